"""Real multi-rank runs for the tests: gloo process groups on the CPU, bounded in time.

The parent side (:class:`Ranks`, :func:`all_ok`) starts ``world`` processes from a
forkserver that has imported the child module once; the child side
(:func:`run_job`) joins the process group, runs one job and writes the rank's
report (``rank<r>.json``: ``ok``, or the error, its type and traceback) for the
parent to read.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SPAWN_TIMEOUT_S = 90.0
#: The key of ``extra`` that carries the parent's ``CHUNKSTORE_*`` variables to each rank.
ENVIRON = "_chunkstore_environ"
Job = Callable[[int, int, str, dict[str, Any]], dict[str, Any]]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Ranks:
    """``world`` rank processes running ``job`` of the child module whose ``run_rank``
    (a wrapper of :func:`run_job`) is given."""

    def __init__(self, child: str, run_rank: Callable[..., None], job: str, url: str,
                 out: Path, extra: dict[str, Any] | None = None, world: int = 2) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.out = out
        self.job = job
        # A forkserver keeps the environment it started with (another test's, earlier in
        # this process): each rank takes the parent's CHUNKSTORE_* variables as they are
        # now (a password, a fault to inject), as a launcher gives each rank its own.
        extra = {**(extra or {}), ENVIRON: {k: v for k, v in os.environ.items()
                                            if k.startswith("CHUNKSTORE_")}}
        ctx = mp.get_context("forkserver")
        # One server process imports torch and the jobs once; every rank forks from it.
        ctx.set_forkserver_preload([child])
        port = _free_port()
        self.processes = [ctx.Process(target=run_rank, args=(r, world, port, url, job,
                                                             str(out), extra),
                                      daemon=True) for r in range(world)]
        for process in self.processes:
            process.start()
        self.deadline = time.monotonic() + SPAWN_TIMEOUT_S

    def wait_for(self, marker: str) -> None:
        """Until every rank has written ``rank<r>.<marker>``."""
        while not all((self.out / f"rank{r}.{marker}").exists()
                      for r in range(len(self.processes))):
            assert time.monotonic() < self.deadline, f"no rank wrote {marker} in time"
            assert all(p.is_alive() for p in self.processes), "a rank ended early"
            time.sleep(0.005)

    def kill(self) -> list[int | None]:
        """SIGKILL every rank still running; their exit codes."""
        for process in self.processes:
            if process.is_alive():
                process.kill()
        for process in self.processes:
            process.join()
        return self.exit_codes()

    def exit_codes(self) -> list[int | None]:
        return [p.exitcode for p in self.processes]

    def join(self) -> list[dict[str, Any] | None]:
        """Wait for every rank (a straggler is killed and fails); each rank's report
        (None for a rank that wrote none)."""
        for process in self.processes:
            process.join(max(0.0, self.deadline - time.monotonic()))
        stragglers = [r for r, p in enumerate(self.processes) if p.is_alive()]
        if stragglers:
            self.kill()
        assert not stragglers, (f"ranks {stragglers} of {self.job} still ran after"
                                f" {SPAWN_TIMEOUT_S}s")
        reports = []
        for r in range(len(self.processes)):
            path = self.out / f"rank{r}.json"
            reports.append(json.loads(path.read_text()) if path.exists() else None)
        return reports


def all_ok(reports: list[dict[str, Any] | None]) -> list[dict[str, Any]]:
    """The reports, once every rank reported success (else the failing rank's story)."""
    for rank, report in enumerate(reports):
        assert report is not None, f"rank {rank} reported nothing"
        assert report["ok"], f"rank {rank}: {report['error']}\n{report['traceback']}"
        assert not report.get("problems"), f"rank {rank}: {report['problems']}"
    return [r for r in reports if r is not None]


def run_job(jobs: dict[str, Job], rank: int, world: int, port: int, url: str, job: str,
            out: str, extra: dict[str, Any]) -> None:
    """In a rank process: join the group, run ``jobs[job]``, write the rank's report."""
    environ = extra.pop(ENVIRON, {})
    for name in [k for k in os.environ if k.startswith("CHUNKSTORE_") and k not in environ]:
        del os.environ[name]
    os.environ.update(environ)
    torch.set_num_threads(1)
    Path(out, f"rank{rank}.started").write_text(str(time.time()))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=30))
    try:
        report = {"ok": True, **jobs[job](rank, world, url, extra)}
    except BaseException as exc:  # the parent reads every rank's story
        report = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                  "type": type(exc).__name__, "traceback": traceback.format_exc()}
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    if report["ok"]:
        dist.destroy_process_group()


def assert_only_the_first_save_published(store: Any, run: str) -> None:
    """After a save whose rank 1 was killed: only step 1 is published, the store
    verifies, and GC at grace 0 removes the killed rank's chunks."""
    assert [v.step for v in store.versions(run)] == [1], "the killed save was published"
    result = store.verify()
    assert result.ok, result.problems
    swept = store.gc(grace=0)
    assert swept.chunks_deleted + swept.orphans_deleted > 0, "rank 1's chunks stay"
    result = store.verify()
    assert result.ok, result.problems
