"""A new index counts the store's versions in a batch at a time (issue 49: one write
transaction and one read at a time each cost 55 s at 10,000 versions): read in
parallel, added in one transaction per batch.  It must give the index that counting
them in one by one gives, with the same checks on the way: an unreadable version is
skipped and reported, a withdrawn one's record deleted, one removed while it is
being counted in counted out again.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import chunkstore
from chunkstore.backends.base import Backend
from chunkstore.backends.wrappers import RequestHook
from chunkstore.index.lmdbindex import ChunkRecord
from chunkstore.maintenance import reconcile
from chunkstore.objects.kinds import VERSIONS
from chunkstore.protocol.runlease import withdraw
from tests.conftest import SMALL_CHUNK

VERSIONS_SAVED = 11


def _saved(saved: Path) -> list[str]:
    """A store (``saved/store``, its index ``saved/index``) of versions with deltas
    (``embed``), packed small tensors and shared chunks."""
    embed = np.random.default_rng(7).standard_normal((1024, 32)).astype(np.float32)
    frozen = np.random.default_rng(0).standard_normal(20_000).astype(np.float32)
    ids = []
    with chunkstore.open(saved / "store", chunk_size=SMALL_CHUNK, delta_depth=2,
                         index_dir=str(saved / "index"), create=True) as store:
        for step in range(1, VERSIONS_SAVED + 1):
            embed[step * 37 % 1024] += np.float32(step)
            with store.new_version("r", step) as version:
                version.put("embed", embed)
                version.put("frozen", frozen)
                version.put("small", np.full(16, step, np.float32))
                version.put_data("lr", 0.1 * step)
            ids.append(version.info.id)
    return ids


class _RemovedWhenChecked(RequestHook):
    """Deletes the commit records of ``victims`` when their existence is first asked
    after they were read: while they are being counted in."""

    def __init__(self, inner: Backend, victims: set[str]) -> None:
        super().__init__(inner)
        self.keys = {f"{VERSIONS.prefix}{vid}" for vid in victims}
        self.read: set[str] = set()
        self.removed: dict[str, bytes] = {}

    def request(self, operation: str, key: str) -> None:
        if operation == "get" and key in self.keys:
            self.read.add(key)
        elif operation == "head" and key in self.read and key not in self.removed:
            self.removed[key] = self.inner.get(key)
            self.inner.delete(key)


def _tables(store: chunkstore.Store) -> dict[str, Any]:
    """What the index holds of the versions it counted in, its times left out."""
    index = store.index
    found: dict[str, Any] = {}
    with index.env.begin() as txn:
        for name in ("versions", "refs", "node_refs", "versions_by_run", "versions_by_time",
                     "packed", "packed_by", "chunks", "nodes", "zero"):
            rows = txn.cursor(db=index.env.open_db(name.encode(), txn=txn))
            found[name] = sorted(
                (bytes(key), _timeless(ChunkRecord.unpack(value)) if name in ("chunks", "nodes")
                 else b"" if name == "zero" else bytes(value)) for key, value in rows)
    found["census"] = index.census(info.id for info in store.versions())
    return found


def _timeless(record: ChunkRecord) -> tuple[object, ...]:
    return (record.state, record.codec_id, record.refcount, record.raw_length,
            record.stored_length)


def _counted_in(saved: Path, run: Path, ids: list[str], batch: int,
                monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A copy of the store and its index, one version made unreadable, one withdrawn and
    one removed while it is counted in, then every version counted in again into the
    emptied index, ``batch`` at a time; its tables."""
    shutil.copytree(saved, run)
    unreadable, withdrawn, removed = ids[2], ids[5], ids[8]
    monkeypatch.setattr(reconcile, "COUNT_BATCH", batch)
    with chunkstore.open(run / "store", create=False, index_dir=str(run / "index")) as store:
        store.backend.put(f"{VERSIONS.prefix}{unreadable}", b"not a commit record")
        withdraw(store.objects, "r", withdrawn)
        hook = _RemovedWhenChecked(store.backend, {removed})
        store.backend = hook
        store.index.clear()  # a new index: every version counted in
        result = reconcile.reconcile(store)
        store.backend = hook.inner
        assert list(hook.removed) == [f"{VERSIONS.prefix}{removed}"]
        assert sorted(result.skipped) == sorted([unreadable, withdrawn, removed])
        assert result.versions == len(ids) - 3
        assert not store.objects.exists(VERSIONS, withdrawn)  # its record deleted
        kept = [vid for vid in ids if vid not in (unreadable, withdrawn, removed)]
        assert store.index.version_ids() == set(kept)  # the removed one counted out
        tables = _tables(store)
        assert set(tables["census"]) == set(kept)
    return tables


def test_counting_in_a_batch_at_a_time_gives_the_index_one_at_a_time_gives(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    saved = tmp_path / "saved"
    ids = _saved(saved)
    one_by_one = _counted_in(saved, tmp_path / "one", ids, 1, monkeypatch)
    batched = _counted_in(saved, tmp_path / "batched", ids, 4, monkeypatch)
    assert batched == one_by_one
    assert len(batched["versions"]) == len(ids) - 3
