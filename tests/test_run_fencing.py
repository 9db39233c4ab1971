"""Fenced run ownership (issue 47 items 2 and 3, docs/format.md §11.5), with real
processes: a writer stopped (SIGSTOP) in the middle of its commit, a new owner taking
the run, the old writer continued (SIGCONT); a second launch whose clock runs 120 s
ahead; a second launch refused when it is made; a killed writer's commit in flight."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import chunkstore
from chunkstore.errors import RunInUseError
from chunkstore.objects.kinds import PUBLISHED, VERSIONS
from tests.s3server import create_bucket, remove_bucket, s3_endpoint, storage_options
from torch_bridge import Checkpointer

__all__ = ["s3_endpoint"]  # the session fixture, re-exported so pytest finds it here

ROOT = Path(__file__).resolve().parent.parent
#: Opens the store as argv says; ``HOST`` and ``CLOCK_OFFSET`` in the environment make
#: the process play another machine (its host name) whose clock is off (time.time).
PRELUDE = """
import os, signal, socket, sys, time, torch
if os.environ.get("HOST"):
    socket.gethostname = lambda: os.environ["HOST"]
if os.environ.get("CLOCK_OFFSET"):
    _real_time = time.time
    time.time = lambda: _real_time() + float(os.environ["CLOCK_OFFSET"])
import chunkstore
from chunkstore.backends.wrappers import ForwardingBackend
from chunkstore.errors import RunInUseError, RunLeaseLostError
from tests.s3server import storage_options
from torch_bridge import Checkpointer
url, endpoint, index = sys.argv[1], sys.argv[2], sys.argv[3]
store = chunkstore.open(url, index_dir=index, create=True,
                        storage_options=storage_options(endpoint) if endpoint != "-" else None)
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
"""
#: Saves steps 1..8; stops itself (SIGSTOP) right before the commit record of step 3,
#: after every check its commit makes.
PAUSED_WRITER = PRELUDE + """
armed = []
class StopBeforeCommit(ForwardingBackend):
    def put_if_absent(self, key, data):
        if key.startswith("versions/") and armed and armed.pop():
            os.kill(os.getpid(), signal.SIGSTOP)
        return super().put_if_absent(key, data)
ckpt = Checkpointer(store, run="r")
store.backend = StopBeforeCommit(store.backend)
for step in range(1, 9):
    armed.append(step == 3)
    try:
        ckpt.save(step, model=model)
    except RunLeaseLostError:
        print("lost", step, flush=True)
        break
    print("saved", step, flush=True)
"""
#: Holds the run: saves step 1, then one more step per line read, until stdin ends.
HOLDER = PRELUDE + """
ckpt = Checkpointer(store, run="r")
ckpt.save(1, model=model)
print("saved 1", flush=True)
for step, _ in enumerate(sys.stdin, start=2):
    try:
        ckpt.save(step, model=model)
        print("saved", step, flush=True)
    except RunLeaseLostError:
        print("lost", step, flush=True)
ckpt.close()
"""
#: A second launch: made (and restoring) without takeover.
SECOND = PRELUDE + """
try:
    ckpt = Checkpointer(store, run="r", async_save=True)
except RunInUseError as exc:
    print("refused", exc.holder.get("host"), flush=True)
    sys.exit(0)
print("took", ckpt.restore(model=model), flush=True)
ckpt.save(100, model=model)
ckpt.wait()
print("saved 100", flush=True)
ckpt.close()
"""


@pytest.fixture(params=["local", "s3"])
def location(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, str]]:
    if request.param == "local":
        yield str(tmp_path / "store"), "-"
        return
    endpoint = request.getfixturevalue("s3_endpoint")
    bucket = create_bucket(endpoint)
    try:
        yield f"s3://{bucket}/store", endpoint
    finally:
        remove_bucket(endpoint, bucket)


def start(script: str, url: str, endpoint: str, index: Path, **env: str
          ) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", script, url, endpoint, str(index)],
                            cwd=ROOT, text=True, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, **env})


def line(process: subprocess.Popen[str]) -> str:
    assert process.stdout is not None
    got = process.stdout.readline().strip()
    if not got:
        process.wait(timeout=60)
        assert process.stderr is not None
        raise AssertionError(f"exited {process.returncode}: {process.stderr.read()}")
    return got


def open_store(url: str, endpoint: str, index: Path) -> chunkstore.Store:
    options = storage_options(endpoint) if endpoint != "-" else None
    return chunkstore.open(url, storage_options=options, index_dir=str(index), create=True)


def steps_of(url: str, endpoint: str, index: Path) -> list[int]:
    """The run's steps as a fresh index finds them in the store."""
    with open_store(url, endpoint, index) as store:
        return [v.step for v in store.versions("r")]


def model() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Linear(4, 2)


def test_a_writer_stopped_in_its_commit_publishes_nothing_after_a_takeover(
        location: tuple[str, str], tmp_path: Path) -> None:
    """A stopped past its checks, B takes the run and saves the next step and 10-12, A
    is continued: on main the store then held two versions of r@3.  Now B rolls A's commit in flight
    forward when it takes the run (restoring step 3), A's PUT changes nothing, and A's
    next save is refused: one chain, one version per step."""
    url, endpoint = location
    writer = start(PAUSED_WRITER, url, endpoint, tmp_path / "a")
    try:
        assert [line(writer), line(writer)] == ["saved 1", "saved 2"]
        _, status = os.waitpid(writer.pid, os.WUNTRACED)  # stopped before r@3's record
        assert os.WIFSTOPPED(status)
        with open_store(url, endpoint, tmp_path / "b") as store, \
                Checkpointer(store, run="r", takeover=True) as taker:
            restored = taker.restore(model=model())
            for step in (restored + 1, 10, 11, 12):  # as a training loop goes on
                taker.save(step, model=model())
            os.kill(writer.pid, signal.SIGCONT)
            assert line(writer) == "saved 3"  # the record B published already
            assert line(writer) == "lost 4"
            assert writer.wait(timeout=60) == 0
    finally:
        writer.kill()
        writer.communicate(timeout=60)
    steps = steps_of(url, endpoint, tmp_path / "check")
    assert len(steps) == len(set(steps)), steps  # main: [1, 2, 3, 3, 10, 11, 12]
    assert restored == 3  # A's commit in flight, published by B when it took the run
    assert steps == [1, 2, 3, 4, 10, 11, 12]


def test_a_second_launch_with_a_clock_ahead_does_not_take_a_live_run(tmp_path: Path) -> None:
    """Two machines (host names), the second's clock 120 s ahead, inside the skew the
    format tolerates, with a 60 s lease: on main it judged the first writer's heartbeat
    120 s old, took the live run, and the first died at its next save.  Liveness now
    rests on the store's clock alone."""
    url = str(tmp_path / "store")
    holder = start(HOLDER, url, "-", tmp_path / "a", HOST="machine-a")
    try:
        assert line(holder) == "saved 1"
        second = start(SECOND, url, "-", tmp_path / "b", HOST="machine-b",
                       CLOCK_OFFSET="120")
        out, err = second.communicate(timeout=60)
        assert out.split() == ["refused", "machine-a"], err
        assert holder.stdin is not None
        holder.stdin.write("next\n")
        holder.stdin.flush()
        assert line(holder) == "saved 2"  # main: "lost 2"
    finally:
        holder.kill()
        holder.communicate(timeout=60)


def test_a_silent_writer_on_another_machine_is_taken_over_after_a_lease(
        tmp_path: Path) -> None:
    """No heartbeat reached the store for a lease (the first writer stopped): a launch on
    another machine takes the run without takeover=True, whatever its clock says, and
    the first, continued, publishes nothing more."""
    url = str(tmp_path / "store")
    lease = {"CHUNKSTORE_RUN_LEASE": "2"}
    holder = start(HOLDER, url, "-", tmp_path / "a", HOST="machine-a", **lease)
    try:
        assert line(holder) == "saved 1"
        holder.send_signal(signal.SIGSTOP)
        time.sleep(3.0)
        second = start(SECOND, url, "-", tmp_path / "c", HOST="machine-b",
                       CLOCK_OFFSET="-300", **lease)
        out, err = second.communicate(timeout=60)
        assert out.split() == ["took", "1", "saved", "100"], err
        holder.send_signal(signal.SIGCONT)
        assert holder.stdin is not None
        holder.stdin.write("next\n")
        holder.stdin.flush()
        assert line(holder) == "lost 2"
    finally:
        holder.kill()
        holder.communicate(timeout=60)
    assert steps_of(url, "-", tmp_path / "check") == [1, 100]


def test_a_second_launch_is_refused_when_it_is_made(location: tuple[str, str],
                                                    tmp_path: Path) -> None:
    """On main an async second launch was made, restored, trained and saved once, and
    was refused only at its second save."""
    url, endpoint = location
    holder = start(HOLDER, url, endpoint, tmp_path / "a")
    try:
        assert line(holder) == "saved 1"
        second = start(SECOND, url, endpoint, tmp_path / "b")
        out, err = second.communicate(timeout=60)
        assert out.split()[0] == "refused", (out, err)  # main: "took 1", "saved 100"
        with open_store(url, endpoint, tmp_path / "c") as store:
            with pytest.raises(RunInUseError, match=f"pid {holder.pid}"):
                Checkpointer(store, run="r")
            with Checkpointer(store, run="r", read_only=True) as reader:  # evaluation
                assert reader.restore(model=model()) == 1
    finally:
        holder.kill()
        holder.communicate(timeout=60)


def test_a_killed_writers_commit_in_flight_is_rolled_forward(tmp_path: Path) -> None:
    """A killed (SIGKILL) between its slot claim and its commit record: the restarted
    job (same host, no takeover: the process is gone) publishes that commit as A would
    have and restores it, so a later PUT could never add a second r@3."""
    url = str(tmp_path / "store")
    writer = start(PAUSED_WRITER, url, "-", tmp_path / "a")
    try:
        assert [line(writer), line(writer)] == ["saved 1", "saved 2"]
        _, status = os.waitpid(writer.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status)
    finally:
        writer.kill()
        writer.communicate(timeout=60)
    with Checkpointer(url, run="r") as restarted:
        assert restarted.restore(model=model()) == 3
        restarted.save(4, model=model())
        assert restarted.all_steps() == [1, 2, 3, 4]
    with chunkstore.open(url, create=False) as store:
        third = store.resolve("r@3").id
        # its writer's publication marker, and the roll-forward's (for other indexes:
        # docs/format.md §17)
        assert len([m for m in store.objects.ids(PUBLISHED) if m.endswith(third)]) == 2


def test_a_version_rolled_forward_then_removed_is_not_published_again_by_its_stopped_writer(
        location: tuple[str, str], tmp_path: Path) -> None:
    """A stopped right before its PUT of r@3's record; B takes the run (rolling r@3
    forward), removes r@3 and saves step 3 again, then A is continued.  Before, A's
    put-if-absent created the removed record again: two versions of r@3, one whose
    objects a GC may have deleted.  Now the removal withdrew it (a marker under
    ``leases/``): A's save deletes the record it created again and reports the run
    lost, and r@3 is B's alone.  (A GC here would wait for A's save session.)"""
    url, endpoint = location
    writer = start(PAUSED_WRITER, url, endpoint, tmp_path / "a")
    try:
        assert [line(writer), line(writer)] == ["saved 1", "saved 2"]
        _, status = os.waitpid(writer.pid, os.WUNTRACED)  # stopped before r@3's record
        assert os.WIFSTOPPED(status)
        with open_store(url, endpoint, tmp_path / "b") as store, \
                Checkpointer(store, run="r", takeover=True) as taker:
            assert taker.restore(model=model()) == 3  # A's r@3, rolled forward
            rolled = store.resolve("r@3").id
            store.delete("r@3")
            taker.save(3, model=torch.nn.Linear(4, 2))  # the step again, other weights
            ours = store.resolve("r@3").id
            os.kill(writer.pid, signal.SIGCONT)
            assert line(writer) == "lost 3"  # before: "saved 3", its record created again
            assert writer.wait(timeout=60) == 0
    finally:
        writer.kill()
        writer.communicate(timeout=60)
    with open_store(url, endpoint, tmp_path / "check") as store:
        assert [(v.step, v.id) for v in store.versions("r")] == [(1, store.resolve("r@1").id),
                                                                 (2, store.resolve("r@2").id),
                                                                 (3, ours)]
        assert not store.objects.exists(VERSIONS, rolled)
        assert store.verify().ok


def test_a_late_put_of_a_withdrawn_version_is_never_counted_in(tmp_path: Path) -> None:
    """The same late PUT by a writer killed before it could delete it again: every index
    that finds the record deletes it instead of listing it (a fresh one, and the
    taker's own)."""
    url = str(tmp_path / "store")
    writer = start(PAUSED_WRITER, url, "-", tmp_path / "a")
    try:
        assert [line(writer), line(writer)] == ["saved 1", "saved 2"]
        _, status = os.waitpid(writer.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status)
        with open_store(url, "-", tmp_path / "b") as store, \
                Checkpointer(store, run="r", takeover=True) as taker:
            assert taker.restore(model=model()) == 3
            rolled = store.resolve("r@3").id
            record = store.objects.get(VERSIONS, rolled)
            store.delete("r@3")
            taker.save(4, model=model())
    finally:
        writer.kill()
        writer.communicate(timeout=60)
    with open_store(url, "-", tmp_path / "b") as store:
        assert store.objects.put_if_absent(VERSIONS, rolled, record)  # the late PUT
    for index in ("b", "fresh"):
        with open_store(url, "-", tmp_path / index) as store:
            assert [v.step for v in store.versions("r")] == [1, 2, 4], index
    with open_store(url, "-", tmp_path / "b") as store:
        assert not store.objects.exists(VERSIONS, rolled)
        assert store.verify().ok
