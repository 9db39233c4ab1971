"""Delta chains: save and restore time by chain depth, against a delta-free store.

Saves nine versions of one 64 MB float32 table (``sparse``: 9% of rows change
per save, as in the sparse-embedding workload; ``dense``: every element takes
a small Adam-like step) into a store with deltas (``--depth``) and into one
without, and restores each version (best of three, decoded bases not cached
between tries).  Version ``v`` sits at chain depth ``v mod (depth + 1)``.
Usage::

    python benchmarks/bench_delta.py sparse --depth 8
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

import chunkstore

ROWS, DIM = 250_000, 64


def states(kind: str) -> Iterator[np.ndarray]:
    rng = np.random.default_rng(0)
    table = rng.standard_normal((ROWS, DIM)).astype(np.float32) * np.float32(0.02)
    while True:
        yield table.copy()
        if kind == "sparse":
            rows = rng.integers(0, ROWS, ROWS // 11)
            table[rows] -= np.float32(0.001) * np.sign(table[rows])
        else:
            step = np.sign(rng.standard_normal(table.shape).astype(np.float32))
            table -= np.float32(1e-4) * step


def best_of(fn: Callable[[], object], tries: int = 3) -> float:
    times = []
    for _ in range(tries):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def measure(kind: str, depth: int, root: Path) -> tuple[list[float], list[float], int]:
    saves, restores = [], []
    with chunkstore.open(root, delta_depth=depth, create=True) as store:
        generator, ids = states(kind), []
        for step in range(9):
            table = next(generator)
            started = time.perf_counter()
            with store.new_version(run="r", step=step) as version:
                version.put("t", table)
            saves.append(time.perf_counter() - started)
            ids.append(version.info.id)
        out = np.empty((ROWS, DIM), dtype=np.float32)
        for version_id in ids:
            def restore(vid: str = version_id) -> None:
                store.base_cache.clear()
                store.open_version(vid).get_into("t", out)
            restores.append(best_of(restore))
        return saves, restores, store.stats().physical_bytes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("kind", choices=["sparse", "dense"])
    parser.add_argument("--depth", type=int, default=8)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as work:
        plain = measure(args.kind, 0, Path(work) / "plain")
        delta = measure(args.kind, args.depth, Path(work) / "delta")
    for v in range(9):
        print(f"v{v} depth {v % (args.depth + 1)}: save {plain[0][v] * 1e3:.0f} ->"
              f" {delta[0][v] * 1e3:.0f} ms ({delta[0][v] / plain[0][v]:.2f}x), restore"
              f" {plain[1][v] * 1e3:.0f} -> {delta[1][v] * 1e3:.0f} ms"
              f" ({delta[1][v] / plain[1][v]:.2f}x)")
    print(f"stored: {plain[2] / 1e6:.1f} MB without deltas, {delta[2] / 1e6:.1f} MB with")


if __name__ == "__main__":
    main()
