"""Bringing the index in line with the manifests: ``reconcile`` and ``index rebuild``.

The manifests and commit records on the backend are the truth.  ``reconcile``
is incremental (versions added or removed behind the index's back, e.g. by a
crash between the commit record and the index update, or by another machine);
``rebuild`` starts from an empty index.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from chunkstore.errors import ChunkStoreError, SavesInProgressError
from chunkstore.format.chunkobj import HEADER, parse_header
from chunkstore.format.digest import (
    DIGEST_SIZE,
    Digest,
)
from chunkstore.index import indexfile
from chunkstore.index.lmdbindex import (
    CHUNK,
    NODE,
    ChunkRecord,
    ChunkState,
    Index,
    NewChunk,
)
from chunkstore.objects.kinds import CHUNKS, NODES, TAGS, VERSIONS
from chunkstore.objects.objectstore import ObjectInfo
from chunkstore.protocol.journal import list_entry_ids, read_entry, sync_journal
from chunkstore.protocol.sessions import live_sessions
from chunkstore.read.tree import flatten
from chunkstore.write.writer import entry_from_record

if TYPE_CHECKING:
    from chunkstore.store import Store

log = logging.getLogger(__name__)
#: Scratch indexes of rebuilds live in the index directory under this prefix.
REBUILD_PREFIX = "rebuild-"


@dataclass
class RebuildResult:
    versions: int = 0
    chunks: int = 0
    unreferenced_chunks: int = 0
    unreferenced_nodes: int = 0
    skipped: list[str] = field(default_factory=list)  # versions that could not be read

    def to_json(self) -> dict[str, object]:
        return dict(self.__dict__)


def _chunk_info(store: Store, digest: Digest) -> NewChunk | None:
    try:
        header = parse_header(digest, store.objects.get_range(CHUNKS, digest, 0,
                                                              HEADER.size + DIGEST_SIZE))
        size = store.objects.stat(CHUNKS, digest).size
    except (FileNotFoundError, ChunkStoreError):
        return None  # missing or damaged: verify reports it
    return NewChunk(digest, header.codec_id, header.raw_length, size)


def _needs_info(store: Store, digest: Digest) -> bool:
    record = store.index.chunk(digest)
    return record is None or record.state == ChunkState.WRITING


def count_in(store: Store, version_id: str) -> bool:
    """Add a version found on the backend to the index; False if it cannot be read."""
    try:
        record = store.read_record(version_id)
        flat = flatten(store.objects, record.root, store.node_cache)
    except (FileNotFoundError, ChunkStoreError) as exc:
        log.warning("version %s is not readable, left out of the index: %s", version_id[:12], exc)
        return False
    refs = flat.chunk_digests()
    # A chunk still WRITING was claimed by a save that died before its index
    # update (killed after the commit record): its size is known only here.
    unknown = [d for d in refs if _needs_info(store, d)]
    new_chunks = [c for c in store.executor.map(lambda d: _chunk_info(store, d), unknown) if c]
    node_digests = sorted(flat.tree_nodes | flat.data_nodes(), key=lambda d: d.raw)
    nodes = dict(zip(node_digests, store.executor.map(lambda d: _node_size(store, d),
                                                      node_digests), strict=True))
    store.index.add_version(entry_from_record(version_id, record), refs, nodes, new_chunks,
                            packed=flat.pack_members())
    if not store.objects.exists(VERSIONS, version_id):
        store.index.remove_version(version_id)  # removed while it was being counted in
        return False
    return True


def _node_size(store: Store, digest: Digest) -> int:
    """The node object's size; 0 (unknown: not a dedup target) when it is missing."""
    try:
        return store.objects.stat(NODES, digest).size
    except FileNotFoundError:
        return 0


def _sync_tags(store: Store) -> None:
    in_index = store.index.tags()  # before listing: a tag set meanwhile is on the backend
    on_backend = store.stored_tags()
    for tag, vid in on_backend.items():
        if in_index.get(tag) != vid and store.index.version(vid) is not None:
            store.index.set_tag(tag, vid)
    for tag in set(in_index) - set(on_backend):
        if not store.objects.exists(TAGS, tag):  # not re-created since the listing
            store.index.delete_tag(tag)


def reconcile(store: Store, result: RebuildResult | None = None) -> RebuildResult:
    """Count in versions on storage the index lacks; count out those storage lacks.

    The index is read before storage is listed, so a version committed
    meanwhile is on the listing; a version missing from the listing is
    checked again before it is counted out.
    """
    result = result or RebuildResult()
    in_index = {e.id for e in store.index.versions()}
    on_backend = set(store.stored_version_ids())
    for version_id in sorted(on_backend - in_index):
        if store.index.version(version_id) is not None:
            continue  # its own save counted it in meanwhile
        if count_in(store, version_id):
            result.versions += 1
        else:
            result.skipped.append(version_id)
    for version_id in in_index - on_backend:
        if not store.objects.exists(VERSIONS, version_id):
            store.index.remove_version(version_id)
    _sync_tags(store)
    return result


def rebuild(store: Store) -> RebuildResult:
    """Recreate the index from the backend.

    Runs under the GC lock (waiting for a running GC); refuses while a save
    is in progress on the store, seen through the store's session objects
    (any machine, any index) and through this index's sessions.
    """
    from chunkstore.maintenance.gc import gc_lock, session_is_dead

    with gc_lock(store.index.path, wait=True):
        now = time.time()
        in_store = live_sessions(store.objects, now)
        in_index = [s for s, info in store.index.list_sessions().items()
                    if not session_is_dead(info, now, 3600.0)]
        busy = max(len(in_store), len(in_index))
        if busy:
            purposes = ", ".join(sorted({str(s.info.get("purpose", "?")) for s in in_store}))
            raise SavesInProgressError(
                f"{busy} save(s) in progress on this store ({purposes or 'this index'});"
                " rebuild the index when they have finished", sessions=busy)
        return _rebuild(store)


def _rebuild(store: Store) -> RebuildResult:
    """Build a new index beside the live one, then swap the contents in one transaction
    (commands in other processes never see a half-built index)."""
    live = store.index
    scratch = Index(tempfile.mkdtemp(prefix=REBUILD_PREFIX, dir=live.path))
    store.index = scratch
    try:
        result = _rebuild_into(store)
    finally:
        store.index = live
    try:
        try:
            live.replace_contents(scratch)
        except indexfile.DAMAGE as exc:  # the live index itself is damaged: a new one
            live.reset(f"{type(exc).__name__}: {exc}")
            live.replace_contents(scratch)
    finally:
        scratch.close()
        shutil.rmtree(scratch.path, ignore_errors=True)
    # Versions committed or removed while the scratch index was built (saves that
    # started after the check above): count them in or out now; and the GC journal.
    reconcile(store)
    sync_journal(store.objects, store.index)
    return result


def _rebuild_into(store: Store) -> RebuildResult:
    # GC journal entries finished before the listing below are reflected in it:
    # the rebuilt index need not apply them.  Listed first, for that reason.
    finished = []
    for entry_id in list_entry_ids(store.objects):
        try:
            entry = read_entry(store.objects, entry_id)
        except ValueError:
            continue
        if entry is not None and not entry.active(time.time()):
            finished.append(entry_id)
    store.index.clear()
    result = reconcile(store)
    store.index.mark_journal_applied(finished)
    for kind, objects in ((CHUNK, CHUNKS), (NODE, NODES)):
        for digest, info in store.objects.infos(objects):
            record = _unreferenced_record(store, kind, digest, info)
            if record is None:
                continue
            if kind == CHUNK:
                result.chunks += 1
            if store.index.put_record_if_absent(kind, record[0], record[1]):
                result.unreferenced_chunks += kind == CHUNK
                result.unreferenced_nodes += kind == NODE
    store.index.sync()
    return result


def _unreferenced_record(store: Store, kind: bytes, digest: Digest, info: ObjectInfo
                         ) -> tuple[Digest, ChunkRecord] | None:
    """A record for an object on storage (unreferenced until a version counts it in).

    Its ``since`` is the object's write time: the grace period of objects of
    removed versions is kept by their tombstones, not by this time.
    """
    if kind == NODE:
        return digest, ChunkRecord(ChunkState.LIVE, 0, 0, info.size, info.size, info.mtime)
    chunk = _chunk_info(store, digest)
    if chunk is None:
        return None
    return digest, ChunkRecord(ChunkState.LIVE, chunk.codec_id, 0, chunk.raw_length,
                               chunk.stored_length, info.mtime)
