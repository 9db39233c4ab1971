"""Mirroring: a background replicator that copies each published version of a store to
a second store (a fast local tier mirrored to a durable one), in order.

1. **The mirror is opened in the replicator's thread**, never by the caller: a mirror
   that is down, refuses connections or never answers costs the process handing
   versions over nothing.  Until it is reached every version handed over is pending
   (not done), and opening is retried as a failing copy is.  Once it is open, the
   ``backlog`` it names (versions a killed replicator may have left) goes to the
   front of the queue, so the order of publication holds.
2. **Each copy is a** :func:`chunkstore.maintenance.sync.sync` **of one version**, so
   the mirror only ever holds whole versions (commit record last), a GC on the mirror
   waits for the copy as for a save, and a replicator killed mid-copy leaves nothing
   partial: the next one copies only what did not land.
3. **A version counts as removed only when the source store says so**: its commit
   record is gone or a tombstone names it.  An index that lacks it (a save whose index
   update failed) is a stale cache: the version is counted in from the store
   (:func:`~chunkstore.maintenance.reconcile.count_in`) and copied.  Taking it for
   removed would let retention delete its only copy once any index heard of it.
4. **A failed copy is told apart by its cause.**  A failure reading the source
   (integrity error, missing object) is checked with ``verify`` on the source: when
   the local copy of the version is damaged, the version is set aside, reported
   (``pending_reasons``, a log warning) and the versions behind it go on; nothing a
   later copy does can make it whole.  Any other failure (the mirror down, slow or
   full) is transient: the copy is retried with a growing pause and the versions
   behind it wait, so the mirror never holds a newer version of the run without the
   older ones queued before it, the damaged ones aside.
5. ``on_mirrored(version_id)`` runs in the thread after each copy and before the
   version counts as done, so a ``wait`` that returns has seen what it did
   (retention of the fast tier, which must ask the mirror's store, not this thread,
   whether a version may leave).
6. **The mirror is read back**, after each version copied, a slice of at most
   ``read_back_bytes`` (:class:`~chunkstore.maintenance.readback.ReadBack`): a copy
   never reads what the mirror already holds, so rot there would otherwise stay
   unseen until the mirror is the only copy.  What fails is replaced from the local
   store's checked bytes; what the local store cannot give (pruned there) is
   logged.  The whole mirror is read once every ``ceil(mirror bytes /
   read_back_bytes)`` mirrored versions; a failure of the read-back is logged and
   never fails or delays a copy's outcome.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable

from chunkstore.errors import ChunkStoreError, IntegrityError, MirrorError
from chunkstore.handle.handle import StoreHandle
from chunkstore.maintenance.readback import DEFAULT_READ_BACK_BYTES, ReadBack
from chunkstore.maintenance.reconcile import count_in
from chunkstore.maintenance.sync import SyncResult, sync
from chunkstore.maintenance.verify import verify
from chunkstore.objects.kinds import TOMBSTONES, VERSIONS

log = logging.getLogger(__name__)

#: Pauses between attempts at a failing copy, in seconds (the last one repeats).
RETRY_PAUSES_S = (0.5, 1.0, 2.0, 5.0, 15.0, 30.0)

#: Opens the destination store (called in the replicator's thread).
Opener = Callable[[], StoreHandle]
#: The versions a freshly opened destination may lack, oldest first.
Backlog = Callable[[StoreHandle], Iterable[str]]


class Replicator:
    """Copies versions of ``src`` to ``dst`` (a store, or an :data:`Opener` that the
    thread calls until it succeeds) in a background thread, in the order they are
    handed over; ``on_mirrored(version_id)`` runs in that thread after each copy."""

    def __init__(self, src: StoreHandle, dst: StoreHandle | Opener,
                 on_mirrored: Callable[[str], None] | None = None, *,
                 backlog: Backlog | None = None, target: str | None = None,
                 read_back_bytes: int = DEFAULT_READ_BACK_BYTES) -> None:
        self.src = src
        #: bytes of the mirror read back after each version copied (0: none)
        self.read_back_bytes = read_back_bytes
        self._read_back: ReadBack | None = None
        #: what the read-back found so far: objects and bytes read, healed, not healed
        self.read_back_stats = {"objects": 0, "bytes": 0, "healed": 0, "unhealed": 0}
        self.dst: StoreHandle | None = dst if isinstance(dst, StoreHandle) else None
        self._open_dst: Opener | None = None if isinstance(dst, StoreHandle) else dst
        #: how the destination is named in messages (its URL once open)
        self.target = target or (self.dst.url if self.dst is not None else "the mirror")
        self._on_mirrored = on_mirrored
        self._backlog = backlog
        self._queue: collections.deque[str] = collections.deque()
        self._order: dict[str, int] = {}  # when each version was handed over
        self._counter = itertools.count()
        self._mirrored: set[str] = set()
        self._damaged: dict[str, str] = {}  # set aside: version -> why
        self._cond = threading.Condition()
        self._busy = False
        self._stop = False
        self._failures = 0
        self._attempts = 0
        self._nudge = False
        self.last_error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def start(self, existing: Iterable[str] = ()) -> None:
        """Start the thread, first enqueueing ``existing`` versions (a previous
        replicator may have been killed before it copied them)."""
        for version_id in existing:
            self.enqueue(version_id)
        self._thread = threading.Thread(target=self._run, name="chunkstore-mirror",
                                        daemon=True)
        self._thread.start()

    def enqueue(self, version_id: str) -> None:
        with self._cond:
            if version_id not in self._order:
                self._order[version_id] = next(self._counter)
                self._queue.append(version_id)
                self._cond.notify_all()

    def is_mirrored(self, version_id: str) -> bool:
        with self._cond:
            return version_id in self._mirrored

    @property
    def running(self) -> bool:
        """Whether the thread is still alive (a copy hung on the mirror keeps it so)."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def pending(self) -> list[str]:
        """Versions handed over and not mirrored, in the order handed over (those set
        aside as damaged included)."""
        with self._cond:
            return self._pending_locked()

    def _pending_locked(self) -> list[str]:
        return sorted([*self._queue, *self._damaged], key=self._order.__getitem__)

    @property
    def pending_reasons(self) -> dict[str, str]:
        """Why each pending version is not mirrored yet."""
        with self._cond:
            reasons = dict(self._damaged)
            head = self._queue[0] if self._queue else None
            for version_id in self._queue:
                reasons[version_id] = self._reason_locked(version_id, head)
            return {v: reasons[v] for v in self._pending_locked()}

    def _reason_locked(self, version_id: str, head: str | None) -> str:
        if self._failures and self.dst is None:
            return f"{self.target} cannot be reached: {self.last_error}"
        if self._failures and version_id == head:
            return f"copying it to {self.target} keeps failing: {self.last_error}"
        if self._failures and head is not None:
            return (f"waiting behind {head[:12]}, whose copy to {self.target} keeps"
                    f" failing: {self.last_error}")
        return "queued" if version_id != head or not self._busy else "being copied"

    def wait(self, timeout: float | None = None) -> None:
        """Block until every version handed over is mirrored; :class:`MirrorError` when
        copies are failing (after the current attempt), ``timeout`` passes first, or a
        version is set aside as damaged."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            started = self._attempts
            self._nudge = True  # a copy pausing after a failure is tried again now
            self._cond.notify_all()
            while self._queue or self._busy:
                if self._failures and not self._busy and self._attempts > started:
                    break  # an attempt made since this wait began failed too
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._cond.wait(left if left is not None else 1.0)
            if self._queue or self._damaged:
                raise MirrorError(self._why_locked(timeout), self._pending_locked())

    def _why_locked(self, timeout: float | None) -> str:
        left = len(self._queue) + len(self._damaged)
        reasons = [f"version {v[:12]}: {why}" for v, why in self._damaged.items()]
        if self._queue and self._failures and self.dst is None:
            reasons.append(f"{self.target} cannot be reached: {self.last_error}")
        elif self._queue:
            reasons.append(f"copying to {self.target} keeps failing: {self.last_error}"
                           if self._failures else f"not done within {timeout} s")
        return f"{left} version(s) not mirrored yet ({'; '.join(reasons)})"

    def close(self, timeout: float | None = None) -> list[str]:
        """Finish the copies queued (for up to ``timeout`` seconds, and while they
        succeed), stop the thread, and return the versions left unmirrored.  A thread
        held by a copy that does not return within the time is left behind (a daemon:
        :attr:`running` says so); what it copies later is whole."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with contextlib.suppress(MirrorError):  # what is left is returned
            self.wait(timeout)
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            left = None if deadline is None else max(0.1, deadline - time.monotonic())
            self._thread.join(left)
        return self.pending

    # --- the thread ------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                self._busy = True
            version_id, error, damage = self._attempt()
            self._settle(version_id, error, damage)
            if error is None or damage is not None:
                continue
            pause = RETRY_PAUSES_S[min(self._failures - 1, len(RETRY_PAUSES_S) - 1)]
            with self._cond:
                self._cond.wait_for(lambda: self._stop or self._nudge, pause)
                if self._stop:
                    return

    def _attempt(self) -> tuple[str | None, Exception | None, str | None]:
        """Reach the destination, then copy the head of the queue: (the version tried,
        the error, why it is damaged when it is)."""
        try:
            dst = self._reach()
        except Exception as exc:
            return None, exc, None
        with self._cond:
            version_id = self._queue[0]
        try:
            if not self._removed(version_id):
                if self.src.index.version(version_id) is None and not count_in(
                        self.src, version_id):
                    raise IntegrityError(f"version {version_id[:12]} cannot be read here")
                result = sync(self.src, dst, [version_id])
                refused = self._refused(version_id, result)
                if refused is not None:
                    return version_id, ChunkStoreError(refused), refused
        except Exception as exc:
            return version_id, exc, self._damage(version_id, exc)
        with self._cond:
            self._mirrored.add(version_id)
        if self._on_mirrored is not None:
            try:
                self._on_mirrored(version_id)
            except Exception as exc:  # retention and the like: the copy is done
                log.warning("after mirroring %s: %s", version_id[:12], exc)
        self._read_back_step(dst)
        return version_id, None, None

    def _read_back_step(self, dst: StoreHandle) -> None:
        """Read the next slice of the mirror back and heal it (step 6)."""
        if self.read_back_bytes <= 0:
            return
        try:
            if self._read_back is None:
                self._read_back = ReadBack(dst, self.src, self.read_back_bytes)
            found = self._read_back.step()
        except Exception as exc:  # the read-back is a check: it never fails a copy
            log.warning("reading %s back failed: %s", self.target, exc)
            return
        stats = self.read_back_stats
        stats["objects"] += found.objects_read
        stats["bytes"] += found.bytes_read
        stats["healed"] += len(found.healed)
        stats["unhealed"] += len(found.unhealed)
        for fix in found.healed:
            log.warning("%s: %s %s was damaged in the mirror (%s) and was rewritten from"
                        " %s", self.target, fix.kind, fix.digest[:16], fix.problem,
                        self.src.url)
        for fix in found.unhealed:
            log.warning("%s: %s %s is damaged in the mirror (%s), needed by %s, and cannot"
                        " be rewritten: %s", self.target, fix.kind, fix.digest[:16],
                        fix.problem, ", ".join(fix.versions), fix.reason)

    def _settle(self, version_id: str | None, error: Exception | None,
                damage: str | None) -> None:
        with self._cond:
            self._busy = False
            self._attempts += 1
            if error is None or damage is not None:
                assert version_id is not None and self._queue[0] == version_id
                self._queue.popleft()
                if damage is not None:
                    self._damaged[version_id] = damage
                else:
                    self._failures = 0
            else:
                self.last_error = error
                self._failures += 1
                self._nudge = False  # a wait() from now on cuts the pause short
            self._cond.notify_all()
        if damage is not None:
            assert version_id is not None
            log.warning("version %s is not mirrored to %s: %s; the versions after it go on",
                        version_id[:12], self.target, damage)
        elif version_id is None:
            log.warning("%s cannot be reached (attempt %d): %s", self.target, self._failures,
                        error)
        elif error is not None:
            log.warning("mirroring version %s to %s failed (attempt %d): %s",
                        version_id[:12], self.target, self._failures, error)

    def _reach(self) -> StoreHandle:
        """The destination, opened at the first attempt that can; the backlog it names
        goes before the versions queued meanwhile (they are newer)."""
        if self.dst is not None:
            return self.dst
        assert self._open_dst is not None
        dst = self._open_dst()
        backlog = list(self._backlog(dst)) if self._backlog is not None else []
        with self._cond:
            self.dst, self.target = dst, dst.url
            older = [v for v in backlog if v not in self._order]
            for version_id in older:
                self._order[version_id] = -len(older) + older.index(version_id)
            self._queue = collections.deque(
                sorted([*older, *self._queue], key=self._order.__getitem__))
        return dst

    def _removed(self, version_id: str) -> bool:
        """Removed from the source: the store says so, whatever an index believes."""
        objects = self.src.objects
        return not objects.exists(VERSIONS, version_id) or objects.exists(TOMBSTONES,
                                                                          version_id)

    def _refused(self, version_id: str, result: SyncResult) -> str | None:
        """Why a sync that returned did not copy the version, when that is lasting: its
        source copy failed sync's checks (damaged), or the destination holds another
        version at its step.  Neither goes away by trying again."""
        if version_id in result.copied or version_id in result.skipped:
            return None
        for failed in result.failed:
            if failed.version == version_id:
                return f"its local copy is damaged ({failed.kind}: {failed.message})"
        for conflict in result.step_conflicts:
            if conflict.src_version == version_id:
                return (f"{self.target} holds another version at {conflict.run}@"
                        f"{conflict.step} ({conflict.dst_version[:12]})")
        raise ChunkStoreError(f"sync did not copy version {version_id[:12]} and said"
                              " nothing why")

    def _damage(self, version_id: str, error: Exception) -> str | None:
        """Why the source's copy of the version is damaged, when the failure came from
        there (verify on the source finds a problem); None: a transient failure."""
        if not isinstance(error, (IntegrityError, FileNotFoundError)):
            return None
        try:
            found = verify(self.src, version_id)
        except IntegrityError as exc:
            return f"its local copy is damaged ({exc})"
        except Exception:  # the check itself failed: not proof of damage
            return None
        if found.ok:
            return None
        problem = found.problems[0]
        return f"its local copy is damaged ({problem.kind}: {problem.message})"
