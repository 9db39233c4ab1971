"""``rm --purge``: remove versions and delete, now, the data no other version shares.

A purge is a removal (:mod:`chunkstore.handle.removal`: refused for a held version,
before anything changes; a version held while the removal runs is left, the others are
removed and purged, then the ``HeldVersionError`` names it) followed by one garbage
collection
(:mod:`chunkstore.maintenance.gc`) narrowed to the removed versions' objects, in three
ways, and otherwise the same run with the same order of steps:

1. its candidates are only the objects the removed versions referenced (the index's
   reference lists, taken before the removal) that no version of this index references
   any more, whatever their age: grace 0 for them;
2. the removed versions' own tombstones protect nothing (and are deleted); every other
   tombstone keeps its version's tree for the grace period, as in any GC, so readers of
   versions removed earlier keep theirs;
3. no sweep and no repack.

What a purge promises: every object that only the purged versions reached, and that no
live version, tombstone within its grace period, live read lease or save in progress
reaches, is deleted before it returns.  The marks, the journal entry's fence and the
wait for save sessions are those of every GC, so a save running at the same time is
never broken: a save whose session was stored before the fence is waited for and its
version marked; one that read the fence rewrites any purged chunk it needs instead of
reusing it (docs/format.md §11.1).  So what such a save writes again, and what a reader
holding a read lease on a purged version still reads, can outlive the purge: the result
says how many bytes were kept and why.  A pack of small chunks is one object: a purged
version's members in a pack other versions still read stay until a GC repacks it.
Readers of a purged version that hold no read lease lose it at once: purge is the one
removal that does not give them the grace period.

An encrypted store (docs/format.md §13.5): a purge deletes the sealed objects; it does
not and cannot destroy keys (one master key seals every version), so a copy of the
ciphertext kept elsewhere (bucket versioning, backups, a synced store) stays readable
to whoever holds a password, and sizes and times of the deleted objects stay in the
storage provider's logs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from chunkstore.errors import GcBusyError, HeldVersionError
from chunkstore.format.digest import Digest
from chunkstore.handle.removal import remove_versions
from chunkstore.index.gclock import gc_lock
from chunkstore.index.lmdbindex import CHUNK, NODE, ChunkState
from chunkstore.maintenance.gc import (
    DEFAULT_GRACE_S,
    DEFAULT_SESSION_WAIT_S,
    Candidate,
    GcResult,
    _Run,
)
from chunkstore.maintenance.retention import parse_duration
from chunkstore.progress import NullProgress, Progress
from chunkstore.protocol.published import forget_markers

if TYPE_CHECKING:
    from chunkstore.handle.handle import StoreHandle
    from chunkstore.handle.versions import VersionInfo

#: At most this many versions are named as sharing a purged version's data.
SHARED_WITH_MAX = 10

_Key = tuple[bytes, Digest]


@dataclass
class PurgeResult:
    """What ``rm --purge`` removed and freed, and what stayed and why."""

    removed: list[VersionInfo]
    #: objects deleted and their stored bytes
    objects_deleted: int = 0
    bytes_freed: int = 0
    #: what stays because live versions still reference it, and (at most
    #: :data:`SHARED_WITH_MAX`, newest first) which; ``shared_with_more``: others too
    objects_shared: int = 0
    bytes_shared: int = 0
    shared_with: list[str] = field(default_factory=list)
    shared_with_more: bool = False
    #: what stays for another reason: a version removed earlier (its grace period), a
    #: live read lease, a save in progress, or saves that outlasted the wait
    objects_kept: int = 0
    bytes_kept: int = 0
    gc: GcResult | None = None

    def to_json(self) -> dict[str, Any]:
        body = {k: v for k, v in self.__dict__.items() if k not in ("removed", "gc")}
        body["removed"] = [info.to_json() for info in self.removed]
        body["gc"] = None if self.gc is None else self.gc.to_json()
        return body


class _PurgeRun(_Run):
    """A GC run whose candidates are the purged versions' objects, at grace 0."""

    audit_op = "purge-gc"

    def __init__(self, store: StoreHandle, grace_s: float, scope: set[_Key],
                 purged: frozenset[str], clock: Callable[[], float], progress: Progress,
                 session_wait_s: float) -> None:
        super().__init__(store, grace_s, False, False, clock, progress, session_wait_s, None)
        self.scope, self.purged = scope, purged

    def decide_sweep(self) -> None:
        super().decide_sweep()  # no sweep (asked for none); other tombstones: their grace
        self.before = self.started  # the purged objects: grace 0

    def find_candidates(self) -> list[Candidate]:
        found = []
        for kind, digest in sorted(self.scope):
            record = self.index.record(kind, digest)
            if record is None or record.state == ChunkState.DELETING or record.refcount > 0:
                continue  # gone, being deleted, or shared with a version of this index
            if self._claimed(digest):
                self.result.kept_by_sessions += 1
                continue
            found.append(Candidate(kind, digest, record.stored_length, True))
        return found


def purge(store: StoreHandle, infos: Sequence[VersionInfo], *, force: bool = False,
          grace: object = DEFAULT_GRACE_S, clock: Callable[[], float] = time.time,
          progress: Progress | None = None,
          session_wait: float = DEFAULT_SESSION_WAIT_S) -> PurgeResult:
    """Remove ``infos`` (resolved; a held one is refused, nothing changed) and delete what
    only they reached.  ``grace``: what the tombstones of *other* removed versions keep."""
    grace_s = parse_duration(grace)
    with gc_lock(store.index.path, wait_s=0.0) as locked:
        if not locked:
            raise GcBusyError("a gc is running on this store; purge when it has finished")
        scope: set[_Key] = set()
        for info in infos:
            scope.update((CHUNK, d) for d in store.index.version_refs(info.id))
            scope.update((NODE, d) for d in store.index.version_node_refs(info.id))
        sizes = {key: record.stored_length for key in scope
                 if (record := store.index.record(*key)) is not None}
        try:
            remove_versions(store, infos, force=force, operation="purge")
            late: HeldVersionError | None = None
        except HeldVersionError as exc:  # held while it ran: the others were removed
            if not exc.removed:
                raise
            late, infos = exc, [info for info in infos if info.id in set(exc.removed)]
        store.index.release_reserve_if_low()
        run = _PurgeRun(store, grace_s, scope, frozenset(info.id for info in infos), clock,
                        progress or NullProgress(), session_wait)
        try:
            gc = run.run()
        finally:
            run.close()
        store.index.keep_reserve()
        # Their publication markers too: empty, but named by the purged ids.
        forget_markers(store.objects, {info.id for info in infos})
    if late is not None:  # what it removed is purged; the held one named
        raise late
    result = PurgeResult(list(infos), gc=gc)
    deleted = set(run.deleted)
    result.objects_deleted = len(scope & deleted)
    result.bytes_freed = sum(sizes.get(key, 0) for key in scope & deleted)
    _account_remaining(store, result, {key: sizes.get(key, 0) for key in scope - deleted})
    return result


def _account_remaining(store: StoreHandle, result: PurgeResult, remaining: dict[_Key, int]
                       ) -> None:
    """Split what stayed into shared with live versions (named, newest first, at most
    :data:`SHARED_WITH_MAX`) and kept for another reason."""
    shared = {key for key in remaining
              if (record := store.index.record(*key)) is not None and record.refcount > 0}
    result.objects_shared = len(shared)
    result.bytes_shared = sum(remaining[key] for key in shared)
    result.objects_kept = len(remaining) - len(shared)
    result.bytes_kept = sum(remaining.values()) - result.bytes_shared
    if not shared:
        return
    for info in store.newest():
        refs = {(CHUNK, d) for d in store.index.version_refs(info.id)}
        refs.update((NODE, d) for d in store.index.version_node_refs(info.id))
        if refs & shared:
            if len(result.shared_with) == SHARED_WITH_MAX:
                result.shared_with_more = True
                return
            result.shared_with.append(info.id)
