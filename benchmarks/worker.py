"""Run one system over one recorded workload in this (fresh) process; print its record as JSON.

Order matters for the memory figure: the first state is loaded, then every
version is saved synchronously and the peak resident set is read (so it
holds the state plus what saving added, nothing from restores); then the
restores, the async pauses and the memcpy reference are measured.  A restore
reference (``benchmarks.systems.REFERENCES``) only restores: it writes the
versions it restores in the turns in which the systems save (so its restores
fall in the same rounds as theirs), then times its restores as theirs are
timed.  Usage::

    python -m benchmarks.worker TRACE_DIR SYSTEM[,SYSTEM...] WORK_DIR [--repeat 3] [--turns]

With several systems the process is shared, so only the first one's peak
memory is its own (``rss_isolated`` says which); the suite's quick mode calls
``run`` in its own process instead, so none is.

With ``--turns`` the worker takes turns with the other systems' workers: it
says ``TURN_READY`` on stdout before each timed step (a save, a restore, an
async save, the memcpy reference), waits for ``go`` on stdin, and holds the
turn (doing the untimed work that follows too) until it next says it is
ready; it prints its records after ``RESULT_PREFIX``.  The suite hands the
turns round-robin (:func:`benchmarks.suite.run_systems`), so every system is
measured in the same minutes, save by save: a slow spell of the machine's
disk or of a neighbour falls on all of them alike, not on whichever system
happened to run then.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.systems import REFERENCES, open_async, open_reference, open_sync
from benchmarks.trace import TraceReader, TraceVersion, empty_like_tree, flatten


def peak_rss_bytes() -> int:
    """This process's peak resident set since exec.

    Not ``ru_maxrss``: Linux carries the forking parent's peak over exec into
    it, so a worker started by a suite that has trained would report the suite.
    """
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


TURN_READY = "@turn-ready"
RESULT_PREFIX = "@result "


class Turns:
    """When this process may run a timed step (see the module docstring).

    Shared, the protocol keeps stdout to itself: what anything else in the
    process prints there goes to stderr, so no stray text can hide a line the
    suite waits for.
    """

    def __init__(self, shared: bool) -> None:
        self.shared = shared
        self.channel = sys.stdout
        if shared:
            self.channel = os.fdopen(os.dup(sys.stdout.fileno()), "w")
            sys.stdout.flush()
            os.dup2(sys.stderr.fileno(), sys.stdout.fileno())

    def take(self) -> None:
        if not self.shared:
            return
        self.say(TURN_READY)
        if sys.stdin.readline().strip() != "go":
            raise SystemExit("the suite ended the run")

    def say(self, line: str) -> None:
        print(line, file=self.channel, flush=True)


ALONE = Turns(shared=False)


def median_times(fn: Callable[[], object], repeat: int, turns: Turns = ALONE
                 ) -> tuple[float, float]:
    """The median wall time of ``fn`` and the median CPU time of this process (all its
    threads) over it."""
    times, cpu = [], []
    for _ in range(repeat):
        turns.take()
        started, cpu_started = time.perf_counter(), time.process_time()
        fn()
        times.append(time.perf_counter() - started)
        cpu.append(time.process_time() - cpu_started)
    return statistics.median(times), statistics.median(cpu)


def median_time(fn: Callable[[], object], repeat: int, turns: Turns = ALONE) -> float:
    return median_times(fn, repeat, turns)[0]


def steady(times: list[float]) -> float:
    """Median over the saves after the first (the first also sets things up)."""
    return statistics.median(times[1:] if len(times) > 1 else times)


def save_all(system: Any, reader: TraceReader, turns: Turns = ALONE
             ) -> tuple[list[float], list[int], list[int], list[list[float]]]:
    """Each save's time, the bytes and objects stored after it, and when it ran
    (``time.monotonic``, one clock for every process: turns must not overlap)."""
    times, stored, objects, spans = [], [], [], []
    for version, state in reader:
        turns.take()
        began = time.monotonic()
        started = time.perf_counter()
        system.save(version, state)
        times.append(time.perf_counter() - started)
        spans.append([began, time.monotonic()])
        stored.append(system.physical_bytes())
        objects.append(system.objects())
    return times, stored, objects, spans


def pause_all(system: Any, reader: TraceReader, turns: Turns = ALONE
              ) -> tuple[list[float], list[float]]:
    """Each async save's pause, and a memcpy of the same state timed in the same turn
    right after it (the machine's speed drifts; a pause is compared with its own)."""
    pauses, copies = [], []
    for version, state in reader:
        turns.take()
        started = time.perf_counter()
        system.save(version, state)
        pauses.append(time.perf_counter() - started)
        system.wait()  # nothing in flight at the next save: the pause is the capture alone
        copies.append(_copy_seconds(state))
    return pauses, copies


def _copy_seconds(state: Any) -> float:
    """A plain copy of ``state`` into buffers that exist already (the second of two)."""
    tensors = list(flatten(state).values())
    buffers = [torch.empty_like(t) for t in tensors]
    seconds = 0.0
    for _ in range(2):
        started = time.perf_counter()
        for buffer, tensor in zip(buffers, tensors, strict=True):
            buffer.copy_(tensor)
        seconds = time.perf_counter() - started
    return seconds


def memcpy_time(reader: TraceReader, repeat: int, turns: Turns = ALONE) -> float:
    """A plain copy of the whole state into reused buffers: the floor of any pause."""
    tensors = list(flatten(reader.load(reader.versions[-1].index)).values())
    buffers = [torch.empty_like(t) for t in tensors]

    def copy() -> None:
        for buffer, tensor in zip(buffers, tensors, strict=True):
            buffer.copy_(tensor)

    copy()
    return median_time(copy, repeat, turns)


def restore_one(system: Any, reader: TraceReader, version: TraceVersion,
                repeat: int, turns: Turns = ALONE) -> tuple[float, float, bool]:
    """Median restore time of ``version``, its median CPU time, and whether every tensor
    came back bit for bit."""
    expected = flatten(reader.load(version.index))
    target = empty_like_tree(reader.load(version.index))
    restored: dict[str, Any] = {}

    def restore() -> None:
        restored["tree"] = system.restore(version, target)

    seconds, cpu_seconds = median_times(restore, repeat, turns)
    got = flatten(restored["tree"])
    ok = got.keys() == expected.keys() and all(
        torch.equal(got[name], tensor) for name, tensor in expected.items())
    return seconds, cpu_seconds, ok


def run_reference(trace_dir: Path, name: str, work_dir: Path, repeat: int,
                  turns: Turns = ALONE) -> dict[str, Any]:
    """A restore reference's record: its restores of the latest and the oldest version,
    from files written in the turns the systems save in (one turn a version)."""
    reader = TraceReader(trace_dir)
    reference = open_reference(name, work_dir)
    restored = (reader.versions[-1], reader.versions[0])
    for version in reader.versions:
        turns.take()
        if version in restored:
            reference.save(version, reader.load(version.index))
    restore_s, restore_cpu_s, latest_ok = restore_one(reference, reader, restored[0], repeat,
                                                      turns)
    restore_oldest_s, _, oldest_ok = restore_one(reference, reader, restored[1], repeat, turns)
    reference.close()
    shutil.rmtree(work_dir)
    return {
        "workload": reader.workload, "system": name, "reference": True, "how": reference.HOW,
        "versions": len(reader.versions), "logical_bytes": reader.versions[-1].logical_bytes,
        "restore_s": restore_s, "restore_cpu_s": restore_cpu_s,
        "restore_oldest_s": restore_oldest_s, "restore_verified": latest_ok and oldest_ok,
    }


def run(trace_dir: Path, system_name: str, work_dir: Path, repeat: int,
        turns: Turns = ALONE) -> dict[str, Any]:
    if system_name in REFERENCES:
        return run_reference(trace_dir, system_name, work_dir, repeat, turns)
    reader = TraceReader(trace_dir)
    reader.load(0)
    baseline_rss = peak_rss_bytes()
    system = open_sync(system_name, work_dir / "sync")
    save_times, stored, objects, save_spans = save_all(system, reader, turns)
    peak_rss = peak_rss_bytes()
    # chunkstore: the copies of the last save's chunks the handle keeps as the next
    # save's delta bases (part of the peak above)
    copies = getattr(getattr(system, "store", None), "base_copies", None)
    base_copies = copies.held() if copies is not None else None
    restore_s, restore_cpu_s, latest_ok = restore_one(system, reader, reader.versions[-1],
                                                      repeat, turns)
    restore_oldest_s, _, oldest_ok = restore_one(system, reader, reader.versions[0], repeat,
                                                 turns)
    system.close()
    shutil.rmtree(work_dir / "sync")
    async_system = open_async(system_name, work_dir / "async")
    pauses: list[float] = []
    copies: list[float] = []
    if async_system is not None:
        pauses, copies = pause_all(async_system, reader, turns)
        async_system.close()
        shutil.rmtree(work_dir / "async")
    logical = reader.versions[-1].logical_bytes
    return {
        "workload": reader.workload, "system": system_name, "versions": len(reader.versions),
        "logical_bytes": logical, "physical_bytes": stored[-1],
        "amplification": stored[-1] / logical,
        "save_s": steady(save_times), "pause_s": steady(pauses) if pauses else steady(save_times),
        "restore_s": restore_s, "restore_cpu_s": restore_cpu_s, "peak_rss_bytes": peak_rss,
        "base_copies_bytes": base_copies,
        "pause_kind": "async" if pauses else "sync (no async save)",
        "first_save_s": save_times[0], "first_pause_s": pauses[0] if pauses else None,
        "restore_oldest_s": restore_oldest_s, "restore_verified": latest_ok and oldest_ok,
        "memcpy_s": steady(copies) if copies else memcpy_time(reader, repeat, turns),
        "baseline_rss_bytes": baseline_rss,
        "cumulative_bytes": stored, "save_times_s": save_times, "pause_times_s": pauses,
        "cumulative_objects": objects, "save_spans": save_spans,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("trace_dir", type=Path)
    parser.add_argument("systems", help="comma-separated system names")
    parser.add_argument("work_dir", type=Path)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--turns", action="store_true",
                        help="take turns with other workers (see the module docstring)")
    args = parser.parse_args()
    turns = Turns(shared=args.turns)
    records = []
    for i, system in enumerate(args.systems.split(",")):
        record = run(args.trace_dir, system, args.work_dir / system, args.repeat, turns)
        records.append({**record, "rss_isolated": i == 0})
    turns.say(RESULT_PREFIX + json.dumps(records))


if __name__ == "__main__":
    main()
