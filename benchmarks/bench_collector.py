"""Saves and restores with Python's cyclic garbage collector paused, against running.

``torch_bridge.save`` and ``load`` pause the collector (``chunkstore.collector``);
their undecorated functions (``__wrapped__``) run with it on.  For each
workload the suite's recorded states are saved into two stores, alternating
save by save between the two ways (and restored the same way), in this one
process, which holds what a training process holds (torch imported, the
states).  Rounds after the first save the same states again (unchanged
re-saves).  Figures: total and median seconds of each way.  Usage::

    python -m benchmarks.bench_collector --out benchmarks/results/collector.json
"""

from __future__ import annotations

import argparse
import contextlib
import copy
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

import chunkstore
import torch_bridge
from benchmarks import workloads
from benchmarks.workloads import FULL

WAYS = {"paused": (torch_bridge.save, torch_bridge.load),
        "running": (torch_bridge.save.__wrapped__, torch_bridge.load.__wrapped__)}


class _Enough(Exception):
    """Raised to end training once enough states are recorded."""


def record_states(workload: str, count: int) -> list[dict[str, Any]]:
    states: list[dict[str, Any]] = []

    def record(run: str, step: int, state: dict[str, Any]) -> None:
        states.append(copy.deepcopy(state))
        if len(states) >= count:
            raise _Enough

    with contextlib.suppress(_Enough):
        workloads.TRAIN[workload](FULL, record)
    return states


def run_workloads(workload_names: str, count: int,
                  compare_one: Callable[[str, list[dict[str, Any]], Path], Any],
                  settings: dict[str, Any], out: str, prefix: str) -> None:
    """Record ``count`` states of each workload (comma-separated names), compare them with
    ``compare_one(workload, states, work directory)``, and write what it returns, with the
    machine and ``settings``, to ``out`` as JSON (and print it)."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    result: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "platform": platform.platform()},
        **settings, "workloads": {}}
    try:
        for workload in workload_names.split(","):
            states = record_states(workload, count)
            result["workloads"][workload] = compare_one(workload, states, work)
            del states  # before the next workload's are recorded
    finally:
        shutil.rmtree(work, ignore_errors=True)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


def _seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def compare(workload: str, states: list[dict[str, Any]], rounds: int, work: Path
            ) -> dict[str, Any]:
    stores = {way: chunkstore.open(work / f"{workload}-{way}", compression="auto", create=True)
              for way in WAYS}
    saves: dict[str, list[float]] = {way: [] for way in WAYS}
    restores: dict[str, list[float]] = {way: [] for way in WAYS}
    target = copy.deepcopy(states[0])
    try:
        for way, (save, _) in WAYS.items():
            save(stores[way], states[0], run="r", step=0)
        step = 1
        for _ in range(rounds):
            for state in states[1:]:
                order = list(WAYS) if step % 2 else list(WAYS)[::-1]
                for way in order:
                    save, load = WAYS[way]
                    saves[way].append(_seconds(
                        lambda: save(stores[way], state, run="r", step=step)))  # noqa: B023
                    restores[way].append(_seconds(
                        lambda: load(stores[way], f"r@{step}", target)))  # noqa: B023
                step += 1
    finally:
        for store in stores.values():
            store.close()
    return {way: {"saves": len(saves[way]), "save_total_s": sum(saves[way]),
                  "save_median_s": statistics.median(saves[way]),
                  "restore_total_s": sum(restores[way]),
                  "restore_median_s": statistics.median(restores[way])} for way in WAYS}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", default="dense,lora,frozen")
    parser.add_argument("--states", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/collector.json")
    args = parser.parse_args(argv)
    run_workloads(args.workloads, args.states,
                  lambda workload, states, work: compare(workload, states, args.rounds, work),
                  {"states": args.states, "rounds": args.rounds}, args.out, "cs-collector-")


if __name__ == "__main__":
    main()
