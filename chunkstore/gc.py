"""Garbage collection: delete chunks and nodes no live version reaches, after a grace period.

The order of a run (invariants 2-4 in DESIGN.md; the failures of restic,
Kopia and Borg are why each step is where it is):

1. take the store's GC lock (one GC at a time), count in or out versions
   committed or removed behind the index's back, and finish the deletions a
   killed GC left in the DELETING state;
2. expire write sessions of dead processes, so their claims stop protecting
   what they wrote (their orphans are then collected like any other
   unreferenced object, by write time);
3. candidates: objects whose refcount has been zero for at least the grace
   period, read from the index's ``zero`` table - proportional to what
   became unreferenced, not to the size of the store;
4. mark: walk the manifests of every live version (shared subtrees once)
   into an on-disk set, and drop any candidate the mark reaches (an index
   that disagrees with the manifests is reported, never trusted);
5. condemn the candidates durably; a save that deduplicates against a
   condemned object resurrects it in its own claim transaction;
6. for each condemned object: re-check it in an LMDB write transaction and
   move it to DELETING (from then on a writer waits rather than reuse it),
   delete the object, then remove the record.  A kill between the last two
   leaves a DELETING record that the next run (or a waiting writer, when no
   GC holds the lock) finishes;
7. sweep objects on storage that no index record names (left by a kill
   between an object write and its record, or after an index rebuild),
   once they are older than the grace period, under the same DELETING
   protocol.

A run that outlives half the grace period stops (:class:`GcAbortedError`):
a reader that opened a version just before it was removed is promised the
grace period.  A dry run takes the same decisions and changes nothing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import lmdb

from chunkstore.digest import (
    CHUNK_PREFIX,
    NODE_PREFIX,
    Digest,
    chunk_key,
    digest_from_chunk_key,
    digest_from_node_key,
    node_key,
)
from chunkstore.errors import ChunkStoreError, GcAbortedError, GcBusyError
from chunkstore.index import CHUNK, NODE, ChunkState, pid_namespace, process_start
from chunkstore.manifest import DataEntry, TensorEntry
from chunkstore.progress import NullProgress, Progress
from chunkstore.retention import parse_duration
from chunkstore.tree import load_tree

if TYPE_CHECKING:
    from chunkstore.store import Store

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]

DEFAULT_GRACE_S = 3600.0
#: Temporary files of interrupted writes are removed only when older than this.
TEMP_MIN_AGE_S = 600.0
_KEY_OF = {CHUNK: chunk_key, NODE: node_key}
_KIND_NAME = {CHUNK: "chunk", NODE: "node"}


@dataclass
class GcResult:
    """What a GC run did (or, with ``dry_run``, would do)."""

    dry_run: bool
    grace_s: float
    versions_considered: int = 0
    sessions_expired: int = 0
    candidates: int = 0
    chunks_deleted: int = 0
    nodes_deleted: int = 0
    bytes_freed: int = 0
    kept_by_grace: int = 0
    kept_by_grace_bytes: int = 0
    kept_by_sessions: int = 0
    orphans_deleted: int = 0
    orphan_bytes_freed: int = 0
    temporaries_deleted: int = 0
    unfinished_deletions: int = 0
    index_disagreements: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


# --- the GC lock ------------------------------------------------------------------------------


@contextlib.contextmanager
def gc_lock(index_path: str, *, wait: bool = False) -> Iterator[bool]:
    """Hold the store's GC lock (an flock, released by the kernel if the holder dies).

    Yields True when held.  Without ``wait``, yields False when another
    process holds it.
    """
    if fcntl is None:  # pragma: no cover
        yield True
        return
    fd = os.open(os.path.join(index_path, "gc.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def _remove_stale_marks(index_path: str) -> None:
    """Remove mark sets of killed GC runs (the caller holds the GC lock)."""
    for name in os.listdir(index_path):
        if name.startswith("gc-mark-"):
            shutil.rmtree(os.path.join(index_path, name), ignore_errors=True)


def finish_deletions(store: Store) -> int:
    """Complete every deletion a killed GC left behind; the caller holds the GC lock."""
    done = 0
    for kind, digest, _ in list(store.index.unreferenced()):
        record = store.index.record(kind, digest)
        if record is not None and record.state == ChunkState.DELETING:
            store.backend.delete(_KEY_OF[kind](digest))
            store.index.finish_delete(kind, digest)
            done += 1
    return done


def finish_abandoned_deletions(store: Store) -> None:
    """For a writer waiting on a DELETING object: finish it if no GC is running."""
    with gc_lock(store.index.path) as held:
        if held:
            finish_deletions(store)


# --- sessions ---------------------------------------------------------------------------------


def session_is_dead(info: dict[str, Any], now: float, grace_s: float) -> bool:
    """Whether a write session's process is gone.

    A session opened on this host in this pid namespace is checked directly
    (the pid, and its start time so a reused pid does not count; a process
    that exists but cannot be inspected counts as alive).  Any other session
    is dead once its heartbeat is older than the grace period.
    """
    local = (info.get("host") == socket.gethostname() and isinstance(info.get("pid"), int)
             and info.get("pidns") == pid_namespace())
    if local:
        start = process_start(info["pid"])
        if start is not None:
            return info.get("process_start") not in (None, start)
        return not _pid_exists(info["pid"])
    heartbeat = info.get("heartbeat", info.get("started", 0.0))
    return bool(heartbeat < now - grace_s)


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# --- mark -------------------------------------------------------------------------------------


class MarkSet:
    """A set of (kind, digest) on disk, so marking a large store needs little memory."""

    def __init__(self, parent: str) -> None:
        self.path = tempfile.mkdtemp(prefix="gc-mark-", dir=parent)
        self.env = lmdb.open(self.path, map_size=1 << 36, sync=False, metasync=False,
                             lock=False)

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
            _mark_tree(store, Digest.parse(entry.root), marks)
        except ChunkStoreError:
            fallback.append(entry.id)
            marks.add_many(CHUNK, store.index.version_refs(entry.id))
            marks.add_many(NODE, store.index.version_node_refs(entry.id))
        progress.advance()
    progress.finish()
    return fallback


def _mark_tree(store: Store, root: Digest, marks: MarkSet) -> None:
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
        stack.extend(node.subtrees.values())


# --- the run ----------------------------------------------------------------------------------


class _Run:
    def __init__(self, store: Store, grace_s: float, dry_run: bool, sweep: bool,
                 clock: Callable[[], float], progress: Progress) -> None:
        self.store, self.index = store, store.index
        self.grace_s, self.dry_run, self.sweep = grace_s, dry_run, sweep
        self.clock, self.progress = clock, progress
        self.started = clock()
        self.before = self.started - grace_s
        self.result = GcResult(dry_run=dry_run, grace_s=grace_s)
        self.expired: set[str] = set()

    def check_time(self) -> None:
        if self.grace_s > 0 and self.clock() - self.started > self.grace_s / 2:
            raise GcAbortedError(
                f"gc ran longer than half the grace period ({self.grace_s / 2:.0f}s) and"
                " stopped so that readers keep the grace period they were promised; run it"
                " again, or with a longer --grace")

    def run(self) -> GcResult:
        self.index.reader_check()
        _remove_stale_marks(self.index.path)
        # Sessions first, reconcile second: a save killed after its commit
        # record but before its index update loses its claims here, and its
        # version is counted in (with its references) just below.
        self.expire_sessions()
        self.store.reconcile()
        self.result.versions_considered = len(self.index.versions())
        if not self.dry_run:
            self.result.unfinished_deletions = finish_deletions(self.store)
        candidates = self.find_candidates()
        if candidates:
            candidates = self.confirm_unreachable(candidates)
        self.delete(candidates)
        if self.sweep:
            self.sweep_orphans()
        self.result.seconds = round(self.clock() - self.started, 3)
        return self.result

    def expire_sessions(self) -> None:
        for session_id, info in self.index.list_sessions().items():
            if session_is_dead(info, self.started, self.grace_s):
                self.expired.add(session_id)
                if not self.dry_run:
                    self.index.close_session(session_id)
        self.result.sessions_expired = len(self.expired)

    def find_candidates(self) -> list[tuple[bytes, Digest, int]]:
        found = []
        for kind, digest, since in self.index.unreferenced():
            record = self.index.record(kind, digest)
            if record is None or record.state == ChunkState.DELETING:
                continue
            if since > self.before:
                self.result.kept_by_grace += 1
                self.result.kept_by_grace_bytes += record.stored_length
                continue
            if self._claimed(digest):
                self.result.kept_by_sessions += 1
                continue
            found.append((kind, digest, record.stored_length))
        self.result.candidates = len(found)
        return found

    def _claimed(self, digest: Digest) -> bool:
        """Claimed by a session that is not expiring in this run."""
        return any(s not in self.expired for s in self.index.claimants(digest))

    def confirm_unreachable(self, candidates: list[tuple[bytes, Digest, int]]
                            ) -> list[tuple[bytes, Digest, int]]:
        marks = MarkSet(self.index.path)
        try:
            fallback = mark_live(self.store, marks, self.progress, self.check_time)
            self.mark_unindexed(marks)
            for vid in fallback:
                self.result.index_disagreements.append(
                    f"version {vid[:12]}: manifest unreadable, marked from the index instead"
                    " (run `chunkstore verify`)")
            confirmed = []
            for kind, digest, size in candidates:
                if (kind, digest) in marks:
                    self.result.index_disagreements.append(
                        f"{_KIND_NAME[kind]} {digest.short(16)}: refcount 0 in the index but"
                        " a live manifest references it; kept (run `chunkstore index rebuild`)")
                else:
                    confirmed.append((kind, digest, size))
            return confirmed
        finally:
            marks.close()

    def mark_unindexed(self, marks: MarkSet) -> None:
        """Mark versions on storage the index does not list (committed since the
        reconcile, or unreadable); refuse to go on when one cannot be read."""
        indexed = {e.id for e in self.index.versions()}
        for version_id in self.store.backend_version_ids():
            if version_id in indexed:
                continue
            try:
                root = self.store.read_record(version_id).root
                _mark_tree(self.store, root, marks)
            except FileNotFoundError:
                continue  # removed meanwhile
            except ChunkStoreError as exc:
                raise GcAbortedError(
                    f"version {version_id[:12]} cannot be read ({exc}), so gc cannot know what"
                    " it references and deletes nothing; run `chunkstore verify`, and"
                    " `chunkstore rm` the version if it is beyond repair") from exc

    def delete(self, candidates: list[tuple[bytes, Digest, int]]) -> None:
        if self.dry_run:
            for kind, _, size in candidates:
                self._count(kind, size)
            return
        self.progress.start(len(candidates), "gc: delete")
        for kind in (CHUNK, NODE):
            digests = [d for k, d, _ in candidates if k == kind]
            for digest in self.index.condemn(kind, digests, self.before):
                self.check_time()
                record = self.index.start_delete(kind, digest, self.before)
                if record is not None:
                    self.store.backend.delete(_KEY_OF[kind](digest))
                    self.index.finish_delete(kind, digest)
                    self._count(kind, record.stored_length)
                self.progress.advance()
        self.progress.finish()

    def _count(self, kind: bytes, size: int) -> None:
        if kind == CHUNK:
            self.result.chunks_deleted += 1
        else:
            self.result.nodes_deleted += 1
        self.result.bytes_freed += size

    def sweep_orphans(self) -> None:
        """Delete objects no index record names, once older than the grace period,
        and the temporary files of interrupted writes."""
        # A write in progress owns its temporary file: never touch a young one,
        # whatever the grace period.
        cutoff = min(self.before, self.started - TEMP_MIN_AGE_S)
        self.result.temporaries_deleted = self.store.backend.remove_temporaries(
            cutoff, dry_run=self.dry_run)
        for prefix, kind, parse in ((CHUNK_PREFIX, CHUNK, digest_from_chunk_key),
                                    (NODE_PREFIX, NODE, digest_from_node_key)):
            for info in self.store.backend.list_info(prefix):
                try:
                    digest = parse(info.key)
                except ValueError:
                    continue
                if info.mtime > self.before or self.index.record(kind, digest) is not None:
                    continue
                self.check_time()
                if self.dry_run or self.index.start_orphan_delete(kind, digest):
                    if not self.dry_run:
                        self.store.backend.delete(info.key)
                        self.index.finish_delete(kind, digest)
                    self.result.orphans_deleted += 1
                    self.result.orphan_bytes_freed += info.size


def collect(store: Store, grace: object = DEFAULT_GRACE_S, *, dry_run: bool = False,
            sweep: bool = True, clock: Callable[[], float] = time.time,
            progress: Progress | None = None) -> GcResult:
    """Run one garbage collection; see the module docstring for the order of steps."""
    grace_s = parse_duration(grace)
    with gc_lock(store.index.path) as held:
        if not held:
            raise GcBusyError("another gc is running on this store; wait for it to finish")
        return _Run(store, grace_s, dry_run, sweep, clock, progress or NullProgress()).run()
