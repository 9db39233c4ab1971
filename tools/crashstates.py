"""Power-cut states of a local store: record what an operation asks of the file
system, build what a power cut could leave, and check each (as ALICE and
CrashMonkey do for file systems).

A SIGKILL leaves the page cache to the kernel, which writes it all back; a power
cut drops every write not yet synced and may reorder the rest.  This explorer:

1. **records** (:class:`Recorder`) every file-system call the local backend
   (:mod:`chunkstore.backends.local`) makes during one operation: files created
   (a named temp file, or an unnamed ``O_TMPFILE`` one), data written, ``fsync`` of
   a file or of a directory, ``syncfs``, ``rename``/``link``/``linkat`` into place
   and ``unlink``.  The backend's ``os`` and its libc entry points are replaced for
   the duration; the calls still happen, so the operation runs as it would;
2. **builds crash states** (:func:`crash_states`) from the persistence model below,
   at each *crash point*: just before every barrier (``fsync``, ``syncfs``) and after
   the last call;
3. **checks** each state (:func:`tools.crashcheck.check_state`) in a directory of its own: the store
   opens (with a fresh index), every version published before the cut (its commit
   returned) reads back bit-exact, ``verify`` finds no damage, a save of the
   interrupted operation's content publishes and reads back, and a GC run a lease
   after the reboot completes without deferring and deletes nothing a version
   needs.

The persistence model (the ext4-without-``auto_da_alloc`` worst case):

- the store as it was before the operation is durable (a snapshot);
- a file's data survives only if the file was fsynced, or the file system
  syncfs'ed, after its last write; otherwise the file, wherever a name of it
  survives, holds all, none or half of its data;
- a name operation (a file created under a name, rename, link, unlink) survives
  only if its directory was fsynced, or the file system syncfs'ed, after it;
  otherwise each one independently survives or not (a rename all or nothing).
  Directories are taken as made durable when created (the backend fsyncs the
  parent right after ``mkdir``);
- a store may span file systems: with ``devices`` the :class:`Recorder` puts a
  folder (``chunks``, say) on a file system of its own (the backend sees another
  ``st_dev`` for everything under it), and a ``syncfs`` makes durable only the
  names and data on the file system it was called for.  (A mount cannot be made
  here; the backend's calls are the same as with one.)

States that differ only in temp files or in nothing at all are checked once.  Where
a crash point has few unsynced calls every subset is built; otherwise a fixed set
(all, none, each one alone lost, each one alone kept, all data lost) and a sample
with a fixed seed, up to a budget.  ``python -m tools.crashscenarios`` runs every
scenario and prints what it found.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
import random
import tempfile
import threading
import types
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np

from chunkstore.backends import local

#: What a version holds: arrays by name, plain data by name.
Content = tuple[dict[str, np.ndarray], dict[str, Any]]

FULL, EMPTY, HALF = "full", "empty", "half"
#: The ``st_dev`` of file system ``n`` of :class:`Recorder`'s ``devices`` is this plus n
#: (far from any real device number).
FAKE_DEVICE_BASE = 1 << 62


# --- 1. recording -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Op:
    """One recorded file-system call.

    ``kind``: ``write`` (data of ``inode``), ``fsync`` (of ``inode``), ``fsyncdir`` (of
    ``directory``), ``syncfs``, ``names`` (``changes``: path -> inode or None, all in
    ``directory``, one atomic call) or ``mark`` (``label``: what the operation had
    done by then, e.g. ``published <id>``).  ``device``: the file system a ``write``,
    ``names`` or ``syncfs`` is on (0: the store root's; see :class:`Recorder`).
    """

    kind: str
    inode: int | None = None
    directory: str | None = None
    changes: tuple[tuple[str, int | None], ...] = ()
    label: str = ""
    device: int = 0


@dataclass
class Recording:
    """What one operation did: its calls, the data of every file it wrote, the store
    before it (relative path -> bytes), and copies of its index by crash point (at 0:
    the index before the operation)."""

    before: dict[str, bytes]
    ops: list[Op] = field(default_factory=list)
    data: dict[int, bytearray] = field(default_factory=dict)
    indexes: dict[int, str] = field(default_factory=dict)


class Recorder:
    """Records the local backend's file-system calls under ``root`` (a context manager).

    With ``index`` (the :class:`~chunkstore.index.lmdbindex.Index` of the store doing
    the operation) it also copies the index at every crash point, into ``index_copies``:
    the index a cut there leaves (an LMDB commit is durable when it returns).

    ``devices`` puts folders of the store (relative paths, ``{"chunks": 1}``) on file
    systems of their own, numbered from 1 (0 is the root's): ``os.stat`` in the
    backend reports a ``st_dev`` of that number's for everything under the folder,
    and each recorded call names the file system it is on.
    """

    def __init__(self, root: str, index: Any = None, index_copies: str | None = None,
                 devices: dict[str, int] | None = None) -> None:
        self.root = os.path.abspath(root)
        self.devices = dict(devices or {})
        self._inode_devices: dict[int, int] = {}
        self.recording = Recording(_snapshot(self.root))
        self._index = index
        self._index_copies = index_copies or tempfile.mkdtemp(prefix="crashstates-index-")
        self._names: dict[str, int] = {}  # the namespace as the calls left it
        for number, path in enumerate(sorted(self.recording.before)):
            self._names[path] = -1 - number  # files of the snapshot: negative inodes
        self._fds: dict[int, tuple[str, Any]] = {}
        self._lock = threading.RLock()
        self._next_inode = 0
        self._patches: contextlib.ExitStack | None = None

    def __enter__(self) -> Recorder:
        proxy = types.SimpleNamespace(**{name: getattr(os, name) for name in dir(os)
                                         if not name.startswith("__")})
        proxy.open, proxy.write, proxy.close = self._open, self._write, self._close
        proxy.writev = self._writev
        proxy.fsync, proxy.replace, proxy.link = self._fsync, self._replace, self._link
        proxy.unlink, proxy.stat = self._unlink, self._stat
        stack = contextlib.ExitStack()
        stack.enter_context(mock.patch.object(local, "os", proxy))
        if local._SYNCFS is not None:
            stack.enter_context(mock.patch.object(local, "_SYNCFS", self._syncfs(local._SYNCFS)))
        if local._LINKAT is not None:
            stack.enter_context(mock.patch.object(local, "_LINKAT", self._linkat(local._LINKAT)))
        self._patches = stack
        self._copy_index()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._patches is not None
        self._patches.close()
        self._copy_index()

    def _copy_index(self) -> None:
        """Copy the index as it is now: the one a cut before the next call leaves."""
        if self._index is None:
            return
        point = len(self.recording.ops)
        if point in self.recording.indexes:
            return
        target = os.path.join(self._index_copies, str(point))
        os.makedirs(target)
        self._index.env.copy(target)
        self.recording.indexes[point] = target

    def mark(self, label: str) -> None:
        """Note what the operation has done (``published <id>``, ``removing <id>``)."""
        with self._lock:
            self.recording.ops.append(Op("mark", label=label))

    # --- the calls ----------------------------------------------------------------------

    def _rel(self, path: str | bytes | int) -> str | None:
        if isinstance(path, int):
            return None
        text = os.path.abspath(os.fsdecode(path))
        if text != self.root and not text.startswith(self.root + os.sep):
            return None
        return os.path.relpath(text, self.root)

    def _new_inode(self, directory: str) -> int:
        inode = self._next_inode
        self._next_inode += 1
        self.recording.data[inode] = bytearray()
        self._inode_devices[inode] = self.device_of(directory)
        return inode

    def device_of(self, rel: str | None) -> int:
        """The file system (0: the root's) of ``rel``, a path relative to the root."""
        for folder, device in self.devices.items():
            if rel is not None and (rel == folder or rel.startswith(folder + os.sep)):
                return device
        return 0

    def _stat(self, path: Any, *args: Any, **kw: Any) -> os.stat_result:
        """``os.stat``, with the ``st_dev`` of a folder's own file system under it."""
        real = os.stat(path, *args, **kw)
        device = self.device_of(self._rel(path))
        if not device:
            return real
        fields = list(real)
        fields[2] = FAKE_DEVICE_BASE + device  # st_dev
        return os.stat_result(fields, {name: getattr(real, name) for name in dir(real)
                                       if name.startswith("st_") and name != "st_dev"})

    def _open(self, path: Any, flags: int, mode: int = 0o777, *args: Any, **kw: Any) -> int:
        with self._lock:
            fd = os.open(path, flags, mode, *args, **kw)
            rel = self._rel(path)
            tmpfile = getattr(os, "O_TMPFILE", 0)
            if rel is None:
                return fd
            if tmpfile and flags & tmpfile == tmpfile:
                self._fds[fd] = ("file", self._new_inode(rel))
            elif flags & os.O_CREAT:
                inode = self._new_inode(os.path.dirname(rel))
                self._fds[fd] = ("file", inode)
                self._name_op(os.path.dirname(rel), ((rel, inode),))
            elif os.path.isdir(path):
                self._fds[fd] = ("dir", rel)
            elif rel in self._names:
                self._fds[fd] = ("file", self._names[rel])
            return fd

    def _write(self, fd: int, data: Any) -> int:
        with self._lock:
            written = os.write(fd, data)
            kind, inode = self._fds.get(fd, ("", None))
            if kind == "file" and inode >= 0:
                self.recording.data[inode] += bytes(memoryview(data).cast("B")[:written])
                self.recording.ops.append(Op("write", inode=inode,
                                             device=self._inode_devices[inode]))
            return written

    def _writev(self, fd: int, pieces: Any) -> int:
        """``os.writev``, recorded as the one write of the pieces laid end to end that it
        is (a pack written from its parts)."""
        with self._lock:
            written = os.writev(fd, pieces)
            kind, inode = self._fds.get(fd, ("", None))
            if kind == "file" and inode >= 0:
                self.recording.data[inode] += b"".join(
                    bytes(memoryview(piece).cast("B")) for piece in pieces)[:written]
                self.recording.ops.append(Op("write", inode=inode,
                                             device=self._inode_devices[inode]))
            return written

    def _close(self, fd: int) -> None:
        with self._lock:
            self._fds.pop(fd, None)
            os.close(fd)

    def _fsync(self, fd: int) -> None:
        with self._lock:  # held throughout: the barrier is the op after the index copy
            self._copy_index()
            os.fsync(fd)
            kind, what = self._fds.get(fd, ("", None))
            if kind == "file":
                self.recording.ops.append(Op("fsync", inode=what))
            elif kind == "dir":
                self.recording.ops.append(Op("fsyncdir", directory=what))

    def _replace(self, source: Any, target: Any) -> None:
        with self._lock:
            os.replace(source, target)
            src, dst = self._rel(source), self._rel(target)
            if src is not None and dst is not None:
                inode = self._names.get(src)
                self._name_op(os.path.dirname(dst), ((dst, inode), (src, None)))

    def _link(self, source: Any, target: Any) -> None:
        with self._lock:
            os.link(source, target)
            src, dst = self._rel(source), self._rel(target)
            if src is not None and dst is not None:
                self._name_op(os.path.dirname(dst), ((dst, self._names.get(src)),))

    def _unlink(self, path: Any) -> None:
        with self._lock:
            os.unlink(path)
            rel = self._rel(path)
            if rel is not None:
                self._name_op(os.path.dirname(rel), ((rel, None),))

    def _syncfs(self, real: Callable[[int], int]) -> Callable[[int], int]:
        def syncfs(fd: int) -> int:
            with self._lock:
                self._copy_index()
                result = real(fd)
                kind, what = self._fds.get(fd, ("", None))
                self.recording.ops.append(Op("syncfs", directory=what if kind == "dir" else None,
                                             device=self.device_of(what if kind == "dir"
                                                                   else None)))
            return result
        return syncfs

    def _linkat(self, real: Callable[[int, bytes, int, bytes, int], int]
                ) -> Callable[[int, bytes, int, bytes, int], int]:
        def linkat(olddir: int, old: bytes, newdir: int, new: bytes, flags: int) -> int:
            with self._lock:
                result = real(olddir, old, newdir, new, flags)
                rel = self._rel(new)
                if result == 0 and rel is not None:
                    kind, inode = self._fds.get(int(old.rsplit(b"/", 1)[1]), ("", None))
                    if kind == "file":
                        self._name_op(os.path.dirname(rel), ((rel, inode),))
                return result
        return linkat

    def _name_op(self, directory: str, changes: tuple[tuple[str, int | None], ...]) -> None:
        for path, inode in changes:
            if inode is None:
                self._names.pop(path, None)
            else:
                self._names[path] = inode
        self.recording.ops.append(Op("names", directory=directory, changes=changes,
                                     device=self.device_of(directory)))


def _snapshot(root: str) -> dict[str, bytes]:
    """Every file of the store except its index, by relative path."""
    files: dict[str, bytes] = {}
    for directory, subdirs, names in os.walk(root):
        if directory == root:
            subdirs[:] = [d for d in subdirs if d not in local.LocalBackend.IGNORED_TOP_LEVEL]
        for name in names:
            path = os.path.join(directory, name)
            files[os.path.relpath(path, root)] = Path(path).read_bytes()
    return files


# --- 2. crash states ----------------------------------------------------------------------------


@dataclass(frozen=True)
class CrashState:
    """What a power cut at ``point`` (the calls before it issued) leaves: the unsynced
    name operations in ``kept`` survived, the others did not; each unsynced file holds
    the share of its data ``data`` says (FULL where absent)."""

    point: int
    kept: frozenset[int]
    data: tuple[tuple[int, str], ...] = ()

    def files(self, recording: Recording) -> dict[str, bytes]:
        """The store's files in this state (relative path -> bytes)."""
        before = sorted(recording.before)
        names: dict[str, int] = {path: -1 - n for n, path in enumerate(before)}
        synced_names, _ = _guarantees(recording.ops, self.point)
        for i, op in enumerate(recording.ops[: self.point]):
            if op.kind == "names" and (i in synced_names or i in self.kept):
                for path, inode in op.changes:
                    if inode is None:
                        names.pop(path, None)
                    else:
                        names[path] = inode
        shares = dict(self.data)
        files: dict[str, bytes] = {}
        for path, inode in names.items():
            if inode < 0:
                files[path] = recording.before[before[-1 - inode]]
                continue
            content = bytes(recording.data[inode])
            share = shares.get(inode, FULL)
            files[path] = (content if share == FULL else b"" if share == EMPTY
                           else content[: len(content) // 2])
        return files


def _guarantees(ops: list[Op], point: int) -> tuple[set[int], set[int]]:
    """Which name operations before ``point`` are durable, and which files' data.  A
    ``syncfs`` reaches the names and data on its own file system only."""
    synced_names: set[int] = set()
    synced_data: set[int] = set()
    pending_names: dict[str | None, list[int]] = {}
    last_write: dict[int, int] = {}
    devices: dict[str | int | None, int] = {}  # of each directory and inode
    for i, op in enumerate(ops[:point]):
        if op.kind == "names":
            pending_names.setdefault(op.directory, []).append(i)
            devices[op.directory] = op.device
        elif op.kind == "write" and op.inode is not None:
            last_write[op.inode] = i
            devices[op.inode] = op.device
            synced_data.discard(op.inode)
        elif op.kind == "fsync" and op.inode is not None:
            synced_data.add(op.inode)
        elif op.kind == "fsyncdir":
            synced_names.update(pending_names.pop(op.directory, []))
        elif op.kind == "syncfs":
            for directory in [d for d in pending_names if devices[d] == op.device]:
                synced_names.update(pending_names.pop(directory))
            synced_data.update(n for n in last_write if devices[n] == op.device)
    return synced_names, synced_data


def crash_points(ops: list[Op]) -> list[int]:
    """Just before every barrier, and after the last call."""
    return [i for i, op in enumerate(ops) if op.kind in ("fsync", "fsyncdir", "syncfs")] \
        + [len(ops)]


def unsynced(recording: Recording, point: int) -> tuple[list[int], list[int]]:
    """The name operations before ``point`` that a cut may lose, and the files (inodes)
    written before it whose data a cut may lose."""
    synced_names, synced_data = _guarantees(recording.ops, point)
    ops = recording.ops[:point]
    names = [i for i, op in enumerate(ops) if op.kind == "names" and i not in synced_names]
    written = {op.inode for op in ops if op.kind == "write" and op.inode is not None}
    return names, sorted(n for n in written if n not in synced_data)


def nominal_count(recording: Recording) -> int:
    """How many states the model allows, summed over the crash points (before merging
    those that leave the same files)."""
    total = 0
    for point in crash_points(recording.ops):
        names, inodes = unsynced(recording, point)
        total += 2 ** len(names) * 3 ** len(inodes)
    return total


def crash_states(recording: Recording, per_point: int = 64, seed: int = 0
                 ) -> Iterator[CrashState]:
    """The states to check, crash point by crash point (see the module docstring)."""
    rng = random.Random(seed)
    for point in crash_points(recording.ops):
        names, inodes = unsynced(recording, point)
        yield from _states_at(point, names, inodes, per_point, rng)


def _states_at(point: int, names: list[int], inodes: list[int], budget: int,
               rng: random.Random) -> Iterator[CrashState]:
    every = frozenset(names)
    lost = tuple((n, EMPTY) for n in inodes)
    half = tuple((n, HALF) for n in inodes)
    if 2 ** len(names) * 3 ** len(inodes) <= budget:
        for kept_bits in itertools.product((False, True), repeat=len(names)):
            kept = frozenset(i for i, keep in zip(names, kept_bits, strict=True) if keep)
            for shares in itertools.product((FULL, EMPTY, HALF), repeat=len(inodes)):
                yield CrashState(point, kept, tuple(zip(inodes, shares, strict=True)))
        return
    fixed = [CrashState(point, every), CrashState(point, every, lost),
             CrashState(point, every, half), CrashState(point, frozenset())]
    fixed += [CrashState(point, every - {i}) for i in names]
    fixed += [CrashState(point, frozenset({i}), lost) for i in names]
    yield from fixed[:budget]
    for _ in range(budget - len(fixed)):
        kept = frozenset(i for i in names if rng.random() < 0.5)
        data = tuple((n, rng.choice((FULL, EMPTY, HALF))) for n in inodes)
        yield CrashState(point, kept, data)


def distinct_states(recording: Recording, states: Iterable[CrashState]
                    ) -> Iterator[tuple[CrashState, dict[str, bytes]]]:
    """``states`` with their files, each set of files (temp files aside) once."""
    seen: set[str] = set()
    for state in states:
        files = state.files(recording)
        digest = hashlib.sha256()
        for path in sorted(files):
            if not os.path.basename(path).startswith(local.LocalBackend.TEMP_PREFIX):
                digest.update(f"{path}\0{len(files[path])}\0".encode())
                digest.update(hashlib.sha256(files[path]).digest())
        if digest.hexdigest() not in seen:
            seen.add(digest.hexdigest())
            yield state, files
