"""Commands whose outcome a test only reads afterwards, run in the background from the
start of the test session.

Some tests run a command and then only check what it printed or wrote: the benchmark
suite's quick run (test_bench_smoke.py, about one core for half a minute and more) and
the README's Python blocks (test_readme.py, some 20 s of torch).  Such a test marks
itself ``@pytest.mark.background(NAME)``, and its module's ``BACKGROUND_RUNS[NAME]``
(a function of a fresh folder) says what to run.  With the session's first test, one
thread starts running, one command at a time, the commands of every run a selected
test needs: about one core of work beside the tests, which mostly wait on
subprocesses, sleeps and I/O and leave the second core idle, instead of adding their
time to the session.  A test waits for its run when it gets there.  Each command has
the time limit it had when its test ran it in the foreground.  Modules of tests
marked ``background(NAME, last=True)`` run at the end of the session, and
BESIDE_THE_RUNS modules (one core of Python in the test process, no process of their
own) at its start.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest

MARKER = "background"
#: Modules that keep one core busy in the test process and start no process: run first,
#: they leave the other core to the background runs.
BESIDE_THE_RUNS = ("test_protocol_model.py",)


@dataclass
class Command:
    argv: list[str]
    cwd: Path
    env: Mapping[str, str]
    timeout_s: float


@dataclass
class BackgroundRun:
    """``commands``, run one after another, stopping at the first that fails."""

    commands: list[Command]
    #: folders removed once the run has ended
    remove_after: list[Path] = field(default_factory=list)
    done: list[subprocess.CompletedProcess[str]] = field(default_factory=list)
    error: BaseException | None = None
    ended: threading.Event = field(default_factory=threading.Event)

    def wait(self, timeout_s: float) -> list[subprocess.CompletedProcess[str]]:
        """The outcome of each command run (the last one failed if fewer than asked)."""
        assert self.ended.wait(timeout_s), f"a background run did not end in {timeout_s:.0f} s"
        if self.error is not None:
            raise self.error
        return self.done


class Lane:
    """One thread running the commands of its runs, one at a time, in order."""

    def __init__(self, runs: list[BackgroundRun]) -> None:
        self.runs = runs
        self._lock = threading.Lock()
        self._process: subprocess.Popen[str] | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._work, daemon=True)
        self._thread.start()

    def _work(self) -> None:
        for run in self.runs:
            try:
                self._run(run)
            except BaseException as exc:  # the test that waits says what went wrong
                run.error = exc
            finally:
                for folder in run.remove_after:
                    shutil.rmtree(folder, ignore_errors=True)
                run.ended.set()

    def _run(self, run: BackgroundRun) -> None:
        for command in run.commands:
            with self._lock:
                if self._closed:
                    raise RuntimeError("the session ended before the run")
                self._process = process = subprocess.Popen(
                    command.argv, cwd=command.cwd, env=dict(command.env),
                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                    text=True)
            try:
                out, err = process.communicate(timeout=command.timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                out, err = process.communicate()
                err += f"\n[killed: still running after {command.timeout_s:.0f} s]"
            run.done.append(subprocess.CompletedProcess(command.argv, process.returncode,
                                                        out, err))
            if process.returncode != 0:
                return

    def time_left_s(self) -> float:
        """An upper bound of the time every run still needs."""
        return sum(c.timeout_s for run in self.runs if not run.ended.is_set()
                   for c in run.commands) + 60

    def close(self) -> None:
        """End the command still running and skip the rest (the session ends first)."""
        with self._lock:
            self._closed = True
            if self._process is not None and self._process.poll() is None:
                self._process.kill()
        self._thread.join()


#: What the background_lane fixture gives: the lane and its runs by name.
Runs = tuple[Lane, dict[str, BackgroundRun]]


def _marks(item: pytest.Item) -> list[pytest.Mark]:
    return list(item.iter_markers(MARKER))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{MARKER}(name, last=False): the test reads the outcome of its module's"
        " BACKGROUND_RUNS[name], run from the start of the session (tests/background.py)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules of tests marked ``last=True`` go to the end and, if there are background
    runs, BESIDE_THE_RUNS to the start (each module's tests in their order)."""
    if not any(_marks(item) for item in items):
        return
    last = {item.path for item in items if any(m.kwargs.get("last") for m in _marks(item))}
    items.sort(key=lambda item: (item.path in last, item.path.name not in BESIDE_THE_RUNS))


@pytest.fixture(scope="session", autouse=True)
def background_lane(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                    ) -> Iterator[Runs]:
    """Every run a selected test needs (in the order of their tests), started with the
    session's first test."""
    runs: dict[str, BackgroundRun] = {}
    for item in request.session.items:
        for mark in _marks(item):
            name = mark.args[0]
            if name not in runs:
                starts: dict[str, Callable[[Path], BackgroundRun]] = getattr(
                    item.module, "BACKGROUND_RUNS", {})
                runs[name] = starts[name](tmp_path_factory.mktemp(name))
    lane = Lane(list(runs.values()))
    try:
        yield lane, runs
    finally:
        lane.close()


def background_outcome(lane_and_runs: Runs, name: str) -> list[subprocess.CompletedProcess[str]]:
    """Wait for the run ``name``; the outcome of each of its commands."""
    lane, runs = lane_and_runs
    return runs[name].wait(lane.time_left_s())
