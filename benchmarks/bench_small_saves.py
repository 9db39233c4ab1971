"""Sync saves of states of many small tensors: hashing shared with the pool, against
the caller hashing alone, and against safetensors.

A store hashes each batch of small tensors on the caller and
``Store.hashing_helpers`` pool jobs (``chunkstore.format.digest.digests_of``); a store
whose ``hashing_helpers`` is set to 0 hashes on the caller alone, as saves did
before.  For each workload the suite's recorded states are saved by the three
ways in turn, save by save (the first way rotating), in this one process.
Rounds after the first save the same states again.  Figures: median seconds of
a save after the first, and the ratio to safetensors'.  Usage::

    python -m benchmarks.bench_small_saves --out benchmarks/results/small_saves.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import chunkstore
import torch_bridge
from benchmarks.bench_collector import run_workloads
from benchmarks.systems import Safetensors
from benchmarks.trace import TraceVersion

WAYS = ("safetensors", "shared", "caller-alone")


def compare(workload: str, states: list[dict[str, Any]], rounds: int, work: Path
            ) -> dict[str, Any]:
    stores = {way: chunkstore.open(work / f"{workload}-{way}", compression="auto", create=True)
              for way in WAYS[1:]}
    stores["caller-alone"].hashing_helpers = 0
    files = Safetensors(work / f"{workload}-safetensors")
    saves: dict[str, list[float]] = {way: [] for way in WAYS}

    def save(way: str, state: dict[str, Any], step: int) -> float:
        start = time.perf_counter()
        if way == "safetensors":
            files.save(TraceVersion(step, "r", step, 0, 0), state)
        else:
            torch_bridge.save(stores[way], state, run="r", step=step)
        return time.perf_counter() - start

    try:
        for way in WAYS:
            save(way, states[0], 0)
        step = 1
        for _ in range(rounds):
            for state in states[1:]:
                turn = step % len(WAYS)
                for way in WAYS[turn:] + WAYS[:turn]:
                    saves[way].append(save(way, state, step))
                step += 1
    finally:
        for store in stores.values():
            store.close()
    base = statistics.median(saves["safetensors"])
    return {way: {"saves": len(saves[way]), "save_median_s": statistics.median(saves[way]),
                  "vs_safetensors": statistics.median(saves[way]) / base} for way in WAYS}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", default="lora,frozen")
    parser.add_argument("--states", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/small_saves.json")
    args = parser.parse_args(argv)
    run_workloads(args.workloads, args.states,
                  lambda workload, states, work: compare(workload, states, args.rounds, work),
                  {"states": args.states, "rounds": args.rounds}, args.out, "cs-small-saves-")


if __name__ == "__main__":
    main()
