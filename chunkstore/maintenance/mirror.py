"""Mirroring: a background replicator that copies each published version of a store to
a second store (a fast local tier mirrored to a durable one), in order.

Each copy is a :func:`chunkstore.maintenance.sync.sync` of one version, so the mirror
only ever holds whole versions (commit record last), a GC on the mirror waits for
the copy as for a save, and a replicator killed mid-copy leaves nothing partial: the
next one (:meth:`Replicator.start` enqueues every version the mirror may lack) copies
only what did not land.  A failed copy is retried with a growing pause; the versions
behind it wait, so the mirror never holds a newer version of the run without the
older ones queued before it.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from chunkstore.errors import MirrorError
from chunkstore.maintenance.sync import sync

if TYPE_CHECKING:
    from chunkstore.handle.handle import StoreHandle

log = logging.getLogger(__name__)

#: Pauses between attempts at a failing copy, in seconds (the last one repeats).
RETRY_PAUSES_S = (0.5, 1.0, 2.0, 5.0, 15.0, 30.0)


class Replicator:
    """Copies versions of ``src`` to ``dst`` in a background thread, in the order they
    are handed over; ``on_mirrored(version_id)`` runs (in that thread) after each."""

    def __init__(self, src: StoreHandle, dst: StoreHandle,
                 on_mirrored: Callable[[str], None] | None = None) -> None:
        self.src = src
        self.dst = dst
        self._on_mirrored = on_mirrored
        self._queue: collections.deque[str] = collections.deque()
        self._mirrored: set[str] = set()
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
            if version_id not in self._mirrored and version_id not in self._queue:
                self._queue.append(version_id)
                self._cond.notify_all()

    def is_mirrored(self, version_id: str) -> bool:
        with self._cond:
            return version_id in self._mirrored

    @property
    def pending(self) -> list[str]:
        """Versions handed over and not yet mirrored, in order."""
        with self._cond:
            return list(self._queue)

    def wait(self, timeout: float | None = None) -> None:
        """Block until every version handed over is mirrored; :class:`MirrorError` when
        copies are failing (after the current attempt) or ``timeout`` passes first."""
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
            if self._queue:
                reason = (f"copying to {self.dst.url} keeps failing: {self.last_error}"
                          if self._failures else f"not done within {timeout} s")
                raise MirrorError(f"{len(self._queue)} version(s) not mirrored yet ({reason})",
                                  list(self._queue))

    def close(self, timeout: float | None = None) -> list[str]:
        """Finish the copies queued (for up to ``timeout`` seconds, and while they
        succeed), stop the thread, and return the versions left unmirrored."""
        with contextlib.suppress(MirrorError):  # what is left is returned
            self.wait(timeout)
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        return self.pending

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                version_id = self._queue[0]
                self._busy = True
            error = self._copy(version_id)
            ok = error is None
            with self._cond:
                self._busy = False
                self._attempts += 1
                if ok:
                    self._queue.popleft()
                    self._mirrored.add(version_id)
                    self._failures = 0
                else:
                    self.last_error = error
                    self._failures += 1
                    self._nudge = False  # a wait() from now on cuts the pause short
                self._cond.notify_all()
            if not ok:
                log.warning("mirroring version %s to %s failed (attempt %d): %s",
                            version_id[:12], self.dst.url, self._failures, error)
            if ok:
                if self._on_mirrored is not None:
                    try:
                        self._on_mirrored(version_id)
                    except Exception as exc:  # retention and the like: the copy is done
                        log.warning("after mirroring %s: %s", version_id[:12], exc)
                continue
            pause = RETRY_PAUSES_S[min(self._failures - 1, len(RETRY_PAUSES_S) - 1)]
            with self._cond:
                self._cond.wait_for(lambda: self._stop or self._nudge, pause)
                if self._stop:
                    return

    def _copy(self, version_id: str) -> Exception | None:
        """Copy one version; the error when it failed."""
        try:
            if self.src.index.version(version_id) is not None:
                sync(self.src, self.dst, [version_id])
            # else removed from the source before it was copied: nothing to mirror
        except Exception as exc:
            return exc
        return None
