"""Opening the LMDB index so that a damaged one is never fatal.

The index is a cache of the store (docs/format.md §1), so a damaged index is
set aside (renamed ``<index>.damaged-<time>``) and rebuilt from the store,
with a warning, instead of failing every command.  Four ways it goes wrong:

- **truncated** (a full disk, a partial copy): LMDB maps the file and the
  first access past its end kills the process with SIGBUS.  The meta pages
  are read with plain file reads first and the file's size checked against
  the last page they name, before anything is mapped;
- **damaged bytes** LMDB notices (``lmdb.CorruptedError`` and kin) when the
  environment is opened or first read;
- **the wrong shape**: the index directory is a file, or ``data.mdb`` or
  ``lock.mdb`` is a directory (a bad copy or restore, a stray ``mkdir``);
- **no address space** for the map (``ulimit -v`` below the map size): the
  map is retried smaller, down to what the data needs, and the error says
  what limit to raise.

An index **deleted while processes use it** (``rm -rf index/``, allowed at any
time: it is a cache) goes one file at a time; an open between two unlinks never
pairs LMDB's file left, which running processes still use, with a new one of the
other (:func:`_open_paired`): it starts a new index of both.

A **full disk** is a :class:`~chunkstore.errors.StorageFullError`, never
LMDB's own error.  And so that removing versions and collecting garbage (the
way to free space) still work when a save has filled the disk, the index
keeps a reserve: a file of allocated blocks (``reserve`` in the index
directory; for a local store that is the store's own filesystem) made when
there is room, and given up by ``rm`` and ``gc`` when the filesystem is
nearly full (:func:`release_reserve_if_low`) so that their tombstones,
journal entries and index writes find room.  Its size follows what those
need on this store (:func:`reserve_needed`), so a small store keeps a small
one and a large store a larger one: it grows as the index grows and shrinks
after a GC has halved it.

LMDB's meta page (``lmdb/mdb.c``, 64-bit): a 16-byte page header, then
``mm_magic`` (u32, 0xBEEFC0DE) at 16, the free-list DB record at 40 whose
first u32 is the page size, ``mm_last_pg`` (u64) at 136 and ``mm_txnid``
(u64) at 144; pages 0 and 1 hold the two meta copies, the newer wins.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import struct
import time
from dataclasses import dataclass

import lmdb

from chunkstore.errors import BackendError, StorageFullError

try:
    import fcntl
except ImportError:  # pragma: no cover - not on POSIX
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

MAGIC = 0xBEEFC0DE
#: Environment variable that sets the index's map size in bytes.
MAP_SIZE_ENV_VAR = "CHUNKSTORE_INDEX_MAP_SIZE"
MIN_MAP_SIZE = 1 << 28
_META = struct.Struct("<16xIIQQI")  # header, magic, version, address, mapsize, page size
_TAIL = struct.Struct("<QQ")  # last page, txn id (at offset 136)
#: Environment variable that fixes the reserve's size in bytes (0: keep none); unset,
#: the size follows the store (:func:`reserve_needed`).
RESERVE_ENV_VAR = "CHUNKSTORE_SPACE_RESERVE"
#: The least reserve an index keeps (the temporary files, the lock and the first
#: index pages of an ``rm`` and a ``gc``), and the step its size moves by.
RESERVE_FLOOR = 256 << 10
#: The most a reserve takes, whatever the size of the index.
RESERVE_CAP = 1 << 30
#: What one tombstone takes (one filesystem block: its record is a few hundred bytes).
TOMBSTONE_BYTES = 4096
RESERVE_NAME = "reserve"
#: What LMDB raises for an environment it cannot trust.
DAMAGE = (lmdb.CorruptedError, lmdb.InvalidError, lmdb.PageNotFoundError,
          lmdb.VersionMismatchError, lmdb.BadRslotError, lmdb.PanicError)


def probe(path: str) -> str | None:  # noqa: PLR0911 - one return per way it can be damaged
    """Why ``path``'s ``data.mdb`` cannot be mapped safely, or None when it can."""
    if os.path.lexists(path) and not os.path.isdir(path):
        return "it is not a directory"
    for name in ("data.mdb", "lock.mdb"):
        if os.path.isdir(os.path.join(path, name)):
            return f"{name} is a directory"
    file = os.path.join(path, "data.mdb")
    try:
        with open(file, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            head = handle.read(2 * 65536)
    except FileNotFoundError:
        return None
    if size == 0:
        return None  # LMDB initialises an empty file
    if len(head) < _META.size:
        return f"data.mdb is {size} bytes, shorter than one meta page"
    page_size = _META.unpack_from(head, 0)[4]
    if page_size not in {1 << n for n in range(9, 17)}:
        return f"data.mdb's meta page is damaged (page size {page_size})"
    last_page = _newest_last_page(head, page_size)
    if last_page is None:
        return "data.mdb has no valid meta page"
    needed = (last_page + 1) * page_size
    if size < needed:
        return f"data.mdb is {size} bytes but its pages reach {needed} (truncated)"
    return None


def _newest_last_page(head: bytes, page_size: int) -> int | None:
    """The last page the newer of the two valid meta pages names."""
    newest: tuple[int, int] | None = None  # (txn id, last page)
    for offset in (0, page_size):
        if len(head) < offset + 152:
            continue
        magic = _META.unpack_from(head, offset)[0]
        last_page, txn = _TAIL.unpack_from(head, offset + 136)
        if magic == MAGIC and (newest is None or txn > newest[0]):
            newest = (txn, last_page)
    return None if newest is None else newest[1]


def set_aside(path: str, reason: str) -> str:
    """Rename a damaged index directory out of the way; return where it went."""
    target = f"{path}.damaged-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    os.replace(path, target)
    os.makedirs(path, exist_ok=True)
    log.warning("the index at %s is damaged (%s): set aside as %s and rebuilt from the store"
                " (the index is a cache; no checkpoint data is lost)", path, reason, target)
    return target


def map_size(default: int) -> int:
    text = os.environ.get(MAP_SIZE_ENV_VAR)
    if not text:
        return default
    try:
        return max(MIN_MAP_SIZE, int(text))
    except ValueError:
        raise BackendError(f"{MAP_SIZE_ENV_VAR}={text!r} is not a number of bytes") from None


def open_env(path: str, size: int) -> tuple[lmdb.Environment, bool]:
    """Open the index environment; True when a damaged one was set aside (rebuild it).
    Close it with :func:`close_env`."""
    damaged = False
    reason = probe(path)
    if reason is not None:
        set_aside(path, reason)
        damaged = True
    for attempt in range(OPEN_ATTEMPTS):
        os.makedirs(path, exist_ok=True)
        try:
            return _open_paired(path, size), damaged
        except DAMAGE as exc:
            set_aside(path, f"{type(exc).__name__}: {exc}")
            return _open_paired(path, size), True
        except BackendError as exc:
            # An index may be deleted at any time (it is a cache): one removed between
            # the makedirs and the open is made again, as if it had gone just before.
            if attempt == OPEN_ATTEMPTS - 1 or not _vanished(exc):
                raise
    raise AssertionError("unreachable: the last attempt returns or raises")


def close_env(env: lmdb.Environment) -> None:
    """Close an environment :func:`open_env` opened, and let go of its ``data.mdb``."""
    env.close()
    held = _HELD.pop(env, None)
    if held is not None:
        os.close(held)


#: The ``data.mdb`` of each environment :func:`open_env` opened, held with a shared
#: flock until :func:`close_env` (what :func:`_unpair` asks of a file found alone).
_HELD: dict[lmdb.Environment, int] = {}
DATA_NAME, LOCK_NAME = "data.mdb", "lock.mdb"


def _open_paired(path: str, size: int) -> lmdb.Environment:
    """:func:`_open_with_fallback`, never pairing one of LMDB's two files that other
    processes use with a new one of the other.

    LMDB keeps its writer mutex, reader table and last transaction id in
    ``lock.mdb``: two lock files on one ``data.mdb``, or one lock file on two data
    files, let two writers write at once and a writer reuse pages under readers it
    does not see (an abort in ``mdb_page_touch``, a damaged index).  An index
    directory deleted while processes use it (``rm -rf index/``, which docs/format.md
    allows at any time) passes through both: its files are unlinked one at a time, and
    an open between two unlinks would make the missing file anew beside the one left.
    So each process holds a shared flock on its ``data.mdb`` while it is open, and an
    open, serialised with the others by an flock on the directory, first finishes such
    a deletion (:func:`_unpair`), then checks that both files are still there once
    LMDB has opened them (else, deleted meanwhile, it tries again)."""
    if fcntl is None:
        return _open_with_fallback(path, size)
    data, lock = os.path.join(path, DATA_NAME), os.path.join(path, LOCK_NAME)
    for _ in range(PAIR_ATTEMPTS):
        os.makedirs(path, exist_ok=True)
        try:
            folder = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            continue  # deleted again
        try:
            fcntl.flock(folder, fcntl.LOCK_EX)
            if _identity(path) == _identity(folder):  # else deleted and made again
                env = _open_checked(path, size, data, lock)
                if env is not None:
                    return env
        except FileNotFoundError:
            pass
        finally:
            os.close(folder)  # the directory's flock goes with it
    raise BackendError(f"cannot open the index at {path}: its files were deleted under"
                       f" {PAIR_ATTEMPTS} opens in a row")


def _open_checked(path: str, size: int, data: str, lock: str) -> lmdb.Environment | None:
    """One open of :func:`_open_paired`, its directory's flock held; None when a file
    was deleted during it (what LMDB made in place of one is unlinked again)."""
    _unpair(data, lock)
    before = _identity(data), _identity(lock)
    env = _open_with_fallback(path, size)
    held = None
    try:
        held = os.open(data, os.O_RDONLY | os.O_CLOEXEC)
        fcntl.flock(held, fcntl.LOCK_SH)
        after = _identity(held), _identity(lock)
    except FileNotFoundError:
        after = None, None
    # The files LMDB opened are the ones there before and after it (only an open makes
    # them, and opens wait for this one): none deleted in between.
    if held is not None and after[0] is not None and after[1] is not None \
            and all(b is None or b == a for b, a in zip(before, after, strict=True)):
        _HELD[env] = held
        return env
    env.close()
    if held is not None:
        os.close(held)
    for name, was in ((data, before[0]), (lock, before[1])):
        now = _identity(name)
        if was is not None and now is not None and now != was:
            os.unlink(name)  # made by this open beside the other, which others may use
    return None


#: Opens of an index whose files are deleted under each, before giving up.
PAIR_ATTEMPTS = 20


def _unpair(data: str, lock: str) -> None:
    """Finish the deletion of an index directory that left one of LMDB's files other
    processes use: a ``data.mdb`` that holds a shared flock (:data:`_HELD`) with no
    ``lock.mdb`` beside it, and a ``lock.mdb`` with no ``data.mdb``.  (A ``data.mdb``
    alone that nobody uses, a copy of the index, is opened as it is.)"""
    if os.path.lexists(data) and not os.path.lexists(lock):
        probe_fd = os.open(data, os.O_RDONLY | os.O_CLOEXEC)
        try:
            fcntl.flock(probe_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            in_use = False
        except BlockingIOError:
            in_use = True
        finally:
            os.close(probe_fd)
        if in_use:
            log.info("the index at %s was being deleted under a running process: starting a"
                     " new one", os.path.dirname(data))
            os.unlink(data)
    elif os.path.lexists(lock) and not os.path.lexists(data):
        os.unlink(lock)


def _identity(file: str | int) -> tuple[int, int] | None:
    """The (device, inode) ``file`` (a path, or an open descriptor) names; None when
    there is no such path."""
    try:
        found = os.stat(file)
    except FileNotFoundError:
        return None
    return found.st_dev, found.st_ino


#: Named tables an index environment may hold (LMDB's ``max_dbs``).
MAX_TABLES = 32
#: Opens of an index whose directory another process keeps deleting, before giving up.
OPEN_ATTEMPTS = 5


def _vanished(exc: BackendError) -> bool:
    """Whether an open failed because the index directory was gone (ENOENT)."""
    cause = exc.__cause__
    return isinstance(cause, lmdb.Error) and os.strerror(errno.ENOENT) in str(cause)


def _open_with_fallback(path: str, size: int) -> lmdb.Environment:
    """Open with ``size``; where the address space is short, retry with less."""
    data = os.path.join(path, "data.mdb")
    needed = os.path.getsize(data) if os.path.exists(data) else 0
    attempt = size
    while True:
        try:
            # metasync=False: each commit still flushes the data pages, and a
            # system crash can at worst undo the last transaction, never
            # corrupt the tree; the index is rebuildable from the manifests.
            # max_dbs: schema 5 names 19 tables; room for more.
            env = lmdb.open(path, map_size=attempt, max_dbs=MAX_TABLES, metasync=False,
                            max_readers=256)
        except lmdb.MemoryError as exc:
            smaller = attempt // 4
            if smaller < max(MIN_MAP_SIZE, 2 * needed):
                raise BackendError(
                    f"cannot map the index at {path} ({exc}): the process has too little"
                    f" address space (is `ulimit -v` set?); it needs at least"
                    f" {max(MIN_MAP_SIZE, 2 * needed)} bytes. Raise the limit, or set"
                    f" {MAP_SIZE_ENV_VAR}") from exc
            attempt = smaller
            continue
        except DAMAGE:
            raise
        except lmdb.DiskError as exc:
            raise full(path, exc) from exc
        except lmdb.Error as exc:
            raise BackendError(f"cannot open the index at {path}: {exc}") from exc
        if attempt != size:
            log.warning("the index at %s is mapped with %d bytes, not %d (address space"
                        " limit); it holds fewer chunks before it is full", path, attempt, size)
        return env


#: Below this many free bytes, a write LMDB saw fail (it reports a short write as an
#: I/O error, not always as ENOSPC) is taken for a full filesystem.
NEARLY_FULL_BYTES = 1 << 20
_NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})


def is_full(exc: BaseException, path: str) -> bool:
    """Whether ``exc``, raised writing under ``path``, means its filesystem is full."""
    if isinstance(exc, lmdb.DiskError):
        return True
    if isinstance(exc, OSError) and exc.errno in _NO_SPACE:
        return True
    if isinstance(exc, lmdb.Error) and not isinstance(exc, DAMAGE):
        free = free_bytes(path)
        return free is not None and free < NEARLY_FULL_BYTES
    return False


def full(path: str, exc: BaseException) -> StorageFullError:
    """The typed error for a write to the index at ``path`` that found no space."""
    return StorageFullError(path, str(exc).split(": ")[-1] or "no space left on device",
                            what=f"the index at {path}")


def fixed_reserve() -> int | None:
    """The size ``CHUNKSTORE_SPACE_RESERVE`` fixes; None where it is unset."""
    text = os.environ.get(RESERVE_ENV_VAR)
    if not text:
        return None
    try:
        return max(0, int(text))
    except ValueError:
        raise BackendError(f"{RESERVE_ENV_VAR}={text!r} is not a number of bytes") from None


def reserve_needed(index_bytes: int, versions: int) -> int:
    """The space ``rm`` and ``gc`` need on a full disk, for an index whose tables hold
    ``index_bytes`` (its pages in use) and ``versions`` versions:

    - the index's own writes: LMDB copies every page a transaction changes and frees
      the old ones only once it commits, and removing every version, then collecting
      every chunk, touches at most all of the tables: once their size;
    - GC's journal entry (about 70 bytes per candidate; an index record is larger):
      at most once their size again;
    - a tombstone per version removed: a filesystem block each;
    - :data:`RESERVE_FLOOR` for the rest, and the size rounded up to a multiple of it,
      at most :data:`RESERVE_CAP`.

    GC's mark set is not counted: it moves to the temporary directory when its
    filesystem is full.  ``CHUNKSTORE_SPACE_RESERVE`` fixes the size instead.
    """
    fixed = fixed_reserve()
    if fixed is not None:
        return fixed
    needed = RESERVE_FLOOR + 2 * index_bytes + TOMBSTONE_BYTES * versions
    return min(RESERVE_CAP, -(-needed // RESERVE_FLOOR) * RESERVE_FLOOR)


@dataclass(frozen=True)
class ReservePlan:
    """An index's space reserve: the bytes it holds and those ``rm`` and ``gc`` need on
    this store (:func:`reserve_needed`), from what they were reckoned."""

    #: the index directory that holds it (``reserve`` in there)
    path: str
    held: int
    needed: int
    #: the bytes the index's tables use (their pages)
    index_bytes: int
    versions: int
    #: whether ``CHUNKSTORE_SPACE_RESERVE`` fixes the size
    fixed: bool

    @property
    def size_ok(self) -> bool:
        """Whether the reserve held is the size :func:`keep_reserve` keeps for ``needed``."""
        return self.needed <= self.held <= 2 * self.needed

    def to_json(self) -> dict[str, str | int | bool]:
        return dict(self.__dict__)


def held_reserve(path: str) -> int:
    """Bytes the reserve in the index directory ``path`` holds now (0: none)."""
    try:
        return os.stat(os.path.join(path, RESERVE_NAME)).st_size
    except OSError:
        return 0


def free_bytes(path: str) -> int | None:
    """Bytes an unprivileged write can still take on the filesystem holding ``path``."""
    try:
        info = os.statvfs(path)
    except (OSError, AttributeError):
        return None
    return info.f_bavail * info.f_frsize


def keep_reserve(path: str, size: int) -> None:
    """Make the reserve in the index directory ``path`` ``size`` bytes where the
    filesystem has room for it twice over (best effort: it is never an error).  One
    smaller than ``size`` is made again at that size (the store grew); one more than
    twice ``size`` is cut to it (a GC shrank the index); one in between is kept, so
    a store whose index grows a little each save does not move it each time."""
    target = os.path.join(path, RESERVE_NAME)
    held = held_reserve(path)
    if size <= held <= 2 * size:
        return
    if held > 2 * size:
        with contextlib.suppress(OSError):
            if size == 0:
                os.unlink(target)
            else:
                os.truncate(target, size)  # the blocks past it go back to the filesystem
        return
    free = free_bytes(path)
    if free is None or free < 2 * size:
        return
    temp = f"{target}.tmp-{os.getpid()}"
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _allocate(fd, size)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, target)
    except OSError as exc:
        log.debug("no space reserve at %s: %s", path, exc)
        with contextlib.suppress(OSError):
            os.unlink(temp)


def _allocate(fd: int, size: int) -> None:
    """Take ``size`` bytes of real blocks (a sparse file would reserve nothing)."""
    if hasattr(os, "posix_fallocate"):
        try:
            os.posix_fallocate(fd, 0, size)
            return
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
    block = b"\0" * (1 << 20)
    for start in range(0, size, len(block)):
        os.write(fd, block[: size - start])


def release_reserve_if_low(path: str, needed: int) -> bool:
    """Give the reserve back to the filesystem when less than it (or than ``needed``,
    what ``rm`` and ``gc`` need now, should the store have outgrown it) is free there;
    True when it was (``rm`` and ``gc`` call this before they write anything)."""
    target = os.path.join(path, RESERVE_NAME)
    held = held_reserve(path)
    free = free_bytes(path)
    if free is None or free >= max(held, needed) or not os.path.exists(target):
        return False
    try:
        os.unlink(target)
    except OSError:
        return False
    log.warning("the filesystem of %s is full: its space reserve (%d bytes) was given up"
                " so that versions can be removed and collected", path, held)
    return True
