"""Export the weights of one version as a safetensors file (optimizer and the rest stripped)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from chunkstore import Store, VersionInfo, VersionReader
from chunkstore.errors import InvalidInputError
from chunkstore.format.manifest import DataEntry, TensorEntry
from torch_bridge.capture.layout import BRIDGE_ENTRY, saved_ranks
from torch_bridge.capture.state import TensorRecord
from torch_bridge.capture.tensors import as_array, torch_dtype
from torch_bridge.checkpointer import open_store
from torch_bridge.dcp.layout import METADATA_ENTRY, StoredItems

CAST_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def _names(reader: VersionReader, prefix: str) -> dict[str, str]:
    """Output name -> entry name for the tensors under ``prefix``.

    For torch_bridge versions a model's tensor is named by its state_dict key
    (exactly, even where the entry name had to be adjusted); for DCP saves by
    its FQN (DCP's bytes items, pickled values, are no tensors to export); for
    other versions by the entry name with the prefix removed.
    """
    entries = reader.entries()
    if BRIDGE_ENTRY in entries:
        return _bridge_names(reader, prefix)
    leaf = entries.get(METADATA_ENTRY)
    if isinstance(leaf, DataEntry):
        items = StoredItems(leaf, reader.get_data(METADATA_ENTRY), entries)
        return {fqn[len(prefix):]: name for fqn, name in items.tensors.items()
                if fqn.startswith(prefix)}
    return {name[len(prefix):]: name for name, leaf in entries.items()
            if isinstance(leaf, TensorEntry) and name.startswith(prefix)}


def _bridge_names(reader: VersionReader, prefix: str) -> dict[str, str]:
    names: dict[str, str] = {}
    # Rank 0's names (one rank for a single-process version; in a multi-rank one its
    # replicated and sharded tensors are every rank's, and no model weight differs).
    # Every kind of array is a tensor to export: numpy arrays in the state (the numpy
    # RNG's key, rng.numpy.1) as much as torch tensors and DTensors.
    for key, section in saved_ranks(reader)[0].items():
        for plain in section["tensors"]:
            record = TensorRecord.from_plain(plain)
            if not record.entry.startswith(prefix):
                continue
            single = len(record.path) == 1 and isinstance(record.path[0], str)
            if single and prefix == f"{key}.":
                names[record.path[0]] = record.entry
            else:
                names[record.entry[len(prefix):]] = record.entry
    # What no record of rank 0 names (another rank's own tensors, such as its RNG
    # state, in a multi-rank version) goes by its entry name: nothing under the
    # prefix is left out.
    exported = set(names.values())
    for name, leaf in reader.entries().items():
        if isinstance(leaf, TensorEntry) and name.startswith(prefix) and name not in exported:
            out_name = name[len(prefix):]
            if out_name in names:
                raise InvalidInputError(f"entries {names[out_name]!r} and {name!r} would both"
                                        f" be exported as {out_name!r}; export with another"
                                        " --prefix")
            names[out_name] = name
    return names


def read_tensor(reader: VersionReader, name: str) -> torch.Tensor:
    """One tensor entry as a new CPU tensor (hash-verified).

    A tensor saved as several shards (by several ranks) is assembled from its
    shards' boxes: the manifest decoder has refused any entry whose boxes do
    not tile its shape exactly (a gap or an overlap is a
    :class:`~chunkstore.errors.CorruptNodeError` before anything is read).
    """
    entry = reader.entry(name)
    if not isinstance(entry, TensorEntry):
        raise InvalidInputError(f"entry {name!r} is not a tensor")
    tensor = torch.empty(tuple(entry.shape), dtype=torch_dtype(entry.dtype))
    array, override = as_array(tensor)
    reader.get_into(name, array, dtype=override)
    return tensor


@dataclass
class ExportedTensors:
    """What an export read from one version: the tensors to write, by output name, and
    what it left out (the lineage file names both)."""

    info: VersionInfo
    tensors: dict[str, torch.Tensor]
    #: Tensors whose dtype the cast changed.
    cast: int
    #: Entries not exported, by the first part of their names (``optimizer``, ``rng``):
    #: how many tensors and plain-data entries, and their logical bytes.
    left_out: dict[str, dict[str, int]]


def read_export(store: Store, selector: str, prefix: str = "model.",
                dtype: str | None = None) -> ExportedTensors:
    """The tensors under ``prefix`` of version ``selector`` as CPU tensors, cast to
    ``dtype`` (float16, bfloat16, float32) where floating-point, hash-verified."""
    if dtype is not None and dtype not in CAST_DTYPES:
        raise InvalidInputError(f"dtype {dtype!r}: choose one of {', '.join(CAST_DTYPES)}")
    with contextlib.closing(store.open_version(selector)) as reader:  # its read lease ends
        names = _names(reader, prefix)                                 # with the read
        if not names:
            raise InvalidInputError(f"version {reader.info.short_id} has no tensors under"
                                    f" prefix {prefix!r}")
        if "__metadata__" in names:  # the header's own key: the file would not load
            raise InvalidInputError(f"version {reader.info.short_id} has a tensor named"
                                    " '__metadata__' under the prefix, which a safetensors"
                                    " file cannot hold; export with another --prefix")
        tensors, cast = {}, 0
        for out_name, entry in sorted(names.items()):
            tensor = read_tensor(reader, entry)
            if dtype is not None and tensor.is_floating_point():
                cast += tensor.dtype != CAST_DTYPES[dtype]
                tensor = tensor.to(CAST_DTYPES[dtype])
            tensors[out_name] = tensor
        left_out = _left_out(reader.entries(), set(names.values()))
        return ExportedTensors(reader.info, tensors, cast, left_out)


def _left_out(entries: Mapping[str, TensorEntry | DataEntry],
              exported: set[str]) -> dict[str, dict[str, int]]:
    groups: dict[str, dict[str, int]] = {}
    for name, leaf in sorted(entries.items()):
        if name in exported:
            continue
        group = groups.setdefault(name.split(".", 1)[0],
                                  {"tensors": 0, "data": 0, "bytes": 0})
        group["tensors" if isinstance(leaf, TensorEntry) else "data"] += 1
        group["bytes"] += leaf.nbytes
    return groups


def export_safetensors(store: Store | str | os.PathLike[str], selector: str,
                       out_path: str | os.PathLike[str], prefix: str = "model.",
                       dtype: str | None = None, *, overwrite: bool = False) -> dict[str, Any]:
    """Write the tensors under ``prefix`` of version ``selector`` to a safetensors file.

    ``dtype`` (float16, bfloat16, float32) casts floating-point tensors.  The
    file is written beside its target and moved into place when complete; an
    existing file is replaced only with ``overwrite``.  Returns a summary:
    version id, step, tensor count, bytes.
    """
    from safetensors.torch import save_file  # missing: said before anything is read

    if dtype is not None and dtype not in CAST_DTYPES:
        raise InvalidInputError(f"dtype {dtype!r}: choose one of {', '.join(CAST_DTYPES)}")
    _check_target(os.fspath(out_path), overwrite)
    opened, owned = open_store(store, create=False)
    try:
        exported = read_export(opened, selector, prefix, dtype)
    finally:
        if owned:
            opened.close()
    info = exported.info
    _write_atomically(exported.tensors, os.fspath(out_path), safetensors_metadata(info),
                      save_file, overwrite)
    return {"version": info.id, "step": info.step, "tensors": len(exported.tensors),
            "bytes": os.path.getsize(out_path), "path": os.fspath(out_path)}


def safetensors_metadata(info: VersionInfo) -> dict[str, str]:
    """The header metadata of an exported file: the version it came from."""
    return {"chunkstore_version": info.id, "run": info.run, "step": str(info.step)}


def _check_target(out_path: str, overwrite: bool) -> None:
    """Refuse, before anything is read, a file that would land nowhere or clobber one."""
    directory = os.path.dirname(os.path.abspath(out_path))
    if not os.path.isdir(directory):
        raise InvalidInputError(f"cannot write {out_path}: the directory {directory} does"
                                " not exist")
    if os.path.isdir(out_path):
        raise InvalidInputError(f"cannot write {out_path}: it is a directory")
    if os.path.lexists(out_path) and not overwrite:
        raise InvalidInputError(f"{out_path} exists; pass --force (overwrite=True) to"
                                " replace it")


def _write_atomically(tensors: dict[str, torch.Tensor], out_path: str,
                      metadata: dict[str, str], save_file: Any, overwrite: bool) -> None:
    directory = os.path.dirname(os.path.abspath(out_path))
    fd, tmp = tempfile.mkstemp(prefix=".export-", suffix=".tmp", dir=directory)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=metadata)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # the mode a plain open() would give, not 0600
        if overwrite:
            os.replace(tmp, out_path)
        else:  # a hard link creates the name only where none is: no clobbering a file
            try:  # written meanwhile by someone else
                os.link(tmp, out_path)
            except FileExistsError:
                raise InvalidInputError(f"{out_path} appeared while exporting; pass --force"
                                        " (overwrite=True) to replace it") from None
            except OSError:  # a file system without hard links: checked, then moved
                _check_target(out_path, overwrite)
                os.replace(tmp, out_path)
                return
            os.unlink(tmp)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
