"""Drill records (docs/format.md §12): what one ``chunkstore drill`` found, kept in the
store under ``drills/<UTC time>-<random>`` so that ``report`` can say when a restore
was last shown to work, and how long it took.

A record is one canonical JSON object; readers skip a record they cannot parse or
whose ``format_version`` they do not know (a drill record is history, not data a
restore depends on).  Decoding is bounded: at most :data:`MAX_RECORD_BYTES`, no
``NaN``/``Infinity``, nesting only as deep as the JSON parser guards, every number of
the type and range the drill writes.
"""

from __future__ import annotations

import json
import math
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from chunkstore.format.plaindata import load_json

DRILL_FORMAT = "chunkstore.drill"
DRILL_FORMAT_VERSION = 1
#: The phases of a drill's recovery time, in the order they happen.
PHASES = ("startup", "discovery", "download", "validation", "materialization",
          "first_update")
#: The largest drill record a reader parses (one with every scenario is a few KiB).
MAX_RECORD_BYTES = 1 << 20


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
    """One drill: the restore of the live store, then the fault scenarios.

    ``target`` is the version the drill set out to restore (the newest, or the
    selector's); ``version`` what the restore got back, an earlier one when the
    target was refused (then ``ok`` is false: the restore fell back).  Records of
    earlier releases have no target (None).
    """

    time: float
    ok: bool  # the target restored, --then got ready, every scenario had its expected outcome
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
    target: str | None = None
    target_run: str | None = None
    target_step: int | None = None

    @property
    def target_failed(self) -> bool:
        """The target was refused (or another version came back in its place)."""
        return self.target is not None and (
            self.target in self.fell_back_from or (self.restored and self.version != self.target))

    @property
    def drilled_run(self) -> str | None:
        """The run the drill is about: the target's (the restored one's in old records)."""
        return self.target_run if self.target is not None else self.run

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
                "scenarios": [s.to_json() for s in self.scenarios], "target": self.target,
                "target_run": self.target_run, "target_step": self.target_step}

    def encode(self) -> bytes:
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> DrillRecord:
        """The record; ``ValueError`` when it is not one this release reads (too large,
        not JSON, nested too deep, a field of the wrong type or out of range)."""
        if len(data) > MAX_RECORD_BYTES:
            raise ValueError(f"a drill record of {len(data)} bytes (at most {MAX_RECORD_BYTES})")
        obj = load_json(data)
        if not isinstance(obj, dict) or obj.get("format") != DRILL_FORMAT:
            raise ValueError("not a drill record")
        if obj.get("format_version") != DRILL_FORMAT_VERSION:
            raise ValueError(f"drill record format version {obj.get('format_version')!r}")
        try:
            return cls(_number(obj["time"]), _flag(obj["ok"]), _flag(obj["restored"]),
                       _opt(obj.get("version"), str), _opt(obj.get("run"), str),
                       _opt(obj.get("step"), int), _opt(obj.get("selector"), str),
                       _number(obj["recovery_seconds"]),
                       {_text(k): _opt(v, float) for k, v in _mapping(obj["phases"]).items()},
                       _count(obj["bytes_downloaded"]), _text(obj["materialized_as"]),
                       tuple(map(_text, _sequence(obj.get("fell_back_from", [])))),
                       _opt(obj.get("error"), str),
                       tuple(map(_scenario, _sequence(obj.get("scenarios", [])))),
                       _opt(obj.get("target"), str), _opt(obj.get("target_run"), str),
                       _opt(obj.get("target_step"), int))
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise ValueError(f"malformed drill record: {exc}") from None


def _scenario(obj: object) -> ScenarioOutcome:
    s = _mapping(obj)
    return ScenarioOutcome(_text(s["name"]), _flag(s["ok"]), _text(s["outcome"]),
                           _text(s["detail"]), _number(s["seconds"]))


def _text(value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{type(value).__name__} where text belongs")
    return value


def _flag(value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{type(value).__name__} where true or false belongs")
    return value


def _number(value: object) -> float:
    """A finite number (an int or a float, never a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{type(value).__name__} where a number belongs")
    number = float(value)  # OverflowError past any float
    if not math.isfinite(number):
        raise ValueError(f"{value!r} is not a finite number")
    return number


def _integer(value: object) -> int:
    """An int as a step or a count is: exact, at most 64 bits."""
    if isinstance(value, bool) or not isinstance(value, int) or abs(value) >= 1 << 63:
        raise TypeError(f"{value!r} where a 64-bit integer belongs")
    return value


def _count(value: object) -> int:
    count = _integer(value)
    if count < 0:
        raise ValueError(f"a count of {count}")
    return count


def _mapping(value: object) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TypeError(f"{type(value).__name__} where an object belongs")
    return value


def _sequence(value: object) -> list[Any]:
    if not isinstance(value, list):
        raise TypeError(f"{type(value).__name__} where a list belongs")
    return value


_CHECK = {str: _text, int: _integer, float: _number}


def _opt(value: object, kind: type[Any]) -> Any:
    return None if value is None else _CHECK[kind](value)
