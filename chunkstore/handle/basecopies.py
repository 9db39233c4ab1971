"""Copies of a save's chunks that the run's next save encodes deltas against.

A delta save (:mod:`chunkstore.write.delta`) encodes a changed chunk against the
chunk at the same tensor and position in the run's previous version.  Read
back from the store, that base costs a read, a decode and a hash check per
chunk (on the suite's dense workload about 170 ms of CPU per save, most of
what deltas add to a save).  A training loop saves the run's previous version
itself, through the same store handle, so the handle keeps a copy of each
chunk its save wrote that the next save may need, and the next save takes the
base from there.

Why a copy may stand in for the stored base:

- the copy is made **before** its chunk is hashed, and the chunk is hashed,
  encoded and written from the copy, so the copy's bytes are exactly the
  bytes of its digest, as a base decoded from the store and hash-checked is;
  an array changed by the caller during the save cannot slip in between;
- a copy is used only for the base the parent's manifest lists at that tensor
  and position, with that digest, and only by the next save of the same run
  on the same handle whose parent is the version that made it;
- the base object is still claimed and fenced as before, and checked to
  exist where a dedup hit is (``VersionWriter._reusable``): the copy replaces
  only the read of its content.  That the stored object still holds those
  bytes is then trusted as a deduplicated chunk's is (reused by digest, never
  read back).  What that gives up: a base damaged on disk after its save was
  caught by the read and the chunk written standalone; now the delta is
  written against it, and the damage reaches the versions whose chains pass
  through it (at most ``delta_depth`` saves), as it reaches every version that
  deduplicated against a damaged chunk.  ``verify`` reports each of them.

Memory: the handle's copies, with the spare buffers kept for the next save
(so a save does not fault in fresh pages), hold at most
``Store.base_copies.budget`` bytes in all (:data:`BASE_COPY_BYTES`); what does
not fit is read back as before.  They are held until the handle is closed, or
given up to another run's save that needs the room.
A chunk is copied only by a save that continues the handle's own run (the
handle saved the version it builds on), and only where the last save wrote
that position anew (or the tensor is new to the run): positions that stay
unchanged (frozen layers) are not copied again.  A handle's first save of a
run (a new run, a resumed one, a one-shot process) copies nothing: most such
saves have no next save on the handle, and a first full save of a large
state would pay a copy of every byte for it.  The run's second save then
reads its bases back once, as a save without copies does.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field

from chunkstore.format.digest import Digest

#: The bytes of copies (and spare buffers) a store handle keeps at most, by default:
#: a copy of the changing part of a state of up to a GiB (``Store.base_copies.budget``;
#: 0 turns copies off, and every base is read back from the store).
BASE_COPY_BYTES = 1 << 30
#: A chunk's place in a version: tensor name and chunk position.
Place = tuple[str, int]
#: What a save left at a place: the chunk's digest, its copy (None: none kept), and
#: whether the save wrote it anew (else it was reused: the place looks unchanged, and
#: the next save need not copy it before hashing).
Left = tuple[Digest, bytearray | None, bool]


@dataclass
class _RunCopies:
    version_id: str
    left: dict[Place, Left] = field(default_factory=dict)

    def buffers(self) -> list[bytearray]:
        return [copy for _, copy, _ in self.left.values() if copy is not None]


class BaseCopies:
    """A store handle's copies by run, and its spare buffers, within one budget.

    The budget counts every buffer the handle holds: the runs' copies, the spare
    buffers, and what each save in progress holds (its parent's copies, the
    copies it made).  A save dropped without a commit or an abort stops counting
    once it is garbage (its buffers go with it).  When a save needs a buffer over
    the budget, spare buffers are freed first, then the copies of the run saved
    longest ago are given up.
    """

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._runs: dict[str, _RunCopies] = {}  # the run saved longest ago first
        self._spare: list[bytearray] = []
        self._pooled = 0  # bytes in _runs and _spare
        self._saves: weakref.WeakSet[SaveCopies] = weakref.WeakSet()
        self._closed = False
        self.lock = threading.Lock()

    def for_save(self, run: str, parent_id: str | None) -> SaveCopies:
        """The copies a save of ``run`` on top of ``parent_id`` may use; the run's
        copies are handed over to it (a second save of the run sees none)."""
        with self.lock:
            held = self._runs.pop(run, None)
            previous: dict[Place, Left] = {}
            continuing = False
            if held is not None:
                self._pooled -= sum(map(len, held.buffers()))
                if held.version_id == parent_id:
                    previous, continuing = held.left, True
                else:  # the run was saved since (elsewhere) or its version removed
                    self._to_spare(held.buffers())
            save = SaveCopies(self, previous,
                              sum(len(c) for _, c, _ in previous.values() if c is not None),
                              continuing=continuing)
            self._saves.add(save)
        return save

    def held(self) -> int:
        """Bytes of every buffer counted against the budget now."""
        with self.lock:
            return self._held()

    def clear(self) -> None:
        """Give up every copy and spare buffer (the handle is closing)."""
        with self.lock:
            self._closed = True
            self._runs.clear()
            self._spare.clear()
            self._pooled = 0

    def _held(self) -> int:
        return self._pooled + sum(save.held for save in self._saves)

    def _buffer(self, save: SaveCopies, size: int) -> bytearray | None:
        with self.lock:
            while True:
                for i, spare in enumerate(self._spare):
                    if len(spare) == size:
                        self._pooled -= size
                        save.held += size
                        return self._spare.pop(i)
                if self._closed:
                    return None
                if self._held() + size <= self.budget:
                    save.held += size
                    break
                # The copies of the run saved longest ago that holds any become spare (a
                # run holding none keeps its place: it is what makes its next save copy).
                oldest = next((run for run, kept in self._runs.items() if kept.buffers()),
                              None)
                if self._spare:
                    self._pooled -= len(self._spare.pop())
                elif oldest is not None:
                    self._spare.extend(self._runs.pop(oldest).buffers())
                else:
                    return None
        return bytearray(size)

    def _to_spare(self, buffers: Iterable[bytearray]) -> None:
        """Under the lock: ``buffers`` (no longer counted elsewhere) become spare."""
        if self._closed:
            return
        for buf in buffers:
            self._spare.append(buf)
            self._pooled += len(buf)

    def _give_back(self, save: SaveCopies, buffers: list[bytearray]) -> None:
        with self.lock:
            save.held -= sum(map(len, buffers))
            self._to_spare(buffers)

    def _keep(self, save: SaveCopies, run: str, version_id: str, left: dict[Place, Left],
              unused: list[bytearray]) -> None:
        with self.lock:
            old = self._runs.pop(run, None)
            if old is not None:  # another save of the run committed meanwhile
                self._pooled -= sum(map(len, old.buffers()))
                self._to_spare(old.buffers())
            save.held = 0
            self._to_spare(unused)
            if not self._closed:
                kept = _RunCopies(version_id, left)
                self._runs[run] = kept
                self._pooled += sum(map(len, kept.buffers()))


class SaveCopies:
    """One save's view: the previous save's copies to take bases from, the copies
    this save leaves for the next."""

    def __init__(self, pool: BaseCopies, previous: dict[Place, Left], held: int, *,
                 continuing: bool = False) -> None:
        self._pool = pool
        self._previous = previous
        #: whether the handle saved the version this save builds on (else: no copies)
        self._continuing = continuing
        self._next: dict[Place, Left] = {}
        #: bytes of the buffers this save holds (counted by the pool, under its lock)
        self.held = held

    def copy_first(self, place: Place) -> bool:
        """Whether to copy the chunk at ``place`` before hashing it: the save continues
        the handle's run, and its last save wrote this place anew or did not save it."""
        if not self._continuing:
            return False
        with self._pool.lock:
            left = self._previous.get(place)
        return left is None or left[2]

    def buffer(self, size: int) -> bytearray | None:
        """A buffer for a copy (a spare one first), or None over the budget."""
        return self._pool._buffer(self, size)

    def base(self, place: Place, digest: Digest) -> bytearray | None:
        """The copy of ``digest`` the last save left at ``place`` (taken: a place's base
        serves one chunk), or None.  Hand it back with :meth:`release` once used."""
        with self._pool.lock:
            left = self._previous.pop(place, None)
        if left is None or left[1] is None:
            return None
        if left[0] != digest:
            self.release(left[1])
            return None
        return left[1]

    def leave(self, place: Place, digest: Digest, copy: bytearray | None, *, written: bool,
              as_base: bool) -> None:
        """Record what this save stored at ``place`` (``written``: anew, not reused):
        ``copy`` is kept for the next save when the chunk may be its base
        (``as_base``), else given back."""
        kept = copy if as_base else None
        with self._pool.lock:
            self._next[place] = (digest, kept, written)
        if copy is not None and kept is None:
            self.release(copy)

    def release(self, copy: bytearray | None) -> None:
        if copy is not None:
            self._pool._give_back(self, [copy])

    def commit(self, run: str, version_id: str) -> None:
        """The save is published: its copies serve the run's next save."""
        with self._pool.lock:
            previous, self._previous = self._previous, {}
            left, self._next = self._next, {}
        unused = [copy for _, copy, _ in previous.values() if copy is not None]
        self._pool._keep(self, run, version_id, left, unused)

    def drop(self) -> None:
        """The save was abandoned: every buffer goes back to the spare list."""
        with self._pool.lock:
            previous, self._previous = self._previous, {}
            left, self._next = self._next, {}
        self._pool._give_back(self, [copy for _, copy, _ in (*previous.values(), *left.values())
                                     if copy is not None])
