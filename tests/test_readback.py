"""The mirror read back in a rotating sample and healed from the local store
(:mod:`chunkstore.maintenance.readback`): rot in an object every mirrored version
shares (which the replicator, deduplicating, never reads again) is found within the
documented number of steps and replaced with the local store's checked bytes.

Real files, real LMDB, and a mirror on the moto S3 server.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import numpy as np
import pytest

import chunkstore
from chunkstore.maintenance.readback import ReadBack
from chunkstore.objects.kinds import CHUNKS, NODES
from tests.s3server import create_bucket, remove_bucket, s3_endpoint, storage_options

__all__ = ["s3_endpoint"]

CHUNK = 4096


def save(store: chunkstore.Store, step: int) -> str:
    frozen = np.random.default_rng(1).standard_normal(4 * CHUNK // 4).astype(np.float32)
    live = np.random.default_rng(step).standard_normal(2 * CHUNK // 4).astype(np.float32)
    with store.new_version(run="r", step=step) as v:
        v.put("frozen", frozen)
        v.put("live", live)
        v.put_data("trainer", {"step": step})
    return v.info.id


def frozen_object(store: chunkstore.Store, version: str) -> chunkstore.format.digest.Digest:
    """The first stored object of the frozen tensor: every version needs it."""
    entry = store.open_version(version).entry("frozen")
    shard = entry.shards[0]  # type: ignore[union-attr]
    location = shard.location(0)
    return location.pack if location is not None else shard.chunks[0]


def mirror_bytes(mirror: chunkstore.Store) -> int:
    return sum(info.size for kind in (CHUNKS, NODES) for _, info in mirror.objects.infos(kind))


@pytest.mark.parametrize("where", ["local", "s3"])
def test_rot_in_a_shared_mirrored_object_is_found_within_the_bound_and_healed(
        tmp_path: Path, where: str, request: pytest.FixtureRequest,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHUNKSTORE_CACHE_DIR", str(tmp_path / "cache"))
    bucket = None
    if where == "s3":
        endpoint = request.getfixturevalue("s3_endpoint")
        bucket = create_bucket(endpoint)
        mirror_url, options = f"s3://{bucket}/m", storage_options(endpoint)
    else:
        mirror_url, options = str(tmp_path / "mirror"), {}
    try:
        with chunkstore.open(tmp_path / "local", create=True, chunk_size=CHUNK) as local:
            ids = [save(local, step) for step in range(1, 6)]
            assert chunkstore.sync(local, mirror_url, dst_options=options).ok
            with chunkstore.open(mirror_url, storage_options=options) as mirror:
                victim = frozen_object(mirror, ids[0])
                good = mirror.objects.get(CHUNKS, victim)
                rotten = bytearray(good)
                rotten[-3] ^= 0x20
                mirror.objects.put(CHUNKS, victim, bytes(rotten))
                budget = 8 << 10
                bound = 2 * math.ceil(mirror_bytes(mirror) / budget)
                reader = ReadBack(mirror, local, budget, rng=random.Random(7))
                steps, found = 0, []
                while not found:
                    result = reader.step()
                    steps += 1
                    found = [f for f in result.healed if f.digest == victim.hex]
                    assert steps <= bound, f"rot unseen after {steps} steps (bound {bound})"
                    assert result.bytes_read >= budget or result.cycle_done
                assert mirror.objects.get(CHUNKS, victim) == good
                assert mirror.verify().ok
    finally:
        if bucket is not None:
            remove_bucket(request.getfixturevalue("s3_endpoint"), bucket)


def test_a_full_cycle_reads_every_object_once_and_heals_nodes(tmp_path: Path) -> None:
    with chunkstore.open(tmp_path / "local", create=True, chunk_size=CHUNK) as local:
        ids = [save(local, step) for step in range(1, 4)]
        assert chunkstore.sync(local, tmp_path / "mirror").ok
        with chunkstore.open(tmp_path / "mirror") as mirror:
            root = mirror.read_record(ids[1]).root
            mirror.objects.delete(NODES, root)
            stored = {d for kind in (CHUNKS, NODES) for d in mirror.objects.ids(kind)}
            reader = ReadBack(mirror, local, 1)  # one object per step (a missing one: free)
            results = []
            while not results or not results[-1].cycle_done:
                results.append(reader.step())
            assert sum(r.objects_read for r in results) == len(stored) + 1
            # A step reads one object with bytes; the missing one rides along with the
            # next, or takes a step of its own when the cycle ends with it.
            assert len(stored) <= len(results) <= len(stored) + 1
            assert [f.digest for r in results for f in r.healed] == [root.hex]
            assert mirror.verify().ok


def test_rot_the_local_store_cannot_heal_is_reported(tmp_path: Path) -> None:
    with chunkstore.open(tmp_path / "local", create=True, chunk_size=CHUNK) as local:
        ids = [save(local, step) for step in range(1, 3)]
        assert chunkstore.sync(local, tmp_path / "mirror").ok
        victim = frozen_object(local, ids[0])
        local.objects.delete(CHUNKS, victim)
        with chunkstore.open(tmp_path / "mirror") as mirror:
            mirror.objects.delete(CHUNKS, victim)
            reader = ReadBack(mirror, local, 1 << 30)
            result = reader.step()
            assert result.cycle_done and victim.hex in result.damaged
            assert [f.digest for f in result.unhealed] == [victim.hex] and not result.healed
