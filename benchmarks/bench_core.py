"""Save/restore throughput of chunkstore against torch.save/torch.load on the same arrays.

One run measures the machine's own limits too (memcpy, BLAKE3, write+fsync),
so every figure is a ratio taken under the same conditions.  Usage::

    python benchmarks/bench_core.py --gib 1 --repeat 3 --out benchmarks/results/core.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import blake3
import numpy as np

import chunkstore


def _timed(fn: Callable[[], object], repeat: int, before: Callable[[], object] | None = None
           ) -> float:
    """Median seconds of ``fn`` over ``repeat`` runs (``before`` runs untimed first)."""
    times = []
    for _ in range(repeat):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def make_state(total_bytes: int, seed: int = 0) -> dict[str, np.ndarray]:
    """A model-like state: a few large float32 matrices and many small ones."""
    rng = np.random.default_rng(seed)
    state: dict[str, np.ndarray] = {}
    big = total_bytes * 9 // 10 // 8
    for i in range(8):
        state[f"model.layers.{i}.w"] = (rng.standard_normal(big // 4) * 0.02).astype(np.float32)
    small = (total_bytes - 8 * big) // 64
    for i in range(64):
        state[f"model.norms.{i}.b"] = rng.standard_normal(small // 4).astype(np.float32)
    return state


def limits(workdir: Path, nbytes: int) -> dict[str, float]:
    data = np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8)
    target = np.ones_like(data)  # touched, so the copy measures bandwidth, not page faults
    memcpy = nbytes / _timed(lambda: np.copyto(target, data), 3)
    view = memoryview(data.data)
    hash1 = nbytes / _timed(lambda: blake3.blake3(view).digest(), 3)

    def write_fsync() -> None:
        path = workdir / "fsync.bin"
        with open(path, "wb") as f:
            f.write(view)
            f.flush()
            os.fsync(f.fileno())
        path.unlink()

    return {"memcpy_gbps": memcpy / 1e9, "blake3_1thread_gbps": hash1 / 1e9,
            "write_fsync_gbps": nbytes / _timed(write_fsync, 3) / 1e9}


def bench_torch(workdir: Path, state: dict[str, np.ndarray], repeat: int) -> dict[str, float]:
    import torch

    tensors = {k: torch.from_numpy(v) for k, v in state.items()}
    path = workdir / "torch.pt"

    def save() -> None:
        with open(path, "wb") as f:
            torch.save(tensors, f)
            f.flush()
            os.fsync(f.fileno())  # the same durability chunkstore gives

    save_s = _timed(save, repeat)
    load_s = _timed(lambda: torch.load(path, weights_only=True), repeat)
    return {"save_s": save_s, "load_s": load_s}


def bench_chunkstore(workdir: Path, state: dict[str, np.ndarray], repeat: int,
                     compression: str) -> dict[str, float]:
    root = workdir / f"cs-{compression}"

    def fresh() -> None:
        shutil.rmtree(root, ignore_errors=True)

    def save(step: int = 0) -> None:
        with chunkstore.open(root, compression=compression) as store, \
                store.new_version(run="bench", step=step) as v:
            for name, array in state.items():
                v.put(name, array)

    first_s = _timed(save, repeat, before=fresh)
    resave_s = _timed(lambda: save(1), repeat)
    with chunkstore.open(root) as store:
        reader = store.open_version("latest")
        outs = {k: np.empty_like(v) for k, v in state.items()}

        def restore() -> None:
            for name, out in outs.items():
                reader.get_into(name, out)

        restore_s = _timed(restore, repeat)
        physical = store.stats().physical_bytes
    return {"first_save_s": first_s, "resave_s": resave_s, "restore_s": restore_s,
            "physical_bytes": physical}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/core.json")
    parser.add_argument("--workdir", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args(argv)
    nbytes = int(args.gib * (1 << 30))
    workdir = Path(tempfile.mkdtemp(prefix="cs-bench-", dir=args.workdir))
    try:
        state = make_state(nbytes)
        logical = sum(a.nbytes for a in state.values())
        result: dict[str, Any] = {
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                        "platform": platform.platform()},
            "logical_bytes": logical, "limits": limits(workdir, min(nbytes, 512 << 20)),
            "torch": bench_torch(workdir, state, args.repeat),
        }
        for compression in ("none", "auto"):
            result[f"chunkstore-{compression}"] = bench_chunkstore(workdir, state, args.repeat,
                                                                   compression)
        t = result["torch"]
        for key in ("chunkstore-none", "chunkstore-auto"):
            r = result[key]
            r["first_save_vs_torch_save"] = t["save_s"] / r["first_save_s"]
            r["resave_vs_torch_save"] = t["save_s"] / r["resave_s"]
            r["restore_vs_torch_load"] = t["load_s"] / r["restore_s"]
            for k in ("first_save", "resave", "restore"):
                r[f"{k}_gbps"] = logical / r[f"{k}_s"] / 1e9
        t["save_gbps"] = logical / t["save_s"] / 1e9
        t["load_gbps"] = logical / t["load_s"] / 1e9
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result, indent=2))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
