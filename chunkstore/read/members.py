"""Pack members: where a packed chunk lies and its member object, bounded and checked.

The lowest part of reading packs (docs/format.md §3.5), below delta chains
(:mod:`chunkstore.read.chain` reads packed bases through :func:`member_object`) and
the pack readers and builder (:mod:`chunkstore.read.packs`): a member's listed
length is bounded before anything is read, a pack GC repacked is followed through
its moved record (:mod:`chunkstore.protocol.moved`), and reads of neighbouring
members are grouped into runs, one ranged read each.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from chunkstore import codecs
from chunkstore.backends.local import populate_mapped, release_mapped
from chunkstore.codecs import PACK
from chunkstore.errors import CorruptChunkError, MissingChunkError
from chunkstore.format.chunkobj import (
    DELTA_MEMBERS_SINCE,
    HEADER,
    MAX_PAYLOAD_OVERHEAD,
    ChunkHeader,
    parse_header,
)
from chunkstore.format.digest import DIGEST_SIZE, Digest
from chunkstore.format.manifest import PackLocation
from chunkstore.index.lmdbindex import CHUNK
from chunkstore.objects.kinds import CHUNKS
from chunkstore.objects.objectstore import MemberBuffer, Paging
from chunkstore.protocol.moved import MAX_HOPS, read_moved

if TYPE_CHECKING:
    from chunkstore.handle.handle import StoreHandle


_T = TypeVar("_T")
#: Where each base of a chain lies inside a pack (None: an object of its own), in chain
#: order; empty when every base is an object of its own.
Locations = tuple[PackLocation | None, ...]
#: Member objects of packed bases a reader read ahead, by listed location
#: (:func:`chunkstore.read.packs.prefetch_bases`; mapped ones unpopulated until used).
Prefetched = dict[PackLocation, memoryview]
#: A member's listed delta chain and where each base lies (empty for a standalone one).
Chain = tuple[tuple[Digest, ...], Locations]
NO_CHAIN: Chain = ((), ())
#: A packed chunk to read: its digest, location, the caller's buffer for it and its
#: listed delta chain.
MemberRead = tuple[Digest, PackLocation, memoryview, Chain]


#: Neighbouring members of one pack are read together when the gap between them is
#: at most this (bytes read for nothing) and the whole read at most READ_RUN_BYTES.
READ_GAP_BYTES = 64 * 1024
READ_RUN_BYTES = 8 * 1024 * 1024
#: ... and while the bytes they decode to are at most this: a run is one read job, and
#: deltas that compress well (sparse updates of an embedding table: 260 MB decoded from
#: one 8 MiB read) would otherwise leave every core but one idle.
READ_RUN_RAW_BYTES = 8 * 1024 * 1024


#: A mapped member or base of at least this many bytes, read ahead unpopulated, is
#: populated as it is decoded (a delta's header first) and released once applied
#: (:func:`page_in`, :func:`page_out`); a smaller one is populated whole where it is
#: first met and kept until its run is done: a few system calls per object would cost
#: more than its pages (a sparse delta's chain of nine links of a few KiB each).
PAGED_BYTES = 256 * 1024
#: A sealed member mapped unpopulated is opened part by part, each part's pages
#: populated just before and released just after (a read error raised, never met as
#: SIGBUS): only the opened bytes stay resident, not the stored ones beside them.
PAGING: Paging = (populate_mapped, release_mapped)


def page_in(view: bytes | memoryview) -> None:
    """Populate a member object or base of :data:`PAGED_BYTES` or more where it is
    mapped, before it is decoded (a smaller one was populated whole where first met)."""
    if len(view) >= PAGED_BYTES:
        populate_mapped(view)


def page_out(view: bytes | memoryview) -> None:
    """Release a member object or base of :data:`PAGED_BYTES` or more where it is
    mapped, once it is decoded or applied."""
    if len(view) >= PAGED_BYTES:
        release_mapped(view)


def missing_chunk(store: StoreHandle, digest: Digest) -> MissingChunkError:
    """The error for a chunk found missing; the index stops offering it for dedup."""
    store.index.forget_missing(CHUNK, digest)
    return MissingChunkError(digest.hex)


def fresh_on_miss(store: StoreHandle, attempt: Callable[[], _T]) -> _T:
    """Run ``attempt``; where it finds a chunk missing while moved records were taken
    from the handle's cache, forget the cache and run it once more.  A moved record
    is written once, but GC deletes it once nothing reaches its pack, and a later
    repack of the same pack (stored again since) writes another: a long-lived
    handle's cached record may lead to a pack that is gone."""
    cached = bool(store.moved_cache)
    try:
        return attempt()
    except MissingChunkError:
        if not cached:
            raise
        store.moved_cache.clear()
        return attempt()


def member_object(store: StoreHandle, digest: Digest, location: PackLocation, raw_length: int,
                  prefetched: Prefetched | None = None, buffer: MemberBuffer | None = None,
                  *, paged: bool = False) -> memoryview:
    """The member object of packed chunk ``digest`` at ``location`` (a base to decode,
    of ``raw_length`` raw bytes): bounded by that length before it is read, taken from
    ``prefetched`` (:func:`chunkstore.read.packs.prefetch_bases`) or read by range,
    following moved records, its header and length checked; a sealed member opened into
    ``buffer`` where given (:meth:`~chunkstore.objects.objectstore.ObjectStore.open_member`).

    A member read ahead into a mapping is populated here (a read error raised, not met
    as SIGBUS), all of it, or with ``paged`` (one of :data:`PAGED_BYTES` or more) only
    its header: the caller populates its payload when it decodes it (:func:`page_in`)
    and releases it after (:func:`page_out`), so a chain's bases are not all resident
    at once."""
    return fresh_on_miss(store, lambda: _member_object(store, digest, location, raw_length,
                                                       prefetched, buffer, paged))


def _member_object(store: StoreHandle, digest: Digest, location: PackLocation,
                   raw_length: int, prefetched: Prefetched | None,
                   buffer: MemberBuffer | None, paged: bool = False) -> memoryview:
    for hops in range(MAX_HOPS + 1):
        check_listed_length(store, digest, location, raw_length)
        found = None if prefetched is None else prefetched.get(location)
        if found is not None and store.objects.sealed_members:  # opened part by part
            return checked_member(store, digest, location, found, buffer, paging=PAGING)
        if found is not None:
            if paged and len(found) >= PAGED_BYTES:
                populate_mapped(found[:HEADER.size + DIGEST_SIZE])  # the payload: page_in
                return checked_member(store, digest, location, found, buffer)
            populate_mapped(found)
            return checked_member(store, digest, location, found, buffer)
        sealed = store.objects.sealed_members
        try:
            data = store.objects.member_range(location.pack, location.offset, location.length,
                                              populate=not sealed)
        except FileNotFoundError:
            ((_, location, _, _),) = forward_members(store, [(digest, location, memoryview(b""),
                                                       NO_CHAIN)], hops)
            continue
        return checked_member(store, digest, location, data, buffer,
                              paging=PAGING if sealed else None)
    raise AssertionError("unreachable: forward_members refuses the hop after the last")


def checked_member(store: StoreHandle, digest: Digest, location: PackLocation,
                   data: bytes | memoryview, buffer: MemberBuffer | None = None,
                   paging: Paging | None = None) -> memoryview:
    """The member object read at ``location`` (the bytes its location names, opened by
    the object layer's one path for members, into ``buffer`` where given; ``paging``:
    see :meth:`~chunkstore.objects.objectstore.ObjectStore.open_member`), its length
    and header checked."""
    data = store.objects.open_member(digest, location, data, buffer, paging)
    header = member_header(digest, data)
    if header.size + header.payload_length != len(data):
        raise CorruptChunkError(digest.hex, f"member object is {len(data)} bytes, its"
                                f" header says {header.size + header.payload_length}")
    return data


def locate_member(store: StoreHandle, digest: Digest, location: PackLocation) -> PackLocation:
    """Where a packed chunk lies now: its listed location while that pack exists, else
    where the moved records say (a missing chunk when they say nothing).  Only to
    name or count the pack: a read of the member goes through :func:`at_member`."""
    def found(at: PackLocation) -> PackLocation:
        store.objects.stat(CHUNKS, at.pack)
        return at

    return at_member(store, digest, location, found)


def at_member(store: StoreHandle, digest: Digest, location: PackLocation,
              read: Callable[[PackLocation], _T]) -> _T:
    """``read`` of packed chunk ``digest`` at ``location``, or, where it finds the pack
    missing (``FileNotFoundError``), at the location the moved records give.  A read
    never looks for the pack first: a GC's repack deletes a pack that live versions
    list once its moved record is stored, so a pack found may be gone by the read."""
    return fresh_on_miss(store, lambda: _at_member(store, digest, location, read))


def _at_member(store: StoreHandle, digest: Digest, location: PackLocation,
               read: Callable[[PackLocation], _T]) -> _T:
    for hops in range(MAX_HOPS + 1):
        try:
            return read(location)
        except FileNotFoundError:
            ((_, location, _, _),) = forward_members(store, [(digest, location, memoryview(b""),
                                                       NO_CHAIN)], hops)
    raise AssertionError("unreachable: forward_members refuses the hop after the last")


def forward_members(store: StoreHandle, members: list[MemberRead], hops: int) -> list[MemberRead]:
    """The members of a missing pack where its moved record puts them; a pack with no
    record, or a member it does not list, is a missing chunk."""
    pack = members[0][1].pack
    if hops >= MAX_HOPS:
        raise CorruptChunkError(pack.hex, f"moved more than {MAX_HOPS} times (a cycle of"
                                " moved records?)")
    record = store.moved_cache.get(pack) or read_moved(store.objects, pack)
    if record is None:
        raise missing_chunk(store, pack)
    store.moved_cache[pack] = record
    moved = []
    for digest, location, out, chain in members:
        new = record.forward(location)
        if new is None:
            raise missing_chunk(store, pack)
        moved.append((digest, new, out, chain))
    return moved


def check_listed_length(store: StoreHandle, digest: Digest, location: PackLocation,
                        raw_length: int) -> None:
    """A member listed longer than any object of ``raw_length`` raw bytes can be is
    refused before anything is read (a crafted manifest or moved record could
    otherwise make a reader fetch and allocate up to a whole pack)."""
    if location.length > store.objects.member_length(
            HEADER.size + DIGEST_SIZE + raw_length + MAX_PAYLOAD_OVERHEAD):
        raise CorruptChunkError(digest.hex, f"listed as {location.length} bytes in pack"
                                f" {location.pack.short()}, too long for {raw_length} raw"
                                " bytes")


def member_header(digest: Digest, data: memoryview) -> ChunkHeader:
    """A member's header, checked: never a pack, and a delta only from chunk format
    version 5."""
    header = parse_header(digest, data)
    codec = codecs.by_id(header.codec_id)
    if codec is None or codec is PACK:
        raise CorruptChunkError(digest.hex, "a pack member is never a pack")
    if (header.base is not None or codec.needs_base) and header.version < DELTA_MEMBERS_SINCE:
        raise CorruptChunkError(digest.hex, f"a pack member of chunk format {header.version}"
                                " is never a delta")
    return header


def read_runs(members: list[MemberRead]) -> list[list[MemberRead]]:
    """Group packed chunk reads into runs, each one ranged read of one pack: members
    of a pack sorted by offset, split where the gap or the run grows too large, or
    the bytes its members decode to (their buffers) pass :data:`READ_RUN_RAW_BYTES`."""
    by_pack: dict[Digest, list[MemberRead]] = {}
    for member in members:
        by_pack.setdefault(member[1].pack, []).append(member)
    runs: list[list[MemberRead]] = []
    for group in by_pack.values():
        group.sort(key=lambda m: m[1].offset)
        run: list[MemberRead] = []
        run_start = run_end = run_raw = 0
        for member in group:
            location = member[1]
            if run and (location.offset > run_end + READ_GAP_BYTES
                        or location.offset + location.length - run_start > READ_RUN_BYTES
                        or run_raw + len(member[2]) > READ_RUN_RAW_BYTES):
                runs.append(run)
                run = []
            if not run:
                run_start = run_end = location.offset
                run_raw = 0
            run.append(member)
            run_end = max(run_end, location.offset + location.length)
            run_raw += len(member[2])
        runs.append(run)
    return runs


def member_span(members: list[MemberRead]) -> tuple[int, int]:
    """The byte range of a pack's content that holds ``members``: (start, end)."""
    return (min(location.offset for _, location, _, _ in members),
            max(location.offset + location.length for _, location, _, _ in members))
