"""Removing published versions, one or a thousand at once (``rm``, ``prune``, a step
saved again with ``replace``).

A removal makes each step durable before the next, in batches of
:data:`~chunkstore.backends.base.DELETE_BATCH` versions:

1. the tags that pin a removed version (only with ``force``), storage first;
2. each version's tombstone (in parallel, made durable together): from it every GC
   counts the grace period of what the version reaches
   (:mod:`chunkstore.protocol.tombstones`), and a taker's walk rolls nothing forward
   (:mod:`chunkstore.protocol.runlease`);
3. the withdrawals: one look at each run's lease objects for the whole batch
   (:class:`~chunkstore.protocol.runlease.Withdrawals`), after every tombstone of it;
4. the commit records, in bulk (one request per batch on S3, one directory fsync
   locally): from here the versions are not published;
5. their signature objects, in bulk (after the records: a crash between leaves a
   published version signed, never one unsigned; an orphan signature left behind GC
   removes, docs/format.md §14);
6. the index, in one transaction.

So a batch costs a PUT per version and a few requests in all, where removing versions
one by one cost six requests each, a listing and a read of every tag included.  A
crash at any point leaves each version of the batch either still published (its
tombstone only protects its objects a grace period longer: it is removed again by the
next ``rm`` or ``prune``) or removed, with its tombstone; an index that missed step 5
counts it out at its next reconcile.  The bulk delete promises no order: which of a
batch's records a crash leaves is left to chance, and either way is safe.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from chunkstore.backends.base import DELETE_BATCH
from chunkstore.errors import InvalidInputError
from chunkstore.objects.kinds import SIGNATURES, TAGS, VERSIONS
from chunkstore.protocol.runlease import Withdrawals, withdraw
from chunkstore.protocol.tombstones import write_tombstone

if TYPE_CHECKING:
    from chunkstore.handle.handle import StoreHandle
    from chunkstore.handle.versions import VersionInfo


def unreadable(info: VersionInfo) -> bool:
    """A commit record that cannot be read (:meth:`StoreHandle.resolve_for_removal`)."""
    return info.meta.get("unreadable") is True


def remove_versions(store: StoreHandle, infos: Sequence[VersionInfo], *,
                    force: bool = False) -> None:
    """Unpublish ``infos`` (resolved, each once).  A tagged version is refused, before
    anything is removed, unless ``force`` (which drops its tags too); a commit record
    that cannot be read is removed with its tags and no tombstone (what it references
    cannot be known, and no reader can have opened it)."""
    if not infos:
        return
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
    for tag in sorted({*pinned, *(t for t, vid in stored.items()
                                  if vid in removed and unreadable(removed[vid]))}):
        store.objects.delete(TAGS, tag)
    if any(not unreadable(info) for info in infos):
        store.upgrade_format()  # tombstones are objects of format 2
    for start in range(0, len(infos), DELETE_BATCH):
        _remove_batch(store, infos[start:start + DELETE_BATCH])


def _remove_batch(store: StoreHandle, batch: Sequence[VersionInfo]) -> None:
    readable = [info for info in batch if not unreadable(info)]

    def tombstone(info: VersionInfo) -> None:
        write_tombstone(store.objects, info.id, info.root, info.run, info.step,
                        deferred=True)

    if len(readable) > 1:  # each PUT waits on a request: side by side
        with ThreadPoolExecutor(min(store.threads, len(readable)),
                                thread_name_prefix="chunkstore-remove") as pool:
            list(pool.map(tombstone, readable))
    else:
        for info in readable:
            tombstone(info)
    store.objects.flush()  # every tombstone durable (locally one syncfs) before step 3
    for run in sorted({info.run for info in readable}):
        withdrawals = Withdrawals(store.objects, run)
        for info in readable:
            if info.run == run and withdrawals.needed(info.id):
                # Rolled forward at a takeover (its writer may have been stopped before
                # its own PUT), or the next taker's walk would roll it forward: withdrawn,
                # it is never rolled forward again, and a late PUT of it never counted in
                # (docs/format.md §11.5).
                withdraw(store.objects, run, info.id)
    store.objects.delete_many(VERSIONS, [info.id for info in batch])
    store.objects.delete_many(SIGNATURES, [info.id for info in batch])
    store.index.remove_versions(info.id for info in batch)
