"""The collector pause shared by saves, restores and commands (chunkstore.collector)."""

from __future__ import annotations

import gc
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from chunkstore.cli import main
from chunkstore.collector import collector_paused


@pytest.fixture
def collector_on() -> Iterator[None]:
    """The collector on for the test, and as it was afterwards whatever the test did."""
    enabled = gc.isenabled()
    gc.enable()
    try:
        yield
    finally:
        (gc.enable if enabled else gc.disable)()


def test_overlapping_pauses_resume_the_collector_once_after_the_last(
        collector_on: None) -> None:
    inside, leave = threading.Event(), threading.Event()

    def other() -> None:
        with collector_paused():
            inside.set()
            leave.wait(10)

    thread = threading.Thread(target=other)
    try:
        with collector_paused():
            thread.start()
            assert inside.wait(10)
        assert not gc.isenabled()  # the other thread's pause still holds
    finally:
        leave.set()
        thread.join(10)
    assert gc.isenabled()


def test_a_pause_nests_and_survives_an_exception(collector_on: None) -> None:
    with pytest.raises(RuntimeError), collector_paused():
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
        raise RuntimeError
    assert gc.isenabled()


def test_a_collector_the_caller_turned_off_stays_off(collector_on: None) -> None:
    gc.disable()
    with collector_paused():
        pass
    assert not gc.isenabled()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork(2) only")
def test_a_child_forked_during_a_pause_runs_with_the_collector_on(
        collector_on: None) -> None:
    with collector_paused():
        pid = os.fork()
        if pid == 0:  # the child: its collector must be on, and a pause of its own work
            code = 0 if gc.isenabled() else 3
            with collector_paused():
                code = code or (4 if gc.isenabled() else 0)
            code = code or (0 if gc.isenabled() else 5)
            sys.stdout.flush()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_the_stores_commands_run_with_the_collector_paused(
        collector_on: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``chunkstore verify`` (as every command of chunkstore.cli) runs paused, and the
    collector is on again afterwards."""
    import chunkstore
    from chunkstore.store import Store

    with chunkstore.open(tmp_path / "s",
                         create=True) as store, store.new_version("r", 1) as version:
        version.put("w", np.ones(10, np.float32))
    seen: list[bool] = []
    verify = Store.verify

    def noting(self: Store, *args: Any, **kwargs: Any) -> Any:
        seen.append(gc.isenabled())
        return verify(self, *args, **kwargs)

    monkeypatch.setattr(Store, "verify", noting)
    with pytest.raises(SystemExit) as exited:
        main(["verify", str(tmp_path / "s")])
    assert exited.value.code == 0
    assert seen == [False]
    assert gc.isenabled()
