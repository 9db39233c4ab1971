"""The object layer of an encrypted store: every object sealed on its way to the
backend and opened on its way back (:mod:`chunkstore.objects.crypto`), chunk ids keyed.

Above this class nothing knows a store is encrypted: every read and write already
passes the hooks of :class:`~chunkstore.objects.objectstore.ObjectStore`.  Sealing
changes lengths (28 bytes per 64 KiB segment), so the ranged reads and the sizes are
this class's too: a range of an encoding is read as the segments that cover it, and
:meth:`stat` and :meth:`infos` report the encoding's size, which is what readers above
compare with chunk headers.  Mapped reads (``view_range``) are opened into fresh
memory instead, never mapped.  The config and key objects stay in clear: they say how
to read the rest.

In a store of version 13 each pack member is sealed on its own under its chunk id
(:mod:`chunkstore.objects.sealedpacks`): pack locations then count stored bytes, and the
member path (:meth:`member_range`, :meth:`open_member`, :meth:`member_head`) reads the
stored bytes a location names and opens each member alone; a whole pack (:meth:`get`)
is opened member by member through its sealed index.

An object that fails authentication raises the corrupt error of its kind (a chunk's
:class:`CorruptChunkError`, and a moved record's, as one that does not parse; a
node's, a commit record's, a tag's; any other kind :class:`CorruptObjectError`), so
verify names it and a restore falls back past it as it does past any damage: nothing
that fails is ever returned.
"""

from __future__ import annotations

from collections.abc import Iterator

from chunkstore.backends import Backend, ObjectInfo
from chunkstore.codecs import PACK
from chunkstore.errors import (
    CorruptChunkError,
    CorruptNodeError,
    CorruptObjectError,
    CorruptRecordError,
    CorruptTagError,
    IntegrityError,
)
from chunkstore.format.chunkobj import HEADER, MAGIC
from chunkstore.format.digest import ChunkIds, Digest
from chunkstore.format.manifest import PackLocation
from chunkstore.objects import sealedpacks
from chunkstore.objects.crypto import (
    AuthenticationError,
    Sealer,
    plain_size,
    scratch,
    stored_size,
)
from chunkstore.objects.kinds import (
    CHUNKS,
    CLEAR_KINDS,
    MOVED,
    NODES,
    TAGS,
    VERSIONS,
    IdT,
    Kind,
)
from chunkstore.objects.objectstore import (
    MemberBuffer,
    ObjectStore,
    PackEncoding,
    PackHead,
    Paging,
    Pieces,
)

#: A sealed member opened with paging (:meth:`SealedObjects.open_member`) is populated,
#: opened and released about this many stored bytes at a time.
OPEN_GRAIN = 1024 * 1024


def _is_pack(plain: bytes) -> bool:
    """Whether an opened chunk object is a pack (its header names the pack codec)."""
    return len(plain) >= HEADER.size and plain[:4] == MAGIC and plain[5] == PACK.id


def corrupt(kind: Kind[IdT], key: str, reason: str) -> IntegrityError:
    """The error an object of ``kind`` stored as ``key`` that fails raises."""
    name = key[len(kind.prefix):].rsplit("/", 1)[-1]
    if kind is CHUNKS:
        return CorruptChunkError(name, reason)
    if kind is MOVED:  # as a moved record that does not parse: the pack's damage
        return CorruptChunkError(name, f"its moved record ({key}) {reason}")
    if kind is NODES:
        return CorruptNodeError(name, reason)
    if kind is VERSIONS:
        return CorruptRecordError(name, reason)
    if kind is TAGS:
        return CorruptTagError(name, reason)
    return CorruptObjectError(kind.name, name, reason)


def _member_corrupt(digest: Digest, location: PackLocation, reason: str) -> CorruptChunkError:
    return CorruptChunkError(digest.hex, f"its member at {location.offset} of pack"
                             f" {location.pack.short()} fails authentication: {reason}"
                             " (tampered with, moved, or another chunk's bytes)")


class SealedObjects(ObjectStore):
    """The objects of an encrypted store (see the module docstring)."""

    encrypted = True

    def __init__(self, backend: Backend, sealer: Sealer, chunk_ids: ChunkIds,
                 master: bytes, key_id: str, node_ids: ChunkIds | None = None) -> None:
        super().__init__(backend)
        self.sealer = sealer
        self.chunk_ids = chunk_ids
        if node_ids is not None:  # keyed (store version 12); else plain, as the base's
            self.node_ids = node_ids
        self.sealed_members = sealer.members  # store version 13
        #: the master key and the key object that opened it (``chunkstore key add`` and
        #: ``passwd`` wrap the same master key again; never stored in clear, never shown)
        self.master = master
        self.key_id = key_id

    def _open(self, kind: Kind[IdT], key: str, start: int, stored: bytes | memoryview,
              out: memoryview, skip: int) -> int:
        try:
            return self.sealer.open_into(key, start, stored, out, skip)
        except AuthenticationError as exc:
            raise corrupt(kind, key, f"fails authentication: {exc} (tampered with,"
                          " truncated, or another object's bytes)") from None

    # --- the hooks --------------------------------------------------------------------------

    def _stored(self, kind: Kind[IdT], key: str, data: bytes | memoryview
                ) -> bytes | memoryview:
        return data if kind in CLEAR_KINDS else self.sealer.seal(key, data)

    def _stored_pieces(self, kind: Kind[IdT], key: str, pieces: Pieces) -> bytes | memoryview:
        """Sealed straight from the pieces (a pack's members): no join."""
        if kind in CLEAR_KINDS:
            return super()._stored_pieces(kind, key, pieces)
        return self.sealer.seal(key, pieces)

    def _stored_pack(self, kind: Kind[IdT], key: str, pack: PackEncoding
                     ) -> bytes | memoryview:
        if not self.sealed_members:
            return super()._stored_pack(kind, key, pack)
        return sealedpacks.seal_pack(self.sealer, key, pack)

    def _loaded(self, kind: Kind[IdT], key: str, data: bytes) -> bytes:
        if kind in CLEAR_KINDS:
            return data
        try:
            plain = self.sealer.open(key, data)
        except AuthenticationError as exc:
            failure = exc
        else:
            if not (self.sealed_members and kind is CHUNKS and _is_pack(plain)):
                return plain
            # A pack sealed whole (as a store of version 12 lays it out): its members
            # are not where its locations, which count stored bytes here, say.
            failure = AuthenticationError("a pack sealed whole, where each member is"
                                          " sealed on its own")
        if self.sealed_members and kind is CHUNKS:  # or a pack, sealed member by member
            try:
                return sealedpacks.open_pack(self.sealer, key, data)
            except AuthenticationError as exc:
                if sealedpacks.looks_like_pack(data, self.sealer.segment):
                    failure = exc
        raise corrupt(kind, key, f"fails authentication: {failure} (tampered with,"
                      " truncated, or another object's bytes)") from None

    def _loaded_range(self, kind: Kind[IdT], key: str, start: int, data: bytes) -> bytes:
        raise AssertionError("ranged reads of a sealed store go through get_range")

    def _loaded_into(self, kind: Kind[IdT], key: str, start: int, buffer: memoryview) -> None:
        raise AssertionError("ranged reads of a sealed store go through read_into")

    # --- ranged reads and sizes ------------------------------------------------------------

    def get_range(self, kind: Kind[IdT], object_id: IdT, start: int, length: int) -> bytes:
        """Up to ``length`` bytes from ``start`` of the object's encoding, read as the
        segments that cover them."""
        key = kind.key(object_id)
        if kind in CLEAR_KINDS:
            return self.backend.get_range(key, start, length)
        if length <= 0:
            return b""
        out = scratch(length)
        return bytes(out[:self._read(kind, key, start, out)])  # bytes, as readers expect

    def view_range(self, kind: Kind[IdT], object_id: IdT, start: int, length: int, *,
                   populate: bool = True) -> bytes | memoryview:
        """:meth:`get_range` as a read-only buffer opened straight into fresh memory, for
        bytes that are decoded and dropped (no copy into a ``bytes``; never a mapping)."""
        key = kind.key(object_id)
        if kind in CLEAR_KINDS or length <= 0:
            return self.get_range(kind, object_id, start, length)
        out = scratch(length)
        return out[:self._read(kind, key, start, out)].toreadonly()

    def read_into(self, kind: Kind[IdT], object_id: IdT, start: int,
                  buffer: memoryview) -> int:
        """Fill ``buffer`` from ``start`` of the encoding: segments wholly inside it are
        opened straight into it, with no copy."""
        key = kind.key(object_id)
        if kind in CLEAR_KINDS:
            return self.backend.read_into(key, start, buffer)
        return self._read(kind, key, start, buffer) if len(buffer) else 0

    def _read(self, kind: Kind[IdT], key: str, start: int, out: memoryview) -> int:
        stored_start, stored_length = self.sealer.span(start, len(out))
        # A local store maps larger ranges: the segments are opened straight from the
        # page cache (no copy of the stored bytes, no fresh memory to fault in).
        stored = self.backend.view_range(key, stored_start, stored_length)
        try:
            return self._open(kind, key, start, stored, out, start % self.sealer.segment)
        except CorruptChunkError:
            if not (self.sealed_members and kind is CHUNKS and start < HEADER.size):
                raise
        try:  # the head of a chunk object that is a pack: its header, from its index
            header = self._pack_head(key).header[start:start + len(out)]
        except (AuthenticationError, FileNotFoundError):
            raise corrupt(kind, key, "fails authentication (tampered with, truncated, or"
                          " another object's bytes)") from None
        out[:len(header)] = header
        return len(header)

    # --- pack members (store version 13: docs/format.md §13.6) -----------------------------

    def member_length(self, length: int) -> int:
        return stored_size(length, self.sealer.segment) if self.sealed_members else length

    def member_range(self, pack: Digest, start: int, length: int, *, populate: bool = True
                     ) -> bytes | memoryview:
        """The stored bytes themselves: each member is opened on its own."""
        if not self.sealed_members:
            return super().member_range(pack, start, length, populate=populate)
        return self.backend.view_range(CHUNKS.key(pack), start, length, populate=populate)

    def open_member(self, digest: Digest, location: PackLocation,
                    data: bytes | memoryview, buffer: MemberBuffer | None = None,
                    paging: Paging | None = None) -> memoryview:
        data = super().open_member(digest, location, data)
        if not self.sealed_members:
            return data
        out = (scratch if buffer is None else buffer)(plain_size(len(data), self.sealer.segment))
        if self._open_member(digest, location, data, out, paging) != len(out) \
                or len(data) != stored_size(len(out), self.sealer.segment):
            raise _member_corrupt(digest, location, "the member is truncated")
        return out.toreadonly()

    def _open_member(self, digest: Digest, location: PackLocation, stored: bytes | memoryview,
                     out: memoryview, paging: Paging | None = None) -> int:
        name = sealedpacks.member_name(digest)
        try:
            if paging is not None:
                return self.sealer.open_paged(name, memoryview(stored), out, *paging,
                                              OPEN_GRAIN)
            return self.sealer.open_into(name, 0, stored, out, 0)
        except AuthenticationError as exc:
            raise _member_corrupt(digest, location, str(exc)) from None

    def member_head(self, digest: Digest, location: PackLocation, length: int) -> bytes:
        if not self.sealed_members:
            return super().member_head(digest, location, length)
        _, span = self.sealer.span(0, length)  # the segments that hold the head
        stored = self.backend.get_range(CHUNKS.key(location.pack), location.offset,
                                        min(span, location.length))
        out = scratch(min(length, plain_size(location.length, self.sealer.segment)))
        return bytes(out[:self._open_member(digest, location, stored, out)])

    def pack_size(self, pack: PackEncoding) -> int:
        if not self.sealed_members:
            return super().pack_size(pack)  # the encoding's size, as stat reports
        return sealedpacks.stored_pack_size(pack, self.sealer.segment)

    def pack_head(self, pack: Digest) -> PackHead:
        if not self.sealed_members:
            return super().pack_head(pack)
        try:
            return self._pack_head(CHUNKS.key(pack))
        except AuthenticationError as exc:
            raise corrupt(CHUNKS, CHUNKS.key(pack), f"its index fails authentication: {exc}"
                          " (tampered with, or truncated)") from None

    def _pack_head(self, key: str) -> PackHead:
        size = self.backend.stat(key).size
        trailer = self.backend.get_range(key, max(size - 4, 0), 4)
        if len(trailer) < 4:
            raise AuthenticationError("the pack is truncated")
        need = sealedpacks.tail_length(trailer)
        tail = self.backend.get_range(key, max(size - need, 0), need)
        return sealedpacks.pack_head(self.sealer, key, size, tail)

    def stat(self, kind: Kind[IdT], object_id: IdT) -> ObjectInfo:
        """The size of the object's encoding and its modification time."""
        info = self.backend.stat(kind.key(object_id))
        return info if kind in CLEAR_KINDS else self._plain(info)

    def infos(self, kind: Kind[IdT]) -> Iterator[tuple[IdT, ObjectInfo]]:
        for object_id, info in super().infos(kind):
            yield object_id, info if kind in CLEAR_KINDS else self._plain(info)

    def _plain(self, info: ObjectInfo) -> ObjectInfo:
        return ObjectInfo(info.key, plain_size(info.size, self.sealer.segment), info.mtime)
