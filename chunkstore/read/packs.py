"""Packs: many small chunk objects stored as one object (docs/format.md §3.5).

A pack is an ordinary chunk object (codec ``pack``) under ``chunks/<digest of
its content>``; its content is complete member chunk objects laid end to end.
A manifest lists, for a packed chunk, the pack and the member's offset and
length; everything that walks manifests for the objects a version needs (GC's
mark, the index's references, ``index rebuild``, ``verify``) sees the pack,
never the member, so packs are kept, claimed, fenced, condemned and deleted
exactly as any chunk object, with no change to that protocol.

A save packs the small chunks it must write:

1. the caller claims a batch of small chunks in one index transaction
   (:meth:`Index.claim_small`): a chunk stored as an object of its own is
   claimed as today; a chunk this index saw inside a pack gets the **pack**
   claimed (a member is not an object and is never claimed); the rest are
   written;
2. a worker reuses a claimed chunk or pack only through the writer's
   ``_reusable`` (fence wait, index claim, existence check), exactly as a
   dedup hit on any object; a pack it may not reuse makes it write the
   member again, into a new pack;
3. members to write are encoded in the workers and appended to the open pack
   in the order the caller handed them out (:class:`PackBuilder`), so a save
   of the same state writes the same packs; a pack is sealed at
   :data:`chunkstore.handle.handle.PACK_TARGET_BYTES` and at commit, its digest claimed like any
   chunk's, and written with put-if-absent;
4. the version lists each member's location; the index remembers the
   locations of standalone members (a dedup cache only: a missing entry
   means "write it again").

In a store with delta chains the chunks of larger tensors are packed too
(chunk format 5), each a delta where that pays: a delta member lists its
chain and where each base lies, and its bases (members of older packs, or
objects) are claimed as every reused object is, its pack for a packed base.
A delta member is reused only with the chain a manifest lists for it (the
parent's), never through the index, which knows no chains.

Why reusing a member of an older pack is safe while a GC may delete that
pack: the save references the pack P, claims P and checks the fence and the
store for P exactly as a dedup hit on a chunk object P, and its version lists
P among the objects it needs.  So the argument of :mod:`chunkstore.maintenance.gc` holds
with X = P word for word: either the GC waited for this save (step 6) and
marks P through the published version (step 7), or the save read the GC's
entry and does not reuse P (it writes the member again, into a new pack).  A
member's bytes are never reached except through P's key, which is what GC
deletes and what the save protects; nothing is deleted member by member.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from chunkstore.backends.local import populate_mapped
from chunkstore.codecs import PACK
from chunkstore.errors import ChunkStoreError, CorruptChunkError
from chunkstore.format.chunkobj import (
    HEADER,
    MAX_PAYLOAD_OVERHEAD,
    ChunkHeader,
    decode_object,
    decode_payload,
    parse_header,
)
from chunkstore.format.digest import DIGEST_SIZE, PLAIN_IDS, ChunkIds, Digest
from chunkstore.format.manifest import MAX_PACK_BYTES, PackLocation
from chunkstore.handle.caches import BaseCache
from chunkstore.handle.handle import PACK_TARGET_BYTES
from chunkstore.objects.objectstore import PackEncoding
from chunkstore.read.chain import decode_chain
from chunkstore.read.members import (
    NO_CHAIN,
    PAGED_BYTES,
    PAGING,
    READ_RUN_BYTES,
    Chain,
    MemberRead,
    Prefetched,
    check_listed_length,
    forward_members,
    fresh_on_miss,
    member_header,
    member_span,
    page_in,
    page_out,
    read_runs,
)
from chunkstore.read.scratch import member_buffer

if TYPE_CHECKING:
    from chunkstore.handle.handle import StoreHandle


def chunks_fit_in_packs(chunk_bytes: int, member_length: Callable[[int], int] | None = None
                        ) -> bool:
    """Whether every object a chunk of ``chunk_bytes`` can be encoded to (its header,
    a base's key and a payload of at most its bytes plus a codec's framing), as a
    location lists it (``member_length``: sealed on its own, in a store of version 13),
    fits in a pack; the chunks of a store whose chunk size is close to the largest are
    objects of their own."""
    longest = HEADER.size + DIGEST_SIZE + chunk_bytes + MAX_PAYLOAD_OVERHEAD
    return (longest if member_length is None else member_length(longest)) <= MAX_PACK_BYTES


class PackSlot:
    """Where a member lies (filled in when its pack is sealed) and the delta chain it
    lists; ``new``: a member this save writes, not one it reuses."""

    __slots__ = ("chain", "location", "new")

    def __init__(self, location: PackLocation | None = None, chain: Chain | None = None, *,
                 new: bool = False) -> None:
        self.location = location
        self.chain = NO_CHAIN if chain is None else chain
        self.new = new


#: A member object as the writer encoded it: its header bytes and its payload.
Member = tuple[bytes, bytes | memoryview]
#: The members of one pack once it is full: (digest, offset, length, raw length) each (in
#: the coordinates of pack locations), each member's pieces, their length in those
#: coordinates, and the members' bytes.
_Sealed = tuple[list[tuple[Digest, int, int, int]], list[tuple[Digest, list[bytes | memoryview]]],
                int, int]


#: Encoded members a save holds back waiting for an earlier one (at least; four packs'
#: worth with a large pack size) before it packs them out of order.
WAITING_BYTES = 64 << 20


class PackBuilder:
    """Collects a save's members in the order they were handed out; seals packs.

    ``write(digest, pack)`` stores one sealed pack object, given as its header and its
    members (each its chunk id and its header and payload), claimed, put-if-absent, and
    returns the bytes written.  ``member_length`` gives the length a location lists for
    a member object (in an encrypted store of version 13, its stored length: locations
    count stored bytes there).  Thread-safe: workers add members as they finish
    encoding; the worker that fills a pack hashes and writes it outside the lock,
    one copy of the bytes in all (the object layer's join, or in an encrypted store
    its sealing, which reads the pieces in place).
    """

    def __init__(self, write: Callable[[Digest, PackEncoding], int],
                 target: int = PACK_TARGET_BYTES, waiting_bytes: int | None = None,
                 ids: ChunkIds = PLAIN_IDS,
                 member_length: Callable[[int], int] | None = None) -> None:
        self._write = write
        self._member_length = member_length
        self._ids = ids  # packs are named as the store names chunks
        self._target = target
        self._lock = threading.Lock()
        self._reserved = 0
        self._next = 0
        self._waiting: dict[int, tuple[Digest, Member | None, int, Chain]] = {}
        #: encoded bytes held in ``_waiting``; past ``_waiting_limit`` (an early member
        #: stalls), the members waiting are packed out of order, so that what a save
        #: holds stays bounded; the places they leave are skipped when reached
        self._waiting_size = 0
        self._waiting_limit = (max(4 * target, WAITING_BYTES) if waiting_bytes is None
                               else waiting_bytes)
        self._early: set[int] = set()
        self._parts: list[tuple[Digest, list[bytes | memoryview]]] = []
        self._size = 0
        self._content = 0  # the members' bytes (``_size`` is in location coordinates)
        self._open: list[tuple[Digest, int, int, int]] = []
        self._slots: dict[Digest, PackSlot] = {}
        self._placed: set[Digest] = set()
        #: where each member this save wrote lies (for the index)
        self.written: dict[Digest, PackLocation] = {}
        #: (pack digest, content bytes, object bytes written) of each pack
        self.packs: list[tuple[Digest, int, int]] = []
        #: raw bytes of the members of the packs written (not of a pack found stored)
        self.member_raw_bytes = 0

    def reserve(self) -> int:
        """A place in the pack order (the caller's thread, in the order of the state)."""
        with self._lock:
            self._reserved += 1
            return self._reserved - 1

    def add(self, seq: int, digest: Digest, member: Member | None, raw_length: int,
            chain: Chain = NO_CHAIN) -> PackSlot | None:
        """Hand over place ``seq``: a member object to pack (a delta lists ``chain``),
        or None (nothing to write).  Returns the member's slot: when one chunk is
        handed over twice, it is packed once, and both get the slot of the member
        packed (its location and chain: the encodings may differ)."""
        with self._lock:
            self._waiting[seq] = (digest, member, raw_length, chain)
            if member is not None:
                self._waiting_size += len(member[0]) + len(member[1])
            slot = (self._slots.setdefault(digest, PackSlot(new=True)) if member is not None
                    else None)
            sealed = self._drain()
        for pack in sealed:
            self._store(pack)
        return slot

    def finish(self) -> None:
        """Seal and write the last pack; every place must have been handed over."""
        with self._lock:
            if self._next != self._reserved:
                raise RuntimeError(f"{self._reserved - self._next} pack members never arrived")
            sealed = [self._seal()] if self._parts else []
        for pack in sealed:
            self._store(pack)

    def _drain(self) -> list[_Sealed]:
        sealed: list[_Sealed] = []
        while self._next in self._waiting or self._next in self._early:
            if self._next in self._early:  # packed ahead of its turn
                self._early.remove(self._next)
                self._next += 1
                continue
            self._place(self._waiting.pop(self._next), sealed)
            self._next += 1
        if self._waiting_size > self._waiting_limit:
            for seq in sorted(self._waiting):
                self._place(self._waiting.pop(seq), sealed)
                self._early.add(seq)
        return sealed

    def _place(self, waiting: tuple[Digest, Member | None, int, Chain],
               sealed: list[_Sealed]) -> None:
        """Put one member into the open pack (sealing packs that fill)."""
        digest, member, raw_length, chain = waiting
        if member is not None:
            self._waiting_size -= len(member[0]) + len(member[1])
        if member is None or digest in self._placed:
            return  # the same chunk twice in one save: packed once
        self._placed.add(digest)
        self._slots[digest].chain = chain
        length = len(member[0]) + len(member[1])
        located = length if self._member_length is None else self._member_length(length)
        if located > MAX_PACK_BYTES:  # the writer packs only chunks_fit_in_packs
            raise ValueError(f"a member of {length} bytes cannot be packed")
        if self._open and self._size + located > MAX_PACK_BYTES:
            sealed.append(self._seal())  # no location may end past MAX_PACK_BYTES
        self._open.append((digest, self._size, located, raw_length))
        self._parts.append((digest, list(member)))
        self._size += located
        self._content += length
        if self._size >= self._target:
            sealed.append(self._seal())

    def _seal(self) -> _Sealed:
        sealed = (self._open, self._parts, self._size, self._content)
        self._parts, self._open, self._size, self._content = [], [], 0, 0
        return sealed

    def _store(self, pack: _Sealed) -> None:
        members, parts, size, content = pack
        header = ChunkHeader(PACK.id, 1, content, content).pack()
        pack_digest = self._ids.of_pieces([piece for _, pieces in parts for piece in pieces])
        written = self._write(pack_digest, PackEncoding(header, parts))
        with self._lock:
            for digest, offset, length, _ in members:
                location = PackLocation(pack_digest, offset, length)
                self._slots[digest].location = location
                self.written[digest] = location
            self.packs.append((pack_digest, size, written))
            if written:
                self.member_raw_bytes += sum(raw for *_, raw in members)


#: A run's packed bases are read ahead up to this many bytes in all (the rest one by one,
#: as before), so a run of deep chains, or a manifest that lists them, holds at most this
#: much besides the run itself.
PREFETCH_BYTES = 2 * READ_RUN_BYTES


def read_member_into(store: StoreHandle, digest: Digest, location: PackLocation, out: memoryview,
                     *, check_links: bool = False, chain: Chain = NO_CHAIN,
                     cache: BaseCache | None = None) -> None:
    """Fill ``out`` with packed chunk ``digest``, read by range from its pack and
    checked as the member object it is (header, length, decode through its listed
    ``chain``, hash).  The pack's own header is not needed, and not read: damage to
    it is what :func:`pack_header_problem` reports.

    ``check_links`` (verify): every base of a delta is hash-checked on its own, so
    a damaged base is named.  A pack GC repacked is followed through its moved
    record (:mod:`chunkstore.protocol.moved`).
    """
    read_members_into(store, [(digest, location, out, chain)], cache=cache,
                      check_links=check_links)


def prefetch_bases(store: StoreHandle, members: list[MemberRead], cache: BaseCache | None
                   ) -> Prefetched:
    """The member objects of the packed bases that ``members``' listed chains need (and
    that ``cache`` does not hold decoded), fetched with one ranged read per run of
    neighbours, as the members themselves are: a chain of depth d then costs a few
    reads per run of chunks, not d per chunk (on an object store, d requests).  Each
    is bounded by its chunk's raw length before anything is read, and all of them by
    :data:`PREFETCH_BYTES` (what does not fit is read when it is used); a pack that is
    gone is left out, so its bases are read one by one where its moved record says;
    every object taken from here is checked when it is used (:func:`member_object`)."""
    cache = store.base_cache if cache is None else cache
    wanted: dict[PackLocation, MemberRead] = {}
    for _, _, out, (bases, locations) in members:
        for base, at in zip(bases, locations, strict=False):
            if cache.get(base) is not None:
                break  # decoded already: the deeper bases are not read
            if at is not None and at not in wanted:
                check_listed_length(store, base, at, len(out))
                wanted[at] = (base, at, out, NO_CHAIN)
    found: Prefetched = {}
    budget = PREFETCH_BYTES  # the bytes read, gaps between neighbours included
    for run in read_runs(list(wanted.values())):
        start, end = member_span(run)
        if end - start > budget:
            continue
        budget -= end - start
        try:
            data = memoryview(store.objects.member_range(run[0][1].pack, start, end - start,
                                                         populate=False))
        except FileNotFoundError:
            continue
        for _, location, _, _ in run:
            found[location] = data[location.offset - start :
                                   location.offset - start + location.length]
    return found


def read_members_into(store: StoreHandle, members: list[MemberRead], hops: int = 0, *,
                      cache: BaseCache | None = None, check_links: bool = False,
                      transient: bool = False) -> None:
    """Read members of one pack with one ranged read (they lie close together: see
    :func:`read_runs`), then check and decode each as :func:`read_member_into` does.
    Members of a pack GC repacked are read where its moved record says.

    ``transient`` (a read job of :func:`chunkstore.read.reader.run_jobs`, which
    releases them): a delta chain's links before the last are decoded into the
    thread's scratch buffers (:mod:`chunkstore.read.scratch`)."""
    pack = members[0][1].pack
    for digest, location, out, _ in members:  # bounded before anything is read
        check_listed_length(store, digest, location, len(out))
    start, end = member_span(members)
    try:  # a mapped run is populated and released member by member (each with its bases)
        data = memoryview(store.objects.member_range(pack, start, end - start, populate=False))
    except FileNotFoundError:
        def forwarded() -> None:
            for run in read_runs(forward_members(store, members, hops)):
                read_members_into(store, run, hops + 1, cache=cache, check_links=check_links,
                                  transient=transient)
        if hops:
            forwarded()
        else:  # where the pack went, read afresh if a cached record leads nowhere
            fresh_on_miss(store, forwarded)
        return
    prefetched = prefetch_bases(store, members, cache)
    for digest, location, out, chain in members:
        begin = location.offset - start
        member = data[begin : begin + location.length]
        _decode_member(store, digest, location, member, out, chain, cache, check_links,
                       prefetched, transient=transient)
        page_out(member)
        for at in chain[1]:  # its bases read ahead (populated as they were used)
            base = None if at is None else prefetched.get(at)
            if base is not None:
                page_out(base)


def copy_members(store: StoreHandle, pack: Digest, members: list[tuple[Digest, int, int]]
                 ) -> list[tuple[bytes, bytes]]:
    """The member objects at (digest, offset, length) of ``pack``, each checked as a
    read checks it (so a repack never copies damage), and the bytes the location
    names (in an encrypted store of version 13 the member sealed on its own, which a
    repack copies unchanged; elsewhere the same bytes): the bytes to pack again.  A
    delta member is checked as far as it can be without its bases (header, length,
    its payload decodes): its bytes are copied unchanged, and a read through its
    chain still hash-checks them."""
    reads: list[MemberRead] = [(digest, PackLocation(pack, offset, length),
                                memoryview(bytearray(0)), NO_CHAIN)
                               for digest, offset, length in members]
    copied: dict[tuple[int, int], tuple[bytes, bytes]] = {}
    for run in read_runs(reads):
        start, end = member_span(run)
        data = memoryview(store.objects.member_range(pack, start, end - start))
        for digest, location, _, _ in run:
            stored = data[location.offset - start : location.offset - start + location.length]
            member = store.objects.open_member(digest, location, stored)
            header = member_header(digest, member)
            out = memoryview(bytearray(header.raw_length))
            if header.base is None:
                _decode_opened(store, digest, member, out, NO_CHAIN, None, False)
            else:
                _check_member_length(digest, member, header, out)
                decode_payload(digest, header, member, out)
            copied[(location.offset, location.length)] = (bytes(member), bytes(stored))
    return [copied[(offset, length)] for _, offset, length in members]


def _check_member_length(digest: Digest, data: memoryview, header: ChunkHeader,
                         out: memoryview) -> None:
    if header.raw_length != len(out):
        raise CorruptChunkError(digest.hex, f"holds {header.raw_length} bytes, the manifest"
                                f" expects {len(out)}")
    if header.size + header.payload_length != len(data):
        raise CorruptChunkError(digest.hex, f"member object is {len(data)} bytes, its header"
                                f" says {header.size + header.payload_length}")


def _decode_member(store: StoreHandle, digest: Digest, location: PackLocation, data: memoryview,
                   out: memoryview, chain: Chain, cache: BaseCache | None,
                   check_links: bool, prefetched: Prefetched | None = None, *,
                   transient: bool = False) -> None:
    """Decode the member ``data`` (the bytes ``location`` names) into ``out``: opened
    by the object layer's one path for members (``transient``: a sealed one into the
    thread's scratch buffer), then checked and decoded.  Mapped bytes are populated as
    they are read: a sealed member's part by part as it is opened (each part released
    once opened), one listed with no chain all at once, a delta's header here and its
    payload as it is decoded (link by link, with its bases)."""
    if store.objects.sealed_members:  # opened part by part, its stored pages released
        opened = store.objects.open_member(digest, location, data,
                                           member_buffer(0) if transient else None, PAGING)
    else:
        populate_mapped(data if not chain[0] or len(data) < PAGED_BYTES
                        else data[:HEADER.size + DIGEST_SIZE])
        opened = store.objects.open_member(digest, location, data)
    _decode_opened(store, digest, opened, out, chain, cache, check_links, prefetched,
                   transient=transient)


def _decode_opened(store: StoreHandle, digest: Digest, data: memoryview, out: memoryview,
                   chain: Chain, cache: BaseCache | None, check_links: bool,
                   prefetched: Prefetched | None = None, *, transient: bool = False) -> None:
    header = member_header(digest, data)
    _check_member_length(digest, data, header, out)
    if header.base is None:
        if chain[0]:  # listed with a chain, yet standalone: maybe populated only in part
            page_in(data)
        decode_object(digest, data, out, header=header, ids=store.objects.chunk_ids)
        return
    bases, locations = chain
    decode_chain(store, digest, data, bases, out, cache, check_links=check_links,
                 locations=locations, prefetched=prefetched, transient=transient)


def pack_header_problem(store: StoreHandle, pack: Digest) -> str | None:
    """What is wrong with a pack object as a whole (its header, its length), or None.

    Reads never use a pack's header (each member is read by its listed range and
    checked by its own header and hash), so this is a warning for ``verify``: the
    members still read back whole.  ``FileNotFoundError`` when the pack is gone.
    """
    try:
        head = store.objects.pack_head(pack)
        header = parse_header(pack, head.header)
    except ChunkStoreError as exc:  # damaged, or a format version no release wrote
        return str(exc)
    if header.codec_id != PACK.id or header.raw_length != header.payload_length:
        return f"pack {pack.hex[:16]}: listed as a pack, but its header is not a pack's"
    if head.content != header.payload_length:
        return (f"pack {pack.hex[:16]}: the object holds {head.content} bytes of members,"
                f" its header says {header.payload_length} (truncated or padded)")
    return None
