"""Restores with a job per core against a job per pool thread (``Store.read_jobs``).

From a local store a read call runs at most a job per core
(``chunkstore.read.reader.run_jobs``); before, it handed every read job to the
store's pool, 8 threads or more.  For each workload the suite's recorded
states are saved into one store (the default policy, with delta chains), which
is copied once per way, so each way has its own handle, index and pool; then
the latest version is restored into the state's tensors by the two ways in
turn (the first way alternating), in this one process.  Figures: median and
fastest seconds of a restore, and the ratio of the per-core way's median to
the other's.  Usage::

    python -m benchmarks.bench_read_jobs --out benchmarks/results/read_jobs.json
"""

from __future__ import annotations

import argparse
import copy
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import chunkstore
import torch_bridge
from benchmarks.bench_collector import run_workloads

WAYS = ("per-core", "per-thread")


def compare(workload: str, states: list[dict[str, Any]], restores: int, work: Path
            ) -> dict[str, Any]:
    saved = work / f"{workload}-saved"
    with chunkstore.open(saved, compression="auto", create=True) as store:
        for step, state in enumerate(states):
            torch_bridge.save(store, state, run="r", step=step)
    for way in WAYS:
        shutil.copytree(saved, work / f"{workload}-{way}")
    stores = {way: chunkstore.open(work / f"{workload}-{way}", create=True) for way in WAYS}
    stores["per-thread"].read_jobs = stores["per-thread"].threads  # as before run_jobs
    target = copy.deepcopy(states[-1])
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    try:
        for turn in range(restores):
            for way in WAYS if turn % 2 else WAYS[::-1]:
                store = stores[way]
                store.base_cache.clear()  # every restore decodes its chains afresh
                start = time.perf_counter()
                torch_bridge.load(store, "r@latest", target)
                times[way].append(time.perf_counter() - start)
    finally:
        for store in stores.values():
            store.close()
    result: dict[str, Any] = {
        way: {"read_jobs": stores[way].read_jobs, "threads": stores[way].threads,
              "restores": len(times[way]), "median_s": statistics.median(times[way]),
              "fastest_s": min(times[way])} for way in WAYS}
    result["per_core_vs_per_thread"] = (result["per-core"]["median_s"]
                                        / result["per-thread"]["median_s"])
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", default="frozen,lora,sweep,mixed-precision")
    parser.add_argument("--states", type=int, default=5)
    parser.add_argument("--restores", type=int, default=20)
    parser.add_argument("--out", default="benchmarks/results/read_jobs.json")
    args = parser.parse_args(argv)
    run_workloads(args.workloads, args.states,
                  lambda workload, states, work: compare(workload, states, args.restores,
                                                         work),
                  {"states": args.states, "restores": args.restores}, args.out,
                  "cs-read-jobs-")


if __name__ == "__main__":
    main()
