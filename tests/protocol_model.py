"""An abstract model of the store protocol of docs/format.md section 11, explored over
every interleaving by a small explicit-state checker.

Nothing here imports chunkstore: the model is the protocol of
:mod:`chunkstore.gc`, :mod:`chunkstore.writer`, :mod:`chunkstore.journal`,
:mod:`chunkstore.sessions` and :mod:`chunkstore.tombstones` reduced to what
decides whether an object is deleted while something needs it.

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
  opens a published version and reads it later, and a **clock**.

Every step of every actor is one atomic transition.  :func:`explore` runs a
breadth-first search over canonical states (every interleaving, up to a
depth bound or to exhaustion) and checks after every transition that no
published version, no object a live save in progress has obtained (reused
or written), and no version a reader opened within the grace period of its
removal references a missing object.  A violation comes back with the
shortest schedule that reaches it.

:class:`Protocol` holds the behaviours: the defaults are what the code does;
the ``break_*`` flags each break one rule, and the tests check that the
explorer finds the schedule that loses data.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from typing import NamedTuple

OBJECT_NAMES = "xyzw"

# writer phases
W_IDLE, W_LIST, W_READ, W_SEEN, W_OBJ, W_COMMIT, W_END, W_RB1, W_RB2 = range(9)
# gc phases
G_IDLE, G_FENCE, G_WAIT, G_REMARK, G_DEL = range(5)
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

    def fixed(self) -> Protocol:
        """The three code behaviours above replaced by the safe ones."""
        return _replace(self, wait_every_blocker=True, gc_stops_when_lapsed=True,
                        finish_deletions_blindly=False)

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
    max_depth: int | None = None

    @property
    def objects(self) -> int:
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
    obtained: frozenset[int]  # objects this save reused or wrote
    pending: tuple[int, ...]  # journal ids still to read / listing kept by a rebuild
    saves: int
    lapsed: bool


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

    def vid(self, writer: int, n: int) -> int:
        return 1 + writer * self.config.saves_per_writer + n

    def version_name(self, vid: int) -> str:
        if vid == 0:
            return "v0"
        w, n = divmod(vid - 1, self.config.saves_per_writer)
        return f"W{w}.save{n + 1}"

    # --- the start ---------------------------------------------------------------------------

    def initial(self) -> State:
        cfg = self.config
        known = frozenset(cfg.initial_version or ()) | frozenset(cfg.initial_orphans)
        present = tuple(0 if o in known else -1 for o in range(cfg.objects))
        writer = Writer(W_IDLE, 0, False, known, frozenset(), frozenset(), frozenset(), (), 0,
                        False)
        gc = Gc(G_IDLE, -1, frozenset(), 0, (), frozenset(), frozenset(), 0, False)
        return State(
            clock=0, present=present,
            published=frozenset({0}) if cfg.initial_version is not None else frozenset(),
            tombstones=frozenset(), removed_at=frozenset(), removing=-1,
            sessions=(None,) * len(cfg.contents), journal=(),
            writers=(writer,) * len(cfg.contents), gcs=(gc,) * cfg.gcs, reader=None,
            budget=(cfg.removals, cfg.index_drops, cfg.rebuilds, cfg.writer_lapses,
                    cfg.gc_lapses, cfg.gc_crashes))

    # --- the invariant -----------------------------------------------------------------------

    def violation(self, s: State) -> str | None:
        for v in s.published:
            missing = [o for o in self.version_objects[v] if s.present[o] < 0]
            if missing:
                return f"published version {self.version_name(v)} references deleted " \
                       f"{self._names(missing)}"
        for w, (writer, session) in enumerate(zip(s.writers, s.sessions, strict=True)):
            if session is None or not session.alive or writer.lapsed:
                continue
            missing = [o for o in writer.obtained if s.present[o] < 0]
            if missing:
                return f"save in progress on W{w} obtained {self._names(missing)}, now deleted"
        if s.reader is not None and s.reader[0] >= 0:
            v, _ = s.reader
            removed = [t for vv, t in s.removed_at if vv == v]
            if v in s.published or (removed and s.clock < removed[0] + self.config.grace):
                missing = [o for o in self.version_objects[v] if s.present[o] < 0]
                if missing:
                    return f"reader of {self.version_name(v)} (within the grace period)" \
                           f" finds {self._names(missing)} deleted"
        return None

    @staticmethod
    def _names(objs: object) -> str:
        return ",".join(OBJECT_NAMES[o] for o in sorted(objs))  # type: ignore[call-overload]

    # --- helpers -------------------------------------------------------------------------------

    def _reached(self, s: State, start: int) -> frozenset[int]:
        """What a mark from the store reaches: published versions, young tombstones."""
        roots = set(s.published)
        if not self.protocol.break_grace_from_write_time:
            roots |= {v for v, t in s.tombstones if t > start - self.config.grace}
        reached: set[int] = set()
        for v in roots:
            reached |= self.version_objects[v]
        return frozenset(reached)

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
        if s.clock < self.config.max_clock:
            out.append(("clock ticks", s._replace(clock=s.clock + 1)))
        return out

    def _writer_steps(self, s: State, i: int,  # noqa: C901, PLR0912
                      out: list[tuple[str, State]]) -> None:
        p, cfg = self.protocol, self.config
        w = s.writers[i]
        name = f"W{i}"
        content = cfg.contents[i]
        session = s.sessions[i]
        if w.phase == W_IDLE:
            if w.saves < cfg.saves_per_writer:
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
                        f": forgets {self._names(entry.objects)})"
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
                e, named = blockers[0]
                if not s.journal[e].active():
                    nw = w._replace(fence=w.fence - {(e, named)}, believed=w.believed - named,
                                    applied=w.applied | {e}, waited=True)
                    out.append((f"{name}: waited out entry {e} for {OBJECT_NAMES[o]}",
                                self._with_writer(s, i, nw)))
                return
            if not blockers and not w.waited and o in w.believed:
                out.append((f"{name}: dedups {OBJECT_NAMES[o]} (its index lists it)",
                            self._with_writer(s, i, w._replace(
                                obtained=w.obtained | {o}, **after))))  # type: ignore[arg-type]
                return
            if s.present[o] >= 0:
                label = f"{name}: writes {OBJECT_NAMES[o]}: already there, reuses that copy"
                ns = s
            else:
                label = f"{name}: writes {OBJECT_NAMES[o]}"
                ns = s._replace(present=self._set(s.present, o, s.clock))
            out.append((label, self._with_writer(ns, i, w._replace(
                obtained=w.obtained | {o}, **after))))  # type: ignore[arg-type]
        elif w.phase == W_COMMIT:
            if w.lapsed and not p.break_publish_when_lapsed:
                out.append((f"{name}: session lapsed, refuses to publish", self._with_writer(
                    s, i, self._end(w), sessions=self._set(s.sessions, i, None))))
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

    @staticmethod
    def _end(w: Writer) -> Writer:
        return w._replace(phase=W_IDLE, pos=0, waited=False, fence=frozenset(),
                          obtained=frozenset(), pending=(), saves=w.saves + 1, lapsed=False)

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
            start = s.clock
            reached = self._reached(s, start)
            cands = frozenset(o for o, t in enumerate(s.present)
                              if t >= 0 and o not in reached and t <= start - grace)
            base = gc._replace(deleting=frozenset(), deleted=frozenset(), lapsed=False)
            if not cands:
                out.append((f"{name}: finds nothing to delete", self._with_gc(
                    s, g, base._replace(runs=gc.runs + 1),
                    tombstones=frozenset(x for x in s.tombstones if x[1] > start - grace))))
            elif p.break_delete_before_journal:
                out.append((f"{name}: chooses {self._names(cands)} and deletes at once",
                            self._with_gc(s, g, base._replace(
                                phase=G_DEL, entry=-1, candidates=cands, start=start,
                                todo=tuple(sorted(cands))))))
            else:
                out.append((f"{name}: chooses {self._names(cands)}", self._with_gc(
                    s, g, base._replace(phase=G_FENCE, candidates=cands, start=start))))
        elif gc.phase == G_FENCE:
            e = len(s.journal)
            out.append((f"{name}: stores fenced entry {e} ({self._names(gc.candidates)})",
                        self._with_gc(s, g, gc._replace(phase=G_WAIT, entry=e),
                                      journal=(*s.journal, Entry(FENCED, gc.candidates, True)))))
        elif gc.phase == G_WAIT:
            waiting = [w for w, sess in enumerate(s.sessions)
                       if sess is not None and sess.alive and gc.entry not in sess.seen]
            if not waiting or p.break_session_wait:
                out.append((f"{name}: no session to wait for"
                            + (f" (skips W{waiting})" if waiting else ""),
                            self._with_gc(s, g, gc._replace(phase=G_REMARK))))
            out.append((f"{name}: gives up waiting, abandons entry {gc.entry}", self._with_gc(
                s, g, gc._replace(phase=G_IDLE, runs=gc.runs + 1, entry=-1),
                journal=self._finish_entry(s, gc, ABANDONED))))
        elif gc.phase == G_REMARK:
            todo = gc.candidates if p.break_no_remark else \
                gc.candidates - self._reached(s, gc.start)
            out.append((f"{name}: marks again, will delete {self._names(todo) or 'nothing'}",
                        self._with_gc(s, g, gc._replace(phase=G_DEL, todo=tuple(sorted(todo))))))
        elif gc.phase == G_DEL:
            if gc.lapsed and p.gc_stops_when_lapsed:
                out.append((f"{name}: finds its heartbeat lapsed, stops", self._with_gc(
                    s, g, gc._replace(phase=G_IDLE, runs=gc.runs + 1, entry=-1, todo=()),
                    journal=self._finish_entry(s, gc, ABANDONED))))
            elif gc.todo:
                o = gc.todo[0]
                out.append((f"{name}: deletes {OBJECT_NAMES[o]}", self._with_gc(
                    s, g, gc._replace(todo=gc.todo[1:], deleted=gc.deleted | {o}),
                    present=self._set(s.present, o, -1))))
            else:
                journal = self._finish_entry(s, gc, DONE)
                if gc.entry < 0:  # deleted before writing the journal
                    journal = (*journal, Entry(DONE, gc.deleted, True))
                out.append((f"{name}: marks its entry done", self._with_gc(
                    s, g, gc._replace(phase=G_IDLE, runs=gc.runs + 1, entry=-1, todo=()),
                    journal=journal,
                    tombstones=frozenset(x for x in s.tombstones if x[1] > gc.start - grace))))
        if gc.phase in (G_WAIT, G_REMARK, G_DEL) and gc.entry >= 0 and s.journal[gc.entry].alive:
            if s.budget[4] > 0 and not gc.lapsed:
                out.append((f"{name}: paused past the lease (counted dead, still running)",
                            self._with_gc(s, g, gc._replace(lapsed=True),
                                          budget=self._budget(s, 4),
                                          journal=self._dead(s.journal, gc.entry))))
            if s.budget[5] > 0:
                dead = gc._replace(phase=G_IDLE, runs=gc.runs + 1, entry=-1, todo=())
                out.append((f"{name}: killed", self._with_gc(
                    s, g, dead, budget=self._budget(s, 5),
                    journal=self._dead(s.journal, gc.entry))))
                if gc.phase == G_DEL and gc.todo:
                    o = gc.todo[0]
                    d = dead._replace(deleting=frozenset({o}))
                    out.append((f"{name}: killed while deleting {OBJECT_NAMES[o]} (object still"
                                " there, DELETING in its index)", self._with_gc(
                                    s, g, d, budget=self._budget(s, 5),
                                    journal=self._dead(s.journal, gc.entry))))
                    out.append((f"{name}: killed right after deleting {OBJECT_NAMES[o]}"
                                " (DELETING in its index)", self._with_gc(
                                    s, g, d, budget=self._budget(s, 5),
                                    journal=self._dead(s.journal, gc.entry),
                                    present=self._set(s.present, o, -1))))

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


def explore(model: Model, max_depth: int | None = None) -> Result:
    """Breadth-first over every interleaving; stops at the first violation (shortest)."""
    start = time.perf_counter()
    init = model.initial()
    parents: dict[State, tuple[State | None, str]] = {init: (None, "")}
    bad = model.violation(init)
    if bad:
        return Result(1, 0, 0, 0.0, True, bad, [])
    frontier = [init]
    depth = transitions = 0
    limit = max_depth if max_depth is not None else model.config.max_depth
    while frontier and (limit is None or depth < limit):
        depth += 1
        nxt: list[State] = []
        for s in frontier:
            for label, t in model.successors(s):
                transitions += 1
                if t in parents:
                    continue
                parents[t] = (s, label)
                bad = model.violation(t)
                if bad:
                    return Result(len(parents), transitions, depth,
                                  time.perf_counter() - start, False, bad, _schedule(parents, t))
                nxt.append(t)
        frontier = nxt
    return Result(len(parents), transitions, depth if frontier else depth - 1 if depth else 0,
                  time.perf_counter() - start, not frontier)


def _schedule(parents: dict[State, tuple[State | None, str]], s: State) -> list[str]:
    steps: list[str] = []
    cur: State | None = s
    while cur is not None:
        prev, label = parents[cur]
        if prev is not None:
            steps.append(label)
        cur = prev
    return steps[::-1]


__all__ = ["Config", "Model", "Protocol", "Result", "explore"]
