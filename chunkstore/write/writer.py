"""Writing one version: chunk, hash, dedup, encode and store in threads, then commit.

Order of a save (invariants 1 and 3 in DESIGN.md; the GC side is in
:mod:`chunkstore.maintenance.gc`):

1. a session object is stored in the store (:mod:`chunkstore.protocol.sessions`),
   then the GC journal is read (:mod:`chunkstore.protocol.journal`): objects of
   finished GC runs stop being dedup targets in this index, and objects of
   GC runs still active are never reused (the save waits for such a run
   before writing one of them).  Only then is any dedup decision taken, so
   every GC either sees this session and waits for it, or this session saw
   the GC's entry;
2. a write session is registered in the index (stored in the transaction of its
   first claim, so GC never sees a claim without its session); every chunk the
   save writes or deduplicates against is claimed by it, so a GC of the same
   index leaves them alone;
3. chunk objects are written (put-if-absent) by a thread pool while the
   caller keeps adding entries (:mod:`chunkstore.write.chunkjobs`); memory stays
   O(chunk_size x threads) plus one open pack.  Small tensors' chunks that
   must be written go into packs (:mod:`chunkstore.read.packs`, which argues why
   reusing a member of an older pack is safe).  Whether a stored object may be
   reused instead is decided in :mod:`chunkstore.write.reuse`; on a local store a
   dedup hit is also checked to exist (a stat), so an object lost behind the
   index's back is written again, not referenced;
4. on commit, manifest nodes are claimed like chunks and the missing ones
   written (the last pack, sealed but not yet claimed, is claimed in the nodes'
   transaction and stored before them: a save of small tensors makes three index
   transactions, each a commit and a sync, with the count-in of step 6), with the
   signature (if signing) and the audit event of the publish
   (:mod:`chunkstore.protocol.audit`); then one backend flush makes every object
   durable (a local store: one syncfs instead of two fsyncs per object);
5. the commit record is written durably (atomic create): this is the
   commit.  A save whose session heartbeat lapsed (a GC elsewhere may have
   counted it dead) refuses instead;
6. the session object is removed; the index counts the version in and drops
   the index session in one transaction.  A failure here is logged, never
   raised: the version is published, and the next reconcile counts it in.

An exception before step 5 publishes nothing; what was written is an orphan
that GC removes after the grace period.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import numpy as np

from chunkstore.codecs import PACK
from chunkstore.errors import (
    ChunkStoreError,
    DuplicateEntryError,
    DuplicateStepError,
    InvalidInputError,
    SessionExpiredError,
    StagedChunkMissingError,
    VersionClosedError,
)
from chunkstore.format import plaindata
from chunkstore.format.digest import Digest
from chunkstore.format.dtypes import check_override, dtype_name, element_size
from chunkstore.format.manifest import (
    DataEntry,
    Shard,
    TensorEntry,
    encode_data,
    shard_from_json,
    tensor_entry,
)
from chunkstore.format.names import check_entry_name, check_label
from chunkstore.format.records import MAX_COUNT, CommitRecord
from chunkstore.format.treelayout import build_tree
from chunkstore.handle.censusrecord import contribution
from chunkstore.handle.signatures import sign_existing, store_signature
from chunkstore.handle.tree import flatten
from chunkstore.handle.versions import VersionInfo, entry_from_record
from chunkstore.index.claims import GroupClaims
from chunkstore.index.lmdbindex import CHUNK, NODE, Claim, NewChunk
from chunkstore.objects.kinds import CHUNKS, NODES, VERSIONS
from chunkstore.objects.objectstore import PackEncoding
from chunkstore.objects.signing import PrivateKeyLike, signing_key
from chunkstore.protocol import audit
from chunkstore.protocol.journal import Fence, sync_journal
from chunkstore.protocol.published import write_marker
from chunkstore.protocol.runlease import RunLease
from chunkstore.protocol.sessions import StoreSession
from chunkstore.read.members import Locations
from chunkstore.read.packs import PackBuilder, chunks_fit_in_packs
from chunkstore.read.reader import chunk_reads
from chunkstore.write.chunkjobs import ChunkJobs, PendingTensor
from chunkstore.write.delta import MIN_DELTA_TENSOR_BYTES, ParentChunks

if TYPE_CHECKING:
    from chunkstore.handle.handle import StoreHandle

#: A tensor of one chunk (of at most the chunk size) up to this size is hashed with its
#: batch (by the caller and idle workers), claimed with others in one index transaction
#: (each commits to disk, so a state of thousands of small tensors pays for a few
#: commits, not one per tensor) and packed.  Measured on this project's 2-core
#: machine, a dense GPT sync save (788 tensors, most 256 KiB-1 MiB) with `auto`:
#: 576-613 ms when only tensors up to 256 KiB were packed, 412-421 ms with every
#: one-chunk tensor packed, and no faster or slower with `none`; objects per dense save
#: went from 91 to 21 in the suite run of that change (`python -m benchmarks.suite`;
#: later runs of latest.md, with delta chunks packed too, have 15).
SMALL_TENSOR_BYTES = 4 * 1024 * 1024
#: In a store with delta chains, only tensors up to this size are stored as small
#: chunks (hashed with their batch, never deltas); larger ones are where deltas pay,
#: and their chunks are packed one by one, deltas included (``Store.pack_delta_chunks``;
#: before chunk format 5 each was an object of its own).  Measured on the suite's
#: mixed-precision workload (delta_depth 2, /tmp A/B script, chunks as objects): at
#: 256 KiB a GPT's 256x256 attention matrices and their Adam moments (29% of the
#: state) were never deltas, and a delta version stored 0.717 of a full copy; at
#: 128 KiB they are deltas, 0.699.
SMALL_TENSOR_BYTES_WITH_DELTAS = 128 * 1024
#: Whether the chunks of larger tensors are packed too, in a store without delta chains
#: (hashed and claimed by the workers, one by one), so a save writes about new bytes /
#: pack size objects whatever its tensors' sizes; None: on object stores only.
#: Measured with the sparse-embedding workload (211 MiB of new 4 MiB chunks per save;
#: /tmp A/B scripts, 2 cores): on the local disk packing cut objects per save from 68 to
#: 25 but made the sync save 31% slower (0.37 -> 0.49 s: the pack's content is hashed
#: again and joined, and packs are sealed in order); on a moto S3 server on loopback
#: it was 5% faster (1.30 -> 1.23 s), before any network latency per request.
PACK_LARGE_TENSORS: bool | None = None
SMALL_BATCH_COUNT = 256
SMALL_BATCH_BYTES = 8 * 1024 * 1024
log = logging.getLogger(__name__)


def _as_le_contiguous(array: np.ndarray) -> np.ndarray:
    """The array's bytes in C order, little-endian; copies only when it must."""
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    return np.ascontiguousarray(array)


def _weakly(method: Callable[[Digest, PackEncoding], int]
            ) -> Callable[[Digest, PackEncoding], int]:
    """``method`` as a callback that does not keep its writer alive.

    A writer's helpers that called back through a bound method would make a
    reference cycle: the whole save (its writer and entries, about 8,900 objects
    for a dense GPT save) would then outlive it until a full garbage collection.
    """
    ref = weakref.WeakMethod(method)

    def call(digest: Digest, data: PackEncoding) -> int:
        bound = ref()
        if bound is None:
            raise VersionClosedError("the version's writer is gone")
        return bound(digest, data)

    return call


class VersionWriter(ChunkJobs):
    """Collects one version's entries; use as a context manager or call commit()/abort()."""

    def __init__(self, store: StoreHandle, run: str, step: int, meta: dict[str, Any] | None, *,
                 replace: bool = False, sign_with: PrivateKeyLike | None = None) -> None:
        self._store = store
        #: the key that signs the commit record (docs/format.md §14), loaded before
        #: anything is stored so that a bad key file changes nothing
        self._signing_key = None if sign_with is None else signing_key(sign_with)
        self.run = check_label(run, "run name")
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) \
                or not 0 <= step <= MAX_COUNT:
            raise InvalidInputError(f"step must be a non-negative int below 2**63, got {step!r}")
        self.step = int(step)
        if meta is not None and not isinstance(meta, dict):
            raise InvalidInputError(f"meta must be a dict of plain data, got {type(meta).__name__}")
        self.meta = dict(meta or {})
        self._replace = replace
        plaindata.encode(self.meta)  # fail now, not at commit, on unserialisable metadata
        self._tensors: dict[str, PendingTensor] = {}
        self._data: dict[str, tuple[Digest, bytes, int]] = {}
        self._adopted: dict[str, TensorEntry] = {}  # stored by other processes: adopt()
        self._adopted_new: dict[Digest, NewChunk] = {}
        self._small: list[tuple[PendingTensor, memoryview, str, int]] = []
        self._small_bytes = 0
        self._packs = PackBuilder(_weakly(self._write_pack), store.pack_size,
                                  ids=store.objects.chunk_ids,
                                  member_length=store.objects.member_length)
        self._reusable_packs: dict[Digest, Future[bool]] = {}
        self._reusable_packs_lock = threading.Lock()
        self._closed = False
        self._info: VersionInfo | None = None
        self._existed = False
        #: called after every object is durable and right before the commit record is
        #: stored; raising stops the commit (the version is not published).  A
        #: :class:`~chunkstore.protocol.runlease.RunLease` first claims the run's next
        #: commit slot with the record, then checks (docs/format.md §11.5)
        self.before_commit: Callable[[], None] | None = None
        self._inflight = threading.BoundedSemaphore(store.max_inflight)
        self._store_session, self._fence = open_store_session(store, f"save {self.run}@"
                                                               f"{self.step}")
        # Dedup hits are checked to exist at every reuse where that costs a stat (local
        # disks) or the GC journal could not be read; elsewhere once per store handle.
        self._check_dedup = self._fence.distrust_index or store.objects.local_path() is not None
        try:
            # Stored with the save's first claim, in its transaction (one commit fewer).
            self._session = store.index.open_session(f"save {self.run}@{self.step}",
                                                     deferred=True)
        except BaseException:
            self._store_session.close()
            raise
        self._claims = GroupClaims(functools.partial(store.index.claim_many, self._session,
                                                     CHUNK))
        self._small_claims = GroupClaims(functools.partial(store.index.claim_small,
                                                           self._session))
        self._last_heartbeat = time.monotonic()
        try:
            self._parent = ParentChunks(store, self.run)
        except BaseException:  # an OSError or Ctrl-C reading the parent: end the sessions
            try:
                store.index.close_session(self._session)
            finally:
                self._store_session.close()
            raise

    # --- adding entries --------------------------------------------------------------------

    def _check_new_name(self, name: str) -> str:
        if self._closed:
            raise VersionClosedError("this version is already committed or aborted")
        name = check_entry_name(name)
        if name in self._tensors or name in self._data or name in self._adopted:
            raise DuplicateEntryError(f"entry {name!r} was already added to this version")
        return name

    def put(self, name: str, array: np.ndarray, dtype: str | None = None) -> None:
        """Add an array.  It must not change until the version is committed.

        ``dtype`` stores the bytes under another dtype name of the same element
        size (e.g. a ``uint16`` view of bfloat16 data as ``"bfloat16"``).
        """
        name = self._check_new_name(name)
        if isinstance(array, np.generic):
            array = np.asarray(array)  # a numpy scalar is a 0-d array
        if not isinstance(array, np.ndarray):
            raise InvalidInputError(f"entry {name!r}: put() takes a numpy array, got "
                                    f"{type(array).__name__}; use put_data() for plain data")
        stored_dtype = dtype_name(array.dtype) if dtype is None else dtype
        if dtype is not None:
            check_override(array.dtype, dtype)
        contiguous = _as_le_contiguous(array)
        itemsize = contiguous.dtype.itemsize
        chunk_bytes = max(itemsize, self._store.chunk_size - self._store.chunk_size % itemsize)
        flat = contiguous.reshape(-1).view(np.uint8).data if contiguous.size else memoryview(b"")
        bases = self._parent.bases(name, stored_dtype, tuple(array.shape), chunk_bytes)
        pending = PendingTensor(stored_dtype, tuple(array.shape), chunk_bytes, [])
        self._tensors[name] = pending
        try:
            small = SMALL_TENSOR_BYTES_WITH_DELTAS if self._parent.depth else SMALL_TENSOR_BYTES
            if 0 < len(flat) <= min(chunk_bytes, small):
                # Packed standalone, never a delta (too small for one to pay); hashed
                # with its batch (see _flush_small).
                self._small.append((pending, flat, stored_dtype, itemsize))
                self._small_bytes += len(flat)
                if (len(self._small) >= SMALL_BATCH_COUNT
                        or self._small_bytes >= SMALL_BATCH_BYTES):
                    self._flush_small()
                return
            # Chunks of nearly the largest chunk size are objects of their own: no pack
            # location may end past MAX_PACK_BYTES.
            fit = chunks_fit_in_packs(chunk_bytes, self._store.objects.member_length)
            pack_chunks = fit and not self._parent.depth and (
                self._store.objects.local_path() is None if PACK_LARGE_TENSORS is None
                else PACK_LARGE_TENSORS)
            # In a store with delta chains, deltas and standalone chunks alike are packed
            # (StoreHandle.pack_delta_chunks), so a delta save writes about new bytes / pack
            # size objects instead of one per chunk (docs/format.md §3.5, chunk format 5).
            pack_members = fit and bool(self._parent.depth) and self._store.pack_delta_chunks
            # A chunk that may be a base of the run's next save (chunkstore.handle.basecopies).
            may_be_base = self._parent.depth and len(flat) >= min(MIN_DELTA_TENSOR_BYTES,
                                                                  chunk_bytes + 1)
            for i, start in enumerate(range(0, len(flat), chunk_bytes)):
                view = flat[start : start + chunk_bytes]
                self._inflight.acquire()
                if pack_chunks:
                    pending.futures.append(self._store.executor.submit(
                        self._store_packed_chunk_job, pending, view, stored_dtype, itemsize,
                        self._packs.reserve()))
                    continue
                pending.futures.append(self._store.executor.submit(
                    self._store_chunk_job, view, stored_dtype, itemsize,
                    bases[i] if i < len(bases) else None, place=(name, i) if may_be_base
                    else None, seq=self._packs.reserve() if pack_members else None))
        except BaseException:
            # Entries are registered before their chunks are queued: a version with
            # some of them missing must never be committed.
            self.abort()
            raise

    def put_data(self, name: str, value: object) -> None:
        """Add plain data (numbers, strings, lists, dicts, tuples, bytes), encoded safely."""
        name = self._check_new_name(name)
        self._data[name] = encode_data(value, self._store.objects.node_ids)

    # --- commit ----------------------------------------------------------------------------

    def _collect(self, set_aside: bool = False
                 ) -> tuple[dict[str, TensorEntry], list[NewChunk], int]:
        """The version's tensor entries, the chunk objects it wrote (packs included)
        and the raw bytes of the chunks it stored.  With ``set_aside``, the last pack
        is sealed but not yet claimed or stored (nor counted): :meth:`_write_nodes`
        claims it with the nodes."""
        self._flush_small()
        for name, pending in self._tensors.items():
            expected = -(-math.prod(pending.shape) * element_size(pending.dtype)
                         // pending.chunk_bytes)
            if len(pending.futures) != expected:  # never publish a tensor short of chunks
                raise VersionClosedError(f"entry {name!r} has {len(pending.futures)} of its"
                                         f" {expected} chunks queued; the version is aborted")
        results = {name: pending.results() for name, pending in self._tensors.items()}
        if set_aside:
            self._set_aside, self._committing = [], threading.get_ident()
        self._packs.finish()  # every member handed over: seal and write the last pack
        entries: dict[str, TensorEntry] = {}
        new_chunks = [NewChunk(d, PACK.id, content, size)
                      for d, content, size in self._packs.packs if size]
        new_bytes = self._packs.member_raw_bytes
        for name, pending in self._tensors.items():
            digests, chains, packs = [], [], []
            base_packs: list[Locations] = []
            for digest, new, listed, slot, listed_at in results[name]:
                # A packed chunk lists the chain of the member packed (one per chunk).
                chain, locations = (listed, listed_at) if slot is None else slot.chain
                if slot is not None and slot.location is None:
                    raise RuntimeError(f"entry {name!r}: a packed chunk has no location")
                digests.append(digest)
                chains.append(chain)
                packs.append(None if slot is None else slot.location)
                base_packs.append(locations or (None,) * len(chain))
                if new is not None:
                    new_chunks.append(new)
                    new_bytes += new.raw_length
            shard = Shard((0,) * len(pending.shape), pending.shape, pending.chunk_bytes,
                          tuple(digests), tuple(chains) if any(chains) else (),
                          tuple(packs) if any(packs) else (),
                          tuple(base_packs) if any(any(b) for b in base_packs) else ())
            entries[name] = TensorEntry(pending.dtype, pending.shape, (shard,))
        entries.update(self._adopted)
        new_chunks.extend(self._adopted_new.values())
        new_bytes += _adopted_raw_bytes(self._adopted, self._adopted_new)
        return entries, new_chunks, new_bytes

    def _build_tree(self, leaves: dict[str, TensorEntry | DataEntry]
                    ) -> tuple[Digest, dict[Digest, bytes]]:
        """Encode the tree of ``leaves`` (:meth:`_leaves`; see
        :func:`chunkstore.format.treelayout.build_tree`); returns the root and every
        node's bytes, data nodes included."""
        root, nodes = build_tree(leaves, self._store.node_size,
                                 self._store.objects.node_ids)
        nodes.update({d: b for d, b, _ in self._data.values()})
        return root, nodes

    def _leaves(self, tensors: dict[str, TensorEntry]) -> dict[str, TensorEntry | DataEntry]:
        """The version's leaves by full name: ``tensors`` and its data entries."""
        leaves: dict[str, TensorEntry | DataEntry] = dict(tensors)
        leaves.update({n: DataEntry(d, size) for n, (d, _, size) in self._data.items()})
        return leaves

    def _same_content(self, version: VersionInfo, tensors: dict[str, TensorEntry]) -> bool:
        """Whether ``version`` holds exactly this version's entries (the same names,
        dtypes, shapes, boxes and chunks, the same data), whatever its node layout
        or packs: a version saved again after an upgrade, or by a handle with
        another ``node_size``."""
        try:
            stored = flatten(self._store.objects, version.root, self._store.node_cache).leaves
        except ChunkStoreError:
            return False
        if stored.keys() != tensors.keys() | self._data.keys():
            return False
        for name, leaf in stored.items():
            if name in self._data:
                if not isinstance(leaf, DataEntry) or leaf.digest != self._data[name][0]:
                    return False
            elif not isinstance(leaf, TensorEntry) or _content(leaf) != _content(tensors[name]):
                return False
        return True

    def _write_nodes(self, nodes: dict[Digest, bytes]) -> tuple[int, list[NewChunk]]:
        """Claim every node of the tree, and the last pack :meth:`_collect` set aside, in
        one index transaction; store the pack (as any pack is: reused where it may be),
        then write those nodes the store lacks.

        Returns the bytes of nodes written, and the pack if it was written.
        """
        index = self._store.index
        generation = self._fence.generation  # before the claims: see _pre_claimed
        last, self._set_aside = self._set_aside or [], None
        claimed = index.claim_kinds(self._session, {NODE: nodes, CHUNK: [d for d, _ in last]})
        packs = []
        for digest, pack in last:
            written = self._store_pack(digest, pack,
                                       self._pre_claimed(claimed[CHUNK][digest], generation))
            if written:
                content = next(c for d, c, _ in self._packs.packs if d == digest)
                packs.append(NewChunk(digest, PACK.id, content, written))
        claims = claimed[NODE]
        for digest, found in claims.items():
            if found == Claim.WAIT:  # GC is deleting an unreferenced copy of it
                claims[digest] = self._wait_out_deletion(digest, self._node_claimer(digest))
        # Claimed above, in one transaction: _reusable reads the answer, unless a GC
        # journal entry was applied since (then it may be stale: claimed again).
        def claim(digest: Digest) -> Claim:
            if self._fence.generation == generation:
                return claims[digest]
            return self._wait_out_deletion(digest, self._node_claimer(digest))
        missing = [(d, nodes[d]) for d in nodes if not self._reusable(NODE, d, claim)]
        done = self._store.executor.map(lambda item: self._put_node(*item), missing)
        return sum(len(b) for (_, b), wrote in zip(missing, done, strict=True) if wrote), packs

    def _put_node(self, digest: Digest, data: bytes) -> bool:
        """Store a node the save may not reuse (put-if-absent); a copy found stored is
        kept only when it holds exactly these bytes, else replaced (docs/format.md
        §11.1, rule 2: an orphan or a copy a GC was deleting may be damaged).  True when
        this save wrote it."""
        objects = self._store.objects
        if objects.put_if_absent_deferred(NODES, digest, data):
            return True
        if objects.holds(NODES, digest, data):
            return False
        objects.put(NODES, digest, data)
        return True

    def commit(self) -> VersionInfo:
        """Publish the version: after this returns it is durable, listed and loadable."""
        if self._closed:
            raise VersionClosedError("this version is already committed or aborted")
        # One commit of a run at a time on this handle, from the same-step check until
        # the index counts the version in (else two threads saving one RUN@STEP both
        # publish).  Taken after every wait on a GC fence (chunks, nodes): a commit
        # holding it while it waited could hold up a save that GC itself waits for.
        held: list[threading.Lock] = []
        try:
            return self._commit(held)
        finally:
            for lock in held:
                lock.release()

    def _commit(self, held: list[threading.Lock]) -> VersionInfo:
        try:
            tensors, new_chunks, new_bytes = self._collect(set_aside=True)
            leaves = self._leaves(tensors)
            root, nodes = self._build_tree(leaves)
            store = self._store
            # Reused where stored (an identical save); the last pack with the nodes.
            node_bytes, last_packs = self._write_nodes(nodes)
            new_chunks += last_packs
            new_bytes += _member_raw_bytes(tensors, {c.digest for c in last_packs})
            lock = store.run_lock(self.run)
            lock.acquire()
            held.append(lock)
            same_step = store.at_step(self.run, self.step)  # a seek, not a listing
            # The index may not know that another process removed one of them: a version
            # whose commit record is gone is neither "saved before" nor in the way (it
            # would be returned as this save, published nowhere).
            for gone in [v for v in same_step if not store.objects.exists(VERSIONS, v.id)]:
                store.index.remove_version(gone.id)
                same_step.remove(gone)
            # With replace, the new meta (metrics a retention policy reads) must be kept:
            # only a save equal in meta too publishes nothing.
            identical = next((v for v in same_step if v.root == root
                              and (not self._replace or v.meta == self.meta)), None)
            if identical is None and not self._replace:  # stored under another layout?
                identical = next((v for v in same_step if self._same_content(v, tensors)),
                                 None)
            if identical is not None and self._signing_key is not None \
                    and not sign_existing(store.objects, self._signing_key, identical.id):
                # Signed by another key: not this save's version (its signature stays).
                if not self._replace:
                    raise DuplicateStepError(self.run, self.step, identical.id,
                                             "signed by another key")
                identical = None
            if identical is not None:  # saved before, byte for byte: publish nothing
                self.abort()
                self._info = identical
                self._existed = True
                return identical
            if same_step and not self._replace:
                raise DuplicateStepError(self.run, self.step, same_step[-1].id)
            latest = store.latest(self.run)
            record = CommitRecord(
                run=self.run, step=self.step, parent=latest.id if latest else None,
                created=time.time(), root=root, meta=self.meta,
                logical_bytes=sum(t.nbytes for t in tensors.values())
                + sum(size for _, _, size in self._data.values()),
                new_bytes=new_bytes,
                new_stored_bytes=sum(c.stored_length for c in new_chunks) + node_bytes,
            )
            version_id, data = record.encode()
            self._publish(version_id, data)
        except BaseException:
            self.abort()
            raise
        # Published: whatever happens to the index now, the save succeeded.
        self._closed = True
        entry = entry_from_record(version_id, record)
        self._info = store.info_from_entry(entry)
        refs = {d for t in tensors.values() for d in t.chunk_digests()}
        # Every object the version needs is stored now: later saves of this handle
        # need not ask (chunkstore.write.reuse, rule 3).
        store.saw_stored(CHUNK, refs)
        store.saw_stored(NODE, nodes)
        try:
            self._store_session.close()
            # Where every packed chunk of the version lies, those packed by other
            # processes (adopted entries) included: dedup targets for later saves.
            # (Standalone members only: a packed delta is reused with its listed chain.)
            packed = {digest: location for t in tensors.values() for shard in t.shards
                      for i, digest in enumerate(shard.chunks)
                      if (location := shard.location(i)) is not None and not shard.chain(i)}
            # Its census, and that it is readable, recorded with it: neither the first
            # report nor the first verify --quick reads its manifests.
            store.index.add_version(entry, refs, {d: len(b) for d, b in nodes.items()},
                                    new_chunks, self._session, packed,
                                    census=contribution(leaves),
                                    built_entries=_readable(leaves, store.chunk_size))
            # Taken at the save's start too (should the save fill the disk); sized again
            # here, the reserve follows what the save added to the index, not a save
            # behind it (25 us: a stat of each table).
            store.index.keep_reserve()
        except Exception as exc:
            # The commit record is the truth; reconcile counts the version in on
            # the next open or GC.  A leftover session object ends with this process.
            log.warning("version %s of %s@%d is published, but the index was not updated"
                        " (%s); it is counted in when the store is next opened",
                        version_id[:12], self.run, self.step, exc)
        self._parent.copies.commit(self.run, version_id)
        self._parent.remember(store, self.run, version_id, tensors)
        self._remove_replaced(same_step)
        return self._info

    def _publish(self, version_id: str, data: bytes) -> None:
        """The commit point (step 5): every object durable, the session alive, the run
        still this writer's, then the record created."""
        objects = self._store.objects
        if self._signing_key is not None:
            # Before the flush, so durable with the nodes: a published signed version
            # always has its signature (docs/format.md §14).
            store_signature(objects, self._signing_key, version_id, data)
        # Durable with the nodes, before the record: openers elsewhere learn of the
        # version from it without listing every record (chunkstore.protocol.published).
        write_marker(objects, version_id)
        # The audit event too: durable before the commit point, so a published version
        # always has its "publish" event (an unpublished save may leave one).
        audit.record(objects, "publish", deferred=True,
                     versions=[{"id": version_id, "run": self.run, "step": self.step}],
                     signed=self._signing_key is not None)
        objects.flush()  # every chunk and node durable before the commit point
        if self._store_session.lapsed():
            raise self._expired()
        lease = self.before_commit if isinstance(self.before_commit, RunLease) else None
        if lease is not None:  # fenced: claim the run's slot first, then check the lease
            lease.claim(version_id, data)
        if self.before_commit is not None:  # e.g. a run lease still this writer's
            self.before_commit()
        if objects.put_if_absent(VERSIONS, version_id, data) and lease is not None:
            lease.confirm(version_id)  # not withdrawn while this process was stopped

    def _remove_replaced(self, replaced: list[VersionInfo]) -> None:
        """After publishing with ``replace``: remove the versions this one replaces
        (a tagged one stays, and RUN@STEP names the newer)."""
        for old in replaced:
            try:
                self._store.delete_listed(old.id)
            except ChunkStoreError as exc:
                log.warning("%s@%d: the replaced version %s stays: %s", self.run, self.step,
                            old.short_id, exc)

    def _expired(self) -> SessionExpiredError:
        return SessionExpiredError(
            f"the save of {self.run}@{self.step} could not prove it was alive for half the"
            " session lease (its heartbeat to the store failed or the process was paused),"
            " so a GC elsewhere may have deleted objects it reuses; the version is not"
            " published. Save again")

    def abort(self) -> None:
        """Discard the version: nothing is published; written chunks become orphans."""
        if self._closed:
            return
        self._closed = True
        self._small = []  # never handed to a worker: nothing to wait for
        self._set_aside = None  # a last pack sealed and never stored: nothing names it
        for pending in self._tensors.values():
            for future in pending.futures:
                future.cancel()
        for pending in self._tensors.values():
            for future in pending.futures:
                if not future.cancelled():
                    future.exception()  # wait, so no job touches the caller's arrays later
            # A failed job's exception holds its frames, the writer among them: let go
            # of the futures so nothing of the aborted save outlives it in a cycle.
            pending.futures = []
        self._parent.copies.drop()
        try:
            self._store.index.close_session(self._session)
        finally:
            self._store_session.close()

    @property
    def info(self) -> VersionInfo:
        if self._info is None:
            raise VersionClosedError("the version has no info until it is committed")
        return self._info

    @property
    def existed(self) -> bool:
        """Whether the run had this step saved before with the same content, so that this
        save published nothing: :attr:`info` is that version (its sizes are its own)."""
        self.info  # noqa: B018 - committed first, as info says
        return self._existed

    @property
    def stored_bytes(self) -> int:
        """Bytes this save stored: the version's ``new_stored_bytes``, or 0 when it
        :attr:`existed` already."""
        return 0 if self.existed else self.info.new_stored_bytes

    def __enter__(self) -> VersionWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._closed:
            self.commit()

    # --- sharded saves: chunks stored by other processes (torch_bridge.dcp) -----------------

    def write_unpublished(self) -> tuple[dict[str, TensorEntry], list[NewChunk]]:
        """Store every chunk put so far, durably, and end the save without publishing.

        Returns each tensor's entry (one shard covering it) and the chunk objects
        this writer wrote.  For a process of a sharded save: the process that
        publishes adds the entries to its own version with :meth:`adopt`.  Until
        that version commits, the chunks are orphans that only the publisher's
        store session protects, so that session MUST be stored before this writer
        is created (then this writer's journal read sees every GC entry the
        publisher's session lists as seen, and never reuses their objects).
        """
        if self._closed:
            raise VersionClosedError("this version is already committed or aborted")
        try:
            entries, new_chunks, _ = self._collect()
            self._store.objects.flush()  # durable before the publisher may reference them
        finally:
            self.abort()  # ends this writer's sessions; every chunk job is done
        return entries, new_chunks

    @property
    def gc_entries_seen(self) -> list[str]:
        """The GC journal entries this save's session object lists as seen (their GC
        runs do not wait for this save; every other entry's run does)."""
        return self._store_session.seen

    def follow_publisher(self, seen: Iterable[str]) -> None:
        """Let only the GC entries the publisher of this sharded save has seen fence
        this writer (call before the first put; ``seen``: the publisher's
        :attr:`gc_entries_seen`).

        An entry the publisher has not seen was stored after the publisher's
        session, so its GC waits for that session, which outlives this writer:
        it deletes nothing before the version is published, and then keeps what
        the version names.  Waiting for such an entry here would wait for the
        publisher, which waits for this writer.
        """
        keep = set(seen)
        for entry_id in list(self._fence.active):
            if entry_id not in keep:
                del self._fence.active[entry_id]

    def adopt(self, entries: dict[str, TensorEntry], written: Iterable[NewChunk] = ()) -> None:
        """Add tensors whose chunks other processes stored for this version.

        ``written`` are the chunk objects those processes wrote (for the index and
        the version's byte counts).  Every chunk and listed base is claimed the way
        a deduplication hit is (:meth:`_reusable`: the GC fence, the index claim and,
        where a hit gets one, an existence check); one that may not be referenced
        unwritten must exist in the store.  A chunk that does not, or whose claim
        fails, raises (:class:`StagedChunkMissingError`, :class:`BackendError`) and
        nothing is added; abort the version then.
        """
        for name, entry in entries.items():
            self._check_new_name(name)
            if any(s.chunk_bytes > self._store.chunk_size for s in entry.shards):
                raise InvalidInputError(f"entry {name!r}: chunks longer than the store's chunk"
                                        f" size {self._store.chunk_size}")
            try:  # what a reader would refuse is never published
                # Each shard as a reader decodes it (pack locations and delta chains
                # included), then the entry as a whole.
                shards = tuple(shard_from_json(s.to_json(), entry.dtype) for s in entry.shards)
                tensor_entry(entry.dtype, entry.shape, shards)
            except ValueError as exc:
                raise InvalidInputError(f"entry {name!r}: {exc}") from exc
        digests = sorted({d for entry in entries.values() for d in entry.chunk_digests()})
        # Claimed together, in one index transaction (the workers' claims one at a time
        # took a commit for every few), then each decided as a batch's claim is.
        generation = self._fence.generation  # before the claims: see _pre_claimed
        claimed = self._store.index.claim_many(self._session, CHUNK, digests) if digests else {}

        def present(digest: Digest) -> bool:
            claim = self._pre_claimed(claimed[digest], generation)
            return (self._reusable(CHUNK, digest, claim)
                    or self._store.objects.exists(CHUNKS, digest))

        missing = [d for d, ok in zip(digests, self._store.executor.map(present, digests),
                                      strict=True) if not ok]
        if missing:
            raise StagedChunkMissingError(missing[0].hex, len(missing), len(digests))
        self._adopted.update(entries)
        for chunk in written:
            self._adopted_new.setdefault(chunk.digest, chunk)


def _readable(leaves: dict[str, TensorEntry | DataEntry], chunk_size: int) -> int | None:
    """The number of a built version's entries where each is one a read can read (the
    check verify makes of every tensor, :func:`~chunkstore.read.reader.chunk_reads`),
    so its index may record the version readable; None where one is not."""
    try:
        for leaf in leaves.values():
            if isinstance(leaf, TensorEntry):
                chunk_reads(leaf, chunk_size)
    except (ChunkStoreError, ValueError):
        return None
    return len(leaves)


def open_store_session(store: StoreHandle, purpose: str) -> tuple[StoreSession, Fence]:
    """Store the session object, then read the GC journal (in that order: see step 1)."""
    store.upgrade_format()  # sessions are a version-2 object
    store.index.keep_reserve()  # room for rm and gc should this save fill the disk
    session = StoreSession(store.objects, purpose)
    session.open()
    try:
        fence = sync_journal(store.objects, store.index)
        session.record_seen(list(fence.active))
    except BaseException:
        session.close()
        raise
    return session, fence


def _adopted_raw_bytes(entries: dict[str, TensorEntry], written: dict[Digest, NewChunk]
                       ) -> int:
    """The raw bytes of the chunks other processes stored for adopted entries: each new
    object of its own, and each member of a new pack (a pack's own length is encoded)."""
    packs = {d for d, chunk in written.items() if chunk.codec_id == PACK.id}
    return _member_raw_bytes(entries, packs) + sum(c.raw_length for c in written.values()
                                                   if c.codec_id != PACK.id)


def _member_raw_bytes(entries: dict[str, TensorEntry], packs: set[Digest]) -> int:
    """The raw bytes of the distinct members ``entries`` list in ``packs``."""
    if not packs:
        return 0
    members: dict[Digest, int] = {}
    for entry in entries.values():
        itemsize = element_size(entry.dtype)
        for shard in entry.shards:
            for i, (digest, _, length) in enumerate(shard.chunk_spans(itemsize)):
                location = shard.location(i)
                if location is not None and location.pack in packs:
                    members[digest] = length
    return sum(members.values())


def _content(entry: TensorEntry) -> tuple[object, ...]:
    """What a tensor entry holds, apart from where its chunks are stored."""
    return entry.dtype, entry.shape, tuple(
        (s.offsets, s.sizes, s.chunk_bytes, s.chunks) for s in entry.shards)

