"""Manifest nodes: immutable, content-addressed JSON (see docs/format.md).

A version's root is a *tree* node.  Entry names are split on ``.``; each
name in a tree node (one component, or from node format 4 a dotted path of
several: a small subtree inlined into its parent) maps to an object with an
optional ``tree`` (digest of the subtree of longer names) and at most one
leaf: ``tensor`` (the tensor described inline: dtype, shape and shards of
chunk digests) or ``data`` (digest of a *data* node holding plain data).
Unchanged subtrees encode to the same bytes, hash the same and are shared
between versions.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from chunkstore.errors import CorruptNodeError, FormatVersionError, InvalidNameError
from chunkstore.format import plaindata
from chunkstore.format.digest import PLAIN_IDS, ChunkIds, Digest
from chunkstore.format.dtypes import element_size, numpy_dtype
from chunkstore.format.names import check_component, check_entry_name

NODE_FORMAT_VERSION = 6
#: Node format versions this release reads (1: no delta bases in shards; 2: no
#: pack locations; 3: one name component per tree entry, no inlined subtrees; 4: no
#: packed delta chunks, no packed bases; 5: plain data with sorted keys, so a dict
#: read back has its keys in sorted order).
NODE_FORMAT_VERSIONS = (1, 2, 3, 4, 5, 6)
#: The first node format whose tree entries may be dotted paths (inlined subtrees).
DOTTED_NAMES_SINCE = 4  # and continuation nodes (``more``)
#: The first node format whose packed chunks may be deltas and whose bases may be
#: packed (a shard's ``base_packs``).
PACKED_DELTAS_SINCE = 5
#: Bounds a reader checks before it allocates (docs/format.md §5-6).
MAX_RANK = 64  # numpy's limit
MAX_DIM = 2**62
MAX_BYTES = 2**62  # of one tensor (a numpy buffer is indexed by a signed 64-bit int)
MAX_SHARDS = 256
MAX_CHUNK_BYTES = 256 * 1024 * 1024  # the largest chunk size a store may have
#: The longest delta chain a shard may list for one chunk (a store's depth is at most this).
MAX_DELTA_DEPTH = 64
#: The longest member object a pack location may name: a chunk's header, base
#: key and payload (docs/format.md §3.1 bounds the payload).
MAX_MEMBER_BYTES = 56 + MAX_CHUNK_BYTES + 1024 * 1024
#: The largest pack content a location may point into.
MAX_PACK_BYTES = MAX_CHUNK_BYTES


@dataclass(frozen=True)
class PackLocation:
    """Where a packed chunk's object lies: ``length`` bytes at ``offset`` of the
    raw content of the pack object ``pack`` (docs/format.md §3.5)."""

    pack: Digest
    offset: int
    length: int

    def to_json(self) -> list[Any]:
        return [self.pack.hex, self.offset, self.length]


@dataclass(frozen=True)
class Shard:
    """A box of the global tensor (offsets + sizes per dimension) and its chunks.

    ``bases`` is empty when no chunk is a delta; otherwise one chain per chunk,
    nearest base first, listing every chunk object the chunk's object may need
    (empty for a standalone chunk).  GC and the index learn the base edges here,
    without reading chunk objects.  ``packs`` is empty when no chunk is packed;
    otherwise one entry per chunk: where its object lies inside a pack, or None
    for a chunk stored as an object of its own.  ``base_packs`` is empty when no
    listed base is packed; otherwise one tuple per chunk, parallel to its chain:
    where each base's object lies inside a pack, or None (an object of its own).
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    chunk_bytes: int
    chunks: tuple[Digest, ...]
    bases: tuple[tuple[Digest, ...], ...] = ()
    packs: tuple[PackLocation | None, ...] = ()
    base_packs: tuple[tuple[PackLocation | None, ...], ...] = ()

    def chain(self, i: int) -> tuple[Digest, ...]:
        """The listed bases of chunk ``i``, nearest first (empty: standalone)."""
        return self.bases[i] if self.bases else ()

    def chain_locations(self, i: int) -> tuple[PackLocation | None, ...]:
        """Where each listed base of chunk ``i`` lies inside a pack (None: an object of
        its own), in chain order; as long as :meth:`chain`."""
        if self.base_packs:
            return self.base_packs[i]
        return (None,) * len(self.chain(i))

    def location(self, i: int) -> PackLocation | None:
        """Where chunk ``i`` lies inside a pack; None when it is an object of its own."""
        return self.packs[i] if self.packs else None

    def objects(self) -> Iterator[Digest]:
        """Every chunk object a read of the shard needs: a packed chunk's pack (a
        member is not an object), every other chunk, and the bases of its chain (a
        packed base's pack)."""
        for i, digest in enumerate(self.chunks):
            location = self.location(i)
            yield digest if location is None else location.pack
            for base, at in zip(self.chain(i), self.chain_locations(i), strict=True):
                yield base if at is None else at.pack

    def members(self) -> Iterator[tuple[PackLocation, Digest]]:
        """(location, digest) of every packed chunk and packed base a read of the
        shard needs."""
        for i, digest in enumerate(self.chunks):
            location = self.location(i)
            if location is not None:
                yield location, digest
            for base, at in zip(self.chain(i), self.chain_locations(i), strict=True):
                if at is not None:
                    yield at, base

    def nbytes(self, itemsize: int) -> int:
        return math.prod(self.sizes) * itemsize

    def chunk_spans(self, itemsize: int) -> Iterator[tuple[Digest, int, int]]:
        """Yield (digest, start, length) of each chunk within the shard's bytes."""
        total = self.nbytes(itemsize)
        for i, digest in enumerate(self.chunks):
            start = i * self.chunk_bytes
            yield digest, start, min(self.chunk_bytes, total - start)

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "offsets": list(self.offsets), "sizes": list(self.sizes),
            "chunk_bytes": self.chunk_bytes, "chunks": [d.hex for d in self.chunks],
        }
        if any(self.bases):
            body["bases"] = [[d.hex for d in chain] for chain in self.bases]
        if any(any(chain) for chain in self.base_packs):
            body["base_packs"] = [[None if p is None else p.to_json() for p in chain]
                                  for chain in self.base_packs]
        if any(self.packs):
            body["packs"] = [None if p is None else p.to_json() for p in self.packs]
        return body


@dataclass(frozen=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    shards: tuple[Shard, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * element_size(self.dtype)

    def chunk_digests(self) -> Iterator[Digest]:
        """Every chunk object a read of the entry needs: its chunks (for a packed
        chunk, its pack) and their bases."""
        for shard in self.shards:
            yield from shard.objects()

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
    """Children by name; each may have a subtree and one leaf.  ``more`` lists tree
    nodes whose entries continue this node's, under the same names' prefix (a level
    too large for one node is split into several, node format 4)."""

    subtrees: dict[str, Digest] = field(default_factory=dict)
    leaves: dict[str, TensorEntry | DataEntry] = field(default_factory=dict)
    more: tuple[Digest, ...] = ()

    def children(self) -> list[Digest]:
        """The tree nodes this one needs: its subtrees and continuations."""
        return [*self.subtrees.values(), *self.more]


#: A str as canonical JSON writes it: ``json.dumps(s, ensure_ascii=False)`` without
#: making an encoder per call (a save quotes every entry's name and dtype).
quote: Callable[[str], str] = json.encoder.encode_basestring


def canonical_json(obj: object) -> str:
    """Canonical JSON text (docs/format.md §4)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False)


def encode_node(body: dict[str, Any], ids: ChunkIds = PLAIN_IDS) -> tuple[Digest, bytes]:
    """A node's id (under the store's node ids, ``ObjectStore.node_ids``) and bytes."""
    data = canonical_json({"format_version": NODE_FORMAT_VERSION, **body}).encode("utf-8")
    return ids.of(data), data


def leaf_text(leaf: TensorEntry | DataEntry) -> str:
    """The canonical JSON of a leaf's field in its tree entry (``tensor`` or ``data``)."""
    if isinstance(leaf, TensorEntry):
        return '"tensor":' + tensor_text(leaf)
    return '"data":' + canonical_json({"node": leaf.digest.hex, "nbytes": leaf.nbytes})


def _ints(values: tuple[int, ...]) -> str:
    return "[" + ",".join(map(str, values)) + "]"


def _hexes(digests: tuple[Digest, ...]) -> str:
    return "[" + ",".join(f'"{d.hex}"' for d in digests) + "]"


def _location_text(p: PackLocation | None) -> str:
    return "null" if p is None else f'["{p.pack.hex}",{p.offset},{p.length}]'


def tensor_text(entry: TensorEntry) -> str:
    """``canonical_json(entry.to_json())``, written out directly (a save encodes
    thousands of entries; the format tests check both agree byte for byte)."""
    shards = []
    for shard in entry.shards:
        fields = []
        if any(any(chain) for chain in shard.base_packs):
            fields.append('"base_packs":[' + ",".join(
                "[" + ",".join(_location_text(p) for p in chain) + "]"
                for chain in shard.base_packs) + "]")
        if any(shard.bases):
            fields.append('"bases":[' + ",".join(_hexes(c) for c in shard.bases) + "]")
        fields.append(f'"chunk_bytes":{shard.chunk_bytes}')
        fields.append('"chunks":' + _hexes(shard.chunks))
        fields.append('"offsets":' + _ints(shard.offsets))
        if any(shard.packs):
            fields.append('"packs":[' + ",".join(_location_text(p) for p in shard.packs) + "]")
        fields.append('"sizes":' + _ints(shard.sizes))
        shards.append("{" + ",".join(fields) + "}")
    return (f'{{"dtype":{quote(entry.dtype)},'
            f'"shape":{_ints(entry.shape)},"shards":[{",".join(shards)}]}}')


def entry_text(leaf: str | None, tree: Digest | None) -> str:
    """The canonical JSON of a tree entry from its leaf's text and subtree (keys sorted:
    ``data`` and ``tensor`` come before ``tree``)."""
    fields = [f for f in (leaf, None if tree is None else f'"tree":"{tree.hex}"') if f]
    return "{" + ",".join(fields) + "}"


def tree_bytes(entries: list[tuple[str, str]], more: tuple[Digest, ...] = (),
               ids: ChunkIds = PLAIN_IDS) -> tuple[Digest, bytes]:
    """A tree node from (name, entry text) pairs and continuation nodes: byte for
    byte what :func:`encode_node` writes for them, without re-encoding the entries."""
    body = ",".join(f"{quote(name)}:{text}"
                    for name, text in sorted(entries))
    tail = "" if not more else ',"more":[' + ",".join(f'"{d.hex}"' for d in more) + "]"
    text = (f'{{"entries":{{{body}}},"format_version":{NODE_FORMAT_VERSION},"kind":"tree"'
            f"{tail}}}")
    data = text.encode("utf-8")
    return ids.of(data), data


def encode_tree(node: TreeNode, ids: ChunkIds = PLAIN_IDS) -> tuple[Digest, bytes]:
    entries = []
    for name in set(node.subtrees) | set(node.leaves):
        leaf = node.leaves.get(name)
        entries.append((name, entry_text(None if leaf is None else leaf_text(leaf),
                                          node.subtrees.get(name))))
    return tree_bytes(entries, node.more, ids)


def encode_data(value: object, ids: ChunkIds = PLAIN_IDS) -> tuple[Digest, bytes, int]:
    """Encode plain data as a data node; returns (digest, node bytes, value bytes)."""
    payload = plaindata.encode(value)
    data = b"".join([
        b'{"format_version":%d,"kind":"data","value":' % NODE_FORMAT_VERSION, payload, b"}",
    ])
    return ids.of(data), data, len(payload)


def exact_int(value: object, what: str, low: int = 0, high: int = MAX_DIM) -> int:
    """``value`` if it is a JSON integer in [low, high]; ``ValueError`` otherwise
    (``true`` and ``1.0`` are not integers here, though Python compares them equal)."""
    if type(value) is not int or not low <= value <= high:
        raise ValueError(f"{what} must be an integer in [{low}, {high}], not {value!r}")
    return value


def is_version(value: object, supported: int) -> bool:
    """True when a JSON ``format_version`` is exactly the integer ``supported``."""
    return type(value) is int and value == supported


def _parse(digest: Digest, data: bytes, kind: str, ids: ChunkIds) -> dict[str, Any]:
    if not ids.names(digest, data):
        raise CorruptNodeError(digest.hex, "content does not match its hash")
    try:
        body = plaindata.load_json(data)
    except ValueError as exc:
        raise CorruptNodeError(digest.hex, f"not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise CorruptNodeError(digest.hex, "not a JSON object")
    version = body.get("format_version")
    if not any(is_version(version, v) for v in NODE_FORMAT_VERSIONS):
        raise FormatVersionError(f"manifest node {digest.short()}", body.get("format_version"),
                                 NODE_FORMAT_VERSION)
    if body.get("kind") != kind:
        raise CorruptNodeError(digest.hex, f"expected a {kind} node, found {body.get('kind')!r}")
    return body


def decode_data(digest: Digest, data: bytes, ids: ChunkIds = PLAIN_IDS) -> Any:
    """Decode a data node stored as ``digest`` under the store's node ids."""
    body = _parse(digest, data, "data", ids)
    if "value" not in body:
        raise CorruptNodeError(digest.hex, "data node without a value")
    try:
        return plaindata.from_tree(body["value"])
    except ValueError as exc:
        raise CorruptNodeError(digest.hex, f"malformed plain data: {exc}") from exc


def decode_tree(digest: Digest, data: bytes, ids: ChunkIds = PLAIN_IDS) -> TreeNode:
    """Decode a tree node stored as ``digest`` under the store's node ids, refusing
    anything a writer would not write (typed errors)."""
    body = _parse(digest, data, "tree", ids)
    entries = body.get("entries")
    if not isinstance(entries, dict):
        raise CorruptNodeError(digest.hex, "tree node without an entries object")
    node = TreeNode()
    check_name = check_entry_name if body["format_version"] >= DOTTED_NAMES_SINCE \
        else check_component
    if "more" in body:
        more = body["more"]
        if body["format_version"] < DOTTED_NAMES_SINCE or not isinstance(more, list) \
                or not more:
            raise CorruptNodeError(digest.hex, "more must be a non-empty list of tree node"
                                   " digests, and only in node format 4 or later")
        try:
            node.more = tuple(_digest(d, "continuation node") for d in more)
        except ValueError as exc:
            raise CorruptNodeError(digest.hex, str(exc)) from exc
    for name, entry in entries.items():
        try:
            check_name(name)
            _decode_entry(node, name, entry)
        except (InvalidNameError, ValueError) as exc:
            raise CorruptNodeError(digest.hex, f"entry {name!r}: {exc}") from exc
    if body["format_version"] < PACKED_DELTAS_SINCE:
        for name, leaf in node.leaves.items():
            if isinstance(leaf, TensorEntry) and any(
                    shard.base_packs or any(shard.location(i) is not None and shard.chain(i)
                                            for i in range(len(shard.chunks)))
                    for shard in leaf.shards):
                raise CorruptNodeError(digest.hex, f"entry {name!r}: a packed delta chunk or"
                                       " a packed base, which node format"
                                       f" {body['format_version']} does not have")
    return node


def _digest(value: object, what: str) -> Digest:
    if not isinstance(value, str):
        raise ValueError(f"{what} is not a digest: {value!r}")
    return Digest.parse(value)


def _decode_entry(node: TreeNode, name: str, entry: object) -> None:
    if not isinstance(entry, dict) or not entry.keys() & {"tree", "tensor", "data"}:
        raise ValueError("an entry is an object with a tree, a tensor or a data field")
    if "tensor" in entry and "data" in entry:
        raise ValueError("an entry has both a tensor and a data leaf")
    if "tree" in entry:
        node.subtrees[name] = _digest(entry["tree"], "tree")
    if "tensor" in entry:
        node.leaves[name] = _decoded.decode(entry["tensor"])
    elif "data" in entry:
        data = entry["data"]
        if not isinstance(data, dict):
            raise ValueError("data leaf is not an object")
        node.leaves[name] = DataEntry(_digest(data.get("node"), "data node"),
                                      exact_int(data.get("nbytes"), "nbytes", high=MAX_BYTES))


def _int_list(value: object, what: str) -> tuple[int, ...]:
    if type(value) is list and len(value) <= MAX_RANK and all(
            type(x) is int and 0 <= x <= MAX_DIM for x in value):
        return tuple(value)
    if not isinstance(value, list) or len(value) > MAX_RANK:
        raise ValueError(f"{what} must be a list of at most {MAX_RANK} integers")
    return tuple(exact_int(x, what) for x in value)


def _shard_from_json(obj: object, itemsize: int) -> Shard:
    if not isinstance(obj, dict) or not isinstance(obj.get("chunks"), list):
        raise ValueError("a shard is an object with a chunks list")
    chunk_bytes = exact_int(obj.get("chunk_bytes"), "chunk_bytes", 1, MAX_CHUNK_BYTES)
    if chunk_bytes % itemsize:
        raise ValueError(f"chunk_bytes {chunk_bytes} is not a positive multiple of the element"
                         f" size {itemsize}")
    chunks = tuple(_digest(c, "chunk") for c in obj["chunks"])
    bases = _bases(obj.get("bases", []), chunks)
    return Shard(_int_list(obj.get("offsets"), "offsets"), _int_list(obj.get("sizes"), "sizes"),
                 chunk_bytes, chunks, bases, _packs(obj.get("packs", []), chunks),
                 _base_packs(obj.get("base_packs", []), chunks, bases))


def _location(item: object, digest: Digest) -> PackLocation | None:
    """A pack location, [pack, offset, length], or None for null; never the chunk's
    own digest as its pack."""
    if item is None:
        return None
    if not isinstance(item, list) or len(item) != 3:
        raise ValueError("a pack location is [pack digest, offset, length]")
    location = PackLocation(_digest(item[0], "pack"),
                            exact_int(item[1], "pack offset", 0, MAX_PACK_BYTES),
                            exact_int(item[2], "member length", 24, MAX_MEMBER_BYTES))
    if location.offset + location.length > MAX_PACK_BYTES:
        raise ValueError(f"chunk {digest.short()} lies beyond the largest pack")
    if location.pack == digest:
        raise ValueError(f"packed chunk {digest.short()} is its own pack")
    return location


def _packs(value: object, chunks: tuple[Digest, ...]) -> tuple[PackLocation | None, ...]:
    """A shard's pack locations: absent, or one per chunk, null or [pack, offset,
    length]."""
    if value == []:
        return ()
    if not isinstance(value, list) or len(value) != len(chunks):
        raise ValueError("packs must be a list with one location (or null) per chunk")
    locations = tuple(_location(item, chunk) for chunk, item in zip(chunks, value, strict=True))
    return locations if any(locations) else ()


def _base_packs(value: object, chunks: tuple[Digest, ...],
                bases: tuple[tuple[Digest, ...], ...]
                ) -> tuple[tuple[PackLocation | None, ...], ...]:
    """A shard's base locations: absent, or one list per chunk as long as its chain,
    each entry null or the location of that base inside a pack."""
    if value == []:
        return ()
    if not isinstance(value, list) or len(value) != len(chunks) or not bases:
        raise ValueError("base_packs must be a list with one list per chunk, and only"
                         " beside bases")
    chains = []
    for chunk, chain, items in zip(chunks, bases, value, strict=True):
        if not isinstance(items, list) or len(items) != len(chain):
            raise ValueError(f"the base locations of chunk {chunk.short()} do not match its"
                             " delta chain")
        located = tuple(_location(item, base) for base, item in zip(chain, items, strict=True))
        if any(at is not None and at.pack == chunk for at in located):
            raise ValueError(f"chunk {chunk.short()} is the pack of its own base")
        chains.append(located)
    return tuple(chains) if any(any(chain) for chain in chains) else ()


def _bases(value: object, chunks: tuple[Digest, ...]) -> tuple[tuple[Digest, ...], ...]:
    """A shard's delta chains: absent, or one bounded list per chunk, no digest twice
    in a chain with its chunk (a chain cannot loop)."""
    if value == []:
        return ()
    if not isinstance(value, list) or len(value) != len(chunks):
        raise ValueError("bases must be a list with one chain per chunk")
    chains = []
    for chunk, chain in zip(chunks, value, strict=True):
        if not isinstance(chain, list) or len(chain) > MAX_DELTA_DEPTH:
            raise ValueError(f"a delta chain is a list of at most {MAX_DELTA_DEPTH} digests")
        digests = tuple(_digest(d, "base") for d in chain)
        if len({chunk, *digests}) != len(digests) + 1:
            raise ValueError(f"the delta chain of chunk {chunk.short()} repeats a digest")
        chains.append(digests)
    return tuple(chains) if any(chains) else ()


class _DecodedEntries:
    """Tensor entries decoded and checked before, by their text.  Each version's
    manifest lists its unchanged tensors again, as the versions before it did: a walk
    of many versions (GC's mark, verify, report) decodes each distinct entry once.
    Entries are immutable, and their text is all a decode depends on.  Bounded: it
    holds at most :attr:`MAX_CHARS` characters of text (emptied when full), and no
    text longer than :attr:`MAX_TEXT` (a tensor of thousands of chunks)."""

    MAX_CHARS = 16 << 20
    MAX_TEXT = 16 << 10

    def __init__(self) -> None:
        self._entries: dict[str, TensorEntry] = {}
        self._chars = 0
        self._lock = threading.Lock()

    def decode(self, obj: object) -> TensorEntry:
        """:func:`_tensor_from_json`, once per distinct entry text."""
        # The parsed JSON's repr: C-fast, and one text per value of JSON's types.
        text = repr(obj)
        entry = self._entries.get(text)
        if entry is None:
            entry = _tensor_from_json(obj)
            if len(text) <= self.MAX_TEXT:
                with self._lock:
                    if self._chars + len(text) > self.MAX_CHARS:
                        self._entries.clear()
                        self._chars = 0
                    self._entries[text] = entry
                    self._chars += len(text)
        return entry


_decoded = _DecodedEntries()


def _tensor_from_json(obj: object) -> TensorEntry:
    if not isinstance(obj, dict) or not isinstance(obj.get("dtype"), str):
        raise ValueError("a tensor is an object with a dtype name")
    itemsize = numpy_dtype(obj["dtype"]).itemsize  # unknown dtype -> typed error
    shards = obj.get("shards")
    if not isinstance(shards, list) or len(shards) > MAX_SHARDS:
        raise ValueError(f"shards must be a list of at most {MAX_SHARDS}")
    entry = TensorEntry(obj["dtype"], _int_list(obj.get("shape"), "shape"),
                        tuple(_shard_from_json(s, itemsize) for s in shards))
    _check_tensor(entry)
    return entry


def _check_tensor(entry: TensorEntry) -> None:
    """Refuse a tensor entry whose shards do not tile its shape or whose chunks do not
    cover exactly their bytes: reading it would leave part of the result unwritten."""
    itemsize = element_size(entry.dtype)
    # The non-zero extents too: numpy refuses to make an empty array of shape
    # [2**62, 2**62, 0] ("array is too big"), though it holds no byte.
    if math.prod(d for d in entry.shape if d) * itemsize > MAX_BYTES:
        raise ValueError(f"shape {list(entry.shape)} is too large ({MAX_BYTES} bytes at most)")
    if len(entry.shards) == 1:
        # What almost every entry is: one shard, the whole tensor, which tiles the shape by
        # itself and needs only its chunk count checked; anything else is checked in full.
        shard = entry.shards[0]
        if shard.sizes == entry.shape and not any(shard.offsets) \
                and len(shard.offsets) == len(entry.shape) \
                and len(shard.chunks) == -(-shard.nbytes(itemsize) // shard.chunk_bytes):
            return
    for shard in entry.shards:
        dims = len(entry.shape)
        if len(shard.offsets) != dims or len(shard.sizes) != dims:
            raise ValueError("shard offsets/sizes do not match the tensor's rank")
        for off, size, full in zip(shard.offsets, shard.sizes, entry.shape, strict=True):
            if off + size > full:
                raise ValueError(f"shard box {list(shard.offsets)}+{list(shard.sizes)} lies"
                                 f" outside shape {list(entry.shape)}")
        expected = -(-shard.nbytes(itemsize) // shard.chunk_bytes)
        if len(shard.chunks) != expected:
            raise ValueError(f"shard of {shard.nbytes(itemsize)} bytes in {shard.chunk_bytes}"
                             f"-byte chunks needs {expected} chunk keys, has {len(shard.chunks)}")
    _check_tiling(entry)


def _check_tiling(entry: TensorEntry) -> None:
    """The shards' boxes are disjoint and together cover the whole shape."""
    covered = sum(math.prod(s.sizes) for s in entry.shards)
    if covered != math.prod(entry.shape):
        raise ValueError(f"shards cover {covered} of the {math.prod(entry.shape)} elements of"
                         f" shape {list(entry.shape)}")
    boxes = [s for s in entry.shards if math.prod(s.sizes)]
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            if all(oa < ob + sb and ob < oa + sa for oa, sa, ob, sb
                   in zip(a.offsets, a.sizes, b.offsets, b.sizes, strict=True)):
                raise ValueError("two shards overlap")


def shard_from_json(obj: object, dtype: str) -> Shard:
    """A shard as a manifest holds it (§6.2), for a tensor of ``dtype``; ``ValueError``
    (or UnsupportedDtypeError) on anything a writer would not write."""
    return _shard_from_json(obj, numpy_dtype(dtype).itemsize)


def tensor_entry(dtype: str, shape: tuple[int, ...], shards: tuple[Shard, ...]) -> TensorEntry:
    """A tensor entry from its parts, checked as a reader checks one (shards tile the
    shape, chunks cover each shard's bytes); ``ValueError`` otherwise."""
    if not shards or len(shards) > MAX_SHARDS:
        raise ValueError(f"a tensor has 1 to {MAX_SHARDS} shards, not {len(shards)}")
    entry = TensorEntry(dtype, tuple(shape), tuple(shards))
    numpy_dtype(dtype)
    _check_tensor(entry)
    return entry
