"""``report``'s census of the live versions' manifests: delta chains, packed chunks,
and the bytes each rank's shards hold in versions saved by several processes.

Reading every version's manifest tree is most of a report's cost in a store of
thousands of versions (3.1 s of 5.7 s at 10,000 versions, issue 49), and what one
version adds to the census never changes: versions are immutable.  So each
version's contribution (its chunks' chain depths, its packed chunks, whether it
records ranks) is kept in the index's ``census`` table, bound to the version as the
index holds it (:mod:`chunkstore.index.derived`: removed, counted in again or the
index rebuilt, it is counted afresh), recorded by the save that wrote the version
and by the open that counted it in (:mod:`chunkstore.handle.censusrecord`), so a
report reads only the manifests of versions recorded without it.  The ranks are
the exception: a rank's new bytes count against every earlier version, so a store
with ranked versions has the manifests of every version up to its last ranked one
read (as before the table existed).
The manifests a census reads are read in parallel, a batch at a time
(:func:`_each_read`), and merged in version order.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from chunkstore.errors import ChunkStoreError, CorruptNodeError, StorageFullError
from chunkstore.format.digest import Digest
from chunkstore.format.dtypes import element_size
from chunkstore.format.manifest import DataEntry, TensorEntry
from chunkstore.format.shards import RANKS_ENTRY, ShardRanks
from chunkstore.handle.censusrecord import contribution, parse
from chunkstore.handle.tree import FlatTree, Leaf, flatten, load_data
from chunkstore.index.writegate import WriterBusy
from chunkstore.read.reader import VersionReader, map_jobs

if TYPE_CHECKING:
    from chunkstore.handle.handle import StoreHandle
    from chunkstore.handle.versions import VersionInfo

log = logging.getLogger(__name__)


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


def version_ranks(store: StoreHandle) -> list[VersionRanks]:
    """Every readable version that records its shards' ranks, oldest first; new
    bytes count against every earlier version (ranked or not)."""
    return manifest_census(store, store.versions()).ranks


@dataclass
class _Census:
    """What the live versions' manifests say beyond the index: the chain depth of every
    chunk listed with bases, the raw length of every packed chunk by (digest, location),
    and the versions saved by several processes, by rank.  A chunk or a pack is named by
    its digest's first :data:`~chunkstore.handle.censusrecord.PREFIX_BYTES` bytes (as a
    recorded contribution names it); a member by (chunk, pack, offset, length).  Merged
    version by version (:meth:`add`); ``ranked``: some version records its ranks."""

    depths: dict[bytes, int] = field(default_factory=dict)
    members: dict[tuple[bytes, bytes, int, int], int] = field(default_factory=dict)
    ranks: list[VersionRanks] = field(default_factory=list)
    ranked: bool = False

    def add(self, payload: bytes) -> bool:
        """Merge one version's contribution (:func:`contribution`); False, merging
        nothing, when it is not one this release wrote (another form, or damaged)."""
        counted = parse(payload)
        if counted is None:
            return False
        for prefix, depth in counted.depths.items():
            if depth > self.depths.get(prefix, 0):
                self.depths[prefix] = depth
        self.members.update(counted.members)
        self.ranked = self.ranked or counted.ranked
        return True


def _data(store: StoreHandle, flat: FlatTree, name: str) -> Any:
    """The plain data of entry ``name`` (a data entry) of a version's tree."""
    leaf = flat.leaves[name]
    assert isinstance(leaf, DataEntry)
    return load_data(store.objects, leaf.digest)


def manifest_census(store: StoreHandle, versions: list[VersionInfo]) -> _Census:
    """:class:`_Census` of ``versions`` (oldest first): each version's contribution
    from the index's ``census`` table where it holds one, from its manifest otherwise
    (then recorded there); a version whose manifest cannot be read is left out
    (verify reports it)."""
    return _census(store, versions, store.index.census(info.id for info in versions))


def _census(store: StoreHandle, versions: list[VersionInfo], cached: dict[str, bytes]
            ) -> _Census:
    """:func:`manifest_census`, taking what ``cached`` holds of a version (its
    recorded contribution) instead of its manifest."""
    merged = _Census()
    # not recorded, or recorded in a form this release does not read: from the manifests
    unknown = [info for info in versions
               if (payload := cached.get(info.id)) is None or not merged.add(payload)]
    counted: list[tuple[str, bytes]] = []
    for info, payload in _each_read(store, unknown, _contribution_of):
        if payload is not None:  # else unreadable: left out
            counted.append((info.id, payload))
            merged.add(payload)
    if counted:
        try:
            store.index.note_census(counted)
        except (StorageFullError, WriterBusy) as exc:  # only a help: counted again next time
            log.info("report could not record its census of %d versions: %s",
                     len(counted), exc)
    if merged.ranked:
        merged.ranks = _ranks_census(store, versions)
    return merged


#: Versions whose manifests a census reads at once (:func:`_each_read`): their reads
#: overlap, and at most this many trees are held.
READ_BATCH = 256

_Found = TypeVar("_Found")


def _each_read(store: StoreHandle, versions: list[VersionInfo],
               read: Callable[[StoreHandle, VersionInfo], _Found]
               ) -> Iterator[tuple[VersionInfo, _Found]]:
    """Each version with ``read`` of it, in order; read :data:`READ_BATCH` at a time in
    parallel (:func:`~chunkstore.read.reader.map_jobs`: a job per core from a local
    store, every pool thread from an object store, where each read waits on a request)."""
    for start in range(0, len(versions), READ_BATCH):
        batch = versions[start:start + READ_BATCH]
        yield from zip(batch, map_jobs(store.executor, batch,
                                       functools.partial(read, store), store.read_jobs),
                       strict=True)


def _contribution_of(store: StoreHandle, info: VersionInfo) -> bytes | None:
    """The version's :func:`contribution`, from its manifests; None where they cannot
    be read."""
    try:
        return contribution(flatten(store.objects, info.root, store.node_cache).leaves)
    except ChunkStoreError:
        return None


def _ranked_tree(store: StoreHandle, info: VersionInfo
                 ) -> tuple[FlatTree, ShardRanks | None] | None:
    """The version's tree and its record of ranks; None where either cannot be read."""
    try:
        flat = flatten(store.objects, info.root, store.node_cache)
        return flat, _ranks_record(flat.leaves, functools.partial(_data, store, flat))
    except ChunkStoreError:
        return None


def _ranks_census(store: StoreHandle, versions: list[VersionInfo]) -> list[VersionRanks]:
    """Every readable version that records its shards' ranks, oldest first, read from
    the manifests; a rank's new bytes count against every earlier version, ranked or
    not."""
    found: list[VersionRanks] = []
    seen: set[Digest] = set()
    for info, read in _each_read(store, versions, _ranked_tree):
        if read is None:
            continue
        flat, record = read
        if record is not None:
            found.append(VersionRanks(info.id, info.run, info.step, record.world_size,
                                      ranks_of(flat.leaves, record, seen)))
        seen.update(d for leaf in flat.leaves.values() if isinstance(leaf, TensorEntry)
                    for shard in leaf.shards for d in shard.chunks)
    return found
