"""Repacking (docs/format.md §3.6): GC copies the live members of a mostly-garbage pack
into a new pack, leaves a moved record, and deletes the old pack; every version keeps
reading through the records.  Real files, real LMDB, real subprocesses killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import chunkstore
from chunkstore.backends.wrappers import FAULT_ENV_VAR
from chunkstore.cli import cli
from chunkstore.errors import (
    CorruptChunkError,
    GcAbortedError,
    InvalidSettingError,
    MissingChunkError,
)
from chunkstore.format.digest import Digest
from chunkstore.format.manifest import PackLocation, TensorEntry
from chunkstore.index.lmdbindex import CHUNK, ChunkState
from chunkstore.objects.kinds import CHUNKS, MOVED
from tests.conftest import tree_snapshot
from tests.s3server import s3_endpoint

# Every test here runs with reads as they come and with every ranged read mapped.
pytestmark = pytest.mark.usefixtures("read_mode")

__all__ = ["s3_endpoint"]  # the session fixture, re-exported so pytest finds it here

REPO = Path(__file__).resolve().parent.parent
#: step -> how many of the ten tensors (the first ones) it changes
CHANGES = {1: 10, 2: 6, 3: 9}
GC_CHILD = """
import sys, chunkstore
with chunkstore.open(sys.argv[1]) as store:
    store.gc(grace=0)
print("finished", flush=True)
"""


def state(step: int) -> dict[str, np.ndarray]:
    """Ten 1 KiB tensors; ``t<i>`` holds the values of the last step that changed it."""
    def last(i: int) -> int:
        return max(s for s, count in CHANGES.items() if s <= step and i < count)
    return {f"t{i}": np.random.default_rng(100 * i + last(i)).standard_normal(256)
            .astype(np.float32) for i in range(10)}


def save(store: chunkstore.Store, step: int) -> str:
    with store.new_version("r", step) as version:
        for name, array in state(step).items():
            version.put(name, array)
    return version.info.id


def check(store: chunkstore.Store, version: str, step: int) -> None:
    reader = store.open_version(version)
    for name, array in state(step).items():
        assert reader.get(name).tobytes() == array.tobytes(), name
    out = {name: np.empty(256, np.float32) for name in state(step)}
    reader.get_many_into([(name, buffer, None) for name, buffer in out.items()])
    for name, array in state(step).items():
        assert out[name].tobytes() == array.tobytes(), name


def packs_of(store: chunkstore.Store, version: str) -> dict[str, PackLocation]:
    found = {}
    for name, leaf in store.open_version(version).entries().items():
        assert isinstance(leaf, TensorEntry)
        location = leaf.shards[0].location(0)
        assert location is not None
        found[name] = location
    return found


def exists(store: chunkstore.Store, pack: Digest) -> bool:
    return store.backend.exists(CHUNKS.key(pack))


def moved(root: Path) -> dict[str, dict[str, object]]:
    folder = root / "moved"
    return {p.name: json.loads(p.read_bytes()) for p in folder.glob("*")} \
        if folder.is_dir() else {}


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "store"


def gc_killed_at(root: Path, fault: str) -> None:
    """Run ``gc(grace=0)`` in a subprocess that SIGKILLs itself at ``fault``."""
    proc = subprocess.run([sys.executable, "-c", GC_CHILD, str(root)],
                          env={**os.environ, FAULT_ENV_VAR: fault}, cwd=REPO,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr


def racing_gc(store: chunkstore.Store, monkeypatch: pytest.MonkeyPatch) -> str:
    """A GC that repacks step 1's pack while a save publishes a version listing one of
    its garbage members (t0 of step 1) between the repack and the second mark: the
    worst moment a concurrent save can pick.  Returns that version's id."""
    import chunkstore.maintenance.gc as gc_module

    real_repack = gc_module.repack
    racing: list[str] = []

    def repack_then_save(*args: object, **kwargs: object) -> object:
        done = real_repack(*args, **kwargs)  # type: ignore[arg-type]
        with store.new_version("racer", 1) as version:
            version.put("t0", state(1)["t0"])
        racing.append(version.info.id)
        return done

    monkeypatch.setattr(gc_module, "repack", repack_then_save)
    result = store.gc(grace=0)
    monkeypatch.undo()
    assert result.packs_repacked == 1 and racing
    return racing[0]


def three_versions(root: Path) -> tuple[list[str], Digest]:
    """Steps 1-3 saved; returns their ids and the pack step 1 wrote."""
    with chunkstore.open(root, chunk_size=64 * 1024, create=True) as store:
        ids = [save(store, step) for step in CHANGES]
        first = packs_of(store, ids[0])["t0"].pack
        assert packs_of(store, ids[1])["t9"].pack == first  # members reused, not rewritten
    return ids, first


def test_a_mostly_garbage_pack_is_repacked_and_every_version_reads_through_its_record(
        root: Path) -> None:
    ids, first = three_versions(root)
    with chunkstore.open(root, create=True) as store:
        store.delete(ids[0])
        # step 1's pack: t6-t9 are still listed (by steps 2 and 3), t0-t5 are garbage
        result = store.gc(grace=0)
        assert result.packs_repacked == 1
        assert result.repack_bytes_copied > 0 and result.repack_bytes_written > 0
        assert not exists(store, first)  # deleted in the same run
        (record,) = moved(root).values()
        assert record["pack"] == first.hex and len(record["members"]) == 4  # type: ignore[arg-type]
        assert exists(store, Digest.parse(record["to"]))  # type: ignore[arg-type]
        for vid, step in zip(ids[1:], (2, 3), strict=True):
            assert packs_of(store, vid)["t9"].pack == first  # manifests never change
            check(store, vid, step)
        assert store.verify().ok and store.verify(read_data=False).ok
        again = store.gc(grace=0)  # nothing more to do; the record stays (versions use it)
        assert again.packs_repacked == 0 and again.moved_records_deleted == 0
        assert again.chunks_deleted == 0 and again.orphans_deleted == 0
        assert len(moved(root)) == 1


def test_a_pack_repacked_twice_is_read_through_two_records_then_all_goes(root: Path) -> None:
    ids, first = three_versions(root)
    with chunkstore.open(root, create=True) as store:
        store.delete(ids[0])
        store.gc(grace=0)
        (record,) = moved(root).values()
        second = Digest.parse(record["to"])  # type: ignore[arg-type]
        store.delete(ids[1])
        # the new pack holds t6-t9 of step 1; only step 3's t9 is left
        result = store.gc(grace=0)
        assert result.packs_repacked == 1 and not exists(store, second)
        assert set(moved(root)) == {first.hex, second.hex}
        check(store, ids[2], 3)
        assert store.verify().ok
    # a fresh process and a rebuilt index follow the records just the same
    with chunkstore.open(root, create=True) as store:
        store.rebuild_index()
        check(store, ids[2], 3)
        assert store.verify().ok
        assert store.gc(grace=0).chunks_deleted == 0
        check(store, ids[2], 3)
        store.delete(ids[2])
        store.gc(grace=0)
        assert moved(root) == {}  # records of packs gone before the run, reached by nothing
        assert not [p for p in (root / "chunks").rglob("*") if p.is_file()]
        assert store.verify().ok


def test_dry_run_says_what_repacking_would_do_and_changes_nothing(root: Path) -> None:
    ids, first = three_versions(root)
    with chunkstore.open(root, create=True) as store:
        store.delete(ids[0])
        store.gc(grace=0, repack_unused=None)  # step 1's own garbage goes; its pack stays
        assert exists(store, first)
        before = tree_snapshot(root / "chunks"), tree_snapshot(root)
        dry = store.gc(grace=0, dry_run=True)
        assert dry.packs_repacked == 1 and dry.repack_bytes_freed > 0
        assert dry.pack_garbage_bytes == dry.repack_bytes_freed - 24  # a header per pack
        assert store.stats().packed_garbage_bytes == dry.pack_garbage_bytes
        assert (tree_snapshot(root / "chunks"), tree_snapshot(root))[0] == before[0]
    runner = CliRunner()
    text = runner.invoke(cli, ["gc", str(root), "--grace", "0", "--dry-run"])
    assert text.exit_code == 0, text.output
    assert "would repack 1 pack at least 50% garbage" in text.output
    as_json = runner.invoke(cli, ["gc", str(root), "--grace", "0", "--dry-run", "--json"])
    assert json.loads(as_json.output)["packs_repacked"] == 1
    assert runner.invoke(cli, ["gc", str(root), "--grace", "0", "--no-repack", "--json"]
                         ).exit_code == 0
    with chunkstore.open(root, create=True) as store:
        assert exists(store, first) and moved(root) == {}
    high = runner.invoke(cli, ["gc", str(root), "--grace", "0", "--repack-unused", "0.9"])
    assert "repacked" not in high.output  # 60% garbage is below 90%
    real = runner.invoke(cli, ["gc", str(root), "--grace", "0", "--json"])
    assert json.loads(real.output)["packs_repacked"] == 1
    with chunkstore.open(root, create=True) as store:
        assert not exists(store, first)
        assert store.stats().packed_garbage_bytes == 0
        for vid, step in zip(ids[1:], (2, 3), strict=True):
            check(store, vid, step)
    bad = runner.invoke(cli, ["gc", str(root), "--repack-unused", "1.5"])
    assert bad.exit_code == 2 and "1.5" in bad.output


def test_a_bad_threshold_is_refused_and_changes_nothing(root: Path) -> None:
    three_versions(root)
    with chunkstore.open(root, create=True) as store:
        before = tree_snapshot(root / "chunks")
        for bad in (0, -1, 2, True, "half"):
            with pytest.raises(InvalidSettingError, match="repack_unused"):
                store.gc(grace=0, repack_unused=bad)  # type: ignore[arg-type]
        assert tree_snapshot(root / "chunks") == before


def test_a_damaged_or_missing_moved_record_is_reported_never_read_as_data(root: Path) -> None:
    ids, first = three_versions(root)
    with chunkstore.open(root, create=True) as store:
        store.delete(ids[0])
        store.gc(grace=0)
    path = root / MOVED.key(first)
    good = path.read_bytes()
    record = json.loads(good)
    # a record that sends a member to the wrong bytes: the hash check catches it
    record["members"][0][2], record["members"][1][2] = (record["members"][1][2],
                                                        record["members"][0][2])
    path.write_bytes(json.dumps(record).encode())
    with chunkstore.open(root, create=True) as store:
        with pytest.raises(CorruptChunkError):
            store.open_version(ids[1]).get("t6")
        problems = store.verify().problems
        assert {p.version for p in problems if p.version} == {ids[1]}  # step 3 reads t9 only
        check(store, ids[2], 3)
    for junk in (b"not json", b"{}", json.dumps({**record, "to": first.hex}).encode(),
                 json.dumps({**record, "members": [[0, 10, 0]]}).encode()):
        path.write_bytes(junk)
        with chunkstore.open(root, create=True) as store:
            with pytest.raises(CorruptChunkError, match="moved record"):
                store.open_version(ids[1]).get("t6")
            before = tree_snapshot(root / "chunks")
            with pytest.raises(GcAbortedError, match="moved record"):
                store.gc(grace=0)  # cannot know where members went: deletes nothing
            assert tree_snapshot(root / "chunks") == before
    path.unlink()
    with chunkstore.open(root, create=True) as store:
        with pytest.raises(MissingChunkError, match=first.hex[:16]):
            store.open_version(ids[2]).get("t9")
        missing = store.verify(read_data=False).problems
        assert {p.version for p in missing if p.version} == set(ids[1:])
    path.write_bytes(good)
    with chunkstore.open(root, create=True) as store:
        assert store.verify().ok


def test_a_save_that_reuses_a_member_the_repack_left_out_keeps_the_old_pack(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The dedup-versus-repack race, at its worst moment: a save publishes a version that
    lists a garbage member of the pack just after GC copied the live members out and
    wrote the moved record, before GC marks again.  The record does not cover that
    member, so the old pack must stay until no version lists it."""
    ids, first = three_versions(root)
    with chunkstore.open(root, create=True) as store:
        store.delete(ids[0])
        store.gc(grace=0, repack_unused=None)  # step 1's nodes go; its pack stays
        racer = racing_gc(store, monkeypatch)
        assert packs_of(store, racer)["t0"].pack == first  # reused the old pack
        assert exists(store, first)  # kept: the racer lists a member the record lacks
        assert store.open_version(racer).get("t0").tobytes() == state(1)["t0"].tobytes()
        for vid, step in zip(ids[1:], (2, 3), strict=True):
            check(store, vid, step)
        assert store.verify().ok
        assert store.gc(grace=0).chunks_deleted == 0  # still listed: still kept
        assert exists(store, first)
        store.delete(racer)
        store.gc(grace=0)  # now every listed member of it is covered by its record
        assert not exists(store, first)
        for vid, step in zip(ids[1:], (2, 3), strict=True):
            check(store, vid, step)
        assert store.verify().ok


@pytest.mark.parametrize("fault", [
    "kill-before-put:chunks/:0", "kill-after-put:chunks/:0",  # the new pack
    "kill-before-put:moved/:0", "kill-after-put:moved/:0",  # the moved record
    "kill-after-put:gc/:0",  # the journal entry naming the old pack
    "kill-before-delete:chunks/:0", "kill-after-delete:chunks/:0",  # the old pack
    "kill-before-put:gc/:1",  # the entry marked done
])
def test_a_repack_killed_at_any_step_leaves_every_version_readable(
        root: Path, fault: str) -> None:
    ids, first = three_versions(root)
    with chunkstore.open(root, create=True) as store:
        store.delete(ids[0])
    gc_killed_at(root, fault)
    with chunkstore.open(root, create=True) as store:
        assert store.verify().ok
        for vid, step in zip(ids[1:], (2, 3), strict=True):
            check(store, vid, step)
        store.gc(grace=0)  # finishes the job
        assert store.verify().ok
        for vid, step in zip(ids[1:], (2, 3), strict=True):
            check(store, vid, step)
        assert not exists(store, first)
        assert len(moved(root)) == 1
        assert not [r for _, r in store.index.iter_chunks() if r.state == ChunkState.DELETING]


@pytest.mark.parametrize("fault", ["kill-before-delete:moved/:0", "kill-after-delete:moved/:0"])
def test_a_gc_killed_while_deleting_moved_records_leaves_a_store_that_verifies(
        root: Path, fault: str) -> None:
    ids, _ = three_versions(root)
    with chunkstore.open(root, create=True) as store:
        store.delete(ids[0])
        store.gc(grace=0)
        store.delete(ids[1])
        store.gc(grace=0)
        store.delete(ids[2])
        assert len(moved(root)) == 2
    gc_killed_at(root, fault)
    with chunkstore.open(root, create=True) as store:
        assert store.verify().ok
        store.gc(grace=0)
        assert moved(root) == {} and store.verify().ok


def test_another_index_gc_keeps_what_versions_reach_through_moved_records(
        root: Path, tmp_path: Path) -> None:
    ids, _ = three_versions(root)
    with chunkstore.open(root, create=True) as store:
        store.delete(ids[0])
        store.gc(grace=0)
    # a second machine's index, built from the store alone
    with chunkstore.open(root, index_dir=str(tmp_path / "other-index"), create=True) as other:
        result = other.gc(grace=0)
        assert result.index_disagreements == []
        assert result.chunks_deleted == result.orphans_deleted == 0
        for vid, step in zip(ids[1:], (2, 3), strict=True):
            check(other, vid, step)
        assert other.verify().ok


def test_gc_of_a_store_without_packs_reads_no_pack_and_writes_no_record(root: Path) -> None:
    # Without delta chains (where the chunks of larger tensors are packed too).
    with chunkstore.open(root, chunk_size=4096, delta_depth=0, create=True) as store:
        with store.new_version("r", 1) as version:
            version.put("big", np.arange(10_000, dtype=np.float32))  # chunks of their own
        result = store.gc(grace=0)
        assert result.live_packs == 0 and result.packs_repacked == 0
        assert not list(store.backend.list(MOVED.prefix))
        assert store.index.record(CHUNK, Digest(b"\0" * 32)) is None


@pytest.mark.s3
def test_an_s3_store_repacks_and_reads_through_moved_records(s3_endpoint: str,
                                                             tmp_path: Path) -> None:
    """On an object store: the new pack and the moved record are objects, the old pack a
    deleted object, and members are read by ranged GET where the record says."""
    from tests.s3server import create_bucket, remove_bucket, storage_options
    bucket = create_bucket(s3_endpoint)
    url = f"s3://{bucket}/store"
    options = storage_options(s3_endpoint)
    try:
        with chunkstore.open(url, index_dir=str(tmp_path / "a"), chunk_size=64 * 1024,
                             storage_options=options, create=True) as store:
            ids = [save(store, step) for step in CHANGES]
            first = packs_of(store, ids[0])["t0"].pack
            store.delete(ids[0])
            assert store.gc(grace=0).packs_repacked == 1
            assert not exists(store, first)
            assert list(store.backend.list(MOVED.prefix)) == [MOVED.key(first)]
            for vid, step in zip(ids[1:], (2, 3), strict=True):
                check(store, vid, step)
            assert store.verify().ok and store.verify(read_data=False).ok
        # another machine's index sees the same store
        with chunkstore.open(url, index_dir=str(tmp_path / "b"),
                             storage_options=options, create=True) as other:
            result = other.gc(grace=0)
            assert result.chunks_deleted == result.orphans_deleted == 0
            for vid, step in zip(ids[1:], (2, 3), strict=True):
                check(other, vid, step)
    finally:
        remove_bucket(s3_endpoint, bucket)


def test_a_repack_starts_a_new_pack_before_one_would_pass_the_largest_pack(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two mostly-garbage packs whose live members together pass the largest pack a
    location may point into (made 1,500 bytes for the repack here) go into two new
    packs, not one whose moved offsets no reader would accept."""
    from chunkstore.maintenance import repack

    limit = 1500
    with chunkstore.open(root, chunk_size=64 * 1024, pack_size=5000, create=True) as store:
        first = save(store, 1)  # ten members of about 940 bytes: packs of six and four
        packs = {at.pack for at in packs_of(store, first).values()}
        assert len(packs) == 2
        kept = ("t0", "t9")  # one live member in each pack
        assert {packs_of(store, first)[name].pack for name in kept} == packs
        with store.new_version("r", 2) as version:
            for name in kept:
                version.put(name, state(1)[name])
        store.delete(first)
        monkeypatch.setattr(repack, "MAX_PACK_BYTES", limit)
        result = store.gc(grace=0)
        assert result.packs_repacked == 2
        records = list(moved(root).values())
        assert {r["pack"] for r in records} == {p.hex for p in packs}
        assert len({r["to"] for r in records}) == 2  # each pack's member in a pack of its own
        for record in records:
            assert all(new + length <= limit  # type: ignore[operator]
                       for _, length, new in record["members"])  # type: ignore[union-attr]
        got = store.open_version(version.info.id)
        for name in kept:
            np.testing.assert_array_equal(got.get(name), state(1)[name])
        assert store.verify().ok
