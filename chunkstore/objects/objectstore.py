"""The object layer: the only code that talks to a storage backend.

Everything above asks for objects by kind and id (:mod:`chunkstore.objects.kinds`)
and never builds a key or calls a :class:`~chunkstore.backends.Backend`.  Every
object's bytes pass through :meth:`ObjectStore._stored` on the way in (an encoding
written in pieces, a pack's, joined first by :meth:`ObjectStore._stored_pieces`, which
a transform that reads pieces in place overrides) and
:meth:`ObjectStore._loaded` on the way out (ranged reads, of pack members and
headers, through :meth:`ObjectStore._loaded_range`, or in place into a caller's
buffer through :meth:`ObjectStore._loaded_into`): a transform of every stored
object (encryption, a copy to a second store for mirroring) is a change to these
methods and nothing else (tests/test_architecture.py stores every object through
a transform and reads the store back).  Today the store keeps objects as they are
encoded; the config object always stays so (it says how to read the rest).  A
transform that changes lengths (a nonce and tag per object) also owns the sizes
:meth:`ObjectStore.stat` reports and the offsets of ranged reads: readers above
compare a chunk's stored size with its header, and read pack members by offset.
Reads that may map the stored bytes (:meth:`ObjectStore.view_range`) do so only
while no transform is in place; with one they get :meth:`ObjectStore.get_range`'s.
Each hook is given the object's key as well: encryption
(:class:`chunkstore.objects.sealed.SealedObjects`) binds every object to it.  Chunk
ids are the object layer's too (:attr:`ObjectStore.chunk_ids`): plain BLAKE3 here,
keyed in an encrypted store; so are node ids (:attr:`ObjectStore.node_ids`), keyed in
an encrypted store of version 12.  Pack members are read through one path
(:meth:`ObjectStore.member_range`, then :meth:`ObjectStore.open_member` for each member
cut out by its location), which a store that seals each member on its own (version 13)
overrides; packs are written as :class:`PackEncoding` (header and members by chunk id).

Errors keep the backend's contract: a missing object is ``FileNotFoundError``,
a second create ``False``; the layers above turn them into domain errors, since
only they know whether a missing object is damage or a race they expect.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

from chunkstore.backends import Backend, ObjectInfo
from chunkstore.errors import CorruptChunkError, IntegrityError
from chunkstore.format.chunkobj import HEADER
from chunkstore.format.digest import PLAIN_IDS, ChunkIds, Digest
from chunkstore.format.manifest import PackLocation
from chunkstore.objects.kinds import CHUNKS, CONFIG_KEY, IdT, Kind

__all__ = ["Encoded", "MemberBuffer", "ObjectInfo", "ObjectStore", "OpenedPack", "PackEncoding",
           "PackHead", "Paging", "Pieces"]

#: An object's encoding as pieces laid end to end (a pack: its header and its members),
#: joined only where the store keeps objects as they are encoded
#: (:meth:`ObjectStore._stored_pieces`).
Pieces = list[bytes | memoryview]


@dataclass(frozen=True)
class PackEncoding:
    """A pack to write (docs/format.md §3.5): its header, and each member as the chunk
    id it is the object of and its encoding in pieces.  ``sealed``: each member's stored
    bytes as a store that seals members on their own already holds them (a repack
    copies them unchanged, §13.6), else None."""

    header: bytes
    members: list[tuple[Digest, Pieces]]
    sealed: list[bytes | memoryview] | None = None

    def pieces(self) -> Pieces:
        """The pack's encoding (header, then every member) as pieces laid end to end."""
        return [self.header, *(piece for _, pieces in self.members for piece in pieces)]


class OpenedPack(bytes):
    """A pack's encoding as a read of the whole pack returns it from a store that seals
    each member on its own, which also holds the pack as :class:`PackEncoding` (its
    members' ids and stored bytes): written to a store under the same keys (a sync, a
    repair, a mirror's heal; :func:`chunkstore.maintenance.sync.check_same_keys`), the
    members' stored bytes are copied as they are."""

    pack: PackEncoding


class PackHead(NamedTuple):
    """A pack object as a whole (:meth:`ObjectStore.pack_head`): its header's bytes, the
    bytes of member objects it holds, the bytes its members take in the coordinates of
    pack locations, and the object's stored bytes (the encoding's, where that is what a
    store reports)."""

    header: bytes
    content: int
    located: int
    stored: int


#: What a write takes: an object's encoding, whole or in pieces, or a pack.
Encoded = bytes | memoryview | Pieces | PackEncoding
#: Where a store that seals each member on its own opens one (:meth:`ObjectStore.open_member`):
#: ``size`` writable bytes that the caller owns until it drops the opened member.
MemberBuffer = Callable[[int], memoryview]
#: How a reader populates and releases the pages of a mapped range (before and after it
#: is read): :meth:`ObjectStore.open_member` opens a sealed member in parts with them.
Paging = tuple[Callable[[memoryview], None], Callable[[memoryview], None]]


class ObjectStore:
    """The objects of one store, by kind and id, on one backend."""

    #: how the store names chunk contents (keyed BLAKE3 in an encrypted store)
    chunk_ids: ChunkIds = PLAIN_IDS
    #: how the store names manifest nodes (keyed BLAKE3 in an encrypted store of version 12)
    node_ids: ChunkIds = PLAIN_IDS
    #: whether stored objects are encrypted (:class:`~chunkstore.objects.sealed.SealedObjects`)
    encrypted = False

    def __init__(self, backend: Backend) -> None:
        #: may be replaced by a wrapper of itself (tests, fault injection, counting)
        self.backend = backend

    # --- the bytes of every object pass here ------------------------------------------------

    def _stored(self, kind: Kind[IdT], key: str, data: bytes | memoryview
                ) -> bytes | memoryview:
        """The bytes that go to the backend for an object of ``kind`` stored as ``key``
        and encoded as ``data``."""
        return data

    def _stored_pieces(self, kind: Kind[IdT], key: str, pieces: Pieces) -> bytes | memoryview:
        """:meth:`_stored` of an encoding given in pieces: here joined first (the one copy
        a pack's bytes take on their way to the backend); a transform that reads its input
        piece by piece (sealing) reads them in place instead."""
        return self._stored(kind, key, b"".join(pieces))

    def _stored_pack(self, kind: Kind[IdT], key: str, pack: PackEncoding
                     ) -> bytes | memoryview:
        """:meth:`_stored` of a pack: here its pieces (a store that seals each member on
        its own lays it out member by member)."""
        return self._stored_pieces(kind, key, pack.pieces())

    def _encoded(self, kind: Kind[IdT], key: str, data: Encoded) -> bytes | memoryview:
        if isinstance(data, OpenedPack):
            data = data.pack
        if isinstance(data, PackEncoding):
            return self._stored_pack(kind, key, data)
        if isinstance(data, list):
            return self._stored_pieces(kind, key, data)
        return self._stored(kind, key, data)

    def _loaded(self, kind: Kind[IdT], key: str, data: bytes) -> bytes:
        """An object's encoding from the bytes the backend holds."""
        return data

    def _loaded_range(self, kind: Kind[IdT], key: str, start: int, data: bytes) -> bytes:
        """Bytes ``start`` onwards of an object's encoding from the same bytes stored."""
        return data

    def _loaded_into(self, kind: Kind[IdT], key: str, start: int, buffer: memoryview) -> None:
        """:meth:`_loaded_range` in place: ``buffer`` holds stored bytes from ``start``."""

    # --- writing ---------------------------------------------------------------------------

    def put(self, kind: Kind[IdT], object_id: IdT, data: Encoded) -> None:
        """Store (or replace) an object; atomic and durable on return."""
        key = kind.key(object_id)
        self.backend.put(key, self._encoded(kind, key, data))

    def put_if_absent(self, kind: Kind[IdT], object_id: IdT, data: Encoded) -> bool:
        """Create an object unless one is stored; whether this call created it (exactly
        one of concurrent creators gets True).  Durable on return."""
        key = kind.key(object_id)
        return self.backend.put_if_absent(key, self._encoded(kind, key, data))

    def put_if_absent_deferred(self, kind: Kind[IdT], object_id: IdT, data: Encoded) -> bool:
        """:meth:`put_if_absent` whose durability may wait for the next :meth:`flush`.
        A pack of a store that keeps objects as encoded goes to the backend in pieces
        (a local store writes them without joining them: one pack's bytes less in
        memory per pack a save writes at once)."""
        key = kind.key(object_id)
        if isinstance(data, PackEncoding) and self._keeps_pieces():
            return self.backend.put_pieces_if_absent_deferred(key, data.pieces())
        return self.backend.put_if_absent_deferred(key, self._encoded(kind, key, data))

    def _keeps_pieces(self) -> bool:
        """Whether a pack is stored as its pieces laid end to end (no transform)."""
        cls = type(self)
        return (cls._stored is ObjectStore._stored
                and cls._stored_pieces is ObjectStore._stored_pieces
                and cls._stored_pack is ObjectStore._stored_pack)

    def flush(self) -> None:
        """Make every write so far durable (the step before a commit point)."""
        self.backend.flush()

    # --- reading ---------------------------------------------------------------------------

    def get(self, kind: Kind[IdT], object_id: IdT) -> bytes:
        """The whole object; ``FileNotFoundError`` when it is not stored."""
        key = kind.key(object_id)
        return self._loaded(kind, key, self.backend.get(key))

    def get_range(self, kind: Kind[IdT], object_id: IdT, start: int, length: int) -> bytes:
        """Up to ``length`` bytes from ``start`` (fewer at the end of the object)."""
        key = kind.key(object_id)
        return self._loaded_range(kind, key, start, self.backend.get_range(key, start, length))

    def view_range(self, kind: Kind[IdT], object_id: IdT, start: int, length: int, *,
                   populate: bool = True) -> bytes | memoryview:
        """:meth:`get_range` as a read-only buffer that may map the stored object
        (a local store's larger ranges: no copy, and no fresh memory to fault in), for
        bytes that are decoded and dropped.  Keeping it keeps the mapping.  A store
        whose objects are transformed (:meth:`_loaded_range` overridden) gets
        :meth:`get_range`'s bytes.  ``populate=False``: a mapping is left unpopulated
        (:meth:`chunkstore.backends.local.LocalBackend.view_range`)."""
        if type(self)._loaded_range is not ObjectStore._loaded_range:
            return self.get_range(kind, object_id, start, length)
        return self.backend.view_range(kind.key(object_id), start, length, populate=populate)

    def read_into(self, kind: Kind[IdT], object_id: IdT, start: int,
                  buffer: memoryview) -> int:
        """Fill ``buffer`` from ``start`` of the object, straight from the backend with
        no copy; the bytes read (fewer only where the object ends first)."""
        key = kind.key(object_id)
        length = self.backend.read_into(key, start, buffer)
        self._loaded_into(kind, key, start, buffer[:length])
        return length

    def holds(self, kind: Kind[IdT], object_id: IdT, data: bytes | memoryview | PackEncoding
              ) -> bool | None:
        """Whether the stored object is exactly ``data`` (None: nothing is stored; False:
        other bytes, or a copy that fails its check, which a writer then replaces)."""
        if isinstance(data, PackEncoding):
            data = b"".join(data.pieces())
        try:
            return self.get(kind, object_id) == data
        except FileNotFoundError:
            return None
        except IntegrityError:  # a sealed copy that fails authentication
            return False

    def stat(self, kind: Kind[IdT], object_id: IdT) -> ObjectInfo:
        """Stored size and modification time; ``FileNotFoundError`` when absent."""
        return self.backend.stat(kind.key(object_id))

    def exists(self, kind: Kind[IdT], object_id: IdT) -> bool:
        return self.backend.exists(kind.key(object_id))

    def ids(self, kind: Kind[IdT], prefix: str = "") -> Iterator[IdT]:
        """The id of every stored object of ``kind`` (whose key continues with
        ``prefix``), in key order; keys the kind does not write are skipped."""
        for key in self.backend.list(kind.prefix + prefix):
            try:
                yield kind.id_of(key)
            except ValueError:
                continue

    def listing_stamp(self, kind: Kind[IdT]) -> str | None:
        """A value that changes whenever an object of ``kind`` is stored or removed, where
        the backend can tell (:meth:`~chunkstore.backends.base.Backend.listing_stamp`);
        None: list them to know."""
        return self.backend.listing_stamp(kind.prefix)

    def infos(self, kind: Kind[IdT]) -> Iterator[tuple[IdT, ObjectInfo]]:
        """:meth:`ids` with each object's size and modification time."""
        for info in self.backend.list_info(kind.prefix):
            try:
                yield kind.id_of(info.key), info
            except ValueError:
                continue

    # --- pack members: the one path every member reader takes (docs/format.md §3.5) ------

    #: whether each pack member is sealed on its own (an encrypted store of version 13):
    #: pack locations then count stored bytes (docs/format.md §13.6)
    sealed_members = False

    def member_length(self, length: int) -> int:
        """The length a pack location lists for a member object of ``length`` bytes."""
        return length

    def member_range(self, pack: Digest, start: int, length: int, *, populate: bool = True
                     ) -> bytes | memoryview:
        """The bytes of ``pack`` from location offset ``start`` (one ranged read for a run
        of neighbouring members, which may map the stored object; ``populate=False``: a
        mapping left unpopulated, each member populated as it is read): cut each member
        out by its location and pass it to :meth:`open_member`.  ``FileNotFoundError``
        when the pack is not stored."""
        return self.view_range(CHUNKS, pack, HEADER.size + start, length, populate=populate)

    def open_member(self, digest: Digest, location: PackLocation,
                    data: bytes | memoryview, buffer: MemberBuffer | None = None,
                    paging: Paging | None = None) -> memoryview:
        """The member object of chunk ``digest`` from the bytes its ``location`` names
        (cut from :meth:`member_range`); :class:`CorruptChunkError` where the pack ended
        first (or, sealed, the member fails authentication).  Here a view of ``data``;
        a store that seals each member on its own opens it into ``buffer`` (a reader's
        reused scratch memory: fresh memory costs a page fault per 4 KiB, as much as
        the decryption), else into fresh memory; with ``paging`` (``data`` mapped and
        unpopulated) part by part, each part's pages populated before it is opened and
        released after, so the stored bytes are never resident whole beside the
        opened ones."""
        if len(data) != location.length:
            raise CorruptChunkError(digest.hex, f"pack {location.pack.short()} ends before"
                                    f" the member's {location.length} bytes at"
                                    f" {location.offset}")
        return memoryview(data)

    def located_members(self, pack: bytes) -> memoryview:
        """The bytes that pack locations address in a whole pack as :meth:`get` returns
        it (cut a member out by its location and pass it to :meth:`open_member`): its
        members' stored bytes where each is sealed on its own, else its content."""
        if isinstance(pack, OpenedPack) and pack.pack.sealed is not None:
            return memoryview(b"".join(pack.pack.sealed))
        return memoryview(pack)[HEADER.size:]

    def pack_sizes(self, pack: bytes) -> tuple[int, int]:
        """A whole pack's (bytes its members take as locations count them, bytes stored),
        for the pack as :meth:`get` returns it (what an index records of it)."""
        located = len(self.located_members(pack))
        if isinstance(pack, OpenedPack) and self.sealed_members:
            return located, self.pack_size(pack.pack)
        return located, len(pack)

    def member_head(self, digest: Digest, location: PackLocation, length: int) -> bytes:
        """Up to the first ``length`` bytes of the member object at ``location`` (its
        header), without the rest."""
        return self.get_range(CHUNKS, location.pack, HEADER.size + location.offset,
                              min(location.length, length))

    def pack_size(self, pack: PackEncoding) -> int:
        """The bytes ``pack`` takes stored (what a write of it reports)."""
        return sum(map(len, pack.pieces()))

    def pack_head(self, pack: Digest) -> PackHead:
        """The pack's header and sizes (:class:`PackHead`), for checks of a pack as a
        whole: reads never need them.  ``FileNotFoundError`` when it is not stored."""
        header = self.get_range(CHUNKS, pack, 0, HEADER.size)
        size = self.stat(CHUNKS, pack).size
        return PackHead(header, size - HEADER.size, size - HEADER.size, size)

    # --- removing --------------------------------------------------------------------------

    def delete(self, kind: Kind[IdT], object_id: IdT) -> bool:
        """Remove an object durably; whether it was stored.  Idempotent."""
        return self.backend.delete(kind.key(object_id))

    def delete_many(self, kind: Kind[IdT], object_ids: Iterable[IdT]) -> None:
        """:meth:`delete` each object, in batches where the backend has a bulk delete
        (:meth:`~chunkstore.backends.Backend.delete_many`: in no particular order)."""
        self.backend.delete_many([kind.key(object_id) for object_id in object_ids])

    def discard(self, kind: Kind[IdT], object_id: IdT) -> bool:
        """:meth:`delete` whose removal need not survive a crash (a session's object)."""
        return self.backend.discard(kind.key(object_id))

    def remove_folders(self, kind: Kind[IdT], folders: Iterable[str]) -> int:
        """Remove those of the kind's ``folders`` (names below its prefix, each ending in
        ``/``) that hold nothing, where the backend has folders; how many went."""
        return self.backend.remove_folders([kind.prefix + folder for folder in folders])

    def remove_temporaries(self, older_than: float, dry_run: bool = False) -> int:
        """Delete leftovers of interrupted writes older than ``older_than``; how many."""
        return self.backend.remove_temporaries(older_than, dry_run)

    # --- the config object -----------------------------------------------------------------

    def get_config(self) -> bytes:
        """The store's config object; ``FileNotFoundError`` where there is none.  It
        stays as it is in every store: it says how to read the rest."""
        return self.backend.get(CONFIG_KEY)

    def create_config(self, data: bytes) -> bool:
        """Store the config of a new store unless one is stored; whether this call did."""
        return self.backend.put_if_absent(CONFIG_KEY, data)

    def replace_config(self, data: bytes) -> None:
        self.backend.put(CONFIG_KEY, data)

    def holds_objects(self, *besides: Kind[IdT]) -> bool:
        """Whether the location holds an object other than the config and those of
        ``besides`` (stops at the first it lists)."""
        for key in self.backend.list(""):
            if key != CONFIG_KEY and not any(key.startswith(kind.prefix) for kind in besides):
                return True
        return False

    def is_empty(self) -> bool:
        """Whether the location holds no object at all (of any kind, or another tool's)."""
        return next(iter(self.backend.list("")), None) is None

    # --- the location ----------------------------------------------------------------------

    def local_path(self) -> str | None:
        """The root directory of a local store, else None."""
        return self.backend.local_path()

    def close(self) -> None:
        self.backend.close()
