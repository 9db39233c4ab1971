"""Codec 1: zstandard over the raw bytes."""

from __future__ import annotations

import threading

import zstandard

from chunkstore import codecs

LEVEL = 1
_local = threading.local()


def compressor() -> zstandard.ZstdCompressor:
    """A per-thread compressor: zstandard's objects are not thread-safe."""
    c = getattr(_local, "c", None)
    if c is None:
        c = _local.c = zstandard.ZstdCompressor(level=LEVEL, write_content_size=True)
    return c


def decompress(payload: memoryview | bytes, raw_length: int) -> bytes:
    d = getattr(_local, "d", None)
    if d is None:
        d = _local.d = zstandard.ZstdDecompressor()
    try:
        out = d.decompress(payload, max_output_size=raw_length)
    except zstandard.ZstdError as exc:
        raise ValueError(f"zstd payload does not decode: {exc}") from exc
    if len(out) != raw_length:
        raise ValueError(f"zstd payload gives {len(out)} bytes, header says {raw_length}")
    return out


class ZstdCodec(codecs.Codec):
    id = 1
    name = "zstd"

    def encode(self, raw: memoryview, element_size: int) -> bytes:
        return compressor().compress(raw)

    def decode(self, payload: memoryview, raw_length: int, element_size: int) -> bytes:
        return decompress(payload, raw_length)


ZSTD = ZstdCodec()
