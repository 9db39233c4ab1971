"""What one version adds to ``report``'s census (:mod:`chunkstore.maintenance.census`),
as the index's ``census`` table records it: computed from the version's leaves, by
the save that wrote them (:mod:`chunkstore.write.writer`), by a copy into another
store, or by the open that counted the version in (:mod:`chunkstore.maintenance.reconcile`),
so that a ``report`` reads no manifest of a version recorded with it.

A contribution is small and binary (form 2), because every save records one and a
job keeps only a few versions: a value larger than an LMDB leaf page holds goes to
overflow pages, whose freed runs a later write seldom fits, and the census of form 1
(JSON, 10 kB for a small MLP with AdamW) kept a ``keep_last`` job's index growing by
a page run every few saves (tests/test_steady_disk.py).  Its layout, little-endian::

    header   form (1 byte, 2), flags (1 byte: 1 = records ranks),
             packs P, chains D, members M (4 bytes each)
    packs    P pack digest prefixes, 8 bytes each
    chains   D x (digest prefix, 8 bytes; deepest chain, 1 byte)
    members  M x (digest prefix, 8 bytes; pack index, 4; offset, 4; length, 4;
                  raw length, 4)

A chunk or a pack is named by the first 8 bytes of its digest (a 20-tensor version
of packed chunks: 0.6 kB): the census counts distinct chunks, their chains and the
bytes each pack's listed members hold, and two objects of one store sharing 64 bits
of BLAKE3 (for a million objects, odds of about 3 in 10^8) would be counted as one,
a figure of a report off by one object.  Offsets and lengths fit 4 bytes: a pack is
at most :data:`~chunkstore.format.manifest.MAX_PACK_BYTES`.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass

from chunkstore.format.dtypes import element_size
from chunkstore.format.manifest import DataEntry, TensorEntry
from chunkstore.format.shards import RANKS_ENTRY

#: The form of a recorded contribution (:func:`contribution`); one of another form is
#: counted again from the manifests.
CENSUS_FORM = 2
#: Bytes of a chunk digest a contribution keeps.
PREFIX_BYTES = 8
_HEADER = struct.Struct("<BBIII")
_CHAIN = struct.Struct("<8sB")
_MEMBER = struct.Struct("<8sIIII")
_RANKED = 1


@dataclass(frozen=True)
class Contribution:
    """One version's contribution, decoded (:func:`parse`): its chained chunks' deepest
    chains and its packed chunks as (digest prefix, pack digest prefix, offset, length)
    -> raw length."""

    depths: dict[bytes, int]
    members: dict[tuple[bytes, bytes, int, int], int]
    ranked: bool


def contribution(leaves: Mapping[str, TensorEntry | DataEntry]) -> bytes:
    """What one version (its leaves by full name) adds to the census: its chunks'
    deepest chains, its packed chunks, and whether it records its shards' ranks."""
    depths: dict[bytes, int] = {}
    packs: dict[bytes, int] = {}
    members: list[bytes] = []
    for leaf in leaves.values():
        if not isinstance(leaf, TensorEntry):
            continue
        for shard in leaf.shards:
            for digest, chain in zip(shard.chunks, shard.bases, strict=False):
                if chain:
                    prefix = digest.raw[:PREFIX_BYTES]
                    depths[prefix] = max(depths.get(prefix, 0), len(chain))
            if shard.packs:
                spans = shard.chunk_spans(element_size(leaf.dtype))
                for (digest, _start, length), at in zip(spans, shard.packs, strict=False):
                    if at is not None:
                        pack = packs.setdefault(at.pack.raw[:PREFIX_BYTES], len(packs))
                        members.append(_MEMBER.pack(digest.raw[:PREFIX_BYTES], pack,
                                                    at.offset, at.length, length))
    ranked = isinstance(leaves.get(RANKS_ENTRY), DataEntry)
    return b"".join((_HEADER.pack(CENSUS_FORM, _RANKED if ranked else 0, len(packs),
                                  len(depths), len(members)),
                     *packs, *(_CHAIN.pack(p, d) for p, d in depths.items()), *members))


def parse(payload: bytes) -> Contribution | None:
    """A recorded contribution; None where it is not one this release writes (another
    form, or damaged): the caller counts that version from its manifests."""
    if len(payload) < _HEADER.size:
        return None
    form, flags, n_packs, n_chains, n_members = _HEADER.unpack_from(payload)
    chains_at = _HEADER.size + PREFIX_BYTES * n_packs
    members_at = chains_at + _CHAIN.size * n_chains
    if form != CENSUS_FORM or flags & ~_RANKED \
            or len(payload) != members_at + _MEMBER.size * n_members:
        return None
    packs = [payload[at:at + PREFIX_BYTES]
             for at in range(_HEADER.size, chains_at, PREFIX_BYTES)]
    depths = {prefix: depth for prefix, depth
              in _CHAIN.iter_unpack(payload[chains_at:members_at])}
    try:
        members = {(prefix, packs[pack], offset, length): raw
                   for prefix, pack, offset, length, raw
                   in _MEMBER.iter_unpack(payload[members_at:])}
    except IndexError:  # a pack index past the packs listed
        return None
    return Contribution(depths, members, bool(flags & _RANKED))
