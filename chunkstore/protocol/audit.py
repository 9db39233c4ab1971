"""The audit trail: an append-only event object for each change to a store
(docs/format.md §16).

An event is the object ``audit/<UTC time>-<random>`` (``20261205T113000.123456Z-1a2b3c4d``:
key order is time order, so a listing is the trail oldest first and a listing can start
from a time), canonical JSON ``{"format": "chunkstore.audit", "format_version": 1, "op":
..., "phase": ..., "when": <unix time>, "who": "user@host", "process": "pid N name", ...}``
plus what the operation names (its versions, tag, key, counts and bytes).  Sealed in an
encrypted store, as every object but the config and the key objects is.

Ordering: each operation records its event *before* its first change to the store, and
durably (a removal's event before its tombstones, a save's before its commit record, a
GC's before its first deletion), so no change is ever left unrecorded, whatever kills
the process after it.  The converse does not hold: an event says an operation was about
to change the store (``"phase": "intent"``), not that it did; a killed or refused
operation leaves an intent with nothing after it.  Operations whose outcome may differ
from their intent (removals, GC runs) add a ``"phase": "done"`` event naming the intent
(``"intent": <event id>``) and what was done.  A save pays one small PUT, deferred to the
flush before its commit record (so it travels with the save's nodes).

Nothing deletes an event but :func:`prune_events` (``chunkstore audit --prune-before``),
which records an event naming what it prunes first.  GC never lists ``audit/`` and sync
copies no event: the trail belongs to the store it was made in.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from chunkstore.errors import ChunkStoreError, InvalidInputError
from chunkstore.format import plaindata
from chunkstore.format.manifest import is_version
from chunkstore.objects.kinds import AUDIT
from chunkstore.protocol.holds import printable, who_am_i

if TYPE_CHECKING:
    from chunkstore.objects.objectstore import ObjectStore

AUDIT_FORMAT = 1
AUDIT_RECORD = "chunkstore.audit"
#: An event larger than this is not read (it is listed as damaged).  A removal's event
#: names at most DELETE_BATCH versions, about 200 bytes each.
MAX_EVENT_BYTES = 1024 * 1024
#: What sealing adds, with room to spare (docs/format.md §13.3).
_SEALING_SLACK = 64 * 1024
INTENT, DONE = "intent", "done"
#: Events a listing reads ahead, and the reads it makes at once.
_READ_AHEAD, _READERS = 64, 8
#: The fields every event has; the rest are the operation's.
_COMMON = ("format", "format_version", "op", "phase", "when", "who", "process")
#: Names a listing gives an event beside its fields (``to_json``): no stored field has one.
_RESERVED = ("id", "damage")
#: 9999-12-31T23:59:59Z, the last second an id can name (strftime writes a year of
#: other than four digits, which would sort out of time order).
_LAST_SECOND = 253_402_300_799
#: The ids :func:`record` makes.
_EVENT_ID = re.compile(r"[0-9]{8}T[0-9]{6}\.[0-9]{6}Z-[0-9a-f]{8}")


class VersionLike(Protocol):
    """What an event records of a version (a ``VersionInfo``)."""

    @property
    def id(self) -> str: ...
    @property
    def run(self) -> str: ...
    @property
    def step(self) -> int: ...


@dataclass(frozen=True)
class AuditEvent:
    """An event as stored; ``damage`` says why its object could not be read (then
    everything but ``id`` may be None)."""

    id: str
    op: str | None = None
    phase: str | None = None
    when: float | None = None
    who: str | None = None
    process: str | None = None
    #: what the operation names: ``versions`` ([{id, run, step}]), ``tag``, counts...
    fields: dict[str, Any] = field(default_factory=dict)
    damage: str | None = None

    def runs(self) -> set[str]:
        """The runs whose versions the event names."""
        found = {v.get("run") for v in self.fields.get("versions", ())
                 if isinstance(v, dict)}
        return {run for run in found if isinstance(run, str)}

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "op": self.op, "phase": self.phase, "when": self.when,
                "who": self.who, "process": self.process, **self.fields,
                "damage": self.damage}


def event_id_at(when: float) -> str:
    """The key-order position of time ``when``: every event stored at or after it has an
    id at least this (``20261205T113000.123456Z``).  A time before 1970 or after 9999 is
    taken as the first or last one an id names, so ids keep the order of times."""
    when = max(when, 0.0)
    seconds = int(min(when, _LAST_SECOND))
    micro = 999_999 if when >= _LAST_SECOND + 1 else min(round((when - seconds) * 1e6),
                                                         999_999)
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime(seconds)) + f".{micro:06d}Z"


def this_process() -> str:
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"
    return printable(f"pid {os.getpid()} {name}")


def versions_named(infos: Iterable[VersionLike]) -> list[dict[str, Any]]:
    """How an event names versions: id, run and step of each."""
    return [{"id": info.id, "run": info.run, "step": info.step} for info in infos]


def encode_event(op: str, phase: str, when: float, fields: dict[str, Any]) -> bytes:
    """The event object's bytes: canonical JSON (sorted keys, no spaces, UTF-8)."""
    clash = set(fields) & {*_COMMON, *_RESERVED, "deferred"}
    if clash:
        raise ValueError(f"an event's own fields may not be named {sorted(clash)}")
    body = {"format": AUDIT_RECORD, "format_version": AUDIT_FORMAT, "op": op,
            "phase": phase, "when": when, "who": who_am_i(), "process": this_process(),
            **fields}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode("utf-8")


def decode_event(event_id: str, data: bytes) -> AuditEvent:
    """The event ``data`` records; never raises: a damaged object is an
    :class:`AuditEvent` with ``damage`` set."""
    if len(data) > MAX_EVENT_BYTES:
        return AuditEvent(event_id, damage=f"{len(data)} bytes, over {MAX_EVENT_BYTES}")
    try:
        body = plaindata.load_json(data)
    except ValueError as exc:
        return AuditEvent(event_id, damage=f"not JSON: {exc}")
    damage = _body_damage(body)
    if damage is None and not _EVENT_ID.fullmatch(event_id):  # no writer names one so
        damage = "its key is no event id (<UTC time>-<8 hex digits>)"
    elif damage is None and event_id_at(body["when"]) != event_id.partition("-")[0]:
        # A writer names an event by its own "when": one listed out of its time's place
        damage = f"its time {body['when']!r} is not the one its key names"
    if damage is not None:
        return AuditEvent(event_id, damage=damage)
    op, phase, when, who, process = (body[k] for k in _COMMON[2:])
    extra = {k: v for k, v in body.items() if k not in _COMMON}
    return AuditEvent(event_id, op, phase, float(when), who, process, extra)


def _body_damage(body: Any) -> str | None:
    """Why a parsed event is not one this release reads (None: it is)."""
    if not isinstance(body, dict) or body.get("format") != AUDIT_RECORD:
        return "not an audit event"
    if not is_version(body.get("format_version"), AUDIT_FORMAT):
        return f"format_version {body.get('format_version')!r} unknown here"
    op, phase, when, who, process = (body.get(k) for k in _COMMON[2:])
    if not (isinstance(op, str) and isinstance(phase, str) and isinstance(when, int | float)
            and not isinstance(when, bool) and isinstance(who, str)
            and isinstance(process, str)):
        return "a field is missing or of the wrong type"
    if not 0 <= when <= _LAST_SECOND:  # 1e400 is infinity; no clock prints 1e300
        return f"when {when!r} is no time between 1970 and 9999"
    reserved = sorted(set(body) & set(_RESERVED))
    if reserved:  # the listing would show it under another id, or undamaged
        return f"a field named {reserved}"
    return None


def record(objects: ObjectStore, op: str, *, phase: str = INTENT, deferred: bool = False,
           **fields: Any) -> str:
    """Store an event; its id.  Durable on return, or with ``deferred`` at the next
    flush (a save's, before its commit point).  Never replaces an event."""
    when = time.time()
    data = encode_event(op, phase, when, fields)
    if len(data) > MAX_EVENT_BYTES:  # a caller's bug: events are batched small
        raise ValueError(f"an audit event of {len(data)} bytes, over {MAX_EVENT_BYTES}")
    put = objects.put_if_absent_deferred if deferred else objects.put_if_absent
    for _ in range(8):  # 32 random bits within a microsecond: a clash is all but impossible
        event_id = f"{event_id_at(when)}-{secrets.token_hex(4)}"
        if put(AUDIT, event_id, data):
            return event_id
    raise ChunkStoreError(f"{objects.backend!r}: eight audit event keys in a row were taken;"
                          " the store's put-if-absent does not work (docs/s3.md)")


def record_done(objects: ObjectStore, op: str, intent: str, **fields: Any) -> str:
    """The ``done`` event of an operation whose ``intent`` event was stored: deferred (on
    a local store durable at the next flush, or when the system writes it back), since
    one lost to a power cut only leaves an intent without its ``done``, which the trail
    reads as an operation that may not have finished."""
    return record(objects, op, phase=DONE, deferred=True, intent=intent, **fields)


# --- reading and pruning ----------------------------------------------------------------------


def event_ids(objects: ObjectStore, since: float | None = None) -> list[str]:
    """The ids of the stored events, oldest first (from ``since``, Unix time)."""
    start = event_id_at(since) if since is not None else ""
    return sorted(i for i in objects.ids(AUDIT) if i >= start)


def read_event(objects: ObjectStore, event_id: str) -> AuditEvent | None:
    """The event ``event_id`` (None: pruned meanwhile); one that cannot be read, parsed or
    opened is returned with ``damage`` set, never raised."""
    try:
        size = objects.stat(AUDIT, event_id).size
    except FileNotFoundError:
        return None
    return _read_sized(objects, event_id, size)


def _read_sized(objects: ObjectStore, event_id: str, size: int) -> AuditEvent | None:
    # Bounded before it is read: a crafted object of a gigabyte is damage, not a read.
    if size > MAX_EVENT_BYTES + _SEALING_SLACK:
        return AuditEvent(event_id, damage=f"{size} bytes, over {MAX_EVENT_BYTES}")
    try:
        data = objects.get(AUDIT, event_id)
    except FileNotFoundError:
        return None
    except ChunkStoreError as exc:  # a sealed event that fails authentication, say
        return AuditEvent(event_id, damage=str(exc))
    return decode_event(event_id, data)


def list_events(objects: ObjectStore, *, since: float | None = None,
                run: str | None = None) -> Iterator[AuditEvent]:
    """The events oldest first, read as they are yielded (a window of
    :data:`_READ_AHEAD` at a time, side by side: each is a GET on an object store; the
    listing gives their sizes); with ``run`` those that name a version of it (a damaged
    event is listed whatever the filter: it may be one)."""
    start = event_id_at(since) if since is not None else ""
    listed = sorted((i, info.size) for i, info in objects.infos(AUDIT) if i >= start)
    with ThreadPoolExecutor(_READERS, thread_name_prefix="chunkstore-audit") as pool:
        for at in range(0, len(listed), _READ_AHEAD):
            window = listed[at:at + _READ_AHEAD]
            for event in pool.map(lambda item: _read_sized(objects, *item), window):
                if event is None:
                    continue
                if run is None or event.damage is not None or run in event.runs():
                    yield event


@dataclass(frozen=True)
class AuditPruneResult:
    """What ``audit --prune-before`` did: the event that records it, and the ids it
    deleted."""

    event: str
    before: float
    pruned: Sequence[str]


def prune_events(objects: ObjectStore, before: float) -> AuditPruneResult:
    """Delete every event stored before ``before`` (Unix time), having first recorded an
    event that says so (it is never among those deleted).  A ``before`` later than now
    is an :class:`InvalidInputError`: it would delete the events of operations running
    now (a mistyped year, say)."""
    if before > time.time():
        raise InvalidInputError(
            f"audit events are pruned before a past time; {event_id_at(before)} is in the"
            " future (it would delete the events of operations running now)")
    limit = event_id_at(before)
    doomed = [i for i in event_ids(objects) if i < limit]
    event = record(objects, "audit-prune", before=before, count=len(doomed),
                   first=doomed[0] if doomed else None, last=doomed[-1] if doomed else None)
    doomed = [i for i in doomed if i != event]
    objects.delete_many(AUDIT, doomed)
    return AuditPruneResult(event, before, doomed)
