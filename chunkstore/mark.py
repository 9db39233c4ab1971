"""Marking: every object that live versions (and versions removed within the grace
period) reach, collected into an on-disk set so a large store needs little memory."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import lmdb

from chunkstore.digest import Digest
from chunkstore.errors import ChunkStoreError, GcAbortedError
from chunkstore.index import CHUNK, NODE
from chunkstore.manifest import DataEntry, TensorEntry
from chunkstore.progress import Progress
from chunkstore.tombstones import list_tombstones
from chunkstore.tree import load_tree

if TYPE_CHECKING:
    from chunkstore.store import Store

class MarkSet:
    """A set of (kind, digest) on disk, so marking a large store needs little memory."""

    def __init__(self, parent: str) -> None:
        for attempt in range(5):  # an index directory may be deleted at any time
            try:
                os.makedirs(parent, exist_ok=True)
                self.path = tempfile.mkdtemp(prefix="gc-mark-", dir=parent)
                self.env = lmdb.open(self.path, map_size=1 << 36, sync=False,
                                     metasync=False, lock=False)
                break
            except (lmdb.Error, OSError):
                if attempt == 4:
                    raise

    def add_many(self, kind: bytes, digests: Iterator[Digest] | list[Digest]) -> None:
        with self.env.begin(write=True) as txn:
            for digest in digests:
                txn.put(kind + digest.raw, b"", overwrite=False)

    def add(self, kind: bytes, digest: Digest) -> bool:
        """Add one; False when it was already there."""
        with self.env.begin(write=True) as txn:
            return bool(txn.put(kind + digest.raw, b"", overwrite=False))

    def __contains__(self, item: tuple[bytes, Digest]) -> bool:
        with self.env.begin() as txn:
            return txn.get(item[0] + item[1].raw) is not None

    def close(self) -> None:
        self.env.close()
        shutil.rmtree(self.path, ignore_errors=True)


def mark_live(store: Store, marks: MarkSet, progress: Progress,
              check_time: Callable[[], None]) -> list[str]:
    """Mark every object the live versions reach; return versions marked from the index.

    A subtree already marked is not walked again, so versions that share
    most of their tree cost only their differences.  A version whose
    manifest cannot be read is marked from the index's reference lists
    instead (and named in the result), so GC never deletes what it uses.
    """
    fallback = []
    versions = store.index.versions()
    progress.start(len(versions), "gc: mark")
    for entry in versions:
        check_time()
        try:
            mark_tree(store, Digest.parse(entry.root), marks)
        except ChunkStoreError:
            fallback.append(entry.id)
            marks.add_many(CHUNK, store.index.version_refs(entry.id))
            marks.add_many(NODE, store.index.version_node_refs(entry.id))
        progress.advance()
    progress.finish()
    return fallback


def mark_tree(store: Store, root: Digest, marks: MarkSet) -> None:
    """Mark every tree and data node and every chunk object the tree at ``root`` needs."""
    stack = [root]
    while stack:
        digest = stack.pop()
        if not marks.add(NODE, digest):
            continue  # shared with a version marked before
        node = load_tree(store.backend, digest, store.node_cache)
        chunks: list[Digest] = []
        for leaf in node.leaves.values():
            if isinstance(leaf, TensorEntry):
                chunks.extend(leaf.chunk_digests())
            elif isinstance(leaf, DataEntry):
                marks.add(NODE, leaf.digest)
        marks.add_many(CHUNK, chunks)
        stack.extend(node.children())




def mark_unindexed(store: Store, marks: MarkSet) -> None:
    """Mark versions on storage the index does not list (committed since the
    reconcile, or unreadable); refuse to go on when one cannot be read."""
    indexed = {e.id for e in store.index.versions()}
    for version_id in store.backend_version_ids():
        if version_id in indexed:
            continue
        try:
            root = store.read_record(version_id).root
            mark_tree(store, root, marks)
        except FileNotFoundError:
            continue  # removed meanwhile
        except ChunkStoreError as exc:
            raise GcAbortedError(
                f"version {version_id[:12]} cannot be read ({exc}), so gc cannot know what"
                " it references and deletes nothing; run `chunkstore verify`, and"
                " `chunkstore rm` the version if it is beyond repair") from exc


def mark_removed(store: Store, marks: MarkSet, removed_after: float) -> list[str]:
    """Mark the trees of versions removed after ``removed_after`` (their grace period
    still runs); return the ids of tombstones older than that, which protect nothing."""
    expired = []
    for tombstone in list_tombstones(store.backend):
        if tombstone.removed <= removed_after:
            expired.append(tombstone.version_id)
        elif tombstone.root is not None:
            try:
                mark_tree(store, tombstone.root, marks)
            except ChunkStoreError:
                continue  # partly gone already: what was marked stays protected
    return expired
