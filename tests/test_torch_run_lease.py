"""One writer per run through the Checkpointer: a second launch of a job is refused,
naming the first; takeover stops the first; a killed job restarts without ceremony."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import chunkstore
from chunkstore.errors import InvalidInputError, RunInUseError, RunLeaseLostError
from chunkstore.protocol.runlease import read_lease
from torch_bridge import Checkpointer
from torch_bridge.errors import AsyncSaveError

ROOT = Path(__file__).resolve().parent.parent
CHILD = """
import sys, time, torch
from torch_bridge import Checkpointer
ckpt = Checkpointer(sys.argv[1], run="job")
model = torch.nn.Linear(4, 2)
ckpt.save(1, model=model)
print("saved", flush=True)
time.sleep(600)
"""


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 2)


def test_a_second_writer_is_refused_and_takeover_stops_the_first(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    first = Checkpointer(root, run="job")
    first.save(1, model=model())
    second = Checkpointer(root, run="job")
    assert second.restore(model=model()) == 1  # reading takes no lease
    with pytest.raises(RunInUseError, match=f"pid {os.getpid()}.*takeover=True"):
        second.save(2, model=model())
    other_run = Checkpointer(root, run="other")  # another run of the store is free
    other_run.save(2, model=model())
    taker = Checkpointer(root, run="job", takeover=True)
    taker.save(2, model=model())
    with pytest.raises(RunLeaseLostError):
        first.save(3, model=model())
    assert [v.step for v in taker.store.versions("job")] == [1, 2]  # nothing from `first`
    for ckpt in (first, second, other_run, taker):
        ckpt.close()
    with chunkstore.open(root) as store:
        assert read_lease(store.objects, "job") is None  # the holder gave it back


def test_an_async_writer_whose_lease_was_taken_publishes_nothing(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    first = Checkpointer(root, run="job", async_save=True)
    first.save(1, model=model())
    first.wait()
    with Checkpointer(root, run="job", takeover=True) as taker:
        taker.save(2, model=model())
        first.save(3, model=model())
        with pytest.raises(AsyncSaveError):
            first.wait()
        assert [v.step for v in taker.store.versions("job")] == [1, 2]
    first.close()


def test_a_killed_job_restarts_without_takeover(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(root)], cwd=ROOT, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "saved"
        # A second launch is refused when it is made, before it trains (it was refused
        # only at its save); a read_only one (an evaluation job) reads the run.
        with pytest.raises(RunInUseError, match=f"pid {child.pid}"):
            Checkpointer(root, run="job")
        with Checkpointer(root, run="job", read_only=True) as reader:
            assert reader.restore(model=model()) == 1
            with pytest.raises(InvalidInputError, match="read_only"):
                reader.save(2, model=model())
    finally:
        child.send_signal(signal.SIGKILL)
        child.communicate(timeout=60)
    with Checkpointer(root, run="job") as restarted:  # its process is gone: no takeover
        assert restarted.restore(model=model()) == 1
        restarted.save(2, model=model())
        assert restarted.latest_step() == 2


def test_a_takeover_during_a_save_stops_its_commit(tmp_path: Path) -> None:
    """The lease is checked right before the commit record: a writer whose run was
    taken over while it wrote publishes nothing."""
    from chunkstore.backends.wrappers import ForwardingBackend
    from chunkstore.protocol.runlease import RunLease

    root = tmp_path / "ckpts"
    first = Checkpointer(root, run="job")
    first.save(1, model=model())
    other = chunkstore.open(root, index_dir=str(tmp_path / "other-index"))
    taker = RunLease(other.objects, "job")

    once = threading.Lock()  # nodes are written by several threads at once

    class TakeOverMidSave(ForwardingBackend):
        def put_if_absent(self, key: str, data: bytes | memoryview) -> bool:
            if key.startswith("nodes/") and once.acquire(blocking=False):
                taker.acquire(takeover=True)
            return super().put_if_absent(key, data)

    first.store.backend = TakeOverMidSave(first.store.backend)
    torch.manual_seed(5)
    with pytest.raises(RunLeaseLostError):
        first.save(2, model=torch.nn.Linear(4, 2))
    assert [v.step for v in other.versions("job")] == [1]
    taker.release()
    other.close()
    first.close()


def test_a_checkpointer_dropped_without_close_gives_the_run_back(tmp_path: Path) -> None:
    import gc

    dropped = Checkpointer(tmp_path / "ckpts", run="job")
    dropped.save(1, model=model())
    del dropped
    gc.collect()
    with Checkpointer(tmp_path / "ckpts", run="job") as again:
        again.save(2, model=model())
        assert again.all_steps() == [1, 2]
