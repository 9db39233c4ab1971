"""Moved records: where the live members of a repacked pack went (docs/format.md §3.6).

Manifests are immutable, so a version keeps listing a packed chunk at
``(pack, offset, length)`` after GC has copied the pack's live members into
a new pack and deleted the old one.  ``moved/<pack hex>`` says, for each
member it copied, where the same member object now lies.  A reader that
finds a pack missing looks for its moved record and reads the member there
(hash-checked as always, so a wrong record is a corrupt chunk, never data);
GC's mark follows the records from the locations the manifests list to the
packs that hold the bytes now.  Records are written once (put-if-absent) and
deleted only when no version can reach them (:mod:`chunkstore.maintenance.gc`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from chunkstore.errors import CorruptChunkError
from chunkstore.format.digest import Digest
from chunkstore.format.manifest import (
    MAX_MEMBER_BYTES,
    MAX_PACK_BYTES,
    PackLocation,
    exact_int,
    is_version,
)
from chunkstore.objects.kinds import MOVED

if TYPE_CHECKING:
    from chunkstore.objects.objectstore import ObjectStore

MOVED_FORMAT = 1
#: A location is followed through at most this many moved records (a pack repacked,
#: its new pack repacked again, ...); a longer path is a corrupt store.
MAX_HOPS = 16
#: A record names at most this many members (a pack's content bounds it far below).
MAX_MEMBERS = MAX_PACK_BYTES // 24


@dataclass(frozen=True)
class MovedRecord:
    """Members of ``pack`` copied into ``to``: old offset -> (length, new offset)."""

    pack: Digest
    to: Digest
    members: dict[int, tuple[int, int]]

    def forward(self, location: PackLocation) -> PackLocation | None:
        """Where the member at ``location`` (inside ``pack``) lies now; None if not moved."""
        found = self.members.get(location.offset)
        if found is None or found[0] != location.length:
            return None
        return PackLocation(self.to, found[1], location.length)

    def encode(self) -> bytes:
        body = {"format_version": MOVED_FORMAT, "pack": self.pack.hex, "to": self.to.hex,
                "members": [[offset, length, new] for offset, (length, new)
                            in sorted(self.members.items())]}
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, pack: Digest, data: bytes) -> MovedRecord:
        """Parse and check a record read from ``moved/<pack>``; damage is a corrupt chunk
        (the pack's members cannot be found)."""
        def bad(reason: str) -> CorruptChunkError:
            return CorruptChunkError(pack.hex, f"its moved record ({MOVED.key(pack)}) {reason}")

        try:
            obj = json.loads(data)
        except (ValueError, UnicodeDecodeError, RecursionError):
            raise bad("is not JSON") from None
        if not isinstance(obj, dict) or not is_version(obj.get("format_version"), MOVED_FORMAT):
            raise bad("is not a format 1 record")
        if obj.get("pack") != pack.hex:
            raise bad("names another pack")
        to_hex = obj.get("to")
        try:
            to = Digest.parse(to_hex if isinstance(to_hex, str) else "")
        except ValueError:
            raise bad("names no pack it moved to") from None
        if to == pack:
            raise bad("moves the pack into itself")
        members = obj.get("members")
        if not isinstance(members, list) or not 0 < len(members) <= MAX_MEMBERS:
            raise bad("lists no members, or too many")
        parsed: dict[int, tuple[int, int]] = {}
        for item in members:
            try:
                if not isinstance(item, list) or len(item) != 3:
                    raise ValueError("not [offset, length, new offset]")
                offset = exact_int(item[0], "offset", 0, MAX_PACK_BYTES)
                length = exact_int(item[1], "length", 24, MAX_MEMBER_BYTES)
                new = exact_int(item[2], "new offset", 0, MAX_PACK_BYTES)
            except ValueError as exc:
                raise bad(f"lists an impossible member: {exc}") from None
            if offset in parsed:
                raise bad(f"lists the member at {offset} twice")
            parsed[offset] = (length, new)
        return cls(pack, to, parsed)


def resolve_location(location: PackLocation, moved: dict[Digest, MovedRecord | None],
                     stored: Callable[[Digest], bool]) -> tuple[PackLocation, list[Digest]]:
    """Where GC counts a listed member as held: through each moved record that covers
    it, as long as the pack it leads to is stored or the pack it leaves is not (a
    record is never trusted to replace bytes that exist with bytes that do not).
    Returns the final location and the packs whose records were followed."""
    hops = resolve_hops(location, moved, stored)
    return hops[-1], [hop.pack for hop in hops[:-1]]


def resolve_hops(location: PackLocation, moved: dict[Digest, MovedRecord | None],
                 stored: Callable[[Digest], bool]) -> list[PackLocation]:
    """Every location :func:`resolve_location` passes through, ``location`` first and
    the final one last."""
    hops = [location]
    for _ in range(MAX_HOPS):
        record = moved.get(location.pack)
        new = record.forward(location) if record is not None else None
        if new is None or not (stored(new.pack) or not stored(location.pack)):
            break
        location = new
        hops.append(location)
    return hops


def read_moved(objects: ObjectStore, pack: Digest) -> MovedRecord | None:
    """The moved record of ``pack``; None when it has none."""
    try:
        data = objects.get(MOVED, pack)
    except FileNotFoundError:
        return None
    return MovedRecord.decode(pack, data)


def list_moved(objects: ObjectStore) -> dict[Digest, MovedRecord | None]:
    """Every moved record in the store by pack; None for one that cannot be parsed
    (GC then keeps everything it might forward to: see :mod:`chunkstore.maintenance.mark`)."""
    found: dict[Digest, MovedRecord | None] = {}
    for pack in objects.ids(MOVED):
        try:
            record = read_moved(objects, pack)
        except CorruptChunkError:
            found[pack] = None
            continue
        if record is not None:  # else deleted since the listing
            found[pack] = record
    return found


def write_moved(objects: ObjectStore, record: MovedRecord) -> bool:
    """Store a record once; False when the pack already has one (another GC moved it)."""
    return objects.put_if_absent(MOVED, record.pack, record.encode())
