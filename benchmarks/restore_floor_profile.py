"""Where a suite restore's time goes, against the suite's restore references.

The suite (``benchmarks.suite``) times chunkstore's restores against a checked
read and the machine's copy+hash floor (``benchmarks.systems.REFERENCES``); this
script prepares the same workloads once (a full-scale trace, every version saved
into ``chunkstore-auto`` and ``chunkstore-none``) and then (the references' files
of the latest version written first), in one process, restores the latest version with each
in turn, ``--repeat`` rounds:

- ``wall_s`` / ``cpu_s``: a whole restore (``system.restore``, as the suite times it)
  and the process's CPU time over it (all threads);
- for chunkstore, ``open_s`` (``open_version`` and its entries: the manifest read,
  decoded and checked) and ``reads_s`` (``get_many_into`` of every tensor entry into
  arrays of the entries' shapes, allocated once: the store's read jobs), each on its own, with their
  CPU times; what ``torch_bridge.load`` adds is the rest;
- ``serial_cpu_s``: the reads' CPU time when one thread runs every read job (what
  ``benchmarks.bench_restore`` calls ``cpu``): the work, which the other processes
  on a shared machine hardly change;
- the checked read again with torch's intra-op threads at 1 (on a busy machine its
  copies' OpenMP threads spin waiting for a core: 80% of its CPU samples in
  libgomp here), with the wall time of its ``load_file``, copy and hashes apart.

``loop`` restores one system many times (for ``perf record``).  Usage::

    python -m benchmarks.restore_floor_profile prepare --work /tmp/floors
    python -m benchmarks.restore_floor_profile measure --work /tmp/floors --repeat 15 \\
        --out benchmarks/results/restore-floors/profile.json
    perf record -F 999 -o /tmp/auto.data -- python -m benchmarks.restore_floor_profile \\
        loop --work /tmp/floors --workload dense --system chunkstore-auto --repeat 60
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks import suite
from benchmarks.systems import REFERENCES, Chunkstore, copy_into, open_reference, open_sync
from benchmarks.trace import TraceReader, empty_like_tree, flatten
from benchmarks.workloads import FULL, QUICK, WORKLOADS, Scale
from chunkstore.format.dtypes import numpy_dtype
from chunkstore.read import reader as read_jobs

STORES = ("chunkstore-auto", "chunkstore-none")
ONE_THREAD = "checked-read, torch on 1 thread"


def prepare(work: Path, workloads: list[str], scale: Scale = FULL) -> None:
    for name in workloads:
        trace = work / name / "trace"
        suite.record_trace(name, scale, trace)
        reader = TraceReader(trace)
        for system in STORES:
            store = open_sync(system, work / name / system)
            for version, state in reader:
                store.save(version, state)
            store.close()
        print(f"{name}: prepared", file=sys.stderr)


def _timed(fn: Callable[[], object]) -> tuple[float, float]:
    started, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - started, time.process_time() - cpu


class _Case:
    """One workload's systems, opened on its prepared files, and the live state."""

    def __init__(self, work: Path, name: str) -> None:
        reader = TraceReader(work / name / "trace")
        self.latest = reader.versions[-1]
        self.target = empty_like_tree(reader.load(self.latest.index))
        self.outs: dict[Any, dict[str, np.ndarray]] = {}
        self.systems: dict[str, Any] = {
            **{system: Chunkstore(work / name / system, system.removeprefix("chunkstore-"))
               for system in STORES},
            # written here: the references keep their files' digests in memory
            **{reference: _reopened(reference, work / name / reference, reader)
               for reference in REFERENCES}}

    def restore(self, system: str) -> dict[str, float]:
        if system == ONE_THREAD:
            return self._one_torch_thread()
        opened = self.systems[system]
        wall, cpu = _timed(lambda: opened.restore(self.latest, self.target))
        found = {"wall_s": wall, "cpu_s": cpu}
        if isinstance(opened, Chunkstore):
            found.update(self._phases(opened))
        return found

    def _one_torch_thread(self) -> dict[str, float]:
        """The checked read with torch's copies on one thread (its intra-op threads
        busy-wait for a core on a shared machine), and its three steps' wall times."""
        opened = self.systems["checked-read"]
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            wall, cpu = _timed(lambda: opened.restore(self.latest, self.target))
            loaded: list[Any] = []
            load_s, _ = _timed(lambda: loaded.append(opened.load(self.latest, [])))
            copy_s, _ = _timed(lambda: copy_into(self.target, loaded[0]))
            hash_s, _ = _timed(lambda: [opened._digest(tensor)
                                        for tensor in flatten(self.target).values()])
        finally:
            torch.set_num_threads(threads)
        return {"wall_s": wall, "cpu_s": cpu, "load_s": load_s, "copy_s": copy_s,
                "hash_s": hash_s}

    def _phases(self, opened: Chunkstore) -> dict[str, float]:
        selector = f"{self.latest.run}@{self.latest.step}"
        versions: list[Any] = []
        open_s, open_cpu_s = _timed(lambda: versions.append(
            opened.store.open_version(selector)))
        version = versions[0]
        try:
            entries = version.entries()
            if opened not in self.outs:  # arrays of the entries' shapes, faulted in once
                self.outs[opened] = {
                    name: np.zeros(entry.shape, numpy_dtype(entry.dtype))
                    for name, entry in entries.items() if hasattr(entry, "shape")}
            requests = [(name, out, None) for name, out in self.outs[opened].items()]
            reads_s, reads_cpu_s = _timed(lambda: version.get_many_into(requests))
            in_pool = read_jobs.run_jobs
            read_jobs.run_jobs = _inline  # type: ignore[assignment]
            try:
                _, serial = _timed(lambda: version.get_many_into(requests))
            finally:
                read_jobs.run_jobs = in_pool  # type: ignore[assignment]
        finally:
            version.close()
        return {"open_s": open_s, "open_cpu_s": open_cpu_s, "reads_s": reads_s,
                "reads_cpu_s": reads_cpu_s, "serial_cpu_s": serial}


def _inline(executor: Any, jobs: list[Callable[[], None]], at_once: int) -> None:
    for job in jobs:
        job()


def _reopened(name: str, root: Path, reader: TraceReader) -> Any:
    opened = open_reference(name, root)
    opened.save(reader.versions[-1], reader.load(reader.versions[-1].index))
    return opened


def measure(work: Path, workloads: list[str], repeat: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name in workloads:
        case = _Case(work, name)
        rounds: dict[str, list[dict[str, float]]] = {
            system: [] for system in [*case.systems, ONE_THREAD]}
        for _ in range(repeat):
            for system, found in rounds.items():  # in turns: a slow spell falls on all
                found.append(case.restore(system))
        results[name] = {system: {key: statistics.median(r[key] for r in found)
                                  for key in found[0]} for system, found in rounds.items()}
        for opened in case.systems.values():
            opened.close()
        print(f"{name}: " + ", ".join(f"{s} {r['wall_s'] * 1e3:.1f} ms"
                                      for s, r in results[name].items()), file=sys.stderr)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("action", choices=("prepare", "measure", "loop"))
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--workload", help="loop: the workload")
    parser.add_argument("--system", help="loop: the system")
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--quick", action="store_true", help="prepare: the suite's quick scale")
    args = parser.parse_args(argv)
    workloads = args.workloads.split(",")
    if args.action == "prepare":
        prepare(args.work, workloads, QUICK if args.quick else FULL)
        return
    if args.action == "loop":
        case = _Case(args.work, args.workload)
        for _ in range(args.repeat):
            case.systems[args.system].restore(case.latest, case.target)
        return
    command = " ".join(["python -m benchmarks.restore_floor_profile",
                        *(sys.argv[1:] if argv is None else argv)])
    doc = {"command": command, "repeat": args.repeat,
           "load_average": os.getloadavg()[0],
           "results": measure(args.work, workloads, args.repeat)}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    else:
        print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
