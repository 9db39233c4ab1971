"""Codec 0: the payload is the raw bytes."""

from __future__ import annotations

from chunkstore import codecs


class RawCodec(codecs.Codec):
    id = 0
    name = "raw"

    def encode(self, raw: memoryview, element_size: int) -> memoryview:
        return raw

    def decode(self, payload: memoryview, raw_length: int, element_size: int) -> memoryview:
        if len(payload) != raw_length:
            raise ValueError(f"{self.name} payload is {len(payload)} bytes, header says"
                             f" {raw_length}")
        return payload


RAW = RawCodec()
