"""Repacking under races, crashes and hostile moved records: the interleavings and
inputs a review of the repacking change found losing data, each now kept safe.

Real files, real LMDB; the only hook is the one tests/test_repack.py uses (a save run
right after GC's repack step, as a concurrent save would)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import chunkstore
from chunkstore.backends.wrappers import RequestHook
from chunkstore.format.digest import Digest
from chunkstore.format.manifest import TensorEntry
from chunkstore.objects.kinds import CHUNKS, MOVED
from chunkstore.read.reader import check_listed_lengths, chunk_reads
from tests.test_repack import (
    check,
    exists,
    gc_killed_at,
    moved,
    packs_of,
    racing_gc,
    state,
    three_versions,
)

# Every test here runs with reads as they come and with every ranged read mapped.
pytestmark = pytest.mark.usefixtures("read_mode")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "store"


def test_an_old_pack_a_save_lists_again_outlives_its_lost_new_pack(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """P repacked into N but kept (a racer lists a member the record lacks).  N is kept
    while P is stored, even when no version lists a moved member; and when N is lost
    anyway, a later save that lists a moved member at P (its index offers P) keeps P:
    a record is never followed to a pack that is missing while the listed one is
    stored."""
    ids, first = three_versions(root)
    with chunkstore.open(root, create=True) as store:
        store.delete(ids[0])
        store.gc(grace=0, repack_unused=None)
        racer = racing_gc(store, monkeypatch)
        assert exists(store, first)
        new = Digest.parse(moved(root)[first.hex]["to"])  # type: ignore[arg-type]
        # every version that lists a moved member goes: N is reached by nothing
        store.delete(ids[1])
        store.delete(ids[2])
        store.gc(grace=0)
        # P kept by the racer; N kept while P is stored (a save may yet list a moved
        # member of P); when N is lost anyway (deleted by hand here), P must stay
        assert exists(store, first) and exists(store, new)
        (root / "chunks" / new.hex[:2] / new.hex).unlink()
        # a save deduplicates t6 of step 1 against P, as the index allows
        with store.new_version("late", 1) as version:
            version.put("t6", state(1)["t6"])
        late = version.info.id
        assert packs_of(store, late)["t6"].pack == first
        assert store.verify().ok  # readable: P is there
        store.delete(racer)
        store.gc(grace=0)
        assert store.verify().ok, [p.message for p in store.verify().problems]
        assert store.open_version(late).get("t6").tobytes() == state(1)["t6"].tobytes()


@pytest.mark.parametrize("target", ["absent", "other pack"])
def test_a_crafted_moved_record_never_makes_gc_delete_a_live_pack(root: Path, target: str) -> None:
    """A parseable moved/<P> for a live pack P that was never repacked, pointing to a
    missing pack or to another pack: GC makes P a candidate, but keeps it (the target
    is missing, or the listed members do not read back there)."""
    ids, first = three_versions(root)
    with chunkstore.open(root, create=True) as store:
        listed = {loc.offset: loc.length for vid in ids
                  for loc in packs_of(store, vid).values() if loc.pack == first}
        other = packs_of(store, ids[2])["t0"].pack
        assert other != first
    to = Digest(b"\x42" * 32).hex if target == "absent" else other.hex
    record = {"format_version": 1, "pack": first.hex, "to": to,
              "members": [[off, length, off] for off, length in sorted(listed.items())]}
    path = root / MOVED.key(first)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(json.dumps(record).encode())
    with chunkstore.open(root, create=True) as store:
        store.gc(grace=0)
        assert exists(store, first), "gc deleted a live pack on the word of a moved record"


@pytest.mark.parametrize("who", ["reader", "gc", "verify"])
def test_a_deeply_nested_moved_record_is_a_typed_error(root: Path, who: str) -> None:
    """A deeply nested moved record (json.loads raises RecursionError) is a corrupt
    chunk for readers and verify, and stops GC with a typed error."""
    from chunkstore.errors import CorruptChunkError, GcAbortedError

    ids, first = three_versions(root)
    with chunkstore.open(root, create=True) as store:
        store.delete(ids[0])
        store.gc(grace=0)
        assert not exists(store, first)
    (root / MOVED.key(first)).write_bytes(b"[" * 200_000 + b"]" * 200_000)
    with chunkstore.open(root, create=True) as store:
        if who == "reader":
            with pytest.raises(CorruptChunkError):
                store.open_version(ids[2]).get("t9")
        elif who == "gc":
            with pytest.raises(GcAbortedError):
                store.gc(grace=0)
        else:
            assert not store.verify().ok


def test_second_gc_on_another_index_between_new_pack_and_moved_record(
        root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """GC A has written the new pack but not yet the moved record when GC B (another
    index, grace 0, sweeping) runs in full: B does not delete A's new pack (an orphan
    to it) nor lose anything; B also repacks the same pack and may win the record."""
    import chunkstore.maintenance.repack as repack_module

    ids, first = three_versions(root)
    with chunkstore.open(root, create=True) as store:
        store.delete(ids[0])
        store.gc(grace=0, repack_unused=None)
    real_write = repack_module.write_moved
    other: list[object] = []

    def b_runs_first(backend, record):  # type: ignore[no-untyped-def]
        if not other:
            other.append(None)  # B's own repack goes through here too
            with chunkstore.open(root, index_dir=str(tmp_path / "b"), create=True) as b:
                other.append(b.gc(grace=0, session_wait=1.0))
        return real_write(backend, record)

    monkeypatch.setattr(repack_module, "write_moved", b_runs_first)
    with chunkstore.open(root, create=True) as store:
        store.gc(grace=0, session_wait=1.0)
    monkeypatch.undo()
    assert other[1].deferred  # B waited for A's repack session, deleted nothing
    with chunkstore.open(root, create=True) as store:
        for vid, step in zip(ids[1:], (2, 3), strict=True):
            check(store, vid, step)
        assert store.verify().ok
        store.gc(grace=0)
        for vid, step in zip(ids[1:], (2, 3), strict=True):
            check(store, vid, step)
        assert store.verify().ok and not exists(store, first)


def test_a_gc_killed_past_its_moved_record_leaves_nothing_to_lose_later(root: Path) -> None:
    """GC SIGKILLed right after writing moved/P (P stays); a save reuses a garbage member
    of P, which keeps P; every version listing a moved member goes (N is kept while P
    is stored); a save lists a moved member at P; the racer goes; P is deleted and the
    late version reads its member through the record."""
    ids, first = three_versions(root)
    with chunkstore.open(root, create=True) as store:
        store.delete(ids[0])
        store.gc(grace=0, repack_unused=None)
    gc_killed_at(root, "kill-after-put:moved/:0")
    with chunkstore.open(root, create=True) as store:
        assert exists(store, first) and first.hex in moved(root)
        new = Digest.parse(moved(root)[first.hex]["to"])  # type: ignore[arg-type]
        with store.new_version("racer", 1) as version:  # t0 of step 1: not in the record
            version.put("t0", state(1)["t0"])
        racer = version.info.id
        assert packs_of(store, racer)["t0"].pack == first
        store.delete(ids[1])
        store.delete(ids[2])
        store.gc(grace=0)
        assert exists(store, first) and exists(store, new)  # N kept while P is stored
        with store.new_version("late", 1) as version:
            version.put("t6", state(1)["t6"])
        late = version.info.id
        assert packs_of(store, late)["t6"].pack == first
        store.delete(racer)
        store.gc(grace=0)
        assert store.open_version(late).get("t6").tobytes() == state(1)["t6"].tobytes()


class CollectBeforeRead(RequestHook):
    """A store where another GC (grace 0) runs in full right before the first read of
    ``key``'s bytes, once armed (``store``): between any earlier request of a reader's
    (a look for the pack) and its read."""

    def __init__(self, inner: Any, key: str) -> None:
        super().__init__(inner)
        self.key = key
        self.store: chunkstore.Store | None = None
        self.result: object = None

    def request(self, operation: str, key: str) -> None:
        if operation != "get" or key != self.key:
            return
        store, self.store = self.store, None
        if store is not None:  # disarmed first: the GC's own reads pass
            self.result = store.gc(grace=0)


def test_a_pack_repacked_under_a_length_check_is_read_where_it_moved(root: Path) -> None:
    """The read's length check (``check_listed_lengths``, what a read runs where there
    is no memory for the buffer) reads each packed chunk's header in its pack.  A GC
    repacks that pack and deletes it right before the header's read: the check reads
    it where the moved record puts it (break-checked: looking for the pack first and
    reading after finds it missing, a MissingChunkError for data still stored)."""
    ids, first = three_versions(root)
    with chunkstore.open(root, create=True) as store:
        store.delete(ids[0])  # P (step 1's pack) mostly garbage, t6-t9 listed by steps 2, 3
        hooked = CollectBeforeRead(store.backend, CHUNKS.key(first))
        store.backend = hooked
        entries = store.open_version(ids[1]).entries()
        reads = [read for leaf in entries.values() if isinstance(leaf, TensorEntry)
                 for read in chunk_reads(leaf, store.chunk_size)]
        assert any(read[4] is not None and read[4].pack == first for read in reads)
        hooked.store = store
        check_listed_lengths(store, reads)
        assert hooked.store is None
        assert getattr(hooked.result, "packs_repacked", None) == 1
        assert not exists(store, first)
        check(store, ids[1], 2)


def test_a_crafted_version_listing_a_wrong_length_hides_no_other_versions_member(
        root: Path) -> None:
    """A crafted version (created=0, so marked first) lists t9's (P, offset) with a
    wrong length: the mark keeps both listings (members are keyed by offset and
    length), so the honest one still reaches the new pack."""
    from tests.test_hostile import _record, _tensor, _tree

    ids, first = three_versions(root)
    with chunkstore.open(root, create=True) as store:
        store.delete(ids[0])
        store.gc(grace=0)  # P -> N (t6-t9 of step 1), P deleted
        assert not exists(store, first)
        store.delete(ids[1])  # now only step 3's t9 reads N
        leaf = store.open_version(ids[2]).entries()["t9"]
        location = leaf.shards[0].location(0)
        digest = leaf.shards[0].chunks[0]
        assert location is not None and location.pack == first
    bad = _tree(root, {"x": _tensor([256], [digest.hex], chunk_bytes=64 * 1024, packs=[
        [first.hex, location.offset, location.length + 1]])})
    _record(root, bad, created=0.0)
    with chunkstore.open(root, create=True) as store:
        store.gc(grace=0, repack_unused=None)
        assert store.open_version(ids[2]).get("t9").tobytes() == state(3)["t9"].tobytes()


def test_a_forwarded_pack_deleted_once_is_not_counted_freed_again(root: Path) -> None:
    """The repacked pack's record stays (WRITING, refcount > 0) after its deletion; when
    its versions go, a later GC does not count its bytes freed a second time."""
    ids, first = three_versions(root)
    with chunkstore.open(root, create=True) as store:
        store.delete(ids[0])
        store.gc(grace=0)
        assert not exists(store, first)
        store.delete(ids[1])
        store.delete(ids[2])
        on_disk = sum(p.stat().st_size for d in ("chunks", "nodes")
                      for p in (root / d).rglob("*") if p.is_file())
        result = store.gc(grace=0)
        assert result.bytes_freed + result.orphan_bytes_freed == on_disk


def test_a_new_pack_is_freed_without_the_orphan_sweep(root: Path) -> None:
    """The repacking GC's index counts the new pack (refcount 0), so GC without the
    orphan sweep (gc --no-sweep) frees it once every version that reached it went."""
    ids, _ = three_versions(root)
    with chunkstore.open(root, create=True) as store:
        store.delete(ids[0])
        store.gc(grace=0, sweep=False)
        for vid in ids[1:]:
            store.delete(vid)
        store.gc(grace=0, sweep=False)
        store.gc(grace=0, sweep=False)
        assert not [p for p in (root / "chunks").rglob("*") if p.is_file()]


@pytest.mark.parametrize("damage", ["crafted record", "damaged copy"])
def test_a_pack_only_moved_records_reach_is_deleted_only_when_its_members_read_back(
        root: Path, damage: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A repack's new pack N is listed by no manifest: versions reach its members through
    the moved record of the pack they were copied from.  Before N is deleted (repacked
    again, or named by a moved record of its own), every member versions reach through
    it must read back where its record puts it: a crafted moved/N, or N's repacked copy
    damaged right after the repack, never costs the data."""
    import chunkstore.maintenance.gc as gc_module

    ids, first = three_versions(root)
    with chunkstore.open(root, create=True) as store:
        store.delete(ids[0])
        store.gc(grace=0)  # step 1's pack -> N
        assert not exists(store, first)
        record = moved(root)[first.hex]
        new = Digest.parse(record["to"])  # type: ignore[arg-type]
        other = packs_of(store, ids[2])["t0"].pack  # step 3's own pack
    if damage == "crafted record":  # moved/N into another stored pack, at N's offsets
        crafted = {"format_version": 1, "pack": new.hex, "to": other.hex,
                   "members": [[at, length, at] for _, length, at in record["members"]]}  # type: ignore[union-attr]
        (root / MOVED.key(new)).write_bytes(json.dumps(crafted).encode())
    else:  # step 2 removed: N is mostly garbage, repacked into N2, damaged at once
        real = gc_module.repack

        def repack_then_damage(*args: object, **kwargs: object) -> object:
            done = real(*args, **kwargs)  # type: ignore[arg-type]
            for old in done.repacked:
                to = json.loads((root / MOVED.key(old)).read_bytes())["to"]
                path = root / CHUNKS.key(Digest.parse(to))
                data = bytearray(path.read_bytes())
                data[-1] ^= 0xFF
                path.write_bytes(bytes(data))
            return done

        monkeypatch.setattr(gc_module, "repack", repack_then_damage)
        with chunkstore.open(root, create=True) as store:
            store.delete(ids[1])
    with chunkstore.open(root, create=True) as store:
        result = store.gc(grace=0)
        assert exists(store, new), "gc deleted a pack whose members do not read back elsewhere"
        assert any(new.short() in note for note in result.repack_skipped)
        if damage == "crafted record":
            (root / MOVED.key(new)).unlink()
            check(store, ids[1], 2)
        check(store, ids[2], 3)


def test_verify_names_a_moved_record_that_cannot_be_parsed(root: Path) -> None:
    """Junk under moved/ for a pack that is still stored: no read goes through it, but
    every GC stops on it; verify names it (it passed before)."""
    from chunkstore.errors import GcAbortedError

    ids, first = three_versions(root)
    path = root / MOVED.key(first)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"{not json")
    with chunkstore.open(root, create=True) as store:
        check(store, ids[2], 3)
        result = store.verify()
        assert not result.ok
        assert [p.kind for p in result.problems] == ["corrupt-moved"]
        assert result.problems[0].digest == first.hex
        store.delete(ids[0])
        with pytest.raises(GcAbortedError):
            store.gc(grace=0)
