"""bench_scale's saves, two checkouts of chunkstore interleaved save by save (an A/B on a
shared machine).

bench_scale measures one checkout per run, and on a machine shared with other work the
load moves by more between two runs than a change moves a save.  Here a process per
checkout (``--before`` and ``--after``: repository roots, each put first on its
``PYTHONPATH``) saves through bench_scale's savers (this checkout's script) into fresh
copies of bench_scale's prepared stores (``--stores``: ``LABEL-base-N``, each index built
by the code that reads it), driven in lock-step: each round one save of every (checkout,
level), the order reversed every round, two warm-up rounds, then ``--saves`` timed; then
three saves each counted for the index's write transactions (LMDB's transaction id).
Every mode on fresh copies.  For example (run ``save-txn-3-interleaved-3`` in
benchmarks/results/scale.json, the prepared stores of bench_scale's runs
``save-txn-3-before`` and ``-after``)::

    python -m benchmarks.scale_ab --before /work/main --after . --stores DIR \\
        --before-label save-txn-3-before --after-label save-txn-3-after --saves 60 \\
        --out results.json
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

LEVELS = (100, 10_000)
MODES = ("store", "checkpointer_sync", "checkpointer_async", "dcp")
WARM_UP = 2
COUNTED = 3
SCRIPT = Path(__file__).resolve().parent / "bench_scale.py"


def worker(mode: str, places: list[str]) -> None:
    """One checkout's side: saves on command (``save LEVEL``: answers the seconds;
    ``txn LEVEL``: the index's committed write transactions so far)."""
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    import chunkstore  # the side's checkout, first on PYTHONPATH
    # This checkout's bench_scale, whichever chunkstore it drives.
    spec = importlib.util.spec_from_file_location("bench_scale_ab", SCRIPT)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench_scale_ab"] = bench
    spec.loader.exec_module(bench)
    with contextlib.ExitStack() as stack:
        savers = {}
        for place in places:
            level, path = place.split("=", 1)
            savers[int(level)] = stack.enter_context(
                bench.saver(mode, bench.Location(path), int(level)))
        print(json.dumps({"ready": chunkstore.__file__}), flush=True)
        for line in sys.stdin:
            command, level = line.split()
            each = savers[int(level)]
            if command == "txn":
                print(json.dumps({"txn": each.index_transactions()}), flush=True)
                continue
            started = time.perf_counter()
            each.save()
            print(json.dumps({"s": time.perf_counter() - started}), flush=True)


class Side:
    """A worker process of one checkout, with its copies of the stores."""

    def __init__(self, root: Path, label: str, stores: Path, mode: str, scratch: Path) -> None:
        self.copies = []
        places = []
        for level in LEVELS:
            copy = scratch / f"{label}-{level}"
            shutil.rmtree(copy, ignore_errors=True)
            shutil.copytree(stores / f"{label}-base-{level}", copy, symlinks=True)
            self.copies.append(copy)
            places.append(f"{level}={copy}")
        # Run as a file, so that the checkout on PYTHONPATH comes before any in the working
        # directory (``-m`` would put that first).
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--worker", mode, *places],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": str(root)})
        self.code = self.read()["ready"]

    def read(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError("a worker ended early")
        found: dict[str, Any] = json.loads(line)
        return found

    def ask(self, command: str, level: int) -> Any:
        assert self.process.stdin is not None
        self.process.stdin.write(f"{command} {level}\n")
        self.process.stdin.flush()
        return next(iter(self.read().values()))

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait()
        for copy in self.copies:
            shutil.rmtree(copy, ignore_errors=True)


def measure(sides: dict[str, Side], saves: int) -> dict[str, Any]:
    times: dict[tuple[str, int], list[float]] = {(s, n): [] for s in sides for n in LEVELS}
    for round_ in range(WARM_UP + saves):
        order = [(name, n) for name in sides for n in LEVELS]
        for name, level in order[::-1] if round_ % 2 else order:
            seconds = sides[name].ask("save", level)
            if round_ >= WARM_UP:
                times[(name, level)].append(seconds)
    found = {}
    for name, worker_side in sides.items():
        medians = {n: statistics.median(times[(name, n)]) * 1e3 for n in LEVELS}
        transactions = {}
        for level in LEVELS:
            first = worker_side.ask("txn", level)
            for _ in range(COUNTED):
                worker_side.ask("save", level)
            last = worker_side.ask("txn", level)
            transactions[str(level)] = None if first is None else (last - first) / COUNTED
        found[name] = {
            "code": worker_side.code,
            "median_ms": {str(n): round(m, 2) for n, m in medians.items()},
            "p90_ms": {str(n): round(sorted(times[(name, n)])[int(0.9 * (saves - 1))] * 1e3, 2)
                       for n in LEVELS},
            "ratio_10000_to_100": round(medians[LEVELS[-1]] / medians[LEVELS[0]], 3),
            "index_transactions_per_save": transactions}
    return found


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2], sys.argv[3:])
        return
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--before", type=Path, required=True)
    parser.add_argument("--after", type=Path, required=True)
    parser.add_argument("--stores", type=Path, required=True)
    parser.add_argument("--before-label", required=True)
    parser.add_argument("--after-label", required=True)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--saves", type=int, default=60)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    found = {}
    for mode in args.modes:
        sides: dict[str, Side] = {}
        try:
            for name, root, label in (("before", args.before, args.before_label),
                                      ("after", args.after, args.after_label)):
                sides[name] = Side(root.resolve(), label, args.stores, mode, args.stores)
            found[mode] = measure(sides, args.saves)
        finally:
            for side in sides.values():
                side.close()
        for name, result in found[mode].items():
            print(mode, name, json.dumps(result), flush=True)
    args.out.write_text(json.dumps(found, indent=1) + "\n")


if __name__ == "__main__":
    main()
