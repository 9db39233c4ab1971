"""Repacking: GC copies the live members of a mostly-garbage pack into a new pack.

A pack is deleted whole, so one live member keeps all its bytes.  When GC's
mark finds that at least ``unused`` of a pack's content is listed by no live
version, the pack's live members are copied (byte for byte, each checked as a
read checks it) into a new pack, its moved record (:mod:`chunkstore.protocol.moved`)
says where each went, and the old pack becomes a GC candidate like any other:
fenced, waited for, marked again, condemned and deleted (:mod:`chunkstore.maintenance.gc`
steps 5-8).  The order, and why no interleaving loses a member:

1. GC's mark resolves every member the live versions list to the pack that
   holds it now; the plan is made from that;
2. a save session is stored and the journal read (as a save does,
   docs/format.md §11.1), then each new pack is written with put-if-absent;
   a new pack an active journal entry names is not written (its GC may be
   deleting a copy), and a copy found stored is used only after it hashes to
   its key;
3. each old pack's moved record is written with put-if-absent (after its new
   pack is durable); an old pack that already has one (another GC moved it)
   is left alone; the session ends once the records are written;
4. the old packs join GC's candidates.

A new pack is an object no index counts: until its moved record exists it is
protected as anything a save in progress writes (a GC elsewhere that fenced
it waits for the session of step 2, then marks through the moved record); from
then on GC's mark reaches it through the record from every version that lists
a moved member, and while the old pack is stored (a save may still deduplicate
against the old pack and list a moved member of it).  An old pack is deleted
only when step 7 of the GC that repacked it (or of any later GC) finds no live
version listing a member of it that its moved record does not cover: a save
that reused a garbage member of the pack while it was being repacked either
was waited for (step 6; its version then keeps the pack) or read the journal
entry naming the pack and did not reuse it.  And before deleting it, GC reads
back, hash-checked, every member the versions list in it where the records put
it (a damaged or crafted record keeps the pack).  A reader that finds the pack
gone follows the record.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from chunkstore.codecs import PACK
from chunkstore.errors import ChunkStoreError
from chunkstore.format.chunkobj import ChunkHeader, parse_header
from chunkstore.format.digest import Digest
from chunkstore.format.manifest import MAX_PACK_BYTES
from chunkstore.index.lmdbindex import CHUNK, ChunkRecord, ChunkState
from chunkstore.objects.kinds import CHUNKS
from chunkstore.objects.objectstore import PackEncoding
from chunkstore.protocol.moved import MovedRecord, write_moved
from chunkstore.read.packs import copy_members

if TYPE_CHECKING:
    from chunkstore.handle.handle import StoreHandle
    from chunkstore.maintenance.mark import MarkSet
    from chunkstore.protocol.journal import Fence
    from chunkstore.protocol.sessions import StoreSession

#: Repack a pack once at least this fraction of its content is garbage (the default
#: of ``gc``'s ``repack_unused``; ``restic prune --max-unused`` works per repository,
#: this per pack, so a pack's live bytes are copied at most about as often as
#: they are shared with garbage).
DEFAULT_UNUSED = 0.5


@dataclass
class PackUse:
    """A live pack: its content size and its live members (digest, offset, length)."""

    pack: Digest
    content: int
    members: list[tuple[Digest, int, int]]
    stored: int

    @property
    def live(self) -> int:
        return sum(length for _, _, length in self.members)

    @property
    def garbage(self) -> int:
        return max(self.content - self.live, 0)


@dataclass
class RepackPlan:
    """What a GC run repacks: live packs at least ``unused`` garbage."""

    packs: list[PackUse] = field(default_factory=list)
    #: bytes inside live packs no live version lists (all live packs, planned or not)
    garbage_bytes: int = 0
    #: every pack holding a member a live version reads, and their stored bytes
    live_packs: int = 0
    live_pack_bytes: int = 0

    @property
    def copy_bytes(self) -> int:
        return sum(p.live for p in self.packs)

    @property
    def freed_bytes(self) -> int:
        """Stored bytes the old packs occupy less the bytes copied out of them."""
        return sum(p.stored for p in self.packs) - self.copy_bytes


def plan(store: StoreHandle, marks: MarkSet, moved: dict[Digest, MovedRecord | None],
         unused: float | None, skip: set[Digest]) -> RepackPlan:
    """Measure every live pack's garbage; choose those at least ``unused`` garbage
    (None: choose none) that have no moved record and are not in ``skip``."""
    result = RepackPlan()
    for pack, members in marks.live_members():
        size = _pack_size(store, pack)
        if size is None:
            continue  # missing or not a pack: verify reports it; nothing to copy from
        content, stored = size
        use = PackUse(pack, content, members, stored)
        result.garbage_bytes += use.garbage
        result.live_packs += 1
        result.live_pack_bytes += stored
        if unused is None or pack in moved or pack in skip or not content:
            continue
        if use.garbage >= unused * content and use.garbage > 0:
            result.packs.append(use)
    return result


def _pack_size(store: StoreHandle, pack: Digest) -> tuple[int, int] | None:
    """A pack's content and stored bytes: from the index when it knows the pack, else
    from the pack's header."""
    record = store.index.record(CHUNK, pack)
    if record is not None and record.codec_id == PACK.id and record.stored_length:
        return record.raw_length, record.stored_length
    try:
        head = store.objects.pack_head(pack)
        header = parse_header(pack, head.header)
    except (FileNotFoundError, ChunkStoreError):
        return None
    if header.codec_id != PACK.id:
        return None
    return head.located, head.stored


@dataclass
class RepackResult:
    repacked: list[Digest] = field(default_factory=list)  # old packs, now candidates
    bytes_written: int = 0
    skipped: list[str] = field(default_factory=list)  # why a planned pack was left


def repack(store: StoreHandle, chosen: list[PackUse], target: int) -> RepackResult:
    """Steps 2-3 of the module docstring for the ``chosen`` packs."""
    from chunkstore.write.writer import open_store_session

    result = RepackResult()
    store.upgrade_format()  # moved records are a store format 6 object
    session, fence = open_store_session(store, "gc repack")
    try:
        group: list[tuple[PackUse, list[tuple[bytes, bytes]]]] = []
        size = 0
        for use in chosen:
            try:
                copied = copy_members(store, use.pack, use.members)
            except FileNotFoundError:
                result.skipped.append(f"pack {use.pack.short()}: deleted meanwhile")
                continue
            except ChunkStoreError as exc:
                result.skipped.append(f"pack {use.pack.short()}: {exc} (run `chunkstore"
                                      " verify`); not repacked")
                continue
            more = sum(len(stored) for _, stored in copied)
            if group and size + more > MAX_PACK_BYTES:  # no moved offset may pass it
                _write_group(store, fence, session, group, result)
                group, size = [], 0
            group.append((use, copied))
            size += more
            if size >= target:
                _write_group(store, fence, session, group, result)
                group, size = [], 0
        if group:
            _write_group(store, fence, session, group, result)
    finally:
        session.close()
    return result


def _write_group(store: StoreHandle, fence: Fence, session: StoreSession,
                 group: list[tuple[PackUse, list[tuple[bytes, bytes]]]],
                 result: RepackResult) -> None:
    """Write one new pack holding every member of ``group``, then the moved records.
    A member's bytes are copied as its location names them: in an encrypted store of
    version 13 the member sealed on its own, unchanged (docs/format.md §13.6)."""
    parts: list[tuple[Digest, list[bytes | memoryview]]] = []
    stored_parts: list[bytes | memoryview] = []
    records: list[MovedRecord] = []
    offset = 0
    placed: dict[bytes, int] = {}
    for use, copied in group:
        members: dict[int, tuple[int, int]] = {}
        for (digest, old, length), (member, stored) in zip(use.members, copied, strict=True):
            new = placed.get(member)
            if new is None:  # the same member object in two old packs: copied once
                new = placed[member] = offset
                parts.append((digest, [member]))
                stored_parts.append(stored)
                offset += len(stored)
            members[old] = (length, new)
        records.append(MovedRecord(use.pack, Digest(b"\0" * 32), members))
    content = sum(len(member) for _, (member,) in parts)
    data = PackEncoding(ChunkHeader(PACK.id, 1, content, content).pack(), parts,
                        stored_parts if store.objects.sealed_members else None)
    new_pack = store.objects.chunk_ids.of_pieces(data.pieces()[1:])
    if fence.blocking(CHUNK, new_pack) is not None:
        result.skipped.extend(f"pack {use.pack.short()}: its new pack is being deleted by"
                              " another gc; not repacked" for use, _ in group)
        return
    if not store.objects.put_if_absent(CHUNKS, new_pack, data) \
            and not store.objects.holds(CHUNKS, new_pack, data):
        store.objects.put(CHUNKS, new_pack, data)  # damaged or deleted meanwhile: whole
    result.bytes_written += store.objects.pack_size(data)
    # Counted by this index (referenced by no version: GC's mark keeps it while a moved
    # record leads to it), so a GC without the orphan sweep frees it when it is not.
    store.index.put_record_if_absent(CHUNK, new_pack, ChunkRecord(
        ChunkState.LIVE, PACK.id, 0, offset, store.objects.pack_size(data), time.time()))
    for record in records:
        if record.pack == new_pack:
            # Its live members, with those of the others (members it holds that
            # another old pack's versions list), make exactly its own content.
            continue
        if session.lapsed():  # a GC elsewhere may have counted us dead and taken the pack
            result.skipped.append(f"pack {record.pack.short()}: the repack's session"
                                  " lapsed; not repacked")
            continue
        if write_moved(store.objects, MovedRecord(record.pack, new_pack, record.members)):
            result.repacked.append(record.pack)
        else:
            result.skipped.append(f"pack {record.pack.short()}: already moved by another gc")
