"""Delta saves: a chunk encoded against the same chunk of the run's previous version.

How a save uses deltas (the writer calls these; the format is docs/format.md
§3.4, the safety argument the last paragraph):

1. when the save opens, the run's latest version (the parent of the version
   being saved) is read: its tensor entries by name, and for every chunk it
   lists, the delta chain its manifest lists (:class:`ParentChunks`);
2. a chunk that is already stored is reused as deduplication always did,
   and its listed chain is taken from the parent's manifest or, for a chunk
   the parent does not list, from the object headers; every base of the
   chain is claimed like the chunk itself, and when one cannot be (a GC has
   condemned it) the chunk is written standalone instead;
3. a new chunk whose tensor has the same dtype, shape and chunk size in the
   parent is encoded against the parent's chunk at the same position, when
   that chunk's chain is shorter than the store's ``delta_depth``: the base
   and its chain are claimed first (they are *reused*, exactly as a dedup
   hit is), then decoded and verified, XORed with the new bytes and encoded
   (:func:`encode_delta`).  The delta is kept only when it is below
   ``MARGIN`` of the standalone encoding's size;
4. the version's manifest lists the chain of every chunk (``bases``), so
   the mark phase of GC and ``index rebuild`` see each base as referenced by
   every version that needs it, without reading a chunk object.

Why no interleaving loses a base: a base is never written by the save that
depends on it, only reused, and it is claimed through the same path as a
deduplicated chunk (session object stored and GC journal read first, the
store-level fence honoured, the index claim taken), so whatever protects a
dedup target protects a base.  Delta objects are only ever created with
put-if-absent; an existing object is only ever replaced by a standalone
encoding, so the chain a manifest lists can only be longer than the one its
object needs, never shorter (and a reader refuses a base that is not listed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from chunkstore.codecs import XOR_DELTA, Codec
from chunkstore.codecs.policy import PROBE_BYTES, encode_with_policy
from chunkstore.codecs.xordelta import xor_of
from chunkstore.digest import Digest
from chunkstore.errors import ChunkStoreError
from chunkstore.manifest import TensorEntry
from chunkstore.tree import flatten

if TYPE_CHECKING:
    from chunkstore.store import Store

#: A delta is kept only below this fraction of the standalone encoding's size:
#: every link of a chain costs a read and a decode on restore.
MARGIN = 0.9
#: Policies under which a save writes deltas (``none`` is the fastest path, raw).
DELTA_POLICIES = ("auto",)


@dataclass(frozen=True)
class BaseSlot:
    """The chunk a new chunk may be encoded against, with that chunk's listed chain."""

    digest: Digest
    chain: tuple[Digest, ...]


class ParentChunks:
    """What a save needs to know of the run's previous version (step 1 above)."""

    def __init__(self, store: Store, run: str) -> None:
        self.depth = store.config.delta_depth if store.compression in DELTA_POLICIES else 0
        self._entries: dict[str, TensorEntry] = {}
        self.chains: dict[Digest, tuple[Digest, ...]] = {}
        parent = store.latest(run)
        if parent is None:
            return
        try:
            flat = flatten(store.backend, parent.root, store.node_cache)
        except ChunkStoreError:
            return  # an unreadable parent: every chunk is written standalone
        for name, leaf in flat.leaves.items():
            if not isinstance(leaf, TensorEntry):
                continue
            self._entries[name] = leaf
            for shard in leaf.shards:
                for i, digest in enumerate(shard.chunks):
                    chain = shard.chain(i)
                    self.chains.setdefault(digest, chain)
                    for k, base in enumerate(chain):
                        self.chains.setdefault(base, chain[k + 1:])

    def bases(self, name: str, dtype: str, shape: tuple[int, ...], chunk_bytes: int
              ) -> list[BaseSlot | None]:
        """The base of each chunk of a new tensor (None: standalone), by position."""
        entry = self._entries.get(name)
        if (self.depth == 0 or entry is None or (entry.dtype, entry.shape) != (dtype, shape)
                or len(entry.shards) != 1 or entry.shards[0].chunk_bytes != chunk_bytes
                or entry.shards[0].sizes != shape):
            return []
        shard = entry.shards[0]
        return [BaseSlot(d, shard.chain(i)) if len(shard.chain(i)) < self.depth else None
                for i, d in enumerate(shard.chunks)]


Standalone = tuple[Codec, bytes | memoryview]


def encode_delta(policy: str, raw: memoryview, base: bytes | memoryview, dtype: str,
                 itemsize: int) -> tuple[bytes | None, Standalone | None]:
    """The xor-delta payload of ``raw`` against ``base`` when it pays (else None), and
    the standalone encoding when judging needed all of it (so it is not made twice).

    A chunk over 256 KiB is judged on a 64 KiB probe first, both ways, so a delta
    that does not pay costs two small encodes, not a full one.
    """
    if len(base) != len(raw) or not raw:
        return None, None
    if len(raw) <= 4 * PROBE_BYTES:
        standalone = encode_with_policy(policy, raw, dtype, itemsize)
        payload = XOR_DELTA.encode(xor_of(raw, base), itemsize)
        return (payload if len(payload) < MARGIN * len(standalone[1]) else None), standalone
    probe_len = PROBE_BYTES - PROBE_BYTES % itemsize
    probe = len(encode_with_policy(policy, raw[:probe_len], dtype, itemsize)[1])
    delta_probe = XOR_DELTA.encode(xor_of(raw[:probe_len], base[:probe_len]), itemsize)
    if len(delta_probe) >= MARGIN * probe:
        return None, None
    payload = XOR_DELTA.encode(xor_of(raw, base), itemsize)
    if len(payload) >= MARGIN * probe / probe_len * len(raw):
        return None, None
    return payload, None
