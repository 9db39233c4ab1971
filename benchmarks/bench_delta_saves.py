"""Sync saves with delta chains: bases from the handle's copies, against bases read
back from the store, against no deltas.

A store with delta chains (the default ``delta_depth``, each chain bounded by its
stored bytes) encodes a changed chunk against the same chunk of the run's previous
version.  ``chains`` takes that base from the copy the handle kept of its last save
(``chunkstore.handle.basecopies``); ``chains-read-back``
(``Store.base_copies.budget = 0``) reads, decodes and hash-checks it from the
store, as saves did before; ``auto`` makes no deltas.  For each workload the
suite's recorded states are saved the three ways in turn, save by save (the
first way rotating), in this one process, so a slow spell of the disk or of the
VM falls on every way alike; the whole comparison is repeated (``--repeat``)
into fresh stores, each run reported on its own.  Figures per run: medians of a
save after the first, wall and CPU (``time.process_time``) seconds, their ratios
to ``auto``, and the bytes each store holds at the end.  Usage::

    python -m benchmarks.bench_delta_saves --out benchmarks/results/delta_saves.json
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import chunkstore
import torch_bridge
from benchmarks.bench_collector import run_workloads

WAYS = ("auto", "chains", "chains-read-back")


def compare(workload: str, states: list[dict[str, Any]], work: Path) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    stores = {way: chunkstore.open(work / f"{workload}-{way}", compression="auto",
                                   delta_depth=0 if way == "auto" else None,
               create=True) for way in WAYS}
    stores["chains-read-back"].base_copies.budget = 0
    walls: dict[str, list[float]] = {way: [] for way in WAYS}
    cpus: dict[str, list[float]] = {way: [] for way in WAYS}
    try:
        for step, state in enumerate(states):
            turn = step % len(WAYS)
            for way in WAYS[turn:] + WAYS[:turn]:
                cpu, wall = time.process_time(), time.perf_counter()
                torch_bridge.save(stores[way], state, run="r", step=step)
                if step:  # the first save also sets things up (and makes no deltas)
                    walls[way].append(time.perf_counter() - wall)
                    cpus[way].append(time.process_time() - cpu)
        stored = {way: store.stats().physical_bytes for way, store in stores.items()}
    finally:
        for store in stores.values():
            store.close()
    wall_base, cpu_base = statistics.median(walls["auto"]), statistics.median(cpus["auto"])
    return {way: {"saves": len(walls[way]),
                  "save_median_s": statistics.median(walls[way]),
                  "save_cpu_median_s": statistics.median(cpus[way]),
                  "vs_auto": statistics.median(walls[way]) / wall_base,
                  "cpu_vs_auto": statistics.median(cpus[way]) / cpu_base,
                  "stored_bytes": stored[way]} for way in WAYS}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", default="dense,mixed-precision,sparse-embedding")
    parser.add_argument("--states", type=int, default=11)
    parser.add_argument("--repeat", type=int, default=2,
                        help="times to save each workload's states the three ways (each into"
                        " fresh stores), each reported on its own")
    parser.add_argument("--out", default="benchmarks/results/delta_saves.json")
    args = parser.parse_args(argv)

    def runs(workload: str, states: list[dict[str, Any]], work: Path) -> list[dict[str, Any]]:
        found = []
        for run in range(args.repeat):
            found.append(compare(workload, states, work / str(run)))
            shutil.rmtree(work / str(run))  # the sparse stores take gigabytes
        return found

    run_workloads(args.workloads, args.states, runs,
                  {"states": args.states, "repeat": args.repeat}, args.out, "cs-delta-saves-")


if __name__ == "__main__":
    main()
