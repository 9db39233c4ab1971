"""Delta saves: a chunk encoded against the same chunk of the run's previous version.

How a save uses deltas (the writer calls these; the format is docs/format.md
§3.4, the safety argument the last paragraph):

1. when the save opens, the run's latest version (the parent of the version
   being saved) is read: its tensor entries by name, and for every chunk it
   lists, the delta chain its manifest lists (:class:`ParentChunks`);
2. a chunk that is already stored is reused as deduplication always did,
   and its listed chain is taken from the parent's manifest or, for a chunk
   the parent does not list, from the object headers; every base of the
   chain is claimed like the chunk itself (a packed base: its pack), and
   when one cannot be (a GC has condemned it) the chunk is written
   standalone instead.  A packed chunk is reused with its chain only where
   the parent lists it (the index remembers standalone members only);
3. a new chunk whose tensor has the same dtype, shape and chunk size in the
   parent is encoded against the parent's chunk at the same position, when
   that chunk's chain is shorter than the store's ``delta_depth``: the base
   and its chain are claimed first (they are *reused*, exactly as a dedup
   hit is), then decoded and verified, differenced with the new bytes and encoded
   (:func:`encode_delta`).  The delta is kept only when it is below
   ``MARGIN`` of the standalone encoding's size;
4. the version's manifest lists the chain of every chunk (``bases``), so
   the mark phase of GC and ``index rebuild`` see each base as referenced by
   every version that needs it, without reading a chunk object.

Why no interleaving loses a base: a base is never written by the save that
depends on it, only reused, and it is claimed through the same path as a
deduplicated chunk (session object stored and GC journal read first, the
store-level fence honoured, the index claim taken), so whatever protects a
dedup target protects a base.  Delta objects are only ever created with
put-if-absent; an existing object is only ever replaced by a standalone
encoding, so the chain a manifest lists can only be longer than the one its
object needs, never shorter (and a reader refuses a base that is not listed).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from chunkstore.codecs import SPARSE_DELTA, SUB_DELTA, XOR_DELTA, Codec
from chunkstore.codecs.policy import PROBE_BYTES, encode_with_policy
from chunkstore.codecs.sparsedelta import encode_runs, runs_of
from chunkstore.codecs.subdelta import LANES
from chunkstore.errors import ChunkStoreError
from chunkstore.format.digest import Digest
from chunkstore.format.manifest import PackLocation, TensorEntry
from chunkstore.handle.basecopies import BaseCopies
from chunkstore.handle.tree import flatten
from chunkstore.read.members import Locations

if TYPE_CHECKING:
    from chunkstore.handle.handle import StoreHandle

#: A delta is kept only below this fraction of the standalone encoding's size:
#: every link of a chain costs a read and a decode on restore.  Measured with
#: sub-delta on the suite's dense and mixed-precision workloads (delta_depth 2, /tmp
#: A/B scripts): at 0.8 only weights take deltas (Adam's second moment saves ~8%, its
#: first ~1%), and a delta version stores 0.793 / 0.733 of a full copy; at 0.9 the
#: second moment takes deltas too, 0.774 / 0.717; 0.95 adds nothing more.
MARGIN = 0.9
#: A tensor of one chunk smaller than this is stored standalone: its delta saves few
#: bytes and costs as much per object (a base to read and decode) as a large one.
MIN_DELTA_TENSOR_BYTES = 64 * 1024
#: A new chunk is encoded against a base only while that base's chain (the base and
#: every base under it) stores at most this many times the chunk's raw bytes, so a
#: read of any chunk reads at most about three times its raw bytes, whatever the
#: store's ``delta_depth`` allows (Mercurial's revlog bounds its delta chains by
#: their bytes alike).  Dense updates, whose deltas store most of a full copy, get
#: chains of about 2; sparse ones, whose deltas (sparse-delta: a read adds what
#: changed alone) store a tenth of it, chains of ten or more.
CHAIN_BYTES = 2.0
#: Policies under which a save writes deltas (``none`` is the fastest path, raw).
DELTA_POLICIES = ("auto",)


#: A chunk position whose delta did not pay is stored standalone, without trying,
#: for this many saves of the same handle (its base would be read and decoded for
#: nothing: a dense update rarely changes character from one save to the next).
SKIP_SAVES = 4
#: A position whose delta paid is judged by the next this many saves against the
#: standalone encoding's bytes per raw byte measured then, encoding only the delta: a
#: dense update's planes compress alike from one save to the next, and judging anew
#: encoded every chunk up to 256 KiB both ways (a probe of each way above that).  A
#: delta that misses the measured ratio is judged anew, both ways, before it is dropped.
RATIO_USES = 4

#: What the last saves learnt, by tensor and position: saves left to skip a delta that
#: did not pay (a positive count) or that the last delta paid (``Skips.PAID``); and for
#: positions whose delta paid, the standalone bytes per raw byte measured then and the
#: judgements it may still serve.
Learnt = tuple[dict[str, dict[int, int]], dict[str, dict[int, tuple[float, int]]]]


@dataclass(frozen=True)
class BaseSlot:
    """The chunk a new chunk may be encoded against, with that chunk's listed chain,
    and the tensor and position it serves (to remember a delta that did not pay)."""

    digest: Digest
    chain: tuple[Digest, ...]
    name: str = ""
    position: int = 0
    #: where the base lies inside a pack (None: an object of its own)
    location: PackLocation | None = None
    #: where each base of its chain lies inside a pack (empty: objects of their own)
    locations: Locations = ()

    def refs(self) -> tuple[tuple[Digest, ...], Locations]:
        """The chain a delta against this base lists, and where its bases lie."""
        return ((self.digest, *self.chain),
                (self.location, *(self.locations or (None,) * len(self.chain))))


#: How the parent lists a chunk: where it lies in a pack (None: an object of its own),
#: its chain, and where the chain's bases lie.
Listing = tuple[PackLocation | None, tuple[Digest, ...], Locations]


class Skips:
    """What the last saves learnt per chunk position, by tensor: saves left to skip a
    delta that did not pay (a positive count), or that the last delta paid (``PAID``),
    with the ratio it was judged against (:data:`Learnt`)."""

    PAID = -1

    def __init__(self, previous: Learnt | None = None) -> None:
        self._previous, self._ratios = previous or ({}, {})
        self._next: dict[str, dict[int, int]] = {}
        self._next_ratios: dict[str, dict[int, tuple[float, int]]] = {}
        self._lock = threading.Lock()

    def skip(self, name: str, position: int) -> bool:
        """Whether to skip the delta of this position in this save (counting it down)."""
        left = self._previous.get(name, {}).get(position, 0)
        if left > 1:
            with self._lock:
                self._next.setdefault(name, {})[position] = left - 1
        return left > 0

    def will_skip(self, name: str, position: int) -> bool:
        """Whether the next save skips the delta of this position (what this save
        learnt so far: call it once the position's chunk is stored)."""
        with self._lock:
            return self._next.get(name, {}).get(position, 0) > 0

    def paid_last(self, slot: BaseSlot) -> bool:
        """Whether the last save's delta at this position paid (so a probe is skipped)."""
        return self._previous.get(slot.name, {}).get(slot.position) == self.PAID

    def known_ratio(self, slot: BaseSlot) -> float | None:
        """The standalone bytes per raw byte a paying delta at this position was last
        judged against, while it may still serve (:data:`RATIO_USES`)."""
        if not self.paid_last(slot):
            return None
        known = self._ratios.get(slot.name, {}).get(slot.position)
        return None if known is None else known[0]

    def carry(self, name: str, position: int) -> None:
        """Pass what this position learnt on to the next save unchanged: this save
        stores it standalone because its chain is full, and judges nothing there."""
        with self._lock:
            if position in self._previous.get(name, {}):
                self._next.setdefault(name, {})[position] = self._previous[name][position]
            if position in self._ratios.get(name, {}):
                self._next_ratios.setdefault(name, {})[position] = self._ratios[name][position]

    def did_not_pay(self, slot: BaseSlot) -> None:
        with self._lock:
            self._next.setdefault(slot.name, {})[slot.position] = SKIP_SAVES

    def paid(self, slot: BaseSlot, measured: float | None) -> None:
        """The delta paid, judged against the ratio ``measured`` now, or (None) against
        the one learnt before, which then has one judgement fewer left."""
        with self._lock:
            self._next.setdefault(slot.name, {})[slot.position] = self.PAID
            if measured is not None:
                ratio, uses = measured, RATIO_USES
            else:
                ratio, uses = self._ratios.get(slot.name, {}).get(slot.position, (0.0, 1))
                uses -= 1
            if uses > 0:
                self._next_ratios.setdefault(slot.name, {})[slot.position] = (ratio, uses)

    def carried(self) -> Learnt:
        with self._lock:
            return ({name: dict(left) for name, left in self._next.items()},
                    {name: dict(known) for name, known in self._next_ratios.items()})


class ParentChunks:
    """What a save needs to know of the run's previous version (step 1 above).

    Built from the parent's manifest, or taken from the store handle's cache
    when this process saved the parent (:meth:`remember`): a training loop's
    saves then read no manifest node of the previous version.
    """

    def __init__(self, store: StoreHandle, run: str) -> None:
        self.depth = store.delta_depth if store.compression in DELTA_POLICIES else 0
        self._entries: dict[str, TensorEntry] = {}
        self.listings: dict[Digest, Listing] = {}
        self.skips = Skips()
        parent = store.latest(run)
        # Copies of the parent's chunks this handle kept (chunkstore.handle.basecopies).
        self.copies = (store.base_copies.for_save(run, parent.id if parent else None)
                       if self.depth else BaseCopies(0).for_save(run, None))
        if parent is None:
            return
        cached = store.parent_cache.get(run)
        if cached is not None and cached[0] == parent.id:
            self._entries, self.listings, self.skips = cached[1], cached[2], Skips(cached[3])
            return
        try:
            flat = flatten(store.objects, parent.root, store.node_cache)
        except ChunkStoreError:
            return  # an unreadable parent: every chunk is written standalone
        self._learn({name: leaf for name, leaf in flat.leaves.items()
                     if isinstance(leaf, TensorEntry)})

    def _learn(self, entries: dict[str, TensorEntry]) -> None:
        self._entries = entries
        self.listings = {}
        for leaf in entries.values():
            for shard in leaf.shards:
                for i, digest in enumerate(shard.chunks):
                    chain, locations = shard.chain(i), shard.chain_locations(i)
                    self.listings.setdefault(digest, (shard.location(i), chain, locations))
                    for k, base in enumerate(chain):
                        self.listings.setdefault(base, (locations[k], chain[k + 1:],
                                                        locations[k + 1:]))

    def remember(self, store: StoreHandle, run: str, version_id: str,
                 entries: dict[str, TensorEntry]) -> None:
        """Cache what the next save of ``run`` needs of the version just committed."""
        known = ParentChunks.__new__(ParentChunks)
        known._learn(entries)
        store.parent_cache[run] = (version_id, known._entries, known.listings,
                                   self.skips.carried())

    def bases(self, name: str, dtype: str, shape: tuple[int, ...], chunk_bytes: int
              ) -> list[BaseSlot | None]:
        """The base of each chunk of a new tensor (None: standalone), by position."""
        entry = self._entries.get(name)
        if (self.depth == 0 or entry is None or (entry.dtype, entry.shape) != (dtype, shape)
                or entry.nbytes < min(MIN_DELTA_TENSOR_BYTES, chunk_bytes + 1)
                or len(entry.shards) != 1 or entry.shards[0].chunk_bytes != chunk_bytes
                or entry.shards[0].sizes != shape):
            return []
        shard = entry.shards[0]
        slots: list[BaseSlot | None] = []
        for i, digest in enumerate(shard.chunks):
            raw_length = min(chunk_bytes, entry.nbytes - i * chunk_bytes)
            if (len(shard.chain(i)) >= self.depth
                    or chain_bytes(shard.location(i), shard.chain_locations(i))
                    > CHAIN_BYTES * raw_length):
                self.skips.carry(name, i)  # standalone: the chain is full
                slots.append(None)
            elif self.skips.skip(name, i):
                slots.append(None)
            else:
                slots.append(BaseSlot(digest, shard.chain(i), name, i, shard.location(i),
                                      shard.chain_locations(i)))
        return slots


Standalone = tuple[Codec, bytes | memoryview]


def chain_bytes(location: PackLocation | None, locations: Locations) -> int:
    """The stored bytes of a chunk at ``location`` and of its chain's bases at
    ``locations``, as far as the manifest gives them: an object of its own (written
    before deltas were packed, chunk format 4 and earlier) counts as nothing, its
    chain bounded by the store's ``delta_depth`` alone, as such chains always were."""
    return sum(0 if at is None else at.length for at in (location, *locations))


def probe_length(raw_length: int, itemsize: int) -> int:
    """The prefix a delta is judged on first (0: the chunk is judged whole)."""
    return 0 if raw_length <= 4 * PROBE_BYTES else PROBE_BYTES - PROBE_BYTES % itemsize


def _probe_pays(policy: str, raw: memoryview, base: bytes | memoryview, dtype: str,
                itemsize: int) -> float | None:
    """The standalone encoding's bytes per raw byte on the probe, when the delta's
    encoding of it is below ``MARGIN`` of that; else None."""
    n = probe_length(len(raw), itemsize)
    probe = len(encode_with_policy(policy, raw[:n], dtype, itemsize)[1])
    codec = delta_codec(itemsize)
    delta_probe = codec.encode(codec.image_of(raw[:n], base[:n], itemsize), itemsize)
    return probe / n if len(delta_probe) < MARGIN * probe else None


def delta_codec(itemsize: int) -> Codec:
    """The codec a writer encodes deltas with: sub-delta where the element size is a
    machine integer's (1, 2, 4, 8 bytes), xor-delta otherwise (``complex128``)."""
    return SUB_DELTA if itemsize in LANES else XOR_DELTA


def delta_may_pay(policy: str, raw: memoryview, base_prefix: bytes, dtype: str,
                  itemsize: int) -> bool:
    """Judge a delta on the probe against the base's first bytes alone (the base
    need not be read whole when the delta will not pay)."""
    return _probe_pays(policy, raw, base_prefix, dtype, itemsize) is not None


#: What judging a delta gives: the delta's codec and payload when it pays (else None),
#: the standalone encoding when judging made it whole (so it is not made twice), and the
#: standalone bytes per raw byte measured (None: judged against a ratio learnt before).
Judged = tuple[Standalone | None, Standalone | None, float | None]


def encode_delta(policy: str, raw: memoryview, base: bytes | memoryview, dtype: str,
                 itemsize: int, known_ratio: float | None = None) -> Judged:
    """Encode ``raw`` against ``base`` and judge whether the delta pays.

    With ``known_ratio`` (the position's last delta paid: :meth:`Skips.known_ratio`)
    only the delta is encoded and judged against that ratio; a delta that misses it
    is judged anew.  Else a chunk over 256 KiB is judged on a 64 KiB probe first,
    both ways, so a delta that does not pay costs two small encodes, not a full one,
    and a smaller chunk is encoded both ways.
    """
    if len(base) != len(raw) or not raw:
        return None, None, None
    delta = None
    if known_ratio is not None:
        delta = encode_image(raw, base, itemsize)
        if len(delta[1]) < MARGIN * known_ratio * len(raw):
            return delta, None, None
    if delta is not None or not probe_length(len(raw), itemsize):
        standalone = encode_with_policy(policy, raw, dtype, itemsize)
        if delta is None:
            delta = encode_image(raw, base, itemsize)
        pays = len(delta[1]) < MARGIN * len(standalone[1])
        return (delta if pays else None), standalone, len(standalone[1]) / len(raw)
    ratio = _probe_pays(policy, raw, base, dtype, itemsize)
    if ratio is None:
        return None, None, None
    delta = encode_image(raw, base, itemsize)
    if len(delta[1]) >= MARGIN * ratio * len(raw):
        return None, None, None
    return delta, None, ratio


def encode_image(raw: memoryview, base: bytes | memoryview, itemsize: int) -> Standalone:
    """The delta of ``raw`` against ``base``: sparse-delta where at most half of the
    elements changed (a reader then adds what changed alone), else the element size's
    delta codec (:func:`delta_codec`)."""
    codec = delta_codec(itemsize)
    image = codec.image_of(raw, base, itemsize)
    if codec is SUB_DELTA:
        runs = runs_of(image, itemsize)
        if runs is not None:
            return SPARSE_DELTA, encode_runs(image, itemsize, *runs)
    return codec, codec.encode(image, itemsize)
