"""Bringing the index in line with the manifests: ``reconcile`` and ``index rebuild``.

The manifests and commit records on the backend are the truth.  ``reconcile``
is incremental (versions added or removed behind the index's back, e.g. by a
crash between the commit record and the index update, or by another machine);
``rebuild`` starts from an empty index.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from chunkstore.chunkobj import HEADER, parse_header
from chunkstore.digest import CHUNK_PREFIX, TAG_PREFIX, Digest, chunk_key, digest_from_chunk_key
from chunkstore.errors import ChunkStoreError
from chunkstore.index import ChunkRecord, ChunkState, NewChunk
from chunkstore.tree import flatten
from chunkstore.writer import entry_from_record

if TYPE_CHECKING:
    from chunkstore.store import Store

log = logging.getLogger(__name__)


@dataclass
class RebuildResult:
    versions: int = 0
    chunks: int = 0
    unreferenced_chunks: int = 0
    skipped: list[str] = field(default_factory=list)  # versions that could not be read

    def to_json(self) -> dict[str, object]:
        return dict(self.__dict__)


def _chunk_info(store: Store, digest: Digest) -> NewChunk | None:
    key = chunk_key(digest)
    try:
        header = parse_header(digest, store.backend.get_range(key, 0, HEADER.size))
        size = store.backend.stat(key).size
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
        flat = flatten(store.backend, record.root, store.node_cache)
    except (FileNotFoundError, ChunkStoreError) as exc:
        log.warning("version %s is not readable, left out of the index: %s", version_id[:12], exc)
        return False
    refs = flat.chunk_digests()
    # A chunk still WRITING was claimed by a save that died before its index
    # update (killed after the commit record): its size is known only here.
    unknown = [d for d in refs if _needs_info(store, d)]
    new_chunks = [c for c in store.executor.map(lambda d: _chunk_info(store, d), unknown) if c]
    nodes = dict.fromkeys(flat.tree_nodes | flat.data_nodes(), 0)
    store.index.add_version(entry_from_record(version_id, record), refs, nodes, new_chunks)
    return True


def _sync_tags(store: Store) -> None:
    import json

    on_backend: dict[str, str] = {}
    for key in store.backend.list(TAG_PREFIX):
        try:
            on_backend[key[len(TAG_PREFIX):]] = json.loads(store.backend.get(key))["version"]
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            continue
    in_index = store.index.tags()
    for tag, vid in on_backend.items():
        if in_index.get(tag) != vid and store.index.version(vid) is not None:
            store.index.set_tag(tag, vid)
    for tag in set(in_index) - set(on_backend):
        store.index.delete_tag(tag)


def reconcile(store: Store, result: RebuildResult | None = None) -> RebuildResult:
    result = result or RebuildResult()
    on_backend = set(store.backend_version_ids())
    in_index = {e.id for e in store.index.versions()}
    for version_id in sorted(on_backend - in_index):
        if count_in(store, version_id):
            result.versions += 1
        else:
            result.skipped.append(version_id)
    for version_id in in_index - on_backend:
        store.index.remove_version(version_id)
    _sync_tags(store)
    return result


def rebuild(store: Store) -> RebuildResult:
    """Recreate the index from the backend.  Run it while no save or GC is running."""
    store.index.clear()
    result = reconcile(store)
    for key in store.backend.list(CHUNK_PREFIX):
        try:
            digest = digest_from_chunk_key(key)
        except ValueError:
            continue
        result.chunks += 1
        if store.index.chunk(digest) is not None:
            continue
        info = _chunk_info(store, digest)
        if info is None:
            continue
        mtime = store.backend.stat(key).mtime
        store.index.put_chunk_record(digest, ChunkRecord(
            ChunkState.LIVE, info.codec_id, 0, info.raw_length, info.stored_length, mtime))
        result.unreferenced_chunks += 1
    store.index.sync()
    return result
