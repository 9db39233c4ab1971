"""DTensors in a multi-rank checkpoint: the box each rank holds, written and read back.

A DTensor (``torch.distributed.tensor``: FSDP2, tensor parallel, or replicated
placements) is one global tensor; each rank holds a box of it (offsets and
sizes in the global shape, as DCP computes them).  A multi-rank save stores
each distinct box once, as one shard of the tensor's entry; a restore fills
each rank's box from the shards that intersect it, so a box need not match a
saved one (another mesh or placement of the same global tensor).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from chunkstore import VersionReader
from chunkstore.errors import InvalidInputError
from chunkstore.format.manifest import TensorEntry
from torch_bridge.capture.tensors import as_array, readable_in_place


def is_dtensor(value: object) -> bool:
    """Whether ``value`` is a DTensor (without importing torch.distributed.tensor when
    nothing could be one)."""
    if not isinstance(value, torch.Tensor) or type(value) is torch.Tensor:
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def local_box(tensor: Any) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """This rank's local tensor of a DTensor, and its box: offsets and sizes in the
    global shape (what DCP's planner computes)."""
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if any(isinstance(p, Partial) for p in tensor.placements):
        raise InvalidInputError("a DTensor with a Partial placement holds no value of its own"
                                " (reduce it first, e.g. .redistribute() to Replicate)")
    sizes, offsets = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh,
                                                           tensor.placements)
    local = tensor.to_local()
    if tuple(local.shape) != tuple(sizes):
        raise InvalidInputError(f"a DTensor's local tensor is {list(local.shape)}, its"
                                f" placements give a box of {list(sizes)}")
    return local, tuple(offsets), tuple(sizes)


def read_local(reader: VersionReader, name: str, tensor: Any) -> None:
    """Fill this rank's box of the DTensor ``tensor`` from entry ``name``, hash-verified."""
    local, offsets, sizes = local_box(tensor)
    direct = readable_in_place(local)
    host = local if direct else torch.empty(sizes, dtype=local.dtype)
    array, _ = as_array(host)
    read_box(reader, name, offsets, sizes, array)
    if not direct:
        with torch.no_grad():
            local.copy_(host)


def read_box(reader: VersionReader, name: str, offsets: tuple[int, ...],
             sizes: tuple[int, ...], out: np.ndarray) -> None:
    """Fill ``out`` (shape ``sizes``) with the box at ``offsets`` of a tensor entry,
    reading from each shard the part of the box it holds.  The shards tile the
    tensor (a reader checks it), so every element is read exactly once."""
    entry = reader.entry(name)
    if not isinstance(entry, TensorEntry) or len(entry.shape) != len(sizes):
        raise InvalidInputError(f"entry {name!r} is no tensor of {len(sizes)} dimensions")
    for number, shard in enumerate(entry.shards):
        low = [max(o, s) for o, s in zip(offsets, shard.offsets, strict=True)]
        high = [min(o + n, s + m) for o, n, s, m in zip(offsets, sizes, shard.offsets,
                                                        shard.sizes, strict=True)]
        if any(h <= lo for lo, h in zip(low, high, strict=True)):
            continue
        inside = tuple(lo - s for lo, s in zip(low, shard.offsets, strict=True))
        extent = tuple(h - lo for lo, h in zip(low, high, strict=True))
        view = out[tuple(slice(lo - o, h - o) for lo, h, o in zip(low, high, offsets,
                                                                   strict=True))]
        reader.get_box(name, number, inside, extent, view)
