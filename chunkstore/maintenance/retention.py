"""Retention policies: which versions of a run to keep.

In the style of Orbax's preservation policies, policies compose by union: a
version is kept when any policy keeps it.  Tags pin versions.  Two safety
rules hold whatever the policies say: the newest version is always kept
(the caller keeps the newest one that *verifies*, see :func:`plan_prune`),
and at least ``min_previous`` older versions are kept behind it, so a
damaged newest checkpoint always has a known-good predecessor.

Everything here is pure: versions in, a decision out.  Applying it
(unpublishing the dropped versions) is :meth:`chunkstore.Store.prune`.
"""

from __future__ import annotations

import math
import re
import reprlib
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from chunkstore.errors import (
    HeldVersionWarning,
    InvalidSettingError,
    SelectorError,
    UnknownMetricError,
)
from chunkstore.maintenance.verify import verify
from chunkstore.protocol.holds import Hold

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|sec|m|min|h|d|w)?\s*$")
_UNIT_S = {None: 1, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(value: object) -> float:
    """Seconds from a number, a ``datetime.timedelta`` or text such as ``30m``, ``1h``, ``2d``."""
    seconds = getattr(value, "total_seconds", None)
    try:
        if callable(seconds):
            result = float(seconds())
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            result = float(value)
        elif isinstance(value, str) and (match := _DURATION.match(value.lower())):
            result = float(match.group(1)) * _UNIT_S[match.group(2)]
        else:
            examples = ("90 (seconds), 30m, 1h, 2d, 1w" if isinstance(value, str)
                        else "a number of seconds, a timedelta, or text such as '30m'")
            raise InvalidSettingError(f"{reprlib.repr(value)} is not a duration (examples:"
                                      f" {examples})")
    except OverflowError:  # an int past any float (10**400)
        result = math.inf
    if not math.isfinite(result) or result < 0:
        raise InvalidSettingError(f"duration {reprlib.repr(value)} must be finite and not"
                                  " negative")
    return result


@dataclass(frozen=True)
class Candidate:
    """What retention needs to know about one version."""

    id: str
    step: int
    created: float
    meta: dict[str, Any] = field(default_factory=dict)
    tags: tuple[str, ...] = ()


@dataclass(frozen=True)
class Policy:
    """The composable retention policies; ``None`` switches one off.

    ``keep_best`` is ``(metric, n)`` or ``(metric, n, "min" | "max")``
    (default ``"min"``, as for a loss); the metric is read from the
    version's metadata, either at the top level or under ``"metrics"``.
    """

    keep_last: int | None = None
    keep_every: int | None = None
    keep_within: float | None = None
    keep_best: tuple[Any, ...] | None = None
    min_previous: int = 1

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_every"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise InvalidSettingError(f"{name} must be a positive integer, got {value!r}")
        if self.keep_within is not None:
            object.__setattr__(self, "keep_within", parse_duration(self.keep_within))
        if self.keep_best is not None:
            self._check_best(self.keep_best)
        if isinstance(self.min_previous, bool) or not isinstance(self.min_previous, int) \
                or self.min_previous < 0:
            raise InvalidSettingError(f"min_previous must be 0 or more, got {self.min_previous!r}")

    @staticmethod
    def _check_best(best: tuple[Any, ...]) -> None:
        ok = (isinstance(best, tuple) and len(best) in (2, 3) and isinstance(best[0], str)
              and best[0] and isinstance(best[1], int) and not isinstance(best[1], bool)
              and best[1] >= 1 and (len(best) == 2 or best[2] in ("min", "max")))
        if not ok:
            raise InvalidSettingError(f"keep_best must be (metric, n) or (metric, n, 'min'|'max')"
                                      f" with n >= 1, got {best!r}")

    @property
    def empty(self) -> bool:
        return (self.keep_last, self.keep_every, self.keep_within, self.keep_best) == (
            None, None, None, None)


def _metric_sources(meta: dict[str, Any]) -> list[dict[str, Any]]:
    return [source for source in (meta, meta.get("metrics")) if isinstance(source, dict)]


def _numeric(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value)


def metric_of(meta: dict[str, Any], name: str) -> float | None:
    """The numeric metric ``name`` from a version's metadata, or None."""
    for source in _metric_sources(meta):
        if name in source and _numeric(source[name]):
            return float(source[name])
    return None


def recorded_metrics(metas: Sequence[dict[str, Any]]) -> list[str]:
    """Every name :func:`metric_of` finds a number for in any of ``metas``, sorted."""
    return sorted({name for meta in metas for source in _metric_sources(meta)
                   for name, value in source.items() if _numeric(value)})


def check_metric(metric: str, run: str, metas: Sequence[dict[str, Any]]) -> str | None:
    """Refuse a ``keep_best`` metric that none of a run's versions records; return a
    warning when only some record it (the rest cannot be ranked)."""
    carrying = sum(metric_of(meta, metric) is not None for meta in metas)
    if metas and not carrying:
        raise UnknownMetricError(metric, run, recorded_metrics(metas))
    if carrying < len(metas):
        return (f"only {carrying} of the {len(metas)} versions of run {run!r} record the"
                f" metric {metric!r}; keep-best ranks those, and the other"
                f" {len(metas) - carrying} are kept only if another rule keeps them")
    return None


@dataclass
class Decision:
    """For each version id, why it is kept; the rest are dropped."""

    keep: dict[str, list[str]] = field(default_factory=dict)
    drop: list[str] = field(default_factory=list)


def _safety_reasons(ordered: Sequence[Candidate], good: int, min_previous: int,
                    previous_good: Sequence[str] | None) -> dict[str, list[str]]:
    reasons: dict[str, list[str]] = {v.id: [] for v in ordered}
    for i, v in enumerate(ordered):
        if i > good:
            reasons[v.id].append("newer than the newest verified version")
        elif i == good:
            reasons[v.id].append("newest verified version")
        elif previous_good is not None:
            if v.id in previous_good:
                reasons[v.id].append("previous known-good version (verified)")
        elif i >= good - min_previous:
            reasons[v.id].append("previous known-good version")
        if v.tags:
            reasons[v.id].append("tagged " + ", ".join(v.tags))
    return reasons


def _best(ordered: Sequence[Candidate], best: tuple[Any, ...]) -> list[Candidate]:
    metric, n = best[0], best[1]
    descending = len(best) == 3 and best[2] == "max"
    scored = [(m, v) for v in ordered if (m := metric_of(v.meta, metric)) is not None]
    scored.sort(key=lambda mv: (-mv[0] if descending else mv[0], -mv[1].step))
    return [v for _, v in scored[:n]]


def decide(versions: Sequence[Candidate], policy: Policy, now: float,
           newest_good: str | None = None, previous_good: Sequence[str] | None = None
           ) -> Decision:
    """Apply ``policy`` to one run's versions (any order).

    ``newest_good`` is the id of the newest version that verifies (default:
    the newest); it and everything newer are always kept, and so are the
    older versions in ``previous_good`` (those found to verify) or, without
    that list, the ``policy.min_previous`` versions just before it.
    """
    ordered = sorted(versions, key=lambda v: (v.step, v.created, v.id))
    good = next((i for i, v in enumerate(ordered) if v.id == newest_good), len(ordered) - 1)
    reasons = _safety_reasons(ordered, good, policy.min_previous, previous_good)
    if policy.keep_last is not None:
        for v in ordered[-policy.keep_last:]:
            reasons[v.id].append(f"keep_last={policy.keep_last}")
    if policy.keep_every is not None:
        for v in ordered:
            if v.step % policy.keep_every == 0:
                reasons[v.id].append(f"keep_every={policy.keep_every}")
    if policy.keep_within is not None:
        for v in ordered:
            if v.created >= now - policy.keep_within:
                reasons[v.id].append(f"keep_within={policy.keep_within:g}s")
    if policy.keep_best is not None:
        for v in _best(ordered, policy.keep_best):
            reasons[v.id].append(f"keep_best={policy.keep_best[0]}")
    return Decision(keep={i: r for i, r in reasons.items() if r},
                    drop=[v.id for v in ordered if not reasons[v.id]])


def held_message(hold: Hold, what: str) -> str:
    """Why retention left a version: the hold, named with its reason."""
    return (f"{what}: version {hold.version_id[:12]} is under a legal hold and stays"
            f" ({hold.describe()}); `chunkstore release` it to let retention remove it")


def warn_held(holds: Sequence[Hold], what: str) -> None:
    """Warn (:class:`HeldVersionWarning`) once per version retention left for its hold."""
    for hold in holds:
        warnings.warn(HeldVersionWarning(held_message(hold, what)), stacklevel=3)


@dataclass
class PruneResult:
    """What :func:`prune` kept (with reasons) and removed, per run."""

    dry_run: bool
    kept: dict[str, list[str]] = field(default_factory=dict)
    removed: list[Any] = field(default_factory=list)  # VersionInfo
    unverified: list[str] = field(default_factory=list)  # newest versions that failed verify
    warnings: list[str] = field(default_factory=list)  # e.g. a metric only some versions record
    #: versions the policy would remove that are under a legal hold: left as they are
    held: list[Hold] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"dry_run": self.dry_run, "kept": self.kept,
                "removed": [v.to_json() for v in self.removed], "unverified": self.unverified,
                "warnings": self.warnings, "held": [h.to_json() for h in self.held]}


def prune(store: Any, policy: Policy, *, run: str | None = None, dry_run: bool = False,
          verify: bool = True, now: float | None = None) -> PruneResult:
    """Unpublish the versions ``policy`` does not keep, run by run.

    With ``verify`` the newest versions of each run are hash-checked, newest
    first, until one passes: that one and its predecessor are kept whatever
    the policy says.  The chunks of removed versions are freed by GC after
    its grace period.  A ``keep_best`` metric that no version of a run
    records raises :class:`UnknownMetricError` before anything is removed.
    """
    import time

    if policy.empty:
        raise InvalidSettingError("give at least one retention policy (keep_last, keep_every,"
                                  " keep_within, keep_best); refusing to prune with none")
    now = time.time() if now is None else now
    result = PruneResult(dry_run=dry_run)
    tags: dict[str, list[str]] = {}
    for tag, vid in {**store.tags(), **store.stored_tags()}.items():
        tags.setdefault(vid, []).append(tag)
    runs = [run] if run is not None else store.runs()
    infos_by_run = {name: store.versions(name) for name in runs}
    if policy.keep_best is not None:
        for name, infos in infos_by_run.items():
            warning = check_metric(policy.keep_best[0], name, [v.meta for v in infos])
            if warning is not None:
                result.warnings.append(warning)
    for infos in infos_by_run.values():
        newest_good, previous_good = None, None
        if verify:
            good = _verified_newest(store, infos, 1 + policy.min_previous, result.unverified)
            newest_good, previous_good = (good[0], good[1:]) if good else (None, None)
        candidates = [Candidate(v.id, v.step, v.created, v.meta, tuple(sorted(tags.get(v.id, []))))
                      for v in infos]
        decision = decide(candidates, policy, now, newest_good, previous_good)
        result.kept.update(decision.keep)
        by_id = {v.id: v for v in infos}
        dropped = [by_id[vid] for vid in decision.drop]
        # in bulk: a PUT per version and a few requests per thousand; held ones stay
        held = [h for h in store.holds().values() if h.version_id in by_id
                and h.version_id in decision.drop] if dry_run \
            else store.delete_listed_many(dropped, operation="prune")
        result.held.extend(held)
        result.warnings.extend(held_message(h, "prune") for h in held)
        held_ids = {h.version_id for h in held}
        result.removed.extend(v for v in dropped if v.id not in held_ids)
    return result


def _verified_newest(store: Any, infos: Sequence[Any], count: int, failed: list[str]
                     ) -> list[str]:
    """Ids of the newest ``count`` versions that pass a full verify, newest first."""
    good: list[str] = []
    for info in reversed(infos):
        if len(good) == count:
            break
        try:
            ok = verify(store, info.id).ok
        except SelectorError:  # removed since the listing (another index's prune): gone,
            continue           # neither a version to keep nor one that failed
        if ok:
            good.append(info.id)
        else:
            failed.append(info.id)
    return good
