"""What an open costs on S3 once another index has saved (issue 49, publication markers).

On the moto server on loopback: a store of ``--versions`` versions of one run (a
tensor of 64 float32 each), saved through index A; index B opens it once (its
first open lists every commit record); then ``--rounds`` times: A saves one
version, B opens the store and sees it.  B's first open waits ``--settle`` seconds
after the history is built, as a job's opens come minutes after the saves before.
B's opens are timed and their requests counted by operation (``list_pages``: the
LIST requests at 1,000 keys each), the median and the counts of the last round
reported.  The script measures whatever
``chunkstore`` it imports: the code before the markers from a checkout of it::

    python -m benchmarks.bench_open_markers --label open-markers-s3 \\
        --out benchmarks/results/scale.json
    PYTHONPATH=/work/before python benchmarks/bench_open_markers.py \\
        --label open-markers-s3-before --out benchmarks/results/scale.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

import chunkstore
from benchmarks.bench_scale import opens_counted


def measure(url: str, options: dict[str, Any], versions: int, rounds: int,
            where: Path, settle: float) -> dict[str, Any]:
    a, b = str(where / "index-a"), str(where / "index-b")
    with chunkstore.open(url, index_dir=a, create=True, storage_options=options) as store:
        for step in range(versions):
            with store.new_version("r", step) as version:
                version.put("w", np.full(64, step, dtype=np.float32))
    time.sleep(settle)  # the history's markers out of B's window, as in a job's steady state
    chunkstore.open(url, index_dir=b, storage_options=options).close()  # B's first open
    times: list[float] = []
    counts: Counter[str] = Counter()
    for step in range(versions, versions + rounds):
        with chunkstore.open(url, index_dir=a, storage_options=options) as store, \
                store.new_version("r", step) as version:
            version.put("w", np.full(64, step, dtype=np.float32))
        with opens_counted() as install:
            counts = install()
            started = time.perf_counter()
            with chunkstore.open(url, index_dir=b, storage_options=options) as store:
                times.append(time.perf_counter() - started)
                assert store.latest("r").step == step  # type: ignore[union-attr]
            counts = Counter(counts)
    return {"versions": versions, "rounds": rounds,
            "open_median_ms": round(statistics.median(times) * 1000, 2),
            "requests_last_open": dict(sorted(counts.items())),
            "requests_total_last_open": sum(v for k, v in counts.items()
                                            if k != "list_pages")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", default="open-markers-s3")
    parser.add_argument("--versions", type=int, nargs="+", default=[100, 2500])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--settle", type=float, default=65.0,
                        help="seconds between building the history and B's first open:"
                        " past the marker window (SKEW_S), so that B's opens list the"
                        " markers of the rounds' saves, not of the build's")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from tests.s3server import (
        _DUMMY_CREDENTIALS,
        _moto_server,
        create_bucket,
        remove_bucket,
        storage_options,
    )
    os.environ.update(_DUMMY_CREDENTIALS)  # a local moto server: never real keys
    found: dict[str, Any] = {}
    with _moto_server() as endpoint, tempfile.TemporaryDirectory() as scratch:
        os.environ["CHUNKSTORE_CACHE_DIR"] = scratch
        for level in args.versions:
            bucket = create_bucket(endpoint)
            try:
                found[str(level)] = measure(f"s3://{bucket}/ckpts", storage_options(endpoint),
                                            level, args.rounds, Path(scratch) / str(level),
                                            args.settle)
            finally:
                remove_bucket(endpoint, bucket)
            print(level, json.dumps(found[str(level)]), flush=True)
    if args.out is not None:
        revision = subprocess.run(["git", "rev-parse", "--short", "HEAD"], text=True,
                                  capture_output=True, cwd=Path(chunkstore.__file__).parent,
                                  check=False).stdout.strip()
        results = json.loads(args.out.read_text()) if args.out.exists() else {"runs": {}}
        results["runs"][args.label] = {
            "command": " ".join(["python -m benchmarks.bench_open_markers", *sys.argv[1:]]),
            "chunkstore": revision, "s3_open": found,
            "when": time.strftime("%Y-%m-%dT%H:%M:%S")}
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
