"""Garbage collection: delete chunks and nodes no version reaches, after a grace period.

The store is the truth and any number of indexes may look at it (one per
machine on S3; a deleted, rebuilt or stale one locally), so no deletion
rests on what this index believes alone.  The order of a run (invariants
2-4 in DESIGN.md; the failures of restic, Kopia and Borg, and Kopia's GC
model, are why each step is where it is):

1. take this index's GC lock (one GC per index at a time; GCs on other
   indexes are safe to run at once, see below), count in or out versions
   committed or removed behind the index's back, apply the GC journal
   entries other GCs finished (:mod:`chunkstore.protocol.journal`), and hand the
   deletions a killed GC of this index left in the DELETING state back to
   this run (never finished blindly: that GC's entry died with it, so saves
   elsewhere may have written those objects again);
2. expire the index's write sessions of dead processes, and decide whether
   this run sweeps (:mod:`chunkstore.maintenance.sweep`: asked to, a dead
   save session in ``sessions/`` whose leftovers are past the grace period,
   or a day since this index's last complete sweep);
3. candidates: objects whose refcount has been zero for at least the grace
   period (the index's ``zero`` table, listed in the transaction that folds in the
   references saves deferred first, :meth:`~chunkstore.index.lmdbindex.Index.unreferenced_folded`:
   exact even where a process of an older release lowered a refcount without
   folding them; step 8 folds again where it re-checks each), and, in a
   sweep, objects on storage no index record names (orphans of killed saves,
   objects of another index's versions) older than the grace period;
4. mark: walk, first, the tree of every intent in a run's commit slots (a
   killed writer's claimed save, which the run's next taker publishes:
   :mod:`chunkstore.protocol.runlease` argues why before the listing of the
   commit records), then the manifests of every live version on storage (shared
   subtrees once) and of every version removed less than the grace period
   ago (its tombstone, :mod:`chunkstore.protocol.tombstones`: the grace period runs
   from unreachability, whoever removed it and whatever the index knows), and
   last the tree of every root a live read lease names
   (:mod:`chunkstore.protocol.readleases`, which argues why listing the leases
   last in both marks protects every reader that checked its version after
   storing its lease); drop every candidate the mark reaches.  Packed chunks are
   marked where the
   manifests list them and followed through the moved records (read after
   the walk) to the packs that hold them now;
   4b. repack (:mod:`chunkstore.maintenance.repack`, which argues its own order): live
   packs at least ``repack_unused`` garbage have their live members copied
   into new packs under a save session, then their moved records written;
   the old packs join the candidates, as does every pack with a moved
   record that is still stored;
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
8. record the run's audit intent event (:mod:`chunkstore.protocol.audit`: counts
   and bytes, durably, so a run killed while deleting is on record), then delete,
   through the index's condemn -> DELETING protocol so that saves
   of this index wait rather than reuse an object being deleted, in batches:
   each batch re-checks its records and moves them to DELETING in one index
   transaction, deletes their objects in one bulk delete (S3 DeleteObjects;
   locally unlinks side by side and one fsync per folder), and only then
   removes the records (a crash in between leaves them DELETING, handed back
   by step 1 of the next run);
9. mark the journal entry ``done`` (saves apply it to their own indexes:
   those objects are never again dedup targets there), delete expired
   tombstones (each read again first: one that a removal run again rewrote
   since is fresh and stays) and old temporary files, and in a sweep the signature objects of
   versions not published, older than the grace period
   (:func:`chunkstore.handle.signatures.orphan_signatures`) and the publication
   markers older than a day (:mod:`chunkstore.protocol.published`); a run that
   recorded an intent records what it deleted (its ``done`` event).

A pack of small chunks (:mod:`chunkstore.read.packs`) is one chunk object here:
versions reference the pack, never its members, so it is marked, fenced,
condemned and deleted whole, and a save that reuses a member claims the pack.
A pack counts as reached when a live version lists a member of it that its
moved record (if any) does not cover; a pack whose every listed member is
covered is deleted even though versions still list it (its refcount in the
index does not count), and readers follow the record.  Before such a pack
is deleted, every member versions list in it must read back where the record
puts it: hash-checked, and a delta member (which cannot be hashed without its
bases) byte for byte equal to the member it was copied from, since a repack
copies members unchanged.  A moved record is
deleted once its pack was already gone when the run started and no version
reaches it: the GC that deleted the pack waited for every save that could
still list it.  A sync writes moved records too (for packs its source
repacked), so a record to delete is fenced like an object: the journal entry of
step 5 names its old pack, step 6 waits for the sessions that have not read the
entry, and a record step 7 reaches is kept; a sync that read the entry waits
for this run before it writes or relies on the record.

Why no interleaving loses an object a published or in-progress version
needs.  Take any object X this run deletes and any save S.  If S stored its
session before step 5 completed and had not read the entry, step 6 waited
until S ended; if S published, step 7 reached X through S's version; if S
was abandoned, nothing needs X.  Otherwise S read the entry: S never
referenced X unwritten, and wrote X only after this run marked the entry
done or died (the fence wait, for every active entry naming X), so after
its deletion.  "Died" includes "could not renew its entry for half the
lease": such a run stops deleting before others may count it dead.  A save
counts a silent entry dead only :data:`~chunkstore.protocol.journal.FENCE_STALE_S`
after it saw it, and this run begins no bulk delete of step 8 later than
``RENEW_LAPSE_S`` (half of that) after its last renewal was sent (it checks
before each batch, and again after any request the batch made first): the other
half is for the delete in flight.  That is why a batch is bounded in time and not
only in keys (one DeleteObjects request on S3, as one DELETE was before; locally
the first batch is small and a batch grows only while its delete takes under a
quarter of ``RENEW_LAPSE_S``).  Batching changes nothing else the argument uses: each
object's record is re-checked (refcount 0, unclaimed) and made DELETING in the
same transaction, before its object is deleted, exactly as one at a time.  Versions published
before step 7 are marked in step 7; a version removed before it is marked
through its tombstone for the grace period.  Two GCs on different indexes
each satisfy this argument independently (deleting is idempotent, and each
waits for sessions that have not seen its own entry).  A session counted
dead while alive (its heartbeat failed for the whole lease) refuses to
publish (:meth:`StoreSession.lapsed`).  A deleted or rebuilt index loses
nothing the argument uses: sessions, journal, versions and tombstones are
all in the store.

What a run costs follows the garbage.  An *idle* run (no record at refcount 0
past the grace period or being deleted, no removal since packs were last looked
at, no sweep, no tombstone of a version this index still counts whose record is
gone) skips the count-in of step 1 (a listing of ``versions/``), the moved
records and both marks: a few listings of small prefixes (``sessions/``,
``removed/``, ``gc/``, ``readers/``), whatever the store holds.  Skipping is safe
for the same reason as above: every deletion is of a candidate confirmed by the
marks of steps 4 and 7 after the fence, and a run that skips a source of
candidates (a sweep, another index's removals, moved records) deletes a subset
of what a full run would.  What it skips only waits: another index's removals
are counted out at the next run that has work or sweeps (at least daily), or
earlier when their tombstones are seen, or their removal markers by an open
(:mod:`chunkstore.protocol.published`); a run that marks lists the versions
first (step 4 needs them anyway), and that listing counts out every version whose
record is gone, whatever became of its tombstone and its marker.  A run that
deletes always marks twice.  Publication and removal markers decide nothing here:
what an open counted in or out from them is a hint that the marks' full listings
(steps 1 and 7) and the tombstones (step 4) replace, so no marker, lost, crafted
or late, makes a run keep less.
Retiring dead sessions (deleting their objects after a complete sweep covered
what they wrote, :mod:`chunkstore.maintenance.sweep`) takes nothing the argument
uses: step 6 waits only for live sessions, and a session is judged dead again
right before its object goes.

A run that outlives half the grace period stops (:class:`GcAbortedError`):
a reader that opened a version just before it was removed is promised the
grace period.  A dry run takes the decisions of steps 1-4 and changes
nothing.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from chunkstore.backends.base import DELETE_BATCH
from chunkstore.errors import (
    ChunkStoreError,
    CorruptChunkError,
    GcAbortedError,
    GcBusyError,
    InvalidSettingError,
)
from chunkstore.format.chunkobj import parse_header
from chunkstore.format.digest import Digest
from chunkstore.handle.signatures import orphan_signatures
from chunkstore.index.gclock import finish_deletions, gc_lock
from chunkstore.index.lmdbindex import CHUNK, NODE, ChunkState
from chunkstore.maintenance.mark import (
    MarkSet,
    mark_live,
    mark_pending,
    mark_read,
    mark_removed,
    mark_unindexed,
    tree_objects,
)
from chunkstore.maintenance.reconcile import reconcile
from chunkstore.maintenance.repack import DEFAULT_UNUSED, plan, repack
from chunkstore.maintenance.retention import parse_duration
from chunkstore.maintenance.sweep import SweepPlan, SweepState, dead_sessions
from chunkstore.maintenance.sweep import finish as finish_sweep
from chunkstore.maintenance.sweep import plan as plan_sweep
from chunkstore.objects.kinds import (
    CHUNKS,
    MOVED,
    NODES,
    READERS,
    SIGNATURES,
    TOMBSTONES,
    VERSIONS,
)
from chunkstore.progress import NullProgress, Progress
from chunkstore.protocol import audit
from chunkstore.protocol.journal import (
    ABANDONED,
    DONE,
    FENCED,
    RENEW_LAPSE_S,
    JournalEntry,
    check_renewed,
    finish_entry,
    prune_journal,
    start_entry,
    sync_journal,
    write_entry,
)
from chunkstore.protocol.moved import MovedRecord, list_moved, resolve_location
from chunkstore.protocol.published import prune_markers
from chunkstore.protocol.readleases import expired_read_leases
from chunkstore.protocol.sessions import HEARTBEAT_S, LEASE_S, list_sessions, owner_is_dead
from chunkstore.protocol.tombstones import removal_times
from chunkstore.read.packs import copy_members

if TYPE_CHECKING:
    from chunkstore.handle.handle import StoreHandle

log = logging.getLogger(__name__)

DEFAULT_GRACE_S = 3600.0
#: How long a GC waits for saves that started before its journal entry (step 6).
DEFAULT_SESSION_WAIT_S = 120.0
#: Temporary files of interrupted writes are removed only when older than this.
TEMP_MIN_AGE_S = 600.0
#: The object kind of each index kind.
_KIND_OF = {CHUNK: CHUNKS, NODE: NODES}
_KIND_NAME = {CHUNK: "chunk", NODE: "node"}


#: The first batch of step 8's deletions; later ones grow to DELETE_BATCH while fast.  One
#: object: nothing is known yet of how long a delete takes here, and a first batch of 64
#: on storage that takes 0.1 s an object ran 6.4 s past the renewal, where a save may
#: count this run dead after one heartbeat (tests/test_stopped_peers.py).
_FIRST_BATCH = 1


@dataclass(frozen=True)
class Candidate:
    """An object GC may delete; ``indexed`` when this index has a record of it."""

    kind: bytes
    digest: Digest
    size: int
    indexed: bool


@dataclass(frozen=True)
class _Started:
    """A candidate whose deletion began (its record DELETING); ``maybe_gone`` when its
    object may be gone already (a record of WRITING state)."""

    candidate: Candidate
    maybe_gone: bool


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
    #: signature objects whose version is not published, past the grace period (a sweep)
    signatures_deleted: int = 0
    #: publication markers older than a day, deleted in a sweep
    markers_pruned: int = 0
    journal_entries_pruned: int = 0
    #: Saves in progress in the store that this run waited for (step 6).
    sessions_waited_for: int = 0
    #: Objects not deleted because saves outlasted the wait; the next run retries.
    deferred: int = 0
    #: Packs repacked (a dry run: that would be), the live bytes copied out of them,
    #: the bytes their new packs take, and what repacking frees net (stored bytes of
    #: the old packs less the bytes copied; in a real run their deletion is counted
    #: in ``chunks_deleted`` and ``bytes_freed``).
    packs_repacked: int = 0
    repack_bytes_copied: int = 0
    repack_bytes_written: int = 0
    repack_bytes_freed: int = 0
    #: Bytes inside live packs that no live version lists (before this run's repacking),
    #: and the live packs (those holding a member a live version reads) and their bytes.
    pack_garbage_bytes: int = 0
    live_packs: int = 0
    live_pack_bytes: int = 0
    #: The repack threshold of this run (None: no repacking).
    repack_unused: float | None = None
    #: Moved records of packs long gone that no version reaches any more.
    moved_records_deleted: int = 0
    #: versions read under a live read lease, kept whole by the last mark
    readers_protected: int = 0
    #: Packs planned for repacking but left as they are, and why.
    repack_skipped: list[str] = field(default_factory=list)
    journal_entry: str | None = None
    index_disagreements: list[str] = field(default_factory=list)
    #: Whether this run listed storage for objects no index record names (a dry run:
    #: would), and why or why not (chunkstore.maintenance.sweep).
    swept: bool = False
    sweep_reason: str = ""
    #: When this index's last complete sweep began, and when the next one is due (by
    #: the schedule, or sooner for a dead save's leftovers), Unix time.
    last_sweep: float | None = None
    next_sweep_due: float | None = None
    #: Save sessions in the store whose process is dead, and of those the ones whose
    #: objects this run deleted after a complete sweep covered their leftovers.
    dead_sessions: int = 0
    sessions_retired: int = 0
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


# --- leftovers of killed runs --------------------------------------------------------------


def _remove_stale_marks(index_path: str) -> None:
    """Remove mark sets and scratch indexes of killed GC runs and rebuilds (the
    caller holds the GC lock, which rebuilds take too)."""
    for name in os.listdir(index_path) if os.path.isdir(index_path) else []:
        if name.startswith(("gc-mark-", "rebuild-")):
            shutil.rmtree(os.path.join(index_path, name), ignore_errors=True)


def session_is_dead(info: dict[str, Any], now: float, grace_s: float) -> bool:
    """Whether an index write session's process is gone (see :func:`owner_is_dead`;
    seen from another host, once its heartbeat is older than the grace period)."""
    return owner_is_dead(info, now, grace_s)


def stored_size(store: StoreHandle, kind: bytes, digest: Digest) -> int | None:
    """The size of a chunk (``kind`` CHUNK) or node object as stored now (one HEAD);
    None when it is not stored.  For a record whose size the index never learnt (a
    killed save's claim: WRITING, size 0)."""
    try:
        return store.objects.stat(_KIND_OF[kind], digest).size
    except FileNotFoundError:
        return None


# --- the run ----------------------------------------------------------------------------------


class _Run:
    #: what the run's audit events call it (docs/format.md §16)
    audit_op = "gc"

    def __init__(self, store: StoreHandle, grace_s: float, dry_run: bool, sweep: bool | None,
                 clock: Callable[[], float], progress: Progress, session_wait_s: float,
                 repack_unused: float | None) -> None:
        self.store, self.index, self.objects = store, store.index, store.objects
        self.grace_s, self.dry_run = grace_s, dry_run
        #: True: sweep; False: never; None: when due (decide_sweep)
        self.requested_sweep = sweep
        self.sweep = False
        self.sweep_plan: SweepPlan | None = None
        self.repack_unused = repack_unused
        #: packs with a moved record still stored: versions may list them, but they are
        #: candidates all the same (the mark says whether a member is still read there)
        self.forwarded: set[Digest] = set()
        #: packs with a moved record that were gone when this run started
        self.gone_moved: set[Digest] = set()
        #: of those, the records this run deletes (confirmed after the fence)
        self.moved_unused: list[Digest] = []
        self.clock, self.progress, self.session_wait_s = clock, progress, session_wait_s
        self.started = clock()
        self.before = self.started - grace_s
        #: tombstones younger than this protect their versions' trees (``before`` but in a
        #: purge, whose own candidates have grace 0: chunkstore.maintenance.purge)
        self.removed_before = self.before
        #: versions whose tombstones protect nothing (a purge's)
        self.purged: frozenset[str] = frozenset()
        self.result = GcResult(dry_run=dry_run, grace_s=grace_s, repack_unused=repack_unused)
        self.expired: set[str] = set()
        self.expired_tombstones: list[str] = []
        self.deleted: list[tuple[bytes, Digest]] = []
        self.delete_began = False
        self.entry: JournalEntry | None = None
        self.audit_intent: str | None = None  # the id of the run's audit intent event
        self.marks: MarkSet | None = None  # steps 4 and 7 share one
        self.moved: dict[Digest, MovedRecord | None] = {}  # read by the last mark
        self.last_beat, self.last_beat_wall = time.monotonic(), time.time()

    def check_time(self) -> None:
        """Called between steps: keep the grace promise, and keep the journal entry
        alive (a GC that cannot prove it is alive must not delete)."""
        if self.grace_s > 0 and self.clock() - self.started > self.grace_s / 2:
            raise GcAbortedError(
                f"gc ran longer than half the grace period ({self.grace_s / 2:.0f}s) and"
                " stopped so that readers keep the grace period they were promised; run it"
                " again, or with a longer --grace")
        if self.entry is None:
            return
        check_renewed(self.entry)  # before every deletion: see journal.FENCE_STALE_S
        if time.monotonic() - self.last_beat < HEARTBEAT_S:
            return
        if time.time() - self.last_beat_wall > LEASE_S / 2:
            # Paused or cut off for half the lease: saves elsewhere may have counted
            # this run dead and written its objects again.
            raise GcAbortedError(
                "gc could not renew its journal entry for half the session lease (paused,"
                " or the store unreachable) and stopped deleting; run it again")
        write_entry(self.objects, self.entry)
        self.last_beat, self.last_beat_wall = time.monotonic(), time.time()

    def run(self) -> GcResult:
        candidates = self.gather()
        # Packs gain garbage only when versions are removed: a run with no candidate
        # marks nothing unless one was removed since repacking was last planned (a dry
        # run marks anyway: report's census of packs comes from it).
        unused = self.repack_unused
        removals = None if unused is None else self.index.repack_pending(unused)
        if candidates or self.gone_moved or removals is not None \
                or (self.dry_run and unused is not None):
            candidates = self.confirm_unreachable(candidates)
            candidates += self.repack()
        moved = self.unused_moved()
        if self.dry_run:
            for candidate in candidates:
                self._count(candidate)
            self.moved_unused = moved
        elif candidates or moved:
            self.fence_and_delete(candidates, moved)
        self.clean_up()
        if not self.dry_run:
            self.finish(removals)
            self.record_done()
        self.result.seconds = round(self.clock() - self.started, 3)
        return self.result

    def gather(self) -> list[Candidate]:
        """Steps 1-3: the candidates (those of this index, the sweep's, the packs with
        a moved record), in a run with work to do; an idle run finds none."""
        self.index.reader_check()
        _remove_stale_marks(self.index.path)
        # Sessions first, reconcile second: a save killed after its commit
        # record but before its index update loses its claims here, and its
        # version is counted in (with its references) just below.
        self.expire_sessions()
        self.decide_sweep()
        # An idle run (nothing old enough at refcount 0, no removal since packs were
        # last looked at, no sweep) neither lists the versions nor marks: what it
        # would find is nothing, and whatever it skips only waits (module docstring).
        busy = self.sweep or self.has_work()
        if busy:
            reconcile(self.store)
        sync_journal(self.objects, self.index)
        self.result.versions_considered = len(self.index.version_ids())
        if not self.dry_run:
            self.result.unfinished_deletions = finish_deletions(self.index)
        candidates = self.find_candidates()
        if candidates and not busy:  # the journal or a killed run left some after all
            busy = True
            reconcile(self.store)
            candidates = self.find_candidates()
        if self.sweep:
            candidates += self.find_orphans()
        if busy:
            candidates += self.find_moved(candidates)
        self.result.candidates = len(candidates)
        return candidates

    def finish(self, removals: int | None) -> None:
        """What a run that completed (no error: we are here; nothing deferred to a
        later run) records: that packs were looked at after ``removals`` removals (a
        run killed or deferred after repacking leaves them pending, so the next run is
        not idle and finds the old packs and moved records again), and its sweep."""
        complete = self.result.deferred == 0
        if complete and self.repack_unused is not None and removals is not None:
            self.index.repack_checked(removals, self.repack_unused)
        assert self.sweep_plan is not None
        self.result.sessions_retired = finish_sweep(self.objects, self.index.path,
                                                    self.sweep_plan, self.started, complete)
        self.result.last_sweep = self.sweep_plan.state.last_sweep

    def decide_sweep(self) -> None:
        """Whether this run sweeps storage for orphans (:mod:`.sweep`).  The dead
        sessions are listed before the run's clock starts: what their processes wrote
        was stored before it, so a run with grace 0 covers them."""
        dead = dead_sessions(self.objects, time.time())
        self.started = self.clock()
        self.before = self.removed_before = self.started - self.grace_s
        state = SweepState.load(self.index.path)
        self.sweep_plan = plan_sweep(state, dead, self.requested_sweep, self.started,
                                     self.grace_s)
        self.sweep = self.sweep_plan.run
        result = self.result
        result.swept, result.sweep_reason = self.sweep, self.sweep_plan.reason
        result.next_sweep_due = self.sweep_plan.next_due
        result.last_sweep = state.last_sweep
        result.dead_sessions = len(dead)

    def has_work(self) -> bool:
        """Whether a run that does not sweep may find anything: a record at refcount 0
        past the grace period (or a killed run's deletion), packs to look at after a
        removal, a dry run's census of packs, or a version another index removed that
        this one still counts (its tombstone, and its record gone)."""
        unused = self.repack_unused
        if unused is not None and (self.dry_run or self.index.repack_pending(unused)
                                   is not None):
            return True
        for kind, digest, since in self.index.unreferenced():
            if since <= self.before:
                return True
            record = self.index.record(kind, digest)
            if record is not None and record.state == ChunkState.DELETING:
                return True
        return any(self.index.version(vid) is not None
                   and not self.objects.exists(VERSIONS, vid)
                   for vid in self.objects.ids(TOMBSTONES))

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
        for kind, digest, since in self.index.unreferenced_folded():
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
            candidate = Candidate(kind, digest, record.stored_length, True)
            if self.dry_run and record.state == ChunkState.WRITING and not record.stored_length:
                # A killed save's claim: its size was never recorded (a real run learns
                # it as it deletes, _delete_batches).
                candidate = self._as_stored(candidate)[0]
            found.append(candidate)
        return found

    def _claimed(self, digest: Digest) -> bool:
        """Claimed by a session that is not expiring in this run."""
        return any(s not in self.expired for s in self.index.claimants(digest))

    def find_orphans(self) -> list[Candidate]:
        """Objects on storage no index record names, older than the grace period.

        The listing streams (on S3 a page of 1,000 keys at a time) and only these
        candidates are kept: the sweep's memory follows the orphans, not the store."""
        found = []
        for kind in (CHUNK, NODE):
            for digest, info in self.objects.infos(_KIND_OF[kind]):
                # Young first: it needs no index lookup (most objects of a busy store).
                if info.mtime > self.before or self.index.record(kind, digest) is not None:
                    continue
                found.append(Candidate(kind, digest, info.size, False))
        return found

    def find_moved(self, found: list[Candidate]) -> list[Candidate]:
        """Packs GC repacked that are still stored (candidates whatever the index says),
        and those already gone (their moved records may go once nothing reaches them)."""
        listed = {c.digest for c in found if c.kind == CHUNK}
        more = []
        for pack in list_moved(self.objects):
            try:
                size = self.objects.stat(CHUNKS, pack).size
            except FileNotFoundError:
                self.gone_moved.add(pack)
                continue
            self.forwarded.add(pack)
            record = self.index.record(CHUNK, pack)
            if pack in listed or (record is not None and record.state == ChunkState.DELETING):
                continue
            if self._claimed(pack):
                self.result.kept_by_sessions += 1
                continue
            more.append(Candidate(CHUNK, pack, size, record is not None))
        return more

    def repack(self) -> list[Candidate]:
        """Plan from the mark which live packs to repack; repack them (not in a dry run)
        and return the old packs as candidates (:mod:`chunkstore.maintenance.repack`)."""
        assert self.marks is not None
        chosen = plan(self.store, self.marks, self.moved, self.repack_unused, self.forwarded)
        self.result.pack_garbage_bytes = chosen.garbage_bytes
        self.result.live_packs = chosen.live_packs
        self.result.live_pack_bytes = chosen.live_pack_bytes
        if not chosen.packs:
            return []
        self.result.repack_bytes_freed = chosen.freed_bytes
        self.result.repack_bytes_copied = chosen.copy_bytes
        if self.dry_run:
            self.result.packs_repacked = len(chosen.packs)
            return []
        self.check_time()
        done = repack(self.store, chosen.packs, self.store.pack_size)
        self.result.packs_repacked = len(done.repacked)
        self.result.repack_bytes_written = done.bytes_written
        self.result.repack_skipped = done.skipped
        repacked = set(done.repacked)
        if len(repacked) < len(chosen.packs):
            kept = [use for use in chosen.packs if use.pack in repacked]
            self.result.repack_bytes_copied = sum(use.live for use in kept)
            self.result.repack_bytes_freed = sum(use.stored - use.live for use in kept)
        self.forwarded |= repacked
        return [Candidate(CHUNK, use.pack, use.stored,
                          self.index.record(CHUNK, use.pack) is not None)
                for use in chosen.packs if use.pack in repacked]

    def confirm_unreachable(self, candidates: list[Candidate]) -> list[Candidate]:
        """Drop every candidate a live or recently removed version reaches (steps 4, 7).

        Step 7 adds to step 4's mark set: a subtree marked once is not walked again,
        so the second pass costs only what was published meanwhile (and keeping
        what a version removed in between reached is only more cautious).
        """
        if self.marks is None:
            self.marks = MarkSet(self.index.path)
        marks = self.marks
        # Intents first: before the listing of the commit records (mark_pending says why).
        pending = mark_pending(self.store, marks)
        fallback = mark_live(self.store, marks, self.progress, self.check_time)
        published = mark_unindexed(self.store, marks)
        self.expired_tombstones = mark_removed(
            self.store, marks, self.removed_before, skip=self.purged, now=self.started,
            published=published) + sorted(self.purged)
        # Read leases last: step 7 lists them after the session wait (the order the
        # argument of chunkstore.protocol.readleases needs).
        self.result.readers_protected = mark_read(self.store, marks)
        # Read after the walk: a pack repacked since is not reached through its members.
        self.moved = list_moved(self.objects)
        marks.resolve(self.moved, self._stored_now())
        for vid in fallback:
            note = (f"version {vid[:12]}: manifest unreadable, marked from the index instead"
                    " (run `chunkstore verify`)")
            if note not in self.result.index_disagreements:
                self.result.index_disagreements.append(note)
        confirmed = []
        uncounted: set[tuple[bytes, Digest]] | None = None  # what only intents reach
        for candidate in candidates:
            if (candidate.kind, candidate.digest) not in marks:
                confirmed.append(candidate)
            elif candidate.indexed and self._refcount(candidate) == 0 \
                    and not marks.forwarded_to(candidate.digest):
                if uncounted is None:
                    uncounted = tree_objects(self.store, pending) if pending else set()
                if (candidate.kind, candidate.digest) not in uncounted:
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

    def unused_moved(self) -> list[Digest]:
        """Moved records of packs gone before this run began that no version the mark
        walked reaches: to be fenced with the candidates, and deleted once the mark
        after the fence confirms it."""
        if self.marks is None:
            return []
        return sorted(p for p in self.gone_moved if not self.marks.record_used(p))

    def fence_and_delete(self, candidates: list[Candidate], moved: list[Digest]) -> None:
        """Steps 5-9: journal entry, wait for older saves, mark again, delete.  The
        journal entry names the packs of the moved records to delete too (as the
        objects whose members they forward), so a sync that would write or rely on
        one waits for this run, and one that did not read the entry is waited for
        here and its version marked before a record goes."""
        self.store.upgrade_format()  # the journal is a version-2 object
        entry = start_entry(self.objects, [*((c.kind, c.digest) for c in candidates),
                                           *((CHUNK, pack) for pack in moved)],
                            self.index.identity())  # who collects here (journal pruning)
        self.entry = entry
        self.last_beat, self.last_beat_wall = time.monotonic(), time.time()
        self.result.journal_entry = entry.id
        failed = True
        try:
            if not self.wait_for_sessions(entry):
                self.result.deferred = len(candidates)
                entry.state = ABANDONED
                failed = False
                return
            reconcile(self.store)  # versions the sessions just waited for published
            candidates = self.confirm_unreachable(candidates)
            still = set(self.unused_moved())
            self.moved_unused = [pack for pack in moved if pack in still]
            if candidates or self.moved_unused:
                self.record_intent(candidates=candidates)
            self.delete(candidates)
            # The records too while the entry is fenced: a sync that reads it done
            # relies on a record it finds and would publish before a later delete.
            for pack in self.moved_unused:
                self.check_time()
                self.objects.delete(MOVED, pack)
            entry.state = DONE
            failed = False
        finally:
            if entry.state == FENCED:
                entry.state = ABANDONED  # interrupted: saves stop waiting for it
            # What other indexes must forget: only what was deleted (or, if the run
            # was interrupted mid-way, everything it may have deleted).
            if entry.state == DONE or not self.delete_began:
                entry.chunks = frozenset(d for k, d in self.deleted if k == CHUNK)
                entry.nodes = frozenset(d for k, d in self.deleted if k == NODE)
            # Stored finished; one that names nothing is deleted at once, else it is
            # marked applied here (this index saw every deletion).
            try:
                finish_entry(self.objects, entry, self.index)
            except Exception as exc:
                if not failed:
                    raise
                # The run's own error says why it stopped (the store unreachable, say);
                # the entry left fenced is counted gone by saves after a heartbeat.
                log.warning("gc journal entry %s could not be marked finished: %s",
                            entry.id, exc)

    def record_intent(self, *, candidates: Sequence[Candidate] = (), **counts: int) -> None:
        """Before the run's first deletion: its audit intent event, durably (one a run:
        what it is about to delete first, counts and bytes, not every object)."""
        if self.audit_intent is not None:
            return
        fields: dict[str, Any] = {
            name: sum(1 for c in candidates if c.kind == kind and c.indexed)
            for name, kind in (("chunks", CHUNK), ("nodes", NODE))}
        fields.update(counts, orphans=sum(1 for c in candidates if not c.indexed),
                      bytes=sum(c.size for c in candidates),
                      moved_records=len(self.moved_unused), grace_s=self.grace_s,
                      journal_entry=self.entry.id if self.entry is not None else None)
        self.audit_intent = audit.record(self.objects, self.audit_op, **fields)

    def record_done(self) -> None:
        """After a run that recorded an intent: what it deleted."""
        if self.audit_intent is None:
            return
        r = self.result
        audit.record_done(
            self.objects, self.audit_op, self.audit_intent, chunks=r.chunks_deleted,
            nodes=r.nodes_deleted, bytes=r.bytes_freed, orphans=r.orphans_deleted,
            orphan_bytes=r.orphan_bytes_freed, tombstones=r.tombstones_deleted,
            signatures=r.signatures_deleted, moved_records=len(self.moved_unused),
            deferred_objects=r.deferred)

    def wait_for_sessions(self, entry: JournalEntry) -> bool:
        """Wait until no live save session that has not read ``entry`` is left."""
        deadline = time.monotonic() + self.session_wait_s
        delay, waited = 0.01, set()
        while True:
            now = time.time()
            waiting = [s.id for s in list_sessions(self.objects)
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

    def _stored_now(self) -> Callable[[Digest], bool]:
        """Whether a pack object exists, each asked once per mark."""
        known: dict[Digest, bool] = {}

        def stored(pack: Digest) -> bool:
            if pack not in known:
                known[pack] = self.objects.exists(CHUNKS, pack)
            return known[pack]
        return stored

    def _intact_elsewhere(self, pack: Digest) -> bool:
        """Before a pack that holds members of live versions is deleted: every member
        they list in it, or reach through it (a pack a repack wrote, which versions
        reach only through moved records), reads back where the moved records put it
        next, hash-checked, or for a delta member (no hash without its bases) equal
        byte for byte to the member it was copied from (so a damaged, crafted or stale
        record never costs data)."""
        assert self.marks is not None
        stored = self._stored_now()
        members = self.marks.listed_members(pack) + self.marks.passing_members(pack)
        for digest, listed in members:
            location, _ = resolve_location(listed, self.moved, stored)
            try:
                if location.pack == pack:
                    raise CorruptChunkError(pack.hex, "a listed member was not moved")
                ((moved, _),) = copy_members(self.store, location.pack,
                                             [(digest, location.offset, location.length)])
                if parse_header(digest, moved).base is not None and moved != bytes(
                        self.objects.open_member(digest, listed, self.objects.member_range(
                            pack, listed.offset, listed.length))):
                    raise CorruptChunkError(digest.hex, "its moved copy differs from the"
                                            f" member in pack {pack.short()}")
            except (FileNotFoundError, ChunkStoreError) as exc:
                self.result.repack_skipped.append(
                    f"pack {pack.short()}: kept, its moved member {digest.short()} does not"
                    f" read back where its moved record says ({exc}); run `chunkstore"
                    " verify`")
                return False
        return True

    def delete(self, candidates: list[Candidate]) -> None:
        """Step 8, a batch at a time (:meth:`_delete_batches`): the index's records first
        (condemned, then re-checked and moved to DELETING), then the objects in bulk."""
        self.delete_began = True  # from here an interruption may leave any candidate deleted
        self.progress.start(len(candidates), "gc: delete")
        candidates = [c for c in candidates if c.kind != CHUNK or c.digest not in self.forwarded
                      or self._intact_elsewhere(c.digest)]
        for kind in (CHUNK, NODE):
            indexed = [c.digest for c in candidates if c.kind == kind and c.indexed]
            forwarded = frozenset(self.forwarded) if kind == CHUNK else frozenset()

            def start_indexed(batch: list[Digest], kind: bytes = kind,
                              forwarded: frozenset[Digest] = forwarded) -> list[_Started]:
                return [_Started(Candidate(kind, digest, record.stored_length, True),
                                 record.state == ChunkState.WRITING)
                        for digest, record in self.index.start_deletes(
                            kind, batch, self.before, forwarded)]
            self._delete_batches(kind, self.index.condemn(kind, indexed, self.before,
                                                          forwarded), start_indexed)
        for kind in (CHUNK, NODE):
            orphans = {c.digest: c for c in candidates if c.kind == kind and not c.indexed}

            def start_orphans(batch: list[Digest], kind: bytes = kind,
                              orphans: dict[Digest, Candidate] = orphans) -> list[_Started]:
                return [_Started(orphans[digest], False)
                        for digest in self.index.start_orphan_deletes(kind, batch)]
            self._delete_batches(kind, list(orphans), start_orphans)
        self.progress.finish()

    def _delete_batches(self, kind: bytes, digests: list[Digest],
                        start: Callable[[list[Digest]], list[_Started]]) -> None:
        """Delete ``digests`` of one kind in batches.  For each: the run's checks
        (:meth:`check_time`: grace, and the entry renewed lately), ``start`` (one index
        transaction: the re-check against saves of this index, and DELETING for each
        object that may go), the run's checks again where requests were made since, the
        objects in one bulk delete (one request per batch on S3, unlinks side by side
        and a fsync per folder locally), then their records removed (one transaction).
        A bulk delete is one deletion in flight for the fence's timing
        (chunkstore.protocol.journal.FENCE_STALE_S): the first is small, and a batch
        grows only while its delete takes under a quarter of RENEW_LAPSE_S, and shrinks
        when one takes over half."""
        size, done = _FIRST_BATCH, 0
        while done < len(digests):
            batch = digests[done:done + size]
            done += len(batch)
            self.check_time()
            started = start(batch)
            # A record of WRITING state (another GC's deletion applied here, a killed
            # run's handed back, a killed save's claim) may name an object gone already
            # (not freed again) or one whose size it never learnt: asked storage.
            counted = [(s.candidate, True) if not s.maybe_gone else self._as_stored(s.candidate)
                       for s in started]
            if any(s.maybe_gone for s in started):
                self.check_time()  # after those requests: the delete begins in time
            began = time.monotonic()
            self.objects.delete_many(_KIND_OF[kind], [s.candidate.digest for s in started])
            self.index.finish_deletes(kind, [s.candidate.digest for s in started])
            for candidate, existed in counted:
                self._count(candidate, existed)
            self.progress.advance(len(batch))
            took = time.monotonic() - began
            if took < RENEW_LAPSE_S / 4:
                size = min(size * 4, DELETE_BATCH)
            elif took > RENEW_LAPSE_S / 2:
                size = max(size // 2, 1)

    def _as_stored(self, candidate: Candidate) -> tuple[Candidate, bool]:
        """``candidate`` with its size as stored now, and whether it is stored."""
        size = stored_size(self.store, candidate.kind, candidate.digest)
        return (candidate, False) if size is None else (replace(candidate, size=size), True)

    def _count(self, candidate: Candidate, existed: bool = True) -> None:
        self.deleted.append((candidate.kind, candidate.digest))
        if not existed:  # gone already (a pack deleted after repacking, counted then)
            return
        if not candidate.indexed:
            self.result.orphans_deleted += 1
            self.result.orphan_bytes_freed += candidate.size
            return
        if candidate.kind == CHUNK:
            self.result.chunks_deleted += 1
        else:
            self.result.nodes_deleted += 1
        self.result.bytes_freed += candidate.size

    def still_expired(self) -> list[str]:
        """The tombstones the marks judged expired, read again right before they go (one
        request each, side by side): a removal run again over one that did not finish
        (``rm`` killed after its tombstones) rewrote its tombstone since, fresh, and is
        deleting the record; deleted by its id, the version would lose its grace period
        and a hold placed now the removal's only sign (docs/format.md §11.3).  A purge's
        own tombstones go whatever their age."""
        judged = [vid for vid in self.expired_tombstones if vid not in self.purged]
        times = removal_times(self.objects, judged)
        return [vid for vid in self.expired_tombstones if vid in self.purged
                or (vid in times and times[vid] <= self.removed_before)]

    def clean_up(self) -> None:
        """Expired tombstones, finished journal entries (older than a day, or applied
        here on a local store), and the temporary files of interrupted writes."""
        # Moved records were deleted in step 8 (fence_and_delete), while the entry
        # was fenced: a pack gone before this run began whose record neither mark
        # reached; every version that lists one of its members was published before
        # the entry (the GC that deleted the pack waited for the saves that could reuse
        # it), or by a session step 6 waited for; a save or sync that reads the entry
        # while it is fenced waits for this run before it writes or relies on the record.
        self.result.moved_records_deleted = len(self.moved_unused)
        if not self.dry_run:
            self.expired_tombstones = self.still_expired()
            if self.expired_tombstones:
                self.record_intent(tombstones=len(self.expired_tombstones))
            # In bulk (a prune leaves a thousand): each protects nothing any more.
            self.objects.delete_many(TOMBSTONES, self.expired_tombstones)
            for lease_id in expired_read_leases(self.objects):  # of killed readers
                self.objects.discard(READERS, lease_id)
            # Finished entries older than a day, and on a local store those this index
            # applied but for this run's own (docs/format.md §11.2): the journal stays
            # at about one entry and one marker however many runs follow retention.
            self.result.journal_entries_pruned = prune_journal(
                self.objects, self.started, index=self.index,
                keep=[self.entry.id] if self.entry is not None else [])
        self.result.tombstones_deleted = len(self.expired_tombstones)
        if self.sweep:
            # A write in progress owns its temporary file, and a signed save about to
            # publish its signature: never touch a young one, whatever the grace period.
            cutoff = min(self.before, self.started - TEMP_MIN_AGE_S)
            self.result.temporaries_deleted = self.objects.remove_temporaries(
                cutoff, dry_run=self.dry_run)
            orphans = orphan_signatures(self.objects, cutoff)
            if not self.dry_run:
                if orphans:
                    self.record_intent(signatures=len(orphans))
                self.objects.delete_many(SIGNATURES, orphans)
            self.result.signatures_deleted = len(orphans)
            # Markers past their keeping: an index that might still look for them lists
            # every commit record instead (chunkstore.protocol.published, step 4).
            self.result.markers_pruned = prune_markers(self.objects, self.started,
                                                       dry_run=self.dry_run)


def collect(store: StoreHandle, grace: object = DEFAULT_GRACE_S, *, dry_run: bool = False,
            sweep: bool | None = None, clock: Callable[[], float] = time.time,
            progress: Progress | None = None,
            session_wait: float = DEFAULT_SESSION_WAIT_S,
            repack_unused: float | None = DEFAULT_UNUSED) -> GcResult:
    """Run one garbage collection; see the module docstring for the order of steps.

    ``sweep``: True lists storage for orphans, False never, None when it is due
    (:mod:`chunkstore.maintenance.sweep`).
    ``repack_unused``: repack live packs at least this fraction garbage (in
    (0, 1]; None: never repack)."""
    grace_s = parse_duration(grace)
    if repack_unused is not None and not (type(repack_unused) in (int, float)
                                          and 0 < repack_unused <= 1):
        raise InvalidSettingError(f"repack_unused must be a fraction in (0, 1], not"
                                  f" {repack_unused!r}")
    # A dry run waits a little for a running GC (or index rebuild) rather than fail.
    with gc_lock(store.index.path, wait_s=30.0 if dry_run else 0.0) as held:
        if not held:
            raise GcBusyError("another gc is running on this store; wait for it to finish")
        if not dry_run:  # on a full disk, the index's reserve makes room for the journal
            store.index.release_reserve_if_low()
        run = _Run(store, grace_s, dry_run, sweep, clock, progress or NullProgress(),
                   session_wait, repack_unused)
        try:
            result = run.run()
        finally:
            run.close()
        if not dry_run:
            store.index.keep_reserve()  # taken again where the run freed room for it
        return result
