"""``report``: logical and physical bytes, dedup and compression, amplification; and,
for versions saved by several processes, the bytes each rank's shards hold (the
census of the manifests: :mod:`chunkstore.maintenance.census`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from chunkstore.codecs import PACK, by_id
from chunkstore.errors import GcAbortedError, GcBusyError
from chunkstore.format.digest import Digest
from chunkstore.format.manifest import PackLocation, TensorEntry
from chunkstore.handle.censusrecord import PREFIX_BYTES
from chunkstore.handle.tree import Leaf
from chunkstore.index.indexfile import ReservePlan
from chunkstore.index.lmdbindex import CHUNK, NODE, ChunkState
from chunkstore.maintenance.census import VersionRanks, manifest_census
from chunkstore.maintenance.drillhistory import DrillSummary, FailedDrill, drill_history

if TYPE_CHECKING:
    from chunkstore.handle.handle import StoreHandle
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


@dataclass
class StoreStats:
    """Sizes over the whole store.  Amplification = physical / logical of the latest version.

    Live objects are those a published version reaches; the rest await GC.
    What GC could reclaim comes from a GC dry run (``gc_source`` "gc-dry-run"),
    so ``report`` and ``gc`` agree by construction (after ``rm``, after ``index
    rebuild``, on orphans the index never knew), or from the index's refcounts
    ("index"), which agree with it on everything this index knows of.
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
    #: Where the awaiting-GC and reclaimable figures come from: ``"gc-dry-run"`` (two
    #: GC dry runs with the orphan sweep, ``report --full``) or ``"index"`` (the
    #: index's refcounts; orphans only a sweep finds are not in them).
    gc_source: str = "gc-dry-run"
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
                "gc_source": self.gc_source,
            },
            "ranks": [v.to_json() for v in self.ranks],
            "drills": [d.to_json() for d in self.drills],
            "failed_drills": [d.to_json() for d in self.failed_drills],
            "drill_warnings": list(self.drill_warnings),
            "space_reserve": None if self.space_reserve is None else self.space_reserve.to_json(),
        }


#: Where the awaiting-GC and reclaimable figures come from (``StoreStats.gc_source``).
GC_FROM_INDEX = "index"
GC_FROM_DRY_RUN = "gc-dry-run"


def stats(store: StoreHandle, grace_s: float = 3600.0, now: float | None = None,
          full: bool = True) -> StoreStats:
    """Sizes of ``store``; what GC could reclaim now and after a grace of ``grace_s``.

    ``full``: those two figures from two GC dry runs with the orphan sweep (grace 0:
    everything awaiting GC; ``grace_s``: what a GC deletes now), so they agree with
    ``gc`` by construction; each marks the live versions and lists every object.
    Otherwise from the index's refcounts (:func:`_gc_from_index`), at a cost that
    follows the garbage; what only a sweep or a mark finds is then left out.
    """
    import time

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
    awaiting = None
    if full:
        awaiting = _gc_dry_runs(store, result, now)
    else:
        _gc_from_index(store, result, now)
    census = manifest_census(store, versions)
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
    packed_raw = {digest: raw for (digest, _, _, _), raw in members.items()}
    result.packed_chunks = len(packed_raw)
    result.delta_chunks += sum(1 for digest in packed_raw if digest in depths)
    result.chunks += result.packed_chunks
    result.unique_raw_bytes += sum(packed_raw.values())
    _count_packs(result, awaiting, members, pack_content, pack_stored)
    if depths:
        result.mean_chain_depth = sum(depths.values()) / len(depths)
        result.max_chain_depth = max(depths.values())
    result.ranks = census.ranks
    drills = drill_history(store, now)
    result.drills, result.failed_drills = drills.last_ok, drills.failed
    result.drill_warnings = drills.skipped
    result.space_reserve = store.index.reserve_plan()
    return result


def _gc_dry_runs(store: StoreHandle, result: StoreStats, now: float) -> GcResult | None:
    """The awaiting-GC and reclaimable figures from two GC dry runs, into ``result``;
    the first run's result (None: GC could not run, ``result.gc_unknown`` says why)."""
    from chunkstore.maintenance.gc import collect

    result.gc_source = GC_FROM_DRY_RUN
    try:
        # With the orphan sweep: what every GC could reclaim, the next one or a later.
        awaiting = collect(store, 0, dry_run=True, sweep=True, clock=lambda: now)
        # A longer grace deletes a part of what grace 0 does: of nothing, nothing.
        later = awaiting if not _objects(awaiting) else collect(
            store, result.grace_s, dry_run=True, sweep=True, clock=lambda: now)
    except (GcAbortedError, GcBusyError) as exc:
        result.gc_unknown = str(exc)
        return None
    result.awaiting_gc_objects = _objects(awaiting)
    result.awaiting_gc_bytes = awaiting.bytes_freed + awaiting.orphan_bytes_freed
    result.reclaimable_now_objects = _objects(later)
    result.reclaimable_now_bytes = later.bytes_freed + later.orphan_bytes_freed
    return awaiting


def _gc_from_index(store: StoreHandle, result: StoreStats, now: float) -> None:
    """The awaiting-GC and reclaimable figures from the index, into ``result``: the
    records at refcount zero (the ``zero`` table, so the cost follows the garbage;
    each refcount read exact, with no write: one a process of index schema 4 lowered
    to zero without folding is left out while pending versions reference it, as GC's
    folded listing leaves it out), less those a GC of that grace keeps (being
    deleted, or claimed by a save session it would not expire), as
    :meth:`~chunkstore.maintenance.gc._Run.find_candidates` chooses.  Left out, as
    only a GC's sweep or mark finds them: objects on storage no index record names
    (orphans of killed saves, objects of versions another index removed and this one
    has not counted out) and packs whose every listed member a repack moved."""
    from chunkstore.maintenance.gc import session_is_dead, stored_size

    result.gc_source = GC_FROM_INDEX
    index = store.index
    sessions = index.list_sessions()
    live_now = {sid for sid, info in sessions.items()
                if not session_is_dead(info, now, result.grace_s)}
    live_at_zero = {sid for sid, info in sessions.items() if not session_is_dead(info, now, 0)}
    for kind, digest, since in index.unreferenced():
        record = index.record(kind, digest)  # its refcount exact, the pending ones added
        if record is None or record.state == ChunkState.DELETING or record.refcount:
            continue
        claimants = set(index.claimants(digest)) if sessions else set()
        awaiting = not claimants & live_at_zero and since <= now
        reclaimable = not claimants & live_now and since <= now - result.grace_s
        size = record.stored_length
        if (awaiting or reclaimable) and not size and record.state == ChunkState.WRITING:
            # A killed save's claim: the index never learnt its size (one HEAD each).
            size = stored_size(store, kind, digest) or 0
        if awaiting:
            result.awaiting_gc_objects += 1
            result.awaiting_gc_bytes += size
        if reclaimable:
            result.reclaimable_now_objects += 1
            result.reclaimable_now_bytes += size


def _count_packs(result: StoreStats, awaiting: GcResult | None,
                 members: dict[tuple[bytes, bytes, int, int], int],
                 pack_content: dict[Digest, int], pack_stored: dict[Digest, int]) -> None:
    """Live packs, their bytes and the garbage inside them."""
    if awaiting is not None:
        # GC's mark knows where each member lies now (a repacked pack's members
        # are in its new pack), and that a pack counted in the index is gone.
        result.live_bytes += awaiting.live_pack_bytes - sum(pack_stored.values())
        result.packs = awaiting.live_packs
        result.packed_garbage_bytes = awaiting.pack_garbage_bytes
        return
    listed: dict[bytes, int] = {}  # by the pack's digest prefix, as the census names it
    for (_, pack, _, length), _raw in members.items():
        listed[pack] = listed.get(pack, 0) + length
    result.packed_garbage_bytes = sum(max(size - listed.get(pack.raw[:PREFIX_BYTES], 0), 0)
                                      for pack, size in pack_content.items())


def _objects(result: GcResult) -> int:
    return result.chunks_deleted + result.nodes_deleted + result.orphans_deleted
