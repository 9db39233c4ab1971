"""Tensors stored as several shards: box geometry, and shards staged by other processes.

A tensor entry holds one or more shards (docs/format.md §6.2), each a box of
the global tensor (``offsets`` + ``sizes``) whose bytes, in C order, are cut
into chunks.  A save by one process writes one shard covering the tensor; a
sharded save (``torch_bridge.dcp``: one shard per rank, or per DCP chunk)
writes many, each by the process that holds it.  This module is the
geometry both need, with no I/O:

- which chunks of a shard hold a sub-box of it (a resharding read needs
  only those);
- where each shard's bytes go in the full array (a read of the whole tensor);
- :class:`StagedShard`: one shard whose chunks a process stored without
  publishing, as plain data, so that it can travel to the process that
  publishes the version (which claims every chunk again before it commits:
  :meth:`chunkstore.write.writer.VersionWriter.adopt`);
- :class:`ShardRanks`: which process (rank) wrote each shard of a version,
  kept as plain data in the entry :data:`RANKS_ENTRY`, for ``show`` and
  ``report``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from chunkstore.errors import InvalidInputError
from chunkstore.format.digest import Digest
from chunkstore.format.dtypes import element_size
from chunkstore.format.manifest import (
    MAX_CHUNK_BYTES,
    MAX_DIM,
    MAX_RANK,
    MAX_SHARDS,
    Shard,
    TensorEntry,
    shard_from_json,
)

#: The plain-data entry in which a save by several processes records which one wrote
#: each shard (:class:`ShardRanks`).  Versions without it are read as before: their
#: shards' writers are unknown, only their boxes are shown.
RANKS_ENTRY = "_shards.ranks"
#: The largest world size a ranks record may name.
MAX_WORLD_SIZE = 1 << 20

#: (digest, codec id, raw length, stored length) of a chunk object a process wrote.
WrittenChunk = tuple[Digest, int, int, int]


def is_sharded(entry: TensorEntry) -> bool:
    """Whether the entry's bytes are not simply its one shard's bytes."""
    return len(entry.shards) != 1 or entry.shards[0].sizes != entry.shape


def shard_bases(entry: TensorEntry) -> list[int]:
    """Where each shard's bytes start when the shards are laid end to end (shard order)."""
    itemsize = element_size(entry.dtype)
    starts, total = [], 0
    for shard in entry.shards:
        starts.append(total)
        total += shard.nbytes(itemsize)
    return starts


def _box_slices(offsets: Sequence[int], sizes: Sequence[int]) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))


def scatter_shards(entry: TensorEntry, staged: np.ndarray, out: np.ndarray) -> None:
    """Copy the shards' bytes laid end to end (``staged``, uint8) into ``out``, the
    full tensor (any dtype of the entry's element size, the entry's shape)."""
    itemsize = element_size(entry.dtype)
    for start, shard in zip(shard_bases(entry), entry.shards, strict=True):
        count = math.prod(shard.sizes)
        if count:
            piece = staged[start:start + count * itemsize].view(out.dtype).reshape(shard.sizes)
            out[_box_slices(shard.offsets, shard.sizes)] = piece


def find_shard(entry: TensorEntry, offsets: Sequence[int]) -> int:
    """The number of the shard whose box starts at ``offsets``."""
    wanted = tuple(offsets)
    for i, shard in enumerate(entry.shards):
        if shard.offsets == wanted:
            return i
    raise InvalidInputError(f"the tensor has no shard at offsets {list(wanted)} (its shards"
                            f" start at {[list(s.offsets) for s in entry.shards]})")


def check_box(shard: Shard, offsets: Sequence[int], sizes: Sequence[int]) -> None:
    """Refuse a sub-box that does not lie inside the shard (or is not made of integers)."""
    try:
        numbers: tuple[object, ...] = (*offsets, *sizes)
    except TypeError:
        numbers = (None,)
    if not all(isinstance(n, (int, np.integer)) and not isinstance(n, bool) for n in numbers):
        raise InvalidInputError(f"box {offsets!r}+{sizes!r}: offsets and sizes must be"
                                " sequences of integers")
    if len(offsets) != len(shard.sizes) or len(sizes) != len(shard.sizes) or any(
            o < 0 or s < 0 or o + s > full
            for o, s, full in zip(offsets, sizes, shard.sizes, strict=True)):
        raise InvalidInputError(f"box {list(offsets)}+{list(sizes)} does not lie inside a shard"
                                f" of sizes {list(shard.sizes)}")


def box_chunk_range(shard: Shard, itemsize: int, offsets: Sequence[int], sizes: Sequence[int]
                    ) -> range:
    """The chunks of ``shard`` that hold bytes of its sub-box at ``offsets`` (shard
    coordinates) of ``sizes``: from the one holding its first element to the one
    holding its last (C order)."""
    if not math.prod(sizes):
        return range(0)
    strides = [math.prod(shard.sizes[d + 1:]) for d in range(len(shard.sizes))]
    first = sum(o * s for o, s in zip(offsets, strides, strict=True))
    last = sum((o + n - 1) * s for o, n, s in zip(offsets, sizes, strides, strict=True))
    return range(first * itemsize // shard.chunk_bytes,
                 -(-(last + 1) * itemsize // shard.chunk_bytes))


def box_of(staged: np.ndarray, shard: Shard, offsets: Sequence[int], sizes: Sequence[int],
           dtype: np.dtype) -> np.ndarray:
    """The sub-box of a shard whose bytes are ``staged`` (uint8, the whole shard's length)."""
    return staged.view(dtype).reshape(shard.sizes)[_box_slices(offsets, sizes)]


def _int_list(value: object, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > MAX_RANK or not all(
            type(v) is int and 0 <= v <= MAX_DIM for v in value):
        raise InvalidInputError(f"{what} must be a list of at most {MAX_RANK} non-negative"
                                f" integers, not {value!r}")
    return tuple(value)


def _written(value: object) -> WrittenChunk:
    if not (isinstance(value, list) and len(value) == 4 and isinstance(value[0], str)
            and all(type(v) is int and 0 <= v <= 2 * MAX_CHUNK_BYTES for v in value[1:])):
        raise InvalidInputError(f"a written chunk is [hex, codec id, raw length, stored length],"
                                f" not {value!r}")
    return Digest.parse(value[0]), value[1], value[2], value[3]


@dataclass(frozen=True)
class StagedShard:
    """One shard of a tensor whose chunks are stored but not yet in any version.

    ``shape`` is the global tensor's; ``written`` the chunk objects the staging
    process wrote (the others it found stored and claimed).  Until a version
    naming them commits, the chunks are orphans: only the session of the
    process that publishes protects them from GC (see ``torch_bridge.dcp``).
    """

    dtype: str
    shape: tuple[int, ...]
    shard: Shard
    written: tuple[WrittenChunk, ...] = ()

    def to_plain(self) -> dict[str, Any]:
        """Plain data (str, int, lists, dicts) that :meth:`from_plain` reads back."""
        return {"dtype": self.dtype, "shape": list(self.shape), "shard": self.shard.to_json(),
                "written": [[d.hex, codec, raw, stored] for d, codec, raw, stored in self.written]}

    @classmethod
    def from_plain(cls, value: object) -> StagedShard:
        """Read :meth:`to_plain`'s output back; InvalidInputError on anything else."""
        if not isinstance(value, dict) or not isinstance(value.get("dtype"), str) \
                or not isinstance(value.get("written"), list):
            raise InvalidInputError(f"a staged shard is a dict with dtype, shape, shard and"
                                    f" written, not {type(value).__name__}")
        try:
            shard = shard_from_json(value.get("shard"), value["dtype"])
            written = tuple(_written(w) for w in value["written"])
        except ValueError as exc:
            raise InvalidInputError(f"malformed staged shard: {exc}") from exc
        staged = cls(value["dtype"], _int_list(value.get("shape"), "shape"), shard, written)
        check_box(Shard((0,) * len(staged.shape), staged.shape, 1, ()), shard.offsets,
                  shard.sizes)
        return staged


@dataclass(frozen=True)
class ShardRanks:
    """Which rank (0 .. ``world_size - 1``) wrote each shard of a version's tensors.

    ``ranks`` maps an entry name to one rank per shard, in the entry's shard
    order.  Stored as plain data (:data:`RANKS_ENTRY`)::

        {"format": 1, "world_size": 2, "shards": {"w": [0, 1], "bias": [0]}}

    It only annotates the version: a reader of the tensors never needs it.
    """

    world_size: int
    ranks: dict[str, tuple[int, ...]]

    def to_plain(self) -> dict[str, Any]:
        return {"format": 1, "world_size": self.world_size,
                "shards": {name: list(ranks) for name, ranks in sorted(self.ranks.items())}}

    @classmethod
    def from_plain(cls, value: object, entries: dict[str, object]) -> ShardRanks:
        """Read :meth:`to_plain`'s output, checked against the version's ``entries``
        (every name a tensor entry, one rank per shard, each below the world size);
        ``ValueError`` on anything else."""
        if not isinstance(value, dict) or value.get("format") != 1 \
                or not isinstance(value.get("shards"), dict):
            raise ValueError("a ranks record is {format: 1, world_size, shards: {entry: ranks}}")
        world = value.get("world_size")
        if type(world) is not int or not 1 <= world <= MAX_WORLD_SIZE:
            raise ValueError(f"world_size must be an integer in [1, {MAX_WORLD_SIZE}],"
                             f" not {world!r}")
        ranks: dict[str, tuple[int, ...]] = {}
        for name, listed in value["shards"].items():
            entry = entries.get(name)
            if not isinstance(entry, TensorEntry):
                raise ValueError(f"names {name!r}, which is no tensor entry of the version")
            if not isinstance(listed, list) or len(listed) != len(entry.shards) \
                    or len(listed) > MAX_SHARDS \
                    or not all(type(r) is int and 0 <= r < world for r in listed):
                raise ValueError(f"{name!r}: needs one rank in [0, {world}) for each of its"
                                 f" {len(entry.shards)} shards, not {listed!r}")
            ranks[name] = tuple(listed)
        return cls(world, ranks)
