"""The LMDB index: chunk records with refcounts, versions, tags, write sessions.

Everything here can be rebuilt from the manifests (``chunkstore index
rebuild``): the manifests are the truth, the index is the fast path.  All
mutations happen in LMDB write transactions, which serialise across threads
and processes, so a writer's dedup claim and a GC's condemnation of the same
chunk can never interleave.  Each commits with a sync of the index file, so a
save makes as few as its order allows: its write session is stored with its first
claims (:meth:`Index.open_session`), its last pack is claimed with its nodes
(:meth:`Index.claim_kinds`), and the count-in drops its session.

Chunk states:

- ``WRITING``: claimed by a session that is writing the object; not yet a
  dedup target (the object may not be durable).
- ``LIVE``: the object is durable; a valid dedup target.
- ``CONDEMNED``: GC found it unreferenced past the grace period; a writer that
  wants it resurrects it (back to LIVE) in its claim transaction.
- ``DELETING``: GC is deleting the object; a writer waits for the record to go
  and then writes the chunk anew.

Manifest nodes have records of the same shape in their own table, with the
same states, claims and refcounts (a version counts each node of its tree
once), so GC treats both kinds alike.  Every record whose refcount is zero
is also listed in the ``zero`` table (kind byte + digest -> since): GC finds
its candidates there, in time proportional to what became unreferenced,
never by scanning every chunk.

The ``packed`` table (member -> pack, offset, length: where this index saw a
small chunk stored, a dedup cache) has a reverse table ``packed_by`` (pack +
member), so that the transaction that forgets a pack (GC's deletion, a GC
journal entry applied, an object found missing) forgets every location inside
it too: the cache holds what the stored packs hold, not every pack ever written.

Versions are kept by id (``versions``) and in two orders, by run and step and by
time (:mod:`chunkstore.index.versiontables`), written in the same transactions, so
that a save finds its run's newest version and its ``RUN@STEP`` by a seek, at a
cost that does not grow with the versions the store holds.

The ``verified`` table names each version a verify found readable (its commit
record and tree parsed, every entry one a read can read, its manifests naming
exactly the references the index holds), or that the save which built it recorded
in its count-in transaction, for ``verify --quick``, which then only checks that
version's objects present (:meth:`Index.verified_versions`).  The ``census`` table
holds what ``report``'s census counts of each version's manifests (chains, packed
chunks, ranks), recorded by the save, the sync or the count-in that adds the
version, so a report reads only the manifests of versions none of them recorded.
Each entry of both is bound to the version's entry and references and to a random
epoch in ``meta`` (:mod:`chunkstore.index.derived`): a rebuild replaces both, so a
rebuilt index trusts nothing derived before; each stays within a leaf page, so that
a job that saves and removes versions reuses the pages it frees.  The tables are
additive (older releases never read them).

A save does not re-write the record of every object its version references: at
10,000 versions those records lie on as many leaf pages, and re-writing them was
most of what a save's count-in writes more than at 100 versions (issue 49).  A
reference to an object already counted (LIVE, refcount 1 or more), whose record the
transaction does not write anyway, is listed in the ``pending`` table (version id
and a nonce -> the deferred digests) instead; the others are counted at once.  So the ``zero``
table stays exact at every instant (no object with a pending reference is at zero)
and GC's candidates need nothing more.  A refcount read adds the table
(:meth:`Index.record`, :meth:`Index.iter_records`: verify's refcount check, report),
and the table is folded into the records, each written once, in the transaction of
anything that lowers a refcount (:meth:`Index.remove_versions`), of a batch count-in,
and of the save that finds it holding :data:`FOLD_AFTER` versions.  A release that
knew no such table would lower refcounts without it, and free objects versions
still reference, so the schema is 5 (a release of 4 rebuilds an index of 5).  The
schema is checked where an index is opened, so a process of such a release that had
it open before goes on doing so; GC folds the table in the transaction that lists its
candidates and in each that re-checks them (:meth:`Index.unreferenced_folded`), so no
refcount so lowered makes it take an object a pending version references.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import struct
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from enum import IntEnum
from typing import Any

import lmdb

from chunkstore.format.digest import Digest
from chunkstore.format.manifest import PackLocation
from chunkstore.index import derived, indexfile, versiontables, writegate
from chunkstore.index.versiontables import VersionEntry, VersionLookups

#: 3 adds the ``packed_by`` table, 4 the orders of the versions (``versions_by_run``,
#: ``versions_by_time``), 5 the ``pending`` table (references a save counted in without
#: raising their refcounts: a release that decrements refcounts without folding them
#: first must not open it); an index of schema 2, 3 or 4 is brought to 5 where it is
#: opened (each table is derived from another, or starts empty), any other schema is
#: rebuilt.
INDEX_SCHEMA = 5
#: The schemas this release migrates in place (:meth:`Index._migrate`).
_MIGRATED_SCHEMAS = (2, 3, 4)
#: A save folds the ``pending`` table into the refcounts (:meth:`Index._fold`) once it
#: holds this many versions' deferred references: what a later fold writes, and how
#: far an exact refcount read adds up the table, stay bounded.
FOLD_AFTER = 64
#: ... or once its deferred digests pass this many bytes (the counts an exact read
#: keeps in memory stay bounded too); a version with more references than that defers
#: none of them: they are raised at once, as a save did before the table.
PENDING_BYTES = 2 << 20
#: The meta key naming the store an index describes (:meth:`Index.describe_store`).
STORE_KEY = b"store"
#: The meta key of an index's own id (:meth:`Index.identity`).
INDEX_ID_KEY = b"index_id"
#: The meta key of the GC journal markers an index has accounted for.
_MARKERS_KEY = b"journal_markers"
#: The meta key of the store's listing stamps as of the index's last complete reconcile
#: (:meth:`Index.listed_as`), with the count of versions it then held.
_LISTED_KEY = b"listed"
#: What follows the entry count in the ``verified`` table where the version's own save
#: recorded it (:meth:`Index.verified_versions`); a release before it reads only the
#: count alone, and so reads such a version again.
_BY_ITS_SAVE = b"s"
#: The meta key of when this index last listed every commit record, and last listed
#: the publication markers (:meth:`Index.markers_listed`).
_MARKERS_LISTED_KEY = b"markers_listed"
log = logging.getLogger(__name__)
DEFAULT_MAP_SIZE = 1 << 36
_CHUNK = struct.Struct("<BBxxIQQd")
_SINCE = struct.Struct("<d")
_PACKED = struct.Struct("<32sQQ")  # pack digest, offset, length
CHUNK = b"c"
NODE = b"n"
KINDS = (CHUNK, NODE)


class ChunkState(IntEnum):
    WRITING = 0
    LIVE = 1
    CONDEMNED = 2
    DELETING = 3


class Claim(IntEnum):
    """What a session's claim on a chunk found."""

    DEDUP = 0  # durable object present: reference it, write nothing
    WRITE = 1  # absent or not yet durable: write it (put-if-absent)
    WAIT = 2  # GC is deleting it: retry shortly, then write


@dataclass(frozen=True)
class ChunkRecord:
    state: ChunkState
    codec_id: int
    refcount: int
    raw_length: int
    stored_length: int
    since: float  # when the state or refcount last changed to what it is

    def pack(self) -> bytes:
        return _CHUNK.pack(self.state, self.codec_id, self.refcount, self.raw_length,
                           self.stored_length, self.since)

    @classmethod
    def unpack(cls, data: bytes | memoryview) -> ChunkRecord:
        state, codec_id, refcount, raw, stored, since = _CHUNK.unpack(data)
        return cls(ChunkState(state), codec_id, refcount, raw, stored, since)


@dataclass(frozen=True)
class NewChunk:
    """A chunk a session wrote: what the commit records about it."""

    digest: Digest
    codec_id: int
    raw_length: int
    stored_length: int


@dataclass(frozen=True)
class NewVersion:
    """A version to count in (:meth:`Index.add_versions`): its entry, the chunks it
    references, its nodes with their sizes (0: unknown), the chunks it wrote, where
    its packed chunks lie, its census contribution (None: not counted), and the
    number of entries of a version its own save built (None: not known readable; see
    :meth:`Index.verified_versions`)."""

    entry: VersionEntry
    refs: Iterable[Digest]
    nodes: dict[Digest, int]
    new_chunks: Iterable[NewChunk] = ()
    packed: dict[Digest, PackLocation] | None = None
    census: bytes | None = None
    built_entries: int | None = None


#: Indexes open in this process, by real path: LMDB allows one environment per file
#: per process, so every handle on one store here shares one (:func:`open_index`).
_OPEN: dict[str, Index] = {}
_OPEN_LOCK = threading.Lock()
if hasattr(os, "register_at_fork"):
    # LMDB forbids using an environment after fork(): a child opens its own.  The
    # parent's are dropped from the table, not closed (closing is the parent's).
    os.register_at_fork(after_in_child=_OPEN.clear)


@dataclass(frozen=True)
class VerifiedVersion:
    """A version a verify found readable, as the index holds it (raw 32-byte digests
    laid end to end)."""

    entry: VersionEntry
    entries: int
    chunk_refs: bytes
    node_refs: bytes
    #: recorded by the save that built the version (its tree never read back), not by a
    #: verify that read it
    by_its_save: bool = False


_PENDING = struct.Struct("<I")  # a pending entry: its chunk digests' count, then both
_NONCE = 8  # random bytes after the version id in a pending entry's key


def _pending_value(chunks: list[Digest], nodes: list[Digest]) -> bytes:
    return _PENDING.pack(len(chunks)) + b"".join(d.raw for d in chunks) \
        + b"".join(d.raw for d in nodes)


def _deferred(value: bytes | memoryview, kind: bytes) -> bytes:
    """The digests of ``kind`` a ``pending`` entry defers, laid end to end."""
    data = bytes(value)
    split = _PENDING.size + 32 * _PENDING.unpack_from(data)[0]
    return data[_PENDING.size:split] if kind == CHUNK else data[split:]


def _digest_set(raw: bytes) -> set[bytes]:
    return {raw[i:i + 32] for i in range(0, len(raw), 32)}


def open_index(path: str) -> Index:
    """The index at ``path``, shared with every other handle of this process that has
    it open (a Checkpointer and ``chunkstore.open`` of its store, two Checkpointers):
    each opener calls :meth:`Index.close` once, and the last one closes it."""
    key = os.path.realpath(path)
    with _OPEN_LOCK:
        index = _OPEN.get(key)
        if index is not None:
            index._openers += 1
            return index
        try:
            index = Index(path, wait_s=writegate.OPEN_WAIT_S)
        except writegate.WriterBusy as exc:
            return private_index(path, str(exc))
        index._shared_as = key
        _OPEN[key] = index
        return index


def private_index(path: str, reason: str) -> Index:
    """An empty index of this process's own, deleted when it closes, for a store whose
    index at ``path`` another process keeps busy (``reason``): the store fills it
    (``reconcile``) and every rule of docs/format.md §11 holds with it as with any
    other index, so nothing waits for the busy one."""
    scratch = tempfile.mkdtemp(prefix="chunkstore-private-index-")
    log.warning("the index at %s is busy (%s): this process works from a private index"
                " built from the store, at %s", path, reason, scratch)
    index = Index(scratch)
    index._private = True
    return index


class Index(VersionLookups):
    """One LMDB environment; safe to share between threads and processes.

    ``needs_rebuild`` is set when the index on disk was written by another
    index schema (it is then emptied), or was damaged and set aside
    (:mod:`chunkstore.index.indexfile`): the store rebuilds it from the manifests.
    """

    def __init__(self, path: str, map_size: int = DEFAULT_MAP_SIZE,
                 wait_s: float | None = None) -> None:
        """Open (or make) the index at ``path``; with ``wait_s``, :class:`WriterBusy`
        when another process holds its writer longer than that (opening the tables
        is a write transaction: :mod:`chunkstore.index.writegate`)."""
        self.path = path
        self._openers = 1
        self._shared_as = ""  # the key in _OPEN, for an index open_index shares
        self._private = False  # a private_index: its directory goes with its last close
        self._warned_orders = False  # see _orders_in_step
        #: the pending counts as of one committed state (:meth:`_pending_at`)
        self._pending_seen: tuple[Any, int, tuple[bytes, ...], Counter[tuple[bytes, bytes]]
                                  ] | None = None
        #: sessions opened ``deferred`` that no write transaction has stored yet (by id:
        #: their record), and the lock that guards the table (:meth:`open_session`)
        self._unwritten: dict[str, dict[str, Any]] = {}
        self._unwritten_lock = threading.Lock()
        self._map_size = indexfile.map_size(map_size)
        self.env, damaged = indexfile.open_env(path, self._map_size)
        self._gate = writegate.WriteGate(path)
        try:
            other_schema = self._open_tables(wait_s)
        except indexfile.DAMAGE as exc:
            self._close_env()
            indexfile.set_aside(path, f"{type(exc).__name__}: {exc}")
            self.env, _ = indexfile.open_env(path, self._map_size)
            self._gate = writegate.WriteGate(path)
            other_schema, damaged = self._open_tables(), True
        except BaseException:
            self._close_env()
            raise
        self.needs_rebuild = other_schema or damaged

    def reset(self, reason: str) -> None:
        """Set this (damaged) index aside and start an empty one in its place."""
        self._close_env()
        indexfile.set_aside(self.path, reason)
        self.env, _ = indexfile.open_env(self.path, self._map_size)
        self._gate = writegate.WriteGate(self.path)
        self._open_tables()

    def _close_env(self) -> None:
        indexfile.close_env(self.env)
        self._gate.close()

    def _open_tables(self, wait_s: float | None = None) -> bool:
        """Open every table; True when the index was written by another schema.
        py-lmdb opens each table in a write transaction: behind the gate, with
        ``wait_s``."""
        with self._gate.held(wait_s):
            return self._open_tables_held()

    def _open_tables_held(self) -> bool:
        self.chunks = self.env.open_db(b"chunks")
        self.nodes = self.env.open_db(b"nodes")
        self.zero = self.env.open_db(b"zero")  # kind + digest -> since, for refcount 0
        self.versions_db = self.env.open_db(b"versions")
        self.refs = self.env.open_db(b"refs")  # version id -> chunk digests
        self.node_refs = self.env.open_db(b"node_refs")  # version id -> node digests
        self.tags_db = self.env.open_db(b"tags")
        self.sessions = self.env.open_db(b"sessions")
        self.claims = self.env.open_db(b"claims")  # digest + session id
        self.session_claims = self.env.open_db(b"session_claims")  # session id + digest
        self.meta = self.env.open_db(b"meta")
        self.journal = self.env.open_db(b"journal")  # GC journal entry ids applied here
        # member digest -> pack digest, offset, length: where a packed chunk was
        # stored (a dedup cache; a missing entry only means "write it again")
        self.packed = self.env.open_db(b"packed")
        # pack digest + member digest -> b"": the entries of ``packed`` that name each
        # pack, forgotten with the pack (_forget_pack)
        self.packed_by = self.env.open_db(b"packed_by")
        # the versions in two orders (chunkstore.index.versiontables): by run, step,
        # time and id; by time and id
        self.versions_by_run = self.env.open_db(b"versions_by_run")
        self.versions_by_time = self.env.open_db(b"versions_by_time")
        # version id -> stamp + entry count: the version passed verify's checks of its
        # record and manifest tree (:meth:`verified_versions`)
        self.verified = self.env.open_db(b"verified")
        # version id -> stamp + what report's census counted of its manifests
        # (:meth:`census`)
        self.census_db = self.env.open_db(b"census")
        # version id + a nonce -> references its count-in did not add to refcounts already at
        # least 1 (:meth:`_add`), folded in later (:meth:`_fold`)
        self.pending = self.env.open_db(b"pending")
        other_schema = self._check_schema()
        self.reader_check()
        return other_schema

    def reader_check(self) -> None:
        """Free the reader slots of killed processes (they pin old pages and fill the table)."""
        self.env.reader_check()

    def _check_schema(self) -> bool:
        """Stamp a new index with the schema; True when an existing one has another."""
        with self.env.begin(db=self.meta) as txn:  # the usual answer, without the writer
            stamped = txn.get(b"schema")
            if stamped is not None and int(stamped) == INDEX_SCHEMA:
                return False
        with self._writing() as txn:
            found = txn.get(b"schema", db=self.meta)
            if found is not None and int(found) == INDEX_SCHEMA:
                return False
            if found is not None and int(found) in _MIGRATED_SCHEMAS:
                self._migrate(txn, int(found))
                return False
            empty = found is None and txn.stat(self.versions_db)["entries"] == 0 \
                and txn.stat(self.chunks)["entries"] == 0
            if empty:
                self._stamp_empty(txn)
            return not empty

    def _migrate(self, txn: lmdb.Transaction, schema: int) -> None:
        """Schema 2, 3 or 4 -> 5 in the checking transaction.  2 -> 3: ``packed_by``
        made afresh from ``packed``; 3 -> 4: the orders of the versions made afresh from
        ``versions``; 4 -> 5: ``pending`` starts empty (an index of schema 4 counted
        every reference in).  (A table an earlier release may have left stale, after a
        downgrade, is dropped first: ``pending`` always, as a release of schema 4 that
        rebuilt an index of 5 left the table as it found it.)  Nothing else changed
        between them."""
        if schema < 3:
            txn.drop(self.packed_by, delete=False)
            for member, value in txn.cursor(db=self.packed):
                txn.put(bytes(value)[:32] + bytes(member), b"", db=self.packed_by)
        if schema < 4:
            versiontables.fill(txn, self.versions_db, self._orders())
        txn.drop(self.pending, delete=False)
        txn.put(b"schema", str(INDEX_SCHEMA).encode(), db=self.meta)


    def _stamp_empty(self, txn: lmdb.Transaction) -> None:
        """Stamp an index that holds nothing: the schema, and, as nothing is in it yet,
        that it has missed no GC journal entry."""
        txn.put(b"schema", str(INDEX_SCHEMA).encode(), db=self.meta)
        txn.put(b"journal_synced", str(time.time_ns()).encode(), db=self.meta)

    def _drop_records(self, txn: lmdb.Transaction) -> None:
        for db in self._tables():
            txn.drop(db, delete=False)

    def _tables(self) -> tuple[Any, ...]:
        return (self.chunks, self.nodes, self.zero, self.versions_db, self.refs,
                self.node_refs, self.tags_db, self.sessions, self.claims, self.session_claims,
                self.journal, self.packed, self.packed_by, self.versions_by_run,
                self.versions_by_time, self.verified, self.census_db, self.pending)

    def close(self) -> None:
        """Close this opener's use; the environment closes with its last opener
        (:func:`open_index`)."""
        with _OPEN_LOCK:
            self._openers -= 1
            if self._openers > 0:
                return
            if _OPEN.get(self._shared_as) is self:
                del _OPEN[self._shared_as]
        self._close_env()
        if self._private:
            shutil.rmtree(self.path, ignore_errors=True)

    @contextlib.contextmanager
    def _writing(self, db: Any = None, wait_s: float | None = None, session: str = ""
                 ) -> Iterator[lmdb.Transaction]:
        """A write transaction, behind the write gate (:class:`WriterBusy` past
        ``wait_s``); a full disk undoes it and is a ``StorageFullError``.  A deferred
        ``session`` not stored yet is stored in it, first (:meth:`open_session`)."""
        try:
            with self._gate.held(wait_s):
                record = self._take_unwritten(session)
                try:
                    with self.env.begin(write=True, db=db) as txn:
                        if record is not None:
                            txn.put(session.encode(), record, db=self.sessions)
                        yield txn
                except BaseException:
                    if record is not None:  # undone with the transaction: still to store
                        self._put_back_unwritten(session, record)
                    raise
        except lmdb.Error as exc:
            if indexfile.is_full(exc, self.path):
                raise indexfile.full(self.path, exc) from exc
            raise

    def reserve_plan(self) -> indexfile.ReservePlan:
        """The space reserve for ``rm`` and ``gc`` on a full disk: held, and needed by
        this store (it follows the pages the tables use and the number of versions)."""
        with self.env.begin() as txn:
            stats = [self.env.stat()] + [txn.stat(db) for db in (*self._tables(), self.meta)]
            versions = int(txn.stat(self.versions_db)["entries"])
        pages = sum(s["branch_pages"] + s["leaf_pages"] + s["overflow_pages"] for s in stats)
        index_bytes = int(pages * stats[0]["psize"])
        return indexfile.ReservePlan(
            path=self.path, held=indexfile.held_reserve(self.path),
            needed=indexfile.reserve_needed(index_bytes, versions), index_bytes=index_bytes,
            versions=versions, fixed=indexfile.fixed_reserve() is not None)

    def keep_reserve(self) -> None:
        """Make the space reserve ``rm`` and ``gc`` use on a full disk, or resize it to
        what the store needs now."""
        indexfile.keep_reserve(self.path, self.reserve_plan().needed)

    def release_reserve_if_low(self) -> bool:
        """Give up the space reserve when the filesystem is nearly full (``rm``, ``gc``)."""
        return indexfile.release_reserve_if_low(self.path, self.reserve_plan().needed)

    def sync(self) -> None:
        self.env.sync(True)

    # --- object records (chunks and nodes) -----------------------------------------------

    def _db(self, kind: bytes) -> Any:
        return self.chunks if kind == CHUNK else self.nodes

    @staticmethod
    def _get(txn: lmdb.Transaction, db: Any, digest: Digest) -> ChunkRecord | None:
        data = txn.get(digest.raw, db=db)
        return ChunkRecord.unpack(data) if data else None

    def _put(self, txn: lmdb.Transaction, kind: bytes, digest: Digest, rec: ChunkRecord) -> None:
        """Write a record and keep the ``zero`` table in step with its refcount."""
        txn.put(digest.raw, rec.pack(), db=self._db(kind))
        if rec.refcount == 0 or rec.state == ChunkState.DELETING:
            txn.put(kind + digest.raw, _SINCE.pack(rec.since), db=self.zero)
        else:
            txn.delete(kind + digest.raw, db=self.zero)

    def _delete(self, txn: lmdb.Transaction, kind: bytes, digest: Digest) -> None:
        txn.delete(digest.raw, db=self._db(kind))
        txn.delete(kind + digest.raw, db=self.zero)

    def chunk(self, digest: Digest) -> ChunkRecord | None:
        return self.record(CHUNK, digest)

    def record(self, kind: bytes, digest: Digest) -> ChunkRecord | None:
        """The object's record, its refcount exact (the references not yet folded in
        added, :meth:`_fold`)."""
        with self.env.begin() as txn:
            rec = self._get(txn, self._db(kind), digest)
            if rec is None or not txn.stat(self.pending)["entries"]:
                return rec
            extra = self._pending_at(txn).get((kind, digest.raw), 0)
            return replace(rec, refcount=rec.refcount + extra) if extra else rec

    def iter_chunks(self) -> Iterator[tuple[Digest, ChunkRecord]]:
        return self.iter_records(CHUNK)

    def iter_records(self, kind: bytes) -> Iterator[tuple[Digest, ChunkRecord]]:
        """Every record of ``kind``, its refcount exact (as :meth:`record`)."""
        with self.env.begin(db=self._db(kind)) as txn:
            extra = self._pending_at(txn)
            for key, value in txn.cursor():
                rec = ChunkRecord.unpack(value)
                if (n := extra.get((kind, bytes(key)))):
                    rec = replace(rec, refcount=rec.refcount + n)
                yield Digest(bytes(key)), rec

    def pending_versions(self) -> int:
        """How many versions' references are not folded into the refcounts yet."""
        with self.env.begin() as txn:
            return int(txn.stat(self.pending)["entries"])

    def count(self, kind: bytes) -> int:
        with self.env.begin() as txn:
            return int(txn.stat(self._db(kind))["entries"])

    def claim_chunk(self, session_id: str, digest: Digest) -> Claim:
        """Record that the session uses ``digest`` and say whether to write it."""
        return self.claim_many(session_id, CHUNK, [digest])[digest]

    def claim_nodes(self, session_id: str, digests: Iterable[Digest]) -> dict[Digest, Claim]:
        """Claim a version's manifest nodes in one transaction."""
        return self.claim_many(session_id, NODE, digests)

    def claim_many(self, session_id: str, kind: bytes, digests: Iterable[Digest]
                   ) -> dict[Digest, Claim]:
        """Claim several objects of one kind in one transaction (one commit, one sync)."""
        return self.claim_kinds(session_id, {kind: digests})[kind]

    def claim_kinds(self, session_id: str, objects: dict[bytes, Iterable[Digest]]
                    ) -> dict[bytes, dict[Digest, Claim]]:
        """Claim objects of several kinds (``objects``: kind -> digests) in one
        transaction: a commit's nodes with the last pack it sealed."""
        now = time.time()
        sid = session_id.encode()
        with self._writing(session=session_id) as txn:
            return {kind: {d: self._claim(txn, sid, kind, d, now) for d in digests}
                    for kind, digests in objects.items()}

    def _claim(self, txn: lmdb.Transaction, sid: bytes, kind: bytes, digest: Digest,
               now: float) -> Claim:
        record = self._get(txn, self._db(kind), digest)
        if record is not None and record.state == ChunkState.DELETING:
            return Claim.WAIT
        txn.put(digest.raw + sid, b"", db=self.claims)
        txn.put(sid + digest.raw, b"", db=self.session_claims)
        if record is None:
            self._put(txn, kind, digest, ChunkRecord(ChunkState.WRITING, 0, 0, 0, 0, now))
            return Claim.WRITE
        if record.state == ChunkState.CONDEMNED:
            # Resurrect under this transaction: GC re-checks the state before
            # deleting, so it leaves the object alone from now on.  The writer
            # still writes it (put-if-absent keeps an intact object, rewrites
            # a vanished one), never trusting an object GC had given up on.
            self._put(txn, kind, digest, replace(record, state=ChunkState.WRITING, since=now))
            return Claim.WRITE
        return Claim.DEDUP if record.state == ChunkState.LIVE else Claim.WRITE

    def claim_small(self, session_id: str, digests: Iterable[Digest]
                    ) -> dict[Digest, tuple[Claim, PackLocation | None]]:
        """Claim what a batch of small chunks can reuse, in one transaction.

        A chunk stored as an object of its own (LIVE) is claimed as
        :meth:`claim_many` claims it; else a chunk this index saw stored inside a
        pack whose record is LIVE gets the pack claimed (the pack, never the
        member: a member is not an object) and its location; else nothing is
        claimed and the answer is WRITE: the writer stores the chunk in a new pack.
        """
        digests = list(digests)
        # A batch none of whose chunks this index has a record or a pack location for is
        # answered from a read transaction: the write transaction below would write
        # nothing for it and answer WRITE for each, but would wait for the index's single
        # writer, which every worker's claims and commits contend for (a delta save claims
        # the changed chunks of its larger tensors a few at a time).  The answer is the one
        # the write transaction would have given at the snapshot, and a WRITE grants no
        # dedup: the chunk is written under the save's session, which protects it whatever
        # the index holds.
        with self.env.begin() as txn:
            if not any(txn.get(d.raw, db=self.chunks) is not None
                       or txn.get(d.raw, db=self.packed) is not None for d in digests):
                return {d: (Claim.WRITE, None) for d in digests}
        now = time.time()
        sid = session_id.encode()
        found: dict[Digest, tuple[Claim, PackLocation | None]] = {}
        # Each pack is looked up and claimed once per transaction, however many of
        # its members the batch reuses: None when it is not LIVE, ``gone`` when deleted.
        packs: dict[Digest, Claim | None] = {}
        gone: set[Digest] = set()
        with self._writing(session=session_id) as txn:
            for digest in digests:
                record = self._get(txn, self.chunks, digest)
                if record is not None and record.state == ChunkState.LIVE:
                    found[digest] = (self._claim(txn, sid, CHUNK, digest, now), None)
                    continue
                location = self._packed(txn, digest)
                if location is None:
                    found[digest] = (Claim.WRITE, None)
                    continue
                if location.pack not in packs:
                    pack = self._get(txn, self.chunks, location.pack)
                    live = pack is not None and pack.state == ChunkState.LIVE
                    packs[location.pack] = (self._claim(txn, sid, CHUNK, location.pack, now)
                                            if live else None)
                    if pack is None:
                        gone.add(location.pack)
                claimed = packs[location.pack]
                if claimed is None:
                    if location.pack in gone:  # deleted: no location in it is of further use
                        self._forget_pack(txn, location.pack)
                    found[digest] = (Claim.WRITE, None)
                    continue
                found[digest] = (claimed, location)
        return found

    def _packed(self, txn: lmdb.Transaction, digest: Digest) -> PackLocation | None:
        data = txn.get(digest.raw, db=self.packed)
        if data is None:
            return None
        pack, offset, length = _PACKED.unpack(data)
        return PackLocation(Digest(pack), offset, length)

    def _remember_packed(self, txn: lmdb.Transaction, member: Digest,
                         location: PackLocation) -> None:
        """Record where ``member`` lies; the reverse entry of a location it replaces goes.
        A location recorded already is left alone: every save names where each of its
        unchanged members lies, and rewriting the same bytes would dirty (and sync) a
        page of each table per member, in tables that grow with the store."""
        value = _PACKED.pack(location.pack.raw, location.offset, location.length)
        old = txn.get(member.raw, db=self.packed)
        if old is not None and bytes(old) == value:
            return  # and its reverse entry is there (packed_by follows packed)
        if old is not None and bytes(old)[:32] != location.pack.raw:
            txn.delete(bytes(old)[:32] + member.raw, db=self.packed_by)
        txn.put(member.raw, value, db=self.packed)
        txn.put(location.pack.raw + member.raw, b"", db=self.packed_by)

    def _forget_pack(self, txn: lmdb.Transaction, pack: Digest) -> None:
        """Forget every location inside ``pack`` (deleted, or no longer trusted to be
        stored): a member it held is written again, or found in another pack."""
        cursor = txn.cursor(db=self.packed_by)
        keys = []
        if cursor.set_range(pack.raw):
            for key in cursor.iternext(values=False):
                raw = bytes(key)
                if not raw.startswith(pack.raw):
                    break
                keys.append(raw)
        for key in keys:
            member = key[32:]
            location = txn.get(member, db=self.packed)
            if location is not None and bytes(location)[:32] == pack.raw:
                txn.delete(member, db=self.packed)
            txn.delete(key, db=self.packed_by)

    def packed_count(self) -> tuple[int, int]:
        """Entries of the ``packed`` table and of its reverse table ``packed_by``."""
        with self.env.begin() as txn:
            return (int(txn.stat(self.packed)["entries"]),
                    int(txn.stat(self.packed_by)["entries"]))

    def pack_location(self, digest: Digest) -> PackLocation | None:
        """Where this index saw ``digest`` stored inside a pack, if it did."""
        with self.env.begin() as txn:
            return self._packed(txn, digest)

    def is_claimed(self, digest: Digest, txn: lmdb.Transaction | None = None) -> bool:
        if txn is None:
            with self.env.begin() as own:
                return self.is_claimed(digest, own)
        cursor = txn.cursor(db=self.claims)
        return bool(cursor.set_range(digest.raw)) and bytes(cursor.key()).startswith(digest.raw)

    # --- nodes ---------------------------------------------------------------------------

    # --- sessions ------------------------------------------------------------------------

    def open_session(self, purpose: str, deferred: bool = False) -> str:
        """A new write session; ``deferred``: stored by the first write transaction that
        claims for it (:meth:`claim_many`, :meth:`claim_small`, :meth:`claim_kinds`), in
        that transaction, instead of one of its own (a commit and a sync).

        What a session protects is its claims, and a deferred one is stored, with its
        heartbeat, in the transaction of its first claim, before that claim: GC never
        sees a claim without its session, so one left by a killed process is expired
        with it (a session that never claimed is never stored, and has nothing to
        expire).  Until then it holds nothing: :meth:`heartbeat` says it is alive,
        :meth:`close_session` forgets it, :meth:`add_version` drops nothing for it."""
        session_id = uuid.uuid4().hex
        now = time.time()
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": now,
                "heartbeat": now, "purpose": purpose, "process_start": process_start(os.getpid()),
                "pidns": pid_namespace()}
        if deferred:
            with self._unwritten_lock:
                self._unwritten[session_id] = info
            return session_id
        with self._writing(db=self.sessions) as txn:
            txn.put(session_id.encode(), json.dumps(info).encode())
        return session_id

    def _take_unwritten(self, session_id: str) -> bytes | None:
        """The record of a deferred session not stored yet, its heartbeat now (and the
        session no longer unwritten); None for any other."""
        if not session_id:
            return None
        with self._unwritten_lock:
            info = self._unwritten.pop(session_id, None)
        if info is None:
            return None
        return json.dumps({**info, "heartbeat": time.time()}).encode()

    def _put_back_unwritten(self, session_id: str, record: bytes) -> None:
        with self._unwritten_lock:
            self._unwritten[session_id] = json.loads(record)

    def _forget_unwritten(self, session_id: str) -> bool:
        """Forget a deferred session no transaction stored; whether it was one."""
        with self._unwritten_lock:
            return self._unwritten.pop(session_id, None) is not None

    def heartbeat(self, session_id: str) -> bool:
        """Mark the session alive now; False when GC has expired it (its claims are gone)."""
        with self._unwritten_lock:
            if session_id in self._unwritten:  # not stored yet: nothing to refresh
                return True
        with self._writing(db=self.sessions) as txn:
            data = txn.get(session_id.encode())
            if data is None:
                return False
            info = json.loads(bytes(data))
            info["heartbeat"] = time.time()
            txn.put(session_id.encode(), json.dumps(info).encode())
            return True

    def list_sessions(self) -> dict[str, dict[str, Any]]:
        with self.env.begin(db=self.sessions) as txn:
            return {bytes(k).decode(): json.loads(v) for k, v in txn.cursor()}

    def _drop_session(self, txn: lmdb.Transaction, session_id: str) -> None:
        sid = session_id.encode()
        cursor = txn.cursor(db=self.session_claims)
        digests = []
        if cursor.set_range(sid):
            for key in cursor.iternext(values=False):
                if not bytes(key).startswith(sid):
                    break
                digests.append(bytes(key)[len(sid):])
        for raw in digests:
            txn.delete(sid + raw, db=self.session_claims)
            txn.delete(raw + sid, db=self.claims)
        txn.delete(sid, db=self.sessions)

    def close_session(self, session_id: str) -> None:
        """Forget a session's claims (abort, or after its commit transaction)."""
        if self._forget_unwritten(session_id):
            return  # never stored, so it never claimed
        with self._writing() as txn:
            self._drop_session(txn, session_id)

    # --- versions ------------------------------------------------------------------------

    def add_version(self, entry: VersionEntry, refs: Iterable[Digest], nodes: dict[Digest, int],
                    new_chunks: Iterable[NewChunk], session_id: str | None = None,
                    packed: dict[Digest, PackLocation] | None = None,
                    census: bytes | None = None, built_entries: int | None = None) -> bool:
        """Count one version in: its chunks' and nodes' refcounts, and the chunks it wrote.

        ``nodes`` maps every node of the version's tree to its size in bytes
        (0 when unknown); ``packed`` where its packed chunks lie (remembered for
        deduplication); ``census`` what report's census counts of it, where the
        caller read its manifests anyway (:meth:`note_census`, in this transaction);
        ``built_entries`` the number of entries of the tree the caller built and
        published itself, recorded as known readable (:meth:`verified_versions`).
        Returns False when ``session_id`` no longer exists (GC expired it, so its
        claims did not protect what it reused).
        """
        now = time.time()
        # A deferred session never stored claimed nothing: alive, with nothing to drop.
        unwritten = session_id is not None and self._forget_unwritten(session_id)
        with self._writing() as txn:
            alive = session_id is None or unwritten or txn.get(session_id.encode(),
                                                               db=self.sessions) is not None
            self._add(txn, NewVersion(entry, refs, nodes, new_chunks, packed, census,
                                      built_entries), now)
            if session_id:
                self._drop_session(txn, session_id)
        return alive

    def add_versions(self, versions: Iterable[NewVersion]) -> list[str]:
        """Count versions in as :meth:`add_version` does, in one transaction (one
        commit, one sync, for the hundreds an open counts in); return the ids of
        those the index did not hold before."""
        now = time.time()
        bumps: Counter[tuple[bytes, bytes]] = Counter()
        with self._writing() as txn:
            added = [version.entry.id for version in versions
                     if self._add(txn, version, now, bumps)]
            # Each object's refcount written once (the batch's versions share most of
            # theirs); raised by n at once it ends as n raises of one would.
            # Bumped with the batch's, the references still pending go in as well.
            if added:
                self._pending_into(txn, bumps)
            for (kind, raw), n in sorted(bumps.items()):
                self._bump(txn, kind, Digest(raw), n, now)
        return added

    def _add(self, txn: lmdb.Transaction, version: NewVersion, now: float,
             bumps: Counter[tuple[bytes, bytes]] | None = None) -> bool:
        """Count one version in (:meth:`add_version`); False if the index holds it.
        With ``bumps``, its references are added there, not to the refcounts.

        Without, a reference to a LIVE object already counted (refcount 1 or more) whose
        record this transaction does not write anyway is deferred: listed in the
        ``pending`` table, not written into the record (at 10,000 versions the records a
        save references lie on as many leaf pages).  The ``zero`` table stays exact (no
        such object is at zero); a refcount is exact only with the table added
        (:meth:`record`), and the table is folded in before any refcount drops
        (:meth:`_fold`), and by the save that finds it holding :data:`FOLD_AFTER`
        versions."""
        entry = version.entry
        if txn.get(entry.id.encode(), db=self.versions_db) is not None:
            return False
        written: set[tuple[bytes, bytes]] = set()
        for chunk in version.new_chunks:
            old = self._get(txn, self.chunks, chunk.digest)
            if old is None or old.state == ChunkState.WRITING:
                rec = ChunkRecord(ChunkState.LIVE, chunk.codec_id, old.refcount if old else 0,
                                  chunk.raw_length, chunk.stored_length, now)
                self._put(txn, CHUNK, chunk.digest, rec)
                written.add((CHUNK, chunk.digest.raw))
        for digest, size in version.nodes.items():
            old = self._get(txn, self.nodes, digest)
            if size and (old is None or old.state == ChunkState.WRITING):
                rec = ChunkRecord(ChunkState.LIVE, 0, old.refcount if old else 0, size, size,
                                  now)
                self._put(txn, NODE, digest, rec)
                written.add((NODE, digest.raw))
        ref_list = sorted(set(version.refs))
        node_list = sorted(version.nodes)
        if bumps is not None:
            bumps.update((CHUNK, d.raw) for d in ref_list)
            bumps.update((NODE, d.raw) for d in node_list)
        else:
            self._count_refs(txn, entry.id, ref_list, node_list, written, now)
        txn.put(entry.id.encode(), entry.to_json(), db=self.versions_db)
        versiontables.put(txn, self._orders(), entry)
        txn.put(entry.id.encode(), b"".join(d.raw for d in ref_list), db=self.refs)
        txn.put(entry.id.encode(), b"".join(d.raw for d in node_list), db=self.node_refs)
        for member, location in (version.packed or {}).items():
            self._remember_packed(txn, member, location)
        self._derive(txn, version)
        return True

    def _count_refs(self, txn: lmdb.Transaction, version_id: str, ref_list: list[Digest],
                    node_list: list[Digest], written: set[tuple[bytes, bytes]],
                    now: float) -> None:
        """Raise the refcounts of one version's references, or defer them (:meth:`_add`)."""
        deferred: dict[bytes, list[Digest]] = {CHUNK: [], NODE: []}
        for kind, digests in ((CHUNK, ref_list), (NODE, node_list)):
            for digest in digests:
                rec = self._get(txn, self._db(kind), digest)
                if rec is not None and rec.refcount >= 1 and rec.state == ChunkState.LIVE \
                        and (kind, digest.raw) not in written:
                    deferred[kind].append(digest)
                else:
                    self._bump(txn, kind, digest, +1, now)
        if 32 * (len(deferred[CHUNK]) + len(deferred[NODE])) > PENDING_BYTES:
            for kind, digests in deferred.items():
                for digest in digests:
                    self._bump(txn, kind, digest, +1, now)
            deferred = {CHUNK: [], NODE: []}
        if deferred[CHUNK] or deferred[NODE]:
            # Keyed by the version and a nonce: a key names one write of its entry (a
            # version counted out and in again gets another), which is what
            # :meth:`_pending_at` tells the table's states apart by.
            txn.put(version_id.encode() + os.urandom(_NONCE),
                    _pending_value(deferred[CHUNK], deferred[NODE]), db=self.pending)
        held = txn.stat(self.pending)
        if held["entries"] >= FOLD_AFTER or held["psize"] * (
                held["leaf_pages"] + held["overflow_pages"]) > PENDING_BYTES:
            self._fold(txn, now)

    def _derive(self, txn: lmdb.Transaction, version: NewVersion) -> None:
        """Record what the caller derived of a version it counts in (its census, and
        that it is readable where its own save built it), bound to the version as just
        put (:mod:`chunkstore.index.derived`)."""
        if version.census is None and version.built_entries is None:
            return
        tables = self._derived_tables()
        parts = tables.parts(txn, version.entry.id.encode())
        assert parts is not None  # put by the caller, in this transaction
        epoch = derived.writing_epoch(txn, tables)
        if version.census is not None:
            derived.write(txn, self.census_db, epoch, version.entry.id, parts, version.census)
        if version.built_entries is not None:
            derived.write(txn, self.verified, epoch, version.entry.id, parts,
                          version.built_entries.to_bytes(8, "big") + _BY_ITS_SAVE)

    def remove_version(self, version_id: str) -> bool:
        """Count a version out; return whether the index knew it."""
        return self.remove_versions([version_id]) == 1

    def remove_versions(self, version_ids: Iterable[str]) -> int:
        """Count versions out in one transaction (one commit, one sync, for a thousand
        removed by a prune; each object's refcount written once); return how many the
        index knew."""
        now = time.time()
        dropped: Counter[tuple[bytes, bytes]] = Counter()
        with self._writing() as txn:
            known = [key for key in map(str.encode, version_ids)
                     if self._count_out(txn, key, dropped)]
            if not known:
                return 0
            # No refcount drops while references to it are pending (it would reach zero
            # with versions still referencing its object): all are folded in first.
            self._fold(txn, now)
            # A refcount dropped by n at once ends as n drops of one would: a CONDEMNED
            # record has none (a reference makes it WRITING), so only the count and its
            # time change.
            for (kind, raw), n in sorted(dropped.items()):
                self._bump(txn, kind, Digest(raw), -n, now)
            removals = int(txn.get(b"removals", db=self.meta) or b"0")
            txn.put(b"removals", str(removals + len(known)).encode(), db=self.meta)
            gone = set(known)
            for tag, target in list(txn.cursor(db=self.tags_db)):
                if bytes(target) in gone:
                    txn.delete(bytes(tag), db=self.tags_db)
        return len(known)

    def _count_out(self, txn: lmdb.Transaction, key: bytes,
                   dropped: Counter[tuple[bytes, bytes]]) -> bool:
        """Delete a version's entries; add the references it held to ``dropped``."""
        found = txn.get(key, db=self.versions_db)
        if found is None:
            return False
        versiontables.delete(txn, self._orders(), VersionEntry.from_json(bytes(found)))
        for kind, db in ((CHUNK, self.refs), (NODE, self.node_refs)):
            refs = bytes(txn.get(key, db=db) or b"")
            dropped.update((kind, refs[i:i + 32]) for i in range(0, len(refs), 32))
            txn.delete(key, db=db)
        txn.delete(key, db=self.versions_db)
        derived.delete(txn, self.verified, key)
        derived.delete(txn, self.census_db, key)
        return True

    def _pending_counts(self, txn: lmdb.Transaction) -> Counter[tuple[bytes, bytes]]:
        """The references the ``pending`` table defers, by kind and raw digest."""
        counts: Counter[tuple[bytes, bytes]] = Counter()
        for _, value in txn.cursor(db=self.pending):
            for kind in KINDS:
                raw = _deferred(value, kind)
                counts.update((kind, raw[i:i + 32]) for i in range(0, len(raw), 32))
        return counts

    def _pending_at(self, txn: lmdb.Transaction) -> Counter[tuple[bytes, bytes]]:
        """:meth:`_pending_counts` in a read transaction, counted once per committed
        state (a read's id is the last commit's): a loop of :meth:`record` reads does
        not add the table up each time.  Not to be changed by the caller."""
        seen, at = self._pending_seen, txn.id()
        if seen is not None and seen[0] is self.env and seen[1] == at:
            return seen[3]
        # Any commit renews the id (a session's heartbeat, a claim, in any process);
        # the table's keys, each naming one write of an entry (:meth:`_count_refs`),
        # say whether the table changed: a loop of reads among other commits does not
        # add it up again after each (at 63 pending versions of 10,000 references,
        # 139 ms a read when it did).
        keys = tuple(bytes(k) for k in txn.cursor(db=self.pending).iternext(values=False))
        if seen is not None and seen[0] is self.env and seen[2] == keys:
            counts = seen[3]
        else:
            counts = self._pending_counts(txn)
        self._pending_seen = (self.env, at, keys, counts)
        return counts

    def _pending_into(self, txn: lmdb.Transaction, bumps: Counter[tuple[bytes, bytes]]
                      ) -> int:
        """Move the ``pending`` table's references into ``bumps`` (the caller bumps
        them, in this transaction); return how many versions it held."""
        held = int(txn.stat(self.pending)["entries"])
        if held:
            bumps.update(self._pending_counts(txn))
            txn.drop(self.pending, delete=False)
        return held

    def _fold(self, txn: lmdb.Transaction, now: float) -> int:
        """Add every deferred reference to its refcount (each record written once, as
        :meth:`add_versions` does) and empty the ``pending`` table; return how many
        versions' references it held.

        Each such object had a record, LIVE at refcount 1 or more, when its reference
        was deferred, and no refcount has dropped since (a drop folds first): nothing
        deletes a record at refcount 1 or more (:meth:`finish_deletes` keeps it
        WRITING; a GC journal entry applied, or an object found missing, keeps it too),
        so the record is there.  Where it is not (an index edited by hand), the bump
        makes one as a count-in of an unreadable object does: WRITING, no dedup
        target, counting the pending references (skipping them would leave the
        pending versions' objects at zero, GC's candidates); verify reports what went
        with the record."""
        bumps: Counter[tuple[bytes, bytes]] = Counter()
        held = self._pending_into(txn, bumps)
        for (kind, raw), n in sorted(bumps.items()):
            self._bump(txn, kind, Digest(raw), n, now)
        return held

    def _bump(self, txn: lmdb.Transaction, kind: bytes, digest: Digest, delta: int,
              now: float) -> None:
        rec = self._get(txn, self._db(kind), digest)
        if rec is None:
            # Known only from a manifest whose object could not be read: not
            # a dedup target (a writer that needs it writes it again).
            rec = ChunkRecord(ChunkState.WRITING, 0, 0, 0, 0, now)
        count = max(rec.refcount + delta, 0)
        state = rec.state
        if state == ChunkState.CONDEMNED and count > 0:
            state = ChunkState.WRITING  # referenced again: out of GC's hands, rewritten on use
        since = now if count == 0 or rec.refcount == 0 else rec.since
        self._put(txn, kind, digest, replace(rec, state=state, refcount=count, since=since))

    def version_refs(self, version_id: str) -> list[Digest]:
        with self.env.begin(db=self.refs) as txn:
            refs = bytes(txn.get(version_id.encode()) or b"")
        return [Digest(refs[i:i + 32]) for i in range(0, len(refs), 32)]

    def version_node_refs(self, version_id: str) -> list[Digest]:
        with self.env.begin(db=self.node_refs) as txn:
            refs = bytes(txn.get(version_id.encode()) or b"")
        return [Digest(refs[i:i + 32]) for i in range(0, len(refs), 32)]

    # --- what verify found readable ---------------------------------------------------------

    def _derived_tables(self) -> derived.VersionTables:
        return derived.VersionTables(self.versions_db, self.refs, self.node_refs, self.meta)

    def verified_versions(self, version_ids: Iterable[str]) -> dict[str, VerifiedVersion]:
        """The versions of ``version_ids`` that a verify found readable (record and
        manifest tree parsed, every entry one a read can read, the manifests naming
        exactly the index's references), or that the save which built them recorded
        (:attr:`VerifiedVersion.by_its_save`: it encoded that tree from entries it
        checked as a read does, and counted in exactly its references; a node it reused
        it did not read), with what the index holds of them.  A verify that reads one
        damaged forgets it (:meth:`forget_verified`).

        An answer is bound to the version's entry and references as the index holds
        them now and to the index's epoch (:mod:`chunkstore.index.derived`): a
        rebuild or an emptied index trusts nothing verified before.  Versions are
        immutable and their nodes content-addressed, so what was parsed once parses
        again; whether each object is still there is the caller's to check."""
        with self.env.begin() as txn:
            bound = derived.read(txn, self._derived_tables(), self.verified, version_ids)
        return {vid: VerifiedVersion(VersionEntry.from_json(parts[0]),
                                     int.from_bytes(payload[:8], "big"), parts[1], parts[2],
                                     by_its_save=payload[8:] == _BY_ITS_SAVE)
                for vid, (payload, parts) in bound.items()
                if len(payload) == 8 or payload[8:] == _BY_ITS_SAVE}

    def note_verified(self, checked: Iterable[tuple[str, int, set[bytes], set[bytes]]]) -> int:
        """Record versions a verify found readable: (id, entries, the raw digests of the
        chunk objects and of the nodes its manifests name).  A version the index does
        not know, or whose references differ from the manifests', is left out (a
        refcount check reports it).  Returns how many were recorded."""
        recorded = 0
        tables = self._derived_tables()
        with self._writing() as txn:
            epoch = derived.writing_epoch(txn, tables)
            for version_id, entries, chunks, nodes in checked:
                parts = tables.parts(txn, version_id.encode())
                if parts is None or _digest_set(parts[1]) != chunks \
                        or _digest_set(parts[2]) != nodes:
                    continue
                derived.write(txn, self.verified, epoch, version_id, parts,
                              entries.to_bytes(8, "big"))
                recorded += 1
        return recorded

    def forget_verified(self, version_ids: Iterable[str], wait_s: float = 2.0) -> None:
        """Hold the versions of ``version_ids`` readable no more (a verify read them
        damaged), whoever recorded them: the next ``--quick`` reads them again.  Writes
        only where one is held; gives up (:class:`~chunkstore.index.writegate.
        WriterBusy`) after ``wait_s`` seconds behind another writer."""
        with self.env.begin(db=self.verified) as txn:
            held = [key for key in (vid.encode() for vid in version_ids) if txn.get(key)]
        if not held:
            return
        with self._writing(wait_s=wait_s) as txn:
            for key in held:
                derived.delete(txn, self.verified, key)

    def census(self, version_ids: Iterable[str]) -> dict[str, bytes]:
        """What ``report``'s census recorded of the versions of ``version_ids``
        (:meth:`note_census`), where it still holds (:mod:`chunkstore.index.derived`)."""
        with self.env.begin() as txn:
            bound = derived.read(txn, self._derived_tables(), self.census_db, version_ids)
        return {vid: payload for vid, (payload, _parts) in bound.items()}

    def note_census(self, counted: Iterable[tuple[str, bytes]], wait_s: float = 2.0) -> None:
        """Record each (version id, what ``report``'s census counted of its manifests);
        a version the index does not know is left out.  Only a help: gives up
        (:class:`~chunkstore.index.writegate.WriterBusy`) after ``wait_s`` seconds
        behind another writer."""
        tables = self._derived_tables()
        with self._writing(wait_s=wait_s) as txn:
            epoch = derived.writing_epoch(txn, tables)
            for version_id, payload in counted:
                parts = tables.parts(txn, version_id.encode())
                if parts is not None:
                    derived.write(txn, self.census_db, epoch, version_id, parts, payload)

    # --- garbage collection ----------------------------------------------------------------

    def unreferenced(self) -> Iterator[tuple[bytes, Digest, float]]:
        """Every record with refcount zero, or being deleted: (kind, digest, since).
        Read as it stands (``report``); GC lists :meth:`unreferenced_folded`."""
        with self.env.begin(db=self.zero) as txn:
            yield from self._zero_entries(txn)

    def unreferenced_folded(self) -> list[tuple[bytes, Digest, float]]:
        """GC's candidate listing: :meth:`unreferenced` in one state of the index in
        which no reference is pending, the ``pending`` table folded in first in the same
        write transaction (where it holds anything; a read, where it holds nothing).

        So the listing names no object a version references, whatever lowered a
        refcount without folding before it: a process of a release of schema 4 that had
        the index open before it was brought to 5 goes on dropping refcounts as if no
        reference were pending, and can leave an object at zero that pending versions
        reference (:meth:`condemn` and :meth:`start_deletes` fold again, for what such
        a process lowers after this listing)."""
        with self.env.begin(db=self.zero) as txn:
            if not txn.stat(self.pending)["entries"]:
                return list(self._zero_entries(txn))
        with self._writing() as txn:
            self._fold(txn, time.time())
            return list(self._zero_entries(txn))

    def _zero_entries(self, txn: lmdb.Transaction) -> Iterator[tuple[bytes, Digest, float]]:
        for key, value in txn.cursor(db=self.zero):
            raw = bytes(key)
            yield raw[:1], Digest(raw[1:]), _SINCE.unpack(value)[0]

    def condemn(self, kind: bytes, digests: Iterable[Digest], before: float,
                forwarded: frozenset[Digest] = frozenset()) -> list[Digest]:
        """Mark unreferenced, unclaimed records older than ``before`` CONDEMNED, durably.

        Returns the digests condemned (now or by an earlier run).  A writer
        that claims one of them later resurrects it in its own transaction.
        ``forwarded`` are packs that versions still list but reach only through
        their moved records (GC's mark decided): their refcount does not count.
        """
        done = []
        with self._writing() as txn:
            self._fold(txn, time.time())  # each refcount re-checked exact (_collectable)
            for digest in digests:
                rec = self._get(txn, self._db(kind), digest)
                if rec is None or not self._collectable(txn, digest, rec, before,
                                                        digest in forwarded):
                    continue
                if rec.state == ChunkState.LIVE:
                    self._put(txn, kind, digest, replace(rec, state=ChunkState.CONDEMNED))
                done.append(digest)
        self.sync()
        return done

    def _collectable(self, txn: lmdb.Transaction, digest: Digest, rec: ChunkRecord,
                     before: float, forwarded: bool = False) -> bool:
        """Whether GC may take the record: at refcount zero since ``before`` (or a pack
        whose listed members its moved record covers), in a state GC takes, unclaimed.
        The caller folded the ``pending`` table in this transaction: the refcount is
        exact (:meth:`unreferenced_folded`)."""
        return ((forwarded or (rec.refcount == 0 and rec.since <= before))
                and rec.state in (ChunkState.LIVE, ChunkState.WRITING, ChunkState.CONDEMNED)
                and not self.is_claimed(digest, txn))

    def start_delete(self, kind: bytes, digest: Digest, before: float,
                     forwarded: bool = False) -> ChunkRecord | None:
        """:meth:`start_deletes` of one record: the record before, or None."""
        started = self.start_deletes(kind, [digest], before,
                                     frozenset([digest]) if forwarded else frozenset())
        return started[0][1] if started else None

    def start_deletes(self, kind: bytes, digests: Iterable[Digest], before: float,
                      forwarded: frozenset[Digest] = frozenset()
                      ) -> list[tuple[Digest, ChunkRecord]]:
        """Re-check condemned records and move each that may go to DELETING, in one
        transaction; return those, each with its record as it was before.

        From this transaction on, a writer that wants one of the objects waits
        instead of deduplicating against it, so the objects may be deleted.
        """
        started = []
        with self._writing() as txn:
            self._fold(txn, time.time())  # each refcount re-checked exact (_collectable)
            for digest in digests:
                rec = self._get(txn, self._db(kind), digest)
                if rec is None or rec.state not in (ChunkState.CONDEMNED, ChunkState.WRITING) \
                        or not self._collectable(txn, digest, rec, before, digest in forwarded):
                    continue
                self._put(txn, kind, digest, replace(rec, state=ChunkState.DELETING))
                started.append((digest, rec))
        return started

    def finish_delete(self, kind: bytes, digest: Digest) -> bool:
        """:meth:`finish_deletes` of one record: whether it was DELETING."""
        return self.finish_deletes(kind, [digest]) == 1

    def finish_deletes(self, kind: bytes, digests: Iterable[Digest]) -> int:
        """Remove DELETING records once their objects are gone (one transaction); return
        how many were DELETING.

        A record a version references again (counted in from storage while
        it was being deleted) is kept as WRITING instead: the next save that
        needs the object writes it again, and verify reports the version.
        """
        finished = 0
        with self._writing() as txn:
            for digest in digests:
                rec = self._get(txn, self._db(kind), digest)
                if rec is None or rec.state != ChunkState.DELETING:
                    continue
                if rec.refcount > 0:
                    self._put(txn, kind, digest, replace(rec, state=ChunkState.WRITING))
                else:
                    self._delete(txn, kind, digest)
                if kind == CHUNK:  # a pack's object is gone: so is every location in it
                    self._forget_pack(txn, digest)
                finished += 1
        return finished

    def abandon_deletions(self) -> int:
        """Turn every DELETING record (of a killed GC) back into WRITING; return how many.

        The object may or may not still exist: WRITING makes it no dedup target,
        and leaves the decision to a whole GC run.
        """
        with self._writing() as txn:
            # DELETING records are all in the ``zero`` table, whatever their refcount.
            keys = [bytes(k) for k, _ in txn.cursor(db=self.zero)]
            count = 0
            for key in keys:
                kind, digest = key[:1], Digest(key[1:])
                rec = self._get(txn, self._db(kind), digest)
                if rec is not None and rec.state == ChunkState.DELETING:
                    self._put(txn, kind, digest, replace(rec, state=ChunkState.WRITING))
                    count += 1
        return count

    def put_record_if_absent(self, kind: bytes, digest: Digest, record: ChunkRecord) -> bool:
        """Add a record unless one exists (one transaction); return whether it was added."""
        with self._writing() as txn:
            if self._get(txn, self._db(kind), digest) is not None:
                return False
            self._put(txn, kind, digest, record)
        return True

    def start_orphan_deletes(self, kind: bytes, digests: Iterable[Digest]) -> list[Digest]:
        """Put a DELETING record for each object the index does not know (one
        transaction); return those, leaving out the ones it does know now.

        Writers then wait instead of deduplicating against the objects while
        the sweep deletes them.
        """
        started = []
        with self._writing() as txn:
            for digest in digests:
                if self._get(txn, self._db(kind), digest) is None:
                    self._put(txn, kind, digest,
                              ChunkRecord(ChunkState.DELETING, 0, 0, 0, 0, 0.0))
                    started.append(digest)
        return started

    def claimants(self, digest: Digest) -> list[str]:
        """The sessions that claim ``digest``."""
        with self.env.begin(db=self.claims) as txn:
            cursor = txn.cursor()
            found = []
            if cursor.set_range(digest.raw):
                for key in cursor.iternext(values=False):
                    raw = bytes(key)
                    if not raw.startswith(digest.raw):
                        break
                    found.append(raw[len(digest.raw):].decode())
            return found

    # --- what the store says is gone -------------------------------------------------------

    def journal_applied(self) -> set[str]:
        """Ids of the GC journal entries this index has applied."""
        with self.env.begin(db=self.journal) as txn:
            return {bytes(k).decode() for k, _ in txn.cursor()}

    def apply_journal(self, entry_id: str | None, objects: Iterable[tuple[bytes, Digest]]
                      ) -> None:
        """Stop treating ``objects`` as stored (another GC may have deleted them).

        Their records become WRITING: no save deduplicates against them; the
        next save that needs one writes it again, keeping an intact object it
        finds.  Refcounts are kept.  ``entry_id`` (a GC journal entry) is
        remembered so that it is applied once.
        """
        with self._writing() as txn:
            self._apply(txn, objects)
            if entry_id is not None:
                txn.put(entry_id.encode(), b"", db=self.journal)

    def _apply(self, txn: lmdb.Transaction, objects: Iterable[tuple[bytes, Digest]]) -> None:
        for kind, digest in objects:
            rec = self._get(txn, self._db(kind), digest)
            if rec is not None and rec.state in (ChunkState.LIVE, ChunkState.CONDEMNED):
                self._put(txn, kind, digest, replace(rec, state=ChunkState.WRITING))
            if kind == CHUNK:  # deleted (or missing): no member is found in it any more
                self._forget_pack(txn, digest)

    def journal_synced(self) -> int | None:
        """Every GC journal entry created before this time (ns) has been applied here;
        None when unknown (an index older than the journal's pruning)."""
        with self.env.begin(db=self.meta) as txn:
            found = txn.get(b"journal_synced")
        return int(found) if found is not None else None

    def repack_pending(self, unused: float) -> int | None:
        """Whether GC should look for packs at least ``unused`` garbage: None when it
        looked since the last version was counted out, with this threshold or a lower
        one; else the count of versions counted out so far, for
        :meth:`repack_checked` once it has looked (always for a fresh index)."""
        with self.env.begin(db=self.meta) as txn:
            removals = int(txn.get(b"removals") or b"0")
            checked = bytes(txn.get(b"repack_checked") or b"-1 1").split()
        if int(checked[0]) == removals and float(checked[1]) <= unused:
            return None
        return removals

    def repack_checked(self, removals: int, unused: float) -> None:
        """GC looked for packs at least ``unused`` garbage after ``removals`` removals."""
        with self._writing(db=self.meta) as txn:
            txn.put(b"repack_checked", f"{removals} {float(unused)!r}".encode())

    def listed_as(self) -> str | None:
        """The listing stamps recorded by :meth:`set_listed_as`, while the index holds as
        many versions as it did then (None otherwise: anything else that changed its
        versions, an earlier release's rebuild stopped half-way say, voids them)."""
        with self.env.begin() as txn:
            found = txn.get(_LISTED_KEY, db=self.meta)
            if found is None:
                return None
            count, _, stamps = bytes(found).decode().partition("\n")
            held = txn.stat(self.versions_db)["entries"]
        return stamps if count == str(held) else None

    def set_listed_as(self, stamps: str | None) -> None:
        """Record the store's listing stamps as of a reconcile that brought this index in
        line with the store (None: forget them), with the versions it holds now."""
        with self._writing() as txn:
            if stamps is None:
                txn.delete(_LISTED_KEY, db=self.meta)
                return
            held = txn.stat(self.versions_db)["entries"]
            txn.put(_LISTED_KEY, f"{held}\n{stamps}".encode(), db=self.meta)

    def markers_listed(self) -> tuple[float, float] | None:
        """When (unix time, this machine's clock) this index last listed every commit
        record, and last listed the publication markers; None: never since it was
        made (chunkstore.protocol.published)."""
        with self.env.begin(db=self.meta) as txn:
            found = txn.get(_MARKERS_LISTED_KEY)
        if found is None:
            return None
        full, _, markers = bytes(found).decode().partition(" ")
        return float(full), float(markers)

    def set_markers_listed(self, full_s: float, markers_s: float) -> None:
        with self._writing(db=self.meta) as txn:
            txn.put(_MARKERS_LISTED_KEY, f"{full_s!r} {markers_s!r}".encode())

    def set_journal_synced(self, time_ns: int) -> None:
        with self._writing(db=self.meta) as txn:
            txn.put(b"journal_synced", str(time_ns).encode())

    def forget_all(self) -> int:
        """No record is a dedup target any more (the index missed pruned journal
        entries, so it cannot know what was deleted); return how many changed."""
        with self._writing() as txn:
            return self._forget_all(txn)

    def _forget_all(self, txn: lmdb.Transaction) -> int:
        # No pack is known to be stored: none of the locations inside them is of use.
        txn.drop(self.packed, delete=False)
        txn.drop(self.packed_by, delete=False)
        changed = 0
        for kind in KINDS:
            db = self._db(kind)
            stale = [(Digest(bytes(k)), ChunkRecord.unpack(v)) for k, v in txn.cursor(db=db)]
            for digest, rec in stale:
                if rec.state in (ChunkState.LIVE, ChunkState.CONDEMNED):
                    self._put(txn, kind, digest, replace(rec, state=ChunkState.WRITING))
                    changed += 1
        return changed

    def record_journal_sync(self, finished: list[tuple[str, list[tuple[bytes, Digest]]]],
                            synced_ns: int, forget: bool, wait_s: float | None = None,
                            markers: Iterable[str] | None = None,
                            pruned: Iterable[str] = ()) -> None:
        """What one read of the GC journal changes, in one write transaction: every
        record forgotten first (``forget``: the index missed pruned entries), then the
        ``finished`` entries applied (:meth:`apply_journal`), then the sync time set,
        the horizon markers it has judged recorded (``markers``, see
        :meth:`journal_markers`), and the ``pruned`` entries (gone from the journal)
        dropped from the applied ones.  :class:`~chunkstore.index.writegate.WriterBusy` past
        ``wait_s``, with nothing changed."""
        with self._writing(wait_s=wait_s) as txn:
            if forget:
                self._forget_all(txn)
            for entry_id, objects in finished:
                self._apply(txn, objects)
                txn.put(entry_id.encode(), b"", db=self.journal)
            txn.put(b"journal_synced", str(synced_ns).encode(), db=self.meta)
            if markers is not None:
                txn.put(_MARKERS_KEY, json.dumps(sorted(markers)).encode(), db=self.meta)
            for entry_id in pruned:
                txn.delete(entry_id.encode(), db=self.journal)

    def journal_markers(self) -> frozenset[str]:
        """The GC journal's horizon markers (by name) this index has accounted for at
        its last sync: it applied every entry pruned behind each, or forgot every
        record (docs/format.md §11.2)."""
        with self.env.begin(db=self.meta) as txn:
            found = txn.get(_MARKERS_KEY)
        names = json.loads(bytes(found)) if found is not None else []
        return frozenset(n for n in names if isinstance(n, str))

    def record_journal_prune(self, marker: str | None, pruned: Iterable[str]) -> None:
        """This index's GC pruned ``pruned``: their ids need no record; ``marker``, when
        it names this index, is the one marker left that it has accounted for."""
        with self._writing() as txn:
            if marker is not None:
                txn.put(_MARKERS_KEY, json.dumps([marker]).encode(), db=self.meta)
            for entry_id in pruned:
                txn.delete(entry_id.encode(), db=self.journal)

    def identity(self, create: bool = True) -> str | None:
        """A random id of this index (its meta, kept by ``index rebuild``): what a
        GC journal horizon marker names when this index applied every entry pruned
        behind it.  Made on first use (``create``), else None until then."""
        with self.env.begin(db=self.meta) as txn:
            found = txn.get(INDEX_ID_KEY)
        if found is not None or not create:
            return bytes(found).decode() if found is not None else None
        with self._writing(db=self.meta) as txn:
            stored = txn.get(INDEX_ID_KEY)
            made = bytes(stored) if stored is not None else uuid.uuid4().hex.encode()
            if stored is None:
                txn.put(INDEX_ID_KEY, made)
        return made.decode()

    def mark_journal_applied(self, entry_ids: Iterable[str]) -> None:
        with self._writing(db=self.journal) as txn:
            for entry_id in entry_ids:
                txn.put(entry_id.encode(), b"")

    def forget_missing(self, kind: bytes, digest: Digest) -> None:
        """An object was found missing: never again a deduplication target."""
        self.apply_journal(None, [(kind, digest)])

    # --- tags ----------------------------------------------------------------------------

    def set_tag(self, tag: str, version_id: str) -> None:
        with self._writing(db=self.tags_db) as txn:
            txn.put(tag.encode(), version_id.encode())

    def delete_tag(self, tag: str) -> bool:
        with self._writing(db=self.tags_db) as txn:
            return bool(txn.delete(tag.encode()))

    def tags(self) -> dict[str, str]:
        with self.env.begin(db=self.tags_db) as txn:
            return {bytes(k).decode(): bytes(v).decode() for k, v in txn.cursor()}

    # --- whole-index operations ----------------------------------------------------------

    def clear(self) -> None:
        """Drop every record (the first step of a rebuild) and stamp the current schema."""
        with self._writing() as txn:
            self._drop_records(txn)
            # No version held: only a full listing brings them back, never the markers.
            txn.delete(_MARKERS_LISTED_KEY, db=self.meta)
            txn.put(b"schema", str(INDEX_SCHEMA).encode(), db=self.meta)
        self.needs_rebuild = False

    def replace_contents(self, other: Index) -> None:
        """Make this index hold exactly what ``other`` holds, in one write transaction:
        a reader in any process sees the old contents or the new, never a half.  The
        store it describes stays named (``other`` is built from the same store)."""
        with self._writing() as txn, other.env.begin() as source:
            kept = {key: txn.get(key, db=self.meta) for key in (STORE_KEY, INDEX_ID_KEY)}
            for mine, theirs in zip((*self._tables(), self.meta),
                                    (*other._tables(), other.meta), strict=True):
                txn.drop(mine, delete=False)
                cursor = txn.cursor(db=mine)
                cursor.putmulti(source.cursor(db=theirs).iternext(), append=True)
            for key, value in kept.items():
                if value is not None and txn.get(key, db=self.meta) is None:
                    txn.put(key, value, db=self.meta)
        self.needs_rebuild = False

    def describe_store(self, identity: str) -> bool:
        """Make sure this index describes the store ``identity`` names
        (:meth:`chunkstore.format.records.StoreConfig.identity`); True when it had to forget
        everything.

        An index records the store it was built for.  Opened on another store at the
        same location (one deleted and created again), or given another store's
        index directory, every record it holds would be a lie: objects it calls
        stored are not there, and a save deduplicating against them would publish a
        version that cannot be read.  So it is emptied, in the same write
        transaction as the check (two processes opening the new store cannot both
        empty it, the second after the first has begun to save), and the store
        rebuilds it.  An index that names no store (new, or made by an earlier
        release) is taken to describe this one."""
        with self.env.begin(db=self.meta) as txn:  # the usual answer, without the writer
            if txn.get(STORE_KEY) == identity.encode():
                return False
        with self._writing() as txn:
            found = txn.get(STORE_KEY, db=self.meta)
            if found is not None and bytes(found) == identity.encode():
                return False
            if found is not None:
                self._drop_records(txn)
                txn.drop(self.meta, delete=False)
                self._stamp_empty(txn)
            txn.put(STORE_KEY, identity.encode(), db=self.meta)
        if found is None:
            return False
        log.warning("the index at %s described another store (%s), not the one at this"
                    " location now (%s): emptied and rebuilt from the store", self.path,
                    bytes(found).decode(errors="replace"), identity)
        self.needs_rebuild = True
        return True

    def put_chunk_record(self, digest: Digest, record: ChunkRecord) -> None:
        self.put_record(CHUNK, digest, record)

    def put_record(self, kind: bytes, digest: Digest, record: ChunkRecord) -> None:
        with self._writing() as txn:
            self._put(txn, kind, digest, record)

    def node_bytes(self) -> int:
        with self.env.begin(db=self.nodes) as txn:
            return sum(ChunkRecord.unpack(v).stored_length for _, v in txn.cursor())


def pid_namespace() -> str | None:
    """The pid namespace and boot of this process: pids compare only within one."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as file:
            boot = file.read().strip()
        return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return None


def process_start(pid: int) -> str | None:
    """An identity for a running process that survives pid reuse (Linux: its start time)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            fields = file.read().rsplit(b")", 1)[1].split()
        return fields[19].decode()  # starttime, field 22 of stat(5)
    except (OSError, IndexError):
        return None
