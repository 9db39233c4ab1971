"""One version written by many processes: each stages its boxes, one publishes.

The two halves of a sharded save that :mod:`torch_bridge.dcp.writer` (DCP's storage
plugin) and :mod:`torch_bridge.distributed.ranks` (the Checkpointer under torch.distributed)
share; the protocol around them, and why no GC deletes what they stage, is
argued in :mod:`torch_bridge.dcp.writer`:

- :func:`stage_boxes`, on every process: store its boxes' chunks durably,
  publish nothing, and describe each box as a :class:`StagedShard`;
- :func:`staged_entry`, on the publishing process: the tensor entry of every
  box staged for one tensor (then :meth:`chunkstore.VersionWriter.adopt`
  claims their chunks and the commit publishes them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from chunkstore import Store
from chunkstore.errors import InvalidInputError
from chunkstore.format.digest import Digest
from chunkstore.format.manifest import TensorEntry, tensor_entry
from chunkstore.format.shards import StagedShard
from chunkstore.index.lmdbindex import NewChunk


@dataclass(frozen=True)
class Box:
    """One box a process stores: ``array`` (``dtype`` overrides its stored dtype name)
    is the box of the global tensor of ``shape`` at ``offsets`` (None: the array is
    the whole tensor)."""

    name: str
    array: np.ndarray
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    offsets: tuple[int, ...] | None = None


def stage_boxes(store: Store, run: str, step: int, boxes: Iterable[Box],
                gc_seen: list[str]) -> list[StagedShard]:
    """Store the boxes' chunks durably under a session of this process, publish
    nothing, and describe each box (in order) for the publishing process.

    ``gc_seen``: the GC journal entries the publisher's session lists as seen;
    that session MUST be stored before this is called (see :mod:`torch_bridge.dcp.writer`).
    """
    boxes = list(boxes)
    writer = store.new_version(run, step)
    try:
        writer.follow_publisher(gc_seen)
        for n, box in enumerate(boxes):
            writer.put(f"b{n}", box.array, dtype=box.dtype)
        entries, written = writer.write_unpublished()
    except BaseException:
        writer.abort()
        raise
    new = {c.digest: c for c in written}
    staged = []
    for n, box in enumerate(boxes):
        entry = entries[f"b{n}"]
        (local,) = entry.shards
        if box.offsets is not None:  # a box, placed in the global shape
            local = dataclasses.replace(local, offsets=box.offsets)
        # The objects this box needs that this process wrote (a packed chunk's pack).
        mine = [new.pop(d) for d in dict.fromkeys(local.objects()) if d in new]
        staged.append(StagedShard(entry.dtype, box.shape or entry.shape, local, tuple(
            (c.digest, c.codec_id, c.raw_length, c.stored_length) for c in mine)))
    return staged


def staged_entry(name: str, shards: list[StagedShard], dtype: str,
                 written: dict[Digest, NewChunk]) -> TensorEntry:
    """The tensor entry of the boxes staged for tensor ``name``; the chunk objects the
    processes wrote are added to ``written``.  InvalidInputError when the boxes do
    not form the tensor (overlaps, gaps, another dtype or shape)."""
    if not shards:
        raise InvalidInputError(f"{name}: no process stored a box of it")
    for shard in shards:
        if shard.dtype != dtype or shard.shape != shards[0].shape:
            raise InvalidInputError(f"{name}: a process stored {shard.dtype}"
                                    f"{list(shard.shape)}, the plan says {dtype}"
                                    f"{list(shards[0].shape)}")
        for digest, codec, raw, stored in shard.written:
            written.setdefault(digest, NewChunk(digest, codec, raw, stored))
    try:
        return tensor_entry(dtype, shards[0].shape, tuple(s.shard for s in shards))
    except ValueError as exc:
        raise InvalidInputError(f"{name}: the boxes stored do not form a tensor: {exc}"
                                ) from exc
