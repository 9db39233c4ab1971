"""Copies of a save's chunks that the run's next save encodes deltas against.

A delta save (:mod:`chunkstore.delta`) encodes a changed chunk against the
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
- the base object is still claimed, fenced and checked to exist exactly as
  before (``VersionWriter._reusable``): the copy replaces only the read of its
  content.  That the stored object still holds those bytes is then trusted
  as a deduplicated chunk's is (reused by digest, never read back); ``verify``
  checks both.

Memory: the handle's copies, with the spare buffers kept for the next save
(so a save does not fault in fresh pages), hold at most
``Store.base_copy_bytes`` in all; what does not fit is read back as before.
A chunk is copied only where the last save wrote that position anew (or the
tensor is new to the handle): positions that stay unchanged (frozen layers)
are not copied again.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

from chunkstore.digest import Digest

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


class BaseCopies:
    """A store handle's copies by run, and its spare buffers, within one budget."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._runs: dict[str, _RunCopies] = {}
        self._spare: list[bytearray] = []
        self._owned = 0  # bytes of every buffer this object handed out and not dropped
        self._lock = threading.Lock()

    def for_save(self, run: str, parent_id: str | None) -> SaveCopies:
        """The copies a save of ``run`` on top of ``parent_id`` may use; the run's
        copies are handed over to it (a second save of the run sees none)."""
        with self._lock:
            held = self._runs.pop(run, None)
        previous: dict[Place, Left] = {}
        if held is not None:
            if held.version_id == parent_id:
                previous = held.left
            else:  # another process saved the run since: these are no one's base
                self._release(buf for _, buf, _ in held.left.values())
        return SaveCopies(self, previous)

    def clear(self) -> None:
        with self._lock:
            self._runs.clear()
            self._spare.clear()
            self._owned = 0

    def buffer(self, size: int) -> bytearray | None:
        """A buffer of ``size`` bytes (a spare one first), or None over the budget."""
        with self._lock:
            for i, spare in enumerate(self._spare):
                if len(spare) == size:
                    return self._spare.pop(i)
            while self._spare and self._owned + size > self.budget:
                self._owned -= len(self._spare.pop())
            if self._owned + size > self.budget:
                return None
            self._owned += size
        return bytearray(size)

    def _release(self, buffers: Iterable[bytearray | None]) -> None:
        with self._lock:
            for buf in buffers:
                if buf is not None:
                    self._spare.append(buf)

    def _keep(self, run: str, version_id: str, left: dict[Place, Left]) -> None:
        with self._lock:
            old = self._runs.pop(run, None)
            self._runs[run] = _RunCopies(version_id, left)
        if old is not None:
            self._release(buf for _, buf, _ in old.left.values())


class SaveCopies:
    """One save's view: the previous save's copies to take bases from, the copies
    this save leaves for the next."""

    def __init__(self, pool: BaseCopies, previous: dict[Place, Left]) -> None:
        self._pool = pool
        self._previous = previous
        self._next: dict[Place, Left] = {}
        self._lock = threading.Lock()

    def copy_first(self, place: Place) -> bool:
        """Whether to copy the chunk at ``place`` before hashing it: the last save
        wrote this place anew, or this handle has not saved it."""
        with self._lock:
            left = self._previous.get(place)
        return left is None or left[2]

    def buffer(self, size: int) -> bytearray | None:
        return self._pool.buffer(size)

    def base(self, place: Place, digest: Digest) -> bytearray | None:
        """The copy of ``digest`` the last save left at ``place`` (taken: a place's base
        serves one chunk), or None.  Hand it back with :meth:`release` once used."""
        with self._lock:
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
        with self._lock:
            self._next[place] = (digest, kept, written)
        if copy is not None and kept is None:
            self.release(copy)

    def release(self, copy: bytearray | None) -> None:
        if copy is not None:
            self._pool._release((copy,))

    def commit(self, run: str, version_id: str) -> None:
        """The save is published: its copies serve the run's next save."""
        with self._lock:
            previous, self._previous = self._previous, {}
            left, self._next = self._next, {}
        self._pool._release(buf for _, buf, _ in previous.values())
        self._pool._keep(run, version_id, left)

    def drop(self) -> None:
        """The save was abandoned: every buffer goes back to the spare list."""
        with self._lock:
            previous, self._previous = self._previous, {}
            left, self._next = self._next, {}
        self._pool._release(buf for _, buf, _ in (*previous.values(), *left.values()))
