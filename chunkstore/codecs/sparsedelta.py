"""Codec 6: a sub-delta that lists only the runs of elements that changed.

A sparse update (an embedding table's touched rows, a frozen block next to a
trained one) leaves most elements of a chunk as they were: their sub-delta
image (codec 5) is zero.  Codec 5 stores those zeros compressed, but a reader
still decompresses and walks every one of them, once per link of a chain, so
a chain of sparse deltas costs a full decode per link.  Codec 6 stores the
runs of changed elements and their image alone; a reader copies the base
once and adds each run in place, so a link costs what changed, and a chain
of such links costs about one decode of its root (docs/format.md §3.2).

Payload (element size 1, 2, 4 or 8; the header's raw length ``n`` bytes,
``n / size`` elements)::

    u32 LE run_count
    u32 LE table_length
    table_length bytes: one zstd frame of run_count pairs of u32 LE
        (gap, count): the run starts gap elements after the previous run's
        end (the first: after element 0), holds count >= 1 elements, and
        every run ends within the chunk
    the rest: a sub-delta payload (codec 5's shuffle-zstd of zigzag images)
        of the runs' elements, in order (sum of counts x size bytes); empty
        when run_count is 0

Writers merge runs separated by at most :data:`MERGE_GAP` unchanged elements
(their zero images are stored): a run costs 8 bytes of table, a zero image
element less after zstd.
"""

from __future__ import annotations

import struct

import numpy as np

from chunkstore.codecs import copy_bytes, native
from chunkstore.codecs.subdelta import SUB_DELTA, SubDeltaCodec, lane_of, unzigzag_add_numpy
from chunkstore.codecs.zstd import compressor, decompress

#: Unchanged elements between two runs up to which a writer stores one run.
MERGE_GAP = 4
#: A writer uses this codec when at most this fraction of a chunk's elements changed.
MAX_CHANGED = 0.5
_HEAD = struct.Struct("<II")
#: How the runs' images are stored: as they are, or as a sub-delta payload.
RAW_VALUES, PACKED_VALUES = 0, 1
#: The runs' images are stored compressed only below this fraction of their size.
PACK_VALUES_BELOW = 0.5


def _lane(element_size: int, length: int) -> np.dtype[np.unsignedinteger]:
    return lane_of(element_size, length, "sparse-delta")


def runs_of(image: memoryview, element_size: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The (starts, counts) of the runs of non-zero elements of a zigzag ``image``
    (runs up to :data:`MERGE_GAP` apart joined), or None when more than
    :data:`MAX_CHANGED` of its elements are non-zero (codec 5 suits it better)."""
    lanes = np.frombuffer(image, dtype=_lane(element_size, len(image)))
    if np.count_nonzero(lanes) > MAX_CHANGED * len(lanes):  # a quick pass before listing
        return None
    changed = np.flatnonzero(lanes)
    if not len(changed):
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    breaks = np.flatnonzero(np.diff(changed) > MERGE_GAP + 1)
    starts = changed[np.concatenate(([0], breaks + 1))]
    ends = changed[np.concatenate((breaks, [len(changed) - 1]))] + 1
    return starts.astype(np.int64), (ends - starts).astype(np.int64)


def _gather(lanes: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The elements of every run, in order."""
    if len(starts) == 1:
        gathered: np.ndarray = lanes[starts[0]:starts[0] + counts[0]]
    else:
        gathered = lanes[_indices(starts, counts)]
    return gathered


class SparseDeltaCodec(SubDeltaCodec):
    id = 6
    name = "sparse-delta"

    def encode(self, raw: memoryview, element_size: int) -> bytes:
        """The payload of a zigzag image ``raw`` (:meth:`image_of`); every element is
        listed when the image is dense (:func:`encode_runs` is what writers call)."""
        found = runs_of(raw, element_size)
        if found is None:
            n = len(raw) // element_size
            found = (np.zeros(1, dtype=np.int64), np.full(1, n, dtype=np.int64))
        return encode_runs(raw, element_size, *found)

    def _runs(self, payload: memoryview, raw_length: int, element_size: int
              ) -> tuple[np.ndarray, np.ndarray, memoryview]:
        """The runs' starts and counts (checked against the chunk) and their image."""
        _lane(element_size, raw_length)
        if len(payload) < _HEAD.size:
            raise ValueError("sparse-delta payload is shorter than its header")
        run_count, table_length = _HEAD.unpack_from(payload)
        elements = raw_length // element_size
        if run_count > elements or table_length > len(payload) - _HEAD.size:
            raise ValueError(f"sparse-delta header is damaged ({run_count} runs, a table of"
                             f" {table_length} bytes)")
        table_end = _HEAD.size + table_length
        if run_count == 0:
            if table_length or len(payload) != table_end:
                raise ValueError("sparse-delta payload without runs holds bytes")
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty, memoryview(b"")
        pairs = np.frombuffer(decompress(payload[_HEAD.size:table_end], 8 * run_count),
                              dtype="<u4").reshape(run_count, 2).astype(np.int64)
        gaps, counts = pairs[:, 0], pairs[:, 1]
        if counts.min() < 1:
            raise ValueError("sparse-delta run of no elements")
        ends = np.cumsum(gaps + counts)  # int64: no overflow for 2^32 runs of 2^32
        if ends[-1] > elements:
            raise ValueError(f"sparse-delta runs reach element {ends[-1]}, the chunk holds"
                             f" {elements}")
        changed = int(counts.sum())
        mode = payload[table_end] if len(payload) > table_end else -1
        values = payload[table_end + 1:]
        if mode == RAW_VALUES:
            if len(values) != changed * element_size:
                raise ValueError(f"sparse-delta holds {len(values)} bytes of values, its runs"
                                 f" {changed * element_size}")
            return ends - counts, counts, values
        if mode != PACKED_VALUES:
            raise ValueError(f"sparse-delta values of an unknown mode ({mode})")
        image = SUB_DELTA.decode(values, changed * element_size, element_size)
        return ends - counts, counts, image

    def decode(self, payload: memoryview, raw_length: int, element_size: int) -> memoryview:
        """The whole zigzag image (zeros outside the runs), as codec 5 would give it."""
        starts, counts, values = self._runs(payload, raw_length, element_size)
        lane = _lane(element_size, raw_length)
        image = np.zeros(raw_length // element_size, dtype=lane)
        if len(starts):
            image[_indices(starts, counts)] = np.frombuffer(values, dtype=lane)
        return image.view(np.uint8).data

    def decode_into(self, payload: memoryview, out: memoryview, element_size: int) -> None:
        copy_bytes(out, self.decode(payload, len(out), element_size))

    def decode_onto(self, payload: memoryview, base: bytes | memoryview, out: memoryview,
                    element_size: int) -> None:
        """out = base, then each run's image added in (out overlaps neither input)."""
        if len(base) != len(out):
            raise ValueError(f"a base of {len(base)} bytes for a chunk of {len(out)}")
        starts, counts, values = self._runs(payload, len(out), element_size)
        copy_bytes(out, base)
        _add_runs(out, starts, counts, values, element_size)

    def apply_in_place(self, payload: memoryview, chunk: memoryview, element_size: int
                       ) -> None:
        """``chunk`` holds the base: add each run's image in, leaving the rest alone."""
        starts, counts, values = self._runs(payload, len(chunk), element_size)
        _add_runs(chunk, starts, counts, values, element_size)

    def apply_prefix(self, payload: memoryview, prefix: memoryview, raw_length: int,
                     element_size: int) -> None:
        """``prefix`` holds the first bytes of the base of a chunk of ``raw_length``
        bytes: add in the runs' images that fall within it, in place."""
        starts, counts, values = self._runs(payload, raw_length, element_size)
        lane = _lane(element_size, len(prefix))
        if not len(starts):
            return
        at = _indices(starts, counts)
        keep = at < len(prefix) // element_size
        lanes = np.frombuffer(prefix, dtype=lane)
        image = np.frombuffer(values, dtype=lane)[keep].copy()
        unzigzag_add_numpy(image.view(np.uint8).data, lanes[at[keep]].view(np.uint8).data,
                           element_size)
        lanes[at[keep]] = image


def encode_runs(image: memoryview, element_size: int, starts: np.ndarray,
                counts: np.ndarray) -> bytes:
    """The payload of the zigzag ``image`` restricted to the runs (:func:`runs_of`)."""
    lane = _lane(element_size, len(image))
    if not len(starts):
        return _HEAD.pack(0, 0)
    gaps = starts - np.concatenate(([0], (starts + counts)[:-1]))
    table = np.stack([gaps, counts], axis=1).astype("<u4")
    packed = compressor().compress(table.tobytes())
    values = _gather(np.frombuffer(image, dtype=lane), starts, counts).view(np.uint8).data
    body = SUB_DELTA.encode(values, element_size)
    if len(body) > PACK_VALUES_BELOW * len(values):
        return b"".join([_HEAD.pack(len(starts), len(packed)), packed, bytes([RAW_VALUES]),
                         values])
    return b"".join([_HEAD.pack(len(starts), len(packed)), packed, bytes([PACKED_VALUES]),
                     body])


def _indices(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The element index of every element of every run, in order."""
    offsets = np.cumsum(counts) - counts
    return np.repeat(starts - offsets, counts) + np.arange(int(counts.sum()))


def _add_runs(chunk: memoryview, starts: np.ndarray, counts: np.ndarray, values: memoryview,
              element_size: int) -> None:
    if not len(starts):
        return
    if native.MODULE is not None:
        native.MODULE.unzigzag_add_runs(chunk, np.ascontiguousarray(starts, dtype=np.int64),
                                        np.ascontiguousarray(counts, dtype=np.int64),
                                        values, element_size)
        return
    lane = _lane(element_size, len(chunk))
    lanes = np.frombuffer(chunk, dtype=lane)
    at = _indices(starts, counts)
    image = np.frombuffer(values, dtype=lane).copy()
    base = lanes[at]
    unzigzag_add_numpy(image.view(np.uint8).data, base.view(np.uint8).data, element_size)
    lanes[at] = image


SPARSE_DELTA = SparseDeltaCodec()
