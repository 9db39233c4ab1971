"""``index rebuild``: the index made again from the store.

The manifests and commit records in the store are the truth.  ``reconcile``
(:mod:`.reconcile`) is incremental (versions added or removed behind the index's
back, e.g. by a crash between the commit record and the index update, or by
another machine); ``rebuild`` starts from an empty index.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from typing import TYPE_CHECKING

from chunkstore.codecs import PACK
from chunkstore.errors import SavesInProgressError
from chunkstore.format.digest import (
    Digest,
)
from chunkstore.index import indexfile
from chunkstore.index.gclock import gc_lock
from chunkstore.index.lmdbindex import (
    CHUNK,
    NODE,
    ChunkRecord,
    ChunkState,
    Index,
)
from chunkstore.maintenance.gc import session_is_dead
from chunkstore.maintenance.reconcile import RebuildResult, chunk_info, reconcile
from chunkstore.objects.kinds import CHUNKS, NODES
from chunkstore.objects.objectstore import ObjectInfo
from chunkstore.protocol.journal import list_entry_ids, read_entry, sync_journal
from chunkstore.protocol.sessions import live_sessions

if TYPE_CHECKING:
    from chunkstore.handle.handle import StoreHandle

log = logging.getLogger(__name__)
#: Scratch indexes of rebuilds live in the index directory under this prefix.
REBUILD_PREFIX = "rebuild-"


def rebuild(store: StoreHandle) -> RebuildResult:
    """Recreate the index from the backend.

    Runs under the GC lock (waiting for a running GC); refuses while a save
    is in progress on the store, seen through the store's session objects
    (any machine, any index) and through this index's sessions.
    """
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


def _rebuild(store: StoreHandle) -> RebuildResult:
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


def _rebuild_into(store: StoreHandle) -> RebuildResult:
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
                result.packs += record[1].codec_id == PACK.id
            if store.index.put_record_if_absent(kind, record[0], record[1]):
                result.unreferenced_chunks += kind == CHUNK
                result.unreferenced_nodes += kind == NODE
    store.index.sync()
    return result


def _unreferenced_record(store: StoreHandle, kind: bytes, digest: Digest, info: ObjectInfo
                         ) -> tuple[Digest, ChunkRecord] | None:
    """A record for an object on storage (unreferenced until a version counts it in).

    Its ``since`` is the object's write time: the grace period of objects of
    removed versions is kept by their tombstones, not by this time.
    """
    if kind == NODE:
        return digest, ChunkRecord(ChunkState.LIVE, 0, 0, info.size, info.size, info.mtime)
    chunk = chunk_info(store, digest)
    if chunk is None:
        return None
    return digest, ChunkRecord(ChunkState.LIVE, chunk.codec_id, 0, chunk.raw_length,
                               chunk.stored_length, info.mtime)
