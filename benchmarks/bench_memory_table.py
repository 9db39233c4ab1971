"""Peak memory side by side: sync save, async save and restore, every system, two sizes.

For each state size and each system of the suite (``benchmarks.systems``),
four measurements, each in a process of its own (memory one measurement frees
is not handed back to the system at once, and would lower the next one's
figures), each the process's peak resident set (``VmHWM``, reset through
``/proc/self/clear_refs`` where a measurement starts) less its resident set
just before (the state made, the store or folder open, Python's collector
run), as the suite's worker measures its sync saves:

- ``sync``: ``--saves`` sync saves of the state, every element changed by a
  small step before each (a dense update: every chunk is new); per save, its
  peak and what chunkstore's handle held in base copies (the larger of before
  and after), so ``working`` = peak - copies is what the save itself needs;
- ``async``: as many async saves (chunkstore's ``Checkpointer(async_save=True)``,
  DCP's ``async_save``; torch.save and safetensors have none), the state
  changed while each runs in the background, at most one in flight; the peak
  over all of them, the staging copy included;
- ``live``: a restore of the last version into the tensors of a live state
  (chunkstore's restore into the existing tensors, DCP's load in place;
  torch.load and safetensors' load_file, then a copy into them, as
  ``load_state_dict`` does);
- ``fresh``: a load of the last version into new objects (``torch.load``,
  ``load_file``, DCP's loader of a checkpoint's keys, ``torch_bridge.load``
  into empty trees); what it allocates beyond the state it returns is its
  extra memory.

The state is an MLP's (square 1024 x 1024 layers, no bias) weights with AdamW's
two moments per weight, built in place (nothing freed before a measurement
starts), about ``--mib`` MiB.  Usage::

    python -m benchmarks.bench_memory_table --out benchmarks/results/memory_table.json
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
import threading
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_memory import reset_peak, rss_status
from benchmarks.systems import SYSTEMS, open_async, open_sync
from benchmarks.trace import TraceVersion, flatten

MIB = 1 << 20
WIDTH = 1024
OPERATIONS = ("sync", "live", "fresh", "async")
RUN = "run"
#: The targets (docs DESIGN, issue 49): a restore's extra memory at most this share of
#: the state; a sync save's working memory (beyond the base copies) under this many
#: bytes whatever the state; an async save's at most the staging copy plus both.
RESTORE_SHARE = 1 / 8
WORKING_BYTES = 256 * MIB


def make_state(mib: int) -> dict[str, Any]:
    """An MLP's state dict and its AdamW state, about ``mib`` MiB, every byte written."""
    layers = max(1, round(mib * MIB / (3 * 4 * WIDTH * WIDTH)))
    model = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH, bias=False)
                                  for _ in range(layers)))
    optimizer = torch.optim.AdamW(model.parameters())
    for param in model.parameters():
        optimizer.state[param] = {
            "step": torch.tensor(1.0),
            "exp_avg": torch.empty_like(param).normal_(0, 1e-3),
            "exp_avg_sq": torch.empty_like(param).uniform_(0, 1e-6)}
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


def state_bytes(state: Any) -> int:
    return sum(t.nbytes for t in flatten(state).values())


class DenseStep:
    """Changes every element of a state by a small step (one noise buffer per shape,
    made before any measurement)."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.tensors = list(flatten(state).values())
        self.noise = {t.shape: torch.empty_like(t) for t in self.tensors}

    def __call__(self) -> None:
        for noise in self.noise.values():
            noise.normal_(0, 1e-4)
        with torch.no_grad():
            for tensor in self.tensors:
                tensor.add_(self.noise[tensor.shape])


def version(i: int) -> TraceVersion:
    return TraceVersion(i, RUN, i, 0, 0)


def checksums(state: Any) -> dict[str, float]:
    """A sum per tensor (a reduction: no copy), how a restore's process checks what it
    read; inside the measurement, so a lazy load (safetensors maps its file) has read
    every byte by its end, as any restore must."""
    return {name: float(t.sum()) for name, t in flatten(state).items()}


class Kinds:
    """The peaks of anonymous and of file-backed resident memory over their values at
    the start, sampled every millisecond in a thread (Linux keeps no peak of each): a
    file's pages mapped from the page cache (chunkstore maps the objects it reads,
    safetensors its file) are resident and counted in the peak, but they are the page
    cache's, given back under pressure, where anonymous memory is the process's own."""

    FIELDS = ("RssAnon", "RssFile")

    def __init__(self, start: dict[str, int] | None = None) -> None:
        self.start = start if start is not None else self.now()
        self.peak = dict(self.start)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    @classmethod
    def now(cls) -> dict[str, int]:
        return {field: rss_status(field) for field in cls.FIELDS}

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            for line in Path("/proc/self/status").read_text().splitlines():
                field, _, value = line.partition(":")
                if field in self.peak:
                    self.peak[field] = max(self.peak[field], int(value.split()[0]) * 1024)

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        return {"anon_peak_bytes": self.peak["RssAnon"] - self.start["RssAnon"],
                "file_peak_bytes": self.peak["RssFile"] - self.start["RssFile"]}


def _copies(system: Any) -> int:
    copies = getattr(getattr(system, "store", None), "base_copies", None)
    return copies.held() if copies is not None else 0


def _baseline() -> int:
    gc.collect()
    baseline = rss_status("VmRSS")
    reset_peak()
    return baseline


def measure_sync(system_name: str, mib: int, saves: int, work: Path) -> dict[str, Any]:
    """``saves`` sync saves; the folder is kept for the restores, with the last state's
    checksums."""
    state = make_state(mib)
    step = DenseStep(state)
    system = open_sync(system_name, work / "store")
    rows = []
    try:
        baseline = _baseline()
        start = Kinds.now()
        for i in range(saves):
            step()
            before = _copies(system)
            gc.collect()
            reset_peak()
            kinds = Kinds(start)
            started = time.perf_counter()
            system.save(version(i), state)
            seconds = time.perf_counter() - started
            peak = rss_status("VmHWM") - baseline
            sampled = kinds.stop()
            copies = max(before, _copies(system))
            rows.append({"seconds": seconds, "peak_bytes": peak, "copies_bytes": copies,
                         "working_bytes": peak - copies, **sampled})
    finally:
        system.close()
    (work / "checksums.json").write_text(json.dumps(checksums(state)))
    worst = max(rows, key=lambda r: r["working_bytes"])
    return {"state_bytes": state_bytes(state), "saves": rows,
            "peak_bytes": max(r["peak_bytes"] for r in rows),
            "working_bytes": worst["working_bytes"],
            "anon_peak_bytes": worst["anon_peak_bytes"],
            "file_peak_bytes": worst["file_peak_bytes"],
            "copies_bytes": max(r["copies_bytes"] for r in rows)}


def measure_async(system_name: str, mib: int, saves: int, work: Path) -> dict[str, Any] | None:
    """``saves`` async saves, the state changed while each is written; None where the
    system has no async save."""
    system = open_async(system_name, work / "async")
    if system is None:
        return None
    state = make_state(mib)
    step = DenseStep(state)
    copies = 0
    try:
        baseline = _baseline()
        kinds = Kinds()
        started = time.perf_counter()
        for i in range(saves):
            system.wait()  # at most one save in flight (a Checkpointer waits by itself)
            copies = max(copies, _copies(system))
            system.save(version(i), state)
            step()  # training goes on while the save is written
        system.wait()
        seconds = time.perf_counter() - started
        peak = rss_status("VmHWM") - baseline
        sampled = kinds.stop()
        copies = max(copies, _copies(system))
    finally:
        system.close()
        shutil.rmtree(work / "async", ignore_errors=True)
    staging = state_bytes(state)
    return {"state_bytes": staging, "seconds": seconds, "peak_bytes": peak,
            "staging_bytes": staging, "copies_bytes": copies,
            "working_bytes": peak - staging - copies, **sampled}


def _verified(tree: Any, work: Path) -> bool:
    expected = json.loads((work / "checksums.json").read_text())
    got = checksums(tree)
    return got.keys() == expected.keys() and all(got[k] == v for k, v in expected.items())


def measure_restore(system_name: str, mib: int, saves: int, work: Path, live: bool
                    ) -> dict[str, Any]:
    """The last version restored into a live state's tensors, or loaded into new objects."""
    state = make_state(mib) if live else None
    system = open_sync(system_name, work / "store")
    try:
        baseline = _baseline()
        kinds = Kinds()
        started = time.perf_counter()
        if state is not None:
            tree = system.restore(version(saves - 1), state)
        else:
            tree = system.load(version(saves - 1), ["model", "optimizer"])
        verified = _verified(tree, work)
        seconds = time.perf_counter() - started
        peak = rss_status("VmHWM") - baseline
        sampled = kinds.stop()
    finally:
        system.close()
    loaded = state_bytes(tree)
    return {"state_bytes": loaded, "seconds": seconds, "peak_bytes": peak,
            # new objects are the result, not overhead: the extra is what lies beyond them
            "extra_bytes": peak if live else peak - loaded, "verified": verified, **sampled}


def measure(operation: str, system: str, mib: int, saves: int, work: Path
            ) -> dict[str, Any] | None:
    if operation == "sync":
        return measure_sync(system, mib, saves, work)
    if operation == "async":
        return measure_async(system, mib, saves, work)
    return measure_restore(system, mib, saves, work, live=operation == "live")


def _measure_apart(operation: str, system: str, mib: int, saves: int, work: Path
                   ) -> dict[str, Any] | None:
    """:func:`measure` in a new process."""
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_memory_table", "--one", operation, system,
         str(mib), str(saves), str(work)],
        capture_output=True, text=True, check=False,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    if done.returncode != 0:
        raise RuntimeError(f"{operation} {system} {mib} MiB failed:\n{done.stderr[-4000:]}")
    measured: dict[str, Any] | None = json.loads(done.stdout)
    return measured


def run(systems: list[str], sizes: list[int], saves: int, work: Path) -> list[dict[str, Any]]:
    rows = []
    for mib in sizes:
        for system in systems:
            folder = work / f"{system}-{mib}"
            folder.mkdir(parents=True)
            row: dict[str, Any] = {"system": system, "mib": mib}
            try:
                for operation in OPERATIONS:
                    row[operation] = _measure_apart(operation, system, mib, saves, folder)
            finally:
                shutil.rmtree(folder, ignore_errors=True)
            row["state_bytes"] = row["sync"]["state_bytes"]
            rows.append(row)
            print(f"{system} {mib} MiB: done", file=sys.stderr)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", default="256,1024", help="state sizes in MiB, comma-separated")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/memory_table.json")
    parser.add_argument("--dir", type=Path, default=None, help="where the stores go")
    parser.add_argument("--one", nargs=5, metavar=("OPERATION", "SYSTEM", "MIB", "SAVES", "DIR"),
                        help=argparse.SUPPRESS)  # one measurement, printed (run() calls it)
    args = parser.parse_args(argv)
    if args.one:
        operation, system, mib, saves, folder = args.one
        print(json.dumps(measure(operation, system, int(mib), int(saves), Path(folder))))
        return
    started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="cs-memtable-", dir=args.dir))
    try:
        rows = run(args.systems.split(","), [int(s) for s in args.mib.split(",")],
                   args.saves, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    command = "python -m benchmarks.bench_memory_table" + "".join(
        f" {flag} {value}" for flag, value, default in (
            ("--mib", args.mib, "256,1024"), ("--systems", args.systems, ",".join(SYSTEMS)),
            ("--saves", args.saves, 3)) if value != default)
    result = {
        "command": command, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "platform": platform.platform(), "torch": torch.__version__},
        "saves": args.saves, "runtime_s": time.perf_counter() - started,
        "targets": {"restore_share": RESTORE_SHARE, "working_bytes": WORKING_BYTES},
        "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
