"""The default restore path, measured two ways, against another release's code in turns.

Each case is a store saved once (untimed) with the default policy:

- ``core-1gib``: bench_core's 1 GiB state (8 large float32 tensors, 64 small), one
  version: every chunk a standalone shuffle-zstd member of a pack;
- ``mlp``, ``sparse-embedding`` (and the other workloads of bench_resume): three
  saves of a Checkpointer, one optimizer step apart, as bench_resume makes them:
  the newest reads through delta chains (an MLP with AdamW, 126 MB; the
  suite's DLRM with sparse updates of its embedding tables, 261 MB).

For each case, processes of their own, alternating the code under test
(``--baseline DIR``: a directory holding another release's ``chunkstore/``, e.g.
from ``git archive``) and, for ``core-1gib``, safetensors (``load_file`` and a copy
into the same existing arrays, as the suite's restore does):

- ``cpu``: every read job run in turn by one pool thread, the process's CPU
  seconds: the work a restore does, which the other jobs on a
  shared machine hardly change; min and median over ``--repeat``;
- ``wall``: ``get_many_into`` as a restore runs it (the store's read jobs, a thread
  per core) into freshly allocated arrays; median and range over ``--repeat``.

Every byte is hash-checked in both.  Usage (the results file's command)::

    python -m benchmarks.bench_restore --rounds 3 --repeat 5 --baseline /tmp/base \\
        --out benchmarks/results/restore.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.bench_resume import summary

ROOT = Path(__file__).resolve().parent.parent
CASES = ("core-1gib", "mlp", "sparse-embedding")


def prepare(case: str, work: Path) -> int:
    """Save the case's store (and safetensors file); its logical bytes."""
    if case != "core-1gib":  # a Checkpointer's three saves, as bench_resume makes them
        from benchmarks.bench_resume import prepare as checkpoints
        return int(checkpoints(case, work)["tensor_bytes"])
    import chunkstore
    from benchmarks.bench_core import make_state
    state = make_state(1 << 30)
    with chunkstore.open(_store(case, work), create=True) as store, \
            store.new_version(run="r", step=0) as version:
        for name, array in state.items():
            version.put(name, array)
    import safetensors.numpy
    safetensors.numpy.save_file(state, str(work / f"{case}.safetensors"))
    return sum(a.nbytes for a in state.values())


def _store(case: str, work: Path) -> Path:
    return work / (case if case == "core-1gib" else f"{case}.store")


def child(system: str, case: str, work: Path, repeat: int) -> dict[str, Any]:
    """One process's measurements (see the module docstring)."""
    if system == "safetensors":
        import safetensors.numpy
        walls = []
        outs: dict[str, np.ndarray] | None = None
        for _ in range(repeat):
            start = time.perf_counter()
            loaded = safetensors.numpy.load_file(str(work / f"{case}.safetensors"))
            if outs is None:
                outs = {k: np.empty_like(v) for k, v in loaded.items()}
            for name, array in loaded.items():
                np.copyto(outs[name], array)
            walls.append(time.perf_counter() - start)
            del loaded
        return {"wall": walls}
    import chunkstore
    from chunkstore.format.dtypes import numpy_dtype
    from chunkstore.read import reader
    with chunkstore.open(_store(case, work)) as store:
        version = store.open_version("latest")
        entries = {name: version.entry(name) for name in version.names()}
        shapes = {n: (e.shape, numpy_dtype(e.dtype)) for n, e in entries.items()
                  if hasattr(e, "shape")}
        walls = []
        for _ in range(repeat):
            outs = {n: np.empty(shape, dtype) for n, (shape, dtype) in shapes.items()}
            store.base_cache.clear()
            start = time.perf_counter()
            version.get_many_into((n, out, None) for n, out in outs.items())
            walls.append(time.perf_counter() - start)
            del outs
        in_pool = reader.run_jobs

        def inline(executor: Any, jobs: list[Any], at_once: int) -> None:
            in_pool(executor, [lambda: [job() for job in jobs]], 1)  # one thread: all of it
        cpus = []
        outs = {n: np.empty(shape, dtype) for n, (shape, dtype) in shapes.items()}
        reader.run_jobs = inline  # type: ignore[assignment]
        for _ in range(repeat):
            store.base_cache.clear()
            # The process's CPU seconds: one pool thread works, the rest sleep.
            cpu = time.process_time()
            version.get_many_into((n, out, None) for n, out in outs.items())
            cpus.append(time.process_time() - cpu)
        reader.run_jobs = in_pool  # type: ignore[assignment]
    return {"wall": walls, "cpu": cpus, "code": str(Path(chunkstore.__file__).parent.parent)}


def _run(system: str, case: str, work: Path, repeat: int, code: Path) -> dict[str, Any]:
    command = [sys.executable, str(Path(__file__).resolve()), "--child", system, case,
               str(work), "--repeat", str(repeat)]
    env = {**os.environ, "PYTHONPATH": f"{code}{os.pathsep}{ROOT}"}
    done = subprocess.run(command, check=True, capture_output=True, text=True, env=env)
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def compare(case: str, work: Path, rounds: int, repeat: int, baseline: Path | None
            ) -> dict[str, Any]:
    logical = prepare(case, work)
    systems = {"chunkstore": ROOT}
    if baseline is not None:
        systems["chunkstore-baseline"] = baseline
    if case == "core-1gib":
        systems["safetensors"] = ROOT
    names = list(systems)
    seen: dict[str, dict[str, list[float]]] = {name: {} for name in names}
    for turn in range(rounds):
        first = turn % len(names)
        for name in names[first:] + names[:first]:
            measured = _run(name.removesuffix("-baseline"), case, work, repeat, systems[name])
            for key, values in measured.items():
                if isinstance(values, list):
                    seen[name].setdefault(key, []).extend(values)
    result: dict[str, Any] = {"logical_bytes": logical}
    for name in names:
        result[name] = {key: summary(values) for key, values in seen[name].items()}
        result[name]["wall_gbps"] = logical / result[name]["wall"]["median"] / 1e9
        if "cpu" in seen[name]:
            result[name]["cpu_gbps_per_core"] = logical / result[name]["cpu"]["median"] / 1e9
    for name in names[1:]:
        result[f"chunkstore_vs_{name}"] = _ratios(result["chunkstore"], result[name])
    return result


def _ratios(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, float]:
    """Time ratios of medians (and of the fastest CPU times)."""
    ratios = {"wall": ours["wall"]["median"] / theirs["wall"]["median"]}
    if "cpu" in theirs:
        ratios["cpu"] = ours["cpu"]["median"] / theirs["cpu"]["median"]
        ratios["cpu_min"] = ours["cpu"]["min"] / theirs["cpu"]["min"]
    return ratios


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--baseline", default=None, metavar="DIR")
    parser.add_argument("--out", default="benchmarks/results/restore.json")
    parser.add_argument("--child", nargs=3, metavar=("SYSTEM", "CASE", "DIR"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        system, case, work = args.child
        print(json.dumps(child(system, case, Path(work), args.repeat)))
        return
    work = Path(tempfile.mkdtemp(prefix="cs-restore-"))
    baseline = Path(args.baseline).resolve() if args.baseline else None
    try:
        results: dict[str, Any] = {
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                        "platform": platform.platform(), "load": os.getloadavg()},
            "rounds": args.rounds, "repeat": args.repeat,
            "command": "python -m benchmarks.bench_restore " + " ".join(argv or sys.argv[1:]),
        }
        for case in args.cases.split(","):
            results[case] = compare(case, work, args.rounds, args.repeat, baseline)
            print(case, json.dumps({k: v for k, v in results[case].items()
                                    if k.startswith("chunkstore_vs")}), file=sys.stderr)
        results["machine"]["load_after"] = os.getloadavg()
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
        print(json.dumps(results, indent=2))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
