"""The objects of one version, copied from one store into another as a save writes them.

:mod:`chunkstore.maintenance.sync` runs the whole copy; this module decides, for one
version, which of the objects it needs the destination lacks, and copies those.  Every
decision to leave an object uncopied is a deduplication decision of the destination's
save-session protocol (docs/format.md §11.1), taken exactly as
:mod:`chunkstore.write.reuse` takes it for a save: wait out an active GC entry that
names the object (and then copy it), claim it in the destination's index (only a LIVE
record may be reused), and check that it exists where a check is due.  A tree node the
destination holds and a published version there counts (refcount above zero) stands
for its whole subtree: nothing below it is read, claimed or checked.

An object the destination holds already, but that this sync may not reuse unseen, is
kept only when it is the source's bytes or a standalone object that decodes and
hashes to its key; otherwise it is replaced by a standalone encoding of the same
bytes, the one replacement docs/format.md §3.4 allows (a delta there against another
base would not be what the copied manifest lists).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from chunkstore import codecs
from chunkstore.errors import (
    BackendError,
    ChunkStoreError,
    CorruptChunkError,
    CorruptNodeError,
    MissingChunkError,
)
from chunkstore.format.chunkobj import HEADER, ChunkHeader, decode_object, parse_header
from chunkstore.format.digest import DIGEST_SIZE, Digest
from chunkstore.format.manifest import DataEntry, PackLocation, TensorEntry, decode_data
from chunkstore.handle.tree import load_tree
from chunkstore.index.gclock import finish_abandoned_deletions
from chunkstore.index.lmdbindex import CHUNK, NODE, Claim, NewChunk
from chunkstore.objects.kinds import CHUNKS, MOVED, NODES, DigestKind
from chunkstore.protocol.moved import MAX_HOPS, MovedRecord, read_moved
from chunkstore.read.chain import decode_chain

if TYPE_CHECKING:
    from chunkstore.handle.handle import StoreHandle
    from chunkstore.protocol.journal import Fence

DELETING_WAIT_S = 120.0
#: A pack the source holds is copied as the members the copied versions list in it (a
#: new pack and a moved record, as a repack writes them) when those are less than this
#: share of its content: the rest are leftovers of versions the source removed, and a
#: version moved into an empty store then costs about its own stored bytes.
COMPACT_BELOW = 0.9

#: In ``planned``: a pack this sync copied as a new pack and a moved record, for the
#: versions after the one that copied it (they read it through the same record).
COMPACTED = b"compacted"
#: Per pack, the members (offset, length) the versions being copied list in it.
Spans = dict[Digest, set[tuple[int, int]]]
#: A member a copied version lists in a pack, as a read of it needs it: the chunk, where
#: it lies in the pack, its listed chain and where each base lies.
Member = tuple[Digest, int, int, tuple[Digest, ...], tuple[PackLocation | None, ...]]

#: What a read of a chunk object needs of it: its listed chain and where each base lies
#: (a standalone chunk: both empty), or None for a pack (content-addressed by its
#: content, so every copy of it holds the same members).
Need = tuple[tuple[Digest, ...], tuple[PackLocation | None, ...]] | None


@dataclass
class Copied:
    """What copying one version moved."""

    objects: int = 0
    bytes: int = 0
    present: int = 0  # referenced objects the destination had (checked, not copied)
    subtrees_present: int = 0  # tree nodes standing for a whole subtree there
    new_chunks: list[NewChunk] = field(default_factory=list)
    node_sizes: dict[Digest, int] = field(default_factory=dict)
    moved: list[Digest] = field(default_factory=list)  # moved records written


class VersionCopy:
    """Copies the objects of one version (``dst`` None: a dry run into an empty store)."""

    def __init__(self, src: StoreHandle, dst: StoreHandle | None, *, session: str | None,
                 fence: Fence | None, planned: set[tuple[bytes, Digest]] | None = None,
                 spans: Spans | None = None) -> None:
        self.src, self.dst = src, dst
        #: what the versions of this sync list in each pack (:func:`add_spans`)
        self.spans = spans or {}
        #: a dry run's objects that earlier versions of the same sync would copy
        self.planned = planned if planned is not None else set()
        self.session, self.fence = session, fence  # None: a dry run, nothing is written
        # As a save: a reused object is checked to exist at every reuse on a local store
        # or where the journal could not be read, elsewhere once per store handle.
        self.check_all = dst is not None and (
            dst.objects.local_path() is not None or (fence is not None and fence.distrust_index))
        self.copied = Copied()
        self._lock = threading.Lock()  # the copy jobs count into ``copied`` at once
        #: per pack, the members the version lists in it (checked as a read checks them
        #: before the pack is copied; through a moved record, where it forwards them)
        self.members: dict[Digest, set[Member]] = {}
        self.data_nodes: set[Digest] = set()

    def _count(self, data: bytes, new_chunk: NewChunk | None = None, *,
               written: bool = True) -> None:
        """Count an object copied (``written``: else found whole in the destination)."""
        with self._lock:
            if written:
                self.copied.objects += 1
                self.copied.bytes += len(data)
            else:
                self.copied.present += 1
            if new_chunk is not None:
                self.copied.new_chunks.append(new_chunk)

    @property
    def dry_run(self) -> bool:
        return self.session is None

    def run(self, root: Digest) -> Copied:
        """Copy what the tree at ``root`` needs, chunks before the nodes naming them."""
        nodes, chunks = self._walk(root)
        self._copy_chunks(chunks)
        self._copy_nodes(nodes)
        return self.copied

    # --- what the version needs ------------------------------------------------------------

    def _walk(self, root: Digest) -> tuple[list[Digest], dict[Digest, Need]]:
        """The nodes and chunk objects the destination may lack: the tree from ``root``,
        without the subtrees the destination holds whole."""
        nodes: list[Digest] = []
        chunks: dict[Digest, Need] = {}
        stack, seen = [root], set()
        while stack:
            digest = stack.pop()
            if digest in seen:
                continue
            seen.add(digest)
            if self._subtree_present(digest):
                self.copied.subtrees_present += 1
                continue
            nodes.append(digest)
            node = load_tree(self.src.objects, digest, self.src.node_cache)
            for leaf in node.leaves.values():
                if isinstance(leaf, DataEntry):
                    nodes.append(leaf.digest)
                    self.data_nodes.add(leaf.digest)
                elif isinstance(leaf, TensorEntry):
                    add_needs(leaf, chunks)
                    add_members(leaf, self.members)
            stack.extend(node.children())
        return nodes, chunks

    def _subtree_present(self, digest: Digest) -> bool:
        """Whether the destination holds the node and everything below it: a version
        counted in there reaches it, and it may be reused as a save reuses a node."""
        if self.dry_run and (NODE, digest) in self.planned:
            return True
        if self.dst is None:
            return False
        record = self.dst.index.record(NODE, digest)
        if record is None or record.refcount <= 0:
            return False
        return digest in self._present(NODE, [digest])

    # --- the deduplication decision --------------------------------------------------------

    def _present(self, kind: bytes, digests: list[Digest]) -> set[Digest]:
        """Those of ``digests`` that may stay uncopied (see the module docstring)."""
        dst = self.dst
        if self.dry_run:  # what a sync would find: copied for an earlier version, or stored
            planned = {d for d in digests if (kind, d) in self.planned}
            rest = [d for d in digests if d not in planned]
            if dst is None or not rest:
                return planned
            # As the real run: only what the index claims is reused unread (an object it
            # does not know is written, or kept when it holds the same bytes: counted
            # when it is copied).
            rest = [d for d in rest if dst.index.record(kind, d) is not None]
            kind_of = CHUNKS if kind == CHUNK else NODES
            found = dst.executor.map(lambda d: dst.objects.exists(kind_of, d), rest)
            return planned | {d for d, ok in zip(rest, found, strict=True) if ok}
        if dst is None or not digests:
            return set()
        assert self.fence is not None and self.session is not None
        fenced = set()
        for digest in digests:  # every active entry naming it, before any claim
            while (blocker := self.fence.blocking(kind, digest)) is not None:
                self.fence.wait(blocker)
                fenced.add(digest)
        claims = self._claim(kind, digests)
        hits = [d for d in digests if claims[d] == Claim.DEDUP and d not in fenced]
        checks = [d for d in hits if self.check_all or not dst.seen_stored(kind, d)]
        kind_of = CHUNKS if kind == CHUNK else NODES
        missing = {d for d, ok in zip(checks, dst.executor.map(
            lambda d: dst.objects.exists(kind_of, d), checks), strict=True) if not ok}
        for digest in missing:
            dst.index.forget_missing(kind, digest)
        dst.saw_stored(kind, [d for d in checks if d not in missing])
        return {d for d in hits if d not in missing}

    def _claim(self, kind: bytes, digests: list[Digest]) -> dict[Digest, Claim]:
        """Claim in one transaction; an object a GC of this index is deleting is waited
        out (or a crashed GC's deletion finished) and claimed again."""
        assert self.dst is not None and self.session is not None
        index, session = self.dst.index, self.session
        claims = index.claim_many(session, kind, digests)
        deadline = time.monotonic() + DELETING_WAIT_S
        while waiting := [d for d, c in claims.items() if c == Claim.WAIT]:
            if time.monotonic() > deadline:
                raise BackendError(f"object {waiting[0].short()} has been in deletion by GC"
                                   f" for {DELETING_WAIT_S:.0f}s; is a GC run stuck?")
            finish_abandoned_deletions(index)
            time.sleep(0.02)
            claims.update(index.claim_many(session, kind, waiting))
        return claims

    def _compatible(self, digest: Digest, need: Need) -> bool:
        """Whether the destination's object of a chunk reads as the copied manifest lists
        it: standalone, or a delta against the listed first base (its index record says
        which codec; only a delta's header is read)."""
        assert self.dst is not None
        record = self.dst.index.record(CHUNK, digest)
        codec = codecs.by_id(record.codec_id) if record is not None else None
        if need is None or codec is None or not codec.needs_base:
            return True
        try:
            header = parse_header(digest, self.dst.objects.get_range(
                CHUNKS, digest, 0, HEADER.size + DIGEST_SIZE))
        except (FileNotFoundError, ChunkStoreError):
            return False
        return header.base is None or (bool(need[0]) and header.base == need[0][0])

    # --- copying ---------------------------------------------------------------------------

    def _copy_chunks(self, needs: dict[Digest, Need]) -> None:
        for hop in range(MAX_HOPS + 1):  # a missing pack's members: through its moved record
            digests = sorted(needs, key=lambda d: d.raw)
            # Compacted for an earlier version of this sync: read through its record (its
            # spans were every copied version's), under this sync's session.
            compacted = {d for d in digests if (COMPACTED, d) in self.planned}
            present = self._present(CHUNK, [d for d in digests if d not in compacted])
            if self.dst is not None and not self.dry_run:
                present = {d for d in present if self._compatible(d, needs[d])}
                self.copied.moved.extend(sorted(compacted, key=lambda d: d.raw))
            present |= compacted
            # What the version lists in a pack it finds in place is checked in the
            # source all the same: a new node's claims are read as a read reads them.
            listed = [d for d in present if needs[d] is None and self.members.get(d)]
            list(self._pool().map(self._check_listed_in_source, listed))
            self.copied.present += len(present)
            todo = [d for d in digests if d not in present]
            moved: dict[Digest, Need] = {}
            jobs = [(d, needs[d]) for d in todo]
            for digest, forwarded in zip(todo, self._pool().map(
                    lambda job: self._copy_chunk(*job), jobs), strict=True):
                if forwarded is not None:
                    moved[forwarded] = None
                    self.copied.moved.append(digest)
            if not moved:
                return
            if hop == MAX_HOPS:
                raise CorruptChunkError(todo[0].hex, f"more than {MAX_HOPS} moved records deep")
            needs = moved

    def _pool(self) -> ThreadPoolExecutor:
        return (self.dst or self.src).executor

    def _copy_chunk(self, digest: Digest, need: Need) -> Digest | None:
        """Copy one chunk object, checked first (:func:`checked_object`); for a pack the
        source no longer holds, its moved record instead, returning the pack the record
        moves it to (copied next)."""
        try:
            data = checked_object(self.src, digest, self.src.objects.get(CHUNKS, digest), need)
        except FileNotFoundError:
            if need is not None:
                raise MissingChunkError(digest.hex) from None
            return self._copy_moved(digest)
        if need is None:
            self._check_members(digest, data)
        compact = self._compacted(digest, data) if need is None else None
        if self.dst is None or self.dry_run:
            with self._lock:
                self.planned.add((CHUNK, digest))
                if compact is not None:
                    self.planned.add((COMPACTED, digest))
            self._count_planned(digest, data, need, compact)
            return None
        if compact is not None:
            self._put_compacted(digest, *compact)
            return None
        stored, written = self._put_chunk(digest, data, need)
        header = parse_header(digest, stored)
        raw, size = (self.dst.objects.pack_sizes(stored) if header.codec_id == codecs.PACK.id
                     else (header.raw_length, len(stored)))
        self._count(stored, NewChunk(digest, header.codec_id, raw, size), written=written)
        return None

    def _compacted(self, pack: Digest, data: bytes) -> tuple[Digest, bytes, bytes] | None:
        """The new pack and moved record that hold only the members this sync's versions
        list in ``pack`` (checked: ``data`` passed :func:`checked_object`), when they
        are less than :data:`COMPACT_BELOW` of it and the destination has no moved
        record of its own for ``pack``; else None (the pack is copied whole)."""
        if self.src.objects.sealed_members:
            return None  # spans count stored bytes there; the pack is copied whole
        spans = sorted(self.spans.get(pack, ()))
        content = len(data) - HEADER.size
        if not spans or len({offset for offset, _ in spans}) != len(spans) \
                or sum(length for _, length in spans) >= COMPACT_BELOW * content \
                or any(offset + length > content for offset, length in spans):
            return None
        members, parts, at = {}, [], 0
        for offset, length in spans:
            members[offset] = (length, at)
            parts.append(data[HEADER.size + offset:HEADER.size + offset + length])
            at += length
        body = b"".join(parts)
        new = self.src.objects.chunk_ids.of(body)
        record = MovedRecord(pack, new, members).encode()
        if self.dst is not None and self._stored(MOVED, pack, record) is False:
            return None  # a moved record of the destination's own: the pack goes whole
        return new, ChunkHeader(codecs.PACK.id, 1, at, at).pack() + body, record

    def _stored(self, kind: DigestKind, digest: Digest, data: bytes) -> bool | None:
        """Whether the destination holds ``data`` under the key (None: nothing there,
        False: other bytes)."""
        assert self.dst is not None
        return self.dst.objects.holds(kind, digest, data)

    def _count_planned(self, digest: Digest, data: bytes, need: Need,
                       compact: tuple[Digest, bytes, bytes] | None) -> None:
        """A dry run counts what the real run would find in place as present, what it
        would write as copied (a new pack or record a killed sync left, an object of
        the same bytes or a whole standalone one)."""
        if self.dst is None:
            for part in compact[1:] if compact is not None else (data,):
                self._count(part)
            return
        if compact is not None:
            new, pack_data, record = compact
            self._count(pack_data, written=self._stored(CHUNKS, new, pack_data) is not True)
            self._count(record, written=self._stored(MOVED, digest, record) is not True)
            return
        try:
            existing = self.dst.objects.get(CHUNKS, digest)
        except (FileNotFoundError, CorruptChunkError):  # failing its check: replaced
            existing = None
        kept = existing is not None and (existing == data or (
            (need is None or not need[0]) and _standalone_intact(self.dst, digest, existing)))
        self._count(data, written=not kept)

    def _put_compacted(self, pack: Digest, new: Digest, data: bytes, record: bytes) -> None:
        """Store the new pack, then the moved record (in that order, as a repack does:
        a record never points at a pack not yet stored)."""
        assert self.dst is not None
        stored, written = self._put_chunk(new, data, None)
        self._count(stored, NewChunk(new, codecs.PACK.id, len(stored) - HEADER.size,
                                     len(stored)), written=written)
        objects = self.dst.objects
        written = objects.put_if_absent(MOVED, pack, record)
        if not written and objects.get(MOVED, pack) != record:
            raise CorruptChunkError(pack.hex, "the destination has another moved record for"
                                    " this pack (a repack of its own); sync cannot list the"
                                    " members it moved")
        self._count(record, written=written)
        with self._lock:
            self.copied.moved.append(pack)
            self.planned.add((COMPACTED, pack))

    def _put_chunk(self, digest: Digest, data: bytes, need: Need) -> tuple[bytes, bool]:
        """Create the object (put-if-absent): the bytes the destination holds after, and
        whether this call wrote them."""
        assert self.dst is not None
        objects = self.dst.objects
        if objects.put_if_absent_deferred(CHUNKS, digest, data):
            return data, True
        try:
            existing = objects.get(CHUNKS, digest)
        except FileNotFoundError:
            existing = b""
        except CorruptChunkError:  # a sealed copy failing authentication: replaced
            existing = b""
        if existing == data or _standalone_intact(self.dst, digest, existing):
            return existing, False  # landed before (a killed sync), or stored otherwise
        replacement = data if need is None or not need[0] else self._standalone(digest, data, need)
        objects.put(CHUNKS, digest, replacement)
        return replacement, True

    def _standalone(self, digest: Digest, data: bytes, need: Need) -> bytes:
        """A standalone (raw) object of a delta chunk, decoded through the source's chain."""
        assert need is not None
        raw = decode_chain(self.src, digest, data, need[0], locations=need[1])
        header = parse_header(digest, data)
        return ChunkHeader(codecs.RAW.id, header.element_size, len(raw), len(raw)).pack() \
            + bytes(raw)

    def _check_members(self, pack: Digest, data: bytes) -> None:
        """Every member the version lists in ``pack`` lies inside it and reads as a read
        reads it (decoded through its listed chain, hash-checked): a pack whose content
        hashes right may still not hold what a crafted or damaged manifest lists."""
        objects = self.src.objects
        located = objects.located_members(data)
        for digest, offset, length, chain, locations in sorted(self.members.get(pack, ())):
            if offset + length > len(located):
                raise CorruptChunkError(digest.hex, f"listed at {offset}+{length} in pack"
                                        f" {pack.short()}, which holds {len(located)} bytes")
            member = objects.open_member(digest, PackLocation(pack, offset, length),
                                         located[offset:offset + length])
            decode_chain(self.src, digest, member, chain, locations=locations)

    def _check_listed_in_source(self, pack: Digest) -> None:
        """:meth:`_check_members` for a pack not copied, read in the source."""
        check_listed(self.src, pack, self.members.get(pack, ()))

    def _forward_members(self, record: MovedRecord) -> None:
        """The members listed in a pack the source repacked are checked where its moved
        record puts them; a member the record does not list cannot be read."""
        forwarded = self.members.setdefault(record.to, set())
        for member in self.members.pop(record.pack, ()):
            forwarded.add(_forwarded(record, member))

    def _copy_moved(self, pack: Digest) -> Digest:
        record = read_moved(self.src.objects, pack)
        if record is None:
            raise MissingChunkError(pack.hex)
        with self._lock:
            self._forward_members(record)
        data = self.src.objects.get(MOVED, pack)
        self._count(data)
        self.planned.add((CHUNK, pack))
        if self.dst is not None and not self.dry_run \
                and not self.dst.objects.put_if_absent(MOVED, pack, data) \
                and self.dst.objects.get(MOVED, pack) != data:
            raise CorruptChunkError(pack.hex, "the destination has another moved record for"
                                    " this pack (a repack of its own); sync cannot list the"
                                    " members the source moved")
        return record.to

    def _copy_nodes(self, nodes: list[Digest]) -> None:
        present = self._present(NODE, nodes)
        self.copied.present += len(present)
        todo = [d for d in nodes if d not in present]
        for digest, size in zip(todo, self._pool().map(self._copy_node, todo), strict=True):
            self.copied.node_sizes[digest] = size

    def _copy_node(self, digest: Digest) -> int:
        data = self.src.objects.get(NODES, digest)
        ids = self.src.objects.node_ids
        if not ids.names(digest, data):
            raise CorruptNodeError(digest.hex, "the source's copy does not hash to its key")
        if digest in self.data_nodes:
            decode_data(digest, data, ids)  # plain data a read of the version would decode
        self.planned.add((NODE, digest))
        written = True
        if self.dst is not None and self.dry_run:
            written = self._stored(NODES, digest, data) is not True
        elif self.dst is not None:
            objects = self.dst.objects
            if not objects.put_if_absent_deferred(NODES, digest, data):
                with contextlib.suppress(FileNotFoundError):
                    written = objects.get(NODES, digest) != data
                if written:  # a damaged copy (an orphan a power cut truncated)
                    objects.put(NODES, digest, data)
        self._count(data, written=written)
        return len(data)


def add_needs(entry: TensorEntry, needs: dict[Digest, Need]) -> None:
    """The chunk objects a read of ``entry`` needs, with what it needs of each."""
    for shard in entry.shards:
        for i, digest in enumerate(shard.chunks):
            chain, locations = shard.chain(i), shard.chain_locations(i)
            location = shard.location(i)
            if location is not None:
                needs[location.pack] = None
            else:
                needs.setdefault(digest, (chain, locations))
            for k, (base, at) in enumerate(zip(chain, locations, strict=True)):
                if at is not None:
                    needs[at.pack] = None
                else:
                    needs.setdefault(base, (chain[k + 1:], locations[k + 1:]))


def check_listed(store: StoreHandle, pack: Digest, members: Iterable[Member]) -> None:
    """Each of ``members`` listed in ``pack`` reads in ``store`` as a read reads it: by
    range from the pack, or where the store's moved records put it, decoded through its
    listed chain and hash-checked (:class:`CorruptChunkError` naming the member, or
    :class:`MissingChunkError`)."""
    listed = sorted(members)
    for hop in range(MAX_HOPS + 1):
        # Read, not looked for first: a GC's repack deletes a pack live versions list
        # once its moved record is stored, so a pack found may be gone by the read
        # (the local tier's collection under a mirror's copy of the next version).
        try:
            read = [store.objects.member_range(pack, offset, length)
                    for _, offset, length, _, _ in listed]
        except FileNotFoundError:
            record = read_moved(store.objects, pack)
            if record is None or hop == MAX_HOPS:
                raise MissingChunkError(pack.hex) from None
            listed = [_forwarded(record, member) for member in listed]
            pack = record.to
            continue
        for (digest, offset, length, chain, locations), data in zip(listed, read, strict=True):
            member = store.objects.open_member(digest, PackLocation(pack, offset, length), data)
            decode_chain(store, digest, member, chain, locations=locations)
        return


def _forwarded(record: MovedRecord, member: Member) -> Member:
    """A member of ``record``'s pack where the record puts it; a member it does not
    list cannot be read."""
    digest, offset, length, chain, locations = member
    at = record.forward(PackLocation(record.pack, offset, length))
    if at is None:
        raise CorruptChunkError(digest.hex, f"pack {record.pack.short()} is gone and its"
                                " moved record does not list this member")
    return digest, at.offset, at.length, chain, locations


def add_members(entry: TensorEntry, members: dict[Digest, set[Member]]) -> None:
    """The members a read of ``entry`` reads in each pack (its chunks and their bases),
    each with the chain a read of it follows."""
    for shard in entry.shards:
        for i, digest in enumerate(shard.chunks):
            chain, locations = shard.chain(i), shard.chain_locations(i)
            for k, (at, chunk) in enumerate(((shard.location(i), digest),
                                              *zip(locations, chain, strict=True))):
                if at is not None:  # the k-th base's own chain is the rest of the list
                    members.setdefault(at.pack, set()).add(
                        (chunk, at.offset, at.length, chain[k:], locations[k:]))


def add_spans(entry: TensorEntry, spans: Spans) -> None:
    """The members a read of ``entry`` needs in each pack (its chunks' and their bases')."""
    for shard in entry.shards:
        for i in range(len(shard.chunks)):
            for at in (shard.location(i), *shard.chain_locations(i)):
                if at is not None:
                    spans.setdefault(at.pack, set()).add((at.offset, at.length))


def checked_object(store: StoreHandle, digest: Digest, data: bytes, need: Need, *,
                   check_links: bool = False) -> bytes:
    """``data``, the object of ``digest`` in ``store``, once it passed the check a read
    makes of it, so that no copy ever moves bytes it did not check: a chunk object
    decodes (through the chain ``need`` lists, its bases read from ``store`` and checked
    on the way) to bytes that hash to its key; a pack's content hashes to its key.
    A pack whose own header alone is damaged (reads never use it, so ``verify`` passes
    the pack with a warning) comes back with the header it was written with.
    :class:`CorruptChunkError` (or :class:`MissingChunkError` for a missing base)
    when the check fails; with ``check_links`` every base on the way is checked too, so
    the error names the object at fault (else a damaged base fails the chunk itself)."""
    if need is not None:
        decode_chain(store, digest, data, need[0], locations=need[1], check_links=check_links)
        return data
    if len(data) < HEADER.size or not store.objects.chunk_ids.names(
            digest, memoryview(data)[HEADER.size:]):
        raise CorruptChunkError(digest.hex, "the pack's content does not hash to its key"
                                " (damaged or truncated)")
    size = len(data) - HEADER.size
    with contextlib.suppress(ChunkStoreError):
        header = parse_header(digest, data)
        if header.codec_id == codecs.PACK.id and header.raw_length == size \
                and header.payload_length == size:
            return data  # as written (by whichever chunk format version)
    return ChunkHeader(codecs.PACK.id, 1, size, size).pack() + data[HEADER.size:]


def _standalone_intact(store: StoreHandle, digest: Digest, data: bytes) -> bool:
    """Whether ``data`` is a standalone chunk object (or pack) of ``digest``, whole."""
    try:
        if parse_header(digest, data).base is not None:
            return False
        decode_object(digest, data, ids=store.objects.chunk_ids)
    except ChunkStoreError:
        return False
    return True
