"""The storage interface every backend implements.

Keys are ``/``-separated relative paths of ASCII letters, digits, ``-``, ``_``
and ``.`` (e.g. ``chunks/ab/ab12...``); the store builds every key, so a
backend may assume they are well formed.  Backends raise the built-in
``FileNotFoundError`` for a missing key and never translate it into domain
errors: the store does that.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

#: Keys one request of :meth:`Backend.delete_many` removes at most (S3's DeleteObjects
#: takes 1,000): a wrapper that counts requests counts one per this many keys.
DELETE_BATCH = 1000


@dataclass(frozen=True)
class ObjectInfo:
    """Size in bytes and modification time (seconds since the epoch) of one object."""

    key: str
    size: int
    mtime: float


class Backend(abc.ABC):
    """A flat key -> bytes namespace with durable, atomic writes."""

    #: URL the backend was opened with, for messages.
    url: str = ""

    @abc.abstractmethod
    def put(self, key: str, data: bytes | memoryview) -> None:
        """Store ``data`` under ``key``, replacing any previous object.

        Atomic (a reader sees the old object or the whole new one, never a
        part) and durable on return (file and directory fsynced locally; a
        completed PUT on object stores).  Idempotent.
        """

    @abc.abstractmethod
    def put_if_absent(self, key: str, data: bytes | memoryview) -> bool:
        """Create ``key`` only if no object has that key; return whether it wrote.

        Atomic against concurrent creators of the same key: exactly one of
        them gets ``True``.  Durable on return like :meth:`put`.
        """

    @abc.abstractmethod
    def get(self, key: str) -> bytes:
        """Return the whole object; ``FileNotFoundError`` if it is absent."""

    @abc.abstractmethod
    def stat(self, key: str) -> ObjectInfo:
        """Return size and modification time; ``FileNotFoundError`` if absent."""

    @abc.abstractmethod
    def delete(self, key: str) -> bool:
        """Remove the object; return whether it existed.

        Idempotent: a missing key returns ``False`` and never raises.
        """

    @abc.abstractmethod
    def list(self, prefix: str = "") -> Iterator[str]:
        """Yield every key that starts with ``prefix``, in ascending byte order."""

    # --- derived conveniences: correct for every backend, overridden where faster ---

    def exists(self, key: str) -> bool:
        """Return whether an object is stored under ``key``."""
        try:
            self.stat(key)
        except FileNotFoundError:
            return False
        return True

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """Return up to ``length`` bytes from offset ``start`` (fewer at the end of the object)."""
        return self.get(key)[start : start + length]

    def view_range(self, key: str, start: int, length: int, *, populate: bool = True
                   ) -> bytes | memoryview:
        """:meth:`get_range`'s bytes as a read-only buffer, which a backend may map from
        the stored object instead of copying (:class:`LocalBackend`): for a reader that
        is done with the bytes once it has decoded them.  The bytes never change while
        the buffer is referenced (a store never rewrites an object in place).
        ``populate=False``: a mapping is left unpopulated (see the local backend's)."""
        return self.get_range(key, start, length)

    def read_into(self, key: str, start: int, buffer: memoryview) -> int:
        """Fill ``buffer`` from offset ``start`` of the object; return the bytes read.

        ``buffer`` is a writable byte (format ``"B"``) memoryview.  Returns fewer
        than ``len(buffer)`` only when the object ends first; bytes past that
        are left untouched.
        """
        data = self.get_range(key, start, len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def list_info(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Yield :class:`ObjectInfo` for each key under ``prefix``, in :meth:`list` order.

        Objects deleted between listing and stat are skipped.
        """
        for key in self.list(prefix):
            try:
                yield self.stat(key)
            except FileNotFoundError:
                continue

    def local_path(self) -> str | None:
        """Return the root directory when the backend is a local filesystem, else None."""
        return None

    def listing_stamp(self, prefix: str) -> str | None:
        """An opaque value that changes whenever a key directly under the folder
        ``prefix`` (ending in ``/``) is created or removed; None where the backend
        cannot tell that cheaply and for sure.

        A stamp read before a :meth:`list` of ``prefix`` that a later call returns
        again means nothing was added or removed since: that listing holds what the
        folder holds now.  The default says nothing (None): a caller then lists.
        """
        return None

    def put_if_absent_deferred(self, key: str, data: bytes | memoryview) -> bool:
        """``put_if_absent`` whose durability may wait for the next :meth:`flush`.

        For many small objects written before one commit point: a backend can
        make them all durable at once instead of one by one.  The default is
        simply ``put_if_absent``, durable on return.
        """
        return self.put_if_absent(key, data)

    def put_pieces_if_absent_deferred(self, key: str, pieces: Sequence[bytes | memoryview]
                                      ) -> bool:
        """:meth:`put_if_absent_deferred` of the object ``pieces`` laid end to end (a
        pack: its header and members).  The default joins them first; a backend that
        writes them as they are (:class:`LocalBackend`) saves a copy of the object."""
        return self.put_if_absent_deferred(key, b"".join(pieces))

    def delete_many(self, keys: Sequence[str]) -> None:
        """:meth:`delete` every key (a missing one is skipped): each removal durable on
        return, as :meth:`delete`'s.  Where the storage has a bulk delete, in one
        request per :data:`DELETE_BATCH` keys.  In no particular order: a failure (an
        exception) may leave any of them deleted and any not.  The default deletes
        them one by one."""
        for key in keys:
            self.delete(key)

    def discard(self, key: str) -> bool:
        """``delete`` for an object whose removal need not survive a crash (a save's
        session marker: after a crash its process is dead anyway).  Visible to
        every reader on return; a backend may skip what makes it durable."""
        return self.delete(key)

    def flush(self) -> None:  # noqa: B027 - durable-on-return backends have nothing to do
        """Make every write made so far durable (see :meth:`put_if_absent_deferred`)."""

    def remove_temporaries(self, older_than: float, dry_run: bool = False) -> int:
        """Delete leftovers of interrupted writes last modified before ``older_than``
        (a UNIX time); return how many there were.  Backends whose writes leave
        nothing behind (object stores: a PUT is whole or absent) have none."""
        return 0

    def remove_folders(self, prefixes: Sequence[str]) -> int:
        """Remove each folder ``prefixes`` names (a key prefix ending in ``/``) that
        holds nothing; one that holds anything, or does not exist, stays.  Return how
        many went.  Object stores have no folders (a prefix is only part of its keys'
        names): nothing to remove."""
        return 0

    def close(self) -> None:  # noqa: B027 - optional hook; most backends hold nothing
        """Release connections or handles; the backend is unusable afterwards."""
