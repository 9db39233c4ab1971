"""``report``: logical and physical bytes, dedup and compression, amplification; and,
for versions saved by several processes, the bytes each rank's shards hold."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from chunkstore.codecs import PACK, by_id
from chunkstore.errors import ChunkStoreError, CorruptNodeError, GcAbortedError, GcBusyError
from chunkstore.format.digest import Digest
from chunkstore.format.dtypes import element_size
from chunkstore.format.manifest import DataEntry, PackLocation, TensorEntry, decode_data
from chunkstore.format.shards import RANKS_ENTRY, ShardRanks
from chunkstore.handle.tree import FlatTree, Leaf, flatten, read_node
from chunkstore.index.indexfile import ReservePlan
from chunkstore.index.lmdbindex import CHUNK, NODE
from chunkstore.maintenance.drillhistory import DrillSummary, FailedDrill, drill_history
from chunkstore.read.reader import VersionReader

if TYPE_CHECKING:
    from chunkstore.handle.handle import StoreHandle
    from chunkstore.handle.versions import VersionInfo
    from chunkstore.maintenance.gc import GcResult


@dataclass(frozen=True)
class VersionStats:
    id: str
    run: str
    step: int
    created: str
    logical_bytes: int
    new_bytes: int
    new_stored_bytes: int


@dataclass(frozen=True)
class RankStats:
    """The shards one rank wrote in one version.

    ``new_bytes``: raw bytes of its chunks that no earlier version lists and no
    lower rank of this version lists (a chunk two ranks hold, such as a zero
    box, counts once, for the lower rank).
    """

    rank: int
    shards: int
    chunks: int
    logical_bytes: int
    new_bytes: int

    def to_json(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class VersionRanks:
    """A version saved by several processes, by rank (ranks that wrote nothing included)."""

    id: str
    run: str
    step: int
    world_size: int
    ranks: tuple[RankStats, ...]

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "run": self.run, "step": self.step,
                "world_size": self.world_size, "ranks": [r.to_json() for r in self.ranks]}


def shard_ranks(reader: VersionReader) -> ShardRanks | None:
    """The version's record of which rank wrote each shard; None when it has none
    (a save by one process, or one made before the record existed)."""
    return _ranks_record(reader.entries(), reader.get_data)


def _ranks_record(entries: dict[str, Leaf], get_data: Callable[[str], Any]
                  ) -> ShardRanks | None:
    """:func:`shard_ranks` of a version whose entries are ``entries`` (``get_data``
    reads a data entry)."""
    leaf = entries.get(RANKS_ENTRY)
    if not isinstance(leaf, DataEntry):
        return None
    value = get_data(RANKS_ENTRY)
    try:
        return ShardRanks.from_plain(value, dict(entries))
    except ValueError as exc:
        raise CorruptNodeError(leaf.digest.hex, f"malformed ranks record: {exc}") from exc


def ranks_of(entries: dict[str, Leaf], record: ShardRanks, seen: set[Digest] | None = None
             ) -> tuple[RankStats, ...]:
    """Per rank: shards, chunks, logical bytes and new bytes (chunks not in ``seen``,
    which gains this version's chunks; None: every chunk counts as new)."""
    seen = set() if seen is None else seen
    totals = [[0, 0, 0, 0] for _ in range(record.world_size)]
    shards = sorted(((rank, name, i) for name, ranks in record.ranks.items()
                     for i, rank in enumerate(ranks)))
    for rank, name, i in shards:  # lower ranks first: a chunk two ranks hold is new once
        entry = entries[name]
        assert isinstance(entry, TensorEntry)
        shard, row = entry.shards[i], totals[rank]
        itemsize = element_size(entry.dtype)
        row[0] += 1
        row[1] += len(shard.chunks)
        row[2] += shard.nbytes(itemsize)
        for digest, _start, length in shard.chunk_spans(itemsize):
            if digest not in seen:
                seen.add(digest)
                row[3] += length
    return tuple(RankStats(rank, *row) for rank, row in enumerate(totals))


@dataclass(frozen=True)
class RestoreReads:
    """What a restore of one version decodes, as its manifest lists it: every chunk of
    every tensor, and for a delta every base its chain lists (a read decodes the chain's
    root, then applies each delta on it, chunk by chunk)."""

    chunks: int
    #: bases decoded besides the chunks, summed over the chunks
    links: int
    #: the most bases one chunk's read decodes
    longest_chain: int
    #: stored bytes of the chunks and of their bases, each counted as often as it is read
    stored_bytes: int
    #: chunks and bases stored as objects of their own whose stored size the index does
    #: not hold (a stale index): left out of ``stored_bytes``
    unsized: int

    def to_json(self) -> dict[str, int]:
        return dict(self.__dict__)


def restore_reads(store: StoreHandle, leaves: dict[str, Leaf]) -> RestoreReads:
    """The chunks, delta links and stored bytes a restore of these entries decodes: from
    the manifest (a packed chunk's length) and the index (an object's stored size)."""
    sizes: dict[Digest, int | None] = {}

    def stored(digest: Digest, location: PackLocation | None) -> int | None:
        if location is not None:
            return location.length
        if digest not in sizes:
            record = store.index.chunk(digest)
            sizes[digest] = None if record is None else record.stored_length
        return sizes[digest]

    chunks = links = longest = total = unsized = 0
    for leaf in leaves.values():
        if not isinstance(leaf, TensorEntry):
            continue
        for shard in leaf.shards:
            for i, digest in enumerate(shard.chunks):
                chain = shard.chain(i)
                chunks, links, longest = chunks + 1, links + len(chain), max(longest, len(chain))
                for read, at in ((digest, shard.location(i)),
                                 *zip(chain, shard.chain_locations(i), strict=True)):
                    size = stored(read, at)
                    if size is None:
                        unsized += 1
                    else:
                        total += size
    return RestoreReads(chunks, links, longest, total, unsized)


def version_ranks(store: StoreHandle) -> list[VersionRanks]:
    """Every readable version that records its shards' ranks, oldest first; new
    bytes count against every earlier version (ranked or not)."""
    return _manifest_census(store, store.versions()).ranks


@dataclass
class StoreStats:
    """Sizes over the whole store.  Amplification = physical / logical of the latest version.

    Live objects are those a published version reaches; the rest await GC.
    What GC could reclaim comes from a GC dry run, so ``report`` and ``gc``
    agree by construction (after ``rm``, after ``index rebuild``, on orphans
    the index never knew).
    """

    versions: list[VersionStats] = field(default_factory=list)
    chunks: int = 0  # live chunks (packed ones included)
    unique_raw_bytes: int = 0  # the live chunks' bytes before encoding
    packs: int = 0  # live pack objects
    packed_chunks: int = 0  # live chunks stored inside packs
    #: bytes inside live packs that no live version lists (members of removed versions)
    packed_garbage_bytes: int = 0
    live_bytes: int = 0  # what the live chunk and node objects occupy
    awaiting_gc_objects: int = 0  # objects no published version reaches
    awaiting_gc_bytes: int = 0
    logical_bytes_total: int = 0  # sum over versions of their logical bytes
    latest_logical_bytes: int = 0
    reclaimable_now_objects: int = 0  # what a GC with ``grace_s`` deletes now
    reclaimable_now_bytes: int = 0
    grace_s: float = 0.0
    delta_chunks: int = 0  # live chunks stored as deltas (xor-, sub- or sparse-delta)
    #: mean number of bases behind a delta chunk, as the manifests list them
    mean_chain_depth: float = 0.0
    #: the most bases behind one chunk (what a read of the deepest chunk decodes)
    max_chain_depth: int = 0
    #: Why the awaiting-GC and reclaimable figures are unknown (a version cannot
    #: be read, so GC itself would delete nothing); None when they are known.
    gc_unknown: str | None = None
    #: Versions saved by several processes: their bytes by rank.
    ranks: list[VersionRanks] = field(default_factory=list)
    #: Per run (by name), its last successful drill (``chunkstore drill``).
    drills: list[DrillSummary] = field(default_factory=list)
    #: Per run, the newest drill that failed after its last successful one.
    failed_drills: list[FailedDrill] = field(default_factory=list)
    #: A warning for each drill record that could not be read (skipped).
    drill_warnings: list[str] = field(default_factory=list)
    #: The index's space reserve for rm and gc on a full disk, and what sizes it.
    space_reserve: ReservePlan | None = None

    @property
    def physical_bytes(self) -> int:
        """Everything the store's chunk and node objects occupy, live or not."""
        return self.live_bytes + self.awaiting_gc_bytes

    @property
    def reclaimable_chunks(self) -> int:  # the name of earlier releases
        return self.awaiting_gc_objects

    @property
    def reclaimable_bytes(self) -> int:  # the name of earlier releases
        return self.awaiting_gc_bytes

    @property
    def amplification(self) -> float:
        return self.physical_bytes / self.latest_logical_bytes if self.latest_logical_bytes else 0.0

    @property
    def dedup_ratio(self) -> float:
        """Logical bytes of all versions per unique live raw byte (higher is better)."""
        return self.logical_bytes_total / self.unique_raw_bytes if self.unique_raw_bytes else 0.0

    @property
    def compression_ratio(self) -> float:
        """Unique live raw bytes per live stored byte (higher is better)."""
        return self.unique_raw_bytes / self.live_bytes if self.live_bytes else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "versions": [v.__dict__ for v in self.versions],
            "totals": {
                "versions": len(self.versions), "chunks": self.chunks,
                "logical_bytes_total": self.logical_bytes_total,
                "latest_logical_bytes": self.latest_logical_bytes,
                "unique_raw_bytes": self.unique_raw_bytes,
                "live_bytes": self.live_bytes,
                "awaiting_gc_objects": self.awaiting_gc_objects,
                "awaiting_gc_bytes": self.awaiting_gc_bytes,
                "physical_bytes": self.physical_bytes,
                "dedup_ratio": round(self.dedup_ratio, 4),
                "compression_ratio": round(self.compression_ratio, 4),
                "amplification": round(self.amplification, 4),
                "reclaimable_objects": self.awaiting_gc_objects,
                "reclaimable_bytes": self.awaiting_gc_bytes,
                "reclaimable_now_objects": self.reclaimable_now_objects,
                "reclaimable_now_bytes": self.reclaimable_now_bytes,
                "grace_s": self.grace_s,
                "delta_chunks": self.delta_chunks,
                "packs": self.packs, "packed_chunks": self.packed_chunks,
                "packed_garbage_bytes": self.packed_garbage_bytes,
                "mean_chain_depth": round(self.mean_chain_depth, 3),
                "max_chain_depth": self.max_chain_depth,
                "gc_unknown": self.gc_unknown,
            },
            "ranks": [v.to_json() for v in self.ranks],
            "drills": [d.to_json() for d in self.drills],
            "failed_drills": [d.to_json() for d in self.failed_drills],
            "drill_warnings": list(self.drill_warnings),
            "space_reserve": None if self.space_reserve is None else self.space_reserve.to_json(),
        }


def stats(store: StoreHandle, grace_s: float = 3600.0, now: float | None = None) -> StoreStats:
    """Sizes of ``store``; what GC could reclaim now and after a grace of ``grace_s``.

    Runs two GC dry runs (grace 0: everything awaiting GC; ``grace_s``: what
    a GC deletes now); each marks the live versions, so the cost grows with
    the size of the manifests, not of the data.
    """
    import time

    from chunkstore.maintenance.gc import collect

    now = time.time() if now is None else now
    result = StoreStats(grace_s=grace_s)
    versions = store.versions()
    for info in versions:
        result.versions.append(VersionStats(info.id, info.run, info.step, info.created_iso,
                                            info.logical_bytes, info.new_bytes,
                                            info.new_stored_bytes))
        result.logical_bytes_total += info.logical_bytes
    if result.versions:
        result.latest_logical_bytes = result.versions[-1].logical_bytes
    awaiting: GcResult | None = None
    try:
        # With the orphan sweep: what every GC could reclaim, the next one or a later.
        awaiting = collect(store, 0, dry_run=True, sweep=True, clock=lambda: now)
        # A longer grace deletes a part of what grace 0 does: of nothing, nothing.
        later = awaiting if not _objects(awaiting) else collect(
            store, grace_s, dry_run=True, sweep=True, clock=lambda: now)
    except (GcAbortedError, GcBusyError) as exc:
        result.gc_unknown = str(exc)
    else:
        result.awaiting_gc_objects = _objects(awaiting)
        result.awaiting_gc_bytes = awaiting.bytes_freed + awaiting.orphan_bytes_freed
        result.reclaimable_now_objects = _objects(later)
        result.reclaimable_now_bytes = later.bytes_freed + later.orphan_bytes_freed
    census = _manifest_census(store, versions)
    depths, members = census.depths, census.members
    pack_content: dict[Digest, int] = {}
    pack_stored: dict[Digest, int] = {}
    for kind in (CHUNK, NODE):
        for digest, record in store.index.iter_records(kind):
            if record.refcount > 0:
                result.live_bytes += record.stored_length
                if kind == CHUNK and record.codec_id == PACK.id:
                    pack_content[digest] = record.raw_length
                    pack_stored[digest] = record.stored_length
                elif kind == CHUNK:
                    result.chunks += 1
                    result.unique_raw_bytes += record.raw_length
                    codec = by_id(record.codec_id)
                    result.delta_chunks += codec is not None and codec.needs_base
    result.packs = len(pack_content)
    packed_raw = {digest: raw for (digest, _), raw in members.items()}
    result.packed_chunks = len(packed_raw)
    result.delta_chunks += sum(1 for digest in packed_raw if digest in depths)
    result.chunks += result.packed_chunks
    result.unique_raw_bytes += sum(packed_raw.values())
    _count_packs(result, awaiting if result.gc_unknown is None else None, members,
                 pack_content, pack_stored)
    if depths:
        result.mean_chain_depth = sum(depths.values()) / len(depths)
        result.max_chain_depth = max(depths.values())
    result.ranks = census.ranks
    drills = drill_history(store, now)
    result.drills, result.failed_drills = drills.last_ok, drills.failed
    result.drill_warnings = drills.skipped
    result.space_reserve = store.index.reserve_plan()
    return result


def _count_packs(result: StoreStats, awaiting: GcResult | None,
                 members: dict[tuple[Digest, PackLocation], int],
                 pack_content: dict[Digest, int], pack_stored: dict[Digest, int]) -> None:
    """Live packs, their bytes and the garbage inside them."""
    if awaiting is not None:
        # GC's mark knows where each member lies now (a repacked pack's members
        # are in its new pack), and that a pack counted in the index is gone.
        result.live_bytes += awaiting.live_pack_bytes - sum(pack_stored.values())
        result.packs = awaiting.live_packs
        result.packed_garbage_bytes = awaiting.pack_garbage_bytes
        return
    listed: dict[Digest, int] = {}
    for (_, location), _raw in members.items():
        listed[location.pack] = listed.get(location.pack, 0) + location.length
    result.packed_garbage_bytes = sum(max(size - listed.get(pack, 0), 0)
                                      for pack, size in pack_content.items())


@dataclass
class _Census:
    """What the live versions' manifests say beyond the index: the chain depth of every
    chunk listed with bases, the raw length of every packed chunk by (digest, location),
    and the versions saved by several processes, by rank."""

    depths: dict[Digest, int] = field(default_factory=dict)
    members: dict[tuple[Digest, PackLocation], int] = field(default_factory=dict)
    ranks: list[VersionRanks] = field(default_factory=list)


def _manifest_census(store: StoreHandle, versions: list[VersionInfo]) -> _Census:
    """One walk of every version's manifest (``versions``, oldest first) for
    :class:`_Census`; a version whose manifest cannot be read is left out (verify
    reports it).  A rank's new bytes count against every earlier version, ranked or
    not."""
    census = _Census()
    seen: set[Digest] = set()
    for info in versions:
        try:
            flat = flatten(store.objects, info.root, store.node_cache)
        except ChunkStoreError:
            continue
        for leaf in flat.leaves.values():
            if isinstance(leaf, TensorEntry):
                _count_chains(census, leaf)
        try:
            record = _ranks_record(flat.leaves, functools.partial(_data, store, flat))
        except ChunkStoreError:
            continue
        if record is not None:
            census.ranks.append(VersionRanks(info.id, info.run, info.step, record.world_size,
                                             ranks_of(flat.leaves, record, seen)))
        seen.update(d for leaf in flat.leaves.values() if isinstance(leaf, TensorEntry)
                    for shard in leaf.shards for d in shard.chunks)
    return census


def _data(store: StoreHandle, flat: FlatTree, name: str) -> Any:
    """The plain data of entry ``name`` (a data entry) of a version's tree."""
    leaf = flat.leaves[name]
    assert isinstance(leaf, DataEntry)
    return decode_data(leaf.digest, read_node(store.objects, leaf.digest))


def _count_chains(census: _Census, leaf: TensorEntry) -> None:
    """A tensor's delta chains and packed chunks, into ``census``."""
    for shard in leaf.shards:
        for digest, chain in zip(shard.chunks, shard.bases, strict=False):
            if chain:
                census.depths[digest] = max(census.depths.get(digest, 0), len(chain))
        if shard.packs:
            spans = shard.chunk_spans(element_size(leaf.dtype))
            for (digest, _start, length), location in zip(spans, shard.packs, strict=False):
                if location is not None:
                    census.members[(digest, location)] = length


def _objects(result: GcResult) -> int:
    return result.chunks_deleted + result.nodes_deleted + result.orphans_deleted
