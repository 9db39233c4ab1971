"""What the stored drill records say, for ``report``: per run, its last successful drill,
and the newest drill that failed after it.

1. Every record under ``drills/`` is listed with its size; one larger than a drill
   writes is not read at all (a reader is bounded before it allocates).
2. Each is read and decoded (:meth:`DrillRecord.decode`, bounded in size, depth and
   every number).  A record that is gone by then was removed by hand: skipped.  One
   that cannot be read or decoded is skipped with a warning naming it: a drill record
   is history, and a crafted or damaged one must not stop ``report``.
3. A record belongs to the run its drill aimed at (its target's; the restored
   version's in records of earlier releases).  The newest record with ``ok`` is the
   run's last successful drill; records that failed after it are counted, and the
   newest is shown: a restore that fell back names the target it refused and what the
   fallback restored, and how long that took.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from chunkstore.errors import ChunkStoreError
from chunkstore.format.drills import MAX_RECORD_BYTES, DrillRecord
from chunkstore.objects.kinds import DRILLS

if TYPE_CHECKING:
    from chunkstore.handle.handle import StoreHandle

#: Room for what a transform of stored bytes adds (an encrypted store's nonce and tag).
_STORED_SLACK = 4096


@dataclass(frozen=True)
class DrillSummary:
    """A run's last successful drill: when (and how long ago), the version it restored
    and the recovery time."""

    run: str
    drill_id: str
    time: float
    age_s: float
    version: str
    step: int | None
    recovery_seconds: float
    scenarios: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"run": self.run, "drill_id": self.drill_id, "time": self.time,
                "age_s": round(self.age_s, 1), "version": self.version, "step": self.step,
                "recovery_seconds": self.recovery_seconds, "scenarios": list(self.scenarios)}


@dataclass(frozen=True)
class FailedDrill:
    """A run's newest drill that failed after its last successful one (``failures``:
    how many failed since).  ``restored``/``restored_step``: what the restore got back
    instead of the target (a fallback), None when nothing; ``recovery_seconds``: how
    long that took."""

    run: str
    drill_id: str
    time: float
    age_s: float
    failures: int
    target: str | None
    target_step: int | None
    target_failed: bool
    error: str | None
    restored: str | None
    restored_run: str | None
    restored_step: int | None
    recovery_seconds: float
    failed_scenarios: tuple[str, ...]

    @property
    def reason(self) -> str:
        """Why the drill failed, in a few words."""
        if self.target_failed:
            return f"target refused ({self.error})" if self.error else "target refused"
        if self.restored is None:
            return f"nothing restored ({self.error})" if self.error else "nothing restored"
        if self.failed_scenarios:
            return "scenario " + ", ".join(self.failed_scenarios)
        return "--then command not ready"

    def to_json(self) -> dict[str, Any]:
        return {"run": self.run, "drill_id": self.drill_id, "time": self.time,
                "age_s": round(self.age_s, 1), "failures": self.failures,
                "target": self.target, "target_step": self.target_step,
                "target_failed": self.target_failed, "reason": self.reason,
                "error": self.error, "restored": self.restored,
                "restored_run": self.restored_run, "restored_step": self.restored_step,
                "recovery_seconds": self.recovery_seconds,
                "failed_scenarios": list(self.failed_scenarios)}


@dataclass
class DrillHistory:
    """Per run (by name) its last successful drill and the newest failure after it;
    ``skipped``: a warning for each record that could not be read."""

    last_ok: list[DrillSummary] = field(default_factory=list)
    failed: list[FailedDrill] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


def read_drills(store: StoreHandle, skipped: list[str]) -> list[tuple[str, DrillRecord]]:
    """Every readable drill record (id, record), oldest first; a warning in ``skipped``
    for each record that is too large, unreadable or malformed (steps 1 and 2)."""
    found: list[tuple[str, DrillRecord]] = []
    for drill_id, info in sorted(store.objects.infos(DRILLS), key=lambda item: item[0]):
        if info.size > MAX_RECORD_BYTES + _STORED_SLACK:
            skipped.append(f"drill record drills/{drill_id} skipped: {info.size} bytes,"
                           f" more than a drill writes ({MAX_RECORD_BYTES})")
            continue
        try:
            record = DrillRecord.decode(store.objects.get(DRILLS, drill_id))
        except FileNotFoundError:
            continue
        except (ValueError, ChunkStoreError) as exc:
            skipped.append(f"drill record drills/{drill_id} skipped: {exc}")
            continue
        found.append((drill_id, record))
    found.sort(key=lambda item: (item[1].time, item[0]))
    return found


def _failure(run: str, drill_id: str, record: DrillRecord, now: float,
             failures: int) -> FailedDrill:
    return FailedDrill(run, drill_id, record.time, max(now - record.time, 0.0), failures,
                       record.target, record.target_step, record.target_failed, record.error,
                       record.version if record.restored else None, record.run, record.step,
                       record.recovery_seconds,
                       tuple(s.name for s in record.scenarios if not s.ok))


def drill_history(store: StoreHandle, now: float) -> DrillHistory:
    """Per run, its last successful drill and the newest failure since (step 3)."""
    history = DrillHistory()
    last_ok: dict[str, tuple[str, DrillRecord]] = {}
    failed: dict[str, list[tuple[str, DrillRecord]]] = {}
    for drill_id, record in read_drills(store, history.skipped):
        run = record.drilled_run
        if run is None:
            continue  # nothing restored and no target named: an earlier release's record
        if record.ok:
            last_ok[run] = (drill_id, record)
            failed.pop(run, None)  # failures before a success are history
        else:
            failed.setdefault(run, []).append((drill_id, record))
    for run, (drill_id, record) in sorted(last_ok.items()):
        history.last_ok.append(DrillSummary(
            run, drill_id, record.time, max(now - record.time, 0.0), record.version or "",
            record.step, record.recovery_seconds, tuple(s.name for s in record.scenarios)))
    for run, records in sorted(failed.items()):
        drill_id, record = records[-1]
        history.failed.append(_failure(run, drill_id, record, now, len(records)))
    return history
