"""How a version's entries are laid out in tree nodes (docs/format.md §5.1).

With a target size N (a store handle's ``node_size``):

- a subtree of the names whose entries, inlined, come to at most N bytes is
  inlined into its parent (its names become dotted paths there);
- a larger subtree is a node of its own;
- a node whose entries come to more than N bytes is split, in name order, into
  continuation nodes of at most N bytes each (one entry more when a single
  entry is larger), listed in ``more`` by a node that holds no entries.

So a save writes about (manifest bytes / N) + depth tree nodes, whatever the
number of tensors, and a change rewrites one run of entries and the nodes
above it.  The layout depends only on the entries, so an unchanged subtree or
run encodes to the same node and is shared between versions.  N = 0: one node
per branch of the names, nothing inlined or split (node formats 1 to 3).
"""

from __future__ import annotations

from typing import Any

from chunkstore.digest import Digest
from chunkstore.manifest import DataEntry, TensorEntry, entry_text, leaf_text, tree_bytes

Entries = list[tuple[str, str]]  # (name relative to the node, entry's canonical JSON)


def build_tree(leaves: dict[str, TensorEntry | DataEntry], limit: int
               ) -> tuple[Digest, dict[Digest, bytes]]:
    """The root digest and every tree node's bytes for ``leaves`` (full names)."""
    nested: dict[str, Any] = {}
    for name, leaf in leaves.items():
        *parents, last = name.split(".")
        level = nested
        for part in parents:
            level = level.setdefault(part, {}).setdefault("", {})
        level.setdefault(last, {})[None] = leaf
    nodes: dict[Digest, bytes] = {}
    root = _store(_entries_of(nested, limit, nodes), limit, nodes)
    return root, nodes


def _cost(name: str, text: str) -> int:
    return len(name) + len(text) + 4  # "name":text,


def _entries_of(level: dict[str, Any], limit: int, nodes: dict[Digest, bytes]) -> Entries:
    """The entries of one level of the names, small subtrees inlined."""
    entries: Entries = []
    for part in sorted(level):
        slot = level[part]
        tree = None
        if "" in slot:
            inner = _entries_of(slot[""], limit, nodes)
            if sum(_cost(n, t) for n, t in inner) + len(inner) * len(part) <= limit:
                entries.extend((f"{part}.{n}", t) for n, t in inner)
            else:
                tree = _store(inner, limit, nodes)
        leaf = slot.get(None)
        if leaf is not None or tree is not None:
            entries.append((part, entry_text(None if leaf is None else leaf_text(leaf), tree)))
    return entries


def _store(entries: Entries, limit: int, nodes: dict[Digest, bytes]) -> Digest:
    """One node for ``entries``, or a node listing continuations of at most ``limit``."""
    if not limit or len(entries) < 2 or sum(_cost(n, t) for n, t in entries) <= limit:
        digest, data = tree_bytes(entries)
        nodes[digest] = data
        return digest
    runs: list[Entries] = [[]]
    used = 0
    for name, text in sorted(entries):
        if runs[-1] and used + _cost(name, text) > limit:
            runs.append([])
            used = 0
        runs[-1].append((name, text))
        used += _cost(name, text)
    more = []
    for run in runs:
        digest, data = tree_bytes(run)
        nodes[digest] = data
        more.append(digest)
    digest, data = tree_bytes([], tuple(more))
    nodes[digest] = data
    return digest
