"""The checkpointing systems under test: sync save, async save (where there is one), restore.

Every save is durable before it returns: the file-based systems fsync their
files and directory, as chunkstore and DCP's FileSystemWriter do.

Each system also loads a version into fresh objects (``load``), what a job that
builds its model afterwards, or a tool, does: ``torch.load``, safetensors'
``load_file``, DCP's loader of a checkpoint's keys into tensors it allocates,
``torch_bridge.load`` into empty trees (new tensors) for chunkstore.

- ``torch.save``: one pickle file per version (the whole state tree).
- ``safetensors``: one file per version, tensors only (plain values dropped).
- ``dcp``: torch.distributed.checkpoint, FileSystemWriter, one directory per
  version; the pause is ``async_save``'s.
- ``chunkstore-<compression>[-d<depth>]``: one store; sync saves through
  ``torch_bridge.save``, the pause through ``Checkpointer(async_save=True)``.
  ``chunkstore-auto`` is the default store: policy ``auto`` with delta chains
  (``delta_depth`` 16, each chain bounded by its stored bytes: a changed chunk
  stored as its difference from the previous version's where that pays);
  ``chunkstore-auto-d0`` is the
  same policy without delta chains (``delta_depth`` 0), the default store of
  earlier releases; ``chunkstore-none`` stores raw chunks, never deltas.
  ``chunkstore-auto-enc`` is ``chunkstore-auto`` in an encrypted store (docs/format.md
  §13: every object sealed with AES-256-GCM, chunk ids keyed): what encryption costs.

Two restore references (``REFERENCES``) only restore, each from a file written
untimed for the versions it restores: what a restore that checks every byte is
held against (issue 49).

- ``checked-read``: safetensors' ``load_file``, a copy into the live tensors,
  then BLAKE3 of every byte, a digest per tensor compared with the one taken
  when the file was written.
- ``copy-hash-floor``: the machine's copy+hash floor: the state's bytes end to
  end in one page-cached file, read into the live tensors and hashed, in
  pieces spread over every core.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import blake3
import safetensors.torch
import torch
import torch.distributed.checkpoint as dcp

import chunkstore
import torch_bridge
from benchmarks.bench_core import BENCH_PASSWORD
from benchmarks.trace import TraceVersion, flatten, tensor_bytes
from chunkstore.format.records import DEFAULT_CHUNK_SIZE

# DCP without a process group says once per call that it assumes one process.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")
warnings.filterwarnings("ignore", message="torch.distributed is unavailable or uninitialized")
SYSTEMS = ("torch.save", "safetensors", "dcp", "chunkstore-none", "chunkstore-auto-d0",
           "chunkstore-auto", "chunkstore-auto-enc")
REFERENCES = ("checked-read", "copy-hash-floor")


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def tree_bytes(root: Path) -> int:
    """Apparent size of every file under ``root``."""
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def tree_files(root: Path, skip: str | None = None) -> int:
    """Files under ``root`` (on an object store, objects), not counting the top-level
    directory ``skip``."""
    return sum(1 for p in root.rglob("*")
               if p.is_file() and (skip is None or p.relative_to(root).parts[0] != skip))


class FileSystem:
    """A system that writes one file or directory per version under ``root``."""

    suffix = ""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def path(self, version: TraceVersion) -> Path:
        return self.root / f"{version.run}-{version.step:06d}{self.suffix}"

    def save(self, version: TraceVersion, state: dict[str, Any]) -> None:
        path = self.path(version)
        self.write(path, state)
        _fsync_path(path)
        _fsync_path(self.root)

    def write(self, path: Path, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def physical_bytes(self) -> int:
        return tree_bytes(self.root)

    def objects(self) -> int:
        return tree_files(self.root)

    def close(self) -> None:
        pass


def copy_into(target: dict[str, Any], loaded: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Copy loaded tensors into the target's, as ``load_state_dict`` does on a resume.

    This also makes a lazily mapped load (safetensors) read its bytes, so every
    system's restore ends with the state in the training process's tensors.
    """
    for name, tensor in flatten(target).items():
        tensor.copy_(loaded[name])
    return target


class TorchSave(FileSystem):
    suffix = ".pt"

    def write(self, path: Path, state: dict[str, Any]) -> None:
        with open(path, "wb") as out:
            torch.save(state, out)

    def restore(self, version: TraceVersion, target: dict[str, Any]) -> Any:
        return copy_into(target, flatten(self.load(version, list(target))))

    def load(self, version: TraceVersion, keys: list[str]) -> Any:
        return torch.load(self.path(version), weights_only=True)


class Safetensors(FileSystem):
    suffix = ".safetensors"

    def write(self, path: Path, state: dict[str, Any]) -> None:
        safetensors.torch.save_file(flatten(state), path)

    def restore(self, version: TraceVersion, target: dict[str, Any]) -> Any:
        return copy_into(target, self.load(version, list(target)))

    def load(self, version: TraceVersion, keys: list[str]) -> Any:
        return safetensors.torch.load_file(self.path(version))


class Dcp(FileSystem):
    def save(self, version: TraceVersion, state: dict[str, Any]) -> None:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(self.path(version)))

    def restore(self, version: TraceVersion, target: dict[str, Any]) -> Any:
        dcp.load(target, storage_reader=dcp.FileSystemReader(self.path(version)))
        return target

    def load(self, version: TraceVersion, keys: list[str]) -> Any:
        """DCP loads into tensors that exist; this private helper of torch's allocates
        them from the checkpoint's metadata first (what ``dcp_to_torch_save`` does);
        imported here, so a torch without it fails this load alone."""
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

        return _load_state_dict_from_keys(
            set(keys), storage_reader=dcp.FileSystemReader(self.path(version)))


class DcpAsync(Dcp):
    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self._pending: Any = None

    def save(self, version: TraceVersion, state: dict[str, Any]) -> None:
        self._pending = dcp.async_save(
            state, storage_writer=dcp.FileSystemWriter(self.path(version)))

    def wait(self) -> None:
        if self._pending is not None:
            self._pending.result()
            self._pending = None


def _settings(config: str) -> tuple[str, int | None, bool]:
    """``auto-d8`` -> (``auto``, 8, False); ``auto`` -> (``auto``, None: the default depth,
    False); ``auto-enc`` -> (``auto``, None, True: an encrypted store)."""
    encrypted = config.endswith("-enc")
    compression, _, depth = config.removesuffix("-enc").partition("-d")
    return compression, int(depth) if depth else None, encrypted


class Chunkstore:
    def __init__(self, root: Path, config: str) -> None:
        compression, depth, encrypted = _settings(config)
        self.store = chunkstore.open(root, compression=compression, delta_depth=depth, create=True,
                                     encrypt=encrypted,
                                     password=BENCH_PASSWORD if encrypted else None)

    def save(self, version: TraceVersion, state: dict[str, Any]) -> None:
        torch_bridge.save(self.store, state, run=version.run, step=version.step)

    def restore(self, version: TraceVersion, target: dict[str, Any]) -> Any:
        torch_bridge.load(self.store, f"{version.run}@{version.step}", target)
        return target

    def load(self, version: TraceVersion, keys: list[str]) -> Any:
        """Empty trees as targets: every tensor is read into a new one."""
        return torch_bridge.load(self.store, f"{version.run}@{version.step}",
                                 {key: {} for key in keys})

    def physical_bytes(self) -> int:
        """What the chunk and node objects occupy: ``store.stats().physical_bytes``,
        read off the directory (stats() runs two GC dry runs, and this runs per save)."""
        root = Path(self.store.url)
        return tree_bytes(root / "chunks") + tree_bytes(root / "nodes")

    def objects(self) -> int:
        """Objects in the store (the local index is not one)."""
        return tree_files(Path(self.store.url), skip="index")

    def close(self) -> None:
        self.store.close()


class ChunkstoreAsync(Chunkstore):
    """A Checkpointer per run over one store: the pause is the staging copy."""

    def __init__(self, root: Path, config: str) -> None:
        super().__init__(root, config)
        self._ckpt: Any = None

    def save(self, version: TraceVersion, state: dict[str, Any]) -> None:
        if self._ckpt is None or self._ckpt.run != version.run:
            self.close_checkpointer()
            self._ckpt = torch_bridge.Checkpointer(self.store, run=version.run,
                                                   async_save=True)
        self._ckpt.save(version.step, **state)

    def wait(self) -> None:
        if self._ckpt is not None:
            self._ckpt.wait()

    def close_checkpointer(self) -> None:
        if self._ckpt is not None:
            self._ckpt.close()
            self._ckpt = None

    def close(self) -> None:
        self.close_checkpointer()
        super().close()


class ChecksumMismatch(Exception):
    """Raised when a restore reference reads bytes whose BLAKE3 differs from the file's."""


class CheckedRead(Safetensors):
    """``load_file``, a copy into the live tensors, then BLAKE3 over each tensor's bytes
    (``max_threads=blake3.AUTO``: the package's own threads, all cores on a large
    tensor), each digest compared with the one taken as the file was written."""

    HOW = ("safetensors load_file + copy into the live tensors + BLAKE3 of each tensor"
           " (blake3 package, max_threads=AUTO), digests compared")

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.digests: dict[Path, dict[str, bytes]] = {}

    def write(self, path: Path, state: dict[str, Any]) -> None:
        super().write(path, state)
        self.digests[path] = {name: self._digest(tensor)
                              for name, tensor in flatten(state).items()}

    @staticmethod
    def _digest(tensor: torch.Tensor) -> bytes:
        return blake3.blake3(tensor_bytes(tensor), max_threads=blake3.blake3.AUTO).digest()

    def restore(self, version: TraceVersion, target: dict[str, Any]) -> Any:
        copy_into(target, self.load(version, list(target)))
        expected = self.digests[self.path(version)]
        for name, tensor in flatten(target).items():
            if self._digest(tensor) != expected[name]:
                raise ChecksumMismatch(f"{self.path(version)}: {name} read back other bytes")
        return target


#: The floor reads and hashes a chunk's worth of bytes per job (what a raw store's read
#: job does), in steps small enough to be hashed while the core's cache holds them.
FLOOR_PIECE = DEFAULT_CHUNK_SIZE
FLOOR_STEP = 256 << 10
_IOV_MAX = os.sysconf("SC_IOV_MAX")


def cut(views: Iterable[memoryview], size: int, start: int = 0
        ) -> list[tuple[int, list[memoryview]]]:
    """The bytes of ``views`` end to end, cut into pieces of ``size`` bytes (the last
    one shorter): each piece's offset (counted from ``start``) and its slices of them."""
    pieces: list[tuple[int, list[memoryview]]] = []
    current: list[memoryview] = []
    filled, offset = 0, start
    for whole in views:
        view = whole
        while len(view):
            part, view = view[:size - filled], view[size - filled:]
            current.append(part)
            filled += len(part)
            if filled == size:
                pieces.append((offset, current))
                offset, current, filled = offset + size, [], 0
    if current:
        pieces.append((offset, current))
    return pieces


def _read_and_hash(fd: int, offset: int, views: list[memoryview]) -> bytes:
    """Read the file's bytes from ``offset`` into ``views`` and hash them, a step at a time;
    their BLAKE3 digest (the hasher releases the GIL on each step)."""
    hasher = blake3.blake3()
    for start, step in cut(views, FLOOR_STEP, offset):
        at = start
        for first in range(0, len(step), _IOV_MAX):
            group = step[first:first + _IOV_MAX]
            wanted = sum(len(view) for view in group)
            if os.preadv(fd, group, at) != wanted:
                raise ChecksumMismatch(f"the file ends before byte {at + wanted}")
            at += wanted
        for view in step:
            hasher.update(view)
    return hasher.digest()


class CopyHashFloor(FileSystem):
    """The machine's copy+hash floor: the state's bytes end to end in one file (in the
    page cache: just written), read into the live tensors with ``preadv`` and hashed with
    BLAKE3 in pieces of a chunk (``FLOOR_PIECE``), one thread per core taking pieces,
    each piece in 256 KiB steps (about 8% less CPU than a 4 MiB read then its hash,
    measured here); each piece's digest compared with the one taken as it was written.
    No framing, no metadata, no allocation: what checking every byte costs at least."""

    suffix = ".bin"
    HOW = (f"preadv from a page-cached file of the state's bytes into the live tensors +"
           f" BLAKE3, {FLOOR_PIECE >> 20} MiB pieces on {os.cpu_count()} threads, in"
           f" {FLOOR_STEP >> 10} KiB steps, digests compared")

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.pool = ThreadPoolExecutor(os.cpu_count() or 1)
        self.digests: dict[Path, list[bytes]] = {}

    @staticmethod
    def _views(state: dict[str, Any]) -> list[memoryview]:
        return [tensor_bytes(tensor) for tensor in flatten(state).values()]

    def write(self, path: Path, state: dict[str, Any]) -> None:
        views = self._views(state)
        with open(path, "wb") as out:
            for view in views:
                out.write(view)
        self.digests[path] = [blake3.blake3(b"".join(piece)).digest()
                              for _, piece in cut(views, FLOOR_PIECE)]

    def restore(self, version: TraceVersion, target: dict[str, Any]) -> Any:
        path = self.path(version)
        fd = os.open(path, os.O_RDONLY)
        try:
            digests = list(self.pool.map(lambda piece: _read_and_hash(fd, *piece),
                                         cut(self._views(target), FLOOR_PIECE)))
        finally:
            os.close(fd)
        if digests != self.digests[path]:
            raise ChecksumMismatch(f"{path}: read back other bytes")
        return target

    def close(self) -> None:
        self.pool.shutdown()


def open_reference(name: str, root: Path) -> CheckedRead | CopyHashFloor:
    """One of ``REFERENCES``: it saves (writes its file, untimed) and restores."""
    kinds: dict[str, type[CheckedRead] | type[CopyHashFloor]] = {
        "checked-read": CheckedRead, "copy-hash-floor": CopyHashFloor}
    return kinds[name](root)


def open_sync(system: str, root: Path) -> Any:
    if system.startswith("chunkstore-"):
        return Chunkstore(root, system.removeprefix("chunkstore-"))
    return {"torch.save": TorchSave, "safetensors": Safetensors, "dcp": Dcp}[system](root)


def open_async(system: str, root: Path) -> Any:
    """The async variant of ``system``, or None where it has none (its pause is its save)."""
    if system.startswith("chunkstore-"):
        return ChunkstoreAsync(root, system.removeprefix("chunkstore-"))
    return DcpAsync(root) if system == "dcp" else None
