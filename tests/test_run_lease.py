"""One writer per run: the run lease (chunkstore/protocol/runlease.py) on a local store
and on the S3 server, with real processes racing for it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import chunkstore
from chunkstore.errors import RunInUseError, RunLeaseLostError
from chunkstore.objects.kinds import LEASES
from chunkstore.protocol.runlease import RUN_LEASE_S, RunLease, read_lease
from tests.s3server import create_bucket, remove_bucket, s3_endpoint, storage_options

__all__ = ["s3_endpoint"]  # the session fixture, re-exported so pytest finds it here

ROOT = Path(__file__).resolve().parent.parent
#: One of RACERS processes: once every one is ready (however slow a busy machine makes
#: their start), all try to take the run at once; the winner holds it until every
#: other has tried, so a later start can never win it after a release.
RACERS = 4
RACER = """
import os, pathlib, sys, time, chunkstore
from chunkstore.errors import RunInUseError
from chunkstore.protocol.runlease import RunLease
from tests.s3server import storage_options
url, endpoint, start = sys.argv[1], sys.argv[2], float(sys.argv[3])
here, racers = pathlib.Path(sys.argv[4]), int(sys.argv[5])
def wait_for(kind, count):
    deadline = time.time() + 90
    while len(list(here.parent.glob(f"{kind}-*"))) < count and time.time() < deadline:
        time.sleep(0.01)
options = storage_options(endpoint) if url.startswith("s3://") else None
with chunkstore.open(url, storage_options=options, index_dir=str(here)) as store:
    lease = RunLease(store.objects, "job")
    (here.parent / f"ready-{os.getpid()}").touch()
    wait_for("ready", racers)
    time.sleep(max(0.0, start - time.time()))
    try:
        lease.acquire()
        print("won", flush=True)
        wait_for("tried", racers - 1)
        lease.check()
        lease.release()
    except RunInUseError as exc:
        print("lost", exc.holder.get("pid"), flush=True)
        (here.parent / f"tried-{os.getpid()}").touch()
"""


@pytest.fixture(params=["local", "s3"])
def location(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, str]]:
    if request.param == "local":
        url = str(tmp_path / "store")
        chunkstore.open(url, create=True).close()
        yield url, ""
        return
    endpoint = request.getfixturevalue("s3_endpoint")
    bucket = create_bucket(endpoint)
    url = f"s3://{bucket}/store"
    chunkstore.open(url, create=True, storage_options=storage_options(endpoint),
                    index_dir=str(tmp_path / "index")).close()
    try:
        yield url, endpoint
    finally:
        remove_bucket(endpoint, bucket)


def open_store(url: str, endpoint: str, index: Path) -> chunkstore.Store:
    options = storage_options(endpoint) if endpoint else None
    return chunkstore.open(url, storage_options=options, index_dir=str(index))


def test_processes_racing_for_a_run_get_one_writer(tmp_path: Path) -> None:
    """On a local store (a create is a link: atomic).  On S3 the same rests on the
    server's conditional create (If-None-Match), which AWS makes atomic and the moto
    server CI runs does not under load (two creates of one key can both succeed
    there), so the S3 case is the sequential takeover test below."""
    url, endpoint = str(tmp_path / "store"), ""
    chunkstore.open(url, create=True).close()
    start = time.time()  # and then every racer ready (RACER)
    racers = [subprocess.Popen([sys.executable, "-c", RACER, url, endpoint or "-", str(start),
                                str(tmp_path / f"index-{i}"), str(RACERS)], cwd=ROOT,
                               text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
              for i in range(RACERS)]
    outcomes = []
    for racer in racers:
        out, err = racer.communicate(timeout=120)
        assert racer.returncode == 0, err
        outcomes.append(out.split()[0])
    assert outcomes.count("won") == 1, outcomes
    with open_store(url, endpoint, tmp_path / "check") as store:
        assert read_lease(store.objects, "job") is None  # released by its holder


def test_a_live_holder_is_named_and_takeover_stops_it(location: tuple[str, str],
                                                      tmp_path: Path) -> None:
    url, endpoint = location
    with open_store(url, endpoint, tmp_path / "a") as first_store, \
            open_store(url, endpoint, tmp_path / "b") as second_store:
        first = RunLease(first_store.objects, "job")
        first.acquire()
        second = RunLease(second_store.objects, "job")
        with pytest.raises(RunInUseError, match=f"pid {os.getpid()}") as caught:
            second.acquire()
        assert caught.value.holder["token"] == first.token and "takeover=True" in str(
            caught.value)
        second.acquire(takeover=True)
        second.check()
        with pytest.raises(RunLeaseLostError, match="no longer this process's"):
            first.check()
        first.release()  # not its lease any more: leaves the new holder's alone
        stored = read_lease(second_store.objects, "job")
        assert stored is not None and stored["token"] == second.token
        second.release()
        assert read_lease(second_store.objects, "job") is None


def craft(store: chunkstore.Store, **fields: object) -> None:
    body = {"format_version": 1, "run": "job", "token": "f" * 32, "host": "elsewhere",
            "pid": 4242, "pidns": "other", "since": time.time() - 100, **fields}
    store.objects.put(LEASES, "job", json.dumps(body).encode())


def age(store: chunkstore.Store, name: str, seconds: float) -> None:
    """Make a lease object look last written ``seconds`` ago by the store's clock."""
    path = store.objects.local_path()
    assert path is not None
    then = time.time() - seconds
    os.utime(os.path.join(path, "leases", name), (then, then))


def test_a_dead_or_expired_holder_is_taken_over(tmp_path: Path) -> None:
    """Liveness from another host is the lease object's stored time against the store's
    own clock (a probe written now): the heartbeat a holder writes is never believed."""
    with chunkstore.open(tmp_path / "store", create=True) as store:
        # Another host, written within the lease: alive, whatever heartbeat it claims.
        craft(store, heartbeat=time.time() - 10 * RUN_LEASE_S)
        with pytest.raises(RunInUseError, match="host elsewhere, pid 4242"):
            RunLease(store.objects, "job").acquire()
        # Another host, not rewritten for longer than the lease: expired.
        age(store, "job", RUN_LEASE_S + 5)
        lease = RunLease(store.objects, "job")
        lease.acquire()
        assert lease.took_over is not None and lease.took_over["pid"] == 4242
        assert lease.generation == 1
        lease.release()
        assert read_lease(store.objects, "job") is None
        # This host, a process that has exited: dead at once.
        gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True)
        from chunkstore.protocol.sessions import owner_info
        mine = owner_info()
        craft(store, heartbeat=time.time(), host=mine["host"], pidns=mine["pidns"],
              pid=int(gone.stdout), process_start="0")
        lease = RunLease(store.objects, "job")
        lease.acquire()
        lease.release()
        # A heartbeat from the far future is not believed either: the object is fresh.
        craft(store, heartbeat=time.time() + 10 * RUN_LEASE_S)
        with pytest.raises(RunInUseError):
            RunLease(store.objects, "job").acquire()


@pytest.mark.parametrize("damage", ["not json", "a list", "a directory"])
def test_a_lease_object_of_the_wrong_shape_is_set_aside(tmp_path: Path, damage: str) -> None:
    """A damaged or crafted lease holds nothing: it is set aside with a typed warning
    (a directory gave an untyped IsADirectoryError)."""
    from chunkstore.errors import LeaseSetAsideWarning

    with chunkstore.open(tmp_path / "store", create=True) as store:
        path = Path(store.objects.local_path() or "") / "leases" / "job"
        path.parent.mkdir(exist_ok=True)
        if damage == "a directory":
            path.mkdir()
        else:
            path.write_bytes(b"{not json" if damage == "not json" else b"[1, 2]")
        lease = RunLease(store.objects, "job")
        with pytest.warns(LeaseSetAsideWarning, match="leases/job"):
            lease.acquire()
        lease.check()
        lease.release()


def test_a_lease_left_behind_is_ignored_by_every_other_command(tmp_path: Path) -> None:
    """A lease (and a drill record) are objects of their own: verify, gc, an index
    rebuild and sync work around them; sync does not copy a lease (it is the source
    store's writer's, not the copy's)."""
    from chunkstore.objects.kinds import DRILLS

    with chunkstore.open(tmp_path / "store", create=True) as store:
        with store.new_version(run="job", step=1) as version:
            version.put("w", np.arange(10.0))
        craft(store, heartbeat=time.time())
        store.objects.put(DRILLS, "00000000000000000001-abcdef012345", b'{"format_version": 1}')
        assert store.verify().ok
        store.gc(grace=0)
        store.rebuild_index()
        assert read_lease(store.objects, "job") is not None
        assert [v.step for v in store.versions()] == [1]
    copied = chunkstore.sync(tmp_path / "store", tmp_path / "copy")
    assert len(copied.copied) == 1
    with chunkstore.open(tmp_path / "copy") as copy:
        assert read_lease(copy.objects, "job") is None
        assert copy.verify().ok


@pytest.mark.parametrize("kind", ["gen", "slot"])
def test_a_lease_object_of_a_newer_format_is_refused(tmp_path: Path, kind: str) -> None:
    """A generation or commit slot written by a newer release follows rules this release
    does not know (docs/format.md, rule 1): taking the run, with takeover or without,
    is refused with FormatVersionError, and nothing is written."""
    from chunkstore.errors import FormatVersionError
    with chunkstore.open(tmp_path / "s", create=True) as store:
        name = f"job@{kind}-{1:012d}"
        store.objects.put(LEASES, name, json.dumps(
            {"format_version": 3, "host": "elsewhere", "pid": 7}).encode())
        before = sorted(store.objects.ids(LEASES))
        for takeover in (False, True):
            with pytest.raises(FormatVersionError, match=f"leases/{name}"):
                RunLease(store.objects, "job").acquire(takeover=takeover)
        if kind == "gen":
            assert sorted(store.objects.ids(LEASES)) == before
