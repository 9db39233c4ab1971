"""Restoring from tiers: the newest version that reads back whole, from the nearest tier
that holds it (the local store first, else the mirror), and healing the local tier with
a copy of what was read from the mirror.

A damaged local copy falls back to the mirror's copy of the *same* version before any
older version is tried; a version removed meanwhile (retention of a save in flight) is
passed over.  Under a process group every rank reads the same tier
(:func:`ranks_tier`).
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import chunkstore
from chunkstore import Store, VersionInfo
from chunkstore.errors import IntegrityError, SelectorError, UntrustedVersionError
from chunkstore.objects.kinds import VERSIONS
from chunkstore.objects.signing import Trust
from torch_bridge.capture.layout import apply_states, load_states, read_sections, warn_unrestored
from torch_bridge.capture.rng import restore_rng
from torch_bridge.distributed.collectives import all_gather_plain
from torch_bridge.errors import RestoreFallbackWarning, caller_stacklevel, nothing_restored

#: A tier by name ("local", "mirror") and its store (None: there is none).
Tier = tuple[str, Store | None]


@dataclass(frozen=True)
class RestoreSource:
    """What :meth:`Checkpointer.restore` restored (``ckpt.last_restore``): ``tier`` is
    ``"local"`` (the Checkpointer's store) or ``"mirror"``, ``reason`` says why, and
    ``timings`` how long each phase took."""

    step: int
    version: str
    tier: str
    reason: str
    #: seconds per phase of the restore: ``discover`` (list and pick), ``read`` (read,
    #: hash-check and decode into the tensors; summed over versions tried), ``apply``
    #: (``load_state_dict`` and RNG states), ``refill`` (a copy into the local tier)
    timings: dict[str, float] = field(default_factory=dict)
    #: logical bytes of the version restored
    bytes: int = 0


class TierRestore:
    """One restore of ``run`` into ``stateful`` (``step``'s version, or the newest that
    loads), its phases timed into ``timings``."""

    def __init__(self, run: str, stateful: dict[str, Any], rng: bool, step: int | None,
                 timings: dict[str, float], trust: Trust | None = None) -> None:
        self.run, self.stateful, self.rng, self.step = run, stateful, rng, step
        self.timings = timings
        #: with ``require_signed``: the keys a version must be signed by to be restored
        self.trust = trust

    def run_over(self, tiers: list[Tier], refill: Callable[[VersionInfo], None],
                 has_local: Callable[[], bool]) -> RestoreSource | None:
        """Load from the nearest of ``tiers`` that holds the version whole; a version read
        from the mirror is then copied into the local tier with ``refill``."""
        failures: list[str] = []
        started = time.perf_counter()
        candidates = self.candidates(tiers)
        self.timings["discover"] = time.perf_counter() - started
        for info, holders in candidates:
            source = self._from_nearest(info, holders, failures, len(tiers) > 1, has_local)
            if source is None:
                continue
            if source.tier == "mirror":
                refilled = time.perf_counter()
                refill(info)
                self.timings["refill"] = time.perf_counter() - refilled
            if failures:
                warnings.warn(RestoreFallbackWarning.skipped(self.run, failures, info.step),
                              stacklevel=caller_stacklevel())
            return replace(source, timings=dict(self.timings), bytes=info.logical_bytes)
        if failures:
            raise nothing_restored(self.run, failures)
        return None

    def candidates(self, tiers: list[Tier]) -> list[tuple[VersionInfo, list[tuple[str, Store]]]]:
        """The run's versions in the tiers, newest first (only ``step``'s when given),
        each with the tiers that hold it, nearest first."""
        held: dict[str, tuple[VersionInfo, list[tuple[str, Store]]]] = {}
        for name, store in tiers:
            if store is None:
                continue
            for info in store.versions(self.run):
                held.setdefault(info.id, (info, []))[1].append((name, store))
        ordered = sorted(held.values(), key=lambda entry: (entry[0].step, entry[0].created))
        if self.step is not None:
            ordered = [entry for entry in ordered if entry[0].step == self.step][-1:]
            if not ordered:
                steps = sorted({info.step for info, _ in held.values()})
                where = " in either tier" if len(tiers) > 1 else ""
                raise SelectorError(f"{self.run}@{self.step}", f"run {self.run!r} has no"
                                    f" version at step {self.step}{where}; steps: {steps}")
        return ordered[::-1]

    def _from_nearest(self, info: VersionInfo, holders: list[tuple[str, Store]],
                      failures: list[str], named: bool, has_local: Callable[[], bool]
                      ) -> RestoreSource | None:
        """Load ``info`` from the nearest tier whose copy reads back whole; None when none
        does (each failure listed, with its tier when ``named``).  With ``step`` the last
        tier's failure is raised."""
        damaged = ""
        for tier, store in holders:
            last = tier == holders[-1][0]
            try:
                self.load(info, store)
            except SelectorError:
                if self.step is not None and last:
                    raise
                continue  # removed meanwhile (retention of a save in flight)
            except IntegrityError as exc:
                if self.step is not None and last:
                    raise
                where = f", {tier} tier" if named else ""
                failures.append(f"{info.short_id} (step {info.step}{where}): {exc}")
                damaged = f"its local copy is damaged ({exc})"
                continue
            if tier == "local":
                reason = "the local tier holds it whole"
            else:
                reason = damaged or ("the local tier does not hold it" if has_local()
                                     else "there is no local store")
            return RestoreSource(info.step, info.id, tier, reason)
        return None

    def load(self, info: VersionInfo, store: Store) -> None:
        """Read ``info`` from ``store`` into the objects (hash-checked), then apply it."""
        started = time.perf_counter()
        if self.trust is not None:  # skipped, as a damaged version is, unless trusted
            check = store.signature(info.id, self.trust)
            if not check.trusted:
                raise UntrustedVersionError(info.id, check.status, check.reason)
        targets = dict(self.stateful)
        if self.rng:
            targets["rng"] = {}
        with store.open_version(info.id) as reader:  # its read lease ends with the read
            sections = read_sections(reader)
            trees = load_states(reader, targets, sections)
        loaded = time.perf_counter()
        apply_states(targets, trees, {"rng": restore_rng})
        self.timings["read"] = self.timings.get("read", 0.0) + loaded - started
        self.timings["apply"] = time.perf_counter() - loaded
        warn_unrestored(reader.info, sections, targets, stacklevel=6)


def refill(mirror: Store, local: str | os.PathLike[str] | Store, run: str,
           info: VersionInfo) -> None:
    """Heal the local tier: a version read from the mirror is copied into it (created
    with the mirror's settings where there is none), or, where the local tier holds a
    damaged copy, what is missing or damaged there is rewritten from the mirror's
    checked bytes (``chunkstore repair``), so the next restore there is local and
    whole.  A failure warns; the restore itself succeeded."""
    try:
        if isinstance(local, Store) and local.objects.exists(VERSIONS, info.id):
            healed = chunkstore.repair(local, mirror, [info.id])
            trouble = None if healed.ok else (
                f"{len(healed.unfixed)} object(s) could not be rewritten"
                f" ({'; '.join(f'{f.kind} {f.digest[:12]}: {f.reason}' for f in healed.unfixed)})"
                if healed.unfixed else f"{len(healed.problems_after)} problem(s) remain")
        else:
            copied = chunkstore.sync(mirror, local, [info.id])
            trouble = None if copied.ok else "; ".join(
                [f.message for f in copied.failed]
                + [f"another version at step {c.step}" for c in copied.step_conflicts])
    except Exception as exc:
        trouble = str(exc)
    if trouble:
        warnings.warn(RuntimeWarning(
            f"run {run!r}: step {info.step} was restored from the mirror, but healing the"
            f" local tier with it failed: {trouble}; `chunkstore repair LOCAL --from"
            " MIRROR` retries it"), stacklevel=6)


def ranks_tier(local: Store | None, run: str, mirror: Callable[[], Store | None]
               ) -> tuple[Store | None, RestoreSource]:
    """Under a process group with a mirror: the local tier when every rank's holds a
    version of the run, else the mirror for every rank (a fresh node's ranks read the
    durable tier; ranks never read different tiers).  A collective."""
    holds = local is not None and bool(local.versions(run))
    if all(all_gather_plain(holds)):
        return local, RestoreSource(0, "", "local", "every rank's local tier holds the run")
    reason = ("a rank's local tier does not hold the run" if holds or local is not None
              else "there is no local store")
    return mirror(), RestoreSource(0, "", "mirror", reason)
