"""The benchmark suite: storage amplification and speed of chunkstore, torch.save, safetensors, DCP.

For each workload (real CPU training, a save every k steps, N versions) the
suite records the saved states once, then replays them into every system,
each in a fresh process (``benchmarks.worker``) so its peak memory is its
own, the processes taking turns step by step so that every system is timed
in the same minutes (the quick mode runs everything in one process instead: it checks that
the suite works and what storage must show by construction, not speed or
memory).  It also runs the ~1 GB throughput benchmark against the machine's
limits (``bench_core``), the async-pause benchmark (``bench_pause``) and the
sharded DCP benchmark at world sizes 1, 2 and 4 (``bench_dcp``: DCP's
FileSystemWriter against ChunkStoreWriter, 10 versions; quick: 2 versions
of a tiny state at world sizes 1 and 2), then writes ``latest.json``,
``run.json``, ``latest.md`` and PNG plots.  Two restore references take turns
with the systems (``benchmarks.systems.REFERENCES``: a checked read and the
machine's copy+hash floor); their records and chunkstore's restores against
them, with issue 49's targets, go to ``restore_floors.json`` (and a section of
``latest.md``), not into the storage and save tables.  Usage::

    python -m benchmarks.suite                 # full mode, into benchmarks/results/
    python -m benchmarks.suite --quick         # smoke test (~30 s), into benchmarks/results/quick/
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
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

import torch

from benchmarks import bench_core, bench_dcp, bench_pause, render, summarize, worker
from benchmarks.systems import REFERENCES, SYSTEMS
from benchmarks.trace import TraceWriter
from benchmarks.workloads import FULL, QUICK, TRAIN, WORKLOADS, Scale

REPO = Path(__file__).resolve().parent.parent


def _child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}


def _python(module: str, *args: str) -> str:
    """Run ``python -m module args`` from the repository root; its stdout."""
    done = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=_child_env(),
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{module} {' '.join(args)} failed:\n{done.stderr[-4000:]}")
    return done.stdout


def record_trace(workload: str, scale: Scale, trace_dir: Path) -> dict[str, Any]:
    """Train ``workload`` once, recording each saved state; its description."""
    writer = TraceWriter(trace_dir, workload)
    started = time.perf_counter()
    meta = TRAIN[workload](scale, writer.add)
    versions = writer.versions
    meta.update({
        "train_s": time.perf_counter() - started, "versions": len(versions),
        "runs": len({v.run for v in versions}),
        "save_every": (scale.sparse_save_every if workload == "sparse-embedding"
                       else scale.save_every),
        "logical_bytes": versions[-1].logical_bytes,
        # What tensor-level dedup could reach: bytes of tensors never seen before.
        "ideal_tensor_dedup_amplification":
            sum(v.new_tensor_bytes for v in versions) / versions[-1].logical_bytes,
        "ideal_cumulative_bytes": list(itertools.accumulate(v.new_tensor_bytes
                                                            for v in versions)),
    })
    writer.finish(meta)
    # The trace is gigabytes of dirty pages; written back now, not while systems are
    # timed (a syncfs, as chunkstore's save does, would wait for all of it).
    os.sync()
    return meta


def run_systems(trace_dir: Path, work_dir: Path, systems: list[str], repeat: int,
                in_process: bool) -> list[dict[str, Any]]:
    """Each system in a fresh worker process, all taking turns (or all in this process).

    The workers start together; each timed step of one (a save, a restore, an
    async save) runs while the others wait, and the turns go round-robin from
    a different system each round, so every system is timed in the same minutes
    (``benchmarks.worker``'s docstring says why).
    """
    if in_process:
        return [{**worker.run(trace_dir, system, work_dir / system, repeat),
                 "rss_isolated": False} for system in systems]
    workers = {system: _Worker(trace_dir, system, work_dir / system, repeat)
               for system in systems}
    try:
        waiting = [system for system in systems if workers[system].until_ready()]
        rounds = 0
        while waiting:
            start = rounds % len(waiting)
            still = []
            for system in waiting[start:] + waiting[:start]:
                if workers[system].turn():
                    still.append(system)
            waiting = [system for system in systems if system in still]
            rounds += 1
        return [record for system in systems for record in workers[system].finish()]
    finally:
        for each in workers.values():
            each.close()


class _Worker:
    """One system's ``benchmarks.worker`` process, run with ``--turns``."""

    def __init__(self, trace_dir: Path, system: str, work_dir: Path, repeat: int) -> None:
        self.system = system
        self.records: list[dict[str, Any]] | None = None
        # A file, not a pipe: a pipe could fill up while the worker waits; closed in
        # close().
        self.stderr = tempfile.TemporaryFile()  # noqa: SIM115
        self.process = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.worker", str(trace_dir), system,
             str(work_dir), "--repeat", str(repeat), "--turns"],
            cwd=REPO, env=_child_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self.stderr, text=True)

    def _failed(self, what: str) -> RuntimeError:
        self.stderr.seek(0)
        tail = self.stderr.read().decode(errors="replace")[-4000:]
        return RuntimeError(f"the {self.system} worker {what} (exit status"
                            f" {self.process.wait()}):\n{tail}")

    def until_ready(self) -> bool:
        """Read until the worker waits for a turn (True) or has printed its records."""
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith(worker.TURN_READY):
                return True
            if line.startswith(worker.RESULT_PREFIX):
                self.records = json.loads(line[len(worker.RESULT_PREFIX):])
                # The worker's exit (freeing its state, its threads ending) is untimed
                # work too: it must not run beside the next worker's timed step.  It
                # did: every chunkstore system's last async pause took 100-490 ms
                # against 7-20 ms, in each of three suite runs before this wait.
                self.process.wait()
                return False
        raise self._failed("ended without its records")

    def turn(self) -> bool:
        """Let the worker run one timed step; whether it wants another."""
        assert self.process.stdin is not None
        try:
            self.process.stdin.write("go\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            raise self._failed("ended while it waited for its turn") from None
        return self.until_ready()

    def finish(self) -> list[dict[str, Any]]:
        if self.process.wait() != 0 or self.records is None:
            raise self._failed("failed")
        return self.records

    def close(self) -> None:
        """End the process if it still runs (another worker failed) and close its files."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        for stream in (self.process.stdin, self.process.stdout, self.stderr):
            if stream is not None:
                stream.close()


def run_reference(out_dir: Path, work_dir: Path, quick: bool) -> None:
    """bench_core (~1 GB state vs the machine's limits), bench_pause and bench_dcp (a
    sharded state at world sizes 1, 2 and 4, N versions), into ``out_dir``.

    Quick: tiny states, in this process (the smoke test checks they run, not their
    figures); bench_dcp's ranks are processes in either mode.
    """
    core = ["--gib", "0.015625", "--repeat", "1"] if quick else ["--gib", "1", "--repeat", "5"]
    core += ["--out", str(out_dir / "core.json"), "--workdir", str(work_dir)]
    pause = ["--mib", "4", "--repeat", "2"] if quick else ["--mib", "256", "--repeat", "5"]
    pause += ["--out", str(out_dir / "pause.json"), "--dir", str(work_dir)]
    sharded = (["--smoke", "--worlds", "1", "2"] if quick
               else ["--mib", "32", "--versions", "10", "--worlds", "1", "2", "4"])
    sharded += ["--out", str(out_dir / "dcp.json")]
    if quick:
        with contextlib.redirect_stdout(io.StringIO()):
            bench_core.main(core)
            bench_pause.main(pause)
            bench_dcp.main(sharded)
        return
    _python("benchmarks.bench_core", *core)
    _python("benchmarks.bench_pause", *pause)
    _python("benchmarks.bench_dcp", *sharded)


def machine() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads()}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.suite", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="tiny states, everything in this one process: a smoke test"
                             " (~30 s) of the results' schema and of the storage figures"
                             " every system must show by construction")
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="results folder (default: benchmarks/results, or"
                             " benchmarks/results/quick with --quick)")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="where traces and checkpoints go (default: a temp dir)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--references", default=",".join(REFERENCES),
                        help="restore references timed in turns with the systems"
                             " (empty: none)")
    parser.add_argument("--repeat", type=int, default=None,
                        help="timing repeats for restores (default: 5, 1 with --quick)")
    parser.add_argument("--no-reference", action="store_true",
                        help="skip bench_core, bench_pause and bench_dcp")
    args = parser.parse_args(argv)
    if args.out_dir is None:
        args.out_dir = REPO / "benchmarks" / "results" / ("quick" if args.quick else "")
    if args.repeat is None:
        args.repeat = 1 if args.quick else 5
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    scale = QUICK if args.quick else FULL
    if args.quick:
        # Tiny tensors gain nothing from intra-op threads, and on a busy machine
        # spinning threads slow training several-fold.
        torch.set_num_threads(1)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if args.work_dir is not None:
        args.work_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="cs-suite-", dir=args.work_dir))
    records: list[dict[str, Any]] = []
    workloads: dict[str, Any] = {}
    measured = args.systems.split(",") + [name for name in args.references.split(",") if name]
    try:
        for name in args.workloads.split(","):
            trace_dir = work / "trace" / name
            workloads[name] = record_trace(name, scale, trace_dir)
            print(f"{name}: trained {workloads[name]['train_s']:.1f} s", file=sys.stderr)
            records += run_systems(trace_dir, work / name, measured, args.repeat,
                                   in_process=args.quick)
            shutil.rmtree(trace_dir)
            print(f"{name}: measured, {time.perf_counter() - started:.0f} s so far",
                  file=sys.stderr)
        if not args.no_reference:
            run_reference(args.out_dir, work, args.quick)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    command = " ".join(["python -m benchmarks.suite", *(sys.argv[1:] if argv is None else argv)])
    run_info = {"command": command, "mode": "quick" if args.quick else "full",
                # the machine may be shared: its 1-minute load average as the run ended
                "load_average": os.getloadavg()[0],
                "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": machine(),
                "runtime_s": time.perf_counter() - started, "scale": scale.__dict__,
                "workloads": workloads, "repeat": args.repeat}
    systems = [record for record in records if not record.get("reference")]
    floors = summarize.restore_floors(records, command)
    (args.out_dir / "latest.json").write_text(json.dumps(systems, indent=1) + "\n")
    (args.out_dir / "run.json").write_text(json.dumps(run_info, indent=1) + "\n")
    (args.out_dir / "restore_floors.json").write_text(json.dumps(floors, indent=1) + "\n")
    render.write_all(args.out_dir)
    print(f"results in {args.out_dir} ({run_info['runtime_s']:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
