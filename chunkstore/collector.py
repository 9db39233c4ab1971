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
other threads make meanwhile.  The command line runs each command paused too:
a quick ``verify`` of a store of 100,000 chunks took 2.6 s instead of 3.2 s.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator


class _Pause:
    """The one pause that every save and restore in the process shares."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.holders = 0
        self.resume = False


_PAUSE = _Pause()


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Pause automatic collection for the block (also as a decorator); nested and
    concurrent uses share one pause, and the collector is enabled again after the
    last one only if it was enabled before the first."""
    with _PAUSE.lock:
        if _PAUSE.holders == 0:
            _PAUSE.resume = gc.isenabled()
            gc.disable()
        _PAUSE.holders += 1
    try:
        yield
    finally:
        with _PAUSE.lock:
            _PAUSE.holders -= 1
            if _PAUSE.holders == 0 and _PAUSE.resume:
                gc.enable()
