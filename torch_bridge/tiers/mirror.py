"""The durable tier of a tiered Checkpointer: opening the mirror, handing it each
published version, retention on both tiers, and waiting for it.

Nothing here runs on the training thread but bookkeeping.  The mirror is opened and
written by the replicator's thread (:class:`chunkstore.maintenance.mirror.Replicator`),
with bounded network timeouts on S3, so a mirror that is down, refuses connections or
never answers neither pauses a save nor is taken for done: until a version is copied it
is pending, and ``wait(mirror=True)`` and ``close()`` say so.  A restore asks the mirror
for its versions in a helper thread and gives up after ``timeout`` seconds, reading the
local tier alone.

Retention of the fast tier runs in the replicator's thread after each copy: a version
leaves the local tier only when the policy drops it *and* the mirror's store holds it
(its commit record there) or removed it on purpose (a tombstone there): never on the
word of this process's memory or of an index, so the last whole copy of a version is
never deleted by retention.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

import chunkstore
from chunkstore import Store
from chunkstore.errors import ChunkStoreError, NoStoreError, PasswordRequiredError
from chunkstore.handle.handle import StoreHandle
from chunkstore.maintenance.mirror import Replicator
from chunkstore.maintenance.retention import Candidate, Policy, decide, warn_held
from chunkstore.objects.kinds import TOMBSTONES, VERSIONS

#: How long a restore waits for the mirror to list its versions before it reads the
#: local tier alone, in seconds (``Checkpointer(mirror_timeout=...)``).
DEFAULT_MIRROR_TIMEOUT_S = 10.0

#: Storage options for an ``s3://`` mirror given by URL, under the caller's: each try of
#: a request bounded (connect 5 s, an answer within 10 s) and two tries in botocore.
#: s3fs still retries a timed-out request itself (up to 5 times, its class setting), so
#: a blackholed endpoint holds one request for about 100 s: in the replicator's thread
#: only.  Without them it held one for minutes, and a refused one cost 5-10 s a save.
S3_MIRROR_OPTIONS: dict[str, Any] = {
    "config_kwargs": {"connect_timeout": 5, "read_timeout": 10,
                      "retries": {"total_max_attempts": 2, "mode": "standard"}},
}

Location = str | os.PathLike[str] | Store


def storage_options(location: Location, options: dict[str, Any] | None) -> dict[str, Any]:
    """The options a mirror given by URL is opened with: the caller's, over the bounded
    timeouts of :data:`S3_MIRROR_OPTIONS` for ``s3://`` (``config_kwargs`` merged)."""
    options = dict(options or {})
    if isinstance(location, Store) or not os.fspath(location).startswith(("s3://", "s3a://")):
        return options
    merged: dict[str, Any] = {**S3_MIRROR_OPTIONS, **options}
    merged["config_kwargs"] = {**S3_MIRROR_OPTIONS["config_kwargs"],
                               **options.get("config_kwargs", {})}
    return merged


class MirrorTier:
    """A Checkpointer's mirror: ``location`` (a path, URL or open store), the run,
    ``keep_last`` versions kept there (None: all), ``options`` for a URL, ``timeout``
    for a restore's look at it; ``local`` gives the fast tier's store."""

    def __init__(self, location: Location, *, run: str, keep_last: int | None,
                 options: dict[str, Any] | None, timeout: float,
                 local: Callable[[], Store]) -> None:
        self.location = location
        self.run = run
        self.keep_last = keep_last
        self.timeout = timeout
        self._options = storage_options(location, options)
        self._local = local
        self._store: Store | None = location if isinstance(location, Store) else None
        self._owns_store = False
        self._opening = threading.Lock()
        self.replicator: Replicator | None = None

    # --- opening -----------------------------------------------------------------------

    def open(self, *, create: bool) -> Store | None:
        """The mirror's store, opened once; created (with the local store's settings) only
        when ``create``; None when it holds none yet.  Blocking: callers run it off the
        training thread."""
        with self._opening:
            if self._store is None:
                location = self.location
                assert not isinstance(location, Store)
                try:
                    self._store = self._open_existing(location)
                except NoStoreError:
                    if not create:
                        return None
                    local = self._local()
                    # An encrypted local tier's mirror is its encrypted copy (its key).
                    self._store = chunkstore.open(
                        location, create=True, storage_options=self._options,
                        chunk_size=local.config.chunk_size,
                        compression=local.config.compression,
                        key_of=local if local.objects.encrypted else None)
                self._owns_store = True
            return self._store

    def _open_existing(self, location: str | os.PathLike[str]) -> Store:
        """The mirror; an encrypted one with its password, else (its password not given)
        with the local tier's key, whose encrypted copy it is."""
        try:
            return chunkstore.open(location, storage_options=self._options)
        except PasswordRequiredError:
            return chunkstore.open(location, storage_options=self._options,
                                   key_of=self._local())

    def _open_for_copies(self) -> Store:
        store = self.open(create=True)
        assert store is not None
        return store

    def for_restore(self, warn: Callable[[str], None]) -> Store | None:
        """The mirror with the run's versions listed, for a restore; None when it holds no
        store, or (``warn`` called) when it cannot be reached within ``timeout`` seconds:
        the local tier then serves alone.  The look runs in a helper thread, which a
        mirror that never answers is left to hold."""
        outcome: list[Store | BaseException | None] = []

        def look() -> None:
            try:
                store = self.open(create=False)
                if store is not None:
                    store.versions(self.run)
                outcome.append(store)
            except BaseException as exc:
                outcome.append(exc)
        helper = threading.Thread(target=look, name="chunkstore-mirror-look", daemon=True)
        helper.start()
        helper.join(self.timeout)
        found = outcome[0] if outcome else TimeoutError(
            f"no answer within {self.timeout:g} s")
        if isinstance(found, ChunkStoreError | OSError | TimeoutError):
            warn(f"run {self.run!r}: the mirror {self.location!r} cannot be reached"
                 f" ({found}); restoring from the local tier alone")
            return None
        if isinstance(found, BaseException):
            raise found
        return found

    # --- copying ------------------------------------------------------------------------

    def published(self, version_id: str, after_mirrored: Callable[[str], None]) -> None:
        """Hand a published version over (the replicator starts at the first, and opens
        the mirror in its own thread): no I/O here."""
        if self.replicator is None:
            replicator = Replicator(self._local(), self._open_for_copies,
                                    on_mirrored=after_mirrored, backlog=self._backlog,
                                    target=str(self.location) if not isinstance(
                                        self.location, Store) else self.location.url)
            replicator.start()
            self.replicator = replicator
        self.replicator.enqueue(version_id)

    def _backlog(self, mirror: StoreHandle) -> list[str]:
        """The run's local versions a fresh replicator starts with: none older than the
        oldest version the mirror holds (older ones were pruned there, or never meant to
        go), and none the mirror has removed (a tombstone)."""
        held = [v.step for v in mirror.versions(self.run)]
        oldest = min(held) if held else None
        return [v.id for v in self._local().versions(self.run)
                if (oldest is None or v.step >= oldest)
                and not mirror.objects.exists(TOMBSTONES, v.id)]

    def may_leave(self, version_id: str) -> bool:
        """Whether the local copy of a version may go: the mirror's store holds it (its
        commit record) or removed it on purpose (a tombstone), never on this process's
        word alone.  In the replicator's thread (it asks the mirror)."""
        mirror = self._store
        if mirror is None or self.replicator is None:
            return False
        return (mirror.objects.exists(VERSIONS, version_id)
                or mirror.objects.exists(TOMBSTONES, version_id))

    def apply_retention(self) -> None:
        """``keep_last`` on the mirror (the newest two at least, tags always)."""
        mirror = self._store
        if self.keep_last is None or mirror is None:
            return
        versions = mirror.versions(self.run)
        decision = decide([Candidate(v.id, v.step, v.created, v.meta) for v in versions],
                          Policy(keep_last=self.keep_last, min_previous=1), time.time())
        pinned = set(mirror.tags().values())
        held = mirror.delete_listed_many(
            [v for v in versions if v.id in decision.drop and v.id not in pinned],
            operation="keep_last")
        warn_held(held, f"mirror of run {self.run!r}: keep_last")

    # --- waiting and closing -------------------------------------------------------------

    @property
    def pending(self) -> list[str]:
        return [] if self.replicator is None else self.replicator.pending

    @property
    def pending_reasons(self) -> dict[str, str]:
        return {} if self.replicator is None else self.replicator.pending_reasons

    def wait(self, timeout: float | None) -> None:
        """Every version handed over mirrored, or :class:`MirrorError` naming those left."""
        if self.replicator is not None:
            self.replicator.wait(timeout)

    def close(self, timeout: float | None) -> tuple[list[str], str]:
        """Let the queue finish (while copies succeed, ``timeout`` seconds at most) and
        release the mirror: the versions left and why.  A replicator still held by the
        mirror after the time keeps its stores open (it is a daemon thread)."""
        left: list[str] = []
        why = ""
        replicator = self.replicator
        if replicator is not None:
            reasons = replicator.pending_reasons
            left = replicator.close(timeout)
            reasons.update(replicator.pending_reasons)
            why = "; ".join(f"{v[:12]}: {reasons.get(v, 'queued')}" for v in left)
            if replicator.running:
                return left, why
        if self._owns_store and self._store is not None:
            self._store.close()
            self._store = None
        return left, why
