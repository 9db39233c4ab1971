"""Chunk objects: a fixed header plus the encoded payload (see docs/format.md).

Header, little-endian, 24 bytes (+32 when a base key is present)::

    0  4s  magic b"CSCK"
    4  u8  chunk format version (6; 1 to 5 are read too)
    5  u8  codec id
    6  u8  element size in bytes (used by shuffle codecs)
    7  u8  flags: bit 0 = a 32-byte base key follows the header (delta codecs)
    8  u64 raw length (bytes after decoding)
    16 u64 payload length (bytes after the header)

From version 2 the BASE flag is set exactly when the codec is a delta codec
(``xor-delta``; ``sub-delta`` from version 4, ``sparse-delta`` from 6): the
payload decodes to an image of the chunk against its base (their XOR, or their
difference, of every element or of the runs that changed), whose raw
bytes the caller supplies (:mod:`chunkstore.read.chain` reads chains).
Every decode re-hashes the result: a chunk whose bytes do not hash to its
key raises :class:`CorruptChunkError`, so nothing corrupt is returned.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from chunkstore import codecs
from chunkstore.errors import CorruptChunkError, FormatVersionError
from chunkstore.format.digest import DIGEST_SIZE, PLAIN_IDS, ChunkIds, Digest

MAGIC = b"CSCK"
CHUNK_FORMAT_VERSION = 6
#: Codec ids each chunk format version knows (version 1: no delta codec; version 3
#: adds packs; version 4 the sub-delta codec; version 5 no new codec: a pack member
#: of version 5 may be a delta; version 6 the sparse-delta codec).
_CODECS_OF_VERSION = {1: frozenset({0, 1, 2}), 2: frozenset({0, 1, 2, 3}),
                      3: frozenset({0, 1, 2, 3, 4}), 4: frozenset({0, 1, 2, 3, 4, 5}),
                      5: frozenset({0, 1, 2, 3, 4, 5}), 6: frozenset({0, 1, 2, 3, 4, 5, 6})}
#: The first chunk format version whose pack members may be deltas (docs/format.md §3.5).
DELTA_MEMBERS_SINCE = 5
HEADER = struct.Struct("<4sBBBBQQ")
FLAG_BASE = 0x01
#: The largest raw length a reader decodes: a store's chunks are never longer.
MAX_RAW_LENGTH = 256 * 1024 * 1024
#: Payloads that do not compress are stored raw, so a payload is hardly longer
#: than its raw bytes; this leaves room for a codec's framing.
MAX_PAYLOAD_OVERHEAD = 1024 * 1024


@dataclass(frozen=True)
class ChunkHeader:
    codec_id: int
    element_size: int
    raw_length: int
    payload_length: int
    base: Digest | None = None
    #: the chunk format version the header was read with (writers write the current one)
    version: int = CHUNK_FORMAT_VERSION

    @property
    def size(self) -> int:
        return HEADER.size + (DIGEST_SIZE if self.base else 0)

    def pack(self) -> bytes:
        flags = FLAG_BASE if self.base else 0
        head = HEADER.pack(
            MAGIC, CHUNK_FORMAT_VERSION, self.codec_id, self.element_size, flags,
            self.raw_length, self.payload_length,
        )
        return head + (self.base.raw if self.base else b"")


def parse_header(digest: Digest, data: bytes | memoryview) -> ChunkHeader:
    """Parse and check the header at the start of ``data`` (at least HEADER.size bytes)."""
    if len(data) < HEADER.size:
        raise CorruptChunkError(digest.hex, f"truncated header ({len(data)} bytes)")
    magic, version, codec_id, element_size, flags, raw_len, payload_len = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise CorruptChunkError(digest.hex, "bad magic (not a chunk object)")
    if version not in _CODECS_OF_VERSION:
        raise FormatVersionError(f"chunk {digest.short(16)}", version, CHUNK_FORMAT_VERSION)
    codec = codecs.by_id(codec_id)
    if codec is None or codec_id not in _CODECS_OF_VERSION[version]:
        raise CorruptChunkError(digest.hex, f"unknown codec id {codec_id} (newer chunkstore?)")
    if flags & ~FLAG_BASE:
        raise CorruptChunkError(digest.hex, f"unknown flag bits {flags & ~FLAG_BASE:#04x}")
    if version >= 2 and bool(flags & FLAG_BASE) != codec.needs_base:
        raise CorruptChunkError(digest.hex, f"codec {codec.name} with the BASE flag"
                                f" {'set' if flags & FLAG_BASE else 'clear'}")
    if raw_len > MAX_RAW_LENGTH or payload_len > MAX_RAW_LENGTH + MAX_PAYLOAD_OVERHEAD:
        raise CorruptChunkError(digest.hex, f"header claims {raw_len} raw / {payload_len} payload"
                                f" bytes; a chunk holds at most {MAX_RAW_LENGTH}")
    base = None
    if flags & FLAG_BASE:
        if len(data) < HEADER.size + DIGEST_SIZE:
            raise CorruptChunkError(digest.hex, "truncated base key")
        base = Digest(bytes(data[HEADER.size : HEADER.size + DIGEST_SIZE]))
    return ChunkHeader(codec_id, element_size, raw_len, payload_len, base, version)


def encode_object(header: ChunkHeader, payload: bytes | memoryview) -> bytes:
    return b"".join([header.pack(), payload])


def decode_object(digest: Digest, data: bytes | memoryview, out: memoryview | None = None,
                  base: bytes | memoryview | None = None, header: ChunkHeader | None = None,
                  ids: ChunkIds = PLAIN_IDS) -> bytes | memoryview:
    """Decode a whole chunk object and verify it hashes to ``digest``.

    With ``out`` (exactly the raw length) the bytes are decoded into it and
    ``out`` is returned; on an integrity error it holds garbage.  Every step
    is bounded by the header's raw length, which is checked before anything
    is allocated (against ``out`` when given).  A delta object needs its
    base's raw bytes in ``base`` (already verified by the caller).  ``header``:
    what :func:`parse_header` gave for ``data``, where the caller has it; ``ids``: how
    the store names chunks (keyed in an encrypted store).
    """
    view = memoryview(data)
    if header is None:
        header = parse_header(digest, view)
    codec = codecs.by_id(header.codec_id)
    assert codec is not None  # parse_header checked it
    if header.base is not None and codec.needs_base:
        if base is None or len(base) != header.raw_length:
            raise CorruptChunkError(digest.hex, f"delta against {header.base.short(16)}, whose"
                                    " bytes were not supplied or have another length")
        payload = _payload(digest, header, view, out)
        chunk = memoryview(bytearray(header.raw_length)) if out is None else out
        try:
            codec.decode_onto(payload, base, chunk, header.element_size)
        except (ValueError, struct.error) as exc:
            raise CorruptChunkError(digest.hex, f"{codec.name} payload does not decode:"
                                    f" {exc}") from exc
        check_digest(digest, chunk, ids)
        return chunk
    raw = decode_payload(digest, header, view, out)
    check_digest(digest, raw, ids)
    return raw


def decode_payload(digest: Digest, header: ChunkHeader, view: memoryview,
                   out: memoryview | None) -> bytes | memoryview:
    """Decode the payload as the header says, unchecked (a delta gives its image)."""
    payload = _payload(digest, header, view, out)
    codec = codecs.by_id(header.codec_id)
    assert codec is not None  # parse_header checked it
    try:
        if out is not None:
            codec.decode_into(payload, out, header.element_size)
            return out
        raw = codec.decode(payload, header.raw_length, header.element_size)
        if codec.needs_base and isinstance(raw, bytes):
            raw = memoryview(bytearray(raw))  # the base is applied in place by the caller
        return raw
    except (ValueError, struct.error) as exc:
        raise CorruptChunkError(digest.hex, f"{codec.name} payload does not decode: {exc}") from exc


def _payload(digest: Digest, header: ChunkHeader, view: memoryview, out: memoryview | None
             ) -> memoryview:
    """The payload, its length checked against the header and ``out``'s (when given)
    against the raw length."""
    payload = view[header.size :]
    if len(payload) != header.payload_length:
        raise CorruptChunkError(
            digest.hex, f"payload is {len(payload)} bytes, header says {header.payload_length}"
            " (truncated or padded)",
        )
    if out is not None and len(out) != header.raw_length:
        raise CorruptChunkError(digest.hex, f"holds {header.raw_length} bytes, the manifest"
                                f" expects {len(out)}")
    return payload


def check_digest(digest: Digest, raw: bytes | memoryview, ids: ChunkIds) -> None:
    if not ids.names(digest, raw):
        raise CorruptChunkError(digest.hex, f"content hashes to {ids.of(raw).short(16)}")
