"""Read leases (chunkstore/protocol/readleases.py, docs/format.md §11.6): a version
opened for reading keeps reading whole until it is closed, whatever retention and
GC (with no grace, from another index) do meanwhile, because the reader is visible
in the store; a reader that is gone protects nothing.

Real files, real LMDB, real processes (a reader SIGKILLed), the moto S3 server.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import chunkstore
from chunkstore.backends.wrappers import ForwardingBackend
from chunkstore.errors import MissingChunkError, UnprotectedReadWarning, VersionRemovedError
from chunkstore.objects.kinds import READERS
from chunkstore.read.reader import VersionReader
from tests.s3server import create_bucket, remove_bucket, s3_endpoint, storage_options

__all__ = ["s3_endpoint"]

CHUNK = 4096
REPO = Path(__file__).resolve().parent.parent


def arrays(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    return {"w": rng.standard_normal(6 * CHUNK // 4).astype(np.float32),
            "b": rng.standard_normal(50).astype(np.float32)}


def save(store: chunkstore.Store, step: int) -> str:
    with store.new_version(run="r", step=step) as v:
        for name, array in arrays(step).items():
            v.put(name, array)
    return v.info.id


def remove_and_collect(url: str, index: Path, version: str,
                       options: dict[str, Any] | None = None) -> chunkstore.store.GcResult:
    """Remove ``version`` and collect with no grace, from an index of its own (as
    another machine would)."""
    with chunkstore.open(url, index_dir=str(index), storage_options=options) as other:
        other.delete(version)
        return other.gc(grace=0)


@pytest.mark.parametrize("where", ["local", "s3"])
def test_an_open_reader_on_another_index_reads_whole_while_everything_else_is_deleted(
        tmp_path: Path, where: str, request: pytest.FixtureRequest,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHUNKSTORE_CACHE_DIR", str(tmp_path / "cache"))
    if where == "s3":
        endpoint = request.getfixturevalue("s3_endpoint")
        bucket = create_bucket(endpoint)
        request.addfinalizer(lambda: remove_bucket(endpoint, bucket))
        url, options = f"s3://{bucket}/s", storage_options(endpoint)
    else:
        url, options = str(tmp_path / "s"), {}
    with chunkstore.open(url, create=True, chunk_size=CHUNK, storage_options=options,
                         index_dir=str(tmp_path / "writer")) as store:
        old, newer = save(store, 1), save(store, 2)
        reader = store.open_version(old)
        result = remove_and_collect(url, tmp_path / "other", old, options)
        assert result.readers_protected == 1
        for name, array in arrays(1).items():  # read after the version is gone
            assert reader.get(name).tobytes() == array.tobytes()
        reader.close()
        assert not list(store.objects.ids(READERS))
        # Closed: the next collection frees what only the removed version needed.
        with chunkstore.open(url, index_dir=str(tmp_path / "other"),
                             storage_options=options) as other:
            freed = other.gc(grace=0)
            assert freed.chunks_deleted + freed.orphans_deleted > 0
            assert other.verify().ok and [v.id for v in other.versions()] == [newer]


def test_without_a_lease_the_same_collection_deletes_what_the_reader_needs(
        tmp_path: Path) -> None:
    """The test above can fail: a reader opened without a lease loses its chunks."""
    with chunkstore.open(tmp_path / "s", create=True, chunk_size=CHUNK) as store:
        old = save(store, 1)
        save(store, 2)
        reader = VersionReader(store, store.resolve(old), lease=False)
        remove_and_collect(str(tmp_path / "s"), tmp_path / "other", old)
        with pytest.raises(MissingChunkError):
            reader.get("w")


def test_a_version_removed_before_its_lease_is_stored_is_not_opened(tmp_path: Path) -> None:
    with chunkstore.open(tmp_path / "s", create=True, chunk_size=CHUNK) as store:
        old = save(store, 1)
        info = store.resolve(old)
        with chunkstore.open(tmp_path / "s", index_dir=str(tmp_path / "other")) as other:
            other.delete(old)
        with pytest.raises(VersionRemovedError):
            VersionReader(store, info)
        assert not list(store.objects.ids(READERS))  # the lease it stored is gone


READER_CHILD = """
import sys, time, chunkstore
store = chunkstore.open(sys.argv[1])
reader = store.open_version(sys.argv[2])
print("open", flush=True)
time.sleep(600)
"""


def test_a_killed_reader_protects_nothing_and_its_lease_is_cleared(tmp_path: Path) -> None:
    with chunkstore.open(tmp_path / "s", create=True, chunk_size=CHUNK) as store:
        old = save(store, 1)
        save(store, 2)
    child = subprocess.Popen([sys.executable, "-c", READER_CHILD, str(tmp_path / "s"), old],
                             stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
    assert child.stdout is not None
    try:
        assert child.stdout.readline().strip() == "open"
        with chunkstore.open(tmp_path / "s", index_dir=str(tmp_path / "alive")) as other:
            assert len(list(other.objects.ids(READERS))) == 1
            other.delete(old)
            assert other.gc(grace=0).readers_protected == 1  # alive: its version stays
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stdout.close()
    with chunkstore.open(tmp_path / "s", index_dir=str(tmp_path / "dead")) as other:
        result = other.gc(grace=0)
        assert result.readers_protected == 0
        assert result.chunks_deleted + result.orphans_deleted > 0
        assert other.verify().ok


class ReadOnly(ForwardingBackend):
    def put_if_absent(self, key: str, data: bytes | memoryview) -> bool:
        raise PermissionError(13, "read-only (test)", key)

    def put_if_absent_deferred(self, key: str, data: bytes | memoryview) -> bool:
        raise PermissionError(13, "read-only (test)", key)


def test_a_store_that_takes_no_lease_is_read_with_a_warning(tmp_path: Path) -> None:
    with chunkstore.open(tmp_path / "s", create=True, chunk_size=CHUNK) as store:
        version = save(store, 1)
        store.backend = ReadOnly(store.backend)
        with pytest.warns(UnprotectedReadWarning, match="without a read lease"):
            reader = store.open_version(version)
        assert reader.get("w").tobytes() == arrays(1)["w"].tobytes()


def test_crafted_leases_protect_nothing_and_stop_no_gc(tmp_path: Path) -> None:
    """Garbage, a lease naming no root, one naming a root that does not exist: the GC
    runs, deletes what it should, and only a live, well-formed lease protects."""
    with chunkstore.open(tmp_path / "s", create=True, chunk_size=CHUNK) as store:
        old = save(store, 1)
        save(store, 2)
        store.objects.put(READERS, "garbage", b"\xff{not json")
        store.objects.put(READERS, "noroot", b'{"format_version": 1, "pid": 1}')
        store.objects.put(READERS, "ghost", b'{"format_version": 1, "root": "' + b"ab" * 32
                          + b'", "host": "elsewhere", "heartbeat": 1e18}')
        store.objects.put(READERS, "big", b" " * (70 * 1024))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            result = remove_and_collect(str(tmp_path / "s"), tmp_path / "other", old)
        assert result.chunks_deleted > 0 and result.readers_protected <= 1
        store.reconcile()  # the removal and the collection ran from another index
        found = store.verify()
        assert found.ok, found.problems


class SlowDeletes(ForwardingBackend):
    """Holds every delete until ``go`` is set (a request that does not return)."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.go = threading.Event()

    def discard(self, key: str) -> bool:
        assert self.go.wait(30)
        return super().discard(key)

    def delete(self, key: str) -> bool:
        assert self.go.wait(30)
        return super().delete(key)


def test_a_reader_collected_on_an_event_loop_does_no_io_there(tmp_path: Path) -> None:
    """A reader's finalizer may run on whatever thread drops the last reference to it,
    fsspec's event-loop thread included, where a request of its own never returns (the
    suite hung so): there, dropping the reader returns at once and the heartbeat thread
    deletes its lease; on any other thread the lease goes at once."""
    with chunkstore.open(tmp_path / "s", create=True, chunk_size=CHUNK) as store:
        version = save(store, 1)
        dropped = store.open_version(version)
        del dropped  # a plain thread: deleted now
        assert not list(store.objects.ids(READERS))
        slow = store.backend = SlowDeletes(store.backend)
        held = [store.open_version(version)]

        async def drop() -> None:
            held.clear()  # the finalizer runs here, on a thread with a running loop

        started = time.monotonic()
        finished = threading.Thread(target=asyncio.run, args=(drop(),))
        finished.start()
        finished.join(10)
        assert not finished.is_alive() and time.monotonic() - started < 5
        assert len(list(store.objects.ids(READERS))) == 1
        slow.go.set()
        deadline = time.monotonic() + 10
        while list(store.objects.ids(READERS)):
            assert time.monotonic() < deadline, "the heartbeat thread never deleted it"
            time.sleep(0.05)


def test_a_read_lease_of_a_newer_format_stops_the_gc_and_deletes_nothing(
        tmp_path: Path) -> None:
    """A reader of a newer release names what it protects in a way this release cannot
    know (docs/format.md, rule 1): its lease is refused with FormatVersionError, and the
    GC deletes nothing rather than what that reader may read."""
    from chunkstore.errors import FormatVersionError
    with chunkstore.open(tmp_path / "s", create=True, chunk_size=CHUNK) as store:
        old = save(store, 1)
        save(store, 2)
        store.objects.put(READERS, "newer", b'{"format_version": 2, "protects": ["..."]}')
        store.delete(old)
        def objects() -> list[Path]:
            return sorted(p for kind in ("chunks", "nodes") for p in (tmp_path / "s" / kind)
                          .rglob("*") if p.is_file())
        before = objects()
        with pytest.raises(FormatVersionError, match="readers/newer"):
            store.gc(grace=0)
        assert objects() == before
        store.objects.delete(READERS, "newer")  # the newer release's reader closed
        assert store.gc(grace=0).chunks_deleted > 0
