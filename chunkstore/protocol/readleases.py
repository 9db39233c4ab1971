"""Read leases: a reader of a version is visible in the store (docs/format.md §11.6).

A version removed while something still reads it (a restore, an export, a drill, a
DCP load, on any machine, with any index) was protected by the GC's grace period
alone: a GC with a short grace (the collection that follows retention) deleted what
the reader still needed, and the reader failed (a missing chunk, never wrong data).
Now a reader says so in the store, ``readers/<random id>``::

    {"format_version": 1, "id": ..., "version": <id>, "root": <root node hex>,
     "purpose": ..., "host", "pid", "pidns", "process_start", "since", "heartbeat"}

1. the reader stores its lease (put-if-absent; visible to every GC on return),
2. then checks that the version's commit record still exists: if it does not, the
   version was removed before the lease could protect it, the lease is deleted and
   the open fails (:class:`~chunkstore.errors.VersionRemovedError`);
3. reads, while one thread per process rewrites every open lease every
   :data:`~chunkstore.protocol.sessions.HEARTBEAT_S`;
4. deletes the lease when it closes (a reader collected unclosed closes it too).

A GC marks the tree of every root a live lease names, in both marks (steps 4 and 7 of
:mod:`chunkstore.maintenance.gc`).  A lease lives as a save session does
(:func:`~chunkstore.protocol.sessions.owner_is_dead`: its process on this host, its
heartbeat elsewhere, never a heartbeat that cannot be believed).

Why no interleaving deletes what a reader reads.  Take an object X of version V
that a GC G deletes, and a reader R that passed step 2 at time ``c`` (V's record
existed then) after storing its lease at ``l < c``.  G deletes X only if no mark
reached it: not step 4's, so V was not live when step 4 walked (V's record was
removed before, as records are never written again once removed), and not step 7's,
which lists the leases after the session wait.  If ``l`` came before step 7's
listing, R's lease is listed and V's tree, X included, is marked: a contradiction.
So ``l`` (and ``c``) came after step 7, hence after step 4, when V's record was
already gone: R's check at ``c`` finds no record and R reads nothing.  A reader
whose heartbeat lapses for a lease (paused, cut off) is unprotected from then on:
its reads fail their checks rather than return wrong bytes.  A store that cannot
take a lease (read-only credentials, a full disk) is read without one, with a
:class:`~chunkstore.errors.UnprotectedReadWarning`: the grace period protects that
reader, as it protects readers of releases before this one.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import threading
import time
import uuid
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from chunkstore.errors import FormatVersionError
from chunkstore.format import plaindata
from chunkstore.format.digest import Digest
from chunkstore.objects.kinds import READERS
from chunkstore.protocol.sessions import (
    HEARTBEAT_S,
    LEASE_S,
    owner_info,
    owner_is_dead,
    stored_time,
    with_stored_heartbeat,
)

if TYPE_CHECKING:
    from chunkstore.objects.objectstore import ObjectStore

READ_LEASE_FORMAT = 1
#: A lease object larger than this is not read (a crafted one cannot cost a GC memory).
MAX_LEASE_BYTES = 64 * 1024


class ReadLease:
    """One reader's lease, rewritten by the process's heartbeat thread until closed."""

    def __init__(self, objects: ObjectStore, version_id: str, root: Digest,
                 purpose: str) -> None:
        self.objects = objects
        self.id = uuid.uuid4().hex
        now = time.time()
        self._info: dict[str, Any] = {
            "format_version": READ_LEASE_FORMAT, "id": self.id, "version": version_id,
            "root": root.hex, "purpose": purpose, **owner_info(), "since": now,
            "heartbeat": now}
        self._lock = threading.Lock()
        self.closed = False

    def open(self) -> ReadLease:
        """Store the lease (visible to every GC on return) and join the heartbeat."""
        if not self.objects.put_if_absent_deferred(READERS, self.id, self._body()):
            raise FileExistsError(self.id)  # a random 128-bit id: never
        _HEARTBEAT.add(self)
        return self

    def _body(self) -> bytes:
        with self._lock:
            return json.dumps(self._info, sort_keys=True).encode()

    def beat(self) -> None:
        """Rewrite the lease (the heartbeat thread).  No I/O under the lock: a close may
        come from a finalizer on any thread, fsspec's event loop included.  A close
        during the write would see its delete undone by it: the write is undone then."""
        with self._lock:
            if self.closed:
                return
            self._info["heartbeat"] = time.time()
            body = json.dumps(self._info, sort_keys=True).encode()
        self.objects.put(READERS, self.id, body)
        with self._lock:
            undo = self.closed
        if undo:
            self._discard()

    def close(self) -> None:
        """Leave the heartbeat and delete the lease now (idempotent)."""
        if self._mark_closed():
            self._discard()

    def close_later(self) -> None:
        """:meth:`close` for a finalizer, which may run on any thread: on one that runs an
        event loop (fsspec's, where a request of its own would never return) the lease
        leaves the heartbeat now and the heartbeat thread deletes it; elsewhere now."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            self.close()
            return
        if self._mark_closed():
            _HEARTBEAT.discard_later(self)

    def _mark_closed(self) -> bool:
        with self._lock:
            if self.closed:
                return False
            self.closed = True
        _HEARTBEAT.remove(self)
        return True

    def _discard(self) -> None:
        with contextlib.suppress(Exception):  # left behind: dead once its process is
            self.objects.discard(READERS, self.id)


class _Heartbeat:
    """The one thread of a process that rewrites its open leases, and deletes those
    closed by finalizers."""

    def __init__(self) -> None:
        self._leases: weakref.WeakSet[ReadLease] = weakref.WeakSet()
        self._closed: list[ReadLease] = []
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def add(self, lease: ReadLease) -> None:
        with self._cond:
            self._leases.add(lease)
            self._start_locked()

    def remove(self, lease: ReadLease) -> None:
        with self._cond:
            self._leases.discard(lease)

    def discard_later(self, lease: ReadLease) -> None:
        with self._cond:
            self._closed.append(lease)
            self._start_locked()
            self._cond.notify_all()

    def _start_locked(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, daemon=True,
                                            name="chunkstore-read-leases")
            self._thread.start()

    def _run(self) -> None:
        next_beat = time.monotonic() + HEARTBEAT_S
        while True:
            with self._cond:
                while not self._closed and time.monotonic() < next_beat:
                    self._cond.wait(next_beat - time.monotonic())
                closed, self._closed = self._closed, []
                due = time.monotonic() >= next_beat
                leases = list(self._leases) if due else []
            for lease in closed:
                lease._discard()
            if due:
                next_beat = time.monotonic() + HEARTBEAT_S
            for lease in leases:
                try:
                    lease.beat()
                except Exception:  # a lapse: the grace period protects the reader
                    continue


_HEARTBEAT = _Heartbeat()


@dataclass(frozen=True)
class LeaseInfo:
    """A read lease as a GC reads it."""

    id: str
    version: str | None
    root: Digest | None
    info: dict[str, Any]

    def dead(self, now: float) -> bool:
        return owner_is_dead(self.info, now)


def list_read_leases(objects: ObjectStore) -> Iterator[LeaseInfo]:
    """Every read lease in the store; one that cannot be read lives by its stored time
    and protects nothing (it names no root).  One of a newer format is refused
    (:class:`FormatVersionError`): what it protects, this release cannot tell, so a GC
    stops rather than delete what a newer release reads."""
    for lease_id in objects.ids(READERS):
        info: dict[str, Any] | None
        try:
            data = objects.get(READERS, lease_id)
            parsed = plaindata.load_json(data) if len(data) <= MAX_LEASE_BYTES else None
            info = parsed if isinstance(parsed, dict) else None
        except FileNotFoundError:
            continue  # closed meanwhile
        except ValueError:
            info = None
        found = info.get("format_version") if info is not None else None
        if type(found) is int and found > READ_LEASE_FORMAT:
            raise FormatVersionError(f"read lease readers/{lease_id}", found,
                                     READ_LEASE_FORMAT)
        info = with_stored_heartbeat(info, time.time(),
                                     functools.partial(stored_time, objects, READERS, lease_id))
        if info is None:
            continue
        yield LeaseInfo(lease_id, _text(info.get("version")), _digest(info.get("root")), info)


def live_read_roots(objects: ObjectStore, now: float | None = None) -> list[Digest]:
    """The roots the live read leases name: what a GC must keep."""
    now = time.time() if now is None else now
    return sorted({lease.root for lease in list_read_leases(objects)
                   if lease.root is not None and not lease.dead(now)}, key=lambda d: d.raw)


def expired_read_leases(objects: ObjectStore, now: float | None = None) -> list[str]:
    """Leases of readers gone for more than a lease: left behind by killed processes."""
    now = time.time() if now is None else now
    return [lease.id for lease in list_read_leases(objects)
            if lease.dead(now) and lease.dead(now - LEASE_S)]


def _text(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _digest(value: object) -> Digest | None:
    try:
        return Digest.parse(value) if isinstance(value, str) else None
    except ValueError:
        return None


__all__ = ["READ_LEASE_FORMAT", "LeaseInfo", "ReadLease", "expired_read_leases",
           "list_read_leases", "live_read_roots"]
