"""The index's write gate: who may begin an LMDB write transaction, asked with a deadline.

LMDB serialises write transactions with one mutex in ``lock.mdb`` and offers no
way to try it: a process stopped (SIGSTOP, a debugger, a frozen container) while
it holds a write transaction blocks every other writer until it runs again, and
opening an index is a writer too (py-lmdb opens each table in a write
transaction; a table opened in a read transaction does not outlive it).  So every
write transaction this release begins on an index is taken behind a gate, an
``flock`` on ``writer.lock`` in the index directory plus a lock for this
process's threads, which *can* be tried: opening a store asks it with
:data:`OPEN_WAIT_S` and, finding it held longer, works from a private index
instead of waiting (:func:`chunkstore.index.lmdbindex.open_index`), and a cache
update that may be skipped gives up after that long (:class:`WriterBusy`).

The kernel drops an flock when its process dies, so a killed holder never blocks
anyone.  A process of an older release does not take the gate: a write transaction
it holds is waited for as before (LMDB's mutex still serialises every writer; the
gate only lets this release see that a writer is busy).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator

try:
    import fcntl
except ImportError:  # pragma: no cover - not on POSIX
    fcntl = None  # type: ignore[assignment]

GATE_NAME = "writer.lock"
#: How long opening a store, or a cache update that may be skipped, waits for another
#: writer of the index before it goes on without it.
OPEN_WAIT_S = float(os.environ.get("CHUNKSTORE_INDEX_WAIT", "2"))


class WriterBusy(Exception):
    """Raised (inside the index package) when the gate stayed held past the deadline."""


class WriteGate:
    """The write gate of one index directory, for every thread of this process.

    Re-entrant within a thread (a table opened inside :meth:`held` may begin its own
    write transaction); the flock is taken by the outermost holder only.
    """

    def __init__(self, index_path: str) -> None:
        self._lock = threading.RLock()
        self._depth = 0
        self._fd: int | None = None
        if fcntl is not None:
            for attempt in range(5):  # an index directory may be deleted at any time
                try:
                    # FileExistsError too: makedirs's mkdir found the directory, which
                    # was gone again when it checked that it is one.
                    os.makedirs(index_path, exist_ok=True)
                    self._fd = os.open(os.path.join(index_path, GATE_NAME),
                                       os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
                    break
                except (FileNotFoundError, FileExistsError):
                    if attempt == 4:
                        raise

    @contextlib.contextmanager
    def held(self, wait_s: float | None = None) -> Iterator[None]:
        """Hold the gate; ``wait_s`` None waits as long as it takes, else
        :class:`WriterBusy` once that many seconds have passed."""
        deadline = None if wait_s is None else time.monotonic() + wait_s
        if not self._lock.acquire(timeout=-1 if wait_s is None else max(wait_s, 0.0)):
            raise WriterBusy("another thread of this process holds the index's writer")
        try:
            if self._depth == 0:
                self._flock(deadline)
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
                if self._depth == 0 and self._fd is not None:
                    fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            self._lock.release()

    def _flock(self, deadline: float | None) -> None:
        if self._fd is None:
            return
        if deadline is None:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            return
        delay = 0.005
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise WriterBusy("another process holds the index's writer (is it"
                                     " stopped?)") from None
                time.sleep(delay)
                delay = min(delay * 2, 0.1)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the flock, were it held
            self._fd = None
