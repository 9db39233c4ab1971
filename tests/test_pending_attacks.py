"""Attacks on the deferred refcounts (the index's ``pending`` table,
chunkstore/index/lmdbindex.py): every path that lowers a refcount, deletes or rewrites a
record, or reads a refcount, run while references are pending.  Real files, a real
LMDB index; a real subprocess only where a kill is the point.

What must hold throughout: the ``zero`` table lists no object a version references; no
record a version references is deleted; every refcount read is the count a rebuilt
index finds; a loop of refcount reads adds the table up once, not at every commit.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import lmdb
import numpy as np
import pytest

import chunkstore
from chunkstore.format.digest import Digest
from chunkstore.index.lmdbindex import CHUNK, NODE, ChunkState, Index, NewChunk, NewVersion
from chunkstore.index.versiontables import VersionEntry
from chunkstore.maintenance.report import GC_FROM_INDEX, stats
from tests.test_gc import save, state
from tests.test_pending_refs import _assert_zero_exact, _counts, _rebuilt_counts

SHARED = np.random.default_rng(5).standard_normal(40_000).astype(np.float32)
REPO = Path(__file__).resolve().parents[1]


def _saved(store: chunkstore.Store, steps: range) -> list[str]:
    return [save(store, step, state(step, SHARED)) for step in steps]


def _entry(number: int) -> VersionEntry:
    return VersionEntry(f"{number:064x}", "r", number, 0.0, "00", None, 0, 0, 0, {})


def _held(index: Index) -> Counter[tuple[bytes, bytes]]:
    """What the versions the index holds reference (what a rebuild counts)."""
    held: Counter[tuple[bytes, bytes]] = Counter()
    for vid in index.version_ids():
        held.update((CHUNK, d.raw) for d in index.version_refs(vid))
        held.update((NODE, d.raw) for d in index.version_node_refs(vid))
    return held


def _assert_exact(index: Index) -> None:
    """Every record's refcount is what the versions held reference; none is missing."""
    held = _held(index)
    counts = {key: count for key, (_, count) in _counts(index).items() if count}
    assert counts == dict(held)
    _assert_zero_exact(index)


def _referenced(counts: dict[tuple[bytes, bytes], tuple[ChunkState, int]]
                ) -> dict[tuple[bytes, bytes], int]:
    return {key: count for key, (_, count) in counts.items() if count}


DIGESTS = [Digest(bytes([i]) * 32) for i in range(1, 9)]


def _counted(index: Index, number: int, refs: list[Digest], new: bool = False) -> None:
    index.add_version(_entry(number), refs, {}, [NewChunk(d, 1, 8, 8) for d in refs] if new
                      else [])


# --- one index: paths that rewrite or drop records --------------------------------------


def test_objects_found_missing_then_removed_keep_their_counts(tmp_path: Path) -> None:
    """An object found missing (``forget_missing``: WRITING, refcount kept) or named by
    another index's GC journal entry while versions' references to it are pending; then
    the counting version goes, and GC's record steps run: nothing referenced is at
    zero or deleted."""
    index = Index(str(tmp_path / "ix"))
    _counted(index, 1, DIGESTS, new=True)
    _counted(index, 2, DIGESTS[:6])
    _counted(index, 3, DIGESTS[:4])
    assert index.pending_versions() == 2
    index.forget_missing(CHUNK, DIGESTS[0])
    index.apply_journal("entry-1", [(CHUNK, DIGESTS[1]), (CHUNK, DIGESTS[5])])
    _assert_exact(index)
    assert index.remove_version(_entry(1).id)
    _assert_exact(index)
    gone = [d for _, d, _ in index.unreferenced()]
    assert set(gone) == set(DIGESTS[6:])
    assert set(index.condemn(CHUNK, DIGESTS, before=2e9)) == set(DIGESTS[6:])
    started = [d for d, _ in index.start_deletes(CHUNK, DIGESTS, before=2e9)]
    assert set(started) == set(DIGESTS[6:])
    assert index.finish_deletes(CHUNK, DIGESTS) == 2
    _assert_exact(index)
    index.close()


def test_a_version_counted_in_twice_and_batches_among_pending_ones(tmp_path: Path) -> None:
    """A version counted in again (by a save, then by a batch as an open's reconcile
    does) changes nothing; a batch count-in with versions pending folds them in once."""
    index = Index(str(tmp_path / "ix"))
    _counted(index, 1, DIGESTS, new=True)
    _counted(index, 2, DIGESTS[:5])
    _counted(index, 2, DIGESTS[:5])  # again: the index holds it
    assert index.pending_versions() == 1
    again = NewVersion(_entry(2), DIGESTS[:5], {}, [])
    assert index.add_versions([again]) == []
    assert index.pending_versions() == 1  # nothing added: nothing folded
    _assert_exact(index)
    assert index.add_versions([again, NewVersion(_entry(3), DIGESTS[3:], {}, [])]) \
        == [_entry(3).id]
    assert index.pending_versions() == 0
    _assert_exact(index)
    _counted(index, 4, DIGESTS[:2])
    assert index.remove_versions([_entry(2).id, _entry(4).id]) == 2
    _assert_exact(index)
    index.close()


# --- a process of an older release -----------------------------------------------------


def _remove_as_schema_4(index: Index, version_ids: Iterable[str]) -> int:
    """``remove_versions`` of the release of index schema 4 (0c143a3), in a process that
    had the index open before this release brought it to 5 (the schema is checked only
    where an index is opened): the versions counted out and their refcounts lowered,
    the ``pending`` table neither read nor folded."""
    now, dropped = time.time(), Counter[tuple[bytes, bytes]]()
    with index.env.begin(write=True) as txn:
        known = [key for key in map(str.encode, version_ids)
                 if index._count_out(txn, key, dropped)]
        for (kind, raw), n in sorted(dropped.items()):
            index._bump(txn, kind, Digest(raw), -n, now)
    return len(known)


def _references(index: Index, version_id: str) -> set[tuple[bytes, bytes]]:
    return {(CHUNK, d.raw) for d in index.version_refs(version_id)} | \
        {(NODE, d.raw) for d in index.version_node_refs(version_id)}


def test_gc_takes_nothing_pending_versions_reference_after_an_older_release_removed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three saves by this release (the shared tensor's references of two pending); a
    process of schema 4 removes the first, lowering the shared objects to zero as
    stored; this release's ``gc --grace 0`` lists as candidates, and deletes, only what
    the first version alone referenced, and reports no disagreement (break-checked:
    listing the ``zero`` table without the fold makes the shared objects candidates,
    kept by the mark alone)."""
    with chunkstore.open(tmp_path / "s", create=True) as store:
        index = store.index
        ids = _saved(store, range(1, 4))
        assert index.pending_versions() == 2
        only_first = _references(index, ids[0]) - _references(index, ids[1]) \
            - _references(index, ids[2])
        monkeypatch.setattr(Index, "remove_versions", _remove_as_schema_4)
        store.delete(ids[0])
        monkeypatch.undo()
        at_zero = {(kind, digest.raw) for kind, digest, _ in index.unreferenced()}
        assert at_zero > only_first  # as stored: objects pending versions reference too
        result = store.gc(grace=0)
        assert result.candidates == len(only_first) == \
            result.chunks_deleted + result.nodes_deleted
        assert not result.index_disagreements
        assert index.pending_versions() == 0
        _assert_exact(index)
        assert store.verify().ok
        exact = _counts(index)
        assert _rebuilt_counts(store) == exact


def test_report_counts_awaiting_gc_only_what_gc_would_take_after_an_older_release_removed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The case above, read by ``report`` (its figures from the index, which it only
    reads): awaiting GC are the objects the first version alone referenced, not those
    at zero as stored that pending versions reference, and the pending table is left
    as it is; GC then takes exactly what report counted (break-checked: the records of
    the unfolded listing counted as they stand count the shared objects too)."""
    with chunkstore.open(tmp_path / "s", create=True) as store:
        index = store.index
        ids = _saved(store, range(1, 4))
        only_first = _references(index, ids[0]) - _references(index, ids[1]) \
            - _references(index, ids[2])
        monkeypatch.setattr(Index, "remove_versions", _remove_as_schema_4)
        store.delete(ids[0])
        monkeypatch.undo()
        assert {(kind, digest.raw) for kind, digest, _ in index.unreferenced()} > only_first
        sizes = sum(record.stored_length for kind, raw in only_first
                    if (record := index.record(kind, Digest(raw))) is not None)
        report = stats(store, grace_s=0, full=False)
        assert report.gc_source == GC_FROM_INDEX
        assert report.awaiting_gc_objects == report.reclaimable_now_objects == len(only_first)
        assert report.awaiting_gc_bytes == report.reclaimable_now_bytes == sizes
        assert index.pending_versions() == 2  # read, not folded
        result = store.gc(grace=0)
        assert result.chunks_deleted + result.nodes_deleted == len(only_first)
        assert result.bytes_freed == sizes


@pytest.mark.parametrize("step", ["condemn", "start_deletes"])
def test_a_refcount_lowered_without_folding_after_the_listing_is_rechecked_exact(
        tmp_path: Path, step: str) -> None:
    """GC listed X at zero (the table folded); then a save counts X at once, the next
    defers it, and a process of schema 4 removes the first: X is at zero as stored, a
    pending version referencing it.  GC's step that re-checks X (condemn of a LIVE
    record; start_deletes of a WRITING one, X found missing meanwhile) folds first and
    leaves X (break-checked: without the fold in either, that step takes X)."""
    x = DIGESTS[0]
    index = Index(str(tmp_path / "ix"))
    _counted(index, 1, [x], new=True)
    assert index.remove_version(_entry(1).id)
    assert [digest for _, digest, _ in index.unreferenced_folded()] == [x]
    _counted(index, 2, [x])
    _counted(index, 3, [x])
    assert index.pending_versions() == 1
    if step == "start_deletes":
        index.forget_missing(CHUNK, x)  # WRITING, its count kept: start_deletes takes those
    assert _remove_as_schema_4(index, [_entry(2).id]) == 1
    assert [digest for _, digest, _ in index.unreferenced()] == [x]  # as stored
    if step == "condemn":
        assert index.condemn(CHUNK, [x], before=2e9) == []
    else:
        assert index.start_deletes(CHUNK, [x], before=2e9) == []
    record = index.record(CHUNK, x)
    assert record is not None and record.refcount == 1
    assert record.state == (ChunkState.LIVE if step == "condemn" else ChunkState.WRITING)
    assert index.pending_versions() == 0
    _assert_exact(index)
    index.close()


# --- two indexes on one store -----------------------------------------------------------


def test_another_index_prunes_and_collects_while_this_one_holds_pending(
        tmp_path: Path) -> None:
    """Saves through index A (two of three pending), a removal of the parent and
    ``gc --grace 0`` through index B, then ``gc --grace 0`` through A: every kept
    version reads back, and A's counts are those a rebuild finds."""
    path = tmp_path / "s"
    with chunkstore.open(path, create=True) as a:
        ids = _saved(a, range(1, 4))
        assert a.index.pending_versions() == 2
        with chunkstore.open(path, index_dir=str(tmp_path / "b")) as b:
            b.delete(ids[0])
            b.gc(grace=0)
            assert b.verify().ok
        a.gc(grace=0)
        assert a.index.version(ids[0]) is None
        _assert_zero_exact(a.index)
        assert a.verify().ok
        _assert_exact(a.index)
        # (A keeps a WRITING record at zero for each node B deleted, as before the table.)
        exact = _referenced(_counts(a.index))
        assert _referenced(_rebuilt_counts(a)) == exact


# --- a GC killed mid-deletion -----------------------------------------------------------

GC_CHILD = """
import sys, chunkstore
with chunkstore.open(sys.argv[1]) as store:
    store.gc(grace=0)
"""


def test_a_gc_killed_mid_deletion_with_references_pending_resumes(tmp_path: Path) -> None:
    """Steps 1-4 saved (three pending), step 1 removed (the fold) and step 5 saved
    (pending again); a GC process SIGKILLed after its first node deletion; a GC here
    resumes: every kept version reads back, the counts are a rebuild's."""
    path = tmp_path / "s"
    with chunkstore.open(path, create=True) as store:
        ids = _saved(store, range(1, 5))
        store.delete(ids[0])
        _saved(store, range(5, 6))
        assert store.index.pending_versions() == 1
    proc = subprocess.run([sys.executable, "-c", GC_CHILD, str(path)], cwd=REPO,
                          env={**os.environ, "CHUNKSTORE_FAULT": "kill-after-delete:nodes/:0"},
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == -9, proc.stderr
    with chunkstore.open(path) as store:
        _assert_zero_exact(store.index)
        store.gc(grace=0)
        assert store.verify().ok
        exact = _counts(store.index)
        assert _rebuilt_counts(store) == exact


# --- reads ------------------------------------------------------------------------------


def test_refcount_reads_add_the_table_up_once_across_unrelated_commits(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A loop of :meth:`Index.record` reads (GC's candidates, sync's per-node checks,
    report) while this or another process commits what leaves the ``pending`` table as
    it is (a session's heartbeat, a claim): the table is added up once, not after each
    commit (measured: 63 pending versions of 10,000 references, 139 ms a read when each
    one did).  A commit that changes the table is seen at the next read."""
    index = Index(str(tmp_path / "ix"))
    _counted(index, 1, DIGESTS, new=True)
    for number in range(2, 5):
        _counted(index, number, DIGESTS)
    assert index.pending_versions() == 3
    sums: list[int] = []
    real = Index._pending_counts

    def counted(self: Index, txn: lmdb.Transaction) -> Counter[tuple[bytes, bytes]]:
        sums.append(txn.id())
        return real(self, txn)

    monkeypatch.setattr(Index, "_pending_counts", counted)
    session = index.open_session("attack")
    for digest in DIGESTS * 4:
        index.heartbeat(session)
        index.claim_chunk(session, digest)
        record = index.record(CHUNK, digest)
        assert record is not None and record.refcount == 4
    assert len(sums) == 1
    _counted(index, 5, DIGESTS[:1])
    assert index.record(CHUNK, DIGESTS[0]).refcount == 5  # type: ignore[union-attr]
    assert index.record(CHUNK, DIGESTS[1]).refcount == 4  # type: ignore[union-attr]
    assert len(sums) == 2
    index.unreferenced_folded()  # GC's listing folds the table
    assert index.record(CHUNK, DIGESTS[0]).refcount == 5  # type: ignore[union-attr]
    assert [r.refcount for _, r in index.iter_records(CHUNK)] == [5] + [4] * 7
    index.close_session(session)
    index.close()



def test_a_version_counted_out_and_in_again_is_a_new_state_of_the_table(
        tmp_path: Path) -> None:
    """The table holds one entry of the same version before and after (counted out,
    then in again, deferring less): the reads see the second entry, not the first
    one's counts (break-checked: keyed by the version id alone, the read of A counts
    the first entry's deferred reference)."""
    a, b = DIGESTS[:2]
    index = Index(str(tmp_path / "ix"))
    _counted(index, 1, [a, b], new=True)
    _counted(index, 2, [a, b])
    assert index.record(CHUNK, a).refcount == 2  # type: ignore[union-attr]
    index.remove_versions([_entry(2).id, _entry(1).id])
    _counted(index, 3, [b])
    _counted(index, 2, [a, b])  # a at zero: counted at once; b deferred
    assert index.pending_versions() == 1
    assert index.record(CHUNK, a).refcount == 1  # type: ignore[union-attr]
    assert index.record(CHUNK, b).refcount == 2  # type: ignore[union-attr]
    _assert_exact(index)
    index.close()


# --- repack, purge, sync ----------------------------------------------------------------


def test_a_repack_of_a_pack_pending_versions_reference(tmp_path: Path) -> None:
    """Step 1's pack P, mostly garbage once step 1 goes, is repacked and deleted by a
    GC while a save's references to P are pending (step 3's tensors saved again): P's
    record outlives its object (refcount above zero: WRITING), every version reads
    back, and the counts are a rebuild's."""
    from tests import test_repack

    root = tmp_path / "store"
    ids, first = test_repack.three_versions(root)
    with chunkstore.open(root, create=True) as store:
        store.delete(ids[0])
        with store.new_version("again", 1) as version:
            for name, array in test_repack.state(3).items():
                version.put(name, array)
        assert store.index.pending_versions() == 1
        assert store.gc(grace=0).packs_repacked == 1
        assert not test_repack.exists(store, first)
        record = store.index.record(CHUNK, first)
        assert record is not None and record.refcount == 3
        assert record.state == ChunkState.WRITING
        _assert_exact(store.index)
        for vid, step in zip(ids[1:], (2, 3), strict=True):
            test_repack.check(store, vid, step)
        assert store.verify().ok
        exact = _referenced(_counts(store.index))
        assert _referenced(_rebuilt_counts(store)) == exact


def test_a_purge_of_a_pending_version_keeps_what_the_others_reference(
        tmp_path: Path) -> None:
    """Purging step 3 (its shared chunks' references pending): only what step 3 alone
    reached goes; the shared tensor stays, counted as shared."""
    with chunkstore.open(tmp_path / "s", create=True) as store:
        ids = _saved(store, range(1, 4))
        assert store.index.pending_versions() == 2
        result = store.purge(ids[2])
        assert result.objects_deleted > 0 and result.objects_shared > 0
        _assert_exact(store.index)
        assert store.verify().ok


def test_a_sync_into_a_destination_holding_pending_references(tmp_path: Path) -> None:
    """The destination's index defers references (steps 1-3 saved there); a sync
    brings the source's steps 4-5, which share the tensor: the destination's counts
    stay exact, and a removal and ``gc --grace 0`` there keep every kept version."""
    with chunkstore.open(tmp_path / "src", create=True) as src:
        _saved(src, range(4, 6))
    with chunkstore.open(tmp_path / "dst", create=True) as dst:
        ids = _saved(dst, range(1, 4))
        assert dst.index.pending_versions() == 2
        assert chunkstore.sync(tmp_path / "src", dst).copied
        assert dst.index.pending_versions() >= 2
        _assert_exact(dst.index)
        dst.delete(ids[0])
        _assert_zero_exact(dst.index)
        dst.gc(grace=0)
        assert dst.verify().ok
        exact = _counts(dst.index)
        assert _rebuilt_counts(dst) == exact
