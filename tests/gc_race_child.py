"""A process in the GC race test: ``python tests/gc_race_child.py STORE ROLE SECONDS [WRITER]``.

ROLE ``save``: save versions of run ``w<WRITER>`` in a loop, each built from
blocks of a small shared pool (so saves deduplicate against chunks other
saves and deletions keep making unreferenced), and unpublish all but the
newest two of its own versions.  ROLE ``gc``: run ``gc(grace=0)`` in a loop.
Both stop after SECONDS and print what they did.  With ``RACE_DELTAS=1`` in
the environment the store writes deltas: half the blocks change every
save (small deltas against the previous version's), half are a few shared
blocks that GC keeps deleting and saves keep deduplicating against.  With
``RACE_PACKS=1`` each version also holds small tensors, stored in packs: a few
drawn from a small shared pool (members of older packs that saves reuse while
GC keeps deleting the packs no kept version needs, or repacking those that are
mostly garbage) and one of its own.  With ``RACE_PACK_DELTAS=1`` too, the saves
pack the delta chunks and their bases (chunk format 5): every save then reuses
bases inside packs that GC keeps deleting or repacking.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

import chunkstore
from chunkstore.errors import GcBusyError

CHUNK = 64 * 1024
DELTAS = os.environ.get("RACE_DELTAS") == "1"
PACKS = os.environ.get("RACE_PACKS") == "1"
PACK_DELTAS = os.environ.get("RACE_PACK_DELTAS") == "1"
SMALL_POOL = 8
SMALL = 4096  # bytes of a small tensor (packed)
POOL = 10
DELTA_POOL = 3
TWEAKS = 3  # values of a block's first element with deltas on
BLOCKS = 6


def block(i: int, deltas: bool) -> np.ndarray:
    if deltas:  # pool block i mod DELTA_POOL with its first element set to the rest
        data = np.random.default_rng(i % DELTA_POOL).integers(0, 2**31, CHUNK // 4,
                                                              dtype=np.int32)
        data[0] = i // DELTA_POOL
        return data
    return np.random.default_rng(i).integers(0, 2**31, CHUNK // 4, dtype=np.int32)


def version_blocks(writer: int, step: int, deltas: bool) -> list[int]:
    rng = np.random.default_rng(writer * 1_000_003 + step)
    if not deltas:
        return [int(i) for i in rng.integers(0, POOL, BLOCKS)]
    # Half the positions change every save (a delta against the previous version's
    # block there), half hold one of a few shared blocks (dedup hits on blocks GC
    # keeps deleting); position j always holds pool block j mod DELTA_POOL.
    unique = DELTA_POOL * (TWEAKS + writer * 1_000_003 + step)
    return [j % DELTA_POOL + (unique if j < BLOCKS // 2 else DELTA_POOL * int(t))
            for j, t in enumerate(rng.integers(0, TWEAKS, BLOCKS))]


def expected(writer: int, step: int, deltas: bool = DELTAS) -> np.ndarray:
    return np.concatenate([block(i, deltas) for i in version_blocks(writer, step, deltas)])


def small_state(writer: int, step: int) -> dict[str, np.ndarray]:
    """Small tensors of a version (RACE_PACKS): three pool blocks and one of its own."""
    picks = np.random.default_rng(writer * 7_000_001 + step).integers(0, SMALL_POOL, 3)
    own = SMALL_POOL + writer * 1_000_003 + step
    return {f"s{j}": np.random.default_rng(int(i) + 10**9).integers(0, 2**31, SMALL // 4,
                                                                   dtype=np.int32)
            for j, i in enumerate([*picks, own])}


def save_loop(store: chunkstore.Store, writer: int, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    step = deltas = reused = 0
    while time.monotonic() < deadline:
        with store.new_version(f"w{writer}", step) as v:
            v.put("w", expected(writer, step))
            if PACKS:
                for name, array in small_state(writer, step).items():
                    v.put(name, array)
        entries = store.open_version(v.info.id).entries()
        (shard,) = entries["w"].shards  # type: ignore[union-attr]
        deltas += sum(1 for chain in shard.bases if chain)
        if PACKS:  # s3 is new in every save, so its pack is this save's own
            packs = {name: entries[name].shards[0].packs[0].pack  # type: ignore[union-attr]
                     for name in ("s0", "s1", "s2", "s3")}
            reused += sum(1 for name in ("s0", "s1", "s2") if packs[name] != packs["s3"])
        mine = store.versions(f"w{writer}")
        for info in mine[:-2]:
            store.delete(info.id)
        step += 1
    print(f"saved {step} {deltas} {reused}", flush=True)


def gc_loop(store: chunkstore.Store, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    runs = deleted = repacked = 0
    while time.monotonic() < deadline:
        try:
            result = store.gc(grace=0)
        except GcBusyError:
            continue
        runs += 1
        deleted += result.chunks_deleted
        repacked += result.packs_repacked
    print(f"gc {runs} {deleted} {repacked}", flush=True)


def main(argv: list[str]) -> None:
    path, role, seconds = argv[0], argv[1], float(argv[2])
    compression = "auto" if DELTAS else "none"
    with chunkstore.open(path, chunk_size=CHUNK, compression=compression, threads=4,
                         create=True) as store:
        store.pack_delta_chunks = PACK_DELTAS
        if role == "gc":
            gc_loop(store, seconds)
        else:
            save_loop(store, int(argv[3]), seconds)


if __name__ == "__main__":
    main(sys.argv[1:])
