"""Collection after retention: ``keep_last`` frees the disk by itself.

Retention only removes versions (their commit records, with tombstones); the bytes
they alone needed stay until a GC deletes them, and the default grace period of an
hour let a job saving every few seconds fill a disk with versions it had dropped.  A
:class:`Collector` runs a GC in a background thread each time it is told that
retention removed something (several triggers while a run goes on make one more
run), with a grace period of its own (default 0): what it may delete is what no
kept version, no open reader (read leases, docs/format.md §11.6) and no save in
flight (sessions, §11.1) needs, on any machine, exactly as ``chunkstore gc`` decides
it.  A reader of a release that takes no read lease is protected by ``grace_s``
alone.  A collection that fails (another GC holds this index, the store is
unreachable) is logged and tried at the next trigger; it never fails a save.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from chunkstore.errors import GcBusyError
from chunkstore.maintenance.gc import GcResult, collect
from chunkstore.maintenance.repack import DEFAULT_UNUSED

if TYPE_CHECKING:
    from chunkstore.handle.handle import StoreHandle

log = logging.getLogger(__name__)

#: The grace period of a collection after retention, by default (seconds).
DEFAULT_COLLECT_GRACE_S = 0.0


class Collector:
    """Runs a GC of ``store`` in a background thread after each :meth:`trigger`."""

    def __init__(self, store: StoreHandle, grace_s: float = DEFAULT_COLLECT_GRACE_S,
                 repack_unused: float | None = DEFAULT_UNUSED) -> None:
        self.store = store
        self.grace_s = grace_s
        self.repack_unused = repack_unused
        self._cond = threading.Condition()
        self._wanted = False
        self._running = False
        self._stop = False
        self._thread: threading.Thread | None = None
        self.runs = 0
        self.last_result: GcResult | None = None
        self.last_error: BaseException | None = None

    def trigger(self) -> None:
        """Ask for a collection (retention removed versions); returns at once."""
        with self._cond:
            if self._stop:
                return
            self._wanted = True
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="chunkstore-collect")
                self._thread.start()
            self._cond.notify_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no collection is asked for or running; False when ``timeout``
        passes first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._wanted or self._running:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float | None = None) -> None:
        """Let a collection asked for finish (``timeout`` seconds at most), then stop; a
        collection cut short by the process's end is a killed GC, which is safe."""
        self.wait_idle(timeout)
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._wanted and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                self._wanted, self._running = False, True
            try:
                self.last_result = collect(self.store, self.grace_s,
                                           repack_unused=self.repack_unused)
                self.last_error = None
            except GcBusyError as exc:  # another GC of this index: it collects too
                self.last_error = exc
            except Exception as exc:
                self.last_error = exc
                log.warning("collecting %s after retention failed (tried again after the"
                            " next removal): %s", self.store.url, exc)
            finally:
                with self._cond:
                    self._running = False
                    self.runs += 1
                    self._cond.notify_all()


__all__ = ["DEFAULT_COLLECT_GRACE_S", "Collector"]
