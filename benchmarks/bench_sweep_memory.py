"""The peak resident memory of GC's full sweep on S3, this tree's code against another
commit's, in one run (issue 49).

    python -m benchmarks.bench_sweep_memory --before 157749f --objects 100000 \\
        --stores DIR --label LABEL --out benchmarks/results/scale.json

Each level's store (``benchmarks/scale_removal.py``'s object store: that many tiny
chunk objects and the run of versions beside them, built under ``--stores`` once)
is inserted into a moto server of its own with sorted listings
(``benchmarks/moto_filled.py``, as ``bench_scale --s3-fill insert-sorted``).  Then,
alternating between the two codes (``--repeat`` times each), a fresh process opens
the store with the copy of its index and runs ``store.gc(grace=0, sweep=True)``:
every object is live, so each run lists every object and deletes nothing.  The
process resets its peak resident memory (``/proc/self/clear_refs``) right before the
GC, so ``peak_mib`` is the GC's own peak and ``extra_mib`` what it added to the
resident memory of the opened store; the moto server is a process of its own and
not counted.  Each run also counts the requests the S3 client sent by operation
(botocore's ``before-send`` event; ``list_requests`` its ListObjectsV2), and the
listings, their keys and the pages of 1,000 keys those take as a
:class:`~chunkstore.backends.wrappers.RequestHook` sees them (``list_pages_counted``,
as bench_scale counts them): where the two disagree, the hook missed requests.

The other commit's code is extracted with ``git archive`` into a temporary directory
(with this tree's compiled codec module).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.bench_scale import Location, commit_of, write_results
from benchmarks.scale_removal import object_store

ROOT = Path(__file__).resolve().parent.parent

#: One GC with a sweep in a fresh process: prints its figures as one JSON line.
SWEEP = r"""
import json, sys, time
from collections import Counter
from pathlib import Path

def status_mib(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return round(int(line.split()[1]) / 1024, 1)

import chunkstore
from chunkstore.backends.wrappers import RequestHook

class Listed(RequestHook):
    listings = keys = pages = 0

    def listed(self, prefix, count):
        self.listings += 1
        self.keys += count
        self.pages += max(1, -(-count // 1000))  # what S3 takes for them

url, options, index_dir = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
with chunkstore.open(url, storage_options=options, index_dir=index_dir) as store:
    backend = store.backend
    while not hasattr(backend, "fs"):
        backend = backend.inner
    sent = Counter()
    backend.fs.s3.meta.events.register(
        "before-send.s3", lambda event_name, **_: sent.update([event_name.rsplit(".", 1)[1]]))
    hook = store.backend = Listed(store.backend)
    Path("/proc/self/clear_refs").write_text("5")  # the peak from here on
    rss = status_mib("VmRSS")
    anon_before, mapped_before = status_mib("RssAnon"), status_mib("RssFile")
    started = time.perf_counter()
    result = store.gc(grace=0, sweep=True)
    seconds = time.perf_counter() - started
    peak = status_mib("VmHWM")
    anon, mapped = status_mib("RssAnon"), status_mib("RssFile")  # after it: heap, files
found = result.to_json()
print(json.dumps({
    "seconds": round(seconds, 1), "rss_before_mib": rss, "peak_mib": peak,
    "extra_mib": round(peak - rss, 1), "rss_anon_before_mib": anon_before,
    "rss_anon_after_mib": anon, "rss_file_before_mib": mapped_before,
    "rss_file_after_mib": mapped, "list_requests": sent["ListObjectsV2"],
    "requests_sent": dict(sorted(sent.items())),
    "listings": hook.listings, "keys_listed": hook.keys, "list_pages_counted": hook.pages,
    "swept": result.swept,
    "deleted": found["chunks_deleted"] + found["nodes_deleted"] + found["orphans_deleted"]}))
"""


@contextlib.contextmanager
def code_of(commit: str) -> Iterator[Path]:
    """The tree of ``commit``, with this tree's compiled codec module, in a temporary
    directory (removed afterwards)."""
    scratch = Path(tempfile.mkdtemp(prefix="bench-sweep-code-"))
    try:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit],
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(scratch)], input=archive, check=True)
        for native in (ROOT / "chunkstore" / "codecs").glob("_native*.so"):
            shutil.copy2(native, scratch / "chunkstore" / "codecs" / native.name)
        yield scratch
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def sweep(code: Path, where: Location) -> dict[str, Any]:
    """One GC with a sweep of ``where`` by the code under ``code``, in a fresh process."""
    done = subprocess.run(
        [sys.executable, "-c", SWEEP, where.url, json.dumps(where.options), str(where.index_dir)],
        cwd=code, env={**os.environ, "PYTHONPATH": str(code)}, capture_output=True,
        text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the sweep by {code} failed:\n{done.stderr}")
    found: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return found


def measure_level(objects: int, stores: Path, codes: dict[str, Path], repeat: int
                  ) -> dict[str, Any]:
    from benchmarks.moto_filled import filled_bucket
    from tests.s3server import _DUMMY_CREDENTIALS
    os.environ.update(_DUMMY_CREDENTIALS)  # a local moto server: never real keys
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in codes}
    with filled_bucket(object_store(stores, objects), sorted_listing=True) as (where, filled):
        print(f"  s3: {filled['inserted']} objects inserted in {filled['seconds']} s,"
              f" listed in {filled['list_seconds']} s", flush=True)
        # The index's first GC does more than a sweep (it reads every version's root):
        # one by this tree's code first, so every measured GC finds the same store.
        warm_up = sweep(codes["after"], where)
        print(f"  {objects} objects, warm-up: {json.dumps(warm_up)}", flush=True)
        for _ in range(repeat):
            for name, code in codes.items():
                found = sweep(code, where)
                runs[name].append(found)
                print(f"  {objects} objects, {name}: {json.dumps(found)}", flush=True)
    entry: dict[str, Any] = {"fill": filled, "warm_up": warm_up, "runs": runs}
    for name, measured in runs.items():
        entry[f"{name}_median_extra_mib"] = statistics.median(m["extra_mib"] for m in measured)
        entry[f"{name}_median_peak_mib"] = statistics.median(m["peak_mib"] for m in measured)
    return entry


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--before", required=True, help="the commit to compare with")
    parser.add_argument("--objects", type=int, nargs="+", default=[100_000])
    parser.add_argument("--repeat", type=int, default=1, help="sweeps per code and level")
    parser.add_argument("--stores", type=Path, required=True)
    parser.add_argument("--label")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--note", default="")
    args = parser.parse_args(argv)
    args.stores.mkdir(parents=True, exist_ok=True)
    run: dict[str, Any] = {
        "command": f"python -m benchmarks.bench_sweep_memory --before {args.before}"
                   f" --objects {' '.join(map(str, args.objects))} --repeat {args.repeat}"
                   f" --stores DIR --label {args.label} --out {args.out}",
        "note": args.note, "chunkstore": commit_of(ROOT), "before": args.before,
        "objects": {}}
    with code_of(args.before) as before:
        codes = {"before": before, "after": ROOT}
        for objects in args.objects:
            run["objects"][str(objects)] = measure_level(objects, args.stores, codes,
                                                         args.repeat)
    if args.out is not None and args.label:
        write_results(args.out, args.label, run)


if __name__ == "__main__":
    main()
