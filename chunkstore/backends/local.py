"""Local-disk backend: plain ``os`` calls, every write made durable explicitly.

fsspec's local filesystem does not fsync, so a power cut could lose an object
the store already counts as written.  Here every write follows the same
recipe: temp file beside the target, fsync it, move it into place
atomically, fsync the directory that now names it.

Layout: key ``a/b/c`` is the file ``<root>/a/b/c``.  Temp files are named
``.tmp-<random>`` and never listed; a crash can leave some behind (they are
harmless and may be deleted at any time).  Where the filesystem has
``O_TMPFILE`` (Linux: ext4, xfs, btrfs, tmpfs), put-if-absent writes an
unnamed file and links it into place: no temp name to create and unlink,
and nothing left behind by a crash.  Top-level names in
:attr:`LocalBackend.IGNORED_TOP_LEVEL` belong to the store itself (the LMDB
index) and are neither listed nor accepted as key prefixes.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import platform
import re
import secrets
import stat as stat_module
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import ClassVar

import numpy as np

from chunkstore.backends.base import Backend, ObjectInfo
from chunkstore.backends.folderstamp import file_system_of, folder_stamp
from chunkstore.errors import StorageFullError

#: errno values that mean the filesystem has no room for the write.
_NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})
#: errno values of an ``O_TMPFILE`` open where the filesystem does not support it.
_NO_TMPFILE = frozenset({errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL,
                         getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)})

#: Deferred objects at least this large are fsynced on write (their directory
#: entries still wait for the syncfs).
EAGER_SYNC_BYTES = 1 << 20
#: Ranged reads of at least this many bytes may be mapped (:meth:`LocalBackend.view_range`):
#: below it a read's copy costs less than a mapping's set-up and removal.  Read and
#: hashed from the page cache by a warm process: 64 KiB 15 us copied against 26 us
#: mapped, 256 KiB 46 against 51, 1 MiB 189 against 184, 8 MiB 1.85 ms against 1.17;
#: a new process also faults in every copy's fresh memory (MLP restore: 1,700 more
#: page faults and 2-3 ms more with 1 MiB here).
MAP_MIN_BYTES = 256 * 1024
#: madvise(2) advice that populates a mapping and fails on a read error (Linux 5.14 and
#: later; Python 3.11's mmap module does not name it); None where reads are never mapped.
_POPULATE_READ: int | None = getattr(mmap, "MADV_POPULATE_READ",
                                     22 if sys.platform == "linux" else None)
#: Files :meth:`LocalBackend.delete_many` unlinks at once.  An unlink frees its file's
#: blocks in the call, which waits on the filesystem's journal (and on a disk mounted
#: with ``discard``, on the trim): on this project's 2-core machine 500 records took
#: 0.7-1.6 s unlinked one after another and 0.05-0.08 s from 8 threads.
UNLINK_THREADS = 8
#: Set to ``file`` to fsync every object on its own instead of one syncfs per save.
SYNC_ENV_VAR = "CHUNKSTORE_LOCAL_SYNC"
#: Set to ``0`` to write new objects through named temp files even where the
#: filesystem has ``O_TMPFILE``.
UNNAMED_ENV_VAR = "CHUNKSTORE_LOCAL_TMPFILE"


def _libc() -> ctypes.CDLL:
    """The C library as the process has it loaded, without a search for its file
    (``ctypes.util.find_library`` runs ``ldconfig -p``: about 1.5 ms, twice, in every
    process that opens a local store).  ``TypeError`` where the platform cannot name
    the process itself (Windows)."""
    return ctypes.CDLL(None, use_errno=True)


def _load_syncfs() -> Callable[[int], int] | None:
    """libc's syncfs(2), where the platform has it (Linux)."""
    try:
        function = _libc().syncfs
    except (OSError, AttributeError, TypeError):
        return None
    function.argtypes = [ctypes.c_int]
    function.restype = ctypes.c_int
    return function


_SYNCFS = _load_syncfs()
#: The first Linux release whose syncfs(2) returns write-back errors (as fsync does);
#: before it, syncfs returns 0 even when the disk failed to take the data.
SYNCFS_REPORTS_ERRORS_SINCE = (5, 8)


def syncfs_reports_errors(release: str) -> bool:
    """Whether a Linux kernel of ``release`` (``platform.release()``, such as
    ``"5.4.0-150-generic"``) returns write-back errors from syncfs(2).  A release
    that cannot be read counts as one that does not."""
    match = re.match(r"(\d+)\.(\d+)", release)
    if match is None:
        return False
    return (int(match[1]), int(match[2])) >= SYNCFS_REPORTS_ERRORS_SINCE


def _load_linkat() -> Callable[[int, bytes, int, bytes, int], int] | None:
    """libc's linkat(2), to name an ``O_TMPFILE`` file, where the platform has both."""
    if not hasattr(os, "O_TMPFILE"):
        return None
    try:
        function = _libc().linkat
    except (OSError, AttributeError, TypeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                         ctypes.c_int]
    function.restype = ctypes.c_int
    return function


_LINKAT = _load_linkat()
#: A file system type not looked up yet.
_UNKNOWN = "?"
_AT_FDCWD = -100
_AT_SYMLINK_FOLLOW = 0x400
#: An object's bytes, or its pieces laid end to end (a pack written without a join).
_Data = bytes | memoryview | list[bytes | memoryview]
#: Pieces one ``writev`` takes (the system's limit, 1024 on Linux).
_IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024) if hasattr(os, "sysconf") else 16
_OPEN_FLAGS_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)


class LocalBackend(Backend):
    """Objects as files under ``root``; writes are atomic and durable on return."""

    #: Top-level directory names the store keeps for itself (never keys).
    IGNORED_TOP_LEVEL: ClassVar[frozenset[str]] = frozenset({"index"})
    #: Basename prefix of in-flight temp files (never keys).
    TEMP_PREFIX: ClassVar[str] = ".tmp-"
    #: Whether :meth:`view_range` maps larger ranges (False where the platform has no
    #: way to populate a mapping and learn of a read error, or the kernel refused it).
    map_reads: ClassVar[bool] = _POPULATE_READ is not None

    def __init__(self, root: str, *, batch_sync: bool | None = None) -> None:
        """Use ``root`` (made absolute) as the store directory; it is created on first write.

        ``batch_sync`` (default: where the OS has syncfs(2), unless the
        environment sets ``CHUNKSTORE_LOCAL_SYNC=file``) makes
        :meth:`put_if_absent_deferred` skip the per-file fsyncs, and
        :meth:`flush` make everything durable with one syncfs of the
        filesystem: one flush per save instead of two fsyncs per object.
        Never on a kernel before Linux 5.8, whatever ``batch_sync`` says: its
        syncfs does not report write-back errors, so a save could publish a
        version whose objects the disk never took; there every object is
        fsynced on its own (:func:`syncfs_reports_errors`).
        """
        self.root = os.path.abspath(os.path.expanduser(root))
        self.url = self.root
        if batch_sync is None:
            batch_sync = os.environ.get(SYNC_ENV_VAR, "batch") != "file"
        self.batch_sync = (batch_sync and _SYNCFS is not None
                           and syncfs_reports_errors(platform.release()))
        # Unnamed temp files (O_TMPFILE + linkat) until the filesystem refuses them.
        self._unnamed = _LINKAT is not None and os.environ.get(UNNAMED_ENV_VAR) != "0"
        # The folders deferred writes went to, or found their object in, since the last
        # flush: flush syncs the filesystem of each, since a folder (chunks/, or any
        # below the root) may be a mount point or a symlink to another device, which a
        # syncfs of the root's filesystem does not reach.
        self._unsynced_dirs: set[str] = set()
        self._unsynced_lock = threading.Lock()
        # The file system the root lies on (listing_stamp), looked up when first asked.
        self._file_system: str | None = _UNKNOWN

    # --- the abstract interface ----------------------------------------------------------

    def put(self, key: str, data: bytes | memoryview) -> None:
        """Atomically replace ``key``; durable (file and directory fsynced) on return."""
        target = self._path(key)
        with _space_as_typed(key):
            temp = self._write_temp(target, data)
        try:
            # rename(2) within one directory is atomic: readers see the old file
            # or the complete new one, never a partial write.
            os.replace(temp, target)
        except BaseException:
            _unlink_quietly(temp)
            raise
        # The rename lives in the directory; until the directory is fsynced a
        # crash can bring back the old name (or no name at all).
        _fsync_dir(os.path.dirname(target))

    def put_if_absent(self, key: str, data: bytes | memoryview) -> bool:
        """Create ``key`` unless it exists; exactly one concurrent creator gets ``True``."""
        return self._link_new(key, data, deferred=False)

    def put_if_absent_deferred(self, key: str, data: bytes | memoryview) -> bool:
        """``put_if_absent`` without fsyncs when batching: durable after :meth:`flush`."""
        return self._link_new(key, data, deferred=self.batch_sync)

    def put_pieces_if_absent_deferred(self, key: str, pieces: Sequence[bytes | memoryview]
                                      ) -> bool:
        """Written piece by piece (``writev``): no joined copy of a pack in memory."""
        return self._link_new(key, [*pieces], deferred=self.batch_sync)

    def _link_new(self, key: str, data: _Data, *, deferred: bool) -> bool:
        target = self._path(key)
        if deferred:
            # Noted before the write: whatever lands there (or is found there, made
            # by another writer that batches) waits for the flush of this filesystem.
            self._note_unsynced(os.path.dirname(target))
        # Deferred: a large object is still fsynced now, in this worker thread, so
        # its write-back overlaps the hashing of the next ones; small ones and
        # the directory entry wait for the syncfs in flush().
        sync = not deferred or _length(data) >= EAGER_SYNC_BYTES
        with _space_as_typed(key):
            created = self._link_unnamed(target, data, sync) if self._unnamed else None
        if created is not None:
            if not deferred:
                _sync_found(target, created)  # see below
            return created
        with _space_as_typed(key):
            temp = self._write_temp(target, data, sync=sync)
        try:
            # link(2) fails with EEXIST if the target exists, atomically, and
            # publishes the complete file (rename would overwrite).
            os.link(temp, target)
            created = True
        except FileExistsError:
            created = False
        finally:
            _unlink_quietly(temp)
        if not deferred:
            # This also persists the temp file's removal.
            _sync_found(target, created)
        return created

    def _link_unnamed(self, target: str, data: _Data, sync: bool) -> bool | None:
        """Create ``target`` from an ``O_TMPFILE`` file: True if created, False if it
        existed; None where the filesystem cannot (then never tried again)."""
        directory = os.path.dirname(target)
        _make_dirs_durably(directory)
        try:
            fd = os.open(directory, os.O_TMPFILE | os.O_WRONLY | getattr(os, "O_CLOEXEC", 0),
                         0o666)
        except OSError as exc:
            if exc.errno not in _NO_TMPFILE:
                raise
            self._unnamed = False  # this filesystem has no O_TMPFILE
            return None
        try:
            _write_all(fd, data)
            if sync:  # the data on disk before any name points at it
                os.fsync(fd)
            assert _LINKAT is not None
            if _LINKAT(_AT_FDCWD, f"/proc/self/fd/{fd}".encode(), _AT_FDCWD,
                       os.fsencode(target), _AT_SYMLINK_FOLLOW) == 0:
                return True
            err = ctypes.get_errno()
            if err == errno.EEXIST:
                return False
            if err == errno.ENOENT and not os.path.isdir("/proc/self/fd"):
                self._unnamed = False  # no /proc to name the file by
                return None
            raise OSError(err, os.strerror(err), target)
        finally:
            os.close(fd)

    def flush(self) -> None:
        """syncfs(2) every filesystem written since the last flush: every file and name
        written so far is durable.

        One call per filesystem (``st_dev``): the root's, and that of each folder a
        deferred write went to or an object was found in (:meth:`exists`), because a
        folder may be another filesystem (a mount point, a symlink to another device)
        whose writes a syncfs of the root's filesystem leaves in memory: a power cut
        would then keep the commit record that follows and lose the objects it names.
        Each call also flushes what other programs wrote to that filesystem.
        """
        if not self.batch_sync or _SYNCFS is None or not os.path.isdir(self.root):
            return
        with self._unsynced_lock:
            directories, self._unsynced_dirs = self._unsynced_dirs, set()
        try:
            for directory in _one_per_device([self.root, *sorted(directories)]):
                _syncfs(directory)
        except BaseException:
            with self._unsynced_lock:  # not durable: the next flush tries them again
                self._unsynced_dirs |= directories
            raise

    def exists(self, key: str) -> bool:
        """Whether an object is stored under ``key``.  While batching, the folder of an
        object found is synced by the next :meth:`flush`: the object may be another
        batching writer's, not yet durable, that a save is about to rely on (dedup)."""
        found = super().exists(key)
        if found and self.batch_sync:
            self._note_unsynced(os.path.dirname(self._path(key)))
        return found

    def _note_unsynced(self, directory: str) -> None:
        with self._unsynced_lock:
            self._unsynced_dirs.add(directory)

    def get(self, key: str) -> bytes:
        """Return the whole file; ``FileNotFoundError`` if absent."""
        path = self._path(key)
        with _missing_as_not_found(key), open(path, "rb") as file:
            return file.read()

    def stat(self, key: str) -> ObjectInfo:
        """Return size and mtime from ``os.stat``; ``FileNotFoundError`` if no such file."""
        path = self._path(key)
        with _missing_as_not_found(key):
            st = os.stat(path)
            if not stat_module.S_ISREG(st.st_mode):
                raise FileNotFoundError(f"no object {key!r} (a directory has that name)")
            return ObjectInfo(key=key, size=st.st_size, mtime=st.st_mtime)

    def delete(self, key: str) -> bool:
        """Unlink the file, fsync its directory; return whether it existed."""
        path = self._path(key)
        try:
            os.unlink(path)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return False
        # Without the directory fsync a crash can resurrect the deleted name.
        _fsync_dir(os.path.dirname(path))
        return True

    def delete_many(self, keys: Sequence[str]) -> None:
        """Unlink every file, :data:`UNLINK_THREADS` at a time, then fsync each directory
        they were in once: one fsync for a thousand records of one folder where
        :meth:`delete` makes a thousand."""
        paths = [self._path(key) for key in keys]
        # Until every unlink has answered, any of them may have happened.
        directories = {os.path.dirname(path) for path in paths}
        try:
            if len(paths) > 1:
                with ThreadPoolExecutor(min(UNLINK_THREADS, len(paths)),
                                        thread_name_prefix="chunkstore-unlink") as pool:
                    found = list(pool.map(_unlinked, paths))
            else:
                found = [_unlinked(path) for path in paths]
            directories = {os.path.dirname(path)
                           for path, was in zip(paths, found, strict=True) if was}
        finally:  # the removals durable, those before a failure too
            for directory in sorted(directories):
                with contextlib.suppress(FileNotFoundError):
                    _fsync_dir(directory)

    def discard(self, key: str) -> bool:
        """Unlink the file without the directory fsync (see :meth:`Backend.discard`)."""
        try:
            os.unlink(self._path(key))
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return False
        return True

    def list(self, prefix: str = "") -> Iterator[str]:
        """Yield keys starting with ``prefix`` in ascending byte order, streaming.

        Only the directory the prefix implies is walked (``chunks/ab`` walks
        ``chunks/``); temp files and :attr:`IGNORED_TOP_LEVEL` are skipped.
        """
        _check_relative(prefix)
        start_rel = prefix[: prefix.rfind("/") + 1]  # "" or ends with "/"
        if start_rel.split("/", 1)[0] in self.IGNORED_TOP_LEVEL:
            return
        yield from self._walk_sorted(os.path.join(self.root, start_rel), start_rel, prefix)

    # --- faster derived conveniences -----------------------------------------------------

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """Read ``length`` bytes at ``start`` with ``os.pread`` (fewer at the end)."""
        _check_range(start, length)
        path = self._path(key)
        with _missing_as_not_found(key):
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            try:
                return _pread(fd, start, length)
            finally:
                os.close(fd)

    def view_range(self, key: str, start: int, length: int, *, populate: bool = True
                   ) -> bytes | memoryview:
        """The file's bytes mapped read-only where the range read holds at least
        :data:`MAP_MIN_BYTES` (populated at once, where the kernel reports a read error
        doing so), else :meth:`get_range`'s.  ``populate=False``: a mapped range is left
        unpopulated, for a reader that populates each part just before it reads it
        (:func:`populate_mapped`, which raises the read error) and releases it once
        decoded (:func:`release_mapped`): what the process holds resident is then one
        part of the range, not all of it.  A mapped range costs no copy and no fresh
        memory: a restore in a new process paid a page fault per 4 KiB of every buffer
        it read packs into (docs/performance.md, resume as a job: a new process
        restored an MLP's 126 MB state in 1.20x torch.load's time, against 1.57x for the
        code before the mapped reads, in one run at 647b446).

        A range that cannot be mapped (a filesystem without mmap) or populated (a read
        error) is read by ``pread``, which raises the error as any read does.  A store
        never shortens a file in place (objects are written under a temporary name and
        renamed, deleted by unlinking, which leaves a mapping readable), so the mapping
        stays valid; a file cut short by something else while mapped, or a page
        evicted and then unreadable, ends the process with SIGBUS, never with wrong
        bytes.  Keep such a view no longer than its decode (caches copy it:
        :class:`chunkstore.handle.caches.BaseCache`)."""
        _check_range(start, length)
        path = self._path(key)
        advice = _POPULATE_READ
        with _missing_as_not_found(key):
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            try:
                if length >= MAP_MIN_BYTES and advice is not None and LocalBackend.map_reads:
                    end = min(os.fstat(fd).st_size, start + length)
                    if end - start >= MAP_MIN_BYTES:  # else what the file holds is small
                        mapped = _mapped(fd, start, end, advice if populate else None)
                        if mapped is not None:
                            return mapped
                return _pread(fd, start, length)
            finally:
                os.close(fd)

    def read_into(self, key: str, start: int, buffer: memoryview) -> int:
        """Fill ``buffer`` straight from the file (no intermediate copy); return bytes read."""
        _check_range(start, len(buffer))
        path = self._path(key)
        # buffering=0 gives a raw FileIO, whose readinto writes into the
        # caller's memory directly.
        with _missing_as_not_found(key), open(path, "rb", buffering=0) as file:
            file.seek(start)
            filled = 0
            while filled < len(buffer):
                count = file.readinto(buffer[filled:])
                if not count:  # end of file
                    break
                filled += count
            return filled

    def local_path(self) -> str:
        """Return the root directory."""
        return self.root

    def listing_stamp(self, prefix: str) -> str | None:
        """The folder's device, inode and times, where they vouch for its names
        (:mod:`chunkstore.backends.folderstamp`: a settled folder on a local file
        system that keeps them); None otherwise, and for a prefix that is no folder."""
        _check_relative(prefix)
        if not prefix.endswith("/"):
            return None
        if self._file_system is _UNKNOWN:
            self._file_system = file_system_of(self.root)
        return folder_stamp(os.path.join(self.root, prefix), self._file_system)

    # --- helpers -------------------------------------------------------------------------

    def _path(self, key: str) -> str:
        """Map a key to its file path, refusing keys that could escape the root."""
        _check_relative(key)
        parts = key.split("/")
        if not key or "" in parts or "." in parts:
            raise ValueError(f"malformed key {key!r}")
        if parts[0] in self.IGNORED_TOP_LEVEL:
            raise ValueError(f"key {key!r} is inside the reserved directory {parts[0]!r}")
        if parts[-1].startswith(self.TEMP_PREFIX):
            raise ValueError(f"key {key!r} would be taken for a temp file")
        return os.path.join(self.root, *parts)

    def _write_temp(self, target: str, data: _Data, sync: bool = True) -> str:
        """Write ``data`` to a fresh temp file beside ``target`` (fsynced unless ``sync``
        is false); return its path."""
        directory = os.path.dirname(target)
        _make_dirs_durably(directory)
        # Same directory as the target: rename/link never cross filesystems.
        temp = os.path.join(directory, f"{self.TEMP_PREFIX}{secrets.token_hex(8)}")
        fd = os.open(temp, _OPEN_FLAGS_NEW, 0o666)
        try:
            _write_all(fd, data)
            # The data must be on disk before any name points at it; otherwise a
            # crash after the rename could leave a complete-looking empty file.
            # (Deferred writes get there by the syncfs before their commit point.)
            if sync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            _unlink_quietly(temp)
            raise
        os.close(fd)
        return temp

    def remove_folders(self, prefixes: Sequence[str]) -> int:
        """``rmdir`` each empty folder, then fsync each parent of one removed (once)."""
        parents: set[str] = set()
        removed = 0
        for prefix in prefixes:
            if not prefix.endswith("/"):
                raise ValueError(f"folder {prefix!r} must end in '/'")
            path = self._path(prefix[:-1])
            try:
                os.rmdir(path)
            except OSError as exc:  # it holds something (a write is under way), or is gone
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
                    raise
                continue
            removed += 1
            parents.add(os.path.dirname(path))
        for parent in sorted(parents):
            _fsync_dir(parent)
        return removed

    def remove_temporaries(self, older_than: float, dry_run: bool = False) -> int:
        """Delete ``.tmp-*`` files (left by killed writes) older than ``older_than``."""
        found = 0
        for directory, subdirs, files in os.walk(self.root):
            if directory == self.root:
                subdirs[:] = [d for d in subdirs if d not in self.IGNORED_TOP_LEVEL]
            for name in files:
                if not name.startswith(self.TEMP_PREFIX):
                    continue
                path = os.path.join(directory, name)
                with contextlib.suppress(FileNotFoundError):
                    if os.stat(path).st_mtime < older_than:
                        found += 1
                        if not dry_run:
                            _unlink_quietly(path)
        return found

    def _walk_sorted(self, directory: str, rel: str, prefix: str) -> Iterator[str]:
        """Yield keys under ``directory`` (key prefix ``rel``) matching ``prefix``, sorted.

        Siblings are ordered by name, a directory as ``name + "/"``: every key
        below it starts with that string, so the output is in byte order.
        """
        try:
            with os.scandir(directory) as entries:
                found = [
                    (f"{rel}{e.name}/" if e.is_dir(follow_symlinks=False) else f"{rel}{e.name}")
                    for e in entries
                    if not e.name.startswith(self.TEMP_PREFIX)
                    and not (not rel and e.name in self.IGNORED_TOP_LEVEL)
                ]
        except (FileNotFoundError, NotADirectoryError):
            return
        for name in sorted(found):
            if name.endswith("/"):
                if name.startswith(prefix) or prefix.startswith(name):
                    yield from self._walk_sorted(os.path.join(self.root, name), name, prefix)
            elif name.startswith(prefix):
                yield name


@contextlib.contextmanager
def _missing_as_not_found(key: str) -> Iterator[None]:
    """Treat a path through a file, or naming a directory, as an absent object."""
    try:
        yield
    except (NotADirectoryError, IsADirectoryError):
        raise FileNotFoundError(f"no object {key!r}") from None


@contextlib.contextmanager
def _space_as_typed(key: str) -> Iterator[None]:
    """A full disk or exhausted quota is a typed error the CLI maps to exit 4; the
    temp file of the failed write has already been removed."""
    try:
        yield
    except OSError as exc:
        if exc.errno in _NO_SPACE:
            raise StorageFullError(key, exc.strerror or str(exc)) from exc
        raise


def _check_relative(key: str) -> None:
    """Reject absolute keys and ``..`` components (defence in depth: the store builds keys)."""
    if key.startswith("/") or "\\" in key or ".." in key.split("/"):
        raise ValueError(f"key {key!r} must be a relative path without '..'")


def _check_range(start: int, length: int) -> None:
    if start < 0 or length < 0:
        raise ValueError(f"invalid range: start={start}, length={length}")


def _length(data: _Data) -> int:
    return sum(map(len, data)) if isinstance(data, list) else len(data)


def _write_all(fd: int, data: _Data) -> None:
    """Write ``data`` (an object's bytes, or its pieces in order: ``writev``) whole."""
    if not isinstance(data, list):
        view = memoryview(data).cast("B")
        written = 0
        while written < len(view):
            written += os.write(fd, view[written:])
        return
    views = [memoryview(piece).cast("B") for piece in data if len(piece)]
    first = 0
    while first < len(views):
        written = os.writev(fd, views[first : first + _IOV_MAX])
        while written:  # past the pieces written whole, into one written in part
            if written >= len(views[first]):
                written -= len(views[first])
                first += 1
            else:
                views[first] = views[first][written:]
                written = 0


def _make_dirs_durably(directory: str) -> None:
    """Create ``directory`` and missing parents, fsyncing each new directory's parent.

    A new directory's name lives in its parent; without that fsync a crash
    could lose the directory together with the fsynced files inside it.
    """
    missing: list[str] = []
    path = directory
    while not os.path.isdir(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    for path in reversed(missing):
        # FileExistsError: a concurrent writer made it; fsync anyway, it may not have yet.
        with contextlib.suppress(FileExistsError):
            os.mkdir(path)
        _fsync_dir(os.path.dirname(path))


def _sync_found(target: str, created: bool) -> None:
    """Make ``target``'s name durable, and its data too when another writer created it.

    Even when we lost the race: the caller may now rely on the winner's object
    (dedup), and the winner may not have made it durable yet: a writer that batches
    its syncs links its objects unsynced and leaves them to its syncfs, which a
    writer that gave up never makes (after a power cut the file would be there,
    empty or truncated, under a published version).
    """
    if not created:
        with contextlib.suppress(FileNotFoundError):  # deleted since: not relied on
            fd = os.open(target, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    _fsync_dir(os.path.dirname(target))


def _one_per_device(directories: list[str]) -> list[str]:
    """The first of ``directories`` on each filesystem (by ``st_dev``, symlinks followed);
    one removed since it was written holds nothing left to sync."""
    chosen: dict[int, str] = {}
    for directory in directories:
        try:
            device = os.stat(directory).st_dev
        except FileNotFoundError:
            continue
        chosen.setdefault(device, directory)
    return list(chosen.values())


def _syncfs(directory: str) -> None:
    """syncfs(2) the filesystem ``directory`` lives on; OSError (StorageFullError for
    no space) when write-back failed."""
    assert _SYNCFS is not None
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        if _SYNCFS(fd) != 0:
            err = ctypes.get_errno()
            with _space_as_typed(directory):
                raise OSError(err, f"syncfs of {directory} failed: {os.strerror(err)}")
    finally:
        os.close(fd)


def _fsync_dir(directory: str) -> None:
    """Flush a directory's entries (names created, renamed or removed) to disk."""
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlinked(path: str) -> bool:
    """Unlink ``path``; whether there was a file to unlink."""
    try:
        os.unlink(path)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return False
    return True


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _pread(fd: int, start: int, length: int) -> bytes:
    """Up to ``length`` bytes of ``fd`` from ``start`` (fewer at the end of the file)."""
    if length > MAP_MIN_BYTES:  # pread allocates what it is asked for: a length past the
        # end (a crafted or damaged location) would ask for memory the file never holds
        length = min(length, max(os.fstat(fd).st_size - start, 0))
    parts: list[bytes] = []
    done = 0
    while done < length:
        part = os.pread(fd, length - done, start + done)
        if not part:  # end of file
            break
        parts.append(part)
        done += len(part)
    return b"".join(parts)


def _mapped(fd: int, start: int, end: int, advice: int | None) -> memoryview | None:
    """Bytes ``start`` to ``end`` of ``fd`` mapped read-only and populated (``advice``;
    None: left unpopulated); None where they cannot be (the caller reads them instead)."""
    aligned = start - start % mmap.ALLOCATIONGRANULARITY
    try:
        mapped = mmap.mmap(fd, end - aligned, access=mmap.ACCESS_READ, offset=aligned)
    except (OSError, ValueError):  # no mmap on this filesystem, no map left to the process
        return None
    if advice is None:
        return memoryview(mapped)[start - aligned:]
    try:
        mapped.madvise(advice)
    except OSError as exc:
        mapped.close()
        if exc.errno == errno.EINVAL:  # a kernel before 5.14: copy from now on
            LocalBackend.map_reads = False
        return None
    return memoryview(mapped)[start - aligned:]  # read-only, as the mapping is


def _mapped_pages(view: bytes | memoryview, outward: bool) -> tuple[mmap.mmap, int, int] | None:
    """The mapping of :meth:`LocalBackend.view_range` that ``view`` is a part of and
    the page-aligned span of it that ``view`` covers (``outward``: every page it
    touches; else only those wholly inside it), or None for bytes not mapped there."""
    mapping = view.obj if isinstance(view, memoryview) else None
    if not isinstance(mapping, mmap.mmap) or not len(view):
        return None
    base = np.frombuffer(mapping, np.uint8).ctypes.data
    begin = int(np.frombuffer(view, np.uint8).ctypes.data) - base
    end = begin + len(view)
    page = mmap.PAGESIZE
    if outward:
        begin, end = begin - begin % page, min(-(-end // page) * page, len(mapping))
    else:
        begin, end = -(-begin // page) * page, end - end % page
    return (mapping, begin, end) if end > begin else None


def populate_mapped(view: bytes | memoryview) -> None:
    """Populate the pages of ``view`` where it is a part of a range mapped with
    ``populate=False`` (:meth:`LocalBackend.view_range`), before it is read: a read error
    is raised here (``OSError``), never met as SIGBUS by the reader.  Nothing for bytes
    not mapped."""
    span = _mapped_pages(view, outward=True)
    if span is None or _POPULATE_READ is None:
        return
    mapping, begin, end = span
    try:
        mapping.madvise(_POPULATE_READ, begin, end - begin)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        LocalBackend.map_reads = False  # a kernel before 5.14: copy from now on


def release_mapped(view: bytes | memoryview) -> None:
    """Drop the pages wholly inside ``view`` from the process's resident memory where it
    is a part of a mapped range (``MADV_DONTNEED`` on a read-only file mapping: the
    page cache keeps them; a later read maps them again, populated first by
    :func:`populate_mapped`), for a reader done with it while the rest of the range is
    still to be read.  Nothing for bytes not mapped."""
    span = _mapped_pages(view, outward=False)
    if span is None:
        return
    mapping, begin, end = span
    mapping.madvise(mmap.MADV_DONTNEED, begin, end - begin)
