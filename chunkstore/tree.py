"""Reading manifest trees from a backend: load nodes (hash-checked) and flatten."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from chunkstore.backends import Backend
from chunkstore.digest import Digest, node_key
from chunkstore.errors import CorruptNodeError
from chunkstore.manifest import DataEntry, TensorEntry, TreeNode, decode_tree

Leaf = TensorEntry | DataEntry


class NodeCache:
    """A small LRU of decoded tree nodes; safe because nodes are immutable and hash-checked."""

    def __init__(self, capacity: int = 4096) -> None:
        self._items: OrderedDict[Digest, TreeNode] = OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()

    def get(self, digest: Digest) -> TreeNode | None:
        with self._lock:
            node = self._items.get(digest)
            if node is not None:
                self._items.move_to_end(digest)
            return node

    def put(self, digest: Digest, node: TreeNode) -> None:
        with self._lock:
            self._items[digest] = node
            if len(self._items) > self._capacity:
                self._items.popitem(last=False)


def read_node(backend: Backend, digest: Digest) -> bytes:
    try:
        return backend.get(node_key(digest))
    except FileNotFoundError:
        raise CorruptNodeError(digest.hex, "missing from the store") from None


def load_tree(backend: Backend, digest: Digest, cache: NodeCache) -> TreeNode:
    node = cache.get(digest)
    if node is None:
        node = decode_tree(digest, read_node(backend, digest))
        cache.put(digest, node)
    return node


@dataclass
class FlatTree:
    """Every leaf of a version by full name, and every node it is built from."""

    leaves: dict[str, Leaf] = field(default_factory=dict)
    tree_nodes: set[Digest] = field(default_factory=set)

    def chunk_digests(self) -> set[Digest]:
        return {d for leaf in self.leaves.values() if isinstance(leaf, TensorEntry)
                for d in leaf.chunk_digests()}

    def data_nodes(self) -> set[Digest]:
        return {leaf.digest for leaf in self.leaves.values() if isinstance(leaf, DataEntry)}


def flatten(backend: Backend, root: Digest, cache: NodeCache) -> FlatTree:
    """Walk the tree from ``root``; missing or corrupt nodes raise typed errors."""
    flat = FlatTree()
    stack: list[tuple[str, Digest]] = [("", root)]
    while stack:
        prefix, digest = stack.pop()
        flat.tree_nodes.add(digest)
        node = load_tree(backend, digest, cache)
        for name, leaf in node.leaves.items():
            flat.leaves[prefix + name] = leaf
        for name, child in node.subtrees.items():
            stack.append((f"{prefix}{name}.", child))
    flat.leaves = dict(sorted(flat.leaves.items()))
    return flat
