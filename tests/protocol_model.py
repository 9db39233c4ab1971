"""An abstract model of the store protocol of docs/format.md section 11, explored over
every interleaving by a small explicit-state checker.

Nothing here imports chunkstore: the model is the protocol of
:mod:`chunkstore.maintenance.gc`, :mod:`chunkstore.write.writer`,
:mod:`chunkstore.protocol.journal`,
:mod:`chunkstore.protocol.sessions`, :mod:`chunkstore.protocol.tombstones` and
:mod:`chunkstore.protocol.readleases` reduced to what decides whether an object is
deleted while something needs it.

The world:

- the **store**: which objects are present (with their write time), the
  published versions, tombstones, save session objects (alive or counted
  dead, with ``seen``) and GC journal entries (``fenced``/``done``/
  ``abandoned``, the objects they name, whether their GC counts as alive);
- **writers**, each with its own **index** (the objects it believes stored,
  i.e. its deduplication targets, and the journal entries it has applied).
  A save is: store the session object -> list the journal -> read each entry
  not yet applied (finished or dead: forget its objects; fenced: keep it in
  the save's fence) -> record the fenced ones in ``seen`` -> per object:
  wait for a fence entry naming it, or deduplicate if the index lists it, or
  write it (put-if-absent: an object already there is reused) -> commit
  (refused when the session lapsed) -> delete the session.  Between saves a
  writer's index may be deleted, or rebuilt (journal listed first, then the
  objects);
- **GCs**, each on its own index: choose candidates (present, reached by no
  published version and no tombstone younger than the grace period, written
  at least the grace period ago) -> store a fenced entry -> wait until every
  live session that does not list the entry in ``seen`` is gone (or abandon)
  -> mark again -> delete one object at a time -> mark the entry done
  (naming what it deleted) and delete expired tombstones.  A GC may crash
  (its entry stays fenced, its owner dead; an object being deleted is left
  DELETING in its index, and the next run on that index finishes it) or
  lapse (paused past the lease: others count it dead while it still runs);
- a **remover** (tombstone, then delete the commit record), a **reader** that
  opens a published version and reads it later (protected by the grace period
  alone), **lease readers** (below) and a **clock**.

**Read leases** (``Config.lease_readers``; docs/format.md 11.6,
:mod:`chunkstore.protocol.readleases`, ``read.reader._take_lease``).  A lease reader
picks a version its index lists (published, or removed since: the index may be
stale) -> stores its lease naming it -> checks that the version's commit record
still exists (if not: deletes the lease and reads nothing) -> reads (any time
later, after any removals and GCs) and closes, deleting the lease.  It may die
instead, while its lease is stored (crashed, or its heartbeat lapsed for a lease):
the lease then protects nothing.  A live lease is one stored and neither closed
nor dead.  In plain worlds each of a GC's two marks (step 4's choice of
candidates, step 7's) takes two steps, as ``_Run.confirm_unreachable`` orders them:
the walk of the published versions and young tombstones, then the listing of the
live leases (``mark_read``), whose versions' objects it reaches; the candidates (or
what is deleted) are what neither reached.  ``lease_mark_faults`` lets the GC's read
of a leased tree fail (a storage outage): the code as first written skipped that
lease (``lease_mark_skips_unreadable``: ``mark_read`` caught every
``ChunkStoreError``, ``BackendUnavailableError`` included) and this model found it
unsafe (below); the code now makes the safe choice and stops the run, deleting
nothing.  In pack worlds the listing of the
leases is part of the walk's step (so ``break_gc_lists_leases_before_walk`` changes
nothing there), and the reader follows moved records as any reader does.  Worlds
with lease readers are meant with no grace period, so that no tombstone protects
what only a lease should.

Why no interleaving deletes what a lease reader reads (the argument of
:mod:`chunkstore.protocol.readleases`, in the model's terms): take an object X of
version V that a GC deletes, and a reader of V that stored its lease at ``l`` and
found V's record at ``c > l``.  Step 7's walk did not reach V, so V's record was
gone by then (a version published by a session the GC waited for is published
before that walk, and a record once removed never returns); step 7's listing did
not find the lease, so ``l`` came after that listing, after the walk: the record
was gone at ``c``, and the reader read nothing.  Step 4's listing plays no part
(it only spares the run from fencing what step 7 keeps): listing the leases in
step 7 only, or before the walk in step 4 only, loses nothing here; listing them in
step 4 only (``break_gc_leases_first_mark_only``), or before the walk in step 7
(``break_gc_lists_leases_before_walk``, in both marks), loses a version published
during the run (after step 4's walk), opened and removed before step 7's walk (19
steps each).  A reader that checks before storing its lease
(``break_reader_checks_before_lease``) loses its version to a GC whose step 7 ran
between the two (11 steps).  The argument assumes step 7 reads every live lease's
tree; with ``lease_mark_skips_unreadable`` (the code as first written) a failed read (in both marks;
or in step 7's alone, for a version published during the run) drops the lease's
protection, and the run deletes what its reader reads (11 steps in the
``lease_faults`` world of tests/test_protocol_model.py).

A **pack world** (``Config.packed``; :mod:`chunkstore.maintenance.repack`, docs/format.md
3.6) adds repacking.  Chunks are members ``a``, ``b`` of pack objects, each
pack named by the members it holds (``P`` holds both; ``Qa`` only ``a``: the
pack a repack copying ``a`` writes, and the pack a save writing only ``a``
seals, are the same object).  Versions list member locations (``P.a``); a
**moved record** per pack says which of its members went to which new pack.
A save deduplicates a chunk against the pack its index lists it in (fenced
and claimed as any object), else packs it anew and writes the sealed pack as
any object.  A GC's run, in a pack world: mark (walk the versions'
locations, then resolve them through the moved records: a location reaches
the pack that holds the member now, an old pack only through members its
record does not cover), with ``find_moved`` (a still-stored pack with a
record is a candidate whatever its age; a record whose pack was gone at the
start and that nothing went through is to be deleted) -> if ``P`` is
present, has no record and at least half of it is garbage: store a save
session -> read the journal (and record ``seen``) -> copy the live members
(``P`` still there) -> write the new pack (put-if-absent; not when an active
entry names it) -> write ``P``'s moved record (put-if-absent; not when the
session lapsed) -> end the session; ``P`` joins the candidates -> fence (the
entry names the candidates and the packs of the moved records to delete: a
run with only records to delete stores one too) -> session wait -> second
mark (walk, adding to the first; then the records; of the records to delete,
only those it still finds unused stay) -> delete -> done -> delete those
moved records, in the deletion step, before the entry is marked done
(``_Run.fence_and_delete``; ``moved_delete_after_done``, what 23a1ab0 did,
deletes them after it, in ``_Run.clean_up``: unsafe with a sync).  An
abandoned or stopped run deletes no record.  Readers (and the invariant)
follow moved records of missing packs.  Abstracted away:
member offsets and lengths (a member is its name), records of more than one
hop (only ``P`` has members to spare), index claims, the index's choice of
location (the biggest pack it lists holding the chunk; a rebuilt index lists
every stored pack), ``removals``-driven planning (a run plans a repack whenever it can,
or with ``optional_repack`` may also not).  One step each: step 4's walk
and moved-record read; the second mark's moved-record read and its checks
of which packs are stored; the repack's journal read and ``seen`` update;
the lapse check and the record's write (as a commit's).

A **syncer** (``Config.sync``; :mod:`chunkstore.maintenance.sync` and
``synccopy``, docs/format.md 11.4) in a pack world is one more writer, ``S``,
whose save copies a version listing members at ``P`` from a source that
repacked them out of ``P`` into one new pack ``Q`` (``Qa`` for ``a``); the
source holds ``P``'s moved record, not ``P``.  It runs under a session as a
save does: store the session -> list and read the journal, record ``seen``
-> ``P`` asked about as a deduplication target (every active entry naming
it waited out; if its index lists ``P``, the members are reused there and
nothing more is copied) -> ``P``'s moved record, put-if-absent (an equal one
already there is relied on; another one fails the version) -> ``Q`` as any
object (fence wait, reuse when its index lists it, put-if-absent) -> the
record checked to be still there (else nothing is published) -> commit,
refused when the session lapsed, the version listing the members at ``P``
-> end the session.  A failed attempt may run again (``sync_attempts``),
finding what the last one left.  The stores start with ``P`` gone
(``pack_gone``) and maybe the record and ``Q`` already there (what an
earlier sync left), or the record without ``Q`` (``moved_pack_gone``); or
with ``P`` present, repacked by a GC into the record the sync copies.
The invariant covers the packs the sync reused or wrote as a save's, and
the record from its publish on (one deleted before the check fails the
version, not the store).  Abstracted away: more than one version or moved
pack per sync, the destination index's claims (its own index, as a writer's).

Why a GC never deletes a moved record a sync publishes through, with the
safe choice: take a record of ``P`` a GC deletes (named in its entry ``E``)
and a sync that publishes through it.  If the sync's session recorded ``E``
in ``seen``, the sync read ``E`` while it was fenced and waited it out before
it asked about ``P``; the record was deleted before ``E`` was marked done, so
the sync writes it anew.  Otherwise the GC waited until the sync's session
was gone (it published, or its session lapsed and it publishes nothing);
the second mark then walks the sync's version, goes through the record, and
keeps it.  With the code's choice the first case fails: a sync that reads
``E`` once it is done does not wait, relies on the record and can publish
before the clean-up deletes it.

Every step of every actor is one atomic transition.  :func:`explore` runs a
breadth-first search over canonical states (every interleaving, up to a
depth bound or to exhaustion) and checks after every transition that no
published version, no object a live save in progress has obtained (reused
or written), no version a reader opened within the grace period of its
removal, and no version a lease reader reads (lease stored, record found, neither
closed nor dead) references a missing object.  A violation comes back with the
shortest schedule that reaches it.

:class:`Protocol` holds the behaviours: the defaults are what the code does;
the ``break_*`` flags each break one rule, and the tests check that the
explorer finds the schedule that loses data.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple

OBJECT_NAMES = "xyzw"
MEMBER_NAMES = "abcd"

# writer phases
W_IDLE, W_LIST, W_READ, W_SEEN, W_OBJ, W_COMMIT, W_END, W_RB1, W_RB2 = range(9)
# gc phases (G_RESOLVE onwards: pack worlds only)
(G_IDLE, G_FENCE, G_WAIT, G_REMARK, G_DEL, G_RESOLVE, G_CLEAN, G_RP_SESSION, G_RP_JOURNAL,
 G_RP_COPY, G_RP_FIRST, G_RP_SECOND, G_RP_END) = range(13)
# gc phases of worlds with lease readers: the second half of step 4's and step 7's mark
G_MARK_REST, G_REMARK_REST = 13, 14
# lease reader phases: lease stored (record not yet checked); record checked, lease not
# yet stored (break_reader_checks_before_lease); open (both done: protected); closed or dead
LR_IDLE, LR_LEASED, LR_CHECKED, LR_OPEN, LR_DONE = range(5)
# journal entry states
FENCED, DONE, ABANDONED = "fenced", "done", "abandoned"


@dataclass(frozen=True)
class Protocol:
    """What each actor does.  Defaults: the protocol as implemented."""

    # --- where the protocol leaves room: the safe choices, as the code makes them ---------------
    #: A save waits for every active entry naming an object before writing it, not only
    #: the first (``VersionWriter._reusable``).  Unsafe with two GCs at once.
    wait_every_blocker: bool = True
    #: A GC that lapsed (paused past the lease, so others count it dead) deletes nothing
    #: more (``_Run.check_time``).
    gc_stops_when_lapsed: bool = True
    #: The next GC on an index finishes a killed GC's DELETING objects without a journal
    #: entry, a session wait or a mark.  The code does not: ``gc.finish_deletions`` hands
    #: them back to a whole run.
    finish_deletions_blindly: bool = False
    #: Pack worlds.  GC's mark follows a moved record whether or not the pack it leads to
    #: exists, and keeps that pack only through members versions list (the first
    #: repacking commit, 7e0f583).  Unsafe: a save may deduplicate a moved member against
    #: the old pack (``_pack_reusable`` fences and claims the old pack only) after a GC
    #: deleted the new pack as unreached; a GC then deletes the old pack too.  The code
    #: makes the safe choice (729afb4): the mark keeps the pack a record leads to while
    #: the pack it leaves is stored (``MarkSet._keep_targets``), and follows a record
    #: only while the pack it leads to is stored or the pack it leaves is not
    #: (``moved.resolve_location``).  (Its read-back of moved members before deleting
    #: the old pack adds nothing here: in the model a record is never damaged, and a
    #: missing new pack already keeps the old one.)
    mark_trusts_moved_records: bool = False
    #: Pack worlds.  A GC deletes the moved records its journal entry names after it marks
    #: the entry done (``_Run.clean_up`` in 23a1ab0), not while the entry is still fenced.
    #: Unsafe with a sync: the done entry names only the objects deleted, so a sync that
    #: stores its session and reads the journal in between (no session wait covers it, no
    #: fence stops it) relies on the record, checks that it is still there, publishes,
    #: and then the record goes.  The code makes the safe choice: the records are deleted
    #: in step 8, with the objects, before the entry is marked done
    #: (``_Run.fence_and_delete``).
    moved_delete_after_done: bool = False
    #: Worlds with lease readers.  GC's mark skips a read lease whose tree it fails to read,
    #: whatever the failure: ``mark.mark_read`` catches every ``ChunkStoreError`` of
    #: ``mark_tree``, ``BackendUnavailableError`` (a storage outage, a throttled GET on S3)
    #: included, and the run goes on to delete what that reader reads.  Meant for a lease
    #: naming a missing or corrupt tree (a crafted lease, a reader that lost its lease
    #: and reads a partly deleted version), where nothing is left to protect.  The safe
    #: choice: only an ``IntegrityError`` (missing or corrupt node) skips a lease; a failed
    #: read stops the run, which deletes nothing (as ``mark_removed`` does for a
    #: tombstone).  The code makes the safe choice since this model found the unsafe one
    #: (``mark.mark_read`` lets every other error through).
    lease_mark_skips_unreadable: bool = False

    # --- one rule broken at a time -------------------------------------------------------------
    #: GC does not wait for sessions before deleting.
    break_session_wait: bool = False
    #: A save reads the journal before it stores its session object.
    break_journal_before_session: bool = False
    #: A save lists fenced entries in ``seen`` but reuses their objects anyway.
    break_ignore_fence: bool = False
    #: A save writes an object named by a fenced entry without waiting for its GC.
    break_no_fence_wait: bool = False
    #: GC counts the grace period from write times only (ignores tombstones).
    break_grace_from_write_time: bool = False
    #: GC deletes first and writes its journal entry afterwards (no fence, no wait).
    break_delete_before_journal: bool = False
    #: GC deletes what it chose without marking again after the session wait.
    break_no_remark: bool = False
    #: A save whose session lapsed publishes anyway.
    break_publish_when_lapsed: bool = False
    #: Version removal deletes the commit record before storing the tombstone.
    break_record_before_tombstone: bool = False
    #: Index rebuild lists the objects before it lists the finished journal entries.
    break_rebuild_objects_first: bool = False

    # --- repacking (pack worlds), one rule broken at a time --------------------------------------
    #: The repack writes the moved record before its new pack (the record points at nothing
    #: until the pack is written, and at nothing for good if the GC dies in between).
    break_moved_before_new_pack: bool = False
    #: The second mark resolves members through the moved records the first mark read
    #: (before the fence and the session wait), not through ones read after its walk.
    break_stale_moved: bool = False
    #: A repacked pack is deleted after the session wait without the second mark.
    break_repack_no_remark: bool = False
    #: The repack writes its new pack and moved record without storing a save session.
    break_repack_without_session: bool = False
    #: The repack writes its new pack although an active journal entry it read names it.
    break_repack_ignores_fence: bool = False
    #: The repack writes the moved record although its session lapsed (a GC that fenced
    #: the new pack stopped waiting for it and may have deleted the pack).
    break_moved_when_lapsed: bool = False
    #: A moved record is deleted although its pack was still stored when the GC started.
    break_moved_delete_while_present: bool = False
    #: A moved record of a pack gone at the start is deleted although a live version
    #: (or young tombstone) lists a member it covers.
    break_moved_delete_reached: bool = False

    # --- sync (pack worlds with a syncer), one rule broken at a time ----------------------------
    #: GC deletes the unused moved records in its clean-up without naming their packs in
    #: its journal entry, so with no session wait and no second mark for them (before
    #: 23a1ab0), even when it has no object to delete.
    break_moved_delete_unfenced: bool = False
    #: The syncer writes or relies on ``P``'s moved record without waiting for an active
    #: entry it read that names ``P`` (it still waits for one naming the new pack).
    break_sync_ignores_fence: bool = False

    # --- read leases (docs/format.md 11.6), one rule broken at a time ---------------------------
    #: The reader checks that the version's commit record exists, then stores its lease.
    break_reader_checks_before_lease: bool = False
    #: GC lists the read leases in step 4's mark only, not in step 7's.
    break_gc_leases_first_mark_only: bool = False
    #: Within each mark, GC lists the read leases before it walks the live versions and
    #: tombstones (the code lists them last: ``confirm_unreachable``).
    break_gc_lists_leases_before_walk: bool = False

    def fixed(self) -> Protocol:
        """The six code behaviours above replaced by the safe ones."""
        return _replace(self, wait_every_blocker=True, gc_stops_when_lapsed=True,
                        finish_deletions_blindly=False, mark_trusts_moved_records=False,
                        moved_delete_after_done=False, lease_mark_skips_unreadable=False)

    def breaks(self) -> list[str]:
        return [f.name for f in fields(self)
                if f.name.startswith("break_") and getattr(self, f.name)]


def _replace(obj: Protocol, **changes: bool) -> Protocol:
    values = {f.name: getattr(obj, f.name) for f in fields(obj)}
    values.update(changes)
    return Protocol(**values)


@dataclass(frozen=True)
class Config:
    """The world's size: what each writer saves, how many of each event may happen."""

    #: Per writer, the objects (indexes into OBJECT_NAMES) each of its saves references.
    contents: tuple[tuple[int, ...], ...] = ((0,), (0, 1))
    saves_per_writer: int = 1
    gcs: int = 2
    gc_runs: int = 1
    #: Grace period in clock ticks; the clock stops at ``max_clock``.
    grace: int = 0
    max_clock: int = 0
    #: Objects of a version published (and indexed by every writer) at the start; None: empty store.
    initial_version: tuple[int, ...] | None = (0, 1)
    #: Objects present at the start that no version references (orphans), indexed by every writer.
    initial_orphans: tuple[int, ...] = ()
    removals: int = 1
    index_drops: int = 1
    rebuilds: int = 1
    writer_lapses: int = 1
    gc_lapses: int = 1
    gc_crashes: int = 1
    reader: bool = False
    #: Readers under read leases (docs/format.md 11.6), each reading one version it knows
    #: of (published, or removed since: its index may be stale).
    lease_readers: int = 0
    #: A lease reader may die (crash, or its heartbeat lapses for a lease): its lease then
    #: protects nothing, and the invariant no longer covers it.
    reader_deaths: bool = True
    #: Plain worlds with lease readers: a GC's read of the tree a live lease names may fail
    #: (a storage outage, a throttled request: ``BackendUnavailableError``).
    lease_mark_faults: bool = False
    max_depth: int | None = None
    #: A pack world: the chunks saves write are the members ``a``, ``b``, ... of packs
    #: (``contents``, ``initial_version`` and ``initial_moved`` then name members, not
    #: objects).  A pack object is named by the members it holds (a save packs what it
    #: writes, a repack what it copies, and the same members make the same pack): ``P``
    #: holds them all, ``Qa`` only ``a``.  The store starts with ``P`` present, indexed by
    #: every writer; ``initial_version`` lists members at ``P``.
    packed: bool = False
    members: int = 2
    #: Pack world: GCs repack a present pack that is at least half garbage.
    repack: bool = True
    #: Pack world: members of ``P`` a GC repacked before the start: their new pack is
    #: present (indexed by no writer) and ``P``'s moved record says where they went.
    initial_moved: tuple[int, ...] = ()
    #: Pack world: GC repack sessions may be killed (after the first of their two writes,
    #: or after both), from the ``gc_crashes`` budget.
    repack_crashes: bool = False
    #: Pack world: a run that could repack may also not (``gc --no-repack``, or its index
    #: planned since the last removal it counted: ``Index.repack_pending``).
    optional_repack: bool = False
    #: Pack world: a **syncer** (one more writer, named ``S``, after the others) syncs a
    #: version listing these members at ``P`` from a source that repacked them out of
    #: ``P`` into one new pack: it writes (or relies on) ``P``'s moved record and that
    #: pack, then publishes.  Empty: no syncer.
    sync: tuple[int, ...] = ()
    #: How many times the syncer may run, until its version is published: a sync whose
    #: session lapsed (killed, or paused past the lease), or that found the record gone,
    #: is run again and finds what the last one left (put-if-absent keeps it).
    sync_attempts: int = 1
    #: Pack world: ``P`` is gone at the start (deleted by a GC after a repack, or never in
    #: this store: a sync's destination); no writer's index lists it.
    pack_gone: bool = False
    #: Pack world: the new pack of ``initial_moved`` is gone at the start while ``P``'s moved
    #: record is still there (a GC killed after deleting the pack, before the record).
    moved_pack_gone: bool = False

    @property
    def objects(self) -> int:
        if self.packed:
            return (1 << self.members) - 1
        used = {o for c in self.contents for o in c} | set(self.initial_version or ()) \
            | set(self.initial_orphans)
        return max(used) + 1


class Writer(NamedTuple):
    phase: int
    pos: int  # object position in W_OBJ
    waited: bool  # waited for a fence entry for the current object
    believed: frozenset[int]  # its index: objects it believes stored (dedup targets)
    applied: frozenset[int]  # journal entries applied to its index
    fence: frozenset[tuple[int, frozenset[int]]]  # active entries (id, objects) it read
    obtained: frozenset[Any]  # objects (pack world: member locations) reused or written
    pending: tuple[int, ...]  # journal ids still to read / listing kept by a rebuild
    saves: int
    lapsed: bool
    written: frozenset[int] = frozenset()  # pack world: members this save packs anew


#: A pack world's chunk reference: (pack object, member), as a manifest lists it.
Ref = tuple[int, int]
#: A moved record: (the new pack, the members of the old pack it covers).
Moved = tuple[int, frozenset[int]]


class Gc(NamedTuple):
    phase: int
    entry: int  # journal id of the current run, -1 when none
    candidates: frozenset[int]
    start: int
    todo: tuple[int, ...]
    deleted: frozenset[int]
    deleting: frozenset[int]  # DELETING records in this GC's index (a killed run's)
    runs: int
    lapsed: bool
    # pack world only
    walked: frozenset[Ref] = frozenset()  # member locations marked (step 4, then step 7 too)
    gone: frozenset[int] = frozenset()  # packs with a moved record, absent at the start
    drop: frozenset[int] = frozenset()  # moved records the last mark found unused
    seen_moved: tuple[Moved | None, ...] = ()  # step 4's moved records (break_stale_moved)
    rp: tuple[int, frozenset[int]] | None = None  # repack: (new pack, live members of P)
    rp_blocked: bool = False  # the repack read an active entry naming its new pack
    rp_done: bool = False  # the repack wrote P's moved record
    # worlds with lease readers: what the first half of a mark (step 4's or 7's) reached
    reached: frozenset[int] = frozenset()


class Entry(NamedTuple):
    state: str
    objects: frozenset[int]
    alive: bool  # its GC counts as alive (not crashed, heartbeat within the lease)

    def active(self) -> bool:
        return self.state == FENCED and self.alive


class Session(NamedTuple):
    alive: bool
    seen: frozenset[int]


class State(NamedTuple):
    clock: int
    present: tuple[int, ...]  # write time per object, -1 when absent
    published: frozenset[int]  # version ids
    tombstones: frozenset[tuple[int, int]]  # (version, removed at)
    removed_at: frozenset[tuple[int, int]]  # (version, first removal step) for the reader
    removing: int  # version between the two removal steps, -1 when none
    sessions: tuple[Session | None, ...]
    journal: tuple[Entry, ...]
    writers: tuple[Writer, ...]
    gcs: tuple[Gc, ...]
    reader: tuple[int, int] | None  # (version, opened at); (-1, 0) once read
    budget: tuple[int, ...]  # removals, drops, rebuilds, wlapse, glapse, gcrash
    # pack world only (sessions then also hold one slot per GC, for its repack)
    moved: tuple[Moved | None, ...] = ()  # moved record per pack object
    vrefs: tuple[frozenset[Ref], ...] = ()  # per version id: the member locations it lists
    # per lease reader: (LR_* phase, the version it reads); a live lease in LR_LEASED, LR_OPEN
    leases: tuple[tuple[int, int], ...] = ()


def _fast_replace(cls: type) -> Any:
    """``cls._replace`` without the generality of ``namedtuple``'s (a map over every field,
    then a length check): the explorer calls it for nearly every transition, and it was
    a sixth of the exploring time.  The same tuples come out (all in C: a map of
    ``dict.pop`` over the fields)."""
    names = cls._fields  # type: ignore[attr-defined]
    new = tuple.__new__

    def _replace(self: tuple, **changes: object) -> tuple:  # type: ignore[type-arg]
        out = new(cls, map(changes.pop, names, self))  # each field: its change or itself
        if changes:
            raise TypeError(f"{cls.__name__} has no fields {sorted(changes)}")
        return out
    return _replace


for _cls in (Writer, Gc, Entry, Session, State):
    _cls._replace = _fast_replace(_cls)  # type: ignore[method-assign]


@dataclass
class Model:
    config: Config
    protocol: Protocol = field(default_factory=Protocol)

    def __post_init__(self) -> None:
        cfg = self.config
        # version 0: the initial one; 1 + w * saves + n: writer w's n-th save
        self.version_objects: dict[int, frozenset[int]] = {0: frozenset(cfg.initial_version or ())}
        for w, content in enumerate(cfg.contents):
            for n in range(cfg.saves_per_writer):
                self.version_objects[self.vid(w, n)] = frozenset(content)
        #: the syncer's writer slot (after the writers'), -1 when there is none
        self.syncer = len(cfg.contents) if cfg.sync else -1
        self.writer_count = len(cfg.contents) + bool(cfg.sync)
        self.versions = 1 + self.writer_count * cfg.saves_per_writer
        assert cfg.packed or not cfg.sync, "a syncer copies moved records: pack worlds only"
        if cfg.packed:
            # pack object o holds the members of the bits of o + 1; P (all of them) is last
            self.full = cfg.objects - 1
            self.holds = tuple(frozenset(m for m in range(cfg.members) if (o + 1) >> m & 1)
                               for o in range(cfg.objects))

    def vid(self, writer: int, n: int) -> int:
        return 1 + writer * self.config.saves_per_writer + n

    def version_name(self, vid: int) -> str:
        if vid == 0:
            return "v0"
        w, n = divmod(vid - 1, self.config.saves_per_writer)
        return "S.sync" if w == self.syncer else f"W{w}.save{n + 1}"

    def writer_name(self, i: int) -> str:
        return "S" if i == self.syncer else f"W{i}"

    def pack_of(self, members: frozenset[int]) -> int:
        """The pack object that holds exactly ``members`` (content addressing)."""
        return sum(1 << m for m in members) - 1

    def refs(self, s: State, v: int) -> frozenset[int] | frozenset[Ref]:
        """What version ``v`` lists: objects, or in a pack world member locations."""
        return s.vrefs[v] if self.config.packed else self.version_objects[v]

    # --- the start ---------------------------------------------------------------------------

    def initial(self) -> State:
        cfg = self.config
        gc = Gc(G_IDLE, -1, frozenset(), 0, (), frozenset(), frozenset(), 0, False)
        if cfg.packed:
            return self._initial_packed(gc)
        known = frozenset(cfg.initial_version or ()) | frozenset(cfg.initial_orphans)
        present = tuple(0 if o in known else -1 for o in range(cfg.objects))
        writer = Writer(W_IDLE, 0, False, known, frozenset(), frozenset(), frozenset(), (), 0,
                        False)
        return State(
            clock=0, present=present,
            published=frozenset({0}) if cfg.initial_version is not None else frozenset(),
            tombstones=frozenset(), removed_at=frozenset(), removing=-1,
            sessions=(None,) * len(cfg.contents), journal=(),
            writers=(writer,) * len(cfg.contents), gcs=(gc,) * cfg.gcs, reader=None,
            budget=(cfg.removals, cfg.index_drops, cfg.rebuilds, cfg.writer_lapses,
                    cfg.gc_lapses, cfg.gc_crashes),
            leases=((LR_IDLE, -1),) * cfg.lease_readers)

    def _initial_packed(self, gc: Gc) -> State:
        cfg = self.config
        big = self.full
        present = [-1] * cfg.objects
        present[big] = -1 if cfg.pack_gone else 0
        moved: list[Moved | None] = [None] * cfg.objects
        if cfg.initial_moved:
            covered = frozenset(cfg.initial_moved)
            present[self.pack_of(covered)] = -1 if cfg.moved_pack_gone else 0
            moved[big] = (self.pack_of(covered), covered)
        vrefs = [frozenset[Ref]()] * self.versions
        vrefs[0] = frozenset((big, m) for m in cfg.initial_version or ())
        writer = Writer(W_IDLE, 0, False, frozenset() if cfg.pack_gone else frozenset({big}),
                        frozenset(), frozenset(), frozenset(), (), 0, False)
        return State(
            clock=0, present=tuple(present),
            published=frozenset({0}) if cfg.initial_version is not None else frozenset(),
            tombstones=frozenset(), removed_at=frozenset(), removing=-1,
            sessions=(None,) * (self.writer_count + cfg.gcs), journal=(),
            writers=(writer,) * self.writer_count, gcs=(gc,) * cfg.gcs, reader=None,
            budget=(cfg.removals, cfg.index_drops, cfg.rebuilds, cfg.writer_lapses,
                    cfg.gc_lapses, cfg.gc_crashes),
            moved=tuple(moved), vrefs=tuple(vrefs), leases=((LR_IDLE, -1),) * cfg.lease_readers)

    # --- the invariant -----------------------------------------------------------------------

    def violation(self, s: State) -> str | None:
        for v in s.published:
            missing = self._unreadable(s, self.refs(s, v))
            if missing:
                return f"published version {self.version_name(v)} references deleted " \
                       f"{self._names(missing)}"
        for w, (writer, session) in enumerate(zip(s.writers, s.sessions, strict=False)):
            if session is None or not session.alive or writer.lapsed:
                continue
            missing = self._unreadable(s, writer.obtained)
            if missing:
                return f"save in progress on {self.writer_name(w)} obtained" \
                       f" {self._names(missing)}, now deleted"
        if s.reader is not None and s.reader[0] >= 0:
            v, _ = s.reader
            removed = [t for vv, t in s.removed_at if vv == v]
            if v in s.published or (removed and s.clock < removed[0] + self.config.grace):
                missing = self._unreadable(s, self.refs(s, v))
                if missing:
                    return f"reader of {self.version_name(v)} (within the grace period)" \
                           f" finds {self._names(missing)} deleted"
        for r, (phase, v) in enumerate(s.leases):
            if phase == LR_OPEN:
                missing = self._unreadable(s, self.refs(s, v))
                if missing:
                    return f"lease reader R{r} of {self.version_name(v)} (checked, not closed)" \
                           f" finds {self._names(missing)} deleted"
        return None

    def _unreadable(self, s: State, refs: frozenset) -> list:  # type: ignore[type-arg]
        if not self.config.packed:
            return [o for o in refs if s.present[o] < 0]
        return [r for r in refs if not self._readable(s, r)]

    def _readable(self, s: State, ref: Ref) -> bool:
        """A reader's view (docs/format.md 3.6): the listed pack if present, else where its
        moved record says, if it lists the member."""
        pack, member = ref
        for _ in range(len(s.present)):
            if s.present[pack] >= 0:
                return True
            record = s.moved[pack]
            if record is None or member not in record[1]:
                return False
            pack = record[0]
        return False

    def obj_name(self, o: int) -> str:
        if not self.config.packed:
            return OBJECT_NAMES[o]
        if o == self.full:
            return "P"
        return "Q" + "".join(MEMBER_NAMES[m] for m in sorted(self.holds[o]))

    def _names(self, items: object) -> str:
        """Objects, or in a pack world also member locations ``P.a``."""
        return ",".join(self.obj_name(i) if isinstance(i, int)
                        else f"{self.obj_name(i[0])}.{MEMBER_NAMES[i[1]]}"
                        for i in sorted(items))  # type: ignore[call-overload]

    # --- helpers -------------------------------------------------------------------------------

    def _wait_out(self, s: State, i: int, w: Writer, name: str, o: int,
                  blocker: tuple[int, frozenset[int]], out: list[tuple[str, State]]) -> None:
        """A writer waits for the fence entry ``blocker`` naming object ``o``: once the
        entry is finished, it forgets the entry's objects and goes on."""
        e, named = blocker
        if not s.journal[e].active():
            nw = w._replace(fence=w.fence - {(e, named)}, believed=w.believed - named,
                            applied=w.applied | {e}, waited=True)
            out.append((f"{name}: waited out entry {e} for {self.obj_name(o)}",
                        self._with_writer(s, i, nw)))

    def _roots(self, s: State, start: int) -> set[int]:
        """The versions a mark starts from: published ones, young tombstones."""
        roots = set(s.published)
        if not self.protocol.break_grace_from_write_time:
            roots |= {v for v, t in s.tombstones if t > start - self.config.grace}
        return roots

    def _reached(self, s: State, start: int) -> frozenset[int]:
        """What a mark from the store reaches."""
        reached: set[int] = set()
        for v in self._roots(s, start):
            reached |= self.version_objects[v]
        return frozenset(reached)

    def _leased(self, s: State) -> frozenset[Any]:
        """What the trees of the roots live read leases name reach (``mark_read``): objects,
        or in a pack world member locations (resolved with the walk's)."""
        found: set[Any] = set()
        for phase, v in s.leases:
            if phase in (LR_LEASED, LR_OPEN):
                found |= self.refs(s, v)
        return frozenset(found)

    def _lease_label(self, s: State) -> str:
        roots = sorted({v for phase, v in s.leases if phase in (LR_LEASED, LR_OPEN)})
        return ",".join(self.version_name(v) for v in roots) or "none live"

    def _walk(self, s: State, start: int) -> frozenset[Ref]:
        """Pack world: the member locations the manifests of the roots list (the walk of
        ``mark_live``/``mark_removed``; ``MarkSet.add_members``)."""
        walked: set[Ref] = set()
        for v in self._roots(s, start):
            walked |= s.vrefs[v]
        return frozenset(walked)

    def _path(self, s: State, moved: tuple[Moved | None, ...], ref: Ref) -> list[int]:
        """``MarkSet._resolve_member``: the packs a member location goes through, the last
        one holding it.  As the code at 7e0f583 does (``mark_trusts_moved_records``), a
        record is followed whether or not the packs exist; else as
        ``moved.resolve_location`` (729afb4) does, only while the pack it leads to is
        stored or the pack it leaves is not."""
        pack, member = ref
        path = [pack]
        trust = self.protocol.mark_trusts_moved_records
        for _ in range(len(moved)):
            record = moved[pack]
            if record is None or member not in record[1]:
                break
            if not trust and s.present[record[0]] < 0 and s.present[pack] >= 0:
                break
            pack = record[0]
            path.append(pack)
        return path

    def _held(self, s: State, walked: frozenset[Ref],
              moved: tuple[Moved | None, ...]) -> frozenset[int]:
        """Packs the mark reaches: each holding a walked member (``MarkSet.__contains__``);
        unless ``mark_trusts_moved_records``, also the pack each moved record of a stored
        pack leads to (``MarkSet._keep_targets``, 729afb4)."""
        held = {self._path(s, moved, ref)[-1] for ref in walked}
        if not self.protocol.mark_trusts_moved_records:
            held |= {r[0] for o, r in enumerate(moved) if r is not None and s.present[o] >= 0}
        return frozenset(held)

    def _drop(self, s: State, gone: frozenset[int], walked: frozenset[Ref],
              moved: tuple[Moved | None, ...]) -> frozenset[int]:
        """Moved records of packs gone at the start that no walked member goes through
        (``MarkSet.record_used``): ``clean_up`` deletes them."""
        if self.protocol.break_moved_delete_reached:
            return gone
        used = {pack for ref in walked for pack in self._path(s, moved, ref)}
        return gone - used

    @staticmethod
    def _set(tup: tuple, i: int, value: object) -> tuple:  # type: ignore[type-arg]
        return (*tup[:i], value, *tup[i + 1:])

    def _with_writer(self, s: State, i: int, w: Writer, **kw: object) -> State:
        return s._replace(writers=self._set(s.writers, i, w), **kw)  # type: ignore[arg-type]

    def _with_gc(self, s: State, g: int, gc: Gc, **kw: object) -> State:
        return s._replace(gcs=self._set(s.gcs, g, gc), **kw)  # type: ignore[arg-type]

    @staticmethod
    def _budget(s: State, k: int) -> tuple[int, ...]:
        b = list(s.budget)
        b[k] -= 1
        return tuple(b)

    # --- transitions ---------------------------------------------------------------------------

    def successors(self, s: State) -> list[tuple[str, State]]:
        out: list[tuple[str, State]] = []
        for i in range(len(s.writers)):
            self._writer_steps(s, i, out)
        for g in range(len(s.gcs)):
            self._gc_steps(s, g, out)
        self._remover_steps(s, out)
        self._reader_steps(s, out)
        for r in range(len(s.leases)):
            self._lease_reader_steps(s, r, out)
        if s.clock < self.config.max_clock:
            out.append(("clock ticks", s._replace(clock=s.clock + 1)))
        return out

    def _writer_steps(self, s: State, i: int,  # noqa: C901, PLR0912
                      out: list[tuple[str, State]]) -> None:
        p, cfg = self.protocol, self.config
        w = s.writers[i]
        name = self.writer_name(i)
        content = cfg.sync if i == self.syncer else cfg.contents[i]
        session = s.sessions[i]
        if w.phase == W_IDLE:
            if self._may_save(s, i, w):
                nw = w._replace(phase=W_LIST, obtained=frozenset(), fence=frozenset(),
                                lapsed=False)
                if p.break_journal_before_session:
                    out.append((f"{name}: save starts (session not stored yet)",
                                self._with_writer(s, i, nw)))
                else:
                    out.append((f"{name}: stores its session", self._with_writer(
                        s, i, nw, sessions=self._set(s.sessions, i, Session(True, frozenset())))))
            if s.budget[1] > 0 and (w.believed or w.applied):
                out.append((f"{name}: its index is deleted", self._with_writer(
                    s, i, w._replace(believed=frozenset(), applied=frozenset()),
                    budget=self._budget(s, 1))))
            if s.budget[2] > 0:
                nw = w._replace(phase=W_RB1)
                if p.break_rebuild_objects_first:
                    nw = nw._replace(pending=self._present(s))
                    label = f"{name}: index rebuild lists objects {self._names(nw.pending)}"
                else:
                    finished = tuple(e for e, entry in enumerate(s.journal) if not entry.active())
                    nw = nw._replace(pending=finished)
                    label = f"{name}: index rebuild lists finished journal entries {finished}"
                out.append((label, self._with_writer(s, i, nw, budget=self._budget(s, 2))))
        elif w.phase == W_RB1:
            if p.break_rebuild_objects_first:
                done = frozenset(e for e, entry in enumerate(s.journal) if not entry.active())
                nw = w._replace(phase=W_IDLE, believed=frozenset(w.pending), applied=done,
                                pending=())
                label = f"{name}: index rebuild lists finished journal entries {sorted(done)}"
            else:
                listed = self._present(s)
                nw = w._replace(phase=W_IDLE, believed=frozenset(listed),
                                applied=frozenset(w.pending), pending=())
                label = f"{name}: index rebuild lists objects {self._names(listed)}"
            out.append((label, self._with_writer(s, i, nw)))
        elif w.phase == W_LIST:
            ids = tuple(e for e in range(len(s.journal)) if e not in w.applied)
            out.append((f"{name}: lists the journal {ids}", self._with_writer(
                s, i, w._replace(phase=W_READ if ids else W_SEEN, pending=ids))))
        elif w.phase == W_READ:
            e = w.pending[0]
            entry = s.journal[e]
            rest = w.pending[1:]
            nphase = W_READ if rest else W_SEEN
            if entry.active():
                nw = w._replace(phase=nphase, pending=rest,
                                fence=w.fence | {(e, entry.objects)})
                label = f"{name}: reads entry {e} (fenced: {self._names(entry.objects)})"
            else:
                nw = w._replace(phase=nphase, pending=rest, believed=w.believed - entry.objects,
                                applied=w.applied | {e})
                dead = "" if entry.alive else ", gc dead"
                label = f"{name}: reads entry {e} ({entry.state}{dead}" \
                        f": forgets {self._names(entry.objects) or 'nothing'})"
            out.append((label, self._with_writer(s, i, nw)))
        elif w.phase == W_SEEN:
            fenced = frozenset(e for e, _ in w.fence)
            nw = w._replace(phase=W_OBJ, pos=0, waited=False)
            if p.break_journal_before_session:
                out.append((f"{name}: stores its session (seen {sorted(fenced)})",
                            self._with_writer(s, i, nw, sessions=self._set(
                                s.sessions, i, Session(True, fenced)))))
            elif fenced:
                assert session is not None
                out.append((f"{name}: records seen {sorted(fenced)}", self._with_writer(
                    s, i, nw, sessions=self._set(s.sessions, i, session._replace(
                        seen=session.seen | fenced)))))
            else:
                out.append((f"{name}: starts on its objects", self._with_writer(s, i, nw)))
        elif w.phase == W_OBJ and i == self.syncer:
            self._sync_object_step(s, i, out)
        elif w.phase == W_OBJ and cfg.packed:
            self._packed_object_step(s, i, out)
        elif w.phase == W_OBJ:
            o = content[w.pos]
            blockers = [] if p.break_ignore_fence else \
                sorted((e, objs) for e, objs in w.fence if o in objs)
            done_obj = w.pos + 1 == len(content)
            after = dict(phase=W_COMMIT if done_obj else W_OBJ, pos=0 if done_obj else w.pos + 1,
                         waited=False)
            must_wait = blockers and not p.break_no_fence_wait and \
                (not w.waited or p.wait_every_blocker)
            if must_wait:
                self._wait_out(s, i, w, name, o, blockers[0], out)
                return
            if not blockers and not w.waited and o in w.believed:
                out.append((f"{name}: dedups {self.obj_name(o)} (its index lists it)",
                            self._with_writer(s, i, w._replace(
                                obtained=w.obtained | {o}, **after))))  # type: ignore[arg-type]
                return
            if s.present[o] >= 0:
                label = f"{name}: writes {self.obj_name(o)}: already there, reuses that copy"
                ns = s
            else:
                label = f"{name}: writes {self.obj_name(o)}"
                ns = s._replace(present=self._set(s.present, o, s.clock))
            out.append((label, self._with_writer(ns, i, w._replace(
                obtained=w.obtained | {o}, **after))))  # type: ignore[arg-type]
        elif w.phase == W_COMMIT:
            if w.lapsed and not p.break_publish_when_lapsed:
                out.append((f"{name}: session lapsed, refuses to publish", self._with_writer(
                    s, i, self._end(w), sessions=self._set(s.sessions, i, None))))
            elif cfg.packed:
                v = self.vid(i, 0 if i == self.syncer else w.saves)
                packs = frozenset(o for o, _ in w.obtained)
                # a sync lists the members where its source's manifests do: at P
                refs = frozenset((self.full, m) for m in content) if i == self.syncer \
                    else w.obtained
                out.append((f"{name}: publishes {self.version_name(v)}"
                             f" ({self._names(refs)})", self._with_writer(
                                 s, i, w._replace(phase=W_END, believed=w.believed | packs),
                                 published=s.published | {v},
                                 vrefs=self._set(s.vrefs, v, refs))))
            else:
                v = self.vid(i, w.saves)
                out.append((f"{name}: publishes {self.version_name(v)}", self._with_writer(
                    s, i, w._replace(phase=W_END, believed=w.believed | frozenset(content)),
                    published=s.published | {v})))
        elif w.phase == W_END:
            out.append((f"{name}: deletes its session", self._with_writer(
                s, i, self._end(w), sessions=self._set(s.sessions, i, None))))
        if session is not None and session.alive and w.phase not in (W_IDLE, W_END) \
                and s.budget[3] > 0:
            out.append((f"{name}: paused past the lease (counted dead)", self._with_writer(
                s, i, w._replace(lapsed=True), budget=self._budget(s, 3),
                sessions=self._set(s.sessions, i, session._replace(alive=False)))))

    def _may_save(self, s: State, i: int, w: Writer) -> bool:
        if i != self.syncer:
            return w.saves < self.config.saves_per_writer
        v = self.vid(i, 0)  # every attempt copies the same version
        return w.saves < self.config.sync_attempts and v not in s.published \
            and all(vv != v for vv, _ in s.removed_at)

    @staticmethod
    def _end(w: Writer) -> Writer:
        return w._replace(phase=W_IDLE, pos=0, waited=False, fence=frozenset(),
                          obtained=frozenset(), pending=(), saves=w.saves + 1, lapsed=False,
                          written=frozenset())

    def _packed_object_step(self, s: State, i: int,  # noqa: PLR0912
                            out: list[tuple[str, State]]) -> None:
        """A save in a pack world (``VersionWriter._store_small``, ``_write_pack``): per
        chunk, reuse it where its index lists it inside a pack (the pack claimed and
        fenced exactly as a dedup hit on any object: ``_pack_reusable``), else pack it
        anew; then seal the pack of the members packed anew and write it as any object
        (fence wait, reuse when the index lists it, put-if-absent)."""
        p, cfg = self.protocol, self.config
        w = s.writers[i]
        name = self.writer_name(i)
        content = cfg.contents[i]
        if w.pos < len(content):
            c = content[w.pos]
            member = MEMBER_NAMES[c]
            targets = [o for o in w.believed if c in self.holds[o]]
            written, obtained = w.written, w.obtained
            if not targets:
                written = written | {c}
                label = f"{name}: no pack in its index holds {member}: packs it anew"
            else:
                # the location the index keeps for the chunk: in the biggest pack it knows
                o = max(targets, key=lambda t: (len(self.holds[t]), -t))
                blockers = [] if p.break_ignore_fence else \
                    sorted((e, objs) for e, objs in w.fence if o in objs)
                if blockers and not p.break_no_fence_wait and \
                        (not w.waited or p.wait_every_blocker):
                    e, named = blockers[0]
                    if not s.journal[e].active():
                        nw = w._replace(fence=w.fence - {(e, named)},
                                        believed=w.believed - named, applied=w.applied | {e},
                                        waited=True)
                        out.append((f"{name}: waited out entry {e} for {self.obj_name(o)}",
                                    self._with_writer(s, i, nw)))
                    return
                if blockers or w.waited:
                    written = written | {c}
                    label = f"{name}: may not reuse {self.obj_name(o)} for {member}:" \
                            " packs it anew"
                else:
                    obtained = obtained | {(o, c)}
                    label = f"{name}: dedups {member} at {self.obj_name(o)}.{member}" \
                            f" (its index lists {self.obj_name(o)})"
            if w.pos + 1 < len(content):
                phase, pos = W_OBJ, w.pos + 1
            else:
                phase, pos = (W_OBJ, len(content)) if written else (W_COMMIT, 0)
            out.append((label, self._with_writer(s, i, w._replace(
                phase=phase, pos=pos, waited=False, written=written, obtained=obtained))))
            return
        o = self.pack_of(w.written)
        blockers = [] if p.break_ignore_fence else \
            sorted((e, objs) for e, objs in w.fence if o in objs)
        if blockers and not p.break_no_fence_wait and (not w.waited or p.wait_every_blocker):
            self._wait_out(s, i, w, name, o, blockers[0], out)
            return
        refs = frozenset((o, m) for m in w.written)
        nw = w._replace(phase=W_COMMIT, pos=0, waited=False, written=frozenset(),
                        obtained=w.obtained | refs)
        what = f"{name}: seals {self.obj_name(o)} ({self._names(refs)})"
        if not blockers and not w.waited and o in w.believed:
            out.append((f"{what}: its index lists it, nothing written",
                        self._with_writer(s, i, nw)))
        elif s.present[o] >= 0:
            out.append((f"{what}: already there, reuses that copy", self._with_writer(s, i, nw)))
        else:
            out.append((f"{what}, writes it", self._with_writer(
                s._replace(present=self._set(s.present, o, s.clock)), i, nw)))

    def _sync_object_step(self, s: State, i: int, out: list[tuple[str, State]]) -> None:
        """A sync's objects (``VersionCopy._copy_chunks``, ``_copy_moved``; docs/format.md
        11.4 step 3), for a pack ``P`` its source repacked: ``P`` is asked about as a
        deduplication target (every active entry naming it waited out, then reused if
        the index lists it); the source lacks it, so ``P``'s moved record is written
        (put-if-absent: an equal one is relied on, another one fails the version); then
        the new pack, asked about and written as any object; then the record is checked
        to be still there (``_copy_version``), else nothing is published."""
        p = self.protocol
        w = s.writers[i]
        name = self.writer_name(i)
        big = self.full
        members = frozenset(self.config.sync)
        new = self.pack_of(members)
        record = (new, members)
        end = self._with_writer(s, i, self._end(w), sessions=self._set(s.sessions, i, None))
        if w.pos == 2:
            if s.moved[big] != record:
                out.append((f"{name}: P's moved record vanished: nothing published", end))
            else:
                out.append((f"{name}: finds P's moved record still there", self._with_writer(
                    s, i, w._replace(phase=W_COMMIT, pos=0, waited=False))))
            return
        o = big if w.pos == 0 else new
        ignore = w.pos == 0 and p.break_sync_ignores_fence
        blockers = [] if ignore else sorted((e, objs) for e, objs in w.fence if o in objs)
        if blockers and (not w.waited or p.wait_every_blocker):
            self._wait_out(s, i, w, name, o, blockers[0], out)
            return
        if not blockers and not w.waited and o in w.believed:
            refs = frozenset((o, m) for m in members)
            nw = w._replace(phase=W_COMMIT if o == big else W_OBJ, pos=0 if o == big else 2,
                            waited=False, obtained=w.obtained | refs)
            out.append((f"{name}: dedups {self._names(refs)} (its index lists"
                        f" {self.obj_name(o)})", self._with_writer(s, i, nw)))
            return
        nw = w._replace(pos=w.pos + 1, waited=False)
        moving = f"{self._names({(big, m) for m in members})} -> {self.obj_name(new)}"
        if o == big and s.moved[big] is None:
            out.append((f"{name}: writes P's moved record ({moving})", self._with_writer(
                s, i, nw, moved=self._set(s.moved, big, record))))
        elif o == big and s.moved[big] == record:
            out.append((f"{name}: P's moved record ({moving}) already there, relies on it",
                        self._with_writer(s, i, nw)))
        elif o == big:
            out.append((f"{name}: P has another moved record: nothing published", end))
        else:
            nw = nw._replace(obtained=w.obtained | {(new, m) for m in members})
            if s.present[new] >= 0:
                out.append((f"{name}: writes {self.obj_name(new)}: already there, reuses that"
                            " copy", self._with_writer(s, i, nw)))
            else:
                out.append((f"{name}: writes {self.obj_name(new)}", self._with_writer(
                    s._replace(present=self._set(s.present, new, s.clock)), i, nw)))

    @staticmethod
    def _present(s: State) -> tuple[int, ...]:
        return tuple(o for o, t in enumerate(s.present) if t >= 0)

    def _finish_entry(self, s: State, gc: Gc, state: str) -> tuple[Entry, ...]:
        if gc.entry < 0:
            return s.journal
        old = s.journal[gc.entry]
        # the code: done names what was deleted; abandoned names it too unless the run
        # was interrupted after deleting something (then every candidate)
        objs = gc.deleted if state == DONE or not gc.deleted else old.objects
        return self._set(s.journal, gc.entry, old._replace(state=state, objects=objs))

    def _run_over(self, gc: Gc) -> Gc:
        """A run that ends normally: in a pack world its clean-up (moved records to delete)
        comes next, if any, and the run's own fields are reset."""
        if not self.config.packed:
            return gc._replace(phase=G_IDLE, runs=gc.runs + 1, entry=-1, todo=())
        if gc.drop:
            return gc._replace(phase=G_CLEAN, entry=-1, todo=())
        return self._run_killed(gc)

    def _run_killed(self, gc: Gc) -> Gc:
        """A run that stops (killed, or aborted: no clean-up)."""
        if not self.config.packed:
            return gc._replace(phase=G_IDLE, runs=gc.runs + 1, entry=-1, todo=())
        return Gc(G_IDLE, -1, frozenset(), 0, (), frozenset(), gc.deleting, gc.runs + 1, False)

    def _session_names(self, s: State, slots: list[int]) -> str:
        n = len(s.writers)
        return ",".join(self.writer_name(k) if k < n else f"GC{k - n}'s repack" for k in slots)

    def _gc_steps(self, s: State, g: int,  # noqa: C901, PLR0912
                  out: list[tuple[str, State]]) -> None:
        p, cfg = self.protocol, self.config
        gc = s.gcs[g]
        name = f"GC{g}"
        grace = cfg.grace
        if gc.phase == G_IDLE:
            if gc.runs >= cfg.gc_runs:
                return
            if gc.deleting and p.finish_deletions_blindly:
                present = tuple(-1 if o in gc.deleting else t for o, t in enumerate(s.present))
                out.append((f"{name}: finishes the killed run's deletion of"
                            f" {self._names(gc.deleting)}", self._with_gc(
                                s, g, gc._replace(deleting=frozenset()), present=present)))
                return
            if cfg.packed:
                self._packed_gc_start(s, g, out)
                return
            start = s.clock
            base = gc._replace(deleting=frozenset(), deleted=frozenset(), lapsed=False)
            if not cfg.lease_readers:
                self._choose(s, g, base, start, self._reached(s, start), f"{name}: ", out)
                return
            # step 4's mark in two halves: the walk, then the read leases
            for label, half in self._mark_part(s, start, step4=True, rest=False):
                nxt = base._replace(runs=gc.runs + 1) if half is None else \
                    base._replace(phase=G_MARK_REST, start=start, reached=half)
                out.append((f"{name}: marks: {label}", self._with_gc(s, g, nxt)))
        elif gc.phase == G_MARK_REST:
            for label, half in self._mark_part(s, gc.start, step4=True, rest=True):
                if half is None:
                    out.append((f"{name}: {label}", self._with_gc(s, g, gc._replace(
                        phase=G_IDLE, runs=gc.runs + 1, reached=frozenset()))))
                else:
                    self._choose(s, g, gc._replace(reached=frozenset()), gc.start,
                                 gc.reached | half, f"{name}: {label}, ", out)
        elif gc.phase == G_FENCE:
            e = len(s.journal)
            # 23a1ab0: the packs of the moved records to delete, as chunk objects
            named = gc.candidates if p.break_moved_delete_unfenced else gc.candidates | gc.drop
            out.append((f"{name}: stores fenced entry {e} ({self._names(named)})",
                        self._with_gc(s, g, gc._replace(phase=G_WAIT, entry=e),
                                      journal=(*s.journal, Entry(FENCED, named, True)))))
        elif gc.phase == G_WAIT:
            waiting = [w for w, sess in enumerate(s.sessions)
                       if sess is not None and sess.alive and gc.entry not in sess.seen]
            if not waiting or p.break_session_wait:
                out.append((f"{name}: no session to wait for"
                            + (f" (skips {self._session_names(s, waiting)})" if waiting else ""),
                            self._with_gc(s, g, gc._replace(phase=G_REMARK))))
            # an abandoned run deletes no moved record (before 23a1ab0 its clean-up did)
            over = gc if p.break_moved_delete_unfenced else gc._replace(drop=frozenset())
            out.append((f"{name}: gives up waiting, abandons entry {gc.entry}", self._with_gc(
                s, g, self._run_over(over), journal=self._finish_entry(s, gc, ABANDONED))))
        elif gc.phase == G_REMARK and cfg.packed and not p.break_no_remark:
            # read leases in the walk, atomically (break_gc_lists_leases_before_walk: no-op)
            leased = frozenset() if p.break_gc_leases_first_mark_only else self._leased(s)
            walked = gc.walked | self._walk(s, gc.start) | leased
            out.append((f"{name}: marks again: walks the versions"
                        f" ({self._names(walked) or 'nothing listed'})",
                        self._with_gc(s, g, gc._replace(phase=G_RESOLVE, walked=walked))))
        elif gc.phase in (G_REMARK, G_REMARK_REST) and cfg.lease_readers \
                and not p.break_no_remark:
            # step 7's mark in two halves: the walk, then the read leases
            rest = gc.phase == G_REMARK_REST
            for what, half in self._mark_part(s, gc.start, step4=False, rest=rest):
                label = f"{name}: {what}" if rest else f"{name}: marks again: {what}"
                if half is None:
                    out.append((label, self._with_gc(
                        s, g, self._run_over(gc._replace(reached=frozenset())),
                        journal=self._finish_entry(s, gc, ABANDONED))))
                elif rest:
                    todo = gc.candidates - (gc.reached | half)
                    out.append((f"{label}, will delete {self._names(todo) or 'nothing'}",
                                self._with_gc(s, g, gc._replace(
                                    phase=G_DEL, todo=tuple(sorted(todo)), reached=frozenset()))))
                else:
                    out.append((label, self._with_gc(s, g, gc._replace(
                        phase=G_REMARK_REST, reached=half))))
        elif gc.phase == G_REMARK:
            todo = gc.candidates if p.break_no_remark else \
                gc.candidates - self._reached(s, gc.start)
            out.append((f"{name}: marks again, will delete {self._names(todo) or 'nothing'}",
                        self._with_gc(s, g, gc._replace(phase=G_DEL, todo=tuple(sorted(todo))))))
        elif gc.phase == G_RESOLVE:
            moved = gc.seen_moved if p.break_stale_moved else s.moved
            todo = gc.candidates - self._held(s, gc.walked, moved)
            if p.break_repack_no_remark and gc.rp_done:
                todo |= gc.candidates & {self.full}
            drop = self._drop(s, gc.gone, gc.walked, moved)
            if not p.break_moved_delete_unfenced:  # only records its entry names
                drop &= gc.drop
            out.append((f"{name}: reads the moved records"
                        f"{' (those of its first mark)' if p.break_stale_moved else ''},"
                        f" will delete {self._names(todo) or 'nothing'}"
                        + (f", then the moved record of {self._names(drop)}" if drop else ""),
                        self._with_gc(s, g, gc._replace(phase=G_DEL, todo=tuple(sorted(todo)),
                                                        drop=drop))))
        elif gc.phase == G_DEL:
            if gc.lapsed and p.gc_stops_when_lapsed:
                out.append((f"{name}: finds its heartbeat lapsed, stops", self._with_gc(
                    s, g, self._run_killed(gc), journal=self._finish_entry(s, gc, ABANDONED))))
            elif gc.todo:
                o = gc.todo[0]
                out.append((f"{name}: deletes {self.obj_name(o)}", self._with_gc(
                    s, g, gc._replace(todo=gc.todo[1:], deleted=gc.deleted | {o}),
                    present=self._set(s.present, o, -1))))
            elif gc.drop and not p.moved_delete_after_done \
                    and not p.break_moved_delete_unfenced:
                moved = tuple(None if o in gc.drop else r for o, r in enumerate(s.moved))
                out.append((f"{name}: deletes the moved record of {self._names(gc.drop)}"
                            " (its entry still fenced)", self._with_gc(
                                s, g, gc._replace(drop=frozenset()), moved=moved)))
            else:
                journal = self._finish_entry(s, gc, DONE)
                if gc.entry < 0:  # deleted before writing the journal
                    journal = (*journal, Entry(DONE, gc.deleted, True))
                out.append((f"{name}: marks its entry done", self._with_gc(
                    s, g, self._run_over(gc), journal=journal,
                    tombstones=frozenset(x for x in s.tombstones if x[1] > gc.start - grace))))
        elif gc.phase == G_CLEAN:
            moved = tuple(None if o in gc.drop else r for o, r in enumerate(s.moved))
            out.append((f"{name}: deletes the moved record of {self._names(gc.drop)}",
                        self._with_gc(s, g, self._run_killed(gc), moved=moved)))
        elif gc.phase >= G_RP_SESSION:
            self._repack_steps(s, g, out)
        if gc.phase in (G_WAIT, G_REMARK, G_REMARK_REST, G_RESOLVE, G_DEL) and gc.entry >= 0 \
                and s.journal[gc.entry].alive:
            if s.budget[4] > 0 and not gc.lapsed:
                out.append((f"{name}: paused past the lease (counted dead, still running)",
                            self._with_gc(s, g, gc._replace(lapsed=True),
                                          budget=self._budget(s, 4),
                                          journal=self._dead(s.journal, gc.entry))))
            if s.budget[5] > 0:
                dead = self._run_killed(gc)
                out.append((f"{name}: killed", self._with_gc(
                    s, g, dead, budget=self._budget(s, 5),
                    journal=self._dead(s.journal, gc.entry))))
                if gc.phase == G_DEL and gc.todo:
                    o = gc.todo[0]
                    d = dead._replace(deleting=frozenset({o}))
                    out.append((f"{name}: killed while deleting {self.obj_name(o)} (object still"
                                " there, DELETING in its index)", self._with_gc(
                                    s, g, d, budget=self._budget(s, 5),
                                    journal=self._dead(s.journal, gc.entry))))
                    out.append((f"{name}: killed right after deleting {self.obj_name(o)}"
                                " (DELETING in its index)", self._with_gc(
                                    s, g, d, budget=self._budget(s, 5),
                                    journal=self._dead(s.journal, gc.entry),
                                    present=self._set(s.present, o, -1))))

    def _choose(self, s: State, g: int, gc: Gc, start: int, reached: frozenset[int],
                prefix: str, out: list[tuple[str, State]]) -> None:
        """The end of step 4: candidates are the objects stored at least the grace period
        that the mark did not reach; fence them (or delete at once, or end the run)."""
        grace = self.config.grace
        cands = frozenset(o for o, t in enumerate(s.present)
                          if t >= 0 and o not in reached and t <= start - grace)
        if not cands:
            out.append((f"{prefix}finds nothing to delete", self._with_gc(
                s, g, gc._replace(phase=G_IDLE, runs=gc.runs + 1),
                tombstones=frozenset(x for x in s.tombstones if x[1] > start - grace))))
        elif self.protocol.break_delete_before_journal:
            out.append((f"{prefix}chooses {self._names(cands)} and deletes at once",
                        self._with_gc(s, g, gc._replace(
                            phase=G_DEL, entry=-1, candidates=cands, start=start,
                            todo=tuple(sorted(cands))))))
        else:
            out.append((f"{prefix}chooses {self._names(cands)}", self._with_gc(
                s, g, gc._replace(phase=G_FENCE, candidates=cands, start=start))))

    def _mark_part(self, s: State, start: int, step4: bool,
                   rest: bool) -> list[tuple[str, frozenset[int] | None]]:
        """One half of a mark (``confirm_unreachable``, step 4's or step 7's) in a world with
        lease readers, each way it can go: (label, what it reaches), None when the run
        stops there.  The walk of the published versions and young tombstones comes first
        and the read leases last (``mark_read``), or the other way round with
        ``break_gc_lists_leases_before_walk``."""
        if self.protocol.break_gc_lists_leases_before_walk == rest:
            walked = self._reached(s, start)
            return [(f"walks the versions (reaches {self._names(walked) or 'nothing'})",
                     walked)]
        if not step4 and self.protocol.break_gc_leases_first_mark_only:
            return [("lists no read leases", frozenset())]
        leased = self._leased(s)
        ways: list[tuple[str, frozenset[int] | None]] = [
            (f"lists the read leases ({self._lease_label(s)}: reach"
             f" {self._names(leased) or 'nothing'})", leased)]
        if not self.config.lease_mark_faults:
            return ways
        roots = sorted({v for phase, v in s.leases if phase in (LR_LEASED, LR_OPEN)})
        for v in roots:
            what = f"lists the read leases: reading the tree of {self.version_name(v)}" \
                   " fails (storage unavailable)"
            if self.protocol.lease_mark_skips_unreadable:
                kept = frozenset().union(*(self.refs(s, u) for u in roots if u != v))
                ways.append((f"{what}, skips that lease (reach {self._names(kept) or 'nothing'})",
                             kept))
            else:
                ways.append((f"{what}: stops, deleting nothing", None))
        return ways

    def _packed_gc_start(self, s: State, g: int, out: list[tuple[str, State]]) -> None:
        """Steps 1-4 and the repack plan in a pack world, as one step (``_Run.run`` up to
        ``repack``): ``find_moved`` (packs with a moved record: still stored ones are
        candidates whatever their age, gone ones have records that may go), the mark
        (walk, then the moved records, resolved), and the plan: ``P`` present, with no
        moved record, at least half of its members listed by no live version."""
        p, cfg = self.protocol, self.config
        gc = s.gcs[g]
        name = f"GC{g}"
        start = s.clock
        # read leases in the walk, atomically (break_gc_lists_leases_before_walk: no-op)
        walked = self._walk(s, start) | self._leased(s)
        held = self._held(s, walked, s.moved)
        recorded = [o for o, r in enumerate(s.moved) if r is not None]
        forwarded = frozenset(o for o in recorded if s.present[o] >= 0)
        gone = frozenset(recorded) if p.break_moved_delete_while_present else \
            frozenset(o for o in recorded if s.present[o] < 0)
        cands = frozenset(o for o, t in enumerate(s.present) if t >= 0 and o not in held
                          and (t <= start - cfg.grace or o in forwarded))
        big = self.full
        rp = None
        if cfg.repack and s.present[big] >= 0 and big not in forwarded:
            live = frozenset(m for o, m in walked if o == big)
            if live and 2 * len(live) <= len(self.holds[big]):
                rp = (self.pack_of(live), live)
        drop = self._drop(s, gone, walked, s.moved)
        base = gc._replace(deleting=frozenset(), deleted=frozenset(), lapsed=False, start=start,
                           candidates=cands, todo=(), walked=walked, gone=gone, drop=drop,
                           seen_moved=s.moved if p.break_stale_moved else (), rp=rp,
                           rp_blocked=False, rp_done=False)
        what = f"{name}: marks ({self._names(walked) or 'nothing listed'}), candidates" \
               f" {self._names(cands) or 'none'}"
        fenced = bool(drop) and not p.break_moved_delete_unfenced
        if drop:
            what += f", {'fences' if fenced else 'will delete'} the moved record of" \
                    f" {self._names(drop)}"
        if rp is not None:
            moving = self._names({(big, m) for m in rp[1]})
            out.append((f"{what}; P is half garbage: repacks {moving} into"
                        f" {self.obj_name(rp[0])}",
                        self._with_gc(s, g, base._replace(phase=G_RP_SESSION))))
            if not cfg.optional_repack:
                return
            # ``gc --no-repack``, or an index that planned since the last removal
            # (``Index.repack_pending``): the same run without the repack
            base = base._replace(rp=None)
            what += " (not repacking)"
        if cands and p.break_delete_before_journal:
            out.append((f"{what}, deletes at once", self._with_gc(s, g, base._replace(
                phase=G_DEL, entry=-1, todo=tuple(sorted(cands))))))
        elif cands or fenced:
            out.append((what, self._with_gc(s, g, base._replace(phase=G_FENCE))))
        else:
            out.append((f"{what}: nothing to delete", self._with_gc(
                s, g, self._run_over(base),
                tombstones=frozenset(x for x in s.tombstones if x[1] > start - cfg.grace))))

    def _repack_steps(self, s: State, g: int,  # noqa: C901, PLR0912
                      out: list[tuple[str, State]]) -> None:
        """``repack.repack``: a save session, the journal, the copy, the new pack, the moved
        record (put-if-absent, unless the session lapsed), the session's end; the old pack
        then joins the run's candidates (fence, wait, second mark, delete)."""
        p, cfg = self.protocol, self.config
        gc = s.gcs[g]
        name = f"GC{g}"
        slot = len(s.writers) + g
        session = s.sessions[slot]
        big = self.full
        assert gc.rp is not None
        new, live = gc.rp
        new_name = self.obj_name(new)

        def write_pack(nxt: int) -> None:
            if s.present[new] >= 0:
                out.append((f"{name}: writes {new_name}: already there, reuses that copy",
                            self._with_gc(s, g, gc._replace(phase=nxt))))
            else:
                out.append((f"{name}: writes {new_name}", self._with_gc(
                    s, g, gc._replace(phase=nxt), present=self._set(s.present, new, s.clock))))

        def write_moved(nxt: int) -> None:
            if session is not None and not session.alive and not p.break_moved_when_lapsed:
                out.append((f"{name}: its repack session lapsed: not repacked",
                            self._with_gc(s, g, gc._replace(phase=G_RP_END))))
            elif s.moved[big] is not None:
                out.append((f"{name}: P already has a moved record: not repacked",
                            self._with_gc(s, g, gc._replace(phase=G_RP_END))))
            else:
                covered = self._names({(big, m) for m in live})
                out.append((f"{name}: writes P's moved record ({covered} -> {new_name})",
                            self._with_gc(s, g, gc._replace(phase=nxt, rp_done=True),
                                          moved=self._set(s.moved, big, (new, live)))))

        if gc.phase == G_RP_SESSION:
            if p.break_repack_without_session:
                out.append((f"{name}: repack starts (no session stored)",
                            self._with_gc(s, g, gc._replace(phase=G_RP_JOURNAL))))
            else:
                out.append((f"{name}: stores a save session for the repack", self._with_gc(
                    s, g, gc._replace(phase=G_RP_JOURNAL),
                    sessions=self._set(s.sessions, slot, Session(True, frozenset())))))
        elif gc.phase == G_RP_JOURNAL:
            active = frozenset(e for e, entry in enumerate(s.journal) if entry.active())
            blocking = sorted(e for e in active if new in s.journal[e].objects)
            label = f"{name}: repack reads the journal"
            kw: dict[str, object] = {}
            if active and session is not None:
                label += f", records seen {sorted(active)}"
                kw["sessions"] = self._set(s.sessions, slot,
                                           session._replace(seen=session.seen | active))
            if blocking:
                label += f" (entry {blocking[0]} names {new_name})"
            out.append((label, self._with_gc(s, g, gc._replace(
                phase=G_RP_COPY, rp_blocked=bool(blocking) and not p.break_repack_ignores_fence),
                **kw)))
        elif gc.phase == G_RP_COPY:
            if s.present[big] < 0:
                out.append((f"{name}: finds P deleted meanwhile: not repacked",
                            self._with_gc(s, g, gc._replace(phase=G_RP_END))))
            else:
                out.append((f"{name}: copies {self._names({(big, m) for m in live})}",
                            self._with_gc(s, g, gc._replace(phase=G_RP_FIRST))))
        elif gc.phase == G_RP_FIRST:
            if gc.rp_blocked:
                out.append((f"{name}: {new_name} is being deleted by another gc: not repacked",
                            self._with_gc(s, g, gc._replace(phase=G_RP_END))))
            elif p.break_moved_before_new_pack:
                write_moved(G_RP_SECOND)
            else:
                write_pack(G_RP_SECOND)
        elif gc.phase == G_RP_SECOND:
            if p.break_moved_before_new_pack:
                write_pack(G_RP_END)
            else:
                write_moved(G_RP_END)
        elif gc.phase == G_RP_END:
            cands = gc.candidates | ({big} if gc.rp_done else frozenset())
            ended = gc._replace(candidates=cands)
            label = f"{name}: ends the repack session" + \
                ("; P joins the candidates" if gc.rp_done else "")
            sessions = self._set(s.sessions, slot, None)
            if cands:
                out.append((label, self._with_gc(s, g, ended._replace(phase=G_FENCE),
                                                 sessions=sessions)))
            else:
                out.append((label, self._with_gc(
                    s, g, self._run_over(ended), sessions=sessions,
                    tombstones=frozenset(x for x in s.tombstones if x[1] > gc.start - cfg.grace))))
        if session is not None and session.alive and s.budget[4] > 0 \
                and gc.phase in (G_RP_JOURNAL, G_RP_COPY, G_RP_FIRST, G_RP_SECOND):
            out.append((f"{name}: paused past the lease in its repack (session counted dead)",
                        self._with_gc(s, g, gc, budget=self._budget(s, 4),
                                      sessions=self._set(s.sessions, slot,
                                                         session._replace(alive=False)))))
        if cfg.repack_crashes and s.budget[5] > 0 and gc.phase in (G_RP_SECOND, G_RP_END):
            out.append((f"{name}: killed in its repack (session counted dead)", self._with_gc(
                s, g, self._run_killed(gc), budget=self._budget(s, 5),
                sessions=self._set(s.sessions, slot, None))))

    def _dead(self, journal: tuple[Entry, ...], e: int) -> tuple[Entry, ...]:
        return self._set(journal, e, journal[e]._replace(alive=False))

    def _remover_steps(self, s: State, out: list[tuple[str, State]]) -> None:
        p = self.protocol
        if s.removing >= 0:
            v = s.removing
            if p.break_record_before_tombstone:
                out.append((f"remover: stores the tombstone of {self.version_name(v)}",
                            s._replace(removing=-1, tombstones=s.tombstones | {(v, s.clock)})))
            else:
                out.append((f"remover: deletes the record of {self.version_name(v)}",
                            s._replace(removing=-1, published=s.published - {v})))
            return
        if s.budget[0] <= 0:
            return
        for v in sorted(s.published):
            removed_at = s.removed_at | {(v, s.clock)}
            budget = self._budget(s, 0)
            if p.break_record_before_tombstone:
                out.append((f"remover: deletes the record of {self.version_name(v)}",
                            s._replace(removing=v, published=s.published - {v},
                                       removed_at=removed_at, budget=budget)))
            else:
                out.append((f"remover: stores the tombstone of {self.version_name(v)}",
                            s._replace(removing=v, tombstones=s.tombstones | {(v, s.clock)},
                                       removed_at=removed_at, budget=budget)))

    def _reader_steps(self, s: State, out: list[tuple[str, State]]) -> None:
        if not self.config.reader:
            return
        if s.reader is None:
            for v in sorted(s.published):
                out.append((f"reader: opens {self.version_name(v)}",
                            s._replace(reader=(v, s.clock))))
        elif s.reader[0] >= 0:
            out.append((f"reader: reads {self.version_name(s.reader[0])}",
                        s._replace(reader=(-1, 0))))

    def _lease_reader_steps(self, s: State, r: int, out: list[tuple[str, State]]) -> None:
        """A reader under a read lease (``read.reader._take_lease``, ``VersionReader``):
        store the lease, check the commit record (gone: delete the lease, read nothing),
        read, close; or die at any point, its lease then protecting nothing."""
        phase, v = s.leases[r]
        name = f"R{r}"

        def to(nphase: int, nv: int, label: str) -> None:
            out.append((f"{name}: {label}",
                        s._replace(leases=self._set(s.leases, r, (nphase, nv)))))

        checks_first = self.protocol.break_reader_checks_before_lease
        if phase == LR_IDLE:
            # a version its index lists: published, or removed since (a stale index)
            for vv in sorted(s.published | {x for x, _ in s.removed_at}):
                vname = self.version_name(vv)
                if not checks_first:
                    to(LR_LEASED, vv, f"stores its read lease on {vname}")
                elif vv in s.published:
                    to(LR_CHECKED, vv, f"finds the record of {vname} there (no lease yet)")
                else:
                    to(LR_DONE, vv, f"finds the record of {vname} gone, reads nothing")
        elif phase == LR_LEASED:
            if v in s.published:
                to(LR_OPEN, v, f"finds the record of {self.version_name(v)} still there")
            else:
                to(LR_DONE, v, f"finds the record of {self.version_name(v)} gone: deletes"
                               " its lease, reads nothing")
        elif phase == LR_CHECKED:
            to(LR_OPEN, v, f"stores its read lease on {self.version_name(v)}")
        elif phase == LR_OPEN:
            to(LR_DONE, v, f"reads {self.version_name(v)} and closes its lease")
        if self.config.reader_deaths and phase in (LR_LEASED, LR_OPEN):
            to(LR_DONE, v, "dies (its lease counts dead, protects nothing)")


@dataclass
class Result:
    states: int
    transitions: int
    depth: int
    seconds: float
    complete: bool  # the whole reachable space was explored (no depth cut)
    violation: str | None = None
    schedule: list[str] = field(default_factory=list)

    def report(self) -> str:
        head = (f"{self.states} states, {self.transitions} transitions, depth {self.depth}"
                f"{'' if self.complete else ' (bounded)'}, {self.seconds:.1f}s")
        if self.violation is None:
            return head + ": no violation"
        steps = "\n".join(f"  {n:2d}. {step}" for n, step in enumerate(self.schedule, 1))
        return f"{head}\nVIOLATION after {len(self.schedule)} steps: {self.violation}\n{steps}"


def explore(model: Model, max_depth: int | None = None,
            labels: set[str] | None = None) -> Result:
    """Breadth-first over every interleaving; stops at the first violation (shortest).

    With ``labels``, the label of every transition taken is added to it.  A model with a
    ``symmetric(state)`` method (states it maps to one key are the same world with
    interchangeable processes renamed) is explored one state per key: the first one
    found, whose path the schedule follows, so a schedule's names stay consistent."""
    start = time.perf_counter()
    key: Callable[[Any], Any] = getattr(model, "symmetric", _same)
    init = model.initial()
    parents: dict[Any, tuple[Any, str]] = {key(init): (None, "")}
    bad = model.violation(init)
    if bad:
        return Result(1, 0, 0, 0.0, True, bad, [])
    frontier = [init]
    depth = transitions = 0
    limit = max_depth if max_depth is not None else model.config.max_depth
    while frontier and (limit is None or depth < limit):
        depth += 1
        nxt: list[Any] = []
        for s in frontier:
            here = key(s)
            for label, t in model.successors(s):
                transitions += 1
                if labels is not None:
                    labels.add(label)
                there = key(t)
                known = len(parents)
                parents.setdefault(there, (here, label))  # one lookup: hashes aren't cached
                if len(parents) == known:
                    continue  # seen before
                bad = model.violation(t)
                if bad:
                    return Result(len(parents), transitions, depth,
                                  time.perf_counter() - start, False, bad,
                                  _schedule(parents, there))
                nxt.append(t)
        frontier = nxt
    return Result(len(parents), transitions, depth if frontier else depth - 1 if depth else 0,
                  time.perf_counter() - start, not frontier)


def _same(state: Any) -> Any:
    return state


def _schedule(parents: dict[Any, tuple[Any, str]], key: Any) -> list[str]:
    steps: list[str] = []
    cur = key
    while cur is not None:
        prev, label = parents[cur]
        if prev is not None:
            steps.append(label)
        cur = prev
    return steps[::-1]


__all__ = ["Config", "Model", "Protocol", "Result", "explore"]
