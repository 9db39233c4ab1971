"""Reading one version: entries by name, chunks hash-verified into the caller's buffer."""

from __future__ import annotations

import collections
import functools
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor, wait
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import numpy as np

from chunkstore.codecs import RAW
from chunkstore.errors import (
    ChunkStoreError,
    CorruptChunkError,
    CorruptNodeError,
    EntryNotFoundError,
    InvalidInputError,
    RecoveredConfigError,
    ShapeMismatchError,
    UnprotectedReadWarning,
    VersionRemovedError,
)
from chunkstore.format.chunkobj import HEADER, check_digest, parse_header
from chunkstore.format.digest import DIGEST_SIZE, Digest
from chunkstore.format.dtypes import dtype_name, element_size, numpy_dtype
from chunkstore.format.manifest import DataEntry, PackLocation, Shard, TensorEntry
from chunkstore.format.shards import (
    box_chunk_range,
    box_of,
    check_box,
    is_sharded,
    scatter_shards,
    shard_bases,
)
from chunkstore.handle.caches import BaseCache
from chunkstore.handle.tree import FlatTree, Leaf, flatten, load_data
from chunkstore.handle.versions import VersionInfo
from chunkstore.objects.kinds import CHUNKS, VERSIONS
from chunkstore.protocol.readleases import ReadLease
from chunkstore.read import scratch
from chunkstore.read.chain import decode_chain
from chunkstore.read.members import (
    Locations,
    MemberRead,
    at_member,
    member_header,
    missing_chunk,
    read_runs,
)
from chunkstore.read.packs import read_members_into

if TYPE_CHECKING:
    from chunkstore.handle.handle import StoreHandle


def read_chunk_into(store: StoreHandle, digest: Digest, out: memoryview,
                    chain: tuple[Digest, ...] = (), cache: BaseCache | None = None, *,
                    check_links: bool = False, location: PackLocation | None = None,
                    locations: Locations = (), transient: bool = False) -> None:
    """Fill ``out`` with the chunk's bytes, verified; raw chunks are read in place,
    deltas through their listed ``chain`` (bases cached in ``cache``, default the
    store's; packed bases where ``locations`` says), a packed chunk by range from
    its pack at ``location``.  ``transient``: a job of :func:`run_jobs`, whose
    intermediate bytes may go to the thread's scratch buffers."""
    if location is not None:
        read_members_into(store, [(digest, location, out, (chain, locations))], cache=cache,
                          check_links=check_links, transient=transient)
        return
    objects = store.objects
    try:
        header = parse_header(digest, objects.get_range(CHUNKS, digest, 0,
                                                        HEADER.size + DIGEST_SIZE))
        if header.codec_id == RAW.id and header.base is None:
            size = objects.stat(CHUNKS, digest).size
            if header.raw_length != len(out) or header.payload_length != len(out):
                raise CorruptChunkError(digest.hex, f"holds {header.raw_length} bytes, the"
                                        f" manifest expects {len(out)}")
            if size != HEADER.size + len(out):
                raise CorruptChunkError(digest.hex, f"object is {size} bytes, header says"
                                        f" {HEADER.size + len(out)} (truncated or padded)")
            if objects.read_into(CHUNKS, digest, HEADER.size, out) != len(out):
                raise CorruptChunkError(digest.hex, "truncated while reading")
            check_digest(digest, out, objects.chunk_ids)
            return
        if header.raw_length != len(out):  # before reading a payload of the wrong chunk
            raise CorruptChunkError(digest.hex, f"holds {header.raw_length} bytes, the"
                                    f" manifest expects {len(out)}")
        # One byte more than the header promises, so padding is seen without
        # reading an object of any size.
        data = objects.view_range(CHUNKS, digest, 0, header.size + header.payload_length + 1)
    except FileNotFoundError:
        raise missing_chunk(store, digest) from None
    decode_chain(store, digest, data, chain, out, cache, check_links=check_links,
                 locations=locations, transient=transient)


ChunkRead = tuple[Digest, int, int, tuple[Digest, ...], PackLocation | None, Locations]


def allocate(store: StoreHandle, reads: list[ChunkRead], shape: Sequence[int],
             dtype: np.dtype[Any]) -> np.ndarray:
    """A buffer for the bytes ``reads`` fill.  Where there is no memory for it, the
    chunks are checked first: an entry that lists a small chunk many times as large
    ones (a crafted node, with valid hashes) is corrupt, not too large for memory;
    a real one gets the MemoryError."""
    try:
        return np.empty(tuple(shape), dtype=dtype)
    except MemoryError:
        check_listed_lengths(store, reads)
        raise


def check_listed_lengths(store: StoreHandle, reads: list[ChunkRead]) -> None:
    """Every distinct chunk ``reads`` name holds the raw length it is listed with
    (headers only); a :class:`CorruptChunkError` for the first that does not."""
    listed: dict[tuple[Digest, PackLocation | None], set[int]] = {}
    for digest, _, length, _, location, _ in reads:
        listed.setdefault((digest, location), set()).add(length)
    for (digest, location), lengths in listed.items():
        raw = _raw_length(store, digest, location)
        if lengths != {raw}:
            raise CorruptChunkError(digest.hex, f"holds {raw} bytes; the manifest lists it as"
                                    f" {max(lengths - {raw})}")


def _raw_length(store: StoreHandle, digest: Digest, location: PackLocation | None) -> int:
    """The raw length the stored chunk's header gives (a member's, for a packed one)."""
    try:
        if location is None:
            head = store.objects.get_range(CHUNKS, digest, 0, HEADER.size + DIGEST_SIZE)
            return parse_header(digest, head).raw_length
        head = at_member(store, digest, location, lambda at: store.objects.member_head(
            digest, at, HEADER.size + DIGEST_SIZE))
        return member_header(digest, memoryview(head)).raw_length
    except FileNotFoundError:
        raise missing_chunk(store, digest) from None


def chunk_reads(entry: TensorEntry, chunk_size: int) -> list[ChunkRead]:
    """(digest, offset, length, chain, pack location, the chain's pack locations) of
    every chunk read that fills ``entry``'s bytes.

    This is the one place where a read decides whether an entry can be read:
    ``verify`` calls it for every tensor, so what verify passes, a read can
    read.  The decoder has checked that the shards tile the shape and that
    their chunks cover the shards' bytes; this adds what depends on the store
    (no chunk longer than its chunk size).  The offsets of a sharded entry's
    reads are into its shards' bytes laid end to end (:func:`shard_bases`).
    """
    itemsize = element_size(entry.dtype)
    reads: list[ChunkRead] = []
    for base, shard in zip(shard_bases(entry), entry.shards, strict=True):
        if shard.chunk_bytes > chunk_size:
            raise ValueError(f"chunks of {shard.chunk_bytes} bytes exceed the store's chunk size"
                             f" {chunk_size}")
        for i, (digest, start, length) in enumerate(shard.chunk_spans(itemsize)):
            reads.append((digest, base + start, length, shard.chain(i), shard.location(i),
                          shard.chain_locations(i)))
    return reads


_Item = TypeVar("_Item")
_Found = TypeVar("_Found")


def map_jobs(executor: Executor, items: Sequence[_Item], read: Callable[[_Item], _Found],
             at_once: int) -> list[_Found]:
    """``read`` of each of ``items``, in their order, through :func:`run_jobs` (at most
    ``at_once`` at a time, the calling thread taking its turn): a bulk read of many
    small objects (commit records, manifests) whose requests overlap.  ``read`` returns
    what its caller reports as a value; an error it raises is raised here, that of the
    first item in order, once every job is done."""
    found: list[_Found | None] = [None] * len(items)

    def job(number: int) -> None:
        found[number] = read(items[number])

    run_jobs(executor, [functools.partial(job, n) for n in range(len(items))], at_once)
    return found  # type: ignore[return-value]  # every job ran, or run_jobs raised


def run_jobs(executor: Executor, jobs: list[Callable[[], None]], at_once: int) -> None:
    """Run every job, at most ``at_once`` at a time, and return when all are done (none
    may still write into a caller's buffer); then raise the error of the first job in
    order that failed, if any.

    The calling thread takes jobs too, beside ``at_once - 1`` pool jobs of ``executor``
    that each take the next job until none is left: a read of one chunk never waits for
    a pool thread (nor starts one, on a handle just opened), and the pool's other
    threads stay asleep (more threads than cores only switch between jobs that all want
    a core).  An interrupt in the calling thread (``KeyboardInterrupt``) stops it taking
    jobs, drops those not yet begun, and is raised once the pool's jobs are done."""
    if not jobs:
        return
    queue = collections.deque(enumerate(jobs))  # popleft is atomic: no lock needed
    failed: list[tuple[int, BaseException]] = []

    def take_turns(catch: type[BaseException]) -> None:
        try:
            while True:
                try:
                    number, job = queue.popleft()
                except IndexError:
                    return
                try:
                    job()
                except catch as exc:  # the others still run; raised below
                    failed.append((number, exc))
        finally:
            scratch.release()  # the call's scratch memory, not kept by an idle thread

    futures = []
    try:
        for _ in range(min(at_once, len(jobs)) - 1):
            futures.append(executor.submit(take_turns, BaseException))
        take_turns(Exception)
    finally:
        queue.clear()  # empty unless the calling thread was interrupted
        wait(futures)
    for future in futures:
        future.result()
    if failed:
        error = min(failed, key=lambda item: item[0])[1]
        failed.clear()
        try:
            raise error
        finally:
            del error  # no cycle (this frame, the error, its traceback) holds the buffers


def _take_lease(store: StoreHandle, info: VersionInfo, purpose: str) -> ReadLease | None:
    """Store the reader's lease, then check the version is still there (the order
    docs/format.md §11.6 argues); None, with a warning, where no lease can be stored."""
    lease = ReadLease(store.objects, info.id, info.root, purpose)
    try:
        lease.open()
    except RecoveredConfigError:
        return None  # its config recovered, the store takes no writes: no GC runs there
    except (OSError, ChunkStoreError) as exc:
        warnings.warn(UnprotectedReadWarning(
            f"version {info.short_id} is read without a read lease ({exc}): a GC elsewhere"
            " with a grace period shorter than this read may delete what it needs"),
            stacklevel=4)
        return None
    try:
        present = store.objects.exists(VERSIONS, info.id)
    except BaseException:
        lease.close()
        raise
    if not present:
        lease.close()
        raise VersionRemovedError(info.id)
    return lease


class VersionReader:
    """A published version, opened for reading.  Loading runs no code.

    The reader holds a read lease (:mod:`chunkstore.protocol.readleases`) until
    :meth:`close` (or the end of a ``with`` block, or its collection): while it is
    open, no GC on any machine deletes what the version needs, even once the version
    is removed.  ``lease=False`` opens without one (the GC grace period then protects
    the reader alone)."""

    def __init__(self, store: StoreHandle, info: VersionInfo, *, lease: bool = True,
                 purpose: str = "read") -> None:
        self._store = store
        self.info = info
        self._lease = _take_lease(store, info, purpose) if lease else None
        try:
            self._flat: FlatTree = flatten(store.objects, info.root, store.node_cache)
        except BaseException:
            self.close()
            raise
        if self._lease is not None:
            weakref.finalize(self, self._lease.close_later)  # any thread: no I/O there

    def close(self) -> None:
        """End the read lease (idempotent); reads after it are not protected."""
        if self._lease is not None:
            self._lease.close()

    def __enter__(self) -> VersionReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def names(self) -> list[str]:
        return list(self._flat.leaves)

    def entries(self) -> dict[str, Leaf]:
        return dict(self._flat.leaves)

    def entry(self, name: str) -> Leaf:
        try:
            return self._flat.leaves[name]
        except KeyError:
            raise EntryNotFoundError(name, self.info.id) from None

    def _tensor(self, name: str) -> tuple[TensorEntry, list[ChunkRead]]:
        """The entry and its chunk reads, checked before any buffer is allocated."""
        leaf = self.entry(name)
        if not isinstance(leaf, TensorEntry):
            raise InvalidInputError(f"entry {name!r} is plain data; use get_data()")
        try:
            return leaf, chunk_reads(leaf, self._store.chunk_size)
        except ValueError as exc:
            if isinstance(exc, InvalidInputError):
                raise
            owner = self._flat.owners[name]
            raise CorruptNodeError(owner.hex, f"entry {name!r}: {exc}") from exc

    def get(self, name: str) -> np.ndarray:
        """Return a new array with the entry's dtype and shape."""
        entry, reads = self._tensor(name)
        out = allocate(self._store, reads, entry.shape, numpy_dtype(entry.dtype))
        self.get_into(name, out)
        return out

    def get_into(self, name: str, out: np.ndarray, dtype: str | None = None) -> np.ndarray:
        """Fill ``out`` (C-contiguous, writeable, same shape) without an extra copy.

        ``dtype`` names the stored dtype when ``out`` is a same-size view (e.g.
        an ``int16`` view of a bfloat16 tensor).  On an integrity error ``out``
        holds partial data and the error is raised.
        """
        self.get_many_into([(name, out, dtype)])
        return out

    def get_many_into(self, requests: Iterable[tuple[str, np.ndarray, str | None]]) -> None:
        """``get_into`` for many entries at once: ``(name, out, dtype)`` triples.

        Every buffer is checked before anything is read; then the chunks of
        all entries are read in parallel, so many small tensors cost one
        round of the thread pool, not one each.
        """
        checked = []
        sharded = []
        for name, out, dtype in requests:
            entry, reads = self._tensor(name)
            self._check_buffer(name, entry, out, dtype)
            target = out
            if is_sharded(entry):  # read the shards end to end, then put each in its box
                target = allocate(self._store, reads, (sum(read[2] for read in reads),),
                                  np.dtype(np.uint8))
                sharded.append((entry, target, out))
            checked.append((reads, target))
        jobs: list[Callable[[], None]] = []
        members: list[MemberRead] = []
        for reads, out in checked:
            jobs.extend(self._jobs(reads, out, members))
        # Packed chunks: neighbours in a pack are fetched by one ranged read.
        jobs.extend(functools.partial(read_members_into, self._store, run, transient=True)
                    for run in read_runs(members))
        run_jobs(self._store.executor, jobs, self._store.read_jobs)
        for entry, staged, out in sharded:
            scatter_shards(entry, staged, out)

    def _jobs(self, reads: list[ChunkRead], out: np.ndarray, members: list[MemberRead]
              ) -> list[Callable[[], None]]:
        """The jobs that read the chunks stored as objects of their own; the packed ones
        are collected in ``members``."""
        flat = out.reshape(-1).view(np.uint8).data if out.size else memoryview(b"")
        jobs: list[Callable[[], None]] = []
        for digest, start, length, chain, location, locations in reads:
            if location is not None:
                members.append((digest, location, flat[start:start + length],
                                (chain, locations)))
                continue
            jobs.append(functools.partial(read_chunk_into, self._store, digest,
                                          flat[start:start + length], chain,
                                          locations=locations, transient=True))
        return jobs

    def _check_buffer(self, name: str, entry: TensorEntry, out: np.ndarray,
                      dtype: str | None) -> None:
        # The messages are made only for an error: every tensor of a restore comes here.
        def mismatch(actual: str) -> ShapeMismatchError:
            return ShapeMismatchError(name, f"{entry.dtype}{list(entry.shape)}", actual)

        if not isinstance(out, np.ndarray):
            raise mismatch(type(out).__name__)
        if dtype is None:
            try:
                have = dtype_name(out.dtype)
            except InvalidInputError:
                have = str(out.dtype)
        else:
            have = dtype if out.dtype.itemsize == element_size(dtype) else str(out.dtype)
        if have != entry.dtype or out.shape != entry.shape:
            raise mismatch(f"{have}{list(out.shape)}")
        if out.dtype.byteorder == ">" or not out.flags.c_contiguous or not out.flags.writeable:
            raise mismatch(f"{have}{list(out.shape)} (not a writeable C-contiguous little-endian"
                           " buffer)")

    def get_data(self, name: str) -> Any:
        leaf = self.entry(name)
        if not isinstance(leaf, DataEntry):
            raise InvalidInputError(f"entry {name!r} is a tensor; use get() or get_into()")
        return load_data(self._store.objects, leaf.digest)

    def get_box(self, name: str, shard: int, offsets: Sequence[int], sizes: Sequence[int],
                out: np.ndarray) -> None:
        """Fill ``out`` (shape ``sizes``, any strides, the entry's element size) with
        the box at ``offsets`` inside shard number ``shard`` of a tensor entry,
        hash-verified.  Only the chunks that hold the box are read, so a resharding
        load reads about what it needs; the whole shard into a C-contiguous ``out``
        is read in place."""
        self.get_boxes([(name, shard, offsets, sizes, out)])

    def get_boxes(self, requests: Iterable[BoxRequest]) -> None:
        """``get_box`` for many boxes at once: ``(name, shard, offsets, sizes, out)``.

        Every request is checked before anything is read; then the chunks of
        all boxes are read in one round of the pool (a sharded load of many
        boxes costs one round, not one each).  A box not read in place is
        staged through a buffer of its shard's size: rounds hold at most
        :data:`STAGING_BYTES` of those (or one larger box)."""
        rounds: list[list[_Box]] = [[]]
        staged = 0
        for request in requests:
            box = self._box(*request)
            if box.staging and staged and staged + box.staging > STAGING_BYTES:
                rounds.append([])
                staged = 0
            rounds[-1].append(box)
            staged += box.staging
        for boxes in rounds:
            self._read_boxes(boxes)

    def _box(self, name: str, shard: int, offsets: Sequence[int], sizes: Sequence[int],
             out: np.ndarray) -> _Box:
        """One request of :meth:`get_boxes`, checked, with the chunk reads it needs."""
        entry, _ = self._tensor(name)
        if not 0 <= shard < len(entry.shards):
            raise InvalidInputError(f"entry {name!r} has {len(entry.shards)} shards, not a"
                                    f" shard {shard}")
        box = entry.shards[shard]
        check_box(box, offsets, sizes)
        itemsize = element_size(entry.dtype)
        if not isinstance(out, np.ndarray) or tuple(out.shape) != tuple(sizes) \
                or out.dtype.itemsize != itemsize or out.dtype.byteorder == ">" \
                or not out.flags.writeable:
            raise ShapeMismatchError(name, f"{entry.dtype}{list(sizes)}, writeable, little-endian",
                                     f"{getattr(out, 'dtype', type(out).__name__)}"
                                     f"{list(getattr(out, 'shape', ()))}")
        spans = list(box.chunk_spans(itemsize))
        reads: list[ChunkRead] = [(*spans[i], box.chain(i), box.location(i),
                                   box.chain_locations(i))
                                  for i in box_chunk_range(box, itemsize, offsets, sizes)]
        in_place = out.flags.c_contiguous and tuple(sizes) == box.sizes
        return _Box(box, tuple(offsets), tuple(sizes), out, reads,
                    0 if in_place else box.nbytes(itemsize))

    def _read_boxes(self, boxes: list[_Box]) -> None:
        """Read ``boxes`` in one round of the pool, then copy each staged one out."""
        targets = [box.out if not box.staging else np.empty(box.staging, dtype=np.uint8)
                   for box in boxes]
        jobs: list[Callable[[], None]] = []
        members: list[MemberRead] = []
        for box, target in zip(boxes, targets, strict=True):
            jobs.extend(self._jobs(box.reads, target, members))
        jobs.extend(functools.partial(read_members_into, self._store, run, transient=True)
                    for run in read_runs(members))
        run_jobs(self._store.executor, jobs, self._store.read_jobs)
        for box, target in zip(boxes, targets, strict=True):
            if box.staging:
                box.out[...] = box_of(target, box.shard, box.offsets, box.sizes, box.out.dtype)


#: (entry name, shard number, offsets in the shard, sizes, out): a box :meth:`get_boxes` reads.
BoxRequest = tuple[str, int, Sequence[int], Sequence[int], np.ndarray]
#: Bytes of staging buffers (boxes not read in place) one round of get_boxes holds.
STAGING_BYTES = 256 << 20


class _Box(NamedTuple):
    """A checked box request: its shard, where it lies, the chunk reads that fill it and
    the bytes of its staging buffer (0: read in place into ``out``)."""

    shard: Shard
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    out: np.ndarray
    reads: list[ChunkRead]
    staging: int
