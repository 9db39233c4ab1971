"""The benchmark suite's quick run that tests/test_bench_smoke.py inspects, started in the
background as the test session starts.

``python -m benchmarks.suite --quick`` is one process that needs about one core
for half a minute and more; the tests read only its output files.  Started at
the session's first test, it runs beside the tests before it (most of the suite
waits on subprocesses, sleeps and I/O and leaves the second core idle) instead of
adding its time to the run.  The module of the tests that read its results runs
at the end of the session: they wait for the run there if it has not ended yet,
and the module's other benchmark tests (worker processes importing torch) do not
compete with it for the CPU.  test_protocol_model.py runs first: it keeps one core
busy in this process for a good part of the run's time and starts no process of
its own, so the run has the other core to itself then.  It starts only when a
selected test needs it (and the order changes only then).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHM = Path("/dev/shm")
#: The fixture (in test_bench_smoke.py) of the tests that read the run's results.
RESULTS_FIXTURE = "quick_suite_results"
#: Modules that keep one core busy in this process and start no other: they go first,
#: while the run has the other core.
BESIDE_THE_RUN = ("test_protocol_model.py",)


class QuickSuiteRun:
    """One ``benchmarks.suite --quick`` process writing into ``root / "results"``."""

    TIMEOUT_S = 240.0

    def __init__(self, root: Path) -> None:
        self.out = root / "results"
        self.log = root / "suite.log"  # its stdout and stderr, for a failure's message
        # The quick mode checks what is stored, not how fast the disk stores it: on a
        # memory-backed file system where there is one.
        on_shm = SHM.is_dir() and os.access(SHM, os.W_OK)
        self.work = Path(tempfile.mkdtemp(prefix="cs-smoke-", dir=SHM if on_shm else root))
        self.deadline = time.monotonic() + self.TIMEOUT_S
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "benchmarks.suite", "--quick", "--out-dir",
                 str(self.out), "--work-dir", str(self.work)],
                cwd=REPO, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONPATH": str(REPO)})

    def results(self) -> Path:
        """Wait for the run (up to TIMEOUT_S from its start); its results folder."""
        try:
            code = self.process.wait(timeout=max(0.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.close()
            raise AssertionError(f"benchmarks.suite --quick ran over {self.TIMEOUT_S:.0f} s:"
                                 f"\n{self._tail()}") from None
        finally:
            shutil.rmtree(self.work, ignore_errors=True)
        assert code == 0, f"benchmarks.suite --quick failed (exit {code}):\n{self._tail()}"
        return self.out

    def close(self) -> None:
        """End the run if it still runs (the session ends early) and remove its work dir."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        shutil.rmtree(self.work, ignore_errors=True)

    def _tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


@pytest.fixture(scope="session", autouse=True)
def quick_suite_run(request: pytest.FixtureRequest,
                    tmp_path_factory: pytest.TempPathFactory) -> Iterator[QuickSuiteRun | None]:
    """The run, started with the session's first test if a selected test reads it."""
    if not any(RESULTS_FIXTURE in getattr(item, "fixturenames", ())
               for item in request.session.items):
        yield None
        return
    run = QuickSuiteRun(tmp_path_factory.mktemp("quick-suite"))
    try:
        yield run
    finally:
        run.close()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules of the tests that read the run go last (their tests in their order),
    so it has the time of the rest of the session to end; BESIDE_THE_RUN goes first."""
    last = {item.path for item in items if RESULTS_FIXTURE in getattr(item, "fixturenames", ())}
    if not last:
        return
    items.sort(key=lambda item: (item.path in last, item.path.name not in BESIDE_THE_RUN))
