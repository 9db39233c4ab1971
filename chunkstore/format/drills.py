"""Drill records (docs/format.md §12): what one ``chunkstore drill`` found, kept in the
store under ``drills/<UTC time>-<random>`` so that ``report`` can say when a restore
was last shown to work, and how long it took.

A record is one canonical JSON object; readers skip a record they cannot parse or
whose ``format_version`` they do not know (a drill record is history, not data a
restore depends on).
"""

from __future__ import annotations

import json
import math
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

DRILL_FORMAT = "chunkstore.drill"
DRILL_FORMAT_VERSION = 1
#: The phases of a drill's recovery time, in the order they happen.
PHASES = ("startup", "discovery", "download", "validation", "materialization",
          "first_update")


def new_drill_id(now: float | None = None) -> str:
    """``20250101T120000Z-1a2b3c4d``: sorts by time; the random part keeps two drills
    in the same second apart."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time() if now is None else now))
    return f"{stamp}-{secrets.token_hex(4)}"


@dataclass(frozen=True)
class ScenarioOutcome:
    """One fault drill: ``outcome`` is a stable word (fell-back, failed-typed,
    wrong-version, undetected, error), ``ok`` whether it is what the scenario expects."""

    name: str
    ok: bool
    outcome: str
    detail: str
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "ok": self.ok, "outcome": self.outcome,
                "detail": self.detail, "seconds": round(self.seconds, 4)}


@dataclass(frozen=True)
class DrillRecord:
    """One drill: the restore of the live store, then the fault scenarios."""

    time: float
    ok: bool  # the restore succeeded and every scenario had its expected outcome
    restored: bool  # the restore of the live store got a version back
    version: str | None
    run: str | None
    step: int | None
    selector: str | None
    recovery_seconds: float
    phases: dict[str, float | None]
    bytes_downloaded: int
    materialized_as: str
    fell_back_from: tuple[str, ...] = ()
    error: str | None = None
    scenarios: tuple[ScenarioOutcome, ...] = field(default=())

    def to_json(self) -> dict[str, Any]:
        return {"format": DRILL_FORMAT, "format_version": DRILL_FORMAT_VERSION,
                "time": self.time, "ok": self.ok, "restored": self.restored,
                "version": self.version, "run": self.run, "step": self.step,
                "selector": self.selector, "recovery_seconds": round(self.recovery_seconds, 4),
                "phases": {k: None if v is None else round(v, 4)
                           for k, v in self.phases.items()},
                "bytes_downloaded": self.bytes_downloaded,
                "materialized_as": self.materialized_as,
                "fell_back_from": list(self.fell_back_from), "error": self.error,
                "scenarios": [s.to_json() for s in self.scenarios]}

    def encode(self) -> bytes:
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> DrillRecord:
        """The record; ``ValueError`` when it is not one this release reads."""
        obj = json.loads(data)
        if not isinstance(obj, dict) or obj.get("format") != DRILL_FORMAT:
            raise ValueError("not a drill record")
        if obj.get("format_version") != DRILL_FORMAT_VERSION:
            raise ValueError(f"drill record format version {obj.get('format_version')!r}")
        try:
            scenarios = tuple(ScenarioOutcome(str(s["name"]), bool(s["ok"]), str(s["outcome"]),
                                              str(s["detail"]), float(s["seconds"]))
                              for s in obj.get("scenarios", ()))
            record = cls(float(obj["time"]), bool(obj["ok"]), bool(obj["restored"]),
                         _opt(obj.get("version"), str), _opt(obj.get("run"), str),
                         _opt(obj.get("step"), int), _opt(obj.get("selector"), str),
                         float(obj["recovery_seconds"]),
                         {str(k): _opt(v, float) for k, v in dict(obj["phases"]).items()},
                         int(obj["bytes_downloaded"]), str(obj["materialized_as"]),
                         tuple(map(str, obj.get("fell_back_from", ()))),
                         _opt(obj.get("error"), str), scenarios)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed drill record: {exc}") from None
        if not math.isfinite(record.time):
            raise ValueError("malformed drill record: time")
        return record


def _opt(value: Any, kind: type[Any]) -> Any:
    return None if value is None else kind(value)
