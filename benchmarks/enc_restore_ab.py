"""Restore of an encrypted store against the same policy unencrypted, A/B between code
versions, by CPU time as well as wall time: on a machine shared with other jobs the wall
times of the suite swing by +-0.3 in the ratio, the CPU times of a restore much less.

For each workload the suite's training is recorded once and saved into a plain and an
encrypted store (``chunkstore-auto`` and ``chunkstore-auto-enc``, built once in
``--work-dir`` with the first side's code; the format is the same on every side).  Then,
``--rounds`` times, each side (a worktree: its code on ``PYTHONPATH``) restores the newest
version in a fresh process, plain and encrypted in turn, ``--repeat`` times each; the
medians of wall and process CPU time, and encrypted over plain, are recorded::

    python -m benchmarks.enc_restore_ab --sides /work/wt-encread,/work/before-encread \\
        --work-dir /tmp/enc-ab --out benchmarks/results/encryption-restore-ab/restore-ab.json

``--segment-sizes`` adds, for each size named, an encrypted store whose config names
that segment size (``auto-enc-seg<size>``, built as ``auto-enc`` with only the size
changed: a value every reader of an encrypted store accepts, docs/format.md §13), restored
in turn with the others and reported over plain as they are: what the size a new store
records costs a restore, at the same code.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SYSTEMS = ("auto", "auto-enc")


def segment_system(size: int) -> str:
    """The name of the encrypted store with segments of ``size`` bytes (``--segment-sizes``)."""
    return f"auto-enc-seg{size}"


def _open_system(stores: Path, name: str) -> Any:
    """The store ``name`` in ``stores``, created where missing (``auto-enc-seg<size>``: an
    ``auto-enc`` store whose config names segments of that size)."""
    from unittest import mock

    import chunkstore.store
    from benchmarks.systems import Chunkstore
    from chunkstore.format.records import Encryption

    if not name.startswith("auto-enc-seg") or (stores / name).exists():
        return Chunkstore(stores / name, name if name in SYSTEMS else "auto-enc")
    size = int(name.removeprefix("auto-enc-seg"))
    # The size new stores record is a module constant, not an option of open(): only the
    # creation of this store sees another.
    with mock.patch.object(chunkstore.store, "Encryption",
                           functools.partial(Encryption, segment_size=size)):
        return Chunkstore(stores / name, "auto-enc")


def _measure(trace: Path, stores: Path, repeat: int, segment_sizes: list[int]
             ) -> dict[str, Any]:
    """In a child: build the stores where missing, then time restores of the newest version."""
    from benchmarks.suite import record_trace
    from benchmarks.trace import TraceReader, empty_like_tree
    from benchmarks.workloads import FULL

    if not trace.exists():
        record_trace(trace.name, FULL, trace)
    reader = TraceReader(trace)
    names = [*SYSTEMS, *map(segment_system, segment_sizes)]
    systems = {}
    for config in names:
        fresh = not (stores / config).exists()
        systems[config] = _open_system(stores, config)
        if fresh:
            for version, state in reader:
                systems[config].save(version, state)
    newest = reader.versions[-1]
    target = empty_like_tree(reader.load(newest.index))
    wall: dict[str, list[float]] = {config: [] for config in names}
    cpu: dict[str, list[float]] = {config: [] for config in names}
    for config in names:  # warm: the page cache, the handle's caches
        systems[config].restore(newest, target)
    for _ in range(repeat):
        for config in names:
            started, cpu_started = time.perf_counter(), time.process_time()
            systems[config].restore(newest, target)
            wall[config].append(time.perf_counter() - started)
            cpu[config].append(time.process_time() - cpu_started)
    for system in systems.values():
        system.close()
    return {"wall_s": {c: statistics.median(t) for c, t in wall.items()},
            "cpu_s": {c: statistics.median(t) for c, t in cpu.items()}}


def _child(side: str, trace: Path, stores: Path, repeat: int, segment_sizes: list[int]
           ) -> dict[str, Any]:
    # This file, run with the side's code first on the path (a side may predate it).
    code = ("import runpy, sys; sys.argv = sys.argv[1:];"
            " runpy.run_path(sys.argv[0], run_name='__main__')")
    done = subprocess.run(
        [sys.executable, "-c", code, __file__, "--child", str(trace), str(stores),
         "--repeat", str(repeat),
         *(["--segment-sizes", ",".join(map(str, segment_sizes))] if segment_sizes else [])],
        cwd=side, env={**os.environ, "PYTHONPATH": side},
        capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{side}: {done.stderr[-3000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", nargs=2, type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--sides", help="comma-separated worktrees to compare")
    parser.add_argument("--workloads",
                        default="dense,frozen,lora,sparse-embedding,sweep,mixed-precision")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/enc-restore-ab"))
    parser.add_argument("--segment-sizes", default="",
                        help="comma-separated segment sizes: an encrypted store more for each")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    segment_sizes = [int(size) for size in args.segment_sizes.split(",") if size]
    encrypted = ["auto-enc", *map(segment_system, segment_sizes)]
    if args.child:
        trace, stores = args.child
        print(json.dumps(_measure(trace, stores, args.repeat, segment_sizes)))
        return
    sides = args.sides.split(",")
    runs: list[dict[str, Any]] = []
    for workload in args.workloads.split(","):
        trace, stores = args.work_dir / "trace" / workload, args.work_dir / "stores" / workload
        for round_number in range(args.rounds):
            for side in sides:
                found = _child(side, trace, stores, args.repeat, segment_sizes)
                runs.append({"workload": workload, "side": side, "round": round_number,
                             "load_average": os.getloadavg()[0], **found})
                print(workload, side, {f"{kind} {name}": round(v[name] / v["auto"], 2)
                                       for kind, v in found.items() for name in encrypted},
                      file=sys.stderr)
    ratios = {f"{workload} {side}" + ("" if name == "auto-enc" else f" {name}"): {
        kind: statistics.median(r[kind][name] / r[kind]["auto"] for r in runs
                                if r["workload"] == workload and r["side"] == side)
        for kind in ("wall_s", "cpu_s")}
        for workload in args.workloads.split(",") for side in sides for name in encrypted}
    result = {"command": "python -m benchmarks.enc_restore_ab " + " ".join(argv or sys.argv[1:]),
              "cpus": os.cpu_count(), "encrypted_over_plain_medians": ratios, "runs": runs}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(ratios, indent=1))


if __name__ == "__main__":
    main()
