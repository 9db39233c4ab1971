"""What one version adds to ``report``'s census (:mod:`chunkstore.maintenance.census`),
as the index's ``census`` table records it: computed from the version's leaves, by
the save that wrote them (:mod:`chunkstore.write.writer`), by a copy into another
store, or by the open that counted the version in (:mod:`chunkstore.maintenance.reconcile`),
so that a ``report`` reads no manifest of a version recorded with it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from chunkstore.format.dtypes import element_size
from chunkstore.format.manifest import DataEntry, TensorEntry
from chunkstore.format.shards import RANKS_ENTRY

#: The form of a recorded contribution (:func:`contribution`); one of another form is
#: counted again from the manifests.
CENSUS_FORM = 1


def contribution(leaves: Mapping[str, TensorEntry | DataEntry]) -> bytes:
    """What one version (its leaves by full name) adds to the census (JSON): its
    chunks' deepest chains, its packed chunks, and whether it records its shards'
    ranks."""
    depths: dict[str, int] = {}
    members: list[list[Any]] = []
    for leaf in leaves.values():
        if not isinstance(leaf, TensorEntry):
            continue
        for shard in leaf.shards:
            for digest, chain in zip(shard.chunks, shard.bases, strict=False):
                if chain:
                    depths[digest.hex] = max(depths.get(digest.hex, 0), len(chain))
            if shard.packs:
                spans = shard.chunk_spans(element_size(leaf.dtype))
                for (digest, _start, length), at in zip(spans, shard.packs, strict=False):
                    if at is not None:
                        members.append([digest.hex, *at.to_json(), length])
    ranked = isinstance(leaves.get(RANKS_ENTRY), DataEntry)
    return json.dumps({"census": CENSUS_FORM, "depths": depths, "members": members,
                       "ranked": ranked}, separators=(",", ":")).encode()
