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
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
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
DRIVER = """
import sys, time, json, os
started = time.perf_counter()
from chunkstore.cli import main
imported = time.perf_counter()
code = 0
try:
    main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code if isinstance(exc.code, int) else 1
done = time.perf_counter()
with open(os.environ["BENCH_INSPECT_TIMES"], "w") as out:
    json.dump({"import_s": imported - started, "in_process_s": done - imported,
               "exit": code}, out)
"""


def run_once(code: Path, args: list[str], scratch: Path) -> dict[str, Any]:
    """One run of the command in a new process: wall time, and the child's own times."""
    times = scratch / "times.json"
    env = {**os.environ, "PYTHONPATH": str(code), "BENCH_INSPECT_TIMES": str(times)}
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
        found.setdefault(str(level), {})[name] = {
            "wall_s": round(statistics.median(r["wall_s"] for r in runs), 4),
            "in_process_s": round(statistics.median(r["in_process_s"] for r in runs), 4),
            "import_s": round(statistics.median(r["import_s"] for r in runs), 4),
            # each run in order: the first ``verify --quick`` of a store reads every
            # version (and has the index remember them), the later ones trust that
            "in_process_runs_s": [round(r["in_process_s"], 4) for r in runs],
            "exit": runs[-1]["exit"], "output_lines": runs[-1]["output_lines"],
            "runs": len(runs)}
        print(f"  {level:>6} versions  {name:<16} wall {found[str(level)][name]['wall_s']:7.3f} s"
              f"  in-process {found[str(level)][name]['in_process_s']:7.3f} s", flush=True)
    return found


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
    args = parser.parse_args(argv)
    args.stores.mkdir(parents=True, exist_ok=True)
    bases = built(args.stores, tuple(args.levels))
    code = args.code.resolve()
    places = {level: prepared(code, base, args.stores / f"{args.label}-{level}")
              for level, base in bases.items()}
    settled(code, places)
    started = time.perf_counter()
    found = measure(code, places, args.repeat, args.commands)
    run = {"command": "python -m benchmarks.bench_inspect " + " ".join(
               sys.argv[1:] if argv is None else argv),
           "code": str(code), "commit": commit_of(code), "repeat": args.repeat,
           "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared with other jobs)",
           "python": platform.python_version(), "seconds": round(time.perf_counter() - started),
           "levels": found}
    if args.out is not None:
        results = json.loads(args.out.read_text()) if args.out.exists() else {}
        results[args.label] = run
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
