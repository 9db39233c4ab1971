"""What a GC with nothing to delete costs, against the number of objects in the store
(issue 49: "an idle GC costs O(1) requests and time whatever the store's size").

A store of ``N`` chunk objects (``--versions`` versions of unique 4 KiB chunks, so
every object is live and a GC has nothing to delete; tiny objects: it is the counts
that matter), built once per ``N`` under ``--stores``.  On a handle opened on it
(the open's own reconcile not counted), three GCs in a row, each timed (median of
``--repeat`` runs, no wrapper: a counting wrapper makes every local write durable
on its own) and counted (one more run through a
:class:`~chunkstore.backends.wrappers.RequestHook` that counts requests by
operation and kind of object):

- ``forced``: ``store.gc(grace=0, sweep=True)``, the full sweep (what every GC did
  before issue 49);
- ``idle``: ``store.gc(grace=0)``, the default, right after it: what a job's
  collection after each save, or a cron ``chunkstore gc``, costs when nothing
  became garbage.

A listing counts once per call in ``list``, and in ``list_pages`` once per 1,000
keys it returns (at least one): the LIST requests S3 would answer.  A walk of the
whole local tree for temporary files (``remove_temporaries``, part of a sweep)
counts in ``walks``.

The script measures whatever ``chunkstore`` it imports, so the code before a change
is measured from a checkout of it (``git worktree add /tmp/before <commit>``) with
the same script and stores; each run is recorded under its ``--label``::

    python -m benchmarks.bench_gc_idle --label after --stores /tmp/gc-idle-stores \\
        --out benchmarks/results/gc_idle.json
    cd /tmp/before && PYTHONPATH=/tmp/before python /work/main/benchmarks/bench_gc_idle.py \\
        --label before --stores /tmp/gc-idle-stores --out /work/main/benchmarks/results/gc_idle.json
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

import chunkstore
from chunkstore.backends.wrappers import RequestHook

CHUNK = 4096
LEVELS = (10_000, 100_000)
#: Threads whose requests come per second (heartbeats), not per GC: not counted.
BACKGROUND = ("chunkstore-run-lease", "chunkstore-read-leases", "chunkstore-session",
              "chunkstore-gc-entry", "chunkstore-collect")


class Counting(RequestHook):
    """Counts requests by operation and kind of object; a listing also by the S3 LIST
    pages (1,000 keys each) it would take."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.counts: Counter[str] = Counter()
        self.by_kind: Counter[str] = Counter()
        self._lock = threading.Lock()

    def _count(self, operation: str, key: str, n: int = 1) -> None:
        if threading.current_thread().name.startswith(BACKGROUND):
            return
        kind = key.split("/", 1)[0] if "/" in key else key or "(root)"
        with self._lock:
            self.counts[operation] += n
            self.by_kind[f"{operation} {kind}"] += n

    def request(self, operation: str, key: str) -> None:
        if operation == "walk":
            self._count("walks", "(whole store)")
        else:
            self._count(operation, key)

    def listed(self, prefix: str, count: int) -> None:
        self._count("list_pages", prefix, max(1, math.ceil(count / 1000)))

    def take(self) -> dict[str, Any]:
        with self._lock:
            counts, self.counts = self.counts, Counter()
            kinds, self.by_kind = self.by_kind, Counter()
        requests = sum(n for op, n in counts.items() if op not in ("list_pages", "walks"))
        return {**dict(sorted(counts.items())), "requests": requests,
                "by_kind": dict(sorted(kinds.items()))}


def build(root: Path, objects: int, versions: int) -> None:
    """``objects`` chunk objects (and a few nodes) in ``versions`` versions, all live."""
    per_version = objects // versions
    counter = np.arange(per_version * CHUNK // 8, dtype=np.uint64)
    with chunkstore.open(root, chunk_size=CHUNK, compression="none", create=True) as store:
        for v in range(versions):
            with store.new_version("bench", v) as writer:
                writer.put("w", counter + np.uint64(v) * np.uint64(counter.size))


def store_for(stores: Path, objects: int, versions: int) -> Path:
    root = stores / f"objects-{objects}"
    if not (root / "chunkstore.json").exists():
        shutil.rmtree(root, ignore_errors=True)
        start = time.perf_counter()
        build(root, objects, versions)
        print(f"built {root} in {time.perf_counter() - start:.1f} s", flush=True)
    return root


def gc_kwargs(phase: str) -> dict[str, Any]:
    return {"grace": 0, "sweep": True} if phase == "forced" else {"grace": 0}


def measure(root: Path, repeat: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with chunkstore.open(root) as store:
        for phase in ("forced", "idle"):
            times, result = [], None
            for _ in range(repeat):
                if phase == "idle":
                    store.gc(**gc_kwargs("forced"))  # the idle GC follows a sweep
                start = time.perf_counter()
                result = store.gc(**gc_kwargs(phase))
                times.append(time.perf_counter() - start)
            assert result is not None
            deleted = result.chunks_deleted + result.nodes_deleted + result.orphans_deleted
            assert deleted == 0, f"not idle: {phase} deleted {deleted}"
            if phase == "idle":
                store.gc(**gc_kwargs("forced"))
            plain = store.backend
            counting = Counting(plain)
            store.backend = counting
            try:
                store.gc(**gc_kwargs(phase))
            finally:
                store.backend = plain
            report = result.to_json()
            out[phase] = {"seconds": round(statistics.median(times), 4),
                          "seconds_all": [round(t, 4) for t in times],
                          "requests": counting.take(),
                          "swept": report.get("swept"), "sweep_reason": report.get("sweep_reason")}
    return out


def revision() -> str:
    here = Path(inspect.getfile(chunkstore)).resolve().parent.parent
    try:
        return subprocess.run(["git", "-C", str(here), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--objects", default=",".join(str(n) for n in LEVELS),
                        help="comma-separated store sizes, in chunk objects")
    parser.add_argument("--versions", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--stores", default="/tmp/gc-idle-stores")
    parser.add_argument("--label", default="after")
    parser.add_argument("--out", default="benchmarks/results/gc_idle.json")
    args = parser.parse_args()
    stores = Path(args.stores)
    stores.mkdir(parents=True, exist_ok=True)
    runs: dict[str, Any] = {}
    for objects in (int(n) for n in args.objects.split(",")):
        root = store_for(stores, objects, args.versions)
        runs[str(objects)] = measure(root, args.repeat)
        print(json.dumps({str(objects): runs[str(objects)]}, indent=2), flush=True)
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.exists() else {}
    results["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version(),
                          "platform": platform.platform()}
    results.setdefault("runs", {})[args.label] = {
        "revision": revision(), "chunkstore": str(Path(inspect.getfile(chunkstore)).parent),
        "versions": args.versions, "by_objects": runs}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
