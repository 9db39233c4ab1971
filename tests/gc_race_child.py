"""A process in the GC race test: ``python tests/gc_race_child.py STORE ROLE SECONDS [WRITER]``.

ROLE ``save``: save versions of run ``w<WRITER>`` in a loop, each built from
blocks of a small shared pool (so saves deduplicate against chunks other
saves and deletions keep making unreferenced), and unpublish all but the
newest two of its own versions.  ROLE ``gc``: run ``gc(grace=0)`` in a loop.
Both stop after SECONDS and print what they did.
"""

from __future__ import annotations

import sys
import time

import numpy as np

import chunkstore
from chunkstore.errors import GcBusyError

CHUNK = 64 * 1024
POOL = 10
BLOCKS = 6


def block(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 2**31, CHUNK // 4, dtype=np.int32)


def version_blocks(writer: int, step: int) -> list[int]:
    rng = np.random.default_rng(writer * 1_000_003 + step)
    return [int(i) for i in rng.integers(0, POOL, BLOCKS)]


def expected(writer: int, step: int) -> np.ndarray:
    return np.concatenate([block(i) for i in version_blocks(writer, step)])


def save_loop(store: chunkstore.Store, writer: int, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    step = 0
    while time.monotonic() < deadline:
        with store.new_version(f"w{writer}", step) as v:
            v.put("w", expected(writer, step))
        mine = store.versions(f"w{writer}")
        for info in mine[:-2]:
            store.delete(info.id)
        step += 1
    print(f"saved {step}", flush=True)


def gc_loop(store: chunkstore.Store, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    runs = deleted = 0
    while time.monotonic() < deadline:
        try:
            result = store.gc(grace=0)
        except GcBusyError:
            continue
        runs += 1
        deleted += result.chunks_deleted
    print(f"gc {runs} {deleted}", flush=True)


def main(argv: list[str]) -> None:
    path, role, seconds = argv[0], argv[1], float(argv[2])
    with chunkstore.open(path, chunk_size=CHUNK, compression="none", threads=4) as store:
        if role == "gc":
            gc_loop(store, seconds)
        else:
            save_loop(store, int(argv[3]), seconds)


if __name__ == "__main__":
    main(sys.argv[1:])
