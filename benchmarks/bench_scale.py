"""A save's cost against the history in the store (issue 49): 100, 1,000, 10,000 versions.

A job that saves every few minutes for weeks holds thousands of versions; what one
save costs must follow what changed, not how many versions came before it.  The
workload: a state of 20 small tensors (1,024 float32 each), one of them changed
per save, saved into run ``r`` of a store that already holds N versions of it
(built by real saves of the same state, once, under ``--stores``).  Through:

- ``store``: ``store.new_version`` (the low-level API), a sync save;
- ``checkpointer_sync``: ``torch_bridge.Checkpointer(store, run="r")`` (run lease,
  RNG state, no ``keep_last``, so versions accumulate);
- ``checkpointer_async``: the same with ``async_save=True``: the whole save
  (``save`` + ``wait``) and the training pause (``save`` alone);
- ``dcp``: ``dcp.save`` through ``ChunkStoreWriter`` given the open store (world
  size 1, no process group);
- ``dcp_url``: the same given the store's path, so each save opens the store: its
  ``reconcile`` lists the recent publication markers, not every commit record
  (chunkstore.protocol.published; every version at most each 10 minutes).

Each mode runs on a fresh copy of each level's store, all levels at once: two
warm-up saves each, then ``--saves`` timed saves taking the levels in turn, the
order reversed every round (the machine's load, which moves from minute to minute
on a shared 2-core machine, falls on every level alike), the median reported, of
the seconds and of the process's CPU time (every thread's: what other work on the
machine moves least), and with ``--saves`` of two ``--block`` or more the ratio of
the levels' medians in each block of rounds (the run's own spread); then
``--count`` saves through
a :class:`~chunkstore.backends.wrappers.ForwardingBackend` that counts requests by
operation (the heartbeat threads' left out: they come per 10-30 s, not per save),
and the write transactions of the store's index they commit (LMDB's transaction id:
each is a commit and a sync; not for ``dcp_url``).
Timing and counting are separate passes: on a local disk the wrapper makes each
write durable on its own, which would change the times.  With ``--s3`` the same
on a moto S3 server on loopback (each level's store uploaded to a bucket of its
own, with a copy of its index; the modes in turn on it).

The script measures whatever ``chunkstore`` it imports, so the code before a change
is measured from a checkout of it (``git worktree add /work/before <commit>``) with
the same script and stores; each run is recorded under its ``--label`` in the
results file, beside the others.  The results in benchmarks/results/scale.json come
from (2-core machine; the stores, built once, take about 1.2 GB; about 25 minutes
for the code after, 45 before)::

    python -m benchmarks.bench_scale --label after --s3 --stores /tmp/scale-stores \
        --out benchmarks/results/scale.json
    cd /work/before && PYTHONPATH=/work/before python /work/main/benchmarks/bench_scale.py \
        --label before --s3 --stores /tmp/scale-stores \
        --out /work/main/benchmarks/results/scale.json

``--quick`` measures at 100 and 1,000 versions with fewer saves (a few minutes).

Whether a save at 10,000 versions stays within 1.1x of one at 100 needs hundreds of
saves per level: two runs of 30 differ by up to 0.25 in the ratio on a shared
machine.  Runs ``saves-10k-interleaved-*`` in scale.json (about 10 minutes here, the
stores built once)::

    python -m benchmarks.bench_scale --label saves-10k-interleaved-N --levels 100 10000 \
        --modes store checkpointer_sync checkpointer_async dcp dcp_url --no-removal \
        --saves 500 --stores DIR --out benchmarks/results/scale.json

The removal columns (benchmarks/scale_removal.py: a prune of 1,000 versions, an idle
GC and a GC after the prune, at the version levels and at stores of 10k, 100k and,
locally, 1M tiny objects) follow the saves; ``--removal-only`` measures them alone,
``--no-removal`` leaves them out.  The reduced run in scale.json (about 15 minutes
here, the stores built once)::

    python -m benchmarks.bench_scale --label removal-quick --removal-only --quick --s3 \
        --stores /tmp/scale-stores --out benchmarks/results/scale.json

The S3 columns at 10k, 100k and 1M objects (runs ``s3-objects-10k-100k`` and
``s3-objects-1m``; each level's store is put straight into a moto server's memory,
benchmarks/moto_filled.py, see ``--s3-fill``; the million-object store takes about
18 minutes to build here, once, and 8.4 GB of disk)::

    python -m benchmarks.bench_scale --label s3-objects-1m --removal-only --levels 100 \
        --object-levels --s3 --s3-object-levels 1000000 --s3-fill insert-sorted \
        --stores /tmp/scale-stores --out benchmarks/results/scale.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import chunkstore
from chunkstore.backends.wrappers import RequestHook

TENSORS = 20
ELEMENTS = 1024
RUN = "r"
LEVELS = (100, 1000, 10_000)
QUICK_LEVELS = (100, 1000)
#: Stores of this many tiny objects for the removal columns (benchmarks/scale_removal.py);
#: on the moto server a million only with ``--s3-fill insert-sorted``: uploading it
#: takes hours there, and moto's own listings sort the whole bucket for every page.
OBJECT_LEVELS = (10_000, 100_000, 1_000_000)
QUICK_OBJECT_LEVELS = (10_000, 100_000)
S3_OBJECT_LEVELS = (10_000, 100_000)
QUICK_S3_OBJECT_LEVELS = (10_000,)
MODES = ("store", "checkpointer_sync", "checkpointer_async", "dcp", "dcp_url")
#: Threads whose requests come per second, not per save (heartbeats, a collection).
BACKGROUND = ("chunkstore-run-lease", "chunkstore-read-leases", "chunkstore-session",
              "chunkstore-gc-entry", "chunkstore-collect")
WARM_UP = 2
#: Rounds per block whose medians are reported beside the run's (``--block``; with
#: ``--saves`` of at least two blocks): the spread of the blocks' ratios is the run's
#: noise, what it cannot decide.
BLOCK = 50


#: Keys an S3 LIST request returns at most: a listing of n keys takes ceil(n / 1000).
LIST_PAGE = 1000


class Counting(RequestHook):
    """Counts requests by operation: ``list`` the listings, ``list_pages`` the LIST
    requests they take on S3 (:data:`LIST_PAGE` keys each, at least one),
    ``delete_many`` the bulk deletes (one per 1,000 keys); the :data:`BACKGROUND`
    threads' requests are not counted."""

    def __init__(self, inner: Any, counts: Counter[str] | None = None) -> None:
        super().__init__(inner)
        self.counts: Counter[str] = Counter() if counts is None else counts
        self._lock = threading.Lock()

    def _count(self, operation: str, times: int = 1) -> None:
        if not threading.current_thread().name.startswith(BACKGROUND):
            with self._lock:
                self.counts[operation] += times

    def request(self, operation: str, key: str) -> None:
        self._count(operation)

    def listed(self, prefix: str, count: int) -> None:
        self._count("list_pages", max(1, -(-count // LIST_PAGE)))


class Workload:
    """20 small tensors; each save changes the next one (numpy, or torch for the
    Checkpointer and DCP)."""

    def __init__(self, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.arrays = {f"t{i}": rng.standard_normal(ELEMENTS).astype(np.float32)
                       for i in range(TENSORS)}

    def advance(self, step: int) -> None:
        name = f"t{step % TENSORS}"
        self.arrays[name] = self.arrays[name] + 1

    def state_dict(self) -> dict[str, Any]:
        import torch
        return {name: torch.from_numpy(array) for name, array in self.arrays.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.arrays = {name: np.asarray(value) for name, value in state.items()}


def save_plain(store: chunkstore.Store, workload: Workload, step: int) -> None:
    workload.advance(step)
    with store.new_version(run=RUN, step=step) as version:
        for name, array in workload.arrays.items():
            version.put(name, array)


def stored_versions(store: chunkstore.Store) -> int:
    return len(store.stored_version_ids())


# --- the stores ------------------------------------------------------------------------------


def build(stores: Path, levels: tuple[int, ...]) -> dict[int, Path]:
    """``base-N`` for each level, each grown from the one below it by real saves."""
    bases: dict[int, Path] = {}
    below: Path | None = None
    for level in sorted(levels):
        base = stores / f"base-{level}"
        done = base / "done"
        if not (done.exists() and done.read_text() == str(level)):
            if below is not None and not base.exists():
                # Not the level's "done": a build killed partway must not read as finished.
                shutil.copytree(below, base, symlinks=True,
                                ignore=shutil.ignore_patterns("done"))
            with chunkstore.open(base, create=True) as store:
                workload = Workload()
                held = stored_versions(store)
                for step in range(held):
                    workload.advance(step)
                started = time.perf_counter()
                for step in range(held, level):
                    save_plain(store, workload, step)
                    if step % 1000 == 999:
                        print(f"  built {step + 1} versions ({time.perf_counter() - started:.0f}"
                              " s)", flush=True)
            (base / "done").write_text(str(level))
        bases[level] = base
        below = base
    return bases


def prepared(stores: Path, base: Path, label: str) -> Path:
    """The base store with an index the code under test built itself (the index is a
    cache; another release's is rebuilt anyway): made once per label."""
    target = stores / f"{label}-{base.name}"
    if not (target / "ready").exists():
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(base, target, symlinks=True, ignore=shutil.ignore_patterns("index"))
        started = time.perf_counter()
        chunkstore.open(target).close()  # counts every version in
        print(f"  {label}: index of {base.name} built in {time.perf_counter() - started:.1f} s",
              flush=True)
        (target / "ready").write_text(label)
    return target


@contextlib.contextmanager
def fresh_copies(sources: dict[int, Path], scratch: Path) -> Iterator[dict[int, Location]]:
    """A fresh copy of each level's store, removed afterwards."""
    works = {level: scratch / f"work-{level}" for level in sources}
    try:
        for level, source in sources.items():
            shutil.rmtree(works[level], ignore_errors=True)
            shutil.copytree(source, works[level], symlinks=True)
        yield {level: Location(str(work)) for level, work in works.items()}
    finally:
        for work in works.values():
            shutil.rmtree(work, ignore_errors=True)


# --- the saves --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Location:
    """Where a mode saves: a store's URL, its storage options and its index directory."""

    url: str
    options: dict[str, Any] | None = None
    index_dir: str | None = None

    def open(self) -> chunkstore.Store:
        return chunkstore.open(self.url, storage_options=self.options, index_dir=self.index_dir)


class Saver:
    """One mode's saves into one store, from ``first_step`` on: :meth:`save` returns the
    training pause where it differs from the save (the async Checkpointer)."""

    def __init__(self, save: Callable[[int], float | None],
                 counting: Callable[[], Counter[str]], first_step: int,
                 store: chunkstore.Store | None = None) -> None:
        self._save, self.counting, self.step = save, counting, first_step
        self._store = store

    def index_transactions(self) -> int | None:
        """Write transactions the store's index has committed so far (LMDB's own count:
        each is a commit and a sync of the index file); None where a save opens a store
        of its own (``dcp_url``)."""
        return None if self._store is None else int(self._store.index.env.info()["last_txnid"])

    def save(self) -> float | None:
        pause = self._save(self.step)
        self.step += 1
        return pause


@contextlib.contextmanager
def saver(mode: str, where: Location, first_step: int) -> Iterator[Saver]:
    workload = Workload()
    for step in range(first_step):
        workload.advance(step)
    with contextlib.ExitStack() as stack:
        store = stack.enter_context(where.open())
        if mode == "store":
            yield Saver(lambda step: save_plain(store, workload, step), wrap(store), first_step,
                        store)
            return
        if mode.startswith("checkpointer"):
            from torch_bridge import Checkpointer
            ckpt = stack.enter_context(Checkpointer(store, run=RUN,
                                                    async_save=mode.endswith("async")))

            def checkpoint(step: int) -> float:
                workload.advance(step)
                started = time.perf_counter()
                ckpt.save(step, state=workload)
                pause = time.perf_counter() - started
                ckpt.wait()
                return pause
            yield Saver(checkpoint, wrap(store), first_step, store)
            return
        from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

        from torch_bridge.dcp import ChunkStoreWriter
        count_opens = stack.enter_context(opens_counted())

        def through_dcp(step: int) -> None:
            workload.advance(step)
            # dcp_url: the writer opens the store (and reconciles its index) per save
            writer = (ChunkStoreWriter(store, run=RUN, step=step) if mode == "dcp" else
                      ChunkStoreWriter(where.url, run=RUN, step=step,
                                       storage_options=where.options, index_dir=where.index_dir))
            dcp_save(workload.state_dict(), storage_writer=writer)
        yield Saver(through_dcp, wrap(store) if mode == "dcp" else count_opens, first_step,
                    store if mode == "dcp" else None)


def measure(savers: dict[int, Saver], saves: int, count: int, block: int = BLOCK
            ) -> dict[int, dict[str, Any]]:
    """Warm-up saves, then the timed saves (:func:`timed_rounds`), then the counted ones;
    the medians of each ``block`` rounds too (their spread is the run's noise)."""
    for _ in range(WARM_UP):
        for each in savers.values():
            each.save()
    times, cpu, pauses = timed_rounds(savers, saves)
    found = {}
    for level, each in savers.items():
        counts = each.counting()
        committed = each.index_transactions()
        for _ in range(count):
            each.save()
        found[level] = summary(times[level], pauses[level], counts, count)
        found[level]["median_cpu_ms"] = round(statistics.median(cpu[level]) * 1e3, 2)
        if saves >= 2 * block:
            found[level]["block_medians_ms"] = block_medians(times[level], block)
            found[level]["block_cpu_medians_ms"] = block_medians(cpu[level], block)
        after = each.index_transactions()
        if committed is not None and after is not None:
            found[level]["index_transactions_per_save"] = round((after - committed) / count, 2)
    return found


Samples = dict[int, list[float]]


def timed_rounds(savers: dict[int, Saver], saves: int) -> tuple[Samples, Samples, Samples]:
    """``saves`` rounds of one save at every level, the order reversed every round (so
    that the load of the machine, which moves, and whatever one save leaves to the next
    fall on every level alike): per level the seconds of each save, the process's CPU
    seconds in it (every thread's: an async save's background included; what the
    machine's other work does not move) and the training pauses where a mode has them."""
    times: Samples = {level: [] for level in savers}
    cpu: Samples = {level: [] for level in savers}
    pauses: Samples = {level: [] for level in savers}
    order = list(savers.items())
    for round_ in range(saves):
        for level, each in order[::-1] if round_ % 2 else order:
            started, started_cpu = time.perf_counter(), time.process_time()
            pause = each.save()
            times[level].append(time.perf_counter() - started)
            cpu[level].append(time.process_time() - started_cpu)
            if pause is not None:
                pauses[level].append(pause)
    return times, cpu, pauses


def block_medians(seconds: list[float], block: int) -> list[float]:
    """The median of each whole block of ``block`` samples, in ms."""
    return [round(statistics.median(seconds[start:start + block]) * 1e3, 3)
            for start in range(0, len(seconds) - block + 1, block)]


def summary(times: list[float], pauses: list[float], counts: Counter[str], count: int
            ) -> dict[str, Any]:
    result: dict[str, Any] = {
        "saves": len(times), "median_ms": round(statistics.median(times) * 1e3, 2),
        "p90_ms": round(sorted(times)[int(0.9 * (len(times) - 1))] * 1e3, 2),
        "requests_per_save": {op: round(n / count, 2) for op, n in sorted(counts.items())},
        # every request, a listing counted by its pages
        "requests_total_per_save": round(sum(n for op, n in counts.items() if op != "list")
                                         / count, 2)}
    if pauses:
        result["median_pause_ms"] = round(statistics.median(pauses) * 1e3, 2)
    return result


def wrap(store: chunkstore.Store) -> Callable[[], Counter[str]]:
    """Counting from now on, for the counted saves (after the timed ones)."""
    def install() -> Counter[str]:
        counter = Counting(store.backend)
        store.backend = counter
        return counter.counts
    return install


@contextlib.contextmanager
def opens_counted() -> Iterator[Callable[[], Counter[str]]]:
    """Within: a callable that counts in every store opened from then on (``dcp_url``
    opens one per save), through the facade's backend wrapping hook, one shared count;
    the hook is put back on the way out."""
    import chunkstore.store as facade
    counts: Counter[str] = Counter()
    original = getattr(facade, "wrap_from_env")  # noqa: B009 - not exported

    def counted(backend: Any, environ: Any = None) -> Any:
        return Counting(original(backend, environ), counts)

    def install() -> Counter[str]:
        setattr(facade, "wrap_from_env", counted)  # noqa: B010 - as above
        return counts
    try:
        yield install
    finally:
        setattr(facade, "wrap_from_env", original)  # noqa: B010


def measure_modes(places: dict[int, Location], modes: list[str], saves: int, count: int,
                  first_steps: Callable[[int, int], int], label: str = "",
                  block: int = BLOCK) -> dict[str, dict[str, Any]]:
    """Every mode at every level (levels interleaved); ``first_steps(level, mode index)``
    is where a mode's saves begin."""
    found: dict[str, dict[str, Any]] = {str(level): {} for level in places}
    for number, mode in enumerate(modes):
        with contextlib.ExitStack() as stack:
            savers = {level: stack.enter_context(saver(mode, where, first_steps(level, number)))
                      for level, where in places.items()}
            measured = measure(savers, saves, count, block)
        for level, result in measured.items():
            found[str(level)][mode] = result
            report(level, f"{label}{mode}", result)
    return found


def store_files(source: Path) -> list[Path]:
    """The files of a local store that a bucket holding it holds (not its index, nor
    the marks this benchmark leaves beside them)."""
    return [path for path in sorted(source.rglob("*")) if path.is_file()
            and path.relative_to(source).parts[0] not in ("index", "done", "ready")]


@contextlib.contextmanager
def on_s3(endpoint: str, sources: dict[int, Path]) -> Iterator[dict[int, Location]]:
    """A bucket per level holding its store's objects (uploaded), each with a copy of
    the store's index (it describes the same store); removed afterwards."""
    import s3fs

    from tests.s3server import create_bucket, remove_bucket, storage_options
    options = storage_options(endpoint)
    scratch = Path(tempfile.mkdtemp(prefix="bench-scale-s3-index-"))
    buckets: list[str] = []
    try:
        places = {}
        for level, source in sources.items():
            buckets.append(create_bucket(endpoint))
            files = store_files(source)
            started = time.perf_counter()
            s3fs.S3FileSystem(**options).put(
                [str(path) for path in files],
                [f"{buckets[-1]}/store/{path.relative_to(source).as_posix()}" for path in files])
            print(f"  s3: {len(files)} objects of {source.name} uploaded in"
                  f" {time.perf_counter() - started:.0f} s", flush=True)
            shutil.copytree(source / "index", scratch / f"index-{level}")
            places[level] = Location(f"s3://{buckets[-1]}/store", options,
                                     str(scratch / f"index-{level}"))
        yield places
    finally:
        for bucket in buckets:
            remove_bucket(endpoint, bucket)
        shutil.rmtree(scratch, ignore_errors=True)


def report(level: int, mode: str, found: dict[str, Any]) -> None:
    print(f"  {level:>6} versions  {mode:<22} {found['median_ms']:8.2f} ms"
          f"  {found['requests_total_per_save']:6.2f} requests/save", flush=True)


# --- the report -------------------------------------------------------------------------------


def commit_of(root: Path) -> str:
    try:
        return subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def ratios(levels: dict[str, dict[str, Any]], key: str = "median_ms") -> dict[str, float]:
    """Median save at the highest level / at the lowest, per mode (``key``: the median of
    the saves' seconds, or ``median_cpu_ms`` of their CPU time)."""
    keys = sorted(levels, key=int)
    low, high = levels[keys[0]], levels[keys[-1]]
    return {mode: round(high[mode][key] / low[mode][key], 2)
            for mode in high if mode in low}


def block_ratios(levels: dict[str, dict[str, Any]], key: str = "block_medians_ms"
                 ) -> dict[str, dict[str, Any]]:
    """Per mode, the ratio of the highest level's median to the lowest's in each block of
    :data:`BLOCK` rounds (both levels' saves of one block ran side by side), with their
    range; ``key`` names the block medians (the saves' seconds, or
    ``block_cpu_medians_ms`` their CPU time)."""
    keys = sorted(levels, key=int)
    low, high = levels[keys[0]], levels[keys[-1]]
    found = {}
    for mode in high:
        if key not in high[mode] or mode not in low:
            continue
        each = [round(h / lo, 3) for h, lo in zip(high[mode][key], low[mode][key], strict=True)]
        found[mode] = {"blocks": each, "min": min(each), "max": max(each),
                       "median": round(statistics.median(each), 3)}
    return found


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--label", default="after", help="the key of this run in --out")
    parser.add_argument("--levels", type=int, nargs="+", default=None)
    parser.add_argument("--saves", type=int, default=30, help="timed saves per mode and level")
    parser.add_argument("--count", type=int, default=5, help="counted saves per mode and level")
    parser.add_argument("--block", type=int, default=BLOCK,
                        help="rounds per block: with --saves of two blocks or more, the ratio"
                        " of the levels' medians in each block too (the run's spread)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--quick", action="store_true",
                        help="100 and 1,000 versions, 10 timed saves, 3 counted")
    parser.add_argument("--s3", action="store_true",
                        help="also on a moto S3 server (each level's store uploaded to it)")
    parser.add_argument("--s3-levels", type=int, nargs="+", default=None,
                        help="the levels measured on S3 (default: --levels)")
    parser.add_argument("--s3-saves", type=int, default=10)
    parser.add_argument("--stores", type=Path, default=None,
                        help="where the stores are built and kept (default: a temporary"
                        " directory, removed afterwards)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--removal-only", action="store_true",
                        help="only the removal columns (a prune of 1,000 versions, an idle GC,"
                        " a GC after the prune: benchmarks/scale_removal.py), not the saves")
    parser.add_argument("--no-removal", action="store_true", help="only the saves")
    parser.add_argument("--object-levels", type=int, nargs="*", default=None,
                        help="stores of this many tiny objects for the removal columns"
                        f" (default {' '.join(map(str, OBJECT_LEVELS))}; --quick"
                        f" {' '.join(map(str, QUICK_OBJECT_LEVELS))})")
    parser.add_argument("--s3-object-levels", type=int, nargs="*", default=None,
                        help=f"the object levels on S3 (default"
                        f" {' '.join(map(str, S3_OBJECT_LEVELS))}, with --s3-fill"
                        f" insert-sorted {' '.join(map(str, OBJECT_LEVELS))}; --quick"
                        f" {' '.join(map(str, QUICK_S3_OBJECT_LEVELS))})")
    parser.add_argument("--s3-fill", choices=("upload", "insert", "insert-sorted"),
                        default="upload", help="how the S3 object levels' stores get into"
                        " their buckets: uploaded over HTTP, or inserted into the moto"
                        " server's memory (with insert-sorted its listings walk only their"
                        " page: benchmarks/moto_filled.py)")
    return parser.parse_args(argv)


def measure_all(args: argparse.Namespace, stores: Path) -> dict[str, Any]:
    levels = tuple(args.levels or (QUICK_LEVELS if args.quick else LEVELS))
    saves, count = (10, 3) if args.quick else (args.saves, args.count)
    bases = build(stores, levels)
    sources = {level: prepared(stores, bases[level], args.label) for level in levels}
    found: dict[str, Any] = {}
    if not args.removal_only:
        local: dict[str, dict[str, Any]] = {str(level): {} for level in levels}
        for mode in args.modes:  # each mode on fresh copies
            with fresh_copies(sources, stores) as places:
                measured = measure_modes(places, [mode], saves, count, lambda level, _: level,
                                         block=args.block)
            for level, results in measured.items():
                local[level].update(results)
        found.update({"saves": saves, "counted": count, "local": {
            "levels": local, "ratio_highest_to_lowest": ratios(local),
            "cpu_ratio_highest_to_lowest": ratios(local, "median_cpu_ms")}})
        if saves >= 2 * args.block:
            found["local"].update({
                "block": args.block, "block_ratios": block_ratios(local),
                "block_cpu_ratios": block_ratios(local, "block_cpu_medians_ms")})
        if args.s3:
            found["s3"] = measure_on_s3(args, stores, sources, count)
    if not args.no_removal:
        found["removal"] = measure_removal(args, stores, sources)
    return found


def measure_removal(args: argparse.Namespace, stores: Path, sources: dict[int, Path]
                    ) -> dict[str, Any]:
    """The removal columns (benchmarks/scale_removal.py), locally and with ``--s3`` on
    the moto server."""
    from benchmarks import scale_removal
    objects = tuple(args.object_levels if args.object_levels is not None
                    else QUICK_OBJECT_LEVELS if args.quick else OBJECT_LEVELS)
    print("removal: a prune of 1,000 versions, an idle GC, a GC after the prune", flush=True)
    found = {}
    if args.s3:  # first: the local run consumes the stores of the object levels
        s3_levels = tuple(args.s3_levels or sources)
        s3_sources = {level: sources.get(level) or prepared(stores, build(
            stores, (level,))[level], args.label) for level in s3_levels}
        s3_objects = tuple(args.s3_object_levels if args.s3_object_levels is not None
                           else QUICK_S3_OBJECT_LEVELS if args.quick
                           else OBJECT_LEVELS if args.s3_fill == "insert-sorted"
                           else S3_OBJECT_LEVELS)
        found["s3"] = scale_removal.measure_s3(s3_sources, s3_objects, stores, args.s3_fill)
    found["local"] = scale_removal.measure_local(sources, objects, stores)
    return found


def measure_on_s3(args: argparse.Namespace, stores: Path, sources: dict[int, Path],
                  count: int) -> dict[str, Any]:
    """Every mode in turn on one bucket per level (a mode's saves add a few dozen
    versions to the next one's store)."""
    s3_levels = tuple(args.s3_levels or sources)
    bases = build(stores, s3_levels)
    s3_sources = {level: sources.get(level) or prepared(stores, bases[level], args.label)
                  for level in s3_levels}
    from tests.s3server import _DUMMY_CREDENTIALS, _moto_server
    os.environ.update(_DUMMY_CREDENTIALS)  # a local moto server: never real keys
    per_mode = WARM_UP + args.s3_saves + count
    with _moto_server() as endpoint, on_s3(endpoint, s3_sources) as places:
        remote = measure_modes(places, args.modes, args.s3_saves, count,
                               lambda level, number: level + number * per_mode, "s3 ")
    return {"levels": remote, "saves": args.s3_saves, "ratio_highest_to_lowest": ratios(remote)}


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    # DCP says once per save that it saves in one process: it does, by design here.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    stores = args.stores or Path(tempfile.mkdtemp(prefix="bench-scale-"))
    stores.mkdir(parents=True, exist_ok=True)
    code = Path(chunkstore.__file__).resolve().parent.parent
    print(f"{args.label}: chunkstore from {code} ({commit_of(code)}); stores in {stores}",
          flush=True)
    try:
        run = {"chunkstore": commit_of(code), **measure_all(args, stores),
               "quick": args.quick, "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
               "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                           "platform": platform.platform()}}
    finally:
        if args.stores is None:
            shutil.rmtree(stores, ignore_errors=True)
    if "local" in run:
        print(json.dumps({where: run[where]["ratio_highest_to_lowest"]
                          for where in ("local", "s3") if where in run}))
    if args.out is not None:
        write_results(args.out, args.label, run)


def write_results(out: Path, label: str, run: dict[str, Any]) -> None:
    """``run`` under ``label`` in ``out``, beside the runs of other labels."""
    existing = json.loads(out.read_text()) if out.exists() else {}
    existing["workload"] = {
        "tensors": TENSORS, "elements": ELEMENTS, "dtype": "float32", "changed_per_save": 1,
        "run": RUN, "warm_up_saves": WARM_UP,
        "command": "python -m benchmarks.bench_scale --label LABEL --stores DIR"
                   " --out benchmarks/results/scale.json (see the module docstring)"}
    existing.setdefault("runs", {})[label] = run
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(existing, indent=2) + "\n")


if __name__ == "__main__":
    main()
