"""An index's GC lock, and handing back deletions a killed GC of the index left."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

try:
    import fcntl
except ImportError:  # pragma: no cover - not on POSIX
    fcntl = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from chunkstore.index.lmdbindex import Index

@contextlib.contextmanager
def gc_lock(index_path: str, *, wait: bool = False, wait_s: float = 0.0) -> Iterator[bool]:
    """Hold this index's GC lock (an flock, released by the kernel if the holder dies).

    Yields True when held.  Without ``wait``, tries for ``wait_s`` seconds and
    yields False when another process still holds it.
    """
    if fcntl is None:  # pragma: no cover
        yield True
        return
    for attempt in range(5):  # an index directory may be deleted at any time
        os.makedirs(index_path, exist_ok=True)
        try:
            fd = os.open(os.path.join(index_path, "gc.lock"), os.O_RDWR | os.O_CREAT, 0o644)
            break
        except FileNotFoundError:  # deleted between the two calls
            if attempt == 4:
                raise
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    yield False
                    return
                time.sleep(0.05)
        yield True
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def finish_deletions(index: Index) -> int:
    """Hand back every deletion a killed GC of this index left in the DELETING state.

    Its records become WRITING (no dedup target), so the objects are decided
    again by a whole run: journal entry, session wait and mark.  Deleting them
    directly would skip all three, and a save on another index may have
    written one again since (the dead GC's entry stopped protecting it).
    The caller holds the GC lock.
    """
    return index.abandon_deletions()


def finish_abandoned_deletions(index: Index) -> None:
    """For a writer waiting on a DELETING object: finish it if no GC is running."""
    with gc_lock(index.path) as held:
        if held:
            finish_deletions(index)
