"""``show``, ``report`` and ``export`` of versions saved through DCP by several ranks.

A real save at world size 2 (gloo ranks of :mod:`tests.dcp_child`, row-sharded
DTensors and a replicated tensor) is shown by rank, summed by rank, and
exported to safetensors assembled from its shards; a save by one process
shows as it always did; a version whose boxes do not tile a tensor exports
nothing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner
from safetensors.torch import load_file

import chunkstore
from chunkstore.cli import cli
from chunkstore.errors import CorruptNodeError
from chunkstore.format.manifest import Shard, TensorEntry
from chunkstore.format.shards import RANKS_ENTRY, ShardRanks
from tests.dcp_child import RUN, SHARDED, full_state
from tests.test_dcp import CHUNK, _all_ok, _spawn
from tests.test_hostile import _record, _tensor, _tree
from torch_bridge import export_safetensors
from torch_bridge.dcp import ChunkStoreWriter
from torch_bridge.tools.cli import export

pytestmark = pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled:UserWarning")

TENSORS = {*SHARDED, "bias"}


def _run(*args: str) -> str:
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


@pytest.fixture(scope="module")
def saved_by_two(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Steps 1 and 2 of tests.dcp_child's state, saved by two gloo ranks."""
    tmp = tmp_path_factory.mktemp("two")
    url = str(tmp / "store")
    chunkstore.open(url, chunk_size=CHUNK, create=True).close()
    _all_ok(_spawn("save_twice_then_load", 2, url, tmp / "ranks")[0])
    return url


def test_show_lists_each_shard_with_its_rank(saved_by_two: str) -> None:
    doc = json.loads(_run("show", saved_by_two, f"{RUN}@2", "--json"))
    entries = {e["name"]: e for e in doc["entries"]}
    w = entries["w"]["shards"]
    assert [(s["rank"], s["offsets"], s["sizes"]) for s in w] == [
        (0, [0, 0], [32, 256]), (1, [32, 0], [32, 256])]
    assert all(s["bytes"] == 32 * 256 * 4 for s in w)
    (bias,) = entries["bias"]["shards"]  # replicated: written once, by one rank
    assert bias["rank"] in (0, 1)
    ranks = doc["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    tensors = [e for e in doc["entries"] if e["kind"] == "tensor"]
    assert sum(r["logical_bytes"] for r in ranks) == sum(e["bytes"] for e in tensors)
    assert sum(r["shards"] for r in ranks) == sum(len(e["shards"]) for e in tensors)
    text = _run("show", saved_by_two, f"{RUN}@2")
    assert "rank 0: [0, 0]+[32, 256], rank 1: [32, 0]+[32, 256]" in text
    assert "shards by rank (saved by 2 ranks):" in text


def test_report_sums_each_ranks_bytes(saved_by_two: str) -> None:
    doc = json.loads(_run("report", saved_by_two, "--json"))
    first, second = doc["ranks"]
    assert (first["step"], second["step"], second["world_size"]) == (1, 2, 2)
    with chunkstore.open(saved_by_two, create=True) as store:
        logical = store.resolve(f"{RUN}@1").logical_bytes
    assert 0 < sum(r["logical_bytes"] for r in first["ranks"]) <= logical
    # momentum's 16 zero chunks (8 per rank) are one chunk: new once, for rank 0
    assert sum(r["logical_bytes"] - r["new_bytes"] for r in first["ranks"]) == 15 * CHUNK
    # step 2 changed w's first 16 rows (rank 0's box) and the bytes items (step, lr,
    # name: whichever rank DCP's planner gave them); every other shard deduplicates
    shown = json.loads(_run("show", saved_by_two, f"{RUN}@2", "--json"))["entries"]
    items = sum(e["bytes"] for e in shown if e["name"].startswith("_dcp.bytes."))
    rank0, rank1 = second["ranks"]
    assert 16 * 256 * 4 <= rank0["new_bytes"] <= 16 * 256 * 4 + items
    assert rank1["new_bytes"] <= items
    text = _run("report", saved_by_two)
    assert "by rank (versions saved by several processes):" in text
    assert f"{RUN}@2" in text.split("by rank", 1)[1]


def test_export_assembles_full_tensors_from_the_ranks_shards(saved_by_two: str,
                                                             tmp_path: Path) -> None:
    out = tmp_path / "model.safetensors"
    result = CliRunner().invoke(export, [saved_by_two, f"{RUN}@2", str(out), "--prefix", "",
                                         "--json"])
    assert result.exit_code == 0, result.output
    exported = load_file(out)
    assert set(exported) == TENSORS, "DCP's bytes items are no tensors to export"
    expected = full_state(2)
    for name in TENSORS:
        assert exported[name].dtype == expected[name].dtype
        assert torch.equal(exported[name].view(torch.uint8), expected[name].view(torch.uint8))


def test_a_save_by_one_process_shows_as_before(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    dcp.save(full_state(1), storage_writer=ChunkStoreWriter(url, run="solo", step=1))
    with chunkstore.open(url, create=True) as store:
        assert RANKS_ENTRY not in store.open_version("solo@1").names()
    doc = json.loads(_run("show", url, "solo@1", "--json"))
    assert "ranks" not in doc
    assert all("rank" not in s for e in doc["entries"] for s in e.get("shards", ()))
    text = _run("show", url, "solo@1")
    assert "SHARDS" not in text and "by rank" not in text
    assert json.loads(_run("report", url, "--json"))["ranks"] == []
    assert "by rank" not in _run("report", url)
    exported = tmp_path / "solo.safetensors"
    export_safetensors(url, "solo@1", exported, prefix="")
    assert set(load_file(exported)) == TENSORS


@pytest.mark.parametrize("boxes", [
    [([0], [1024])],  # half of the tensor is in no shard
    [([0], [1024]), ([512], [1024])],  # as many elements as the shape, overlapping
], ids=["gap", "overlap"])
def test_export_of_boxes_that_do_not_tile_the_tensor_writes_nothing(
        tmp_path: Path, boxes: list[tuple[list[int], list[int]]]) -> None:
    path = tmp_path / "store"
    with chunkstore.open(path, chunk_size=CHUNK, create=True) as store:
        with store.new_version(run="good", step=1) as version:
            version.put("w", np.zeros(1024, np.float32))
        (chunk,) = store.open_version("good@1").entry("w").shards[0].chunks  # type: ignore[union-attr]
    shards = [{"offsets": o, "sizes": s, "chunk_bytes": CHUNK, "chunks": [chunk.hex]}
              for o, s in boxes]
    bad = _record(path, _tree(path, {"w": _tensor([2048], [], shards=shards)}))
    out = tmp_path / "bad.safetensors"
    with pytest.raises(CorruptNodeError, match=r"cover|overlap"):
        export_safetensors(path, bad, out, prefix="")
    assert not out.exists() and not list(tmp_path.glob(".export-*"))
    with chunkstore.open(path,
                         create=True) as store:  # the store is unchanged, the good version reads
        assert np.array_equal(store.open_version("good@1").get("w"), np.zeros(1024))


def _entries() -> dict[str, Any]:
    shard = Shard((0,), (4,), 16, ())
    return {"w": TensorEntry("float32", (8,), (shard, shard)), "d": object()}


@pytest.mark.parametrize("value", [
    None, {"format": 2, "world_size": 2, "shards": {}},
    {"format": 1, "world_size": 0, "shards": {}},
    {"format": 1, "world_size": 2, "shards": {"nowhere": [0]}},
    {"format": 1, "world_size": 2, "shards": {"d": [0]}},
    {"format": 1, "world_size": 2, "shards": {"w": [0]}},
    {"format": 1, "world_size": 2, "shards": {"w": [0, 2]}},
    {"format": 1, "world_size": 2, "shards": {"w": [0, True]}},
])
def test_a_malformed_ranks_record_is_refused(value: object) -> None:
    with pytest.raises(ValueError):
        ShardRanks.from_plain(value, _entries())
    good = ShardRanks(2, {"w": (1, 0)})
    assert ShardRanks.from_plain(good.to_plain(), _entries()) == good
