"""What a save does more at 10,000 versions than at 100: bench_scale's saves profiled side
by side (issue 49).

One mode's saves at two levels (``--levels``, default 100 and 10,000) on fresh copies of
bench_scale's prepared stores (``--stores DIR --label LABEL``: ``LABEL-base-N``, as a
``bench_scale --label LABEL`` run leaves them), taking the levels in turn, the order
reversed every round, each save under cProfile: the calling thread's and every thread
pool task's it starts while it runs (the async Checkpointer's background save, the
parallel existence checks), CPU time per thread with ``--cpu`` (the load of a shared
machine moves wall time by more than a level does).  Printed per level: the median
save, the requests per save (bench_scale's counting backend, installed before the timed
saves: it makes each local write durable on its own, so its times are not
bench_scale's); then the functions whose calls per save differ between the levels (a
listing or a lookup that follows the history shows here), and those whose own time and
cumulative time per save grew most.  For example (the figures in docs/performance.md,
"Saves at 10,000 versions")::

    python -m benchmarks.scale_profile --mode checkpointer_async --saves 150 \\
        --stores DIR --label saves-10k-interleaved-2 --cpu
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import shutil
import statistics
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import thread as pool_threads
from pathlib import Path
from typing import Any

from benchmarks import bench_scale

Row = tuple[Any, float, float, float, float, float, float]


@contextlib.contextmanager
def pool_tasks_profiled(current: Callable[[], cProfile.Profile | None]) -> Iterator[None]:
    """Within: every thread pool task runs under ``current()``'s profile, where it names
    one (a profile object per thread: cProfile's state is the enabling thread's)."""
    original = pool_threads._WorkItem.run

    def run(item: Any) -> None:
        profile = current()
        if profile is None:
            original(item)
            return
        profile.enable()
        try:
            original(item)
        finally:
            profile.disable()
    pool_threads._WorkItem.run = run  # type: ignore[method-assign]
    try:
        yield
    finally:
        pool_threads._WorkItem.run = original  # type: ignore[method-assign]


def profile_saves(mode: str, sources: dict[int, Path], scratch: Path, saves: int,
                  timer: Callable[[], float]) -> dict[int, pstats.Stats]:
    levels = sorted(sources)
    callers = {level: cProfile.Profile(timer) for level in levels}
    # One profile per pool thread and level: a profile enabled in two threads at once
    # mixes their call stacks.
    tasks: dict[tuple[int, int], cProfile.Profile] = {}
    running: list[int] = []

    def task_profile() -> cProfile.Profile | None:
        if not running:
            return None
        key = (running[0], threading.get_ident())
        return tasks.setdefault(key, cProfile.Profile(timer))
    with bench_scale.fresh_copies(sources, scratch) as places, contextlib.ExitStack() as stack:
        savers = {level: stack.enter_context(bench_scale.saver(mode, places[level], level))
                  for level in levels}
        counts = {level: savers[level].counting() for level in levels}
        for _ in range(bench_scale.WARM_UP):
            for each in savers.values():
                each.save()
        for count in counts.values():
            count.clear()  # one Counter for dcp_url: every store it opens
        times: dict[int, list[float]] = {level: [] for level in levels}
        stack.enter_context(pool_tasks_profiled(task_profile))
        for round_ in range(saves):
            for level in levels[::-1] if round_ % 2 else levels:
                running.append(level)
                started = time.perf_counter()
                callers[level].enable()
                savers[level].save()
                callers[level].disable()
                times[level].append(time.perf_counter() - started)
                running.clear()
        shared = len({id(c) for c in counts.values()}) == 1
        for level in levels:
            per_save = {op: round(n / saves / (len(levels) if shared else 1), 2)
                        for op, n in sorted(counts[level].items())}
            print(f"{level:>6} versions: median {statistics.median(times[level]) * 1e3:.2f} ms,"
                  f" requests per save {per_save}")
    found = {}
    for level in levels:
        stats = pstats.Stats(callers[level])
        for (at, _), profile in tasks.items():
            if at == level:
                stats.add(profile)
        found[level] = stats
    return found


def compare(low: pstats.Stats, high: pstats.Stats, saves: int, top: int) -> None:
    """Print what differs per save between the levels' profiles."""
    lows: dict[Any, Any] = low.stats  # type: ignore[attr-defined]
    highs: dict[Any, Any] = high.stats  # type: ignore[attr-defined]
    none = (0, 0, 0.0, 0.0, {})
    rows: list[Row] = []
    for function in set(lows) | set(highs):
        a, b = lows.get(function, none), highs.get(function, none)
        rows.append((function, a[1] / saves, b[1] / saves, a[2] / saves * 1e3,
                     b[2] / saves * 1e3, a[3] / saves * 1e3, b[3] / saves * 1e3))
    name = pstats.func_std_string
    print("calls per save that differ by half a call or more (low, high level):")
    for row in sorted(rows, key=lambda r: -abs(r[2] - r[1])):
        if abs(row[2] - row[1]) < 0.5:
            break
        print(f"  {row[1]:9.1f} {row[2]:9.1f}  {name(row[0])}")
    for title, low_at, high_at in (("own", 3, 4), ("cumulative", 5, 6)):
        print(f"{title} time per save, ms, the largest growth (low, high level; calls):")
        for row in sorted(rows, key=lambda r: -(r[high_at] - r[low_at]))[:top]:
            print(f"  {row[low_at]:8.3f} {row[high_at]:8.3f}  {row[1]:7.1f} {row[2]:7.1f}"
                  f"  {name(row[0])}")
    print("profiled own time per save, ms:", {which: round(sum(
        v[2] for v in stats.values()) / saves * 1e3, 2)
        for which, stats in (("low", lows), ("high", highs))})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--mode", choices=bench_scale.MODES, required=True)
    parser.add_argument("--levels", type=int, nargs=2, default=[100, 10_000])
    parser.add_argument("--saves", type=int, default=150, help="profiled saves per level")
    parser.add_argument("--stores", type=Path, required=True)
    parser.add_argument("--label", required=True,
                        help="the bench_scale run whose prepared stores to copy")
    parser.add_argument("--cpu", action="store_true", help="each thread's CPU time, not wall")
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    sources = {level: args.stores / f"{args.label}-base-{level}" for level in args.levels}
    for source in sources.values():
        if not (source / "ready").exists():
            parser.error(f"{source} is no prepared store: run bench_scale --label"
                         f" {args.label} --stores {args.stores} with these levels first")
    scratch = Path(tempfile.mkdtemp(prefix="scale-profile-", dir=args.stores))
    try:
        found = profile_saves(args.mode, sources, scratch, args.saves,
                              time.thread_time if args.cpu else time.perf_counter)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    low, high = sorted(found)
    compare(found[low], found[high], args.saves, args.top)


if __name__ == "__main__":
    main()
