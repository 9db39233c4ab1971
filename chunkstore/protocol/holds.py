"""Legal holds: a held version is removed by no removal path (docs/format.md §15).

A hold is the object ``holds/<version id>`` (canonical JSON ``{"format":
"chunkstore.hold", "format_version": 1, "version": ..., "reason": ..., "who":
"user@host", "when": <unix time>, "process": ...}``); releasing deletes it.  Its
*existence* is the hold: a hold object that cannot be read, parsed or opened still holds
its version (a removal never reads a damaged object as "released"), and ``verify``
reports it.  Every index on every machine sees the same holds, because a removal asks
the store, not its index, at the moment it decides.

Why no interleaving removes a version whose hold was confirmed. A removal (R) stores the
version's tombstone durably, *then* lists ``holds/`` and removes only versions not held
(:mod:`chunkstore.handle.removal`). Placing a hold (H) stores the hold object durably,
*then* looks for the version's tombstone (and first for its ``@withdrawn-`` marker,
:mod:`chunkstore.protocol.runlease`: a withdrawn version is never a version again,
whether or not its removal lived to delete the record, so H is refused). Both are "write
mine, then read theirs", so at least one sees the other: if H's look finds no tombstone,
R's tombstone was stored after that look, hence after H's write, and R's listing, later
still, sees the hold (a hold stored before R's tombstone is always seen). If H finds a
tombstone, a removal may have listed ``holds/`` before H's write and may still remove
the version: H waits for the record to go (the hold then held nothing: it is deleted and
the caller told the version was removed) or the tombstone to go with the record still
there (GC expired it; a purge deletes its tombstone only after the record, so H looks at
the tombstone first), and otherwise says the hold is stored but unconfirmed
(:class:`~chunkstore.errors.HoldUnconfirmedError`): it still stops every removal that
lists ``holds/`` after it, and ``hold`` run again confirms it once the tombstone is
gone. The argument needs R's tombstone stored from its write until R deletes the record,
and a GC deletes tombstones past the grace period (at once at grace 0): so a GC keeps
the tombstone of a version still published for at least
:data:`~chunkstore.protocol.tombstones.LIVE_TOMBSTONE_MIN_AGE_S`, whatever the grace
period, and a removal stalled longer than
:data:`~chunkstore.protocol.tombstones.MAX_REMOVAL_STALL_S` between its tombstones and
its withdrawals stores them again and lists ``holds/`` again (docs/format.md §15.2). A
tombstone left by a removal a hold refused, or by one that was killed, makes a hold
unconfirmed until GC deletes the tombstone (one grace period, an hour at least); a
removal checks
``holds/`` before it writes any tombstone, so a version held already gets none.
"""

from __future__ import annotations

import getpass
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from chunkstore.errors import ChunkStoreError, InvalidInputError
from chunkstore.format import plaindata
from chunkstore.format.digest import is_hex_digest
from chunkstore.format.manifest import is_version
from chunkstore.objects.kinds import HOLDS

if TYPE_CHECKING:
    from chunkstore.objects.objectstore import ObjectStore

HOLD_FORMAT = 1
HOLD_RECORD = "chunkstore.hold"
#: A hold object larger than this is not read (it is damaged; it still holds).
MAX_HOLD_BYTES = 16 * 1024
#: What sealing adds to an object of at most MAX_HOLD_BYTES (docs/format.md §13.3), with
#: room to spare: the stored size is checked against the bound plus this.
_SEALING_SLACK = 4096
#: The longest reason a hold records, in characters.
MAX_REASON_CHARS = 2000


@dataclass(frozen=True)
class Hold:
    """A hold as stored; ``damage`` says why its object could not be read (it holds all
    the same, and then ``reason`` and the rest are None)."""

    version_id: str
    reason: str | None
    who: str | None = None
    when: float | None = None
    process: str | None = None
    damage: str | None = None

    def describe(self) -> str:
        if self.damage is not None:
            return f"hold object damaged ({self.damage}); it still holds"
        return f"reason {self.reason!r}, by {self.who} at {_utc(self.when)}"

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version_id, "reason": self.reason, "who": self.who,
                "when": self.when, "process": self.process, "damage": self.damage}


def _utc(when: float | None) -> str:
    if when is None:
        return "?"
    return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(when))


def check_reason(reason: object) -> str:
    """The reason a hold records: non-empty text of at most :data:`MAX_REASON_CHARS`."""
    if not (isinstance(reason, str) and reason.strip() and plaindata.is_unicode(reason)):
        raise InvalidInputError(f"a hold needs a reason (non-empty text), not {reason!r}:"
                                " say why the version must be kept (--reason TEXT)")
    if not reason.isprintable():  # log and show print it on operators' terminals
        raise InvalidInputError(f"a hold's reason is one line of printable text, not"
                                f" {reason!r}: no control characters or line breaks")
    if len(reason) > MAX_REASON_CHARS:
        raise InvalidInputError(f"a hold's reason is at most {MAX_REASON_CHARS} characters"
                                f" ({len(reason)} given); refer to a document instead")
    return reason


def who_am_i() -> str:
    """``user@host``: the name of the process's user id (not getpass.getuser(), which
    believes $LOGNAME and $USER: any process would record the name it was started
    with), ``uid<N>`` where the id has none (a container)."""
    try:
        import pwd  # POSIX only
        user = pwd.getpwuid(os.getuid()).pw_name
    except ImportError:  # Windows: the login name is the one there is
        user = getpass.getuser()
    except KeyError:  # no name for this uid
        user = f"uid{os.getuid()}"
    return printable(f"{user}@{socket.gethostname()}")


def printable(text: str) -> str:
    """``text`` with each character that is not printable as ``?`` (a reader takes a
    hold object with one for damage: its fields go to terminals)."""
    return "".join(c if c.isprintable() else "?" for c in text)


def encode_hold(version_id: str, reason: str, when: float, *, who: str | None = None,
                process: str | None = None) -> bytes:
    """The hold object's bytes (who and process: this user and process unless given)."""
    if process is None:
        process = f"pid {os.getpid()} {os.path.basename(sys.argv[0]) if sys.argv else ''}"
    body = {"format": HOLD_RECORD, "format_version": HOLD_FORMAT, "version": version_id,
            "reason": reason, "who": who_am_i() if who is None else who, "when": when,
            "process": printable(process.strip())}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode("utf-8")


def decode_hold(version_id: str, data: bytes) -> Hold:
    """The hold ``data`` records; never raises: a damaged object is a :class:`Hold` with
    ``damage`` set (it holds)."""
    if len(data) > MAX_HOLD_BYTES:
        return Hold(version_id, None, damage=f"{len(data)} bytes, over {MAX_HOLD_BYTES}")
    try:
        body = plaindata.load_json(data)
    except ValueError as exc:
        return Hold(version_id, None, damage=f"not JSON: {exc}")
    if not isinstance(body, dict) or body.get("format") != HOLD_RECORD:
        return Hold(version_id, None, damage="not a hold object")
    if not is_version(body.get("format_version"), HOLD_FORMAT):
        return Hold(version_id, None,
                    damage=f"format_version {body.get('format_version')!r} unknown here")
    damage = _field_damage(version_id, body)
    if damage is not None:
        return Hold(version_id, None, damage=damage)
    return Hold(version_id, body["reason"], body["who"], float(body["when"]), body["process"])


def _field_damage(version_id: str, body: dict[str, Any]) -> str | None:
    """What is wrong with a hold object's fields (None: nothing)."""
    reason, who, when, process = (body.get(k) for k in ("reason", "who", "when", "process"))
    if body.get("version") != version_id or not isinstance(reason, str) \
            or not isinstance(who, str) or type(when) not in (int, float) \
            or not isinstance(process, str):
        return "a field is missing, of the wrong type, or names another version"
    if not all(text.isprintable() for text in (reason, who, process)):
        return "a field holds control characters"  # they would go raw to terminals
    return None


def held_ids(objects: ObjectStore) -> set[str]:
    """The ids of every held version: one listing of ``holds/`` (existence is the hold)."""
    return {vid for vid in objects.ids(HOLDS) if is_hex_digest(vid)}


def read_hold(objects: ObjectStore, version_id: str) -> Hold | None:
    """The hold of ``version_id`` (None: not held); one that cannot be read holds."""
    try:
        # Bounded before it is read: a crafted object of a gigabyte is damage, not a read.
        size = objects.stat(HOLDS, version_id).size
        if size > MAX_HOLD_BYTES + _SEALING_SLACK:
            return Hold(version_id, None, damage=f"{size} bytes, over {MAX_HOLD_BYTES}")
        data = objects.get(HOLDS, version_id)
    except FileNotFoundError:
        return None
    except ChunkStoreError as exc:  # a sealed hold that fails authentication, say
        return Hold(version_id, None, damage=str(exc))
    return decode_hold(version_id, data)


def list_holds(objects: ObjectStore) -> dict[str, Hold]:
    """Every hold in the store, by version id."""
    found = {}
    for vid in sorted(held_ids(objects)):
        hold = read_hold(objects, vid)
        if hold is not None:  # released meanwhile
            found[vid] = hold
    return found


def store_hold(objects: ObjectStore, version_id: str, reason: str) -> Hold:
    """Store the hold object, durably (replacing an earlier hold of the version)."""
    when = time.time()
    data = encode_hold(version_id, reason, when)
    objects.put(HOLDS, version_id, data)
    return decode_hold(version_id, data)


def release_hold(objects: ObjectStore, version_id: str) -> bool:
    """Delete the hold object; False when there was none."""
    return objects.delete(HOLDS, version_id)
