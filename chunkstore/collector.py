"""Python's cyclic garbage collector, paused while a save, a restore or a command runs.

A PyTorch process holds about 180,000 objects the collector tracks (importing
torch makes them).  A save or a restore of a model makes thousands of small
objects (entries, shards, digests, manifest nodes) that live until it returns.
With the collector running, each young collection scans them, the survivors
are promoted to the oldest generation, and every few saves that pushes it over
the threshold of a full collection of the whole process: 80-100 ms on this
project's 2-core machine, against a LoRA save of about 100 ms.  None of those
objects needs the collector: chunkstore and torch_bridge make no reference
cycles (tests/test_writer.py and tests/test_torch_collector.py check it), so
reference counting frees them when the operation returns.  Pausing the
collector for that long only delays the collection of cyclic garbage that
other threads make meanwhile.  The store's commands (chunkstore.cli) run paused too:
a quick ``verify`` of a store of 100,000 chunks took 2.6 s instead of 3.2 s.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
from collections.abc import Iterator


class _Pause:
    """The one pause that every save and restore in the process shares.

    The order of the steps makes an interruption (a KeyboardInterrupt between
    two bytecodes) leave the collector on, never off: a holder is counted
    before the collector is turned off and uncounted after it is turned back
    on, so the worst case is a count that stays above zero, and later pauses
    then leave the collector alone.
    """

    def __init__(self) -> None:
        # Re-entrant: a signal handler that saves a checkpoint may run on a thread
        # that holds the lock.
        self.lock = threading.RLock()
        self.holders = 0
        self.resume = False

    def enter(self) -> None:
        with self.lock:
            self.holders += 1
            if self.holders == 1:
                self.resume = gc.isenabled()
                gc.disable()

    def leave(self) -> None:
        with self.lock:
            if self.holders == 1 and self.resume:
                gc.enable()
            self.holders -= 1

    def reset_in_child(self) -> None:
        """After fork: the child has no save or restore in progress."""
        self.lock = threading.RLock()
        if self.holders and self.resume:
            gc.enable()
        self.holders = 0


_PAUSE = _Pause()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_PAUSE.reset_in_child)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Pause automatic collection for the block (also as a decorator).

    Nested and concurrent uses share one pause; the collector is enabled again
    after the last one only if it was enabled before the first.  A
    ``gc.disable()`` called by other code during the pause is undone when it
    ends.
    """
    _PAUSE.enter()
    try:
        yield
    finally:
        _PAUSE.leave()
