"""Reading manifest trees from the store: load nodes (hash-checked) and flatten.

Every walk is iterative and bounded (distinct nodes, expanded size, name
length) before it expands anything, so a hostile tree cannot recurse or
allocate without limit.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from chunkstore.errors import CorruptNodeError
from chunkstore.format.digest import Digest
from chunkstore.format.manifest import (
    DataEntry,
    PackLocation,
    TensorEntry,
    TreeNode,
    decode_data,
    decode_tree,
)
from chunkstore.format.names import MAX_NAME_LENGTH
from chunkstore.objects.kinds import NODES
from chunkstore.objects.objectstore import ObjectStore

Leaf = TensorEntry | DataEntry
#: Nodes plus leaves of one version's expanded tree (a model has thousands).
MAX_ENTRIES = 1_000_000


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


def read_node(objects: ObjectStore, digest: Digest) -> bytes:
    try:
        return objects.get(NODES, digest)
    except FileNotFoundError:
        raise CorruptNodeError(digest.hex, "missing from the store") from None


def load_tree(objects: ObjectStore, digest: Digest, cache: NodeCache) -> TreeNode:
    node = cache.get(digest)
    if node is None:
        node = decode_tree(digest, read_node(objects, digest), objects.node_ids)
        cache.put(digest, node)
    return node


def load_data(objects: ObjectStore, digest: Digest) -> Any:
    """The plain data the data node ``digest`` holds (hash-checked, under the store's
    node ids)."""
    return decode_data(digest, read_node(objects, digest), objects.node_ids)


@dataclass
class FlatTree:
    """Every leaf of a version by full name, and every node it is built from."""

    leaves: dict[str, Leaf] = field(default_factory=dict)
    tree_nodes: set[Digest] = field(default_factory=set)
    #: the tree node that holds each leaf (to name it in an error)
    owners: dict[str, Digest] = field(default_factory=dict)
    #: the full name of every subtree (a name has one subtree)
    subtree_names: set[str] = field(default_factory=set)

    def chunk_digests(self) -> set[Digest]:
        return {d for leaf in self.leaves.values() if isinstance(leaf, TensorEntry)
                for d in leaf.chunk_digests()}

    def pack_members(self) -> dict[Digest, PackLocation]:
        """Where each standalone packed chunk of the version lies (the index's dedup
        cache: a packed delta is reused only with the chain a manifest lists)."""
        return {digest: location for leaf in self.leaves.values()
                if isinstance(leaf, TensorEntry) for shard in leaf.shards
                for i, digest in enumerate(shard.chunks)
                if (location := shard.location(i)) is not None and not shard.chain(i)}

    def data_nodes(self) -> set[Digest]:
        return {leaf.digest for leaf in self.leaves.values() if isinstance(leaf, DataEntry)}


def flatten(objects: ObjectStore, root: Digest, cache: NodeCache) -> FlatTree:
    """Walk the tree from ``root``; missing, corrupt or oversized trees raise typed errors.

    Subtrees are shared, so a few small nodes can describe a huge tree: every
    distinct node is loaded once, the size of the expanded tree is counted
    from them, and only a tree within ``MAX_ENTRIES`` is expanded.
    """
    nodes = _load_distinct(objects, root, cache)
    size = _expanded_size(root, nodes)
    if size > MAX_ENTRIES:
        raise CorruptNodeError(root.hex, f"the tree expands to {size} nodes and leaves; a"
                               f" version holds at most {MAX_ENTRIES}")
    flat = FlatTree(tree_nodes=set(nodes))
    stack: list[tuple[str, Digest]] = [("", root)]
    while stack:
        prefix, digest = stack.pop()
        node = nodes[digest]
        if len(prefix) > MAX_NAME_LENGTH:
            raise CorruptNodeError(digest.hex, f"names below {prefix[:40]!r}… are longer than"
                                   f" {MAX_NAME_LENGTH} characters")
        for name, leaf in node.leaves.items():
            full = prefix + name
            if len(full) > MAX_NAME_LENGTH or full in flat.leaves:
                raise CorruptNodeError(digest.hex, f"entry {full[:60]!r} is too long or"
                                       " appears twice")
            flat.leaves[full] = leaf
            flat.owners[full] = digest
        for name, child in node.subtrees.items():
            full = prefix + name
            if full in flat.subtree_names:
                raise CorruptNodeError(digest.hex, f"subtree {full[:60]!r} appears twice")
            flat.subtree_names.add(full)
            stack.append((f"{full}.", child))
        stack.extend((prefix, more) for more in node.more)
    flat.leaves = dict(sorted(flat.leaves.items()))
    return flat


def _load_distinct(objects: ObjectStore, root: Digest, cache: NodeCache) -> dict[Digest, TreeNode]:
    nodes: dict[Digest, TreeNode] = {}
    todo = [root]
    while todo:
        digest = todo.pop()
        if digest in nodes:
            continue
        if len(nodes) >= MAX_ENTRIES:
            raise CorruptNodeError(root.hex, f"the tree has more than {MAX_ENTRIES} nodes")
        nodes[digest] = node = load_tree(objects, digest, cache)
        todo.extend(d for d in node.children() if d not in nodes)
    return nodes


def _expanded_size(root: Digest, nodes: dict[Digest, TreeNode]) -> int:
    """Nodes plus leaves of the tree with every shared subtree repeated, counted
    bottom-up over the distinct nodes (iteratively: depth is untrusted)."""
    sizes: dict[Digest, int] = {}
    stack: list[tuple[Digest, bool]] = [(root, False)]
    while stack:
        digest, children_done = stack.pop()
        if digest in sizes:
            continue
        node = nodes[digest]
        if children_done:
            sizes[digest] = 1 + len(node.leaves) + sum(sizes.get(d, MAX_ENTRIES + 1)
                                                       for d in node.children())
        else:
            stack.append((digest, True))
            stack.extend((d, False) for d in node.children() if d not in sizes)
    return sizes[root]
