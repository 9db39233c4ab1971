"""What encryption costs (docs/format.md §13): saves, restores and stored bytes of one
state in a plain and an encrypted store, side by side, with the machine's limits.

Each round, for the policy ``auto`` and ``none`` (raw chunks: the most bytes sealed per
second of work), in a plain store and an encrypted one, the systems taking turns
(:func:`benchmarks.bench_core.in_rounds`): a first save into an empty store, a save
after a quarter of the large tensors changed densely and every small one changed, an
unchanged re-save, then in a fresh handle a restore into existing arrays; the handle's
open (for an encrypted store, scrypt at the real cost) is timed apart, as a job opens
its store once.  Medians of ``--repeat`` rounds; the ratios encrypted / plain are what
the issue's target (1.15x) is about.  The limits: memcpy, one thread's BLAKE3, and one
thread sealing and opening 4 MiB objects (AES-256-GCM in 64 KiB segments)::

    python -m benchmarks.bench_encryption --mib 256 --repeat 3 \\
        --out benchmarks/results/encryption.json

``--sealing`` adds, for each policy, an encrypted store of version 10 (sealing 1: random
nonces, plain node ids; made as a release before version 12 made it) beside today's of
version 12, taking turns with the others, and the ratios version 12 / version 10: what
the format change costs, measured in one process on the same code::

    python -m benchmarks.bench_encryption --mib 256 --repeat 5 --sealing \\
        --out benchmarks/results/encryption-sealing.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from unittest import mock

import numpy as np

import chunkstore
from benchmarks.bench_core import BENCH_PASSWORD, Round, in_rounds, limits, make_state
from chunkstore.format.records import Encryption


def _changed(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A quarter of the large tensors changed everywhere, every small one changed."""
    large = sorted(k for k, v in state.items() if v.nbytes >= 1 << 20)
    changed = {k: v for k, v in state.items()}
    for name in large[: max(1, len(large) // 4)]:
        changed[name] = state[name] * np.float32(1.001)
    for name in (k for k in state if k not in large):
        changed[name] = state[name] + np.float32(1)
    return changed


def store_round(workdir: Path, state: dict[str, np.ndarray], compression: str,
                encrypted: bool, sealing: int = 2) -> Round:
    root = workdir / f"{compression}{'-enc' if encrypted else ''}{sealing}"
    outs = {k: np.empty_like(v) for k, v in state.items()}
    changed = _changed(state)
    password = BENCH_PASSWORD if encrypted else None

    def save(store: chunkstore.Store, step: int, arrays: dict[str, np.ndarray]) -> None:
        with store.new_version(run="bench", step=step) as version:
            for name, array in arrays.items():
                version.put(name, array)

    def one() -> dict[str, float]:
        times: dict[str, float] = {}

        def timed(step: str, fn: Callable[[], object]) -> None:
            """Wall seconds, and CPU seconds of every thread of the process (steadier
            than wall time on a shared machine: a neighbour's load hardly moves them)."""
            wall, cpu = time.perf_counter(), time.process_time()
            fn()
            times[step + "_s"] = time.perf_counter() - wall
            times[step + "_cpu_s"] = time.process_time() - cpu

        shutil.rmtree(root, ignore_errors=True)
        with mock.patch("chunkstore.store.Encryption", partial(Encryption, sealing=sealing)):
            store = chunkstore.open(root, create=True, compression=compression,
                                    encrypt=encrypted, password=password)
        assert not encrypted or store.config.format_version == (12 if sealing == 2 else 10)
        with store:
            timed("first_save", lambda: save(store, 0, state))
            timed("changed_save", lambda: save(store, 1, changed))
            timed("resave", lambda: save(store, 2, changed))
        opened: list[chunkstore.Store] = []
        timed("open", lambda: opened.append(chunkstore.open(root, password=password)))
        with opened[0] as store:
            timed("restore", lambda: store.open_version("latest").get_many_into(
                (name, out, None) for name, out in outs.items()))
        times["stored_bytes"] = sum(p.stat().st_size for kind in ("chunks", "nodes")
                                    for p in (root / kind).rglob("*") if p.is_file())
        return times

    return one


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/encryption.json")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--policies", default="auto,none",
                        help="comma-separated compression policies to measure")
    parser.add_argument("--sealing", action="store_true",
                        help="add encrypted stores of version 10 (sealing 1) to compare")
    args = parser.parse_args(argv)
    policies = args.policies.split(",")
    workdir = Path(tempfile.mkdtemp(prefix="cs-enc-bench-", dir=args.workdir))
    started, load_before = time.perf_counter(), os.getloadavg()
    try:
        state = make_state(args.mib << 20)
        systems = {f"{policy}{suffix}": store_round(workdir, state, policy, bool(suffix))
                   for policy in policies for suffix in ("", "-enc")}
        if args.sealing:
            systems.update({f"{policy}-enc10": store_round(workdir, state, policy, True, 1)
                            for policy in policies})
        measured = in_rounds(systems, args.repeat)
        machine = limits(64 << 20)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    ratios = {policy: {step: measured[f"{policy}-enc"][step] / measured[policy][step]
                       for step in measured[policy] if measured[policy][step]}
              for policy in policies}
    if args.sealing:
        ratios.update({f"{policy}-enc12/enc10": {
            step: measured[f"{policy}-enc"][step] / measured[f"{policy}-enc10"][step]
            for step in measured[policy] if measured[f"{policy}-enc10"][step]}
            for policy in policies})
    result = {
        "command": "python -m benchmarks.bench_encryption " + " ".join(argv or sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "logical_bytes": sum(a.nbytes for a in state.values()), "repeat": args.repeat,
        "limits": machine, "median": measured, "encrypted_over_plain": ratios,
        "runtime_s": time.perf_counter() - started,
        # the machine may be shared: its 1-minute load average when the run began and ended
        "load_average": [load_before[0], os.getloadavg()[0]],
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"encrypted_over_plain": ratios, "limits": machine}, indent=2))


if __name__ == "__main__":
    main()
