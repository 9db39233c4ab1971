"""Removing published versions, one or a thousand at once (``rm``, ``prune``, a step
saved again with ``replace``).

A removal makes each step durable before the next, in batches of
:data:`~chunkstore.backends.base.DELETE_BATCH` versions:

0. the audit intent events (:mod:`chunkstore.protocol.audit`), one per batch, durable
   before any tag or record is deleted (with the tombstones' flush, or one of their
   own before step 1): a removal a crash cuts short at any later step is recorded;
1. the tags that pin a removed version (only with ``force``), storage first;
2. each version's tombstone (in parallel, made durable together): from it every GC
   counts the grace period of what the version reaches
   (:mod:`chunkstore.protocol.tombstones`), and a taker's walk rolls nothing forward
   (:mod:`chunkstore.protocol.runlease`); with it, durable together, each version's
   removal marker (:mod:`chunkstore.protocol.published`): other indexes count the
   version out at their next open from it, whatever becomes of the tombstone;
2b. one listing of ``holds/``, after every tombstone of the batch is durable: a version
   held now is left out of steps 3-5 (its tombstone stays; it only protects the
   version's objects a grace period longer).  Why a hold stored before the listing, and
   so every hold stored before the tombstone, always stops the removal, and how placing
   a hold learns of a removal that listed ``holds/`` before it:
   :mod:`chunkstore.protocol.holds`.  Holds are also listed once before anything else,
   so that a held version normally gets no tombstone and ``rm`` refuses it having
   changed nothing.  A batch that reaches step 3 more than
   :data:`~chunkstore.protocol.tombstones.MAX_REMOVAL_STALL_S` after its tombstones
   (the process was stopped) goes back to step 2: a GC may have deleted them since;
3. the withdrawals: one look at each run's lease objects for the whole batch
   (:class:`~chunkstore.protocol.runlease.Withdrawals`), after every tombstone of it;
4. the commit records, in bulk (one request per batch on S3, one directory fsync
   locally): from here the versions are not published;
5. their signature objects, in bulk (after the records: a crash between leaves a
   published version signed, never one unsigned; an orphan signature left behind GC
   removes, docs/format.md §14);
6. the index, in one transaction;
7. the audit done event: how many were removed, and those a hold kept.

So a batch costs two PUTs per version (tombstone, marker) and a few requests in all,
where removing versions one by one cost six requests each, a listing and a read of
every tag included.  A
crash at any point leaves each version of the batch either still published (its
tombstone only protects its objects a grace period longer: it is removed again by the
next ``rm`` or ``prune``) or removed, with its tombstone; an index that missed step 5
counts it out at its next reconcile.  The bulk delete promises no order: which of a
batch's records a crash leaves is left to chance, and either way is safe.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from chunkstore.backends.base import DELETE_BATCH
from chunkstore.errors import HeldVersionError, InvalidInputError
from chunkstore.format.records import MIN_PREFIX
from chunkstore.objects.kinds import SIGNATURES, TAGS, VERSIONS
from chunkstore.protocol import audit, tombstones
from chunkstore.protocol.audit import versions_named
from chunkstore.protocol.holds import Hold, held_ids, read_hold
from chunkstore.protocol.published import write_marker
from chunkstore.protocol.runlease import Withdrawals, withdraw
from chunkstore.protocol.tombstones import RemovedVersion, find_removed, write_tombstone

if TYPE_CHECKING:
    from chunkstore.handle.handle import StoreHandle
    from chunkstore.handle.versions import VersionInfo


def unreadable(info: VersionInfo) -> bool:
    """A commit record that cannot be read (:meth:`StoreHandle.resolve_for_removal`)."""
    return info.meta.get("unreadable") is True


def remove_versions(store: StoreHandle, infos: Sequence[VersionInfo], *,
                    force: bool = False, skip_held: bool = False,
                    operation: str = "rm") -> list[Hold]:
    """Unpublish ``infos`` (resolved, each once).  A tagged version is refused, before
    anything is removed, unless ``force`` (which drops its tags too); a commit record
    that cannot be read is removed with its tags and no tombstone (what it references
    cannot be known, and no reader can have opened it).

    A held version is never removed (``force`` or not): with ``skip_held`` it is left
    out and its hold returned (retention); else :class:`HeldVersionError` is raised,
    before anything changes when the hold was there at the start.

    ``operation`` names the removal in its audit events (``rm``, ``prune``, ...): one
    intent per batch, stored before anything is removed, and one done event."""
    if not infos:
        return []
    held = _holds_of(store, held_ids(store.objects), infos)
    if held and not skip_held:
        raise HeldVersionError({h.version_id: h.reason for h in held})
    infos = [info for info in infos if info.id not in {h.version_id for h in held}]
    if not infos:
        return held
    # Removing versions is how a full disk is freed: on one, the index's space reserve
    # makes room for the tombstones and the index's own writes.
    store.index.release_reserve_if_low()
    stored = store.stored_tags()  # storage is the truth for tags (the index may lag)
    tags = {**store.tags(), **stored}
    removed = {info.id: info for info in infos}
    pinned = {tag: vid for tag, vid in tags.items()
              if vid in removed and not unreadable(removed[vid])}
    if pinned and not force:
        raise InvalidInputError("; ".join(
            f"version {removed[vid].short_id} is tagged"
            f" {', '.join(sorted(t for t, v in pinned.items() if v == vid))}"
            for vid in sorted(set(pinned.values()))) + "; untag first or pass force=True"
            " (--force)")
    # 0. recorded: durable with the first batch's tombstones, before any record goes,
    # or at once when a tag is deleted first
    intents = [audit.record(store.objects, operation, force=force, deferred=True,
                            versions=versions_named(infos[start:start + DELETE_BATCH]))
               for start in range(0, len(infos), DELETE_BATCH)]
    untagged = sorted({*pinned, *(t for t, vid in stored.items()
                                  if vid in removed and unreadable(removed[vid]))})
    if untagged:
        store.objects.flush()
    for tag in untagged:
        store.objects.delete(TAGS, tag)
    if any(not unreadable(info) for info in infos):
        store.upgrade_format()  # tombstones are objects of format 2
    removed_ids: list[str] = []
    late: list[Hold] = []  # held after the first listing
    for start in range(0, len(infos), DELETE_BATCH):
        batch = infos[start:start + DELETE_BATCH]
        late += _remove_batch(store, batch)
        removed_ids += [info.id for info in batch]
    late_ids = {h.version_id for h in late}
    audit.record_done(store.objects, operation, intents[0], intents=len(intents),
                      removed=len(removed_ids) - len(late_ids),
                      held=sorted(late_ids | {h.version_id for h in held}),
                      tags_removed=untagged)
    if late and not skip_held:
        raise HeldVersionError({h.version_id: h.reason for h in late},
                               removed=[vid for vid in removed_ids if vid not in late_ids])
    return held + late


def removed_already(store: StoreHandle, selector: str) -> RemovedVersion | None:
    """The version ``selector`` named (a full id or unique id prefix, or RUN@STEP) if it
    was removed already and its tombstone is still stored (removed less than a grace
    period ago, docs/format.md §11.3) and its record is gone: what a rerun of a removal
    reports instead of a bad selector.  None when the selector names no such version."""
    run, at, step = selector.partition("@")
    if at:
        if not (step.isascii() and step.isdigit() and len(step) <= 19):
            return None  # RUN@latest names what is published now
        found = find_removed(store.objects, run=run, step=int(step))
    elif len(selector) >= MIN_PREFIX and all(c in "0123456789abcdef" for c in selector.lower()):
        found = find_removed(store.objects, prefix=selector.lower())
        if len(found) > 1:
            return None  # ambiguous: the resolver's error says so
    else:
        return None
    found = [r for r in found if not store.objects.exists(VERSIONS, r.version_id)]
    return found[-1] if found else None


def _holds_of(store: StoreHandle, held: set[str], infos: Sequence[VersionInfo]
              ) -> list[Hold]:
    """The holds of those of ``infos`` that ``held`` names (a hold released meanwhile
    still counts: it was there when the removal looked)."""
    return [read_hold(store.objects, info.id)
            or Hold(info.id, "(released while the removal ran)")
            for info in infos if info.id in held]


def _remove_batch(store: StoreHandle, batch: Sequence[VersionInfo]) -> list[Hold]:
    """Steps 2-5 for one batch; return the holds step 2b found (left out)."""
    readable = [info for info in batch if not unreadable(info)]
    while True:
        stored_at = time.monotonic()
        _store_tombstones(store, batch)
        # 2b: a hold stored before the tombstones were durable is listed here.  An
        # unreadable record has no tombstone and is not held (it was never listed).
        late = _holds_of(store, held_ids(store.objects), readable) if readable else []
        kept = {h.version_id for h in late}
        withdrawals = _withdrawals(store, [i for i in readable if i.id not in kept])
        if time.monotonic() - stored_at <= tombstones.MAX_REMOVAL_STALL_S:
            break
        # Stalled since the tombstones (a stopped process): a GC may have deleted them
        # and a hold been confirmed meanwhile, finding none.  Stored again, looked again.
    for run, version_id in withdrawals:
        # Rolled forward at a takeover (its writer may have been stopped before its own
        # PUT), or the next taker's walk would roll it forward: withdrawn, it is never
        # rolled forward again, and a late PUT of it never counted in (docs/format.md
        # §11.5).
        withdraw(store.objects, run, version_id)
    batch = [info for info in batch if info.id not in kept]
    store.objects.delete_many(VERSIONS, [info.id for info in batch])
    store.objects.delete_many(SIGNATURES, [info.id for info in batch])
    store.index.remove_versions(info.id for info in batch)
    return late


def _store_tombstones(store: StoreHandle, infos: Sequence[VersionInfo]) -> None:
    """Step 2: each version's tombstone (an unreadable record has none) and removal
    marker, durable when this returns."""
    def tombstone(info: VersionInfo) -> None:
        if not unreadable(info):
            write_tombstone(store.objects, info.id, info.root, info.run, info.step,
                            deferred=True)
        write_marker(store.objects, info.id, removed=True)

    if len(infos) > 1:  # each PUT waits on a request: side by side
        with ThreadPoolExecutor(min(store.threads, len(infos)),
                                thread_name_prefix="chunkstore-remove") as pool:
            list(pool.map(tombstone, infos))
    else:
        for info in infos:
            tombstone(info)
    store.objects.flush()  # every tombstone durable (locally one syncfs) before step 3


def _withdrawals(store: StoreHandle, infos: Sequence[VersionInfo]) -> list[tuple[str, str]]:
    """Step 3's look: (run, version id) of each of ``infos`` to withdraw, from one look
    at each run's lease objects."""
    found = []
    for run in sorted({info.run for info in infos}):
        withdrawals = Withdrawals(store.objects, run)
        found += [(run, info.id) for info in infos
                  if info.run == run and withdrawals.needed(info.id)]
    return found
