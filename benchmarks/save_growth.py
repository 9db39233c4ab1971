"""Whether a save costs more the more saves the process made before it (issue 49).

bench_scale's saves, each mode into a fresh copy of one store (``--store``, e.g. its
``base-100``), ``--saves`` of them in one process after two warm-up saves: the CPU time
of the process in each save (every thread's: what other work on a shared machine moves
least) and, for ``dcp_url`` (the DCP writer given the store's path), the calling
thread's in each save's open of the store (``chunkstore.open``: its reconcile from the
publication markers).  Reported per mode: the medians of the first and the last
``--block`` saves and their difference, and the file descriptors and threads of the
process after the warm-up and after the saves (a handle or a thread left behind by each
save shows there).

The figures in benchmarks/results/save_growth.json (2-core machine shared with other
sessions; the code before from a worktree of it, the same script)::

    python -m benchmarks.save_growth --store DIR/base-100 --label after \\
        --out benchmarks/results/save_growth.json
    cd /work/before && PYTHONPATH=/work/before python /work/main/benchmarks/save_growth.py \\
        --store DIR/base-100 --label before --out /work/main/benchmarks/results/save_growth.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import chunkstore
from benchmarks import bench_scale


def cpu_of(call: Callable[[], Any], into: list[float],
           clock: Callable[[], float] = time.process_time) -> Any:
    """``call()``, the CPU seconds it took appended to ``into``: the process's (every
    thread's), or the calling thread's with ``clock=time.thread_time``."""
    started = clock()
    try:
        return call()
    finally:
        into.append(clock() - started)


def held() -> dict[str, int]:
    return {"fds": len(os.listdir("/proc/self/fd")), "threads": threading.active_count()}


def first_and_last(seconds: list[float], block: int) -> dict[str, float]:
    first, last = (statistics.median(part) * 1e3 for part in (seconds[:block],
                                                               seconds[-block:]))
    return {"first_ms": round(first, 3), "last_ms": round(last, 3),
            "growth_ms": round(last - first, 3)}


def measure(mode: str, store: Path, saves: int, block: int) -> dict[str, Any]:
    scratch = Path(tempfile.mkdtemp(prefix="save-growth-"))
    opens: list[float] = []
    original = chunkstore.open

    def timed_open(*args: Any, **kwargs: Any) -> chunkstore.Store:
        return cpu_of(lambda: original(*args, **kwargs), opens, time.thread_time)  # type: ignore[no-any-return]
    try:
        work = scratch / "store"
        shutil.copytree(store, work, symlinks=True)
        with chunkstore.open(work) as opened:
            first_step = bench_scale.stored_versions(opened)  # run "r"'s next step
        with bench_scale.saver(mode, bench_scale.Location(str(work)), first_step) as each:
            for _ in range(bench_scale.WARM_UP):
                each.save()
            before = held()
            setattr(chunkstore, "open", timed_open)  # noqa: B010 - the writer's opens
            opens.clear()
            cpu: list[float] = []
            for _ in range(saves):
                cpu_of(each.save, cpu)
            setattr(chunkstore, "open", original)  # noqa: B010
            found: dict[str, Any] = {"save_cpu": first_and_last(cpu, block),
                                     "held_after_warm_up": before, "held_after": held()}
            if len(opens) == saves:  # one open a save: dcp_url
                found["open_cpu"] = first_and_last(opens, block)
            return found
    finally:
        setattr(chunkstore, "open", original)  # noqa: B010
        shutil.rmtree(scratch, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--store", type=Path, required=True, help="a store to copy")
    parser.add_argument("--modes", nargs="+", choices=bench_scale.MODES,
                        default=list(bench_scale.MODES))
    parser.add_argument("--saves", type=int, default=300)
    parser.add_argument("--block", type=int, default=50)
    parser.add_argument("--label", default="after")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    code = Path(chunkstore.__file__).resolve().parent.parent
    run: dict[str, Any] = {"chunkstore": bench_scale.commit_of(code), "saves": args.saves,
                           "block": args.block, "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
                           "modes": {}}
    for mode in args.modes:
        run["modes"][mode] = found = measure(mode, args.store, args.saves, args.block)
        print(f"{args.label} {mode:<20} {json.dumps(found)}", flush=True)
    if args.out is not None:
        existing = json.loads(args.out.read_text()) if args.out.exists() else {}
        existing.setdefault("runs", {})[args.label] = run
        args.out.write_text(json.dumps(existing, indent=2) + "\n")


if __name__ == "__main__":
    main()
