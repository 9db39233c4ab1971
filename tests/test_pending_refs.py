"""A save defers raising the refcounts of objects already counted (issue 49): it lists
them in the index's ``pending`` table instead of re-writing each record, and the table
is folded in before any refcount drops and once it holds ``FOLD_AFTER`` versions
(chunkstore/index/lmdbindex.py).  Real files, a real LMDB index.

What must hold: GC never takes an object a pending version references; a removal of a
pending version or of its parent leaves the counts a rebuilt index finds; verify's
refcount check and every refcount read see the exact count; an index of schema 4 is
brought to 5 in place.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import blake3
import lmdb
import numpy as np
import pytest

import chunkstore
from chunkstore.format.digest import Digest
from chunkstore.index import lmdbindex
from chunkstore.index.lmdbindex import CHUNK, INDEX_SCHEMA, KINDS, ChunkRecord, ChunkState, Index
from tests.crash_child import RUN
from tests.test_crash import CHILD, REPO_ROOT
from tests.test_gc import save, state

SHARED = np.random.default_rng(3).standard_normal(40_000).astype(np.float32)


def _saved(store: chunkstore.Store, steps: range) -> list[str]:
    return [save(store, step, state(step, SHARED)) for step in steps]


def _counts(index: Index) -> dict[tuple[bytes, bytes], tuple[ChunkState, int]]:
    """Every record's state and refcount as the index's readers see them."""
    return {(kind, digest.raw): (record.state, record.refcount)
            for kind in KINDS for digest, record in index.iter_records(kind)}


def _raw_counts(index: Index) -> dict[tuple[bytes, bytes], tuple[ChunkState, int]]:
    """Every record as stored, the pending table not added."""
    found = {}
    with index.env.begin() as txn:
        for kind in KINDS:
            for key, value in txn.cursor(db=index._db(kind)):
                record = ChunkRecord.unpack(value)
                found[(kind, bytes(key))] = (record.state, record.refcount)
    return found


def _assert_zero_exact(index: Index) -> None:
    """The ``zero`` table (GC's candidates) lists no object a version still references:
    with references pending, a refcount dropped without folding them first would."""
    counts = _counts(index)
    listed = {(kind, digest.raw) for kind, digest, _ in index.unreferenced()}
    assert not {key for key in listed if counts[key][1] > 0}


def _rebuilt_counts(store: chunkstore.Store) -> dict[tuple[bytes, bytes], tuple[ChunkState, int]]:
    store.rebuild_index()
    assert store.index.pending_versions() == 0
    return _counts(store.index)


def test_a_pending_versions_objects_are_no_gc_candidates(tmp_path: Path) -> None:
    """The shared tensor's chunks are counted by the first save and deferred by the
    next two: nothing they reference is at refcount zero (the ``zero`` table GC takes
    its candidates from), and ``gc --grace 0`` deletes nothing (break-checked:
    deferring every reference, the uncounted ones too, leaves each new chunk in the
    ``zero`` table; GC's mark of the manifests still keeps them)."""
    with chunkstore.open(tmp_path / "s", create=True) as store:
        _saved(store, range(1, 4))
        assert store.index.pending_versions() == 2
        zero = {(kind, digest.raw) for kind, digest, _ in store.index.unreferenced()}
        assert zero == set()
        exact = _counts(store.index)
        assert exact != _raw_counts(store.index)  # some references are pending
        result = store.gc(grace=0)
        assert result.chunks_deleted == result.nodes_deleted == 0
        assert store.verify().ok  # every chunk read back; refcounts exact
        assert _rebuilt_counts(store) == exact


@pytest.mark.parametrize("removed", [(2,), (1,), (1, 2)], ids=["pending", "parent", "both"])
def test_removing_pending_versions_leaves_the_counts_a_rebuild_finds(
        tmp_path: Path, removed: tuple[int, ...]) -> None:
    """Removal folds first (break-checked: without the fold, removing the parent drops
    the shared chunks to zero while the pending versions reference them)."""
    with chunkstore.open(tmp_path / "s", create=True) as store:
        ids = _saved(store, range(1, 4))
        assert store.index.pending_versions() == 2
        store.delete_many([ids[step - 1] for step in removed])
        _assert_zero_exact(store.index)
        assert store.index.pending_versions() == 0  # folded by the removal
        kept = _counts(store.index)
        assert kept == _raw_counts(store.index)
        store.gc(grace=0)
        assert store.verify().ok
        assert _rebuilt_counts(store) == _counts(store.index)


def test_verify_counts_pending_references_and_still_finds_a_wrong_count(
        tmp_path: Path) -> None:
    with chunkstore.open(tmp_path / "s", create=True) as store:
        _saved(store, range(1, 4))
        assert store.index.pending_versions() == 2
        assert not [p for p in store.verify(read_data=False).problems if p.kind == "refcount"]
        digest = next(d for d, r in store.index.iter_chunks() if r.refcount == 3)
        with store.index.env.begin() as txn:  # the stored record, pending not added
            stored = Index._get(txn, store.index.chunks, digest)
        assert stored is not None and stored.refcount == 1
        store.index.put_chunk_record(digest, ChunkRecord(
            stored.state, stored.codec_id, stored.refcount + 1, stored.raw_length,
            stored.stored_length, stored.since))
        assert store.index.chunk(digest).refcount == 4  # type: ignore[union-attr]
        found = [p for p in store.verify(read_data=False).problems if p.kind == "refcount"]
        assert len(found) == 1 and "4" in found[0].message


def test_a_save_folds_the_table_once_it_holds_fold_after_versions(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lmdbindex, "FOLD_AFTER", 3)
    with chunkstore.open(tmp_path / "s", create=True) as store:
        held = []
        for step in range(1, 8):
            _saved(store, range(step, step + 1))
            held.append(store.index.pending_versions())
        assert held == [0, 1, 2, 0, 1, 2, 0]
        assert _counts(store.index) == _raw_counts(store.index)
        exact = _counts(store.index)
        assert _rebuilt_counts(store) == exact


def test_the_table_stays_within_pending_bytes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A version whose deferred references alone pass ``PENDING_BYTES`` defers none;
    a table whose pages pass it is folded by the save that grows it (the counts an
    exact read holds in memory stay bounded; break-checked: without the bytes bound
    the table holds every save)."""
    with chunkstore.open(tmp_path / "s", create=True) as store:
        _saved(store, range(1, 3))
        deferred = store.index.pending_versions()
        assert deferred == 1
        monkeypatch.setattr(lmdbindex, "PENDING_BYTES", 32)  # under one version's
        _saved(store, range(3, 5))
        assert store.index.pending_versions() == 0
        assert _counts(store.index) == _raw_counts(store.index)
        exact = _counts(store.index)
        assert _rebuilt_counts(store) == exact


def test_an_index_of_schema_4_is_brought_to_5_where_it_is_opened(tmp_path: Path) -> None:
    """Schema 4 counted every reference in: ``pending`` starts empty.  A table a release
    of schema 4 left behind (it rebuilt an index of 5, leaving the table it does not
    know) is dropped, not folded in twice."""
    with chunkstore.open(tmp_path / "s", create=True) as store:
        _saved(store, range(1, 4))
        store.index.unreferenced_folded()  # GC's listing folds the table
        exact = _counts(store.index)
        path = store.index.path
    env = lmdb.open(path, max_dbs=32)
    with env.begin(write=True) as txn:
        txn.put(b"schema", b"4", db=env.open_db(b"meta", txn=txn))
        stale = env.open_db(b"pending", txn=txn)
        counted = next(Digest(raw) for kind, raw in exact if kind == CHUNK)
        txn.put(b"f" * 64, lmdbindex._pending_value([counted], []), db=stale)
    env.close()
    with chunkstore.open(tmp_path / "s") as store:
        assert not store.index.needs_rebuild
        with store.index.env.begin(db=store.index.meta) as txn:
            assert int(txn.get(b"schema") or b"0") == INDEX_SCHEMA == 5
        assert store.index.pending_versions() == 0
        assert _counts(store.index) == exact


def test_pending_references_of_a_killed_saver_hold_for_another_process(
        tmp_path: Path) -> None:
    """A saving process SIGKILLed after its third save returned (its count-ins
    committed, their unchanged chunks pending; a fourth save maybe under way): this
    process removes the first version and collects with ``--grace 0``; every other
    version reads back whole and the counts are those a rebuild finds (break-checked:
    with no fold before a removal, the frozen tensor's chunks, still referenced, are
    listed at refcount zero; GC's mark of the manifests keeps them all the same)."""
    path = tmp_path / "s"
    with subprocess.Popen([sys.executable, str(CHILD), str(path), "1"], cwd=REPO_ROOT,
                          stdout=subprocess.PIPE, text=True,
                          env={**os.environ, "CHUNKSTORE_TEST_PACK_DELTAS": "0"}) as child:
        assert child.stdout is not None
        for line in child.stdout:
            if line.startswith("saved 3 "):
                break
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait() == -signal.SIGKILL
    with chunkstore.open(path) as store:
        assert store.index.pending_versions() >= 2
        store.delete(f"{RUN}@1")
        _assert_zero_exact(store.index)
        store.gc(grace=0)
        assert store.verify().ok
        after = {key: count for key, (_, count) in _counts(store.index).items()}
        rebuilt = _rebuilt_counts(store)
        assert {key: after.get(key) for key in rebuilt} == \
            {key: count for key, (_, count) in rebuilt.items()}


@pytest.mark.parametrize("gone", ["journal", "record"])
def test_a_fold_after_the_object_was_forgotten_counts_what_the_manifests_hold(
        tmp_path: Path, gone: str) -> None:
    """Another GC's journal entry applied (or the object found missing) makes a pending
    object's record WRITING, its count kept: the fold raises it, WRITING still.  A record
    gone (nothing deletes one at refcount 1 or more; here by hand) comes back WRITING,
    no dedup target, as a count-in of an unreadable object makes it, counting the
    pending references rather than skipping them: verify reports the count that went
    with the record (``index rebuild`` mends it), not one of the pending versions'."""
    with chunkstore.open(tmp_path / "s", create=True) as store:
        _saved(store, range(1, 4))
        digest = next(d for d, r in store.index.iter_chunks() if r.refcount == 3)
        if gone == "journal":
            store.index.apply_journal(None, [(CHUNK, digest)])
        else:
            with store.index.env.begin(write=True) as txn:
                txn.delete(digest.raw, db=store.index.chunks)
        assert store.index.pending_versions() == 2
        store.index.unreferenced_folded()  # GC's listing folds the table
        assert store.index.pending_versions() == 0
        record = store.index.chunk(digest)
        assert record is not None and record.state == ChunkState.WRITING
        assert record.refcount == (3 if gone == "journal" else 2)
        if gone == "record":  # the first save's count went with the record
            assert [p.kind for p in store.verify(read_data=False).problems] == ["refcount"]
        else:
            assert store.verify(read_data=False).ok


def test_an_index_a_release_of_schema_4_wrote_is_brought_to_5_in_place(
        tmp_path: Path) -> None:
    """tests/data/index-v4 (tools/make_index_fixture.py, built by 0c143a3): its index is
    migrated where the store is opened, not rebuilt (the index keeps its id), its
    counts are those a rebuild finds, and a save then defers as any other."""
    fixture = Path(__file__).parent / "data" / "index-v4"
    expected = json.loads(fixture.with_name("index-v4.expected.json").read_text())
    assert expected["index_schema"] == 4
    for rel, digest in expected["files"].items():  # the fixture is as frozen
        assert blake3.blake3((fixture / rel).read_bytes()).hexdigest() == digest, rel
    shutil.copytree(fixture, tmp_path / "s")
    index = Index(str(tmp_path / "s" / "index"))
    try:  # brought to 5 where it is opened, its tables kept: no rebuild asked for
        assert not index.needs_rebuild
        assert index.pending_versions() == 0
    finally:
        index.close()
    with chunkstore.open(tmp_path / "s") as store:
        assert store.index.identity(create=False) == expected["index_id"]
        with store.index.env.begin(db=store.index.meta) as txn:
            assert txn.get(b"schema") == str(INDEX_SCHEMA).encode() == b"5"
        assert [v.id for v in store.versions(expected["run"])] == expected["versions"]
        assert store.index.pending_versions() == 0
        migrated = _counts(store.index)
        assert any(count == 3 for _, count in migrated.values())  # the shared chunks
        with store.new_version(expected["run"], 4) as version:  # as the fixture's saves
            version.put("shared", np.arange(20_000, dtype=np.float32))
            version.put("w", np.arange(1000, dtype=np.float32) * 4)
        assert store.index.pending_versions() == 1
        assert store.gc(grace=0).chunks_deleted == 0
        assert store.verify().ok
        exact = _counts(store.index)
        assert _rebuilt_counts(store) == exact
