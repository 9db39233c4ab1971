"""Writer leases: one writer per run, visible from every machine and index.

Two launches of one training job (a scheduler retry while the first still runs,
a copy-pasted command) would otherwise both save to the run, and its history
would mix two trajectories that resume then picks from.  A writer of a run (the
``Checkpointer``, at its first save) holds ``leases/<run>``::

    {"format_version": 1, "run": ..., "token": <random hex>, "purpose": ...,
     "host": ..., "pid": ..., "pidns": ..., "process_start": ...,
     "since": <unix time>, "heartbeat": <unix time>}

created put-if-absent (exactly one creator wins, on a local disk and on S3),
rewritten every :data:`HEARTBEAT_S` by a background thread, and deleted when the
writer closes.  A lease whose owner is dead (:func:`~chunkstore.protocol.sessions.owner_is_dead`:
its process gone on this host, or its heartbeat older than :data:`RUN_LEASE_S`
seen from elsewhere; an unreadable object or an unbelievable heartbeat counts by the
object's stored time) is taken over by the next writer; a live one only when the
caller says so (``takeover=True``, for a job restarted elsewhere before the old
lease expired).  Before each publish the writer checks that the lease is still its
own (:meth:`RunLease.check`): a writer whose lease was taken over stops publishing,
so even a takeover race leaves one writer.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any

from chunkstore.errors import RunInUseError, RunLeaseLostError
from chunkstore.format import plaindata
from chunkstore.objects.kinds import LEASES
from chunkstore.protocol.sessions import (
    owner_info,
    owner_is_dead,
    stored_time,
    with_stored_heartbeat,
)

if TYPE_CHECKING:
    from chunkstore.objects.objectstore import ObjectStore

LEASE_FORMAT = 1
#: Environment variable: seconds after its last heartbeat that a run lease held on
#: another machine counts as expired.
RUN_LEASE_ENV_VAR = "CHUNKSTORE_RUN_LEASE"
RUN_LEASE_S = float(os.environ.get(RUN_LEASE_ENV_VAR, "60"))
HEARTBEAT_S = min(10.0, RUN_LEASE_S / 6)


def read_lease(objects: ObjectStore, run: str) -> dict[str, Any] | None:
    """The run's lease as stored (heartbeat taken from the stored time where it
    cannot be believed); None when the run has none."""
    try:
        data = plaindata.load_json(objects.get(LEASES, run))
        info: dict[str, Any] | None = data if isinstance(data, dict) else {}
    except FileNotFoundError:
        return None
    except ValueError:
        info = None  # damaged: it lives by its stored time, as sessions do
    return with_stored_heartbeat(info, time.time(),
                                 functools.partial(stored_time, objects, LEASES, run))


def describe_holder(info: dict[str, Any], now: float) -> str:
    since = info.get("since")
    beat = info.get("heartbeat")
    parts = [f"host {info.get('host', '?')}", f"pid {info.get('pid', '?')}"]
    if isinstance(since, (int, float)):
        parts.append("since " + time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)))
    if isinstance(beat, (int, float)):
        parts.append(f"last heartbeat {max(0.0, now - beat):.0f} s ago")
    return ", ".join(parts)


class RunLease:
    """A run's writer lease held by this process (see the module docstring)."""

    def __init__(self, objects: ObjectStore, run: str, purpose: str = "checkpointer") -> None:
        self.objects = objects
        self.run = run
        self.token = uuid.uuid4().hex
        self._info: dict[str, Any] = {"format_version": LEASE_FORMAT, "run": run,
                                      "token": self.token, "purpose": purpose,
                                      **owner_info()}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.held = False
        #: what the lease replaced: None, or the holder taken over (dead or not)
        self.took_over: dict[str, Any] | None = None

    def acquire(self, *, takeover: bool = False) -> None:
        """Hold the lease, or raise :class:`RunInUseError` naming its live holder."""
        now = time.time()
        self._info["since"] = self._info["heartbeat"] = now
        if not self.objects.put_if_absent(LEASES, self.run, self._body()):
            current = read_lease(self.objects, self.run)
            if current is not None and current.get("token") == self.token:
                pass  # ours (a retried create)
            elif current is not None and not takeover and not owner_is_dead(
                    current, now, RUN_LEASE_S):
                here = (current.get("pid") == self._info["pid"]
                        and current.get("host") == self._info["host"])
                raise RunInUseError(self.run, current, (
                    f"run {self.run!r} is being written by "
                    + ("another Checkpointer of this process (close it first, or drop"
                       " it: a collected one gives the run back)" if here else
                       "another process") +
                    f" ({describe_holder(current, now)}): a run has one writer. Wait for"
                    " it to finish, pick another run name, or, if that job is gone (it"
                    f" counts as gone {RUN_LEASE_S:.0f} s after its last heartbeat), pass"
                    " takeover=True"))
            else:
                self._replace(current)
        self.held = True
        self._thread = threading.Thread(target=self._beat, name="chunkstore-run-lease",
                                        daemon=True)
        self._thread.start()

    def _replace(self, current: dict[str, Any] | None) -> None:
        """Take the lease over from ``current``: only if it is still the one judged (a
        second taker may have been first), then put ours and read it back."""
        again = read_lease(self.objects, self.run)
        if again is not None and current is not None and again.get("token") != current.get(
                "token"):
            raise RunInUseError(self.run, again, (
                f"run {self.run!r} was just taken by another process"
                f" ({describe_holder(again, time.time())})"))
        self.objects.put(LEASES, self.run, self._body())
        self.took_over = current
        self.check()

    def check(self) -> None:
        """Raise :class:`RunLeaseLostError` unless the stored lease is still this one."""
        current = read_lease(self.objects, self.run)
        if current is None or current.get("token") != self.token:
            self.held = False
            raise RunLeaseLostError(self.run, current)

    def _body(self) -> bytes:
        return json.dumps(self._info, sort_keys=True).encode()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                current = read_lease(self.objects, self.run)
                if current is None or current.get("token") != self.token:
                    return  # taken over: the next check() says so
                self._info["heartbeat"] = time.time()
                self.objects.put(LEASES, self.run, self._body())
            except Exception:  # a missed beat; the next one retries
                continue

    def release(self) -> None:
        """Stop the heartbeat and delete the lease if it is still this one (idempotent)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        if not self.held:
            return
        self.held = False
        current = read_lease(self.objects, self.run)
        if current is not None and current.get("token") == self.token:
            self.objects.discard(LEASES, self.run)
