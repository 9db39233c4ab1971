"""Codec 1: zstandard over the raw bytes.

A payload is exactly one Zstandard frame (RFC 8878).  Before anything is
decompressed its header and block headers are walked (cheap: one 3-byte
header per block of at most 128 KiB) to refuse bytes after the frame, and a
content size that is absent or other than the chunk's raw length; so
decompression is bounded by the raw length, so a hostile frame cannot make a reader allocate
more than the header promised.
"""

from __future__ import annotations

import threading

import zstandard

from chunkstore import codecs

#: Whole chunks (codec 1: integers, bools, bytes) are compressed at level 1: their
#: repeats are real (counters, ids, masks) and worth zstd's match finder.
LEVEL = 1
#: Byte planes of float tensors and of deltas (codecs 2, 3, 5) use zstd's ``fast`` strategy with a
#: 128 KiB window, a 64-entry hash table and 7-byte matches, chosen by measurement
#: (``python -m benchmarks.bench_codec``, ``benchmarks/results/codec.json``): such
#: planes are low-entropy noise with few real repeats, and level 1's larger table
#: spends its time on short matches that pay less than entropy coding the literals.
#: On the exponent planes of float32 and bfloat16 weights and Adam moments this
#: compresses 2.5-2.8x faster than level 1, to 8-10% fewer bytes, and decodes
#: 1.3-1.7x faster; on XOR planes it is level 1's equal (sparse ones encode 1.5x
#: faster and decode 0.7x as fast, at several GB/s).  Any zstd decoder reads either.
PLANE_PARAMETERS = zstandard.ZstdCompressionParameters(
    window_log=17, hash_log=6, chain_log=6, search_log=1, min_match=7, target_length=0,
    strategy=1, write_content_size=True)
_local = threading.local()
_MAGIC = b"\x28\xb5\x2f\xfd"
_BLOCK_HEADER = 3
_CHECKSUM = 4
_BLOCK_RLE = 1
_BLOCK_RESERVED = 3
_MAX_BLOCK = 128 * 1024  # no block decodes to more (RFC 8878 Block_Maximum_Size)


def compressor() -> zstandard.ZstdCompressor:
    """A per-thread compressor for whole chunks: zstandard's objects are not thread-safe."""
    c = getattr(_local, "c", None)
    if c is None:
        c = _local.c = zstandard.ZstdCompressor(level=LEVEL, write_content_size=True)
    return c


def plane_compressor() -> zstandard.ZstdCompressor:
    """A per-thread compressor for the byte planes of float tensors."""
    c = getattr(_local, "p", None)
    if c is None:
        c = _local.p = zstandard.ZstdCompressor(compression_params=PLANE_PARAMETERS)
    return c


def _walk_frame(payload: memoryview | bytes) -> tuple[int, int]:
    """(length, block count) of the Zstandard frame at the start of ``payload``;
    ``ValueError`` when it is not one frame or is truncated."""
    if bytes(payload[:4]) != _MAGIC:
        raise ValueError("not a zstd frame (bad magic)")
    try:
        pos = zstandard.frame_header_size(payload)
    except zstandard.ZstdError as exc:
        raise ValueError(f"bad zstd frame header: {exc}") from exc
    has_checksum = payload[4] & 0x04
    blocks = 0
    while True:
        if pos + _BLOCK_HEADER > len(payload):
            raise ValueError("zstd frame is truncated")
        header = int.from_bytes(payload[pos : pos + _BLOCK_HEADER], "little")
        last, kind, size = header & 1, (header >> 1) & 3, header >> 3
        if kind == _BLOCK_RESERVED:
            raise ValueError("zstd block of the reserved type")
        pos += _BLOCK_HEADER + (1 if kind == _BLOCK_RLE else size)
        blocks += 1
        if last:
            return pos + (_CHECKSUM if has_checksum else 0), blocks


def check_frame(payload: memoryview | bytes, raw_length: int) -> None:
    """Refuse, before anything is decompressed, a payload that is not exactly one
    frame declaring ``raw_length`` bytes that its blocks can hold."""
    end, blocks = _walk_frame(payload)
    if end != len(payload):
        raise ValueError(f"{len(payload) - end} bytes after the zstd frame"
                         if end < len(payload) else "zstd frame is truncated")
    try:
        declared = zstandard.frame_content_size(payload)
    except zstandard.ZstdError as exc:
        raise ValueError(f"bad zstd frame header: {exc}") from exc
    if declared != raw_length:  # -1: the frame does not say (writers always say)
        raise ValueError(f"zstd frame declares {declared} bytes, header says {raw_length}")
    if raw_length > blocks * _MAX_BLOCK:
        raise ValueError(f"{blocks} zstd blocks cannot hold {raw_length} bytes")


def decompress(payload: memoryview | bytes, raw_length: int, *, checked: bool = False
               ) -> bytes:
    """Decode one frame to exactly ``raw_length`` bytes; ``ValueError`` otherwise.
    ``checked``: the caller passed this payload and length to :func:`check_frame`
    already (a shuffle payload's plane table checks every frame before anything is
    decoded), so the frame is not walked twice."""
    if not checked:
        check_frame(payload, raw_length)
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


def decompress_prefix(payload: memoryview | bytes, length: int) -> bytes:
    """The first ``length`` bytes the frame decodes to (at most one block more is
    decoded); ``ValueError`` when the frame does not hold that many."""
    d = getattr(_local, "d", None)
    if d is None:
        d = _local.d = zstandard.ZstdDecompressor()
    try:
        with d.stream_reader(payload, read_across_frames=False) as reader:
            out = reader.read(length)
            while len(out) < length and (more := reader.read(length - len(out))):
                out += more
    except zstandard.ZstdError as exc:
        raise ValueError(f"zstd payload does not decode: {exc}") from exc
    if len(out) != length:
        raise ValueError(f"zstd payload gives {len(out)} bytes, at least {length} expected")
    return out


class ZstdCodec(codecs.Codec):
    id = 1
    name = "zstd"

    def encode(self, raw: memoryview, element_size: int) -> bytes:
        return compressor().compress(raw)

    def decode(self, payload: memoryview, raw_length: int, element_size: int) -> bytes:
        return decompress(payload, raw_length)


ZSTD = ZstdCodec()
