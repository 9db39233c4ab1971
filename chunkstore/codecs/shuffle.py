"""Codec 2: bytes regrouped into planes by element size, each plane zstd or raw.

Float tensors compress in their exponent byte and hardly at all in the low
mantissa bytes (the observation behind ZipNN and blosc's shuffle), so each
plane is compressed on its own and kept raw when zstd does not shrink it:
the incompressible planes cost a copy, not a compression pass.

Payload: ``u8 plane_count`` then per plane ``u8 mode (0 raw, 1 zstd)``,
``u32 LE length``; then the planes' bytes in order.
"""

from __future__ import annotations

import struct

import numpy as np

from chunkstore import codecs
from chunkstore.codecs.planes import join, split_planes
from chunkstore.codecs.zstd import check_frame, decompress, plane_compressor

PROBE_BYTES = 16 * 1024
#: a plane is compressed only when a probe of it shrinks below this fraction.
PLANE_KEEP_RATIO = 0.9
_PLANE = struct.Struct("<BI")


def _compress_plane(plane: np.ndarray) -> tuple[int, bytes | memoryview]:
    data = plane.data
    if len(data) > 4 * PROBE_BYTES:
        probe = plane_compressor().compress(data[:PROBE_BYTES])
        if len(probe) > PLANE_KEEP_RATIO * PROBE_BYTES:
            return 0, data
    packed = plane_compressor().compress(data)
    if len(packed) >= len(data):
        return 0, data
    return 1, packed


class ShuffleZstdCodec(codecs.Codec):
    id = 2
    name = "shuffle-zstd"
    #: the fewest planes (element size) a payload may have
    min_planes = 2

    def encode(self, raw: memoryview, element_size: int) -> bytes:
        if element_size < self.min_planes or len(raw) % element_size:
            raise ValueError(f"{self.name} needs an element size of at least"
                             f" {self.min_planes} that divides the chunk")
        planes = split_planes(raw, element_size)
        header = bytearray([element_size])
        bodies: list[bytes | memoryview] = []
        for plane in planes:
            mode, body = _compress_plane(plane)
            header += _PLANE.pack(mode, len(body))
            bodies.append(body)
        return b"".join([bytes(header), *bodies])

    def decode(self, payload: memoryview, raw_length: int, element_size: int) -> memoryview:
        plane_table(payload, raw_length, element_size, self.min_planes)  # before allocating
        out = np.empty(raw_length, dtype=np.uint8)
        self.decode_into(payload, out.data, element_size)
        return out.data

    def decode_into(self, payload: memoryview, out: memoryview, element_size: int) -> None:
        # All planes are interleaved into the result in one pass.
        join(self.plane_bodies(payload, len(out), element_size), out)

    def plane_bodies(self, payload: memoryview, raw_length: int, element_size: int
                     ) -> list[bytes | memoryview]:
        """Each plane's bytes: a raw plane where it lies in the payload, a compressed
        one decompressed (every frame checked by the table first, and only there)."""
        table = plane_table(payload, raw_length, element_size, self.min_planes)
        plane_len = raw_length // element_size
        return [payload[start : start + length] if mode == 0
                else decompress(payload[start : start + length], plane_len, checked=True)
                for mode, start, length in table]


def planes_into(payload: memoryview, planes: np.ndarray, min_planes: int, *, xor: bool) -> None:
    """Decode a payload's planes into the rows of ``planes`` (element size x elements,
    contiguous), or XOR them in: decoding a chain of deltas in the plane domain
    needs no strided copy per link (XOR commutes with the shuffle)."""
    count, plane_len = planes.shape
    table = plane_table(payload, count * plane_len, count, min_planes)
    for i, (mode, start, length) in enumerate(table):
        body = payload[start : start + length]
        plane = np.frombuffer(body if mode == 0 else decompress(body, plane_len, checked=True),
                              dtype=np.uint8)
        if xor:
            np.bitwise_xor(planes[i], plane, out=planes[i])
        else:
            planes[i] = plane


def plane_table(payload: memoryview, raw_length: int, element_size: int, min_planes: int
                ) -> list[tuple[int, int, int]]:
    """(mode, offset, length) of each plane body, all checked against the payload's
    length before anything is decoded; ``ValueError`` on a malformed table."""
    count = payload[0] if len(payload) else 0
    if count != element_size or element_size < min_planes or raw_length % element_size:
        raise ValueError("shuffle payload's plane count does not match the element size")
    pos = 1 + _PLANE.size * count
    if pos > len(payload):
        raise ValueError("shuffle plane table is truncated")
    table = []
    for i in range(count):
        mode, length = _PLANE.unpack_from(payload, 1 + _PLANE.size * i)
        if mode not in (0, 1) or (mode == 0 and length != raw_length // element_size):
            raise ValueError(f"shuffle plane {i} is damaged (mode {mode}, {length} bytes)")
        if mode == 1:
            check_frame(payload[pos : pos + length], raw_length // element_size)
        table.append((mode, pos, length))
        pos += length
    if pos != len(payload):
        raise ValueError(f"shuffle bodies end at {pos}, the payload at {len(payload)}")
    return table


SHUFFLE_ZSTD = ShuffleZstdCodec()
