"""Manifest nodes that parse but do not describe a readable tensor are refused as corrupt."""

from __future__ import annotations

import json
from typing import Any

import pytest

from chunkstore import plaindata
from chunkstore.digest import Digest
from chunkstore.errors import CorruptNodeError
from chunkstore.manifest import NODE_FORMAT_VERSION, decode_data, decode_tree

CHUNK = Digest.of(b"x").hex


def _tree(tensor: dict[str, Any]) -> tuple[Digest, bytes]:
    body = {"format_version": NODE_FORMAT_VERSION, "kind": "tree",
            "entries": {"w": {"tensor": tensor}}}
    data = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return Digest.of(data), data


def _tensor(shape: list[int], chunks: int, chunk_bytes: int = 64, offsets: list[int] | None = None,
            sizes: list[int] | None = None) -> dict[str, Any]:
    return {"dtype": "float32", "shape": shape, "shards": [{
        "offsets": offsets if offsets is not None else [0] * len(shape),
        "sizes": sizes if sizes is not None else shape,
        "chunk_bytes": chunk_bytes, "chunks": [CHUNK] * chunks}]}


def test_a_well_formed_tensor_entry_decodes() -> None:
    node = decode_tree(*_tree(_tensor([40], chunks=3)))  # 160 bytes in 64-byte chunks
    assert len(node.leaves["w"].shards[0].chunks) == 3  # type: ignore[union-attr]


@pytest.mark.parametrize(("tensor", "words"), [
    (_tensor([40], chunks=2), "needs 3 chunk keys, has 2"),
    (_tensor([40], chunks=4), "needs 3 chunk keys, has 4"),
    (_tensor([40], chunks=3, chunk_bytes=0), "chunk_bytes must be an integer in"),
    (_tensor([40], chunks=3, chunk_bytes=66), "not a positive multiple"),
    (_tensor([40], chunks=1, offsets=[30], sizes=[20]), "outside shape"),
    (_tensor([4, 10], chunks=3, sizes=[40]), "rank"),
    (_tensor([-4], chunks=0), "shape must be an integer in"),
])
def test_a_tensor_whose_chunks_do_not_cover_it_is_corrupt(tensor: dict[str, Any],
                                                          words: str) -> None:
    with pytest.raises(CorruptNodeError, match=words):
        decode_tree(*_tree(tensor))


def test_a_dict_key_that_cannot_be_a_key_is_corrupt_data_not_a_crash() -> None:
    value = {"$dict": [[{"a": 1, "b": 2}, 1]]}
    body = {"format_version": NODE_FORMAT_VERSION, "kind": "data", "value": value}
    data = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    with pytest.raises(CorruptNodeError, match="malformed"):
        decode_data(Digest.of(data), data)
    assert plaindata.decode(plaindata.encode({(1, 2): 3})) == {(1, 2): 3}
