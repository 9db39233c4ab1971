"""The jobs a save runs for its chunks, most of them in the store's thread pool.

A tensor of one chunk up to the small size is hashed with its batch (by the
caller and idle workers), claimed with the batch in one index transaction, and
stored by a worker with its group: reused, or encoded standalone and handed to
the open pack (:mod:`chunkstore.read.packs`) at the place it was given in the order
of the state.  A chunk of a larger tensor is one job: hashed, reused where
:mod:`chunkstore.write.reuse` allows, else encoded (as a delta against the chunk at
the same place in the run's previous version where that pays,
:mod:`chunkstore.write.delta`) and written as an object of its own or packed.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, NamedTuple

from chunkstore.codecs import copy_bytes
from chunkstore.codecs.policy import encode_with_policy, tensor_policy
from chunkstore.errors import ChunkStoreError
from chunkstore.format.chunkobj import ChunkHeader, decode_object, encode_object, parse_header
from chunkstore.format.digest import Digest, digests_of
from chunkstore.format.manifest import PackLocation
from chunkstore.handle.basecopies import Place
from chunkstore.index.lmdbindex import CHUNK, Claim, NewChunk
from chunkstore.objects.kinds import CHUNKS
from chunkstore.objects.objectstore import PackEncoding
from chunkstore.read.chain import base_bytes, base_prefix
from chunkstore.read.members import Locations
from chunkstore.read.packs import PackBuilder
from chunkstore.write.delta import BaseSlot, Judged, delta_may_pay, encode_delta, probe_length
from chunkstore.write.reuse import Reuse, StoredChunk

log = logging.getLogger(__name__)
_NO_DIGEST = Digest(bytes(32))  # the place of a chunk that failed before it was hashed
#: A worker stores a batch's small chunks in groups of at most this many (and at most
#: a chunk's size of bytes, so the writer's memory bound holds): one job per group,
#: not per tensor, as the job's own cost is most of a small chunk's.
SMALL_GROUP_COUNT = 64


@dataclass
class PendingTensor:
    dtype: str
    shape: tuple[int, ...]
    chunk_bytes: int
    #: one job per chunk, or for a small tensor its group's job (a list of results)
    futures: list[Future[Any]]
    #: a small tensor's place in the result of its group's job (None: one job per chunk)
    part: int | None = None

    def results(self) -> list[StoredChunk]:
        # No frame of ours holds a future while its result is taken: a job's exception
        # keeps its traceback, and a frame there that referred to the future would
        # make a cycle holding the writer and the caller's arrays.
        if self.part is None:
            return list(map(Future.result, self.futures))
        return [Future.result(self.futures[0])[self.part]]


class SmallChunk(NamedTuple):
    """A one-chunk tensor, hashed, with its batch's claim to come.  (A tuple: a save
    makes one per small tensor on the caller's thread, and a frozen dataclass costs
    several times as much to make.)"""

    pending: PendingTensor
    view: memoryview
    dtype: str
    itemsize: int
    digest: Digest


class ChunkJobs(Reuse):
    """Storing one save's chunks (a part of :class:`chunkstore.write.writer.VersionWriter`,
    which sets these attributes)."""

    _small: list[tuple[PendingTensor, memoryview, str, int]]
    _small_bytes: int
    _packs: PackBuilder
    _inflight: threading.BoundedSemaphore
    #: the last pack a commit sealed, put aside by :meth:`_write_pack` (a list while the
    #: commit, in thread ``_committing``, seals it), until the commit stores it
    _set_aside: list[tuple[Digest, PackEncoding]] | None = None
    _committing: int = 0

    def _store_chunk_job(self, view: memoryview, dtype: str, itemsize: int,
                         base: BaseSlot | None, digest: Digest | None = None,
                         claim: Callable[[Digest], Claim] | None = None, *,
                         place: Place | None = None, seq: int | None = None) -> StoredChunk:
        try:
            if place is None:
                return self._store_chunk(view, dtype, itemsize, base, digest, claim, seq=seq)
            return self._store_chunk_at(place, view, dtype, itemsize, base, seq)
        finally:
            self._inflight.release()

    def _store_chunk_at(self, place: Place, view: memoryview, dtype: str, itemsize: int,
                        base: BaseSlot | None, seq: int | None = None) -> StoredChunk:
        """Store a chunk that may be a base of the run's next save, from a copy kept
        for that save where the last save wrote this place anew, and with the copy
        the last save kept of its base, if any (chunkstore.handle.basecopies)."""
        copies = self._parent.copies
        copy = copies.buffer(len(view)) if copies.copy_first(place) else None
        if copy is not None:  # hashed, encoded and written from the copy, never the array
            copy_bytes(memoryview(copy), view)
            view = memoryview(copy)
        base_copy = None if base is None else copies.base(place, base.digest)
        try:
            stored = self._store_chunk(view, dtype, itemsize, base, base_copy=base_copy, seq=seq)
        except BaseException:
            copies.release(copy)
            raise
        finally:
            copies.release(base_copy)
        digest, new, chain, slot, _ = stored
        written = new is not None or (slot is not None and slot.new)
        copies.leave(place, digest, copy, written=written,
                     as_base=written and len(chain) < self._parent.depth
                     and not self._parent.skips.will_skip(*place))
        return stored

    def _store_chunk(self, view: memoryview, dtype: str, itemsize: int,
                     base: BaseSlot | None, digest: Digest | None = None,
                     claim: Callable[[Digest], Claim] | None = None,
                     base_copy: bytearray | None = None, seq: int | None = None
                     ) -> StoredChunk:
        """Store one chunk; ``digest`` and ``claim`` when the caller hashed and claimed
        it already (a small tensor's batch: :meth:`_pre_claimed`); ``base_copy``: the
        raw bytes of ``base`` when a copy was kept; ``seq``: its place in the pack
        order, when it is packed (:meth:`_store_member`)."""
        if seq is not None:
            return self._store_member(view, dtype, itemsize, base, base_copy, seq)
        if digest is None:
            digest = self._store.objects.chunk_ids.of(view)
        packed = self._reuse_packed(digest) if claim is None else None
        if packed is not None:
            return packed
        if self._reusable(CHUNK, digest, claim or self._claim):
            chain = self._reusable_chain(digest)
            if chain is not None:
                return digest, None, chain[0], None, chain[1]
            # A base of the stored object cannot be referenced: store the chunk whole.
            return self._write(digest, view, dtype, itemsize, None)
        if base is not None and self._refs_reusable(*base.refs()):
            return self._write(digest, view, dtype, itemsize, base, base_copy)
        return self._write(digest, view, dtype, itemsize, None)

    def _store_member(self, view: memoryview, dtype: str, itemsize: int,
                      base: BaseSlot | None, base_copy: bytearray | None, seq: int
                      ) -> StoredChunk:
        """A chunk of a larger tensor in a store with delta chains, packed: reused
        where the parent lists it (with its chain) or the index knows it, else
        encoded (a delta against ``base`` when that pays) and handed to the open
        pack at place ``seq``, which is always handed over, so later members are
        not held up."""
        digest = _NO_DIGEST
        try:
            digest = self._store.objects.chunk_ids.of(view)
            reused = self._reuse_listed(digest)
            if reused is None:
                generation = self._fence.generation  # before the claim: see _pre_claimed
                claimed, location = self._small_claims.claim(digest)
                reused = self._reuse_small(digest, self._pre_claimed(claimed, generation),
                                           claimed, location)
            if reused is None:
                if base is not None and not self._refs_reusable(*base.refs()):
                    base = None
                header, payload, chain, locations = self._encode(view, dtype, itemsize, base,
                                                                 base_copy)
        except BaseException:
            self._packs.add(seq, digest, None, 0)
            raise
        if reused is not None:
            self._packs.add(seq, digest, None, 0)
            return reused
        # A raw payload is a view of the chunk, and the chunk may be a copy whose buffer
        # serves another chunk once this one is stored (chunkstore.handle.basecopies): the pack
        # joins its members later, so it gets bytes of its own.
        member = (header.pack(), payload if isinstance(payload, bytes) else bytes(payload))
        slot = self._packs.add(seq, digest, member, len(view), (chain, locations))
        return digest, None, chain, slot, locations

    def _delta_payload(self, view: memoryview, dtype: str, itemsize: int, base: BaseSlot,
                       base_copy: bytearray | None) -> Judged:
        policy = self._store.compression
        known = self._parent.skips.known_ratio(base)
        if base_copy is not None:
            return encode_delta(policy, view, memoryview(base_copy), dtype, itemsize, known)
        probe = probe_length(len(view), itemsize)
        # On a local disk the base's first bytes are read to judge first; on an object
        # store that would fetch the chain twice when the delta pays.
        if (probe and self._store.objects.local_path() is not None
                and not self._parent.skips.paid_last(base)
                and self._store.base_cache.get(base.digest) is None):
            prefix = base_prefix(self._store, base.digest, base.chain, probe, len(view),
                                 base.refs()[1])
            if prefix is not None and not delta_may_pay(policy, view, prefix, dtype, itemsize):
                return None, None, None
        try:
            base_raw = base_bytes(self._store, base.digest, base.chain, len(view),
                                  location=base.location, locations=base.locations)
        except ChunkStoreError as exc:  # a damaged base: write standalone, verify reports it
            log.warning("chunk %s cannot serve as a delta base: %s", base.digest.short(), exc)
            return None, None, None
        return encode_delta(policy, view, base_raw, dtype, itemsize, known)

    def _encode(self, view: memoryview, dtype: str, itemsize: int, base: BaseSlot | None,
                base_copy: bytearray | None = None, *, compression: str | None = None
                ) -> tuple[ChunkHeader, bytes | memoryview, tuple[Digest, ...], Locations]:
        """The object's header and payload, and the chain it lists (with where its
        bases lie): a delta against ``base`` when that pays.  ``compression``: the
        policy of a standalone encoding, when not the store's."""
        standalone = None
        if base is not None:
            delta, standalone, measured = self._delta_payload(view, dtype, itemsize, base,
                                                              base_copy)
            if delta is None:
                self._parent.skips.did_not_pay(base)
            else:
                self._parent.skips.paid(base, measured)
                codec, payload = delta
                header = ChunkHeader(codec.id, itemsize, len(view), len(payload), base.digest)
                return (header, payload, *base.refs())
        codec, payload = standalone or encode_with_policy(compression or self._store.compression,
                                                          view, dtype, itemsize)
        return ChunkHeader(codec.id, itemsize, len(view), len(payload)), payload, (), ()

    def _write(self, digest: Digest, view: memoryview, dtype: str, itemsize: int,
               base: BaseSlot | None, base_copy: bytearray | None = None) -> StoredChunk:
        """Write the chunk with put-if-absent (a delta against ``base`` when that pays)."""
        header, payload, chain, locations = self._encode(view, dtype, itemsize, base, base_copy)
        data = encode_object(header, payload)
        if self._store.objects.put_if_absent_deferred(CHUNKS, digest, data):
            return (digest, NewChunk(digest, header.codec_id, len(view), len(data)), chain, None,
                    locations)
        # Already stored (an orphan of an earlier save, a chunk GC had condemned,
        # or a concurrent writer): reuse it only if it is standalone and decodes
        # to these bytes, else replace it whole, standalone (an existing object is
        # never replaced by a delta: other versions may list a shorter chain).
        try:
            existing = self._store.objects.get(CHUNKS, digest)
            found = parse_header(digest, existing)
            if found.base is None:
                decode_object(digest, existing, ids=self._store.objects.chunk_ids)
                return (digest, NewChunk(digest, found.codec_id, len(view), len(existing)), (),
                        None, ())
        except (FileNotFoundError, ChunkStoreError):
            pass
        if chain:
            header, payload, chain, _ = self._encode(view, dtype, itemsize, None)
            data = encode_object(header, payload)
        self._store.objects.put(CHUNKS, digest, data)
        return digest, NewChunk(digest, header.codec_id, len(view), len(data)), (), None, ()

    def _flush_small(self) -> None:
        """Hash the waiting small chunks (the caller and idle workers, a thread per
        core), claim what they can reuse in one index transaction, then hand them to
        the workers, each with its place in the pack order."""
        waiting, self._small, self._small_bytes = self._small, [], 0
        if not waiting:
            return
        digests = digests_of([view for _, view, _, _ in waiting], self._store.executor,
                             self._store.hashing_helpers, self._store.objects.chunk_ids)
        batch = [SmallChunk(pending, view, dtype, itemsize, digest)
                 for (pending, view, dtype, itemsize), digest in zip(waiting, digests,
                                                                      strict=True)]
        self._heartbeat_now_and_then()
        generation = self._fence.generation  # read before the claims: see _pre_claimed
        claims = self._store.index.claim_small(self._session, [c.digest for c in batch])
        limit = self._store.chunk_size
        start = 0
        while start < len(batch):
            end, size = start, 0
            while end < len(batch) and end - start < SMALL_GROUP_COUNT and (
                    end == start or size + len(batch[end].view) <= limit):
                size += len(batch[end].view)
                end += 1
            group = [(chunk, *claims[chunk.digest], self._packs.reserve())
                     for chunk in batch[start:end]]
            self._inflight.acquire()
            future = self._store.executor.submit(self._store_small_group, group, generation)
            for part, chunk in enumerate(batch[start:end]):
                chunk.pending.futures.append(future)
                chunk.pending.part = part
            start = end

    def _store_small_group(self, group: list[tuple[SmallChunk, Claim, PackLocation | None,
                                                    int]], generation: int) -> list[StoredChunk]:
        """Store a group of small chunks in order (see :meth:`_store_small`); on an
        error, hand over the places of the rest too, so later members are not held up."""
        stored: list[StoredChunk] = []
        try:
            for chunk, claimed, location, seq in group:
                stored.append(self._store_small(chunk, self._pre_claimed(claimed, generation),
                                                claimed, location, seq))
            return stored
        except BaseException:
            for chunk, _, _, seq in group[len(stored) + 1:]:
                self._packs.add(seq, chunk.digest, None, 0)
            raise
        finally:
            self._inflight.release()

    def _store_packed_chunk_job(self, pending: PendingTensor, view: memoryview, dtype: str,
                                itemsize: int, seq: int) -> StoredChunk:
        """A chunk of a tensor of several chunks, in a store without delta chains: hashed
        and claimed here, in a worker (so hashing runs on every core), then stored as a
        small chunk is (:meth:`_store_small`): reused, or packed at place ``seq``."""
        try:
            try:
                digest = self._store.objects.chunk_ids.of(view)
                self._heartbeat_now_and_then()
                generation = self._fence.generation  # before the claim: see _pre_claimed
                claimed, location = self._store.index.claim_small(self._session,
                                                                  [digest])[digest]
            except BaseException:
                self._packs.add(seq, _NO_DIGEST, None, 0)  # later members are not held up
                raise
            chunk = SmallChunk(pending, view, dtype, itemsize, digest)
            return self._store_small(chunk, self._pre_claimed(claimed, generation), claimed,
                                     location, seq)
        finally:
            self._inflight.release()

    def _policy_of(self, chunk: SmallChunk) -> str:
        """The policy a small chunk is encoded with: raw under ``auto`` for a tensor of
        one chunk under ``raw_tensor_bytes`` (chunkstore.codecs.policy.tensor_policy)."""
        if len(chunk.view) != math.prod(chunk.pending.shape) * chunk.itemsize:
            return self._store.compression  # a chunk of a larger tensor
        return tensor_policy(self._store.compression, len(chunk.view),
                             self._store.raw_tensor_bytes)

    def _store_small(self, chunk: SmallChunk, claim: Callable[[Digest], Claim],
                     claimed: Claim, location: PackLocation | None, seq: int) -> StoredChunk:
        """Reuse the chunk, or encode it standalone and hand it to the open pack (its
        place ``seq`` is always handed over, so later members are not held up)."""
        member = None
        try:
            reused = self._reuse_small(chunk.digest, claim, claimed, location)
            if reused is None:
                header, payload, _, _ = self._encode(chunk.view, chunk.dtype, chunk.itemsize,
                                                     None, compression=self._policy_of(chunk))
                member = (header.pack(), payload)
        except BaseException:
            self._packs.add(seq, chunk.digest, None, 0)
            raise
        slot = self._packs.add(seq, chunk.digest, member, len(chunk.view))
        return reused if reused is not None else (chunk.digest, None, (), slot, ())

    def _write_pack(self, digest: Digest, pack: PackEncoding) -> int:
        """Store a sealed pack object, given as its header and members (see
        :class:`~chunkstore.read.packs.PackBuilder`), as a new chunk object would be
        (:meth:`_store_pack`); return the bytes written.

        The last pack a commit seals (in the committing thread, while ``_set_aside``
        is a list) is only put aside, 0 bytes written so far: the commit claims it with
        the version's nodes, in their transaction, and stores it before them
        (:meth:`~chunkstore.write.writer.VersionWriter._write_nodes`)."""
        if self._set_aside is not None and threading.get_ident() == self._committing:
            self._set_aside.append((digest, pack))
            return 0
        return self._store_pack(digest, pack, self._claim)

    def _store_pack(self, digest: Digest, pack: PackEncoding,
                    claim: Callable[[Digest], Claim]) -> int:
        """Claim the pack (``claim``), wait out a GC that is deleting or fencing a copy,
        put-if-absent; return the bytes written."""
        if self._reusable(CHUNK, digest, claim):
            return 0  # the same pack is stored and safe to reference: nothing written
        size = self._store.objects.pack_size(pack)
        if self._store.objects.put_if_absent_deferred(CHUNKS, digest, pack):
            return size
        try:  # a copy exists (an orphan of an earlier save): keep it only if intact
            decode_object(digest, self._store.objects.get(CHUNKS, digest),
                          ids=self._store.objects.chunk_ids)
            return size
        except (FileNotFoundError, ChunkStoreError):
            pass
        self._store.objects.put(CHUNKS, digest, pack)
        return size
