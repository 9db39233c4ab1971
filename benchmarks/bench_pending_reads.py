"""What a refcount read costs while a save's references are pending (the index's
``pending`` table, issue 49), in a loop of reads with and without commits between them.

An index (real LMDB, in a temporary directory) counts one version of ``--refs`` chunks
in, then ``--pending`` versions that reference every one of them (each deferred: the
table holds ``--pending`` entries of ``--refs`` digests; 63 is the most a save leaves,
the 64th folds).  Then, each timed (wall and CPU, median of ``--repeat``):

- ``loop``: :meth:`Index.record` of every chunk, nothing committed in between (GC's
  candidates, a report);
- ``interleaved``: ``--interleaved`` reads, each after a commit that leaves the table
  as it is (a session's heartbeat: what another process's saves, or sync's claims
  between its per-node reads, commit), reported per read, the heartbeat included;
- ``heartbeat``: the heartbeats alone, the same number.

The script measures whatever ``chunkstore`` it imports; the code before a change from
a checkout of it, with this script, each run under its ``--label``::

    python -m benchmarks.bench_pending_reads --label after \\
        --out benchmarks/results/pending_reads.json
    cd /tmp/before && PYTHONPATH=/tmp/before python /work/main/benchmarks/bench_pending_reads.py \\
        --label before --out /work/main/benchmarks/results/pending_reads.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import chunkstore
from chunkstore.format.digest import Digest
from chunkstore.index.lmdbindex import CHUNK, Index, NewChunk
from chunkstore.index.versiontables import VersionEntry


def _entry(number: int) -> VersionEntry:
    return VersionEntry(f"{number:064x}", "r", number, 0.0, "00", None, 0, 0, 0, {})


def _timed(run: Any) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    run()
    return time.perf_counter() - wall, time.process_time() - cpu


def measure(refs: int, pending: int, interleaved: int, repeat: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as scratch:
        index = Index(os.path.join(scratch, "index"))
        digests = [Digest(os.urandom(32)) for _ in range(refs)]
        index.add_version(_entry(0), digests, {}, [NewChunk(d, 1, 8, 8) for d in digests])
        for number in range(1, pending + 1):
            index.add_version(_entry(number), digests, {}, [])
        held = index.pending_versions()
        session = index.open_session("bench")

        def loop() -> None:
            for digest in digests:
                index.record(CHUNK, digest)

        def mixed() -> None:
            for digest in digests[:interleaved]:
                index.heartbeat(session)
                index.record(CHUNK, digest)

        def beats() -> None:
            for _ in range(interleaved):
                index.heartbeat(session)

        found: dict[str, Any] = {"pending_versions": held}
        for name, run, per in (("loop", loop, 1), ("interleaved", mixed, interleaved),
                               ("heartbeat", beats, interleaved)):
            runs = [_timed(run) for _ in range(repeat)]
            found[name] = {"reads" if name != "heartbeat" else "commits":
                           refs if name == "loop" else interleaved,
                           "wall_s": statistics.median(w for w, _ in runs),
                           "cpu_s": statistics.median(c for _, c in runs),
                           "ms_each": statistics.median(w for w, _ in runs) / per * 1e3
                           if per > 1 else None}
        index.close_session(session)
        index.close()
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--label", required=True)
    parser.add_argument("--refs", type=int, default=10_000)
    parser.add_argument("--pending", type=int, default=63)
    parser.add_argument("--interleaved", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    run = {"command": " ".join([Path(sys.executable).name, *sys.argv]),
           "chunkstore": str(Path(chunkstore.__file__).parent),
           "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared)",
           "refs": args.refs, **measure(args.refs, args.pending, args.interleaved,
                                        args.repeat)}
    results = json.loads(args.out.read_text()) if args.out.exists() else {"runs": {}}
    results["runs"][args.label] = run
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(run, indent=1))


if __name__ == "__main__":
    main()
