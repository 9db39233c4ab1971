"""Manifest nodes: immutable, content-addressed JSON (see docs/format.md).

A version's root is a *tree* node.  Entry names are split on ``.``; each
component maps to an object with an optional ``tree`` (digest of the subtree
of longer names) and at most one leaf: ``tensor`` (the tensor described
inline: dtype, shape and shards of chunk digests) or ``data`` (digest of a
*data* node holding plain data).  Unchanged subtrees encode to the same
bytes, hash the same and are shared between versions.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from chunkstore import plaindata
from chunkstore.digest import Digest
from chunkstore.dtypes import element_size, numpy_dtype
from chunkstore.errors import CorruptNodeError, FormatVersionError

NODE_FORMAT_VERSION = 1


@dataclass(frozen=True)
class Shard:
    """A box of the global tensor (offsets + sizes per dimension) and its chunks."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    chunk_bytes: int
    chunks: tuple[Digest, ...]

    def nbytes(self, itemsize: int) -> int:
        return math.prod(self.sizes) * itemsize

    def chunk_spans(self, itemsize: int) -> Iterator[tuple[Digest, int, int]]:
        """Yield (digest, start, length) of each chunk within the shard's bytes."""
        total = self.nbytes(itemsize)
        for i, digest in enumerate(self.chunks):
            start = i * self.chunk_bytes
            yield digest, start, min(self.chunk_bytes, total - start)

    def to_json(self) -> dict[str, Any]:
        return {
            "offsets": list(self.offsets), "sizes": list(self.sizes),
            "chunk_bytes": self.chunk_bytes, "chunks": [d.hex for d in self.chunks],
        }


@dataclass(frozen=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    shards: tuple[Shard, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * element_size(self.dtype)

    def chunk_digests(self) -> Iterator[Digest]:
        for shard in self.shards:
            yield from shard.chunks

    def to_json(self) -> dict[str, Any]:
        return {
            "dtype": self.dtype, "shape": list(self.shape),
            "shards": [s.to_json() for s in self.shards],
        }


@dataclass(frozen=True)
class DataEntry:
    digest: Digest
    nbytes: int


@dataclass
class TreeNode:
    """Children by name component; each may have a subtree and one leaf."""

    subtrees: dict[str, Digest] = field(default_factory=dict)
    leaves: dict[str, TensorEntry | DataEntry] = field(default_factory=dict)


def encode_node(body: dict[str, Any]) -> tuple[Digest, bytes]:
    data = json.dumps(
        {"format_version": NODE_FORMAT_VERSION, **body},
        sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False,
    ).encode("utf-8")
    return Digest.of(data), data


def encode_tree(node: TreeNode) -> tuple[Digest, bytes]:
    entries: dict[str, dict[str, Any]] = {}
    for name in sorted(set(node.subtrees) | set(node.leaves)):
        entry: dict[str, Any] = {}
        if name in node.subtrees:
            entry["tree"] = node.subtrees[name].hex
        leaf = node.leaves.get(name)
        if isinstance(leaf, TensorEntry):
            entry["tensor"] = leaf.to_json()
        elif isinstance(leaf, DataEntry):
            entry["data"] = {"node": leaf.digest.hex, "nbytes": leaf.nbytes}
        entries[name] = entry
    return encode_node({"kind": "tree", "entries": entries})


def encode_data(value: object) -> tuple[Digest, bytes, int]:
    """Encode plain data as a data node; returns (digest, node bytes, value bytes)."""
    payload = plaindata.encode(value)
    data = b"".join([
        b'{"format_version":%d,"kind":"data","value":' % NODE_FORMAT_VERSION, payload, b"}",
    ])
    return Digest.of(data), data, len(payload)


def _parse(digest: Digest, data: bytes, kind: str) -> dict[str, Any]:
    if Digest.of(data) != digest:
        raise CorruptNodeError(digest.hex, "content does not match its hash")
    try:
        body = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CorruptNodeError(digest.hex, f"not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise CorruptNodeError(digest.hex, "not a JSON object")
    if body.get("format_version") != NODE_FORMAT_VERSION:
        raise FormatVersionError(f"manifest node {digest.short()}", body.get("format_version"),
                                 NODE_FORMAT_VERSION)
    if body.get("kind") != kind:
        raise CorruptNodeError(digest.hex, f"expected a {kind} node, found {body.get('kind')!r}")
    return body


def decode_data(digest: Digest, data: bytes) -> Any:
    body = _parse(digest, data, "data")
    try:
        return plaindata.from_tree(body["value"])
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptNodeError(digest.hex, f"malformed plain data: {exc}") from exc


def decode_tree(digest: Digest, data: bytes) -> TreeNode:
    body = _parse(digest, data, "tree")
    node = TreeNode()
    try:
        for name, entry in body["entries"].items():
            if "tree" in entry:
                node.subtrees[name] = Digest.parse(entry["tree"])
            if "tensor" in entry:
                node.leaves[name] = _tensor_from_json(entry["tensor"])
            elif "data" in entry:
                node.leaves[name] = DataEntry(Digest.parse(entry["data"]["node"]),
                                              int(entry["data"]["nbytes"]))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CorruptNodeError(digest.hex, f"malformed tree entry: {exc!r}") from exc
    return node


def _tensor_from_json(obj: dict[str, Any]) -> TensorEntry:
    numpy_dtype(obj["dtype"])  # unknown dtype -> typed error
    shards = tuple(
        Shard(tuple(int(x) for x in s["offsets"]), tuple(int(x) for x in s["sizes"]),
              int(s["chunk_bytes"]), tuple(Digest.parse(c) for c in s["chunks"]))
        for s in obj["shards"]
    )
    entry = TensorEntry(obj["dtype"], tuple(int(x) for x in obj["shape"]), shards)
    _check_tensor(entry)
    return entry


def _check_tensor(entry: TensorEntry) -> None:
    """Refuse a tensor entry whose shards do not fit its shape or whose chunks do not
    cover exactly its bytes: reading it would leave part of the result unwritten."""
    itemsize = element_size(entry.dtype)
    if any(n < 0 for n in entry.shape):
        raise ValueError(f"negative dimension in shape {list(entry.shape)}")
    for shard in entry.shards:
        dims = len(entry.shape)
        if len(shard.offsets) != dims or len(shard.sizes) != dims:
            raise ValueError("shard offsets/sizes do not match the tensor's rank")
        for off, size, full in zip(shard.offsets, shard.sizes, entry.shape, strict=True):
            if off < 0 or size < 0 or off + size > full:
                raise ValueError(f"shard box {list(shard.offsets)}+{list(shard.sizes)} lies"
                                 f" outside shape {list(entry.shape)}")
        if shard.chunk_bytes <= 0 or shard.chunk_bytes % itemsize:
            raise ValueError(f"chunk_bytes {shard.chunk_bytes} is not a positive multiple of"
                             f" the element size {itemsize}")
        expected = -(-shard.nbytes(itemsize) // shard.chunk_bytes)
        if len(shard.chunks) != expected:
            raise ValueError(f"shard of {shard.nbytes(itemsize)} bytes in {shard.chunk_bytes}"
                             f"-byte chunks needs {expected} chunk keys, has {len(shard.chunks)}")
