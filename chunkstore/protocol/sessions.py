"""Write sessions in the store: what makes a save in progress visible to every GC.

A save registers a session object ``sessions/<id>`` before it takes its
first deduplication decision and removes it when it has published (or
given up).  A GC on any machine, with any index, lists these objects; the
protocol in :mod:`chunkstore.maintenance.gc` waits for every session that may have
decided to reuse an object before the GC's condemnation was visible.

The object is canonical JSON::

    {"format_version": 1, "id": ..., "purpose": "save exp1@100",
     "host": ..., "pid": ..., "pidns": ..., "process_start": ...,
     "started": <unix time>, "heartbeat": <unix time>, "seen": [<journal entry id>, ...]}

``seen`` names the GC journal entries that were active when the session
read the journal (after its object was first stored): the session does not
reuse their objects, so their GC need not wait for it.  A background thread
rewrites ``heartbeat`` every :data:`HEARTBEAT_S` seconds.  A session is dead
when its process is gone (same host and pid namespace: checked directly) or,
seen from elsewhere, when its heartbeat is older than :data:`LEASE_S`.  A
save whose own heartbeat lapsed for half the lease refuses to publish.

A heartbeat that cannot be believed (an object that cannot be read, as a power
cut can leave one; a time that is not finite, or further ahead of this machine's
clock than :data:`CLOCK_SKEW_S`) is replaced by the object's stored time: a live
owner rewrites its object every :data:`HEARTBEAT_S`, so an object not written for a
lease has no live owner, whatever it says.  Such an object never blocks a GC or an
``index rebuild`` for longer than a lease.
"""

from __future__ import annotations

import functools
import json
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from chunkstore.format import plaindata
from chunkstore.index.lmdbindex import pid_namespace, process_start
from chunkstore.objects.kinds import SESSIONS

if TYPE_CHECKING:
    from chunkstore.objects.kinds import Kind
    from chunkstore.objects.objectstore import ObjectStore

SESSION_FORMAT = 1
#: Environment variable that sets :data:`LEASE_S` (seconds; for tests and slow links).
LEASE_ENV_VAR = "CHUNKSTORE_SESSION_LEASE"
#: A session or GC run seen from another machine is dead once its heartbeat is this old.
LEASE_S = float(os.environ.get(LEASE_ENV_VAR, "900"))
#: How often a session (and a GC's journal entry) proves its process alive.
HEARTBEAT_S = min(30.0, LEASE_S / 10)
#: A stored time further ahead of this machine's clock than this is not believed (the
#: protocol assumes clocks agree well within half the lease).  A heartbeat ahead of
#: this clock at all is not believed: the object's stored time stands in for it.
CLOCK_SKEW_S = LEASE_S / 2


def owner_info() -> dict[str, Any]:
    """Who is writing: enough to tell later, from any machine, whether it still runs."""
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "pidns": pid_namespace(),
            "process_start": process_start(pid)}


def owner_is_dead(info: dict[str, Any], now: float, lease_s: float = LEASE_S) -> bool:
    """Whether the process that wrote ``info`` (with :func:`owner_info` fields) is gone.

    On this host and pid namespace the process is checked directly (its start
    time guards against a reused pid; one that exists but cannot be inspected
    counts as alive).  Elsewhere, or where the object records no start time to
    tell its process from another with the same pid, it is dead once its
    heartbeat is older than ``lease_s`` or is not a finite time (pass ``info`` through
    :func:`with_stored_heartbeat` first, so that no heartbeat is believed blindly).
    """
    pid = info.get("pid")
    local = (info.get("host") == socket.gethostname() and isinstance(pid, int)
             and not isinstance(pid, bool) and 0 < pid < 2**31
             and info.get("pidns") == pid_namespace())
    if local:
        assert isinstance(pid, int)
        start = process_start(pid)
        if start is None:
            return not _pid_exists(pid)
        recorded = info.get("process_start")
        if recorded is not None:
            return bool(recorded != start)
        # No start time: the live process with this pid may be another one (pid 1).
    heartbeat = info.get("heartbeat", info.get("started", 0.0))
    # Written so that a NaN (which compares false with everything) counts dead, as
    # does an infinite time: no live owner writes either.
    return (not isinstance(heartbeat, (int, float)) or _not_finite(heartbeat)
            or not heartbeat >= now - lease_s)


def owner_is_silent(info: dict[str, Any], now: float, lease_s: float = LEASE_S) -> bool:
    """Whether the owner of a session or GC journal entry counts as gone for the
    protocol: its process is gone (on this host, checked directly), or, wherever it
    runs, it has not rewritten its object for ``lease_s`` (``info`` passed through
    :func:`with_stored_heartbeat`).

    Unlike :func:`owner_is_dead`, a process found alive on this host proves nothing
    by itself: a crafted object can name any live process (pid 1), and a process
    stopped for a lease (SIGSTOP) protects nothing, exactly as one on another
    machine would not; its save refuses to publish when it runs again
    (:meth:`StoreSession.lapsed`)."""
    if _process_gone(info):
        return True
    heartbeat = info.get("heartbeat", info.get("started", 0.0))
    return (not isinstance(heartbeat, (int, float)) or _not_finite(heartbeat)
            or not heartbeat >= now - lease_s)


def _process_gone(info: dict[str, Any]) -> bool:
    """Whether ``info`` names a process of this host and pid namespace that is gone."""
    pid = info.get("pid")
    if not (info.get("host") == socket.gethostname() and isinstance(pid, int)
            and not isinstance(pid, bool) and 0 < pid < 2**31
            and info.get("pidns") == pid_namespace()):
        return False
    start = process_start(pid)
    if start is None:
        return not _pid_exists(pid)
    recorded = info.get("process_start")
    return recorded is not None and recorded != start


def _not_finite(value: float) -> bool:
    try:
        return not math.isfinite(value)
    except OverflowError:  # an int past any float
        return True


def _unbelievable(info: dict[str, Any], now: float) -> bool:
    """Whether the heartbeat ``info`` records is one the reader must not take on the
    object's word: not finite, or ahead of this clock (a time in the future proves
    nothing about when the object was last written)."""
    heartbeat = info.get("heartbeat", info.get("started", 0.0))
    if not isinstance(heartbeat, (int, float)) or isinstance(heartbeat, bool):
        return False  # no heartbeat at all: dead by owner_is_dead
    return _not_finite(heartbeat) or heartbeat > now


def with_stored_heartbeat(info: dict[str, Any] | None, now: float,
                          stored_time: Callable[[], float | None]) -> dict[str, Any] | None:
    """``info`` of an owner object, its heartbeat replaced by the object's stored time
    where the heartbeat cannot be believed (``info`` None: the object could not be
    read; a heartbeat not finite or in the future).  A stored time itself further
    ahead than :data:`CLOCK_SKEW_S` (a file's mtime set by hand) proves nothing
    either: the heartbeat becomes 0, long past.  None when the object is gone
    (``stored_time`` returns None)."""
    if info is not None and not _unbelievable(info, now):
        return info
    stored = stored_time()
    if stored is None:
        return None
    if _not_finite(stored) or stored > now + CLOCK_SKEW_S:
        return {**(info or {}), "heartbeat": 0.0, "heartbeat_from": "stored time, in the future"}
    return {**(info or {}), "heartbeat": min(stored, now), "heartbeat_from": "stored time"}


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True)
class SessionInfo:
    """One session object as read from the store."""

    id: str
    info: dict[str, Any]

    @property
    def seen(self) -> frozenset[str]:
        seen = self.info.get("seen")
        return frozenset(s for s in seen if isinstance(s, str)) if isinstance(seen, list) \
            else frozenset()

    def dead(self, now: float) -> bool:
        return owner_is_silent(self.info, now)


def list_sessions(objects: ObjectStore) -> Iterator[SessionInfo]:
    """Every session object in the store; one that cannot be read, or whose heartbeat
    cannot be believed, lives by its stored time (see :func:`with_stored_heartbeat`)."""
    for session_id in objects.ids(SESSIONS):
        info: dict[str, Any] | None
        try:
            # ValueError when too deep, ...
            data = plaindata.load_json(objects.get(SESSIONS, session_id))
            info = data if isinstance(data, dict) else {}
        except FileNotFoundError:
            continue  # ended meanwhile
        except ValueError:
            info = None
        info = with_stored_heartbeat(info, time.time(),
                                     functools.partial(stored_time, objects, SESSIONS, session_id))
        if info is not None:  # else ended meanwhile
            yield SessionInfo(session_id, info)


def stored_time(objects: ObjectStore, kind: Kind[str], name: str) -> float | None:
    """When the object was last written, by the store's clock; None when it is gone."""
    try:
        return objects.stat(kind, name).mtime
    except FileNotFoundError:
        return None


def live_sessions(objects: ObjectStore, now: float | None = None) -> list[SessionInfo]:
    now = time.time() if now is None else now
    return [s for s in list_sessions(objects) if not s.dead(now)]


class StoreSession:
    """A save's session object, kept alive by a heartbeat thread until :meth:`close`."""

    def __init__(self, objects: ObjectStore, purpose: str) -> None:
        self.objects = objects
        self.id = uuid.uuid4().hex
        now = time.time()
        self._info: dict[str, Any] = {"format_version": SESSION_FORMAT, "id": self.id,
                                      "purpose": purpose, **owner_info(), "started": now,
                                      "heartbeat": now, "seen": []}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._last_beat = now
        self._ever_lapsed = False
        self._thread: threading.Thread | None = None

    def open(self) -> None:
        """Store the session object and start the heartbeat.

        Visible to every GC on return; durability is not needed (after a crash
        its process is dead), so a local store skips the fsyncs.
        """
        with self._lock:
            body = json.dumps(self._info, sort_keys=True).encode()
        if not self.objects.put_if_absent_deferred(SESSIONS, self.id, body):
            raise FileExistsError(self.id)  # a random 128-bit id: never
        self._thread = threading.Thread(target=self._beat, name="chunkstore-session",
                                        daemon=True)
        self._thread.start()

    def record_seen(self, entry_ids: list[str]) -> None:
        """Say in the store which active GC journal entries this session knows of."""
        if entry_ids:
            with self._lock:
                self._info["seen"] = sorted(set(self._info["seen"]) | set(entry_ids))
            self._write()

    @property
    def seen(self) -> list[str]:
        """The GC journal entries this session's object lists as seen."""
        with self._lock:
            return list(self._info["seen"])

    def _write(self) -> None:
        with self._lock:
            self._info["heartbeat"] = now = time.time()
            body = json.dumps(self._info, sort_keys=True).encode()
        self.objects.put(SESSIONS, self.id, body)
        with self._lock:
            # A gap between two stored beats longer than half the lease is a lapse for
            # good: a GC may have counted the session dead during it.
            self._ever_lapsed |= now - self._last_beat > LEASE_S / 2
            self._last_beat = max(self._last_beat, now)

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._write()
            except Exception:  # a lapse is detected at commit, by lapsed()
                continue

    def lapsed(self) -> bool:
        """Whether the heartbeat failed long enough that a GC elsewhere may count us dead."""
        with self._lock:
            return self._ever_lapsed or time.time() - self._last_beat > LEASE_S / 2

    def close(self) -> None:
        """Stop the heartbeat and remove the session object (idempotent)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self.objects.discard(SESSIONS, self.id)
