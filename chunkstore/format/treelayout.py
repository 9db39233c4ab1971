"""How a version's entries are laid out in tree nodes (docs/format.md §5.1).

With a target size N (a store handle's ``node_size``):

- a subtree of the names whose entries, inlined, come to at most N bytes is
  inlined into its parent (its names become dotted paths there);
- a larger subtree is a node of its own;
- a node whose entries come to more than N bytes is split, in name order, into
  continuation nodes listed in ``more`` by a node that holds no entries.  A run
  ends after an entry whose name hashes to a cut point once it holds N/2
  bytes, and in any case before it would pass N (a single larger entry is a
  run of its own): cut points depend on names only, so a change to one entry,
  or one entry added or removed, rewrites about one run, not every run after
  it.

Sizes are UTF-8 bytes of the entries' JSON; the node listing continuations
and a level's own subtree references are not bounded by N.  So a save writes
about (manifest bytes / (N/2)) + depth tree nodes, whatever the number of
tensors.  The layout depends only on the entries, so an unchanged subtree or
run encodes to the same node and is shared between versions.  N = 0: one node
per branch of the names, nothing inlined or split (the layout of node formats
1 to 3, written as format 4).
"""

from __future__ import annotations

from typing import Any

import blake3

from chunkstore.format.digest import PLAIN_IDS, ChunkIds, Digest
from chunkstore.format.manifest import (
    DataEntry,
    TensorEntry,
    entry_text,
    leaf_text,
    quote,
    tree_bytes,
)

#: (name relative to the node, entry's canonical JSON, UTF-8 bytes of ``"name":entry,``):
#: the size is counted once per entry and grows by the prefix when a subtree is inlined.
Entries = list[tuple[str, str, int]]


def build_tree(leaves: dict[str, TensorEntry | DataEntry], limit: int,
               ids: ChunkIds = PLAIN_IDS) -> tuple[Digest, dict[Digest, bytes]]:
    """The root digest and every tree node's bytes for ``leaves`` (full names), the
    nodes named by ``ids`` (the store's node ids)."""
    nested: dict[str, Any] = {}
    for name, leaf in leaves.items():
        *parents, last = name.split(".")
        level = nested
        for part in parents:
            level = level.setdefault(part, {}).setdefault("", {})
        level.setdefault(last, {})[None] = leaf
    nodes: dict[Digest, bytes] = {}
    root = _store(_entries_of(nested, limit, nodes, ids), limit, nodes, ids)
    return root, nodes


#: A run may end after an entry whose name's BLAKE3 is 0 modulo this (one in 16 names).
CUT_MODULUS = 16


def _entry(name: str, text: str) -> tuple[str, str, int]:
    """An entry with its size: UTF-8 bytes of ``"name":text,`` in the node."""
    return name, text, len(quote(name).encode()) + len(text.encode()) + 2


def _is_cut(name: str) -> bool:
    return blake3.blake3(name.encode()).digest(length=2)[0] % CUT_MODULUS == 0


def _entries_of(level: dict[str, Any], limit: int, nodes: dict[Digest, bytes],
                ids: ChunkIds) -> Entries:
    """The entries of one level of the names, small subtrees inlined."""
    entries: Entries = []
    for part in sorted(level):
        slot = level[part]
        tree = None
        if "" in slot:
            inner = _entries_of(slot[""], limit, nodes, ids)
            prefix = len(part.encode()) + 1  # "part." before each inlined name
            if sum(cost + prefix for _, _, cost in inner) <= limit:
                entries.extend((f"{part}.{n}", t, cost + prefix) for n, t, cost in inner)
            else:
                tree = _store(inner, limit, nodes, ids)
        leaf = slot.get(None)
        if leaf is not None or tree is not None:
            entries.append(_entry(part, entry_text(None if leaf is None else leaf_text(leaf),
                                                   tree)))
    return entries


def _store(entries: Entries, limit: int, nodes: dict[Digest, bytes], ids: ChunkIds) -> Digest:
    """One node for ``entries``, or a node listing continuations (see above)."""
    if not limit or len(entries) < 2 or sum(cost for _, _, cost in entries) <= limit:
        digest, data = tree_bytes([(n, t) for n, t, _ in entries], ids=ids)
        nodes[digest] = data
        return digest
    runs: list[list[tuple[str, str]]] = [[]]
    used = 0
    for name, text, cost in sorted(entries):
        if runs[-1] and used + cost > limit:
            runs.append([])
            used = 0
        runs[-1].append((name, text))
        used += cost
        if used >= limit // 2 and _is_cut(name):
            runs.append([])
            used = 0
    if not runs[-1]:
        runs.pop()
    more = []
    for run in runs:
        digest, data = tree_bytes(run, ids=ids)
        nodes[digest] = data
        more.append(digest)
    digest, data = tree_bytes([], tuple(more), ids)
    nodes[digest] = data
    return digest
