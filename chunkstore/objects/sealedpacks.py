"""Packs of an encrypted store of version 13: each member sealed on its own
(docs/format.md §13.6).

A pack member is sealed as an object of its own would be (:class:`Sealer`'s segments,
a salt per write), under the name ``"pack member " + its chunk id``, not under its
pack's key: its ciphertext is bound to the chunk it is the object of and to nothing
about where it lies, so a repack copies it unchanged into another pack at another
offset, and a member swapped for another chunk's ciphertext fails as a corrupt chunk.
The stored pack is::

    member 1 sealed || ... || member n sealed || index sealed || index's stored length (4 bytes)

The index, sealed under the pack's own key, is the pack's header (§3.5) and, per
member in order, its chunk id (32 bytes) and stored length (4 bytes, big-endian): what
a reader of the whole pack (a sync's check, a writer's check of a copy it found) needs
to open it member by member into the pack's encoding.  A reader of one member needs
none of it: a pack location lists the member's stored offset and length.
"""

from __future__ import annotations

import struct

from chunkstore.format.chunkobj import HEADER
from chunkstore.format.digest import Digest
from chunkstore.objects.crypto import (
    AuthenticationError,
    Sealer,
    byte_views,
    fresh_salts,
    plain_size,
    scratch,
    stored_size,
)
from chunkstore.objects.objectstore import OpenedPack, PackEncoding, PackHead, Pieces

#: What a member is sealed as: this, then its chunk id in hex.  No object's key starts
#: so (every kind's prefix ends with "/"), so a member never opens as an object.
MEMBER_PREFIX = "pack member "
_ENTRY = struct.Struct(">32sI")
_TRAILER = struct.Struct(">I")


def member_name(digest: Digest) -> str:
    """What the member object of chunk ``digest`` is sealed as."""
    return MEMBER_PREFIX + digest.hex


def seal_pack(sealer: Sealer, key: str, pack: PackEncoding) -> memoryview:
    """The stored bytes of ``pack`` under ``key``: its members sealed each on its own
    (or, for a repack, as ``pack.sealed`` holds them already), then its index, written
    side by side into one buffer (no member sealed into a buffer of its own, then
    joined: a save's packs are its largest writes, and the last one's sealing is on
    its commit's path)."""
    if pack.sealed is not None and len(pack.sealed) != len(pack.members):
        raise ValueError("a sealed pack needs the stored bytes of every member")
    plain = [byte_views(pieces) for _, pieces in pack.members] if pack.sealed is None else []
    lengths = ([stored_size(sum(map(len, pieces)), sealer.segment) for pieces in plain]
               if pack.sealed is None else list(map(len, pack.sealed)))
    entries = [pack.header, *(_ENTRY.pack(digest.raw, length)
                              for (digest, _), length in zip(pack.members, lengths, strict=True))]
    index = stored_size(sum(map(len, entries)), sealer.segment)
    target = scratch(sum(lengths) + index + _TRAILER.size)
    gather, at = scratch(sealer.segment), 0
    # Each member's salt and the index's, in the order each write drew its own before.
    salts = fresh_salts(len(plain) + 1)
    for number, ((digest, _), length) in enumerate(zip(pack.members, lengths, strict=True)):
        member = target[at:at + length]
        if pack.sealed is None:
            sealer.seal_into(member_name(digest), plain[number], member, gather,
                             salts[number])
        else:  # a repack: the member's ciphertext, unchanged
            member[:] = pack.sealed[number]
        at += length
    sealer.seal_into(key, byte_views(entries), target[at:at + index], gather, salts[-1])
    target[at + index:] = _TRAILER.pack(index)
    return target


def stored_pack_size(pack: PackEncoding, segment: int) -> int:
    """The bytes :func:`seal_pack` stores for ``pack``."""
    members = (sum(stored_size(sum(map(len, pieces)), segment) for _, pieces in pack.members)
               if pack.sealed is None else sum(map(len, pack.sealed)))
    index = stored_size(HEADER.size + _ENTRY.size * len(pack.members), segment)
    return members + index + _TRAILER.size


def _index(sealer: Sealer, key: str, index: bytes | memoryview, members: int
           ) -> tuple[bytes, list[tuple[Digest, int]]]:
    """The pack's header and (chunk id, stored length) of each member, from its stored
    index; the members must take exactly ``members`` bytes."""
    plain = sealer.open(key, index)
    if len(plain) < HEADER.size or (len(plain) - HEADER.size) % _ENTRY.size:
        raise AuthenticationError("its index is not a pack index")
    entries = [(Digest(raw), length) for raw, length in _ENTRY.iter_unpack(
        plain[HEADER.size:])]
    if sum(length for _, length in entries) != members:
        raise AuthenticationError(f"its index lists {sum(length for _, length in entries)}"
                                  f" bytes of members, the pack holds {members}")
    return plain[:HEADER.size], entries


def _index_length(stored: int, trailer: bytes | memoryview) -> int:
    length = int(_TRAILER.unpack(trailer)[0])
    if not stored_size(HEADER.size) <= length <= stored - _TRAILER.size:
        raise AuthenticationError(f"its index length {length} is out of range")
    return length


def looks_like_pack(stored: bytes | memoryview, segment: int) -> bool:
    """Whether a stored chunk object's trailer names an index a pack could have (to tell
    which failure to report for an object that opens neither way)."""
    if len(stored) < _TRAILER.size:
        return False
    (length,) = _TRAILER.unpack(stored[-_TRAILER.size:])
    plain = plain_size(length, segment)
    return (stored_size(HEADER.size, segment) <= length <= len(stored) - _TRAILER.size
            and plain >= HEADER.size and (plain - HEADER.size) % _ENTRY.size == 0)


def open_pack(sealer: Sealer, key: str, stored: bytes | memoryview) -> OpenedPack:
    """The encoding of the whole pack stored as ``stored`` (header, then every member
    object), every member opened under its chunk id, with the stored bytes of each
    (:class:`OpenedPack`); :class:`AuthenticationError`."""
    view = memoryview(stored).cast("B")
    if len(view) < _TRAILER.size:
        raise AuthenticationError("the pack is truncated")
    length = _index_length(len(view), view[-_TRAILER.size:])
    end = len(view) - _TRAILER.size - length
    header, entries = _index(sealer, key, view[end:len(view) - _TRAILER.size], end)
    members: list[tuple[Digest, Pieces]] = []
    sealed: list[bytes | memoryview] = []
    at = 0
    for digest, size in entries:
        members.append((digest, [sealer.open(member_name(digest), view[at:at + size])]))
        sealed.append(bytes(view[at:at + size]))
        at += size
    pack = PackEncoding(header, members, sealed)
    opened = OpenedPack(b"".join(pack.pieces()))
    opened.pack = pack
    return opened


def pack_head(sealer: Sealer, key: str, size: int, tail: bytes | memoryview) -> PackHead:
    """The head of a pack of ``size`` stored bytes whose last bytes are ``tail`` (at
    least :func:`tail_length` of them, or the whole pack)."""
    view = memoryview(tail).cast("B")
    if size < _TRAILER.size or len(view) < _TRAILER.size:
        raise AuthenticationError("the pack is truncated")
    length = _index_length(size, view[-_TRAILER.size:])
    if len(view) < length + _TRAILER.size:
        raise AuthenticationError("the pack is truncated")
    members = size - _TRAILER.size - length
    header, entries = _index(sealer, key, view[len(view) - _TRAILER.size - length:
                                               len(view) - _TRAILER.size], members)
    content = sum(plain_size(stored, sealer.segment) for _, stored in entries)
    return PackHead(header, content, members, size)


def tail_length(trailer: bytes | memoryview) -> int:
    """How many last bytes of a pack :func:`pack_head` needs, from its last 4."""
    return int(_TRAILER.unpack(trailer)[0]) + _TRAILER.size
