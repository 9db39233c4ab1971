"""Tensors stored as several shards by several writers, published by one (no torch here).

The pieces ``torch_bridge.dcp.writer`` builds on: writers that store their chunks
without publishing (``write_unpublished``), plain data that carries each
shard to the publisher (``StagedShard``), the publisher's ``adopt`` (every
chunk claimed, a missing one fails the save), and reads of sharded entries:
whole (assembled from the shards) or one box of one shard.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import chunkstore
from chunkstore.cli import cli
from chunkstore.errors import InvalidInputError, StagedChunkMissingError
from chunkstore.format.manifest import PackLocation, TensorEntry
from chunkstore.format.shards import StagedShard, box_chunk_range
from chunkstore.index.lmdbindex import NewChunk

FULL = np.arange(96 * 64, dtype=np.float32).reshape(96, 64)  # 24 KiB: 6 chunks of 4 KiB


def _stage(store: chunkstore.Store, rows: slice) -> tuple[StagedShard, list[NewChunk]]:
    """What one rank does: store its rows' chunks, publish nothing, describe the shard."""
    writer = store.new_version("sharded", 1)
    writer.put("box", FULL[rows])
    entries, written = writer.write_unpublished()
    (shard,) = entries["box"].shards
    shard = dataclasses.replace(shard, offsets=(rows.start, 0))
    staged = StagedShard("float32", FULL.shape, shard, tuple(
        (c.digest, c.codec_id, c.raw_length, c.stored_length) for c in written))
    return StagedShard.from_plain(staged.to_plain()), written


def _publish(store: chunkstore.Store, staged: list[StagedShard]) -> chunkstore.VersionInfo:
    version = store.new_version("sharded", 1)
    try:
        entry = TensorEntry("float32", FULL.shape, tuple(s.shard for s in staged))
        version.adopt({"w": entry}, [NewChunk(d, c, r, s) for x in staged
                                     for d, c, r, s in x.written])
    except BaseException:
        version.abort()
        raise
    return version.commit()


@pytest.fixture
def small_store(tmp_path: Path) -> chunkstore.Store:
    return chunkstore.open(tmp_path / "store", chunk_size=4096, compression="none", create=True)


def test_shards_of_several_writers_publish_as_one_tensor(small_store: chunkstore.Store) -> None:
    with small_store as store:
        staged = [_stage(store, slice(0, 32))[0], _stage(store, slice(32, 96))[0]]
        info = _publish(store, staged)
        assert info.new_bytes == FULL.nbytes
        reader = store.open_version("sharded@1")
        assert np.array_equal(reader.get("w"), FULL)
        box = np.empty((4, 10), np.float32)
        reader.get_box("w", 1, (5, 3), (4, 10), box)  # rows 37..40 of the tensor
        assert np.array_equal(box, FULL[37:41, 3:13])
        strided = np.zeros((64, 64), np.float32)[:, ::2]
        with pytest.raises(InvalidInputError, match="does not lie inside"):
            reader.get_box("w", 0, (30, 0), (4, 64), np.empty((4, 64), np.float32))
        reader.get_box("w", 1, (0, 0), (64, 32), strided)
        assert np.array_equal(strided, FULL[32:, :32])
        result = store.verify()
        assert result.ok, result.problems


def test_many_boxes_read_at_once_stage_a_bounded_amount(
        small_store: chunkstore.Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """get_boxes: every request checked before anything is read; boxes read in place
    and staged ones (bounded by STAGING_BYTES a round; here one box a round) alike
    come back as get_box gives them."""
    from chunkstore.read import reader as read_module

    with small_store as store:
        staged = [_stage(store, slice(0, 32))[0], _stage(store, slice(32, 96))[0]]
        _publish(store, staged)
        reader = store.open_version("sharded@1")
        monkeypatch.setattr(read_module, "STAGING_BYTES", 1)
        whole, box = np.zeros((64, 64), np.float32), np.empty((4, 10), np.float32)
        strided = np.zeros((32, 64), np.float32)[:, ::2]
        with pytest.raises(InvalidInputError, match="does not lie inside"):
            reader.get_boxes([("w", 1, (0, 0), (64, 64), whole),
                              ("w", 0, (30, 0), (4, 10), np.empty((4, 10), np.float32))])
        assert not whole.any(), "nothing is read before every request is checked"
        reader.get_boxes([("w", 1, (5, 3), (4, 10), box), ("w", 1, (0, 0), (64, 64), whole),
                          ("w", 0, (0, 0), (32, 32), strided)])
        assert np.array_equal(box, FULL[37:41, 3:13])
        assert np.array_equal(whole, FULL[32:])
        assert np.array_equal(strided, FULL[:32, :32])


def test_a_box_reads_only_the_chunks_that_hold_it(small_store: chunkstore.Store) -> None:
    with small_store as store:
        staged, _ = _stage(store, slice(0, 96))
    shard = staged.shard  # 6 chunks of 16 rows each
    assert box_chunk_range(shard, 4, (20, 0), (10, 64)) == range(1, 2)
    assert box_chunk_range(shard, 4, (15, 63), (2, 1)) == range(0, 2)
    assert box_chunk_range(shard, 4, (0, 0), (0, 64)) == range(0)


def test_a_chunk_missing_when_adopted_publishes_nothing(small_store: chunkstore.Store,
                                                       tmp_path: Path) -> None:
    with small_store as store:
        staged, written = _stage(store, slice(0, 96))
        lost = written[2].digest
        (tmp_path / "store" / "chunks" / lost.hex[:2] / lost.hex).unlink()
        with pytest.raises(StagedChunkMissingError, match="nothing was published") as raised:
            _publish(store, [staged])
        assert raised.value.digest == lost.hex and raised.value.missing == 1
        assert store.versions() == []
        assert not list(store.backend.list("sessions/"))


def test_shards_that_do_not_tile_the_tensor_are_refused(small_store: chunkstore.Store) -> None:
    with small_store as store:
        staged, _ = _stage(store, slice(0, 32))
        with pytest.raises(InvalidInputError, match="cover"):
            _publish(store, [staged])
        assert store.versions() == []


@pytest.mark.parametrize("bad", [
    None, {"dtype": "float32"}, {"dtype": "float32", "shape": [4], "written": [],
                                 "shard": {"chunks": ["zz"]}},
    {"dtype": "float32", "shape": [4], "written": [["00" * 32, 0, -1, 0]],
     "shard": {"offsets": [0], "sizes": [4], "chunk_bytes": 16, "chunks": ["00" * 32]}},
    {"dtype": "float32", "shape": [2], "written": [],
     "shard": {"offsets": [0], "sizes": [4], "chunk_bytes": 16, "chunks": ["00" * 32]}},
])
def test_a_malformed_staged_shard_is_refused(bad: object) -> None:
    with pytest.raises(InvalidInputError):
        StagedShard.from_plain(bad)


def test_show_lists_each_shard_box(small_store: chunkstore.Store, tmp_path: Path) -> None:
    with small_store as store:
        _publish(store, [_stage(store, slice(0, 32))[0], _stage(store, slice(32, 96))[0]])
    shown = CliRunner().invoke(cli, ["show", str(tmp_path / "store"), "sharded@1", "--json"],
                               catch_exceptions=False)
    (entry,) = json.loads(shown.output)["entries"]
    assert entry["shards"] == [
        {"offsets": [0, 0], "sizes": [32, 64], "chunks": 2, "bytes": 32 * 64 * 4},
        {"offsets": [32, 0], "sizes": [64, 64], "chunks": 4, "bytes": 64 * 64 * 4}]
    text = CliRunner().invoke(cli, ["show", str(tmp_path / "store"), "sharded@1"]).output
    assert "[0, 0]+[32, 64] [32, 0]+[64, 64]" in text
    report = CliRunner().invoke(cli, ["report", str(tmp_path / "store"), "--json"])
    assert report.exit_code == 0, report.output


def test_adopted_shards_with_malformed_pack_locations_are_refused(
        small_store: chunkstore.Store) -> None:
    """adopt() checks a shard as a reader decodes it: a pack location list that does not
    match the chunks is refused before anything is published."""
    with small_store as store:
        staged, _ = _stage(store, slice(0, 96))
        shard = staged.shard
        location = PackLocation(shard.chunks[0], 0, 4096 + 24)
        broken = dataclasses.replace(shard, packs=(location,))  # one location for 6 chunks
        with pytest.raises(InvalidInputError, match="pack"):
            _publish(store, [dataclasses.replace(staged, shard=broken)])
        assert store.versions() == []
