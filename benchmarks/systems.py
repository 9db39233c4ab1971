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
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
import torch.distributed.checkpoint as dcp

import chunkstore
import torch_bridge
from benchmarks.bench_core import BENCH_PASSWORD
from benchmarks.trace import TraceVersion, flatten

# DCP without a process group says once per call that it assumes one process.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")
warnings.filterwarnings("ignore", message="torch.distributed is unavailable or uninitialized")
SYSTEMS = ("torch.save", "safetensors", "dcp", "chunkstore-none", "chunkstore-auto-d0",
           "chunkstore-auto", "chunkstore-auto-enc")


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


def open_sync(system: str, root: Path) -> Any:
    if system.startswith("chunkstore-"):
        return Chunkstore(root, system.removeprefix("chunkstore-"))
    return {"torch.save": TorchSave, "safetensors": Safetensors, "dcp": Dcp}[system](root)


def open_async(system: str, root: Path) -> Any:
    """The async variant of ``system``, or None where it has none (its pause is its save)."""
    if system.startswith("chunkstore-"):
        return ChunkstoreAsync(root, system.removeprefix("chunkstore-"))
    return DcpAsync(root) if system == "dcp" else None
