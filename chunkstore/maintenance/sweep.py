"""When a GC sweeps storage for orphans: objects no index record names, left by saves
that died (or by anything else that wrote behind every index's back).

Listing every chunk object and node costs a request per 1,000 objects on an object
store and seconds locally at 100,000 objects, so a GC sweeps only when it can find
something or is due (:func:`plan`):

1. **asked to** (``store.gc(sweep=True)``, ``chunkstore gc --sweep``); ``sweep=False``
   (``--no-sweep``) never sweeps;
2. **a save died** whose leftovers the sweep now covers: the GC lists ``sessions/``
   (one listing: the saves in progress and the dead ones not yet retired, below).  A
   session object whose owner is dead (docs/format.md §11) is remembered with the time
   this index's GC first saw it dead; everything its process wrote was stored before
   that time, so a sweep whose cutoff (its start less the grace period) is at or past
   it takes every one of those objects no version reaches.  That sweep, once complete,
   *retires* the session: deletes its object, which protects nothing (a GC does not
   wait for a dead session) and would otherwise stay for ever, and would ask for a
   sweep at every run.  The listing is made before the run's clock starts, so a GC
   with grace 0 sweeps up a save killed before it at once;
3. **on schedule**: when this index has no record of a complete sweep, or its last one
   began more than :data:`SWEEP_INTERVAL_S` ago (a day; ``CHUNKSTORE_SWEEP_INTERVAL``
   seconds).  What no session points at is collected this way: a save whose session
   object a power cut lost, a writer counted dead that wrote on after its lease lapsed
   (it publishes nothing: ``StoreSession.lapsed``), objects written by hand or by a
   release before sessions.  So an orphan goes at the latest at the first GC a day
   after it passed the grace period.

The record (:class:`SweepState`) is a small file beside this index
(``gc-sweep.json``): which sweep completed last, and which dead sessions were first
seen when.  It is a cache like the index: a lost, damaged or older copy (a deleted or
rebuilt index, a power cut, no fsync) only makes a sweep come sooner, and its times
come from completed sweeps only, so no copy of it makes one come later than the
schedule says.  A sweep is *complete* when the run ended without error and deferred
nothing (a run whose session wait expired deleted nothing: it is due again).

Why skipping a sweep never costs a live object: a sweep only adds candidates, and
every candidate, swept or not, goes through the journal fence, the session wait and
both marks of :mod:`chunkstore.maintenance.gc` before it is deleted; a run without one
deletes a subset of what the run with one would.  Retiring a dead session deletes
only an object no GC waits for: an owner that was only paused finds its lease lapsed
and publishes nothing, and its heartbeat stores the object again.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from chunkstore.errors import InvalidSettingError
from chunkstore.objects.kinds import SESSIONS
from chunkstore.protocol.sessions import list_sessions

if TYPE_CHECKING:
    from chunkstore.objects.objectstore import ObjectStore

log = logging.getLogger(__name__)

#: Environment variable that sets :data:`SWEEP_INTERVAL_S` (seconds).
SWEEP_INTERVAL_ENV_VAR = "CHUNKSTORE_SWEEP_INTERVAL"


def _interval(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise InvalidSettingError(f"{SWEEP_INTERVAL_ENV_VAR}={text!r}: expected a number of"
                                  " seconds, 0 or more")
    return value


#: A GC sweeps when this index's last complete sweep began longer ago than this.
SWEEP_INTERVAL_S = _interval(os.environ.get(SWEEP_INTERVAL_ENV_VAR, "86400"))
#: The record beside the index (see the module docstring).
STATE_FILE = "gc-sweep.json"


@dataclass
class SweepState:
    """This index's record: when its last complete sweep began, and when its GC first
    saw each dead session (GC clock, Unix seconds)."""

    last_sweep: float | None = None
    dead_since: dict[str, float] = field(default_factory=dict)

    @classmethod
    def load(cls, index_path: str) -> SweepState:
        """The record, or an empty one (a sweep is due) where it is missing or damaged."""
        try:
            with open(os.path.join(index_path, STATE_FILE), "rb") as file:
                data = json.loads(file.read(1 << 20))
            last = data.get("last_sweep")
            dead = data.get("dead_since", {})
            return cls(float(last) if _finite(last) else None,
                       {str(k): float(v) for k, v in dead.items() if _finite(v)})
        except (OSError, ValueError, AttributeError, TypeError):
            return cls()

    def save(self, index_path: str) -> None:
        """Store the record (temporary file, rename; no fsync: an older copy after a
        crash only brings a sweep forward).  A failure is logged, never raised: the
        run's own work is done, and the next run sweeps sooner."""
        path = os.path.join(index_path, STATE_FILE)
        body = json.dumps({"last_sweep": self.last_sweep, "dead_since": self.dead_since},
                          sort_keys=True).encode()
        try:
            with open(path + ".tmp", "wb") as file:
                file.write(body)
            os.replace(path + ".tmp", path)
        except OSError as exc:
            log.warning("could not record the orphan sweep beside the index (%s): the"
                        " next gc sweeps again", exc)
            with contextlib.suppress(OSError):
                os.unlink(path + ".tmp")


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value)


def dead_sessions(objects: ObjectStore, now: float) -> list[str]:
    """The session objects in the store whose owner is dead (one listing of
    ``sessions/``, a read of each)."""
    return [s.id for s in list_sessions(objects) if s.dead(now)]


@dataclass
class SweepPlan:
    """Whether this run sweeps, and why (what ``gc --json`` reports)."""

    run: bool
    reason: str
    #: dead sessions found, and those whose leftovers this run's cutoff covers
    dead: list[str]
    ready: list[str]
    #: when the next sweep is due: by the schedule, or sooner for a dead session
    next_due: float | None
    state: SweepState


def plan(state: SweepState, dead: list[str], requested: bool | None, started: float,
         grace_s: float, interval_s: float | None = None) -> SweepPlan:
    """Decide whether a GC that started at ``started`` with ``grace_s`` sweeps (rules
    1-3 of the module docstring); ``dead`` are the dead sessions just listed, first
    seen now unless ``state`` saw them before.  ``state`` is updated (sessions no
    longer stored forgotten, new ones remembered); the caller stores it."""
    interval_s = SWEEP_INTERVAL_S if interval_s is None else interval_s
    state.dead_since = {sid: min(state.dead_since.get(sid, started), started) for sid in dead}
    before = started - grace_s
    ready = sorted(sid for sid, since in state.dead_since.items() if since <= before)
    waiting = [since + grace_s for sid, since in state.dead_since.items() if since > before]
    if requested is False:
        run, reason = False, "turned off (--no-sweep)"
    elif requested:
        run, reason = True, "asked for (--sweep)"
    elif ready:
        run, reason = True, (f"{len(ready)} dead save session(s) whose leftovers are past"
                             " the grace period")
    elif state.last_sweep is None:
        run, reason = True, "no complete sweep recorded for this index"
    elif started - state.last_sweep >= interval_s:
        run, reason = True, (f"due: the last complete sweep began"
                             f" {(started - state.last_sweep) / 3600:.1f} h ago (every"
                             f" {interval_s / 3600:g} h)")
    else:
        run, reason = False, "not due"
    last = started if run else state.last_sweep
    due = [*waiting, last + interval_s] if last is not None else waiting
    return SweepPlan(run, reason, list(dead), ready if run else [],
                     min(due) if due else None, state)


def finish(objects: ObjectStore, index_path: str, sweep: SweepPlan, started: float,
           complete: bool) -> int:
    """After the run (not a dry run): record a complete sweep and retire the dead
    sessions it covered (delete their objects); store the record.  Returns how many
    sessions were retired."""
    state = sweep.state
    retired = 0
    if sweep.run and complete:
        state.last_sweep = started
        # Judged again now: an owner that was only paused and has stored its object
        # since is alive again, and keeps it.
        still_dead = set(dead_sessions(objects, time.time())) if sweep.ready else set()
        for sid in sweep.ready:
            if sid in still_dead:
                objects.discard(SESSIONS, sid)
                retired += 1
            state.dead_since.pop(sid, None)
    state.save(index_path)
    return retired


__all__ = ["STATE_FILE", "SWEEP_INTERVAL_ENV_VAR", "SWEEP_INTERVAL_S", "SweepPlan",
           "SweepState", "dead_sessions", "finish", "plan"]
