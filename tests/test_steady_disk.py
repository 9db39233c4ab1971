"""A job with ``keep_last`` holds bounded bytes on disk at steady state (issue 47).

The collection that follows retention keeps chunks and nodes at what the kept
versions need; what else the store holds must not grow with the number of saves
either: the index's ``packed`` table (a dedup cache of where small chunks lie)
forgets the locations inside a pack in the transaction that forgets the pack, and
the GC journal does not keep one entry per collection (docs/format.md §11.2).

Real files, real LMDB, real training steps.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import lmdb
import numpy as np
import pytest
import torch

import chunkstore
from chunkstore.format.digest import Digest
from chunkstore.format.manifest import PackLocation
from chunkstore.index.lmdbindex import CHUNK, INDEX_SCHEMA, ChunkState, Index, VersionEntry
from chunkstore.objects.kinds import CHUNKS, JOURNAL
from chunkstore.protocol.journal import (
    DONE,
    HORIZON_PREFIX,
    finish_entry,
    marker_applied_by,
    start_entry,
    sync_journal,
)
from torch_bridge import Checkpointer


def small_tensors(seed: int, count: int = 12) -> dict[str, np.ndarray]:
    """Tensors small enough to be packed, distinct for each seed."""
    rng = np.random.default_rng(seed)
    return {f"t{i}": rng.standard_normal(300).astype(np.float32) for i in range(count)}


def save(store: chunkstore.Store, step: int, seed: int) -> str:
    with store.new_version(run="r", step=step) as version:
        for name, array in small_tensors(seed).items():
            version.put(name, array)
    return version.info.id


def stored_packs(store: chunkstore.Store) -> set[bytes]:
    return {digest.raw for digest, _ in store.objects.infos(CHUNKS)}


def packed_packs(index: Index) -> set[bytes]:
    """The packs the index's ``packed`` table names."""
    with index.env.begin(db=index.packed) as txn:
        return {bytes(value)[:32] for _, value in txn.cursor()}


def test_gc_forgets_the_locations_inside_the_packs_it_deletes(tmp_path: Path) -> None:
    with chunkstore.open(tmp_path / "s", create=True) as store:
        old = save(store, 1, seed=1)
        save(store, 2, seed=2)
        assert store.index.packed_count() == (24, 24)
        store.delete(old)
        result = store.gc(grace=0)
        assert result.chunks_deleted >= 1
        assert store.index.packed_count() == (12, 12)
        assert packed_packs(store.index) <= stored_packs(store)


def test_an_index_that_applies_a_journal_entry_forgets_the_deleted_packs_locations(
        tmp_path: Path) -> None:
    path = tmp_path / "s"
    with chunkstore.open(path, index_dir=str(tmp_path / "a"), create=True) as a:
        old = save(a, 1, seed=1)
        save(a, 2, seed=2)
    with chunkstore.open(path, index_dir=str(tmp_path / "b")) as b:  # counts both in
        assert b.index.packed_count() == (24, 24)
        with chunkstore.open(path, index_dir=str(tmp_path / "a")) as a:
            a.delete(old)
            assert a.gc(grace=0).chunks_deleted >= 1
        sync_journal(b.objects, b.index)
        assert b.index.packed_count() == (12, 12)
        assert packed_packs(b.index) <= stored_packs(b)


def test_a_pack_found_missing_takes_its_locations_with_it(tmp_path: Path) -> None:
    with chunkstore.open(tmp_path / "s", create=True) as store:
        save(store, 1, seed=1)
        (pack,) = {store.index.pack_location(d).pack  # type: ignore[union-attr]
                   for d in _members(store.index)}
        store.index.forget_missing(CHUNK, pack)
        assert store.index.packed_count() == (0, 0)


def test_a_member_packed_again_elsewhere_keeps_its_newer_location(tmp_path: Path) -> None:
    """The reverse table follows the location ``packed`` holds: forgetting the older
    pack leaves a member's newer location alone, and forgetting the newer one leaves
    nothing behind."""
    member, older, newer = (Digest(bytes([n]) * 32) for n in (1, 2, 3))
    index = Index(str(tmp_path / "index"))
    try:
        for number, pack in enumerate((older, newer)):
            entry = VersionEntry(f"v{number}", "r", number, 0.0, "00", None, 0, 0, 0, {})
            index.add_version(entry, [pack], {}, [], packed={member: PackLocation(pack, 8, 4)})
        assert index.packed_count() == (1, 1)
        index.forget_missing(CHUNK, older)
        assert index.pack_location(member) == PackLocation(newer, 8, 4)
        index.forget_missing(CHUNK, newer)
        assert index.pack_location(member) is None
        assert index.packed_count() == (0, 0)
    finally:
        index.close()


def test_what_saves_record_of_their_versions_stays_in_leaf_pages(tmp_path: Path) -> None:
    """Each save records its version's census and that it is readable (for the first
    ``report`` and ``verify --quick``); a value on LMDB's overflow pages (a run of
    pages, whose freed runs a later write seldom fits) kept a keep_last job's index
    growing, so neither table has one (the census of 12 packed tensors is 0.3 kB)."""
    with chunkstore.open(tmp_path / "s", create=True) as store:
        ids = [save(store, step, seed=step) for step in range(1, 4)]
        assert store.index.census(ids).keys() == set(ids)
        assert store.index.verified_versions(ids).keys() == set(ids)
        with store.index.env.begin() as txn:
            for db in (store.index.census_db, store.index.verified):
                assert txn.stat(db)["overflow_pages"] == 0


def test_a_long_payload_is_laid_over_pieces_and_removed_with_its_version(
        tmp_path: Path) -> None:
    """A census longer than a leaf page holds (a version of many packed chunks) is laid
    over leaf-sized entries, read back whole, trusted only whole, and deleted with its
    version, every piece."""
    index = Index(str(tmp_path / "index"))
    try:
        entry = VersionEntry("a" * 64, "r", 1, 0.0, "00", None, 0, 0, 0, {})
        payload = bytes(range(256)) * 20  # 5,120 bytes: three pieces
        index.add_version(entry, [], {}, [], census=payload, built_entries=2)
        assert index.census([entry.id]) == {entry.id: payload}
        with index.env.begin() as txn:
            keys = [bytes(k) for k, _ in txn.cursor(db=index.census_db)]
            assert txn.stat(index.census_db)["overflow_pages"] == 0
        assert len(keys) == 4
        with index.env.begin(write=True) as txn:
            txn.delete(keys[2], db=index.census_db)
        assert index.census([entry.id]) == {}  # a piece lost: nothing trusted
        index.note_census([(entry.id, payload)])
        assert index.census([entry.id]) == {entry.id: payload}
        index.note_census([(entry.id, b"short")])  # the pieces go with the long form
        assert index.census([entry.id]) == {entry.id: b"short"}
        index.note_census([(entry.id, payload)])
        assert index.remove_version(entry.id)
        with index.env.begin() as txn:
            assert txn.stat(index.census_db)["entries"] == 0
            assert txn.stat(index.verified)["entries"] == 0
    finally:
        index.close()


def test_an_index_of_schema_2_gets_its_reverse_table_where_it_is_opened(
        tmp_path: Path) -> None:
    """Schema 3 adds ``packed_by``, derived from ``packed``: a schema-2 index (or one a
    release of schema 2 wrote after a downgrade, with a stale reverse table) is brought
    to the current schema in place, without a rebuild (tests/test_version_lookups.py
    checks the tables schema 4 adds)."""
    with chunkstore.open(tmp_path / "s", create=True) as store:
        save(store, 1, seed=1)
        index_path = store.index.path
    env = lmdb.open(index_path, max_dbs=32)
    with env.begin(write=True) as txn:
        txn.put(b"schema", b"2", db=env.open_db(b"meta", txn=txn))
        by = env.open_db(b"packed_by", txn=txn)
        txn.drop(by, delete=False)
        txn.put(b"\x01" * 64, b"", db=by)  # stale: a pack no entry of ``packed`` names
    env.close()
    index = Index(index_path)
    try:
        assert not index.needs_rebuild
        assert index.packed_count() == (12, 12)
        with index.env.begin(db=index.meta) as txn:
            assert int(txn.get(b"schema")) == INDEX_SCHEMA == 5
    finally:
        index.close()


def _members(index: Index) -> list[Digest]:
    with index.env.begin(db=index.packed) as txn:
        return [Digest(bytes(k)) for k, _ in txn.cursor()]


def tree_bytes(path: Path, *, audit: bool = True) -> int:
    """Every file under ``path``, as ``du`` counts it (allocated blocks); without the
    audit trail (``audit/``, which grows until ``audit --prune-before``) where ``audit``
    is false."""
    return sum(os.lstat(os.path.join(root, name)).st_blocks * 512
               for root, _, names in os.walk(path) for name in names
               if audit or Path(root, name).relative_to(path).parts[0] != "audit")


# --- the GC journal ------------------------------------------------------------------------


def journal_keys(store: chunkstore.Store) -> list[str]:
    return sorted(store.backend.list(JOURNAL.prefix))


def test_a_finished_entry_that_names_nothing_is_deleted_at_once(tmp_path: Path) -> None:
    with chunkstore.open(tmp_path / "s", create=True) as store:
        store.upgrade_format()
        entry = start_entry(store.objects, [])
        assert journal_keys(store) == [JOURNAL.key(entry.id)]
        entry.state = DONE
        finish_entry(store.objects, entry, store.index)
        assert journal_keys(store) == []
        assert entry.id not in store.index.journal_applied()


def rounds(store: chunkstore.Store, first: int, count: int) -> None:
    """``count`` saves, each followed by the removal of the one before and a GC."""
    for step in range(first, first + count):
        save(store, step, seed=step)
        previous = [v for v in store.versions("r") if v.step < step]
        for version in previous:
            store.delete(version.id)
        store.gc(grace=0)


def test_collections_on_a_local_store_keep_one_entry_and_their_index_trusts_itself(
        tmp_path: Path) -> None:
    """Each GC prunes what the one before it left (its own index applied it), behind a
    marker that names that index: the journal holds the newest run's entry and one
    marker, and the index that pruned never forgets what it holds."""
    with chunkstore.open(tmp_path / "s", create=True) as store:
        rounds(store, 1, 8)
        keys = journal_keys(store)
        assert len(keys) == 2 and sum(HORIZON_PREFIX in k for k in keys) == 1, keys
        marker = next(k for k in keys if HORIZON_PREFIX in k)
        named = marker_applied_by(store.objects, marker[len(JOURNAL.prefix):])
        assert named == {store.index.identity()}
        (latest,) = store.versions("r")
        live = store.index.version_refs(latest.id)
        assert live and all(store.index.record(CHUNK, d).state == ChunkState.LIVE  # type: ignore[union-attr]
                            for d in live)
        assert len(store.index.journal_applied()) <= 1
        assert store.index.packed_count() == (12, 12)


def test_an_index_away_while_many_gcs_ran_never_dedups_against_what_they_deleted(
        tmp_path: Path) -> None:
    """Index A saw version 1; index B then ran 8 rounds of save, remove, GC, pruning the
    journal behind markers that name B only.  When A comes back its sync finds a marker
    that does not name it: every record stops being a dedup target (its packs'
    locations go too), and saving version 1's bytes again writes them, whole."""
    path = tmp_path / "s"
    with chunkstore.open(path, index_dir=str(tmp_path / "a"), create=True) as a:
        first = save(a, 1, seed=1)
        held = a.index.version_refs(first)
    with chunkstore.open(path, index_dir=str(tmp_path / "b")) as b:
        rounds(b, 2, 8)
        assert all(not b.objects.exists(CHUNKS, d) for d in held)  # version 1's packs
        assert not [k for k in journal_keys(b) if HORIZON_PREFIX not in k
                    and any(d.hex in b.backend.get(k).decode() for d in held)]
    with chunkstore.open(path, index_dir=str(tmp_path / "a")) as a:
        assert all(a.index.record(CHUNK, d).state == ChunkState.WRITING  # type: ignore[union-attr]
                   for d in held)
        assert not (packed_packs(a.index) & {d.raw for d in held})
        again = save(a, 20, seed=1)
        reader = a.open_version(again)
        for name, array in small_tensors(1).items():
            np.testing.assert_array_equal(reader.get(name), array)
        assert a.verify().ok


def test_on_a_remote_store_finished_entries_stay_for_the_week(tmp_path: Path) -> None:
    """Other machines' indexes read a remote store's journal: no early pruning there."""
    url = f"memory://steady-{uuid.uuid4().hex}"
    with chunkstore.open(url, index_dir=str(tmp_path / "i"), create=True) as store:
        rounds(store, 1, 4)
        entries = [k for k in journal_keys(store) if HORIZON_PREFIX not in k]
        assert len(entries) == 3  # every run but the first deleted something


# --- a training job ------------------------------------------------------------------------


@pytest.mark.slow_job  # 20 s of CPU: ./dev test-slow (CI runs both)
def test_a_keep_last_job_holds_bounded_bytes_on_disk_over_300_saves(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """300 saves of a small MLP with AdamW (every tensor changes, every one packed),
    keep_last=3 with its background collection: after the first 100 saves the whole
    store directory (objects, journal, the LMDB index and its space reserve, which
    follows the index) stays within 64 KiB of its size then, and the index's file
    stops growing (LMDB reuses the pages freed).  Before the packed table forgot
    deleted packs and the journal was pruned it grew by about 10 kB per save.  The
    audit trail is apart: it keeps every save's events (the publish, the retention's
    removal and the collection's run) until ``audit --prune-before``, after which the
    store is back within the bound."""
    monkeypatch.delenv("CHUNKSTORE_SPACE_RESERVE", raising=False)  # the reserve follows
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(4):
        layers += [torch.nn.Linear(32, 32), torch.nn.LayerNorm(32)]
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    path = tmp_path / "s"
    sizes: dict[int, tuple[int, int]] = {}
    with Checkpointer(path, run="r", keep_last=3, async_save=False) as ckpt:
        for step in range(1, 301):
            model(torch.randn(4, 32)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            ckpt.save(step, model=model, optimizer=opt)
            collector = ckpt._collector
            assert collector is None or collector.wait_idle(60)
            sizes[step] = (tree_bytes(path, audit=False),
                           os.path.getsize(path / "index" / "data.mdb"))
    warm, index_warm = sizes[100]
    grown = {step: size - warm for step, (size, _) in sizes.items() if step > 100}
    worst = max(grown, key=grown.__getitem__)
    assert grown[worst] <= 64 << 10, f"save {worst}: {grown[worst]} bytes past save 100's"
    assert sizes[300][1] <= index_warm + (16 << 10), (index_warm, sizes[300][1])
    with chunkstore.open(path) as store:
        assert [v.step for v in store.versions("r")] == [298, 299, 300]
        assert len(journal_keys(store)) <= 2
        assert store.verify().ok
        events = len(list(store.audit()))
        assert 300 <= events <= 5 * 300, events  # a publish each, then removals and GCs
        store.prune_audit(time.time())
    assert tree_bytes(path) - warm <= 64 << 10, tree_bytes(path) - warm
