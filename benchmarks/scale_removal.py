"""The removal columns of ``python -m benchmarks.bench_scale`` (issue 49): a prune of
1,000 versions, an idle GC and a GC after the prune, and a save beside them, at the
version levels and at levels of object counts.

On each store, in this order:

1. ``first_gc``, then ``idle_gc``: ``store.gc(grace=0)`` twice on the store as built:
   every object is live, so neither deletes anything.  The first GC of an index
   sweeps (lists every object, reads every version's root: no sweep is recorded for
   it); the second is what a job's collection after a save, or a cron ``chunkstore
   gc``, costs when nothing became garbage;
2. ``save``: saves of the scale workload into run ``r`` (object levels only: at the
   version levels the save columns measure them);
3. ``prune``: ``store.prune(run="r", keep_last=max(10, N - 1000))`` where run ``r``
   holds N versions: 1,000 versions removed (N - 10 where N < 1,010), reported per
   version removed;
4. ``gc_after_prune``: ``store.gc(grace=0)``: deletes what only the removed versions
   reached (a thousand-odd objects: the scale workload changes one small tensor per
   save).

A version level's store is the save columns' store of N versions (run ``r``).  An
object level's: N tiny objects (:func:`benchmarks.bench_gc_idle.build`: 4 KiB chunks
in 20 versions of run ``bench``; it is their count that matters) and then 1,010
versions of run ``r``, so its prune and GC meet the same garbage at every level: what
they cost should follow that garbage, not the N objects beside it.

Locally, a version level is timed on one fresh copy and counted on another, through
the :class:`~benchmarks.bench_scale.Counting` request hook (it makes each deferred
write durable on its own, which would change the times).  An object level is not
copied (a million files take longer to copy than to measure): its GCs and saves are
counted first, then everything is timed (its ``first_gc`` there is the index's
second), and the store, consumed, is built again by the next run.  On the moto
server each store is put in a bucket of its own (on a server of its own) and timed
and counted in one pass (the hook changes no request there).  By default the store
is uploaded, at 70-140 objects a second on this machine: hours for a million.  With
``fill="insert"`` an object level's store (the same local store the local run
measures) is inserted straight into the memory of a moto server started for it
(:func:`benchmarks.moto_filled.filled_bucket`, under a minute for a million), and a
listing over HTTP must count every object inserted before anything is measured; the
measured operations still go over HTTP through s3fs and the hook.  moto's own
listing sorts the whole bucket for every page it returns, so its times grow with
the store even where the requests do not (a full listing of a million objects takes
hours): ``fill="insert-sorted"`` also keeps the bucket's names sorted and walks only
each page, as S3 does.  The request counts are the figures that must stay bounded.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import chunkstore
from benchmarks import bench_gc_idle
from benchmarks.bench_scale import (
    RUN,
    Counting,
    Location,
    Workload,
    on_s3,
    save_plain,
)

#: Versions of run ``r`` in an object level's store: the prune removes 1,000.
OBJECT_LEVEL_RUN = 1010
#: Versions a prune removes (fewer where the store holds fewer than 1,010).
PRUNED = 1000
#: Saves timed (and counted) at each object level.
SAVES, COUNTED_SAVES = 5, 2


def keep_last(versions: int) -> int:
    return max(10, versions - PRUNED)


def object_store(stores: Path, objects: int) -> Path:
    """The store of ``objects`` tiny chunk objects and :data:`OBJECT_LEVEL_RUN` versions
    of run ``r``, built under ``stores`` (again after a run consumed it)."""
    root = stores / f"objects-{objects}"
    if not (root / "done").exists():
        shutil.rmtree(root, ignore_errors=True)
        started = time.perf_counter()
        bench_gc_idle.build(root, objects, 20)
        with chunkstore.open(root) as store:
            workload = Workload()
            for step in range(OBJECT_LEVEL_RUN):
                save_plain(store, workload, step)
        (root / "done").write_text(str(objects))
        print(f"  built {root.name} in {time.perf_counter() - started:.0f} s", flush=True)
    return root


@contextlib.contextmanager
def fresh_copy(source: Path, scratch: Path) -> Iterator[Path]:
    work = scratch / f"removal-{source.name}"
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(source, work, symlinks=True, ignore=shutil.ignore_patterns("done", "ready"))
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _gc_json(result: Any) -> dict[str, Any]:
    found = result.to_json()
    return {"deleted": found["chunks_deleted"] + found["nodes_deleted"]
            + found["orphans_deleted"], "tombstones_deleted": found["tombstones_deleted"],
            "swept": found.get("swept")}


class Phases:
    """Runs the phases on one open store, timing each and, with ``counting``, counting
    its requests (the hook installed on the store's backend)."""

    def __init__(self, store: chunkstore.Store, counting: bool) -> None:
        self.store = store
        self.counter: Counting | None = None
        if counting:
            self.counter = Counting(store.backend)
            store.backend = self.counter
        self.found: dict[str, dict[str, Any]] = {}

    def run(self, name: str, work: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        before = Counter(self.counter.counts) if self.counter is not None else Counter()
        started = time.perf_counter()
        extra = work()
        seconds = time.perf_counter() - started
        entry = {"seconds": round(seconds, 4), **extra}
        if self.counter is not None:
            counts = Counter(self.counter.counts)
            counts.subtract(before)
            entry["requests"] = {op: n for op, n in sorted(counts.items()) if n}
            entry["requests_total"] = sum(n for op, n in counts.items() if op != "list")
        self.found[name] = entry
        return entry

    def idle_gc(self) -> None:
        self.run("first_gc", lambda: _gc_json(self.store.gc(grace=0)))
        self.run("idle_gc", lambda: _gc_json(self.store.gc(grace=0)))

    def saves(self, count: int, first_step: int) -> None:
        """``count`` saves of the scale workload, into run ``r`` (of its own here)."""
        workload = Workload()
        times: list[float] = []

        def save() -> dict[str, Any]:
            for step in range(first_step, first_step + count):
                started = time.perf_counter()
                save_plain(self.store, workload, step)
                times.append(time.perf_counter() - started)
            return {"saves": count}
        entry = self.run("save", save)
        entry["median_ms"] = round(statistics.median(times) * 1e3, 2)

    def prune(self) -> None:
        def prune() -> dict[str, Any]:
            versions = len(self.store.versions(RUN))
            removed = len(self.store.prune(run=RUN, keep_last=keep_last(versions)).removed)
            return {"removed": removed}
        entry = self.run("prune", prune)
        removed = max(1, entry["removed"])
        entry["ms_per_version"] = round(entry["seconds"] * 1e3 / removed, 3)
        if "requests" in entry:
            entry["requests_per_version"] = round(entry["requests_total"] / removed, 3)

    def gc_after_prune(self) -> None:
        self.run("gc_after_prune", lambda: _gc_json(self.store.gc(grace=0)))


def _version_level(where: Location, counting: bool) -> dict[str, Any]:
    with where.open() as store:
        phases = Phases(store, counting)
        phases.idle_gc()
        phases.prune()
        phases.gc_after_prune()
        return phases.found


def _object_level(where: Location, saves: int, counting: bool, *, first_step: int = 0,
                  whole: bool = True) -> dict[str, Any]:
    """``whole``: the prune and the GC after it too (else the idle GC and saves only)."""
    with where.open() as store:
        phases = Phases(store, counting)
        phases.idle_gc()
        phases.saves(saves, first_step)
        if whole:
            phases.prune()
            phases.gc_after_prune()
        return phases.found


def measure_local(version_sources: dict[int, Path], object_levels: tuple[int, ...],
                  stores: Path) -> dict[str, Any]:
    found: dict[str, Any] = {"versions": {}, "objects": {}}
    for level, source in version_sources.items():
        entry: dict[str, Any] = {}
        for counting in (False, True):
            with fresh_copy(source, stores) as work:
                entry["counted" if counting else "timed"] = _version_level(
                    Location(str(work)), counting)
        found["versions"][str(level)] = entry
        report(f"{level} versions", entry)
    for objects in object_levels:
        where = Location(str(object_store(stores, objects)))
        (Path(where.url) / "done").unlink()  # consumed: built again by the next run
        first = OBJECT_LEVEL_RUN
        entry = {"counted": _object_level(where, COUNTED_SAVES, True, first_step=first,
                                          whole=False),
                 "timed": _object_level(where, SAVES, False, first_step=first + COUNTED_SAVES)}
        entry["objects"] = objects
        found["objects"][str(objects)] = entry
        report(f"{objects} objects", entry)
    return found


def measure_s3(version_sources: dict[int, Path], object_levels: tuple[int, ...],
               stores: Path, fill: str = "upload") -> dict[str, Any]:
    """``fill``: how an object level's store gets into its bucket: ``upload`` over HTTP,
    ``insert`` straight into the moto server's memory, ``insert-sorted`` so and with
    listings that walk only their page (benchmarks/moto_filled.py)."""
    from tests.s3server import _DUMMY_CREDENTIALS, _moto_server
    os.environ.update(_DUMMY_CREDENTIALS)  # a local moto server: never real keys
    found: dict[str, Any] = {"versions": {}, "objects": {}}
    for level, source in version_sources.items():
        with _moto_server() as endpoint, on_s3(endpoint, {level: source}) as places:
            entry = _version_level(places[level], True)
        found["versions"][str(level)] = {"counted": entry}
        report(f"s3 {level} versions", {"counted": entry})
    for level in object_levels:
        # A server per store: moto's listings slow down with what it holds.
        with _object_bucket(object_store(stores, level), fill) as (where, filled):
            entry = _object_level(where, SAVES, True, first_step=OBJECT_LEVEL_RUN)
        found["objects"][str(level)] = {"counted": entry, **({"fill": filled} if filled else {})}
        report(f"s3 {level} objects", {"counted": entry})
    return found


@contextlib.contextmanager
def _object_bucket(source: Path, fill: str) -> Iterator[tuple[Location, dict[str, Any]]]:
    if fill == "upload":
        from tests.s3server import _moto_server
        with _moto_server() as endpoint, on_s3(endpoint, {0: source}) as places:
            yield places[0], {}
        return
    from benchmarks.moto_filled import filled_bucket
    with filled_bucket(source, sorted_listing=fill == "insert-sorted") as (where, filled):
        print(f"  s3: {filled['inserted']} objects of {source.name} inserted in"
              f" {filled['seconds']} s, {filled['listed']} listed in {filled['list_seconds']} s",
              flush=True)
        yield where, filled


def report(what: str, entry: dict[str, Any]) -> None:
    timed = entry.get("timed") or entry["counted"]
    counted = entry.get("counted", {})
    parts = []
    for phase in ("first_gc", "idle_gc", "save", "prune", "gc_after_prune"):
        if phase not in timed:
            continue
        text = f"{phase} {timed[phase]['seconds']:.3f} s"
        if phase == "prune":
            text += f" ({timed[phase]['ms_per_version']} ms/version"
            if "requests_per_version" in counted.get("prune", {}):
                text += f", {counted['prune']['requests_per_version']} requests/version"
            text += ")"
        elif phase in counted and "requests_total" in counted[phase]:
            text += f" ({counted[phase]['requests_total']} requests)"
        parts.append(text)
    print(f"  {what:>16}: " + "; ".join(parts), flush=True)
