"""Garbage collection: delete chunks and nodes no version reaches, after a grace period.

The store is the truth and any number of indexes may look at it (one per
machine on S3; a deleted, rebuilt or stale one locally), so no deletion
rests on what this index believes alone.  The order of a run (invariants
2-4 in DESIGN.md; the failures of restic, Kopia and Borg, and Kopia's GC
model, are why each step is where it is):

1. take this index's GC lock (one GC per index at a time; GCs on other
   indexes are safe to run at once, see below), count in or out versions
   committed or removed behind the index's back, apply the GC journal
   entries other GCs finished (:mod:`chunkstore.journal`), and hand the
   deletions a killed GC of this index left in the DELETING state back to
   this run (never finished blindly: that GC's entry died with it, so saves
   elsewhere may have written those objects again);
2. expire the index's write sessions of dead processes;
3. candidates: objects whose refcount has been zero for at least the grace
   period (the index's ``zero`` table), and objects on storage no index
   record names (orphans of killed saves, objects of another index's
   versions) older than the grace period;
4. mark: walk the manifests of every live version on storage (shared
   subtrees once) and of every version removed less than the grace period
   ago (its tombstone, :mod:`chunkstore.tombstones`: the grace period runs
   from unreachability, whoever removed it and whatever the index knows);
   drop every candidate the mark reaches;
5. fence: store a journal entry ``gc/<id>`` naming the remaining candidates.
   From the moment it is stored, every save that starts reads it and never
   reuses those objects;
6. wait until every save session in the store (``sessions/``) that was
   stored before the entry, and so may have decided to reuse a candidate,
   has ended or died.  A session that read the entry says so in its object
   and is not waited for (it waits for us instead, only if it needs one of
   our objects).  If sessions outlast the wait, the entry is abandoned and
   nothing is deleted;
7. mark again: count in and walk every version committed meanwhile (by the
   sessions just waited for) and every tombstone, into step 4's mark set
   (what was walked then is not walked again); drop what is reached;
8. delete, through the index's condemn -> DELETING protocol so that saves
   of this index wait rather than reuse an object being deleted;
9. mark the journal entry ``done`` (saves apply it to their own indexes:
   those objects are never again dedup targets there), delete expired
   tombstones and old temporary files.

A pack of small chunks (:mod:`chunkstore.packs`) is one chunk object here:
versions reference the pack, never its members, so it is marked, fenced,
condemned and deleted whole, and a save that reuses a member claims the pack.

Why no interleaving loses an object a published or in-progress version
needs.  Take any object X this run deletes and any save S.  If S stored its
session before step 5 completed and had not read the entry, step 6 waited
until S ended; if S published, step 7 reached X through S's version; if S
was abandoned, nothing needs X.  Otherwise S read the entry: S never
referenced X unwritten, and wrote X only after this run marked the entry
done or died (the fence wait, for every active entry naming X), so after
its deletion.  "Died" includes "could not renew its entry for half the
lease": such a run stops deleting before others may count it dead.  Versions published
before step 7 are marked in step 7; a version removed before it is marked
through its tombstone for the grace period.  Two GCs on different indexes
each satisfy this argument independently (deleting is idempotent, and each
waits for sessions that have not seen its own entry).  A session counted
dead while alive (its heartbeat failed for the whole lease) refuses to
publish (:meth:`StoreSession.lapsed`).  A deleted or rebuilt index loses
nothing the argument uses: sessions, journal, versions and tombstones are
all in the store.

A run that outlives half the grace period stops (:class:`GcAbortedError`):
a reader that opened a version just before it was removed is promised the
grace period.  A dry run takes the decisions of steps 1-4 and changes
nothing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from chunkstore.digest import (
    CHUNK_PREFIX,
    NODE_PREFIX,
    Digest,
    chunk_key,
    digest_from_chunk_key,
    digest_from_node_key,
    node_key,
)
from chunkstore.errors import GcAbortedError, GcBusyError
from chunkstore.index import CHUNK, NODE, ChunkState
from chunkstore.journal import (
    ABANDONED,
    DONE,
    FENCED,
    JournalEntry,
    prune_journal,
    start_entry,
    sync_journal,
    write_entry,
)
from chunkstore.mark import MarkSet, mark_live, mark_removed, mark_unindexed
from chunkstore.progress import NullProgress, Progress
from chunkstore.retention import parse_duration
from chunkstore.sessions import HEARTBEAT_S, LEASE_S, list_sessions, owner_is_dead
from chunkstore.tombstones import tombstone_key

if TYPE_CHECKING:
    from chunkstore.store import Store

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]

DEFAULT_GRACE_S = 3600.0
#: How long a GC waits for saves that started before its journal entry (step 6).
DEFAULT_SESSION_WAIT_S = 120.0
#: Temporary files of interrupted writes are removed only when older than this.
TEMP_MIN_AGE_S = 600.0
_KEY_OF = {CHUNK: chunk_key, NODE: node_key}
_KIND_NAME = {CHUNK: "chunk", NODE: "node"}


@dataclass(frozen=True)
class Candidate:
    """An object GC may delete; ``indexed`` when this index has a record of it."""

    kind: bytes
    digest: Digest
    size: int
    indexed: bool


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
    tombstones_deleted: int = 0
    journal_entries_pruned: int = 0
    #: Saves in progress in the store that this run waited for (step 6).
    sessions_waited_for: int = 0
    #: Objects not deleted because saves outlasted the wait; the next run retries.
    deferred: int = 0
    journal_entry: str | None = None
    index_disagreements: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


# --- the GC lock ------------------------------------------------------------------------------


@contextlib.contextmanager
def gc_lock(index_path: str, *, wait: bool = False, wait_s: float = 0.0) -> Iterator[bool]:
    """Hold this index's GC lock (an flock, released by the kernel if the holder dies).

    Yields True when held.  Without ``wait``, tries for ``wait_s`` seconds and
    yields False when another process still holds it.
    """
    if fcntl is None:  # pragma: no cover
        yield True
        return
    os.makedirs(index_path, exist_ok=True)  # an index directory may be deleted at any time
    fd = os.open(os.path.join(index_path, "gc.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    yield False
                    return
                time.sleep(0.05)
        yield True
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def _remove_stale_marks(index_path: str) -> None:
    """Remove mark sets and scratch indexes of killed GC runs and rebuilds (the
    caller holds the GC lock, which rebuilds take too)."""
    for name in os.listdir(index_path) if os.path.isdir(index_path) else []:
        if name.startswith(("gc-mark-", "rebuild-")):
            shutil.rmtree(os.path.join(index_path, name), ignore_errors=True)


def finish_deletions(store: Store) -> int:
    """Hand back every deletion a killed GC of this index left in the DELETING state.

    Its records become WRITING (no dedup target), so the objects are decided
    again by a whole run: journal entry, session wait and mark.  Deleting them
    directly would skip all three, and a save on another index may have
    written one again since (the dead GC's entry stopped protecting it).
    The caller holds the GC lock.
    """
    return store.index.abandon_deletions()


def finish_abandoned_deletions(store: Store) -> None:
    """For a writer waiting on a DELETING object: finish it if no GC is running."""
    with gc_lock(store.index.path) as held:
        if held:
            finish_deletions(store)


def session_is_dead(info: dict[str, Any], now: float, grace_s: float) -> bool:
    """Whether an index write session's process is gone (see :func:`owner_is_dead`;
    seen from another host, once its heartbeat is older than the grace period)."""
    return owner_is_dead(info, now, grace_s)


# --- the run ----------------------------------------------------------------------------------


class _Run:
    def __init__(self, store: Store, grace_s: float, dry_run: bool, sweep: bool,
                 clock: Callable[[], float], progress: Progress, session_wait_s: float) -> None:
        self.store, self.index, self.backend = store, store.index, store.backend
        self.grace_s, self.dry_run, self.sweep = grace_s, dry_run, sweep
        self.clock, self.progress, self.session_wait_s = clock, progress, session_wait_s
        self.started = clock()
        self.before = self.started - grace_s
        self.result = GcResult(dry_run=dry_run, grace_s=grace_s)
        self.expired: set[str] = set()
        self.expired_tombstones: list[str] = []
        self.deleted: list[tuple[bytes, Digest]] = []
        self.entry: JournalEntry | None = None
        self.marks: MarkSet | None = None  # steps 4 and 7 share one
        self.last_beat, self.last_beat_wall = time.monotonic(), time.time()

    def check_time(self) -> None:
        """Called between steps: keep the grace promise, and keep the journal entry
        alive (a GC that cannot prove it is alive must not delete)."""
        if self.grace_s > 0 and self.clock() - self.started > self.grace_s / 2:
            raise GcAbortedError(
                f"gc ran longer than half the grace period ({self.grace_s / 2:.0f}s) and"
                " stopped so that readers keep the grace period they were promised; run it"
                " again, or with a longer --grace")
        if self.entry is None or time.monotonic() - self.last_beat < HEARTBEAT_S:
            return
        if time.time() - self.last_beat_wall > LEASE_S / 2:
            # Paused or cut off for half the lease: saves elsewhere may have counted
            # this run dead and written its objects again.
            raise GcAbortedError(
                "gc could not renew its journal entry for half the session lease (paused,"
                " or the store unreachable) and stopped deleting; run it again")
        write_entry(self.backend, self.entry)
        self.last_beat, self.last_beat_wall = time.monotonic(), time.time()

    def run(self) -> GcResult:
        self.index.reader_check()
        _remove_stale_marks(self.index.path)
        # Sessions first, reconcile second: a save killed after its commit
        # record but before its index update loses its claims here, and its
        # version is counted in (with its references) just below.
        self.expire_sessions()
        self.store.reconcile()
        sync_journal(self.backend, self.index)
        self.result.versions_considered = len(self.index.versions())
        if not self.dry_run:
            self.result.unfinished_deletions = finish_deletions(self.store)
        candidates = self.find_candidates()
        if self.sweep:
            candidates += self.find_orphans()
        self.result.candidates = len(candidates)
        if candidates:
            candidates = self.confirm_unreachable(candidates)
        if self.dry_run:
            for candidate in candidates:
                self._count(candidate)
        elif candidates:
            self.fence_and_delete(candidates)
        self.clean_up()
        self.result.seconds = round(self.clock() - self.started, 3)
        return self.result

    def close(self) -> None:
        if self.marks is not None:
            self.marks.close()

    def expire_sessions(self) -> None:
        for session_id, info in self.index.list_sessions().items():
            if session_is_dead(info, self.started, self.grace_s):
                self.expired.add(session_id)
                if not self.dry_run:
                    self.index.close_session(session_id)
        self.result.sessions_expired = len(self.expired)

    def find_candidates(self) -> list[Candidate]:
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
            found.append(Candidate(kind, digest, record.stored_length, True))
        return found

    def _claimed(self, digest: Digest) -> bool:
        """Claimed by a session that is not expiring in this run."""
        return any(s not in self.expired for s in self.index.claimants(digest))

    def find_orphans(self) -> list[Candidate]:
        """Objects on storage no index record names, older than the grace period."""
        found = []
        for prefix, kind, parse in ((CHUNK_PREFIX, CHUNK, digest_from_chunk_key),
                                    (NODE_PREFIX, NODE, digest_from_node_key)):
            for info in self.backend.list_info(prefix):
                try:
                    digest = parse(info.key)
                except ValueError:
                    continue
                # Young first: it needs no index lookup (most objects of a busy store).
                if info.mtime > self.before or self.index.record(kind, digest) is not None:
                    continue
                found.append(Candidate(kind, digest, info.size, False))
        return found

    def confirm_unreachable(self, candidates: list[Candidate]) -> list[Candidate]:
        """Drop every candidate a live or recently removed version reaches (steps 4, 7).

        Step 7 adds to step 4's mark set: a subtree marked once is not walked again,
        so the second pass costs only what was published meanwhile (and keeping
        what a version removed in between reached is only more cautious).
        """
        if self.marks is None:
            self.marks = MarkSet(self.index.path)
        marks = self.marks
        fallback = mark_live(self.store, marks, self.progress, self.check_time)
        mark_unindexed(self.store, marks)
        self.expired_tombstones = mark_removed(self.store, marks, self.before)
        for vid in fallback:
            note = (f"version {vid[:12]}: manifest unreadable, marked from the index instead"
                    " (run `chunkstore verify`)")
            if note not in self.result.index_disagreements:
                self.result.index_disagreements.append(note)
        confirmed = []
        for candidate in candidates:
            if (candidate.kind, candidate.digest) not in marks:
                confirmed.append(candidate)
            elif candidate.indexed and self._refcount(candidate) == 0:
                self._disagree(candidate)
        return confirmed

    def _refcount(self, candidate: Candidate) -> int:
        record = self.index.record(candidate.kind, candidate.digest)
        return record.refcount if record is not None else 0

    def _disagree(self, candidate: Candidate) -> None:
        note = (f"{_KIND_NAME[candidate.kind]} {candidate.digest.short(16)}: refcount 0 in the"
                " index but a live manifest references it; kept (run `chunkstore index"
                " rebuild`)")
        if note not in self.result.index_disagreements:
            self.result.index_disagreements.append(note)

    def fence_and_delete(self, candidates: list[Candidate]) -> None:
        """Steps 5-9: journal entry, wait for older saves, mark again, delete."""
        self.store.upgrade_format()  # the journal is a version-2 object
        entry = start_entry(self.backend, ((c.kind, c.digest) for c in candidates))
        self.entry = entry
        self.last_beat, self.last_beat_wall = time.monotonic(), time.time()
        self.result.journal_entry = entry.id
        try:
            if not self.wait_for_sessions(entry):
                self.result.deferred = len(candidates)
                entry.state = ABANDONED
                return
            self.store.reconcile()  # versions the sessions just waited for published
            candidates = self.confirm_unreachable(candidates)
            self.delete(candidates)
            entry.state = DONE
        finally:
            if entry.state == FENCED:
                entry.state = ABANDONED  # interrupted: saves stop waiting for it
            # What other indexes must forget: only what was deleted (or, if the run
            # was interrupted mid-way, everything it may have deleted).
            if entry.state == DONE or not self.deleted:
                entry.chunks = frozenset(d for k, d in self.deleted if k == CHUNK)
                entry.nodes = frozenset(d for k, d in self.deleted if k == NODE)
            write_entry(self.backend, entry)
            self.index.mark_journal_applied([entry.id])  # this index saw every deletion

    def wait_for_sessions(self, entry: JournalEntry) -> bool:
        """Wait until no live save session that has not read ``entry`` is left."""
        deadline = time.monotonic() + self.session_wait_s
        delay, waited = 0.01, set()
        while True:
            now = time.time()
            waiting = [s.id for s in list_sessions(self.backend)
                       if entry.id not in s.seen and not s.dead(now)]
            waited.update(waiting)
            self.result.sessions_waited_for = len(waited)
            if not waiting:
                return True
            if time.monotonic() > deadline:
                return False
            self.check_time()  # renews the entry: saves that need its objects wait for us
            time.sleep(delay)
            delay = min(delay * 2, 0.5)

    def delete(self, candidates: list[Candidate]) -> None:
        self.progress.start(len(candidates), "gc: delete")
        for kind in (CHUNK, NODE):
            indexed = [c.digest for c in candidates if c.kind == kind and c.indexed]
            for digest in self.index.condemn(kind, indexed, self.before):
                self.check_time()
                record = self.index.start_delete(kind, digest, self.before)
                if record is not None:
                    self.backend.delete(_KEY_OF[kind](digest))
                    self.index.finish_delete(kind, digest)
                    self._count(Candidate(kind, digest, record.stored_length, True))
                self.progress.advance()
        for candidate in candidates:
            if not candidate.indexed:
                self.check_time()
                if self.index.start_orphan_delete(candidate.kind, candidate.digest):
                    self.backend.delete(_KEY_OF[candidate.kind](candidate.digest))
                    self.index.finish_delete(candidate.kind, candidate.digest)
                    self._count(candidate)
                self.progress.advance()
        self.progress.finish()

    def _count(self, candidate: Candidate) -> None:
        self.deleted.append((candidate.kind, candidate.digest))
        if not candidate.indexed:
            self.result.orphans_deleted += 1
            self.result.orphan_bytes_freed += candidate.size
            return
        if candidate.kind == CHUNK:
            self.result.chunks_deleted += 1
        else:
            self.result.nodes_deleted += 1
        self.result.bytes_freed += candidate.size

    def clean_up(self) -> None:
        """Expired tombstones, finished journal entries older than a week, and the
        temporary files of interrupted writes."""
        if not self.dry_run:
            for version_id in self.expired_tombstones:
                self.backend.delete(tombstone_key(version_id))
            self.result.journal_entries_pruned = prune_journal(self.backend, self.started)
        self.result.tombstones_deleted = len(self.expired_tombstones)
        if self.sweep:
            # A write in progress owns its temporary file: never touch a young one,
            # whatever the grace period.
            cutoff = min(self.before, self.started - TEMP_MIN_AGE_S)
            self.result.temporaries_deleted = self.backend.remove_temporaries(
                cutoff, dry_run=self.dry_run)


def collect(store: Store, grace: object = DEFAULT_GRACE_S, *, dry_run: bool = False,
            sweep: bool = True, clock: Callable[[], float] = time.time,
            progress: Progress | None = None,
            session_wait: float = DEFAULT_SESSION_WAIT_S) -> GcResult:
    """Run one garbage collection; see the module docstring for the order of steps."""
    grace_s = parse_duration(grace)
    # A dry run waits a little for a running GC (or index rebuild) rather than fail.
    with gc_lock(store.index.path, wait_s=30.0 if dry_run else 0.0) as held:
        if not held:
            raise GcBusyError("another gc is running on this store; wait for it to finish")
        run = _Run(store, grace_s, dry_run, sweep, clock, progress or NullProgress(),
                   session_wait)
        try:
            return run.run()
        finally:
            run.close()
