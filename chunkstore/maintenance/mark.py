"""Marking: every object that live versions (and versions removed within the grace
period) reach, collected into an on-disk set so a large store needs little memory."""

from __future__ import annotations

import logging
import os
import shutil
import struct
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import lmdb

from chunkstore.errors import (
    ChunkStoreError,
    FormatVersionError,
    GcAbortedError,
    IntegrityError,
    StorageFullError,
)
from chunkstore.format.digest import Digest
from chunkstore.format.manifest import DataEntry, PackLocation, TensorEntry
from chunkstore.handle.tree import flatten, load_tree
from chunkstore.index.indexfile import is_full
from chunkstore.index.lmdbindex import CHUNK, NODE
from chunkstore.objects.kinds import TOMBSTONES
from chunkstore.progress import Progress
from chunkstore.protocol import tombstones
from chunkstore.protocol.moved import MAX_HOPS, MovedRecord, resolve_hops
from chunkstore.protocol.readleases import live_read_roots
from chunkstore.protocol.runlease import pending_roots
from chunkstore.protocol.tombstones import list_tombstones

if TYPE_CHECKING:
    from chunkstore.handle.handle import StoreHandle

log = logging.getLogger(__name__)
_T = TypeVar("_T")


class MarkSet:
    """A set of (kind, digest) on disk, so marking a large store needs little memory.

    Packed chunks are marked as members (pack, offset, length, chunk digest),
    not as their pack: :meth:`resolve` follows them through the store's moved
    records to the packs that hold them now, into a second table it rebuilds
    each time (a pack repacked since the last resolve is then no longer
    reached through members that moved).
    """

    def __init__(self, parent: str) -> None:
        # Where a mark set may live, nearest first: beside the index, else the temporary
        # directory, else memory (/dev/shm), so GC (the way to free space) runs on a
        # full disk; a write that finds its filesystem full moves the set on.
        self._places = [parent, tempfile.gettempdir(), "/dev/shm"]
        self.path, self.env = self._next_place(None, None)
        self.resolved = self.env.open_db(b"resolved")

    def _next_place(self, full: BaseException | None, source: lmdb.Environment | None
                    ) -> tuple[str, lmdb.Environment]:
        """Open the set in the next place with room: empty, or a copy of ``source``."""
        while self._places:
            parent = self._places.pop(0)
            for attempt in range(5):  # an index directory may be deleted at any time
                path = ""
                try:
                    os.makedirs(parent, exist_ok=True)
                    path = tempfile.mkdtemp(prefix="gc-mark-", dir=parent)
                    if source is not None:
                        source.copy(path)  # compacted: what the set holds so far
                    env = lmdb.open(path, map_size=1 << 36, sync=False, metasync=False,
                                    lock=False, max_dbs=2)
                    return path, env
                except (lmdb.Error, OSError) as exc:
                    if path:
                        shutil.rmtree(path, ignore_errors=True)
                    if is_full(exc, parent):
                        full = exc
                        break  # this filesystem is full: the next place
                    if attempt == 4:
                        raise
        raise StorageFullError("gc-mark", str(full), what=(
            "gc's mark set (beside the index, in the temporary directory and in /dev/shm)"))

    def _write(self, body: Callable[[lmdb.Transaction], _T]) -> _T:
        """Run ``body`` in a write transaction; where the set's filesystem is full, move
        the set to the next place and run it again (the failed transaction is undone)."""
        while True:
            try:
                with self.env.begin(write=True) as txn:
                    return body(txn)
            except lmdb.Error as exc:
                if not is_full(exc, self.path):
                    raise
                self._move(exc)

    def _move(self, exc: BaseException) -> None:
        old_path, old_env = self.path, self.env
        self.path, self.env = self._next_place(exc, old_env)
        old_env.close()
        shutil.rmtree(old_path, ignore_errors=True)
        self.resolved = self.env.open_db(b"resolved")
        log.warning("gc's mark set moved to %s: %s", self.path, exc)

    def add_many(self, kind: bytes, digests: Iterator[Digest] | list[Digest]) -> None:
        keys = [kind + digest.raw for digest in digests]

        def body(txn: lmdb.Transaction) -> None:
            for key in keys:
                txn.put(key, b"", overwrite=False)
        self._write(body)

    def add(self, kind: bytes, digest: Digest) -> bool:
        """Add one; False when it was already there."""
        return self._write(lambda txn: bool(txn.put(kind + digest.raw, b"", overwrite=False)))

    def add_members(self, members: list[tuple[PackLocation, Digest]]) -> None:
        """Mark packed chunks where a manifest lists them (a location listed with two
        lengths is two members: one listing never hides another)."""
        def body(txn: lmdb.Transaction) -> None:
            for location, digest in members:
                txn.put(_MEMBER + _location_key(location), digest.raw, overwrite=False)
        self._write(body)

    def listed_members(self, pack: Digest) -> list[tuple[Digest, PackLocation]]:
        """Every member the marked versions list inside ``pack``: (digest, location)."""
        return self._members(_MEMBER + pack.raw, None)

    def passing_members(self, pack: Digest) -> list[tuple[Digest, PackLocation]]:
        """Every marked member that the last :meth:`resolve` followed through ``pack``
        on its way to where it lies now (``pack`` reached only through moved records,
        as a repack's new pack is): (digest, its location in ``pack``)."""
        return self._members(_PASS + pack.raw, self.resolved)

    def _members(self, prefix: bytes, db: Any) -> list[tuple[Digest, PackLocation]]:
        found = []
        with self.env.begin() as txn:
            cursor = txn.cursor(db=db) if db is not None else txn.cursor()
            if cursor.set_range(prefix):
                for raw_key, raw_value in cursor.iternext():
                    key = bytes(raw_key)
                    if not key.startswith(prefix):
                        break
                    found.append((Digest(bytes(raw_value)), _location_of(key)))
        return found

    def __contains__(self, item: tuple[bytes, Digest]) -> bool:
        """Whether the object is reached: marked itself, or (a pack) holding a member."""
        kind, digest = item
        with self.env.begin() as txn:
            return txn.get(kind + digest.raw) is not None or (
                kind == CHUNK and txn.get(_HOLDS + digest.raw, db=self.resolved) is not None)

    def forwarded_to(self, pack: Digest) -> bool:
        """Whether ``pack`` is reached only through a moved record (an index that never
        counted it is then not wrong)."""
        with self.env.begin() as txn:
            return txn.get(_VIA + pack.raw, db=self.resolved) is not None

    def record_used(self, pack: Digest) -> bool:
        """Whether a member is listed in ``pack``, or reached through its moved record."""
        with self.env.begin() as txn:
            return (txn.get(_USED + pack.raw, db=self.resolved) is not None
                    or txn.get(_HOLDS + pack.raw, db=self.resolved) is not None
                    or txn.get(CHUNK + pack.raw) is not None)

    def resolve(self, moved: dict[Digest, MovedRecord | None],
                stored: Callable[[Digest], bool]) -> None:
        """Follow every marked member through ``moved`` (every moved record in the
        store, read after the marking it resolves) to the pack that holds it, as
        :func:`chunkstore.protocol.moved.resolve_location` decides with ``stored`` (whether a
        pack object exists)."""
        broken = [pack for pack, record in moved.items() if record is None]
        if broken:
            raise GcAbortedError(
                f"the moved record of pack {broken[0].short()} cannot be read, so gc cannot"
                " know where that pack's members went and deletes nothing; run `chunkstore"
                " verify`")
        def body(txn: lmdb.Transaction) -> None:
            txn.drop(self.resolved, delete=False)
            self._keep_targets(txn, moved, stored)
            cursor = txn.cursor()
            if not cursor.set_range(_MEMBER):
                return
            for raw_key, raw_value in cursor.iternext():
                key = bytes(raw_key)
                if not key.startswith(_MEMBER):
                    break
                self._resolve_member(txn, moved, stored, _location_of(key), bytes(raw_value))
        self._write(body)

    def _keep_targets(self, txn: lmdb.Transaction, moved: dict[Digest, MovedRecord | None],
                      stored: Callable[[Digest], bool]) -> None:
        """Keep the packs a record leads to while the pack it leaves is stored (a save
        may still deduplicate against that pack and list a member the record moved),
        or marked whole (a version marked from the index's references, its manifest
        unreadable)."""
        for pack, first in moved.items():
            whole = txn.get(CHUNK + pack.raw) is not None
            record = first if whole or stored(pack) else None
            for _ in range(MAX_HOPS):
                if record is None:
                    break
                txn.put(_HOLDS + record.to.raw, b"", db=self.resolved)
                txn.put(_VIA + record.to.raw, b"", db=self.resolved)
                txn.put(_USED + record.pack.raw, b"", db=self.resolved)
                record = moved.get(record.to)

    def _resolve_member(self, txn: lmdb.Transaction, moved: dict[Digest, MovedRecord | None],
                        stored: Callable[[Digest], bool], listed: PackLocation,
                        digest: bytes) -> None:
        hops = resolve_hops(listed, moved, stored)
        location, path = hops[-1], [hop.pack for hop in hops[:-1]]
        for pack in path:
            txn.put(_USED + pack.raw, b"", db=self.resolved)
        for passed in hops[1:-1]:  # in a pack only moved records reach (a repack's pack)
            txn.put(_PASS + _location_key(passed), digest, db=self.resolved)
        if len(path) == MAX_HOPS:  # as long as a reader follows (a cycle?): keep them all
            for pack in path:
                txn.put(_HOLDS + pack.raw, b"", db=self.resolved)
        txn.put(_HOLDS + location.pack.raw, b"", db=self.resolved)
        if path:
            txn.put(_VIA + location.pack.raw, b"", db=self.resolved)
        txn.put(_LIVE + _location_key(location), digest, db=self.resolved)

    def live_members(self) -> Iterator[tuple[Digest, list[tuple[Digest, int, int]]]]:
        """Per pack a resolved member lies in: its live members (digest, offset, length)
        in offset order."""
        with self.env.begin() as txn:
            cursor = txn.cursor(db=self.resolved)
            if not cursor.set_range(_LIVE):
                return
            pack: Digest | None = None
            members: list[tuple[Digest, int, int]] = []
            for raw_key, raw_value in cursor.iternext():
                key = bytes(raw_key)
                if not key.startswith(_LIVE):
                    break
                location = _location_of(key)
                if location.pack != pack:
                    if pack is not None:
                        yield pack, members
                    pack, members = location.pack, []
                members.append((Digest(bytes(raw_value)), location.offset, location.length))
            if pack is not None:
                yield pack, members

    def close(self) -> None:
        self.env.close()
        shutil.rmtree(self.path, ignore_errors=True)


#: Mark set keys: a member where a manifest lists it (pack + offset -> chunk + length);
#: in the resolved table, a pack holding a reached member, a pack reached through a
#: moved record, a pack whose moved record was followed, a member where it lies now,
#: and a member in a pack its resolution passed through (neither listed nor final).
_MEMBER, _HOLDS, _VIA, _USED, _LIVE, _PASS = b"m", b"p", b"v", b"u", b"l", b"t"
_PLACE = struct.Struct(">QQ")  # offset, length: sorts by offset within a pack


def _location_key(location: PackLocation) -> bytes:
    return location.pack.raw + _PLACE.pack(location.offset, location.length)


def _location_of(key: bytes) -> PackLocation:
    """The location in a mark set key (after its one-byte prefix)."""
    offset, length = _PLACE.unpack(key[33:])
    return PackLocation(Digest(key[1:33]), offset, length)


def mark_live(store: StoreHandle, marks: MarkSet, progress: Progress,
              check_time: Callable[[], None]) -> list[str]:
    """Mark every object the live versions reach; return versions marked from the index.

    A subtree already marked is not walked again, so versions that share
    most of their tree cost only their differences.  A version whose
    manifest cannot be read is marked from the index's reference lists
    instead (and named in the result), so GC never deletes what it uses.
    """
    fallback = []
    versions = store.index.versions()
    progress.start(len(versions), "gc: mark")
    for entry in versions:
        check_time()
        try:
            mark_tree(store, Digest.parse(entry.root), marks)
        except ChunkStoreError:
            fallback.append(entry.id)
            marks.add_many(CHUNK, store.index.version_refs(entry.id))
            marks.add_many(NODE, store.index.version_node_refs(entry.id))
        progress.advance()
    progress.finish()
    return fallback


def mark_tree(store: StoreHandle, root: Digest, marks: MarkSet) -> None:
    """Mark every tree and data node and every chunk object the tree at ``root`` needs."""
    stack = [root]
    while stack:
        digest = stack.pop()
        if (NODE, digest) in marks:
            continue  # shared with a version marked before
        # Marked once loaded, not before: a node a read failed on is walked again by the
        # next walk that reaches it (step 7's of versions published meanwhile).
        node = load_tree(store.objects, digest, store.node_cache)
        marks.add(NODE, digest)
        chunks: list[Digest] = []
        members: list[tuple[PackLocation, Digest]] = []
        for leaf in node.leaves.values():
            if isinstance(leaf, TensorEntry):
                for shard in leaf.shards:
                    for i, digest in enumerate(shard.chunks):
                        if shard.location(i) is None:
                            chunks.append(digest)
                        for base, at in zip(shard.chain(i), shard.chain_locations(i),
                                            strict=True):
                            if at is None:
                                chunks.append(base)
                    members.extend(shard.members())
            elif isinstance(leaf, DataEntry):
                marks.add(NODE, leaf.digest)
        marks.add_many(CHUNK, chunks)
        marks.add_members(members)
        stack.extend(node.children())




def mark_unindexed(store: StoreHandle, marks: MarkSet) -> set[str]:
    """Mark versions on storage the index does not list (committed since the
    reconcile, or unreadable); refuse to go on when one cannot be read.  Returns the
    ids of the commit records listed."""
    indexed = {e.id for e in store.index.versions()}
    stored = set(store.stored_version_ids())
    for version_id in stored:
        if version_id in indexed:
            continue
        try:
            root = store.read_record(version_id).root
            mark_tree(store, root, marks)
        except FileNotFoundError:
            continue  # removed meanwhile
        except ChunkStoreError as exc:
            raise GcAbortedError(
                f"version {version_id[:12]} cannot be read ({exc}), so gc cannot know what"
                " it references and deletes nothing; run `chunkstore verify`, and"
                " `chunkstore rm` the version if it is beyond repair") from exc
    return stored


def mark_removed(store: StoreHandle, marks: MarkSet, removed_after: float,
                 skip: frozenset[str] = frozenset(), now: float | None = None,
                 published: set[str] | None = None) -> list[str]:
    """Mark the trees of versions removed after ``removed_after`` (their grace period
    still runs), but those of ``skip`` (purged); return the ids of tombstones older than
    that, which protect nothing, but those younger than
    :data:`~chunkstore.protocol.tombstones.LIVE_TOMBSTONE_MIN_AGE_S` (at ``now``) whose
    version is still published (in ``published``, a listing of the commit records made
    before this call, else one made here): a removal in progress may be stopped after
    them."""
    expired: list[str] = []
    young: list[str] = []
    live_after = (time.time() if now is None else now) - tombstones.LIVE_TOMBSTONE_MIN_AGE_S
    for tombstone in list_tombstones(store.objects):
        if tombstone.version_id in skip:
            continue
        if tombstone.removed <= removed_after:
            (young if tombstone.removed > live_after else expired).append(
                tombstone.version_id)
        elif tombstone.root is not None:
            try:
                mark_tree(store, tombstone.root, marks)
            except (IntegrityError, FormatVersionError):
                continue  # partly gone already, or unreadable here: as it was marked
            except ChunkStoreError as exc:  # unreadable now, maybe not gone: keep everything
                if not tombstone.dated:  # it ages from its write, but damage it is
                    continue
                raise GcAbortedError(
                    f"removed version {tombstone.version_id[:12]} (tombstone"
                    f" {TOMBSTONES.key(tombstone.version_id)}) cannot be read now ({exc}); gc"
                    " deletes nothing until it can, or until the tombstone is older than the"
                    " grace period") from exc
    if young:  # only below the minimum age
        # A record listed earlier and deleted since keeps its tombstone one run longer.
        listed = set(store.stored_version_ids()) if published is None else published
        expired += [vid for vid in young if vid not in listed]
    return expired


def mark_read(store: StoreHandle, marks: MarkSet) -> int:
    """Mark the trees that live read leases name (docs/format.md §11.6): what a reader
    on any machine still reads stays, removed or not.  Returns how many were marked."""
    return _mark_roots(store, marks, live_read_roots(store.objects))


def mark_pending(store: StoreHandle, marks: MarkSet) -> list[Digest]:
    """Mark the trees of the intents in every run's commit slots (docs/format.md §11.5):
    a writer killed after its claim left a version the run's next taker publishes.
    Called before the mark lists the commit records: a slot is deleted only after its
    version's record was created (or its version withdrawn), so an intent this listing
    misses is a record (or a tombstone) the later listing finds.  Returns their roots."""
    roots = pending_roots(store.objects)
    _mark_roots(store, marks, roots)
    return roots


def tree_objects(store: StoreHandle, roots: list[Digest]) -> set[tuple[bytes, Digest]]:
    """(kind, digest) of every node and chunk object the trees at ``roots`` need (those
    that can be read): what no index counts for an intent, so that a GC does not call
    an index wrong for keeping them at refcount 0."""
    found: set[tuple[bytes, Digest]] = set()
    for root in roots:
        try:
            flat = flatten(store.objects, root, store.node_cache)
        except ChunkStoreError:
            continue
        found |= {(NODE, digest) for digest in flat.tree_nodes | flat.data_nodes()}
        found |= {(CHUNK, digest) for leaf in flat.leaves.values()
                  if isinstance(leaf, TensorEntry) for digest in leaf.chunk_digests()}
    return found


def _mark_roots(store: StoreHandle, marks: MarkSet, roots: list[Digest]) -> int:
    for root in roots:
        try:
            mark_tree(store, root, marks)
        except (IntegrityError, FormatVersionError):
            continue  # partly gone already, or damaged: its reader fails its checks
        # Anything else (the store unreachable) stops the run: a tree not read is not
        # marked, and what its reader reads would go.
    return len(roots)
