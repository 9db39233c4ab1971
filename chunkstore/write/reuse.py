"""Whether a save may reference an object it did not write: the dedup decisions.

A save reuses a stored chunk object, a pack (for a member of it), or the bases
a reused delta lists, instead of writing them.  Every such decision is taken
here, by one rule (invariants 1 and 3 in DESIGN.md; the GC side is in
:mod:`chunkstore.maintenance.gc`, the order of a save in :mod:`chunkstore.write.writer`):

1. while an active GC run's journal entry names the object, the save waits for
   that run (``Fence.blocking``), and then does not reuse it: it writes the
   object (put-if-absent keeps an intact copy);
2. the save's index session claims the object (one transaction per group of
   claims, :class:`chunkstore.index.claims.GroupClaims`), so a GC of the same index
   leaves it alone; only a LIVE record is reused, a DELETING one is waited out;
3. the object is checked to exist, so one lost behind the index's back is
   written again, not referenced: at every reuse where a stat is cheap (a local
   store) or the GC journal could not be read; elsewhere, where a check costs a
   request, once per store handle (``Store.seen_stored``: what a save of the
   handle found stored, or stored and published), before its first reuse.
   What the protocol deletes is kept out by rules 1 and 2 whenever it happens;
   the check catches what vanished outside it before the process opened the
   store (a bucket put back to an older copy, a lifecycle rule).

A pack is decided once per save, and the workers that reach it while the first
checks it wait for that answer; a reused delta is reused only with every object
of the chain its listing names, each decided by the same rule.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

from chunkstore.errors import BackendError
from chunkstore.format.digest import Digest
from chunkstore.format.manifest import MAX_DELTA_DEPTH, PackLocation
from chunkstore.index.claims import GroupClaims
from chunkstore.index.gclock import finish_abandoned_deletions
from chunkstore.index.lmdbindex import CHUNK, Claim, NewChunk
from chunkstore.objects.kinds import CHUNKS, NODES
from chunkstore.protocol.journal import Fence
from chunkstore.read.chain import header_chain
from chunkstore.read.members import Chain, Locations
from chunkstore.read.packs import PackSlot
from chunkstore.write.delta import ParentChunks

if TYPE_CHECKING:
    from chunkstore.handle.handle import StoreHandle

DELETING_WAIT_S = 120.0
HEARTBEAT_S = 30.0

#: What storing one chunk gives: its digest, what was written as an object of its own
#: (None: reused, or packed), the chain of bases its object may need (nearest first;
#: empty when standalone), where it lies in a pack (None: an object of its own; a packed
#: chunk lists its slot's chain, not this one), and where the chain's bases lie.
StoredChunk = tuple[Digest, NewChunk | None, tuple[Digest, ...], PackSlot | None, Locations]


class Reuse:
    """The dedup decisions of one save (a part of :class:`chunkstore.write.writer.VersionWriter`,
    which sets these attributes)."""

    _store: StoreHandle
    _session: str
    _fence: Fence
    _check_dedup: bool
    _claims: GroupClaims[Claim]
    _small_claims: GroupClaims[tuple[Claim, PackLocation | None]]
    _last_heartbeat: float
    _parent: ParentChunks
    _reusable_packs: dict[Digest, Future[bool]]
    _reusable_packs_lock: threading.Lock

    def _claim(self, digest: Digest) -> Claim:
        self._heartbeat_now_and_then()
        return self._wait_out_deletion(digest, lambda: self._claims.claim(digest))

    def _wait_out_deletion(self, digest: Digest, claim: Callable[[], Claim]) -> Claim:
        """Claim; while GC deletes the object, wait (or finish a crashed GC's deletion)."""
        deadline = time.monotonic() + DELETING_WAIT_S
        while True:
            result = claim()
            if result != Claim.WAIT:
                return result
            finish_abandoned_deletions(self._store.index)
            if time.monotonic() > deadline:
                raise BackendError(f"object {digest.short()} has been in deletion by GC for"
                                   f" {DELETING_WAIT_S:.0f}s; is a GC run stuck?")
            time.sleep(0.02)

    def _node_claimer(self, digest: Digest) -> Callable[[], Claim]:
        return lambda: self._store.index.claim_nodes(self._session, [digest])[digest]

    def _heartbeat_now_and_then(self) -> None:
        if time.monotonic() - self._last_heartbeat > HEARTBEAT_S:
            self._last_heartbeat = time.monotonic()
            self._store.index.heartbeat(self._session)

    def _reusable(self, kind: bytes, digest: Digest, claim: Callable[[Digest], Claim]) -> bool:
        """Claim the object; True when it may be referenced without writing it.

        An object an active GC run may delete is never reused: the save waits
        for that run first, and then writes it (keeping an intact copy).
        """
        fenced = False
        # Every active entry that names it, not only the first: each one's GC
        # relies on this save (which listed it as seen) not to touch the object.
        while (blocker := self._fence.blocking(kind, digest)) is not None:
            self._fence.wait(blocker)
            fenced = True
        if claim(digest) != Claim.DEDUP or fenced:
            return False
        if self._check_dedup or not self._store.seen_stored(kind, digest):
            if not self._store.objects.exists(CHUNKS if kind == CHUNK else NODES, digest):
                self._store.index.forget_missing(kind, digest)
                return False
            self._store.saw_stored(kind, (digest,))
        return True

    def _pre_claimed(self, claimed: Claim, generation: int) -> Callable[[Digest], Claim]:
        """The claim function of a chunk claimed with its batch: the batch's answer while
        no GC journal entry was applied to the index since it was taken, else a fresh
        claim.  (``_reusable`` asks after waiting out the fence: an entry applied in
        between may have made the object a deleted one that the answer still calls
        reusable.)"""
        def claim(digest: Digest) -> Claim:
            if claimed != Claim.WAIT and self._fence.generation == generation:
                return claimed
            return self._claim(digest)
        return claim

    def _reuse_small(self, digest: Digest, claim: Callable[[Digest], Claim], claimed: Claim,
                     location: PackLocation | None) -> StoredChunk | None:
        """A small chunk stored before, when it may be referenced without writing it:
        an object of its own, or a member of an older pack that may be reused."""
        if location is None:
            if claimed == Claim.DEDUP and self._reusable(CHUNK, digest, claim):
                chain = self._reusable_chain(digest)
                if chain is not None:
                    return digest, None, chain[0], None, chain[1]
            return None
        if self._pack_reusable(location.pack, claim):
            return digest, None, (), PackSlot(location), ()
        return None

    def _pack_reusable(self, pack: Digest, claim: Callable[[Digest], Claim]) -> bool:
        """Whether the older pack may be referenced: claimed, fenced and checked once
        per save, exactly as a dedup hit on any chunk object (the claim lasts the save).

        Once: the workers that ask about a pack while the first asker checks it wait
        for its answer.  (Each asked on its own before, and a save reusing the chunks
        of a few packs paid an index commit and a stat per chunk, not per pack: 268
        claims in 95 commits per re-save of a GiB of unchanged tensors.)"""
        with self._reusable_packs_lock:
            known = self._reusable_packs.get(pack)
            lead = known is None
            if known is None:
                known = self._reusable_packs[pack] = Future()
        if not lead:
            return known.result()
        try:
            reusable = self._reusable(CHUNK, pack, claim)
        except BaseException as exc:
            with self._reusable_packs_lock:  # a later asker checks again
                del self._reusable_packs[pack]
            known.set_exception(exc)
            raise
        known.set_result(reusable)
        return reusable

    def _reuse_packed(self, digest: Digest) -> StoredChunk | None:
        """A chunk this index saw stored standalone inside a pack (a save in a store
        with delta chains packs the chunks of larger tensors too), reused through its
        pack, claimed as a small chunk's is (``claim_small``: only a LIVE pack, and the
        location of a deleted one forgotten), then fenced and checked to exist as every
        dedup hit is (:meth:`_reuse_small`).  None: no pack may serve (the object path
        decides)."""
        generation = self._fence.generation  # before the claim: see _pre_claimed
        claimed, location = self._small_claims.claim(digest)
        if location is None:
            return None
        return self._reuse_small(digest, self._pre_claimed(claimed, generation), claimed,
                                 location)

    def _reuse_listed(self, digest: Digest) -> StoredChunk | None:
        """A chunk the parent lists inside a pack, when its pack and its chain's
        objects may be referenced (claimed and checked as every dedup hit is): the
        parent's listing, reused.  (The index remembers standalone members only: a
        packed delta is reused only with the chain a manifest lists for it.)"""
        listing = self._parent.listings.get(digest)
        if listing is None:
            return None
        location, chain, locations = listing
        if location is None:
            return None
        if not self._pack_reusable(location.pack, self._claim) \
                or not self._refs_reusable(chain, locations):
            return None
        return digest, None, chain, PackSlot(location, (chain, locations)), locations

    def _refs_reusable(self, chain: tuple[Digest, ...], locations: Locations) -> bool:
        """Whether every object a chain needs may be referenced: each base, or the pack
        a packed base lies in, claimed and checked as a dedup hit is."""
        return all(self._reusable(CHUNK, base, self._claim) if at is None
                   else self._pack_reusable(at.pack, self._claim)
                   for base, at in zip(chain, locations or (None,) * len(chain), strict=True))

    def _reusable_chain(self, digest: Digest) -> Chain | None:
        """The listed chain of a reused chunk object (and where its bases lie) with
        every base claimed, or None when one is not reusable (or the headers cannot
        be read)."""
        listing = self._parent.listings.get(digest)
        if listing is not None and listing[0] is None:  # the parent lists the object
            chain, locations = listing[1], listing[2]
        else:
            found = header_chain(self._store, digest, MAX_DELTA_DEPTH)
            if found is None:
                return None
            chain, locations = found, ()
        if not self._refs_reusable(chain, locations):
            return None
        return chain, locations
