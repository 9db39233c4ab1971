"""Peak memory of sync saves against the size of the state saved.

DESIGN.md bounds a sync save's extra memory by the chunk size times the
threads, not by the state; besides that, a store handle keeps copies of the
bases of the next delta save, within ``Store.base_copies.budget`` bytes (1 GiB
by default, ``chunkstore.handle.basecopies``).  This checks both as the state grows.

For each size, a state of 64 float32 tensors is saved ``--saves`` times as one
run into a new store (the default policy and delta chains), every element
changed by a small step before each save: a dense update, where every chunk is
new and the handle copies the most.  Each save is measured from the process's
RSS before the first save (state made, store open, Python's collector run),
its peak reset before the save (Linux: ``/proc/self/clear_refs``), so what a
save leaves allocated is counted in the saves after it:

- ``peak_over_baseline_bytes``: the process's peak RSS during the save, less
  that baseline: all the memory saving costs at that moment;
- ``copies_bytes``: what the handle's base copies held, the larger of before
  and after the save;
- ``working_bytes``: the first less the second, what the save itself needs.

Each size is measured with the default budget of copies and with copies off
(budget 0: every base is read back), each in a process of its own (memory
one measurement frees is not handed back to the system at once, and would
lower the next one's figures).  Usage::

    python -m benchmarks.bench_memory --out benchmarks/results/memory.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import chunkstore
import torch_bridge
from chunkstore.handle.basecopies import BASE_COPY_BYTES

MIB = 1 << 20
TENSORS = 64
#: How each size is saved: the handle's base copies at their default budget, and off.
WAYS = {"default": BASE_COPY_BYTES, "no copies": 0}


def rss_status(field: str) -> int:
    """A ``VmRSS``/``VmHWM`` figure of this process, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak() -> None:
    """Make the peak RSS (VmHWM) the current RSS."""
    Path("/proc/self/clear_refs").write_text("5")


def measure(mib: int, budget: int, saves: int, work: Path) -> dict[str, Any]:
    """``saves`` saves of a ``mib``-MiB state into a new store whose handle may keep
    ``budget`` bytes of base copies."""
    generator = torch.Generator().manual_seed(0)
    elements = mib * MIB // 4 // TENSORS
    state = {f"layer{i}": torch.randn(elements, generator=generator) * 0.02
             for i in range(TENSORS)}
    step_size = torch.randn(elements, generator=generator) * 1e-4
    path = work / f"store-{mib}-{budget}"
    store = chunkstore.open(path, compression="auto", create=True)
    store.base_copies.budget = budget
    rows = []
    try:
        gc.collect()
        baseline = rss_status("VmRSS")
        for step in range(saves):
            for tensor in state.values():
                tensor.add_(step_size)
            copies_before = store.base_copies.held()
            gc.collect()
            reset_peak()
            start = time.perf_counter()
            torch_bridge.save(store, state, run="r", step=step)
            seconds = time.perf_counter() - start
            peak = rss_status("VmHWM") - baseline
            copies = max(copies_before, store.base_copies.held())
            rows.append({"save": step, "seconds": seconds, "peak_over_baseline_bytes": peak,
                         "copies_bytes": copies, "working_bytes": peak - copies})
    finally:
        store.close()
        shutil.rmtree(path, ignore_errors=True)
    state_bytes = sum(t.nbytes for t in state.values())
    return {"state_bytes": state_bytes, "copies_budget_bytes": budget,
            "threads": store.threads, "chunk_size": store.config.chunk_size,
            "saves": rows,
            "most_working_bytes": max(r["working_bytes"] for r in rows),
            "most_working_over_state": max(r["working_bytes"] for r in rows) / state_bytes,
            "most_peak_over_baseline_bytes": max(r["peak_over_baseline_bytes"] for r in rows)}


def run(sizes: list[int], saves: int) -> dict[str, Any]:
    result: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "platform": platform.platform(), "torch": torch.__version__},
        "tensors": TENSORS, "saves": saves, "sizes": {}}
    for mib in sizes:
        result["sizes"][f"{mib} MiB"] = {way: _measure_apart(mib, budget, saves)
                                         for way, budget in WAYS.items()}
    return result


def _measure_apart(mib: int, budget: int, saves: int) -> dict[str, Any]:
    """:func:`measure` in a new process."""
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_memory", "--one", str(mib), str(budget),
         str(saves)], check=True, capture_output=True, text=True)
    measured: dict[str, Any] = json.loads(done.stdout)
    return measured


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", default="256,1024,2048",
                        help="state sizes in MiB, comma-separated")
    parser.add_argument("--saves", type=int, default=6)
    parser.add_argument("--out", default="benchmarks/results/memory.json")
    parser.add_argument("--one", nargs=3, type=int, metavar=("MIB", "BUDGET", "SAVES"),
                        help=argparse.SUPPRESS)  # one measurement, printed (run() calls it)
    args = parser.parse_args(argv)
    if args.one:
        work = Path(tempfile.mkdtemp(prefix="cs-memory-"))
        try:
            mib, budget, saves = args.one
            print(json.dumps(measure(mib, budget, saves, work)))
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return
    result = run([int(s) for s in args.mib.split(",")], args.saves)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
