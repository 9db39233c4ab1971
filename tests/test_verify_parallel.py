"""``verify`` reads the versions' commit records and manifests in parallel (issue 49:
the first ``verify --quick`` of a new index at 10,000 versions read them one after
another); what it finds must not depend on it.  A store of many versions, some
damaged in each way a version's own objects can be (its commit record, its root
node, its own data node, a data node every version shares), is verified reading
with many jobs at once and with one: each damaged version is named with what is
wrong, every other one is readable, and the two answers are the same, finding for
finding, in the same order."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import chunkstore
from chunkstore.format.manifest import DataEntry, TensorEntry
from chunkstore.handle.tree import flatten
from chunkstore.maintenance.verify import VerifyResult
from chunkstore.objects.kinds import CHUNKS, NODES, VERSIONS
from tests.conftest import SMALL_CHUNK

VERSIONS_SAVED = 40
#: the versions (by step) damaged, and how
RECORD, OWN_PACK, ROOT, OWN_DATA, OWN_CHUNK = 7, 12, 19, 31, 36


@pytest.fixture(scope="module")
def damaged(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """40 versions of run ``r``; step 7's commit record garbled, step 19's root node
    deleted, step 31's own data node garbled, the data node all share garbled, and
    step 36's own chunk object of "big" and step 12's pack holding "w" deleted (each
    verify runs on a copy)."""
    path = tmp_path_factory.mktemp("parallel") / "store"
    ids = []
    with chunkstore.open(path, create=True, chunk_size=SMALL_CHUNK) as store:
        store.pack_delta_chunks = False  # "big"'s deltas as objects of their own
        for step in range(VERSIONS_SAVED):
            with store.new_version(run="r", step=step) as version:
                version.put("w", np.full(16, step, dtype=np.float32))  # packed
                version.put("big", np.full(20_000, step, dtype=np.float32))  # an object
                version.put("frozen", np.arange(16, dtype=np.float32))
                version.put_data("trainer", {"step": step})
                version.put_data("config", {"lr": 0.1})
            ids.append(version.info.id)
        # The saves recorded their versions readable, and a quick verify trusts that
        # (docs/recovery.md): an index that trusts nothing, so both verifies read all.
        store.rebuild_index()
        (path / VERSIONS.key(ids[RECORD])).write_bytes(b"{not a record")
        root = store.read_record(ids[ROOT]).root
        leaves = flatten(store.objects, store.read_record(ids[OWN_DATA]).root,
                         store.node_cache).leaves
        big = flatten(store.objects, store.read_record(ids[OWN_CHUNK]).root,
                      store.node_cache).leaves["big"]
        w = flatten(store.objects, store.read_record(ids[OWN_PACK]).root,
                    store.node_cache).leaves["w"]
    assert isinstance(big, TensorEntry) and isinstance(w, TensorEntry)
    (path / CHUNKS.key(next(big.chunk_digests()))).unlink()
    pack = w.shards[0].location(0)
    assert pack is not None  # a small chunk is packed
    (path / CHUNKS.key(pack.pack)).unlink()
    (path / NODES.key(root)).unlink()
    for name in ("trainer", "config"):
        leaf = leaves[name]
        assert isinstance(leaf, DataEntry)
        (path / NODES.key(leaf.digest)).write_bytes(b"garbled")
    return path, ids


def _verify(path: Path, jobs: int, read_data: bool) -> VerifyResult:
    """A verify of a copy of the store at ``path`` (a verify of the whole store has the
    index remember what it read: the next quick one would trust it)."""
    copy = path.with_name(f"{path.name}-{jobs}-{read_data}")
    shutil.copytree(path, copy)
    with chunkstore.open(copy) as store:
        store.read_jobs = jobs
        return store.verify(read_data=read_data)


def _answer(result: VerifyResult) -> dict[str, Any]:
    answer = result.to_json()
    del answer["seconds"]
    return answer


@pytest.mark.parametrize("read_data", [False, True], ids=["quick", "full"])
def test_damaged_versions_read_in_parallel_are_each_named_as_read_one_by_one(
        damaged: tuple[Path, list[str]], read_data: bool) -> None:
    path, ids = damaged
    parallel = _verify(path, 8, read_data)

    assert not parallel.ok and parallel.versions_checked == VERSIONS_SAVED
    verdicts = {v.id: v for v in parallel.versions}
    assert [verdicts[vid].step for vid in ids] == list(range(VERSIONS_SAVED))
    assert verdicts[ids[RECORD]].damaged and verdicts[ids[RECORD]].entries is None
    assert verdicts[ids[ROOT]].damaged and verdicts[ids[ROOT]].entries is None
    assert sorted(verdicts[ids[OWN_DATA]].damaged_entries) == ["config", "trainer"]
    assert sorted(verdicts[ids[OWN_CHUNK]].damaged_entries) == ["big", "config"]
    for step, vid in enumerate(ids):  # the shared data node breaks every readable tree
        if step not in (RECORD, OWN_PACK, ROOT, OWN_DATA, OWN_CHUNK):
            assert verdicts[vid].damaged_entries == ["config"], step
    found = {(p.version, p.kind, p.tensor, p.object_state) for p in parallel.problems}
    assert (ids[RECORD], "corrupt-record", None, "corrupt") in found
    assert (ids[ROOT], "corrupt-node", None, "missing") in found
    assert (ids[OWN_DATA], "corrupt-node", "trainer", "corrupt") in found
    assert (ids[OWN_CHUNK], "missing-chunk", "big", "missing") in found
    assert {p.object_kind for p in parallel.problems if p.tensor == "big"} == {"chunk"}
    assert "w" in verdicts[ids[OWN_PACK]].damaged_entries
    assert (ids[OWN_PACK], "missing-chunk", "w", "missing") in found

    assert _answer(parallel) == _answer(_verify(path, 1, read_data))


def _census(path: Path, jobs: int) -> dict[str, Any]:
    """``report``'s figures from a copy of the store at ``path``, its census read from
    the manifests (a save records none) with ``jobs`` reads at once."""
    copy = path.with_name(f"{path.name}-census-{jobs}")
    shutil.copytree(path, copy)
    with chunkstore.open(copy) as store:
        store.read_jobs = jobs
        answer = store.stats(full=False).to_json()
    del answer["space_reserve"]  # names the copy's index
    return answer


def test_reports_census_read_in_parallel_is_the_census_read_one_by_one(
        damaged: tuple[Path, list[str]]) -> None:
    parallel = _census(damaged[0], 8)
    assert parallel["totals"]["packed_chunks"] > 0  # what the census counts from manifests
    assert parallel == _census(damaged[0], 1)
