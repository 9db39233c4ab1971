"""Bringing the index in line with the store: count in the versions it lacks, count out
those the store no longer has (``reconcile``, run when a store is opened and by GC).

The manifests and commit records in the store are the truth; the index is a
cache of them (docs/format.md §1).  ``index rebuild`` (:mod:`.rebuild`) starts it
afresh and reconciles.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from chunkstore.codecs import PACK
from chunkstore.errors import ChunkStoreError
from chunkstore.format.chunkobj import HEADER, parse_header
from chunkstore.format.digest import (
    DIGEST_SIZE,
    Digest,
)
from chunkstore.handle.censusrecord import contribution
from chunkstore.handle.tree import flatten
from chunkstore.handle.versions import entry_from_record
from chunkstore.index.lmdbindex import (
    ChunkState,
    NewChunk,
    NewVersion,
)
from chunkstore.objects.kinds import CHUNKS, LEASES, NODES, TAGS, VERSIONS
from chunkstore.protocol.published import (
    FULL_LISTING_S,
    KEEP_S,
    SKEW_S,
    clock_s,
    recent_markers,
)
from chunkstore.protocol.runlease import withdrawn, withdrawn_name
from chunkstore.read.reader import map_jobs

if TYPE_CHECKING:
    from chunkstore.handle.handle import StoreHandle

log = logging.getLogger(__name__)


@dataclass
class RebuildResult:
    versions: int = 0
    #: chunk objects in the store: a pack of small chunks counts once (``packs`` of them)
    chunks: int = 0
    packs: int = 0
    unreferenced_chunks: int = 0
    unreferenced_nodes: int = 0
    skipped: list[str] = field(default_factory=list)  # versions that could not be read

    def to_json(self) -> dict[str, object]:
        return dict(self.__dict__)


def chunk_info(store: StoreHandle, digest: Digest) -> NewChunk | None:
    try:
        header = parse_header(digest, store.objects.get_range(CHUNKS, digest, 0,
                                                              HEADER.size + DIGEST_SIZE))
        raw = header.raw_length
        if header.codec_id == PACK.id:  # its content as pack locations count it
            head = store.objects.pack_head(digest)
            raw, size = head.located, head.stored
        else:
            size = store.objects.stat(CHUNKS, digest).size
    except (FileNotFoundError, ChunkStoreError):
        return None  # missing or damaged: verify reports it
    return NewChunk(digest, header.codec_id, raw, size)


def _needs_info(store: StoreHandle, digest: Digest) -> bool:
    record = store.index.chunk(digest)
    return record is None or record.state == ChunkState.WRITING


#: Versions counted in at once (:func:`count_in_many`): read in parallel, then added to
#: the index in one write transaction (one commit and sync, not one per version).
COUNT_BATCH = 256


def count_in(store: StoreHandle, version_id: str,
             withdrawn_ids: frozenset[str] | None = None) -> bool:
    """Add a version found on the backend to the index; False if it cannot be read, or
    if it was withdrawn (``withdrawn_ids``, one listing of them; None: asked here)."""
    return bool(count_in_many(store, [version_id], withdrawn_ids))


def count_in_many(store: StoreHandle, version_ids: list[str],
                  withdrawn_ids: frozenset[str] | None = None) -> list[str]:
    """:func:`count_in` of each version, :data:`COUNT_BATCH` at a time: each batch's
    versions read in parallel (:func:`~chunkstore.read.reader.map_jobs`), then added
    in one index transaction; return those counted in, in order (the others cannot
    be read, were withdrawn, or were removed while they were being counted in)."""
    counted: list[str] = []
    for start in range(0, len(version_ids), COUNT_BATCH):
        batch = version_ids[start:start + COUNT_BATCH]
        # A lone version's objects are asked about in parallel; a batch's versions are.
        each: Callable[..., Iterable[Any]] = store.executor.map if len(batch) == 1 else map
        read = [found for found in map_jobs(
            store.executor, batch, functools.partial(_read_in, store, withdrawn_ids, each),
            store.read_jobs) if found is not None]
        if not read:
            continue
        store.index.add_versions(read)
        ids = [found.entry.id for found in read]
        there = map_jobs(store.executor, ids, functools.partial(store.objects.exists, VERSIONS),
                         store.read_jobs)
        gone = [vid for vid, present in zip(ids, there, strict=True) if not present]
        if gone:
            store.index.remove_versions(gone)  # removed while they were being counted in
        counted += [vid for vid, present in zip(ids, there, strict=True) if present]
    return counted


def _read_in(store: StoreHandle, withdrawn_ids: frozenset[str] | None,
             each: Callable[..., Iterable[Any]], version_id: str) -> NewVersion | None:
    """What counting a version in adds to the index, from its commit record and
    manifests (``each`` maps over its objects); None if it cannot be read, or was
    withdrawn (:func:`count_in`)."""
    try:
        record = store.read_record(version_id)
        if (version_id in withdrawn_ids if withdrawn_ids is not None
                else store.objects.exists(LEASES, withdrawn_name(record.run, version_id))):
            # Removed after a takeover rolled it forward: this record is its stopped
            # writer's late PUT (docs/format.md §11.5), never a version.
            log.warning("version %s of %s@%d was withdrawn by the run's new owner; the"
                        " record its earlier writer created again is deleted",
                        version_id[:12], record.run, record.step)
            store.objects.discard(VERSIONS, version_id)
            return None
        flat = flatten(store.objects, record.root, store.node_cache)
    except (FileNotFoundError, ChunkStoreError) as exc:
        log.warning("version %s is not readable, left out of the index: %s", version_id[:12], exc)
        return None
    refs = flat.chunk_digests()
    # A chunk still WRITING was claimed by a save that died before its index
    # update (killed after the commit record): its size is known only here.
    unknown = [d for d in refs if _needs_info(store, d)]
    new_chunks = [c for c in each(lambda d: chunk_info(store, d), unknown) if c]
    node_digests = sorted(flat.tree_nodes | flat.data_nodes(), key=lambda d: d.raw)
    nodes = dict(zip(node_digests, each(lambda d: _node_size(store, d), node_digests),
                     strict=True))
    # Its census recorded with it: report need not read its manifests again.
    return NewVersion(entry_from_record(version_id, record), refs, nodes, new_chunks,
                      flat.pack_members(), contribution(flat.leaves))


def _node_size(store: StoreHandle, digest: Digest) -> int:
    """The node object's size; 0 (unknown: not a dedup target) when it is missing."""
    try:
        return store.objects.stat(NODES, digest).size
    except FileNotFoundError:
        return 0


def _sync_tags(store: StoreHandle) -> None:
    in_index = store.index.tags()  # before listing: a tag set meanwhile is on the backend
    on_backend = store.stored_tags()
    for tag, vid in on_backend.items():
        if in_index.get(tag) != vid and store.index.version(vid) is not None:
            store.index.set_tag(tag, vid)
    for tag in set(in_index) - set(on_backend):
        if not store.objects.exists(TAGS, tag):  # not re-created since the listing
            store.index.delete_tag(tag)


def _stamps(store: StoreHandle) -> str | None:
    """The listing stamps of the commit records and the tags; None where the backend
    cannot give both (:meth:`~chunkstore.backends.base.Backend.listing_stamp`)."""
    versions = store.objects.listing_stamp(VERSIONS)
    tags = store.objects.listing_stamp(TAGS)
    return None if versions is None or tags is None else f"{versions} {tags}"


def reconcile_if_changed(store: StoreHandle) -> RebuildResult | None:
    """:func:`reconcile`, unless the store's commit records and tags are as the index's
    last complete reconcile listed them (what opening a store runs); None when skipped.

    Skipped only where the backend vouches that no commit record and no tag was
    added or removed since that reconcile read the stamps, before its listing (a
    local folder's times: :mod:`chunkstore.backends.folderstamp`),
    and the index holds as many versions as it then did.  Everything else lists:
    object stores (no such stamp), a folder changed in the last seconds, an index
    whose last reconcile left a version out (it may be readable now).  GC always
    lists: what it deletes never rests on a stamp.  Where the stamps do not vouch, the
    publication markers may (:func:`reconcile_from_markers`).
    """
    stamps = _stamps(store)
    if stamps is not None and stamps == store.index.listed_as():
        return None
    if reconcile_from_markers(store):
        return None
    return reconcile(store)


#: How far the marker watermark may lag before an open records a new one (a write
#: transaction): the window listed grows by at most this much.
MARKER_REFRESH_S = 60.0


def reconcile_from_markers(store: StoreHandle, now: float | None = None) -> bool:
    """Count in the versions the recent publication markers name and count out those
    the recent removal markers name, without listing the commit records; False
    (nothing done) where the markers cannot vouch (:mod:`chunkstore.protocol.published`,
    steps 2-3): the index has no watermark, its last full listing is older than
    :data:`~chunkstore.protocol.published.FULL_LISTING_S`, its watermark older than
    the markers are kept, or the clock went back since.

    A marker only names a version to look at: a version is counted in only after its
    commit record is read (``count_in``), and out only once its record is found gone;
    a marker whose change never came (a process killed or refused between the two, or
    one in flight) changes nothing.  A version created or removed without a marker
    waits for the next full listing (the safety net of step 3).
    """
    now = clock_s() if now is None else now
    listed = store.index.markers_listed()
    if listed is None:
        return False
    full_s, markers_s = listed
    if not (now - FULL_LISTING_S < full_s <= now and now - KEEP_S + SKEW_S < markers_s <= now):
        return False
    # Every version this index holds that was created inside the window must have its
    # marker there (stamped after its record's time, on the same clock): where one
    # lacks it (an older release's save; a store put back to an older copy of itself,
    # which took the marker with the record), list every record instead.
    expected = store.index.version_ids_since(markers_s - SKEW_S)
    if expected is None:
        return False
    markers = list(recent_markers(store.objects, markers_s, now))
    # The window holds every save of the last minutes (a job saving every second, a
    # hundred or more): which of them the index holds, in one read, by key alone.
    held = store.index.held_version_ids({marker.version_id for marker in markers})
    named = set()
    found: list[str] = []
    for marker in markers:
        if marker.removed:
            if marker.version_id in held \
                    and not store.objects.exists(VERSIONS, marker.version_id):
                store.index.remove_version(marker.version_id)
                held.discard(marker.version_id)
            continue
        named.add(marker.version_id)
        if marker.version_id not in held and store.objects.exists(VERSIONS, marker.version_id):
            found.append(marker.version_id)  # else: no such version (yet, or now)
    count_in_many(store, found)
    if expected - named:
        return False
    _sync_tags(store)
    if now - markers_s > MARKER_REFRESH_S:  # the window listed starts from ``now`` next
        store.index.set_markers_listed(full_s, now)
    return True


def line_up(store: StoreHandle, in_index: set[str], listed: set[str],
            result: RebuildResult | None = None) -> RebuildResult:
    """Bring the index in line with a listing of the commit records (``listed``),
    ``in_index`` being the index's versions read before that listing: count in each
    listed version it lacks (``result.skipped`` those that cannot be), count out each
    it holds that the listing lacks and a check again finds gone (a record created
    after the listing stays).  What a full listing (:func:`reconcile`, a whole
    verify) learns that no marker may have said: a record created or deleted by an
    older release, by hand, or crafted."""
    result = result or RebuildResult()
    new = sorted(listed - in_index)
    gone = withdrawn(store.objects) if new else frozenset()
    for start in range(0, len(new), COUNT_BATCH):
        # Not those their own saves counted in meanwhile.
        batch = [vid for vid in new[start:start + COUNT_BATCH] if store.index.version(vid) is None]
        counted = set(count_in_many(store, batch, gone))
        result.versions += len(counted)
        result.skipped += [vid for vid in batch if vid not in counted]
    for version_id in in_index - listed:
        if not store.objects.exists(VERSIONS, version_id):
            store.index.remove_version(version_id)
    return result


def reconcile(store: StoreHandle, result: RebuildResult | None = None) -> RebuildResult:
    """Count in versions on storage the index lacks; count out those storage lacks.

    The index is read before storage is listed, so a version committed
    meanwhile is on the listing; a version missing from the listing is
    checked again before it is counted out.  The backend's listing stamps (:func:`_stamps`), read
    before the listing, are recorded in the index where every version listed was
    counted in: the next open that finds them unchanged need not list
    (:func:`reconcile_if_changed`).
    """
    result = result or RebuildResult()
    started = clock_s()  # before the listing: markers from then on are listed next
    before = _stamps(store)
    in_index = store.index.version_ids()  # ids only: no entry decoded
    line_up(store, in_index, set(store.stored_version_ids()), result)
    _sync_tags(store)
    # The stamps read before the listing: any change since alters them.
    store.index.set_listed_as(None if result.skipped else before)
    if not result.skipped:  # else the next open lists in full again
        store.index.set_markers_listed(started, started)
    return result


