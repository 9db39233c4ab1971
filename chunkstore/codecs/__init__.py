"""Chunk codecs: small immutable classes registered by a one-byte id.

The chunk header names the codec, so decoding is data-driven; the policy
(:mod:`chunkstore.codecs.policy`) decides which codec encodes a chunk.
"""

from __future__ import annotations

import abc

import numpy as np

#: Copies at least this long go through numpy, which lets go of the GIL while it copies:
#: a memoryview slice assignment holds it, so read threads copying raw chunks took
#: turns (two threads copying 4 MiB each: 0.95x one thread's rate, through numpy 1.89x).
GIL_FREE_COPY_BYTES = 64 * 1024


def copy_bytes(out: memoryview, data: bytes | memoryview) -> None:
    """``out[:] = data`` for byte buffers of equal length (``ValueError`` otherwise),
    without holding the GIL through a long copy."""
    if out.nbytes < GIL_FREE_COPY_BYTES:
        out[:] = data
        return
    source = np.frombuffer(data, dtype=np.uint8)
    target = np.frombuffer(out, dtype=np.uint8)
    if source.size != target.size:  # copyto would broadcast a single byte
        raise ValueError(f"{source.size} bytes do not fill a buffer of {target.size}")
    np.copyto(target, source)


class Codec(abc.ABC):
    """Turns a chunk's raw bytes into a payload and back."""

    id: int
    name: str
    #: a delta codec: the payload decodes to an image of the chunk against a base chunk
    needs_base = False

    @abc.abstractmethod
    def encode(self, raw: memoryview, element_size: int) -> bytes | memoryview:
        """Return the payload for ``raw`` (which may be larger than ``raw``)."""

    @abc.abstractmethod
    def decode(self, payload: memoryview, raw_length: int, element_size: int) -> bytes | memoryview:
        """Return exactly ``raw_length`` bytes; raise ``ValueError`` on a malformed payload."""

    def decode_into(self, payload: memoryview, out: memoryview, element_size: int) -> None:
        """Decode into ``out`` (exactly the raw length); codecs override it to skip a copy."""
        copy_bytes(out, self.decode(payload, len(out), element_size))

    def image_of(self, raw: memoryview, base: bytes | memoryview, element_size: int
                 ) -> memoryview:
        """A delta codec's image of ``raw`` against ``base`` (equal lengths): what its
        payload encodes."""
        raise TypeError(f"{self.name} is not a delta codec")

    def apply_base(self, image: memoryview, base: bytes | memoryview, element_size: int
                   ) -> None:
        """Turn a decoded image into the chunk's bytes, in place, given its base's;
        ``ValueError`` when the element size does not suit the codec."""
        raise TypeError(f"{self.name} is not a delta codec")

    def decode_onto(self, payload: memoryview, base: bytes | memoryview, out: memoryview,
                    element_size: int) -> None:
        """A delta codec's chunk bytes into ``out`` (the raw length, overlapping neither
        input): :meth:`decode_into` then :meth:`apply_base`, which codecs may do in one
        pass; ``ValueError`` on a malformed payload."""
        self.decode_into(payload, out, element_size)
        self.apply_base(out, base, element_size)


_REGISTRY: dict[int, Codec] = {}
_BY_NAME: dict[str, Codec] = {}


def register(codec: Codec) -> Codec:
    if codec.id in _REGISTRY or codec.name in _BY_NAME:
        raise ValueError(f"codec id {codec.id} / name {codec.name!r} registered twice")
    _REGISTRY[codec.id] = codec
    _BY_NAME[codec.name] = codec
    return codec


def by_id(codec_id: int) -> Codec | None:
    """Return the codec with ``codec_id``, or None when this release does not know it."""
    return _REGISTRY.get(codec_id)


def by_name(name: str) -> Codec:
    return _BY_NAME[name]


def names() -> dict[int, str]:
    return {cid: c.name for cid, c in sorted(_REGISTRY.items())}


from chunkstore.codecs.pack import PACK  # noqa: E402
from chunkstore.codecs.raw import RAW  # noqa: E402
from chunkstore.codecs.shuffle import SHUFFLE_ZSTD  # noqa: E402
from chunkstore.codecs.sparsedelta import SPARSE_DELTA  # noqa: E402
from chunkstore.codecs.subdelta import SUB_DELTA  # noqa: E402
from chunkstore.codecs.xordelta import XOR_DELTA  # noqa: E402
from chunkstore.codecs.zstd import ZSTD  # noqa: E402

for _codec in (RAW, ZSTD, SHUFFLE_ZSTD, XOR_DELTA, PACK, SUB_DELTA, SPARSE_DELTA):
    register(_codec)

__all__ = ["PACK", "RAW", "SHUFFLE_ZSTD", "SPARSE_DELTA", "SUB_DELTA", "XOR_DELTA", "ZSTD",
           "Codec", "by_id", "by_name", "names", "register"]
