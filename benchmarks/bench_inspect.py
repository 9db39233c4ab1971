"""The commands that look into a store, at 100, 1,000 and 10,000 versions (issue 49).

``log``, ``show``, ``report`` and ``verify --quick`` are what people type to see
what a training job left behind; a job that saves every few minutes for weeks
leaves thousands of versions, and each command opens the store afresh.  Each is
timed as a user runs it: ``python -m chunkstore ARGS`` in a new process, its
output to a file, and for each run two times:

- ``wall_s``: the whole process, interpreter start and imports included;
- ``in_process_s``: the command itself (``chunkstore.cli.main`` called, the store
  opened, the answer written), which excludes the interpreter start and the
  import of the package (``import_s``, the same for every command).

The stores hold the workload of :mod:`benchmarks.bench_scale` (20 tensors of 1,024
float32, one changing per save, run ``r``), built by real saves once under
``--stores`` (``base-N``; the builder is bench_scale's).  Each label measures a copy
of each (``<label>-N``) whose index the measured code built on a first open; the
copies are then left alone 11 s and opened once more, so the timed opens find the
index current (and its listing stamps recorded, where the code keeps them), as a
user's next command does after a job's last save.  The medians of
``--repeat`` runs are recorded, each level's commands in turn.

The script measures whatever ``chunkstore`` ``--code`` holds (default: this
checkout), so the code before a change is measured from a worktree of it with the
same script and stores; each run is recorded under its ``--label`` in the results
file, beside the others.  benchmarks/results/inspect.json comes from (a 2-core
machine shared with other jobs; the stores take about 320 MB)::

    git worktree add --detach /work/before 5771ba8
    python -m benchmarks.bench_inspect --label before --code /work/before \\
        --stores /tmp/inspect-stores --out benchmarks/results/inspect.json
    python -m benchmarks.bench_inspect --label after \\
        --stores /tmp/inspect-stores --out benchmarks/results/inspect.json

``--first-runs K`` measures instead the *first* run of each command on an index
just built (the store's first open counted every version in, and nothing else ran
on it): each run on a fresh copy of that index, ``K`` rounds, each round every
command under the code measured and under ``--baseline`` in turn (the load of a
shared machine falls on both alike); with ``--s3`` also on a moto S3 server filled
with the store (benchmarks/moto_filled.py; the index copied into a fresh
``CHUNKSTORE_CACHE_DIR`` for each run).  ``--first-index saves`` takes instead the
index the saves that built the store kept (no census recorded: a job's own index,
as a user's first ``report`` after a run finds it).  Each code is recorded under its
label (``--label``, ``--baseline-label``)::

    git worktree add --detach /work/main-before main
    python -m benchmarks.bench_inspect --first-runs 3 --s3 --levels 10000 \\
        --commands "verify --quick" report --label first-after \\
        --baseline /work/main-before --baseline-label first-before \\
        --stores /tmp/inspect-stores --out benchmarks/results/inspect.json

``--first-open K`` times instead the first open of each store by a new index
(``log -n 1`` on a copy of ``base-N`` without its index: every version counted
in), ``K`` rounds, in turn with ``--baseline`` (runs ``countin-open-*``).
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
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

LEVELS = (100, 1000, 10_000)
#: Seconds a store is left alone before it is measured (more than
#: chunkstore.backends.folderstamp.SETTLE_S).
SETTLE_S = 11.0
#: What each command is run with (STORE: the store's path).
COMMANDS: dict[str, list[str]] = {
    "log": ["log", "STORE"],
    "log --all": ["log", "STORE", "--all"],
    "log --json": ["log", "STORE", "--json"],
    "show latest": ["show", "STORE", "latest"],
    "report": ["report", "STORE"],
    "report --json": ["report", "STORE", "--json"],
    "report --full": ["report", "STORE", "--full"],
    "verify --quick": ["verify", "STORE", "--quick"],
}
#: The child: imports the command line, then runs it, and says how long each took.
#: With ``BENCH_INSPECT_COUNT`` set, the stores it opens count their requests by
#: operation (benchmarks.bench_scale.opens_counted, of the code measured).
DRIVER = """
import sys, time, json, os, contextlib
started = time.perf_counter()
from chunkstore.cli import main
counting = contextlib.nullcontext(None)
if os.environ.get("BENCH_INSPECT_COUNT"):
    from benchmarks.bench_scale import opens_counted
    counting = opens_counted()
imported = time.perf_counter()
code = 0
with counting as install:
    counts = install() if install is not None else None
    try:
        main(sys.argv[1:])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
done = time.perf_counter()
with open(os.environ["BENCH_INSPECT_TIMES"], "w") as out:
    json.dump({"import_s": imported - started, "in_process_s": done - imported,
               "cpu_s": time.process_time(),
               "exit": code, "requests": None if counts is None else dict(counts)}, out)
"""


def run_once(code: Path, args: list[str], scratch: Path,
             env_extra: dict[str, str] | None = None) -> dict[str, Any]:
    """One run of the command in a new process: wall time, and the child's own times."""
    times = scratch / "times.json"
    env = {**os.environ, "PYTHONPATH": str(code), "BENCH_INSPECT_TIMES": str(times),
           **(env_extra or {})}
    with open(scratch / "out.txt", "wb") as out:
        started = time.perf_counter()
        # Run from the scratch folder: ``python -c`` puts the working directory first
        # on the path, ahead of PYTHONPATH.
        subprocess.run([sys.executable, "-c", DRIVER, *args], stdout=out,
                       stderr=subprocess.DEVNULL, env=env, check=False, cwd=scratch)
        wall = time.perf_counter() - started
    found: dict[str, Any] = json.loads(times.read_text())
    found["wall_s"] = wall
    found["output_lines"] = (scratch / "out.txt").read_bytes().count(b"\n")
    return found


def prepared(code: Path, base: Path, target: Path) -> Path:
    """A copy of ``base`` whose index the measured code built (made once per label)."""
    if not (target / "ready").exists():
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(base, target, symlinks=True, ignore=shutil.ignore_patterns("index"))
        subprocess.run([sys.executable, "-m", "chunkstore", "log", str(target), "-n", "1"],
                       env={**os.environ, "PYTHONPATH": str(code)}, check=True,
                       stdout=subprocess.DEVNULL, cwd=target.parent)
        (target / "ready").write_text("ready")
    return target


def settled(code: Path, places: dict[int, Path]) -> None:
    """Wait until no store was changed in the last :data:`SETTLE_S` seconds, then open
    each once: a store is measured as a user's next command finds it, its index up to
    date and, where the code keeps them, its listing stamps recorded (a local store
    left alone that long is opened without a listing)."""
    changed = max(path.stat().st_mtime for place in places.values()
                  for path in (place / "ready", place / "versions"))
    time.sleep(max(0.0, changed + SETTLE_S - time.time()))
    for place in places.values():
        subprocess.run([sys.executable, "-m", "chunkstore", "log", str(place), "-n", "1"],
                       env={**os.environ, "PYTHONPATH": str(code)}, check=True,
                       stdout=subprocess.DEVNULL, cwd=place.parent)


def built(stores: Path, levels: tuple[int, ...]) -> dict[int, Path]:
    """``base-N`` for each level, built by bench_scale's builder where missing (a base
    whose ``done`` names another level, copied from the one below by a build that was
    stopped, is grown to its level)."""
    from benchmarks.bench_scale import build

    for level in levels:
        done = stores / f"base-{level}" / "done"
        if done.exists() and done.read_text().strip() != str(level):
            done.unlink()
    return build(stores, levels)


def measure(code: Path, places: dict[int, Path], repeat: int, commands: list[str]
            ) -> dict[str, dict[str, Any]]:
    """The median times of each command at each level."""
    samples: dict[tuple[int, str], list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for _ in range(repeat):
            for level, place in places.items():
                for name in commands:
                    args = [str(place) if a == "STORE" else a for a in COMMANDS[name]]
                    samples.setdefault((level, name), []).append(
                        run_once(code, args, Path(scratch)))
    found: dict[str, dict[str, Any]] = {}
    for (level, name), runs in samples.items():
        # in_process_runs_s, each run in order: the first ``verify --quick`` of a store
        # reads every version (and has the index remember them), the later ones trust it
        found.setdefault(str(level), {})[name] = {
            **medians(runs), "import_s": round(statistics.median(r["import_s"] for r in runs), 4)}
        print(f"  {level:>6} versions  {name:<16} wall {found[str(level)][name]['wall_s']:7.3f} s"
              f"  in-process {found[str(level)][name]['in_process_s']:7.3f} s", flush=True)
    return found


def medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median times of a command's runs, and each run's."""
    return {"wall_s": round(statistics.median(r["wall_s"] for r in runs), 4),
            "in_process_s": round(statistics.median(r["in_process_s"] for r in runs), 4),
            "in_process_runs_s": [round(r["in_process_s"], 4) for r in runs],
            **({"cpu_s": round(statistics.median(r["cpu_s"] for r in runs), 4)}
               if all("cpu_s" in r for r in runs) else {}),
            "exit": runs[-1]["exit"], "output_lines": runs[-1]["output_lines"],
            "runs": len(runs),
            **({"requests": runs[-1]["requests"]} if runs[-1].get("requests") else {})}


@contextlib.contextmanager
def fresh_index(where: str, store: str, counted: Path, scratch: Path
                ) -> Iterator[tuple[str, dict[str, str]]]:
    """A store whose index is a fresh copy of ``counted``'s (built by its first open):
    locally a copy of the store's objects made once (``scratch/store``; no command
    measured changes them) with the index put back; on S3 the bucket's URL
    (``store``), with the index copied where the command finds it
    (``CHUNKSTORE_CACHE_DIR``).  Yields the store's name and the environment."""
    if where == "local":
        place = scratch / "store"
        if not place.exists():
            shutil.copytree(counted, place, symlinks=True,
                            ignore=shutil.ignore_patterns("index"))
        shutil.rmtree(place / "index", ignore_errors=True)
        shutil.copytree(counted / "index", place / "index")
        yield str(place), {}
        return
    from chunkstore.store import default_index_dir

    cache = scratch / "cache"
    shutil.rmtree(cache, ignore_errors=True)
    os.environ["CHUNKSTORE_CACHE_DIR"] = str(cache)
    try:
        target = default_index_dir(store, _NotLocal())  # type: ignore[arg-type]
    finally:
        del os.environ["CHUNKSTORE_CACHE_DIR"]
    shutil.copytree(counted / "index", target)
    yield store, {"CHUNKSTORE_CACHE_DIR": str(cache)}


class _NotLocal:
    """What :func:`chunkstore.store.default_index_dir` asks of a remote store's objects."""

    def local_path(self) -> None:
        return None


def first_runs(codes: dict[str, Path], counted: dict[int, Path], commands: list[str],
               rounds: int, s3: bool) -> dict[str, dict[str, Any]]:
    """Per label: the first run of each command on an index just built, locally and,
    with ``s3``, on a moto server filled with the store, ``rounds`` times, the codes of
    ``codes`` in turn for each command."""
    samples: dict[tuple[str, str, int, str], list[dict[str, Any]]] = {}
    wheres = ["local", "s3"] if s3 else ["local"]
    for where in wheres:
        for level, source in counted.items():
            with tempfile.TemporaryDirectory() as scratch_dir, \
                    _bucket(where, source) as (url, env):
                scratch = Path(scratch_dir)
                for _ in range(rounds):
                    for name in commands:
                        for label, code in codes.items():
                            with fresh_index(where, url, source, scratch) as (place, extra):
                                args = [place if a == "STORE" else a for a in COMMANDS[name]]
                                found = run_once(code, args, scratch, {**env, **extra})
                            samples.setdefault((label, where, level, name), []).append(found)
                            print(f"  {label:<14} {where:<5} {level:>6} {name:<16}"
                                  f" in-process {found['in_process_s']:7.3f} s"
                                  f" (exit {found['exit']})", flush=True)
    found_all: dict[str, dict[str, Any]] = {}
    for (label, where, level, name), runs in samples.items():
        levels = found_all.setdefault(label, {}).setdefault(where, {})
        levels.setdefault(str(level), {})[name] = medians(runs)
    return found_all


def first_opens(codes: dict[str, Path], bases: dict[int, Path], rounds: int
                ) -> dict[str, dict[str, Any]]:
    """Per label: the first open of each store by a new index (``log -n 1`` on a copy
    of ``base-N`` without its index: every version counted in), ``rounds`` times, the
    codes of ``codes`` in turn."""
    samples: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for level, base in bases.items():
        with tempfile.TemporaryDirectory() as scratch_dir:
            scratch = Path(scratch_dir)
            place = scratch / "store"
            shutil.copytree(base, place, symlinks=True, ignore=shutil.ignore_patterns("index"))
            for _ in range(rounds):
                for label, code in codes.items():
                    shutil.rmtree(place / "index", ignore_errors=True)
                    found = run_once(code, ["log", str(place), "-n", "1"], scratch)
                    samples.setdefault((label, level), []).append(found)
                    print(f"  {label:<14} {level:>6} first open in-process"
                          f" {found['in_process_s']:7.3f} s, cpu {found['cpu_s']:7.3f} s"
                          f" (exit {found['exit']})", flush=True)
    found_all: dict[str, dict[str, Any]] = {}
    for (label, level), runs in samples.items():
        found_all.setdefault(label, {})[str(level)] = medians(runs)
    return found_all


@contextlib.contextmanager
def _bucket(where: str, source: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """Locally the store's path (nothing to start); on S3 a moto server filled with
    the store (:func:`benchmarks.moto_filled.filled_bucket`), its URL and the
    environment that points the command line at it."""
    if where == "local":
        yield str(source), {}
        return
    from benchmarks.moto_filled import filled_bucket
    from tests.s3server import _DUMMY_CREDENTIALS

    os.environ.update(_DUMMY_CREDENTIALS)  # a local moto server: never real keys
    with filled_bucket(source, sorted_listing=True) as (location, _fill):
        yield location.url, {"CHUNKSTORE_STORAGE_OPTIONS": json.dumps(location.options)}


def commit_of(root: Path) -> str:
    done = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=False)
    return done.stdout.strip() or "unknown"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--label", default="after")
    parser.add_argument("--code", type=Path, default=Path(__file__).resolve().parents[1],
                        help="the checkout whose chunkstore is measured")
    parser.add_argument("--stores", type=Path, default=Path("/tmp/inspect-stores"))
    parser.add_argument("--levels", type=int, nargs="+", default=list(LEVELS))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--commands", nargs="+", default=list(COMMANDS),
                        choices=list(COMMANDS))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--first-runs", type=int, default=0, metavar="K",
                        help="measure each command's first run on an index just built,"
                        " K rounds (see the module's docstring)")
    parser.add_argument("--baseline", type=Path,
                        help="with --first-runs: another checkout measured in turn")
    parser.add_argument("--baseline-label", default="baseline")
    parser.add_argument("--s3", action="store_true",
                        help="with --first-runs: also on a moto S3 server")
    parser.add_argument("--count", action="store_true",
                        help="count each run's requests by operation (the last run's"
                        " recorded)")
    parser.add_argument("--first-index", choices=("count-in", "saves"), default="count-in",
                        help="with --first-runs: the index the first runs find, built by"
                        " the store's first open (count-in, which records each version's"
                        " census) or the one the saves that built the store kept (saves)")
    parser.add_argument("--first-open", type=int, default=0, metavar="K",
                        help="measure instead the first open of each store by a new index"
                        " (every version counted in), K rounds, in turn with --baseline")
    args = parser.parse_args(argv)
    if args.count:
        os.environ["BENCH_INSPECT_COUNT"] = "1"
    args.stores.mkdir(parents=True, exist_ok=True)
    bases = built(args.stores, tuple(args.levels))
    code = args.code.resolve()
    if args.first_open:
        return first_open_main(args, code, bases, argv)
    places = {level: prepared(code, base, args.stores / f"{args.label}-{level}")
              for level, base in bases.items()}
    settled(code, places)
    started = time.perf_counter()
    command = "python -m benchmarks.bench_inspect " + " ".join(
        sys.argv[1:] if argv is None else argv)
    machine = f"{platform.machine()}, {os.cpu_count()} cores (shared with other jobs)"
    runs: dict[str, dict[str, Any]] = {}
    if args.first_runs:
        codes = {args.label: code}
        if args.baseline is not None:
            codes[args.baseline_label] = args.baseline.resolve()
        found_by = first_runs(codes, places if args.first_index == "count-in" else bases,
                              args.commands, args.first_runs, args.s3)
        for label, found in found_by.items():
            runs[label] = {"command": command, "code": str(codes[label]),
                           "commit": commit_of(codes[label]), "first_runs": args.first_runs,
                           "first_index": args.first_index,
                           "measured_in_turn_with": [k for k in codes if k != label],
                           "machine": machine, "python": platform.python_version(),
                           "seconds": round(time.perf_counter() - started), "first": found}
    else:
        found = measure(code, places, args.repeat, args.commands)
        runs[args.label] = {
            "command": command, "code": str(code), "commit": commit_of(code),
            "repeat": args.repeat, "machine": machine, "python": platform.python_version(),
            "seconds": round(time.perf_counter() - started), "levels": found}
    record(args.out, runs)


def first_open_main(args: argparse.Namespace, code: Path, bases: dict[int, Path],
                    argv: list[str] | None) -> None:
    """``--first-open``: :func:`first_opens`, each label recorded in ``--out``."""
    started = time.perf_counter()
    codes = {args.label: code}
    if args.baseline is not None:
        codes[args.baseline_label] = args.baseline.resolve()
    found_by = first_opens(codes, bases, args.first_open)
    command = "python -m benchmarks.bench_inspect " + " ".join(
        sys.argv[1:] if argv is None else argv)
    runs = {label: {"command": command, "code": str(codes[label]),
                    "commit": commit_of(codes[label]), "first_open": args.first_open,
                    "measured_in_turn_with": [k for k in codes if k != label],
                    "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared with"
                    " other jobs)", "python": platform.python_version(),
                    "seconds": round(time.perf_counter() - started), "first_open_s": found}
            for label, found in found_by.items()}
    record(args.out, runs)


def record(out: Path | None, runs: dict[str, dict[str, Any]]) -> None:
    """Add ``runs`` to the results file ``out`` (a label already there: refused)."""
    if out is None:
        return
    results = json.loads(out.read_text()) if out.exists() else {}
    for label in runs:
        if label in results:
            raise SystemExit(f"{out} has a run labelled {label!r} already: choose"
                             " another label (runs are added, never rewritten)")
    results.update(runs)
    out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
