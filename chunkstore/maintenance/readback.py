"""Reading a mirror back: a rotating sample of its objects, checked, and healed from
the store it mirrors.

A replicator never reads what the mirror already holds (an object the mirror has is
a deduplication hit: its existence is checked, not its bytes), so rot in the mirror
would stay unseen until the day the mirror is the only copy.  So, after each version
it mirrors, the replicator reads back a slice of the mirror
(:meth:`ReadBack.step`):

1. at the start of a cycle, the objects the mirror's versions need are listed from
   their trees (walked in the local store where it still has the version, its trees
   being the same bytes, else in the mirror): every tree and data node, every chunk
   object with what a read of it needs (its listed chain; for a pack, nothing), in
   digest order from a random start, so that a replicator started again does not
   always read the same objects first;
2. each step reads the next objects of the cycle, each checked as a read checks it
   (a chunk decoded through its chain with every link checked, a pack's content and
   a node hashed), until ``budget_bytes`` were read (at least one object);
3. an object that fails (or is missing, and not forwarded by a moved record) is
   replaced from the local store's checked bytes, as ``chunkstore repair`` does it
   (:func:`~chunkstore.maintenance.repair.repair_objects`); one the local store cannot
   give (pruned there, or damaged there too) is reported.

A cycle reads every object the mirror's versions needed at its start once, so with
``B`` stored bytes in the mirror and a budget of ``b`` per mirrored version, rot in an
object is found (and healed) within ``ceil(B / b)`` mirrored versions of the cycle
after it appeared: at most ``2 * ceil(B / b)``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from chunkstore.errors import ChunkStoreError
from chunkstore.format.digest import Digest
from chunkstore.format.manifest import TensorEntry
from chunkstore.handle.tree import FlatTree, flatten
from chunkstore.maintenance.repair import Fix, repair_nodes, repair_objects
from chunkstore.maintenance.synccopy import Need, add_needs, checked_object
from chunkstore.objects.kinds import CHUNKS, NODES

if TYPE_CHECKING:
    from chunkstore.handle.handle import StoreHandle

#: What a replicator reads back of the mirror per version it mirrors, by default.
DEFAULT_READ_BACK_BYTES = 64 << 20

#: One object of a cycle: its digest, whether it is a node, what a read of a chunk
#: object needs, and the version that needs it (RUN@STEP).
Item = tuple[Digest, bool, Need, str]


@dataclass
class ReadBackResult:
    """What one step read, found and healed."""

    objects_read: int = 0
    bytes_read: int = 0
    damaged: list[str] = field(default_factory=list)  # digests that failed their check
    healed: list[Fix] = field(default_factory=list)
    unhealed: list[Fix] = field(default_factory=list)
    cycle_done: bool = False  # this step read the last object of its cycle


class ReadBack:
    """Reads ``mirror`` back a slice per step and heals it from ``local``; see the
    module docstring."""

    def __init__(self, mirror: StoreHandle, local: StoreHandle,
                 budget_bytes: int = DEFAULT_READ_BACK_BYTES,
                 rng: random.Random | None = None) -> None:
        self.mirror, self.local = mirror, local
        self.budget_bytes = max(1, budget_bytes)
        self._rng = rng or random.Random()
        self._cycle: list[Item] = []
        self._position = 0
        self.cycles = 0  # cycles begun

    @property
    def left_in_cycle(self) -> int:
        return len(self._cycle) - self._position

    def step(self) -> ReadBackResult:
        """Read and check the next objects, up to the budget; heal what fails."""
        result = ReadBackResult()
        if self._position >= len(self._cycle):
            self._cycle, self._position = self._survey(), 0
            self.cycles += 1
        while self._position < len(self._cycle) and (
                result.objects_read == 0 or result.bytes_read < self.budget_bytes):
            item = self._cycle[self._position]
            self._position += 1
            self._check(item, result)
        result.cycle_done = self._position >= len(self._cycle)
        return result

    def _survey(self) -> list[Item]:
        items: dict[Digest, Item] = {}
        for info in sorted(self.mirror.versions(), key=lambda v: (v.created, v.id)):
            label = f"{info.run}@{info.step}"
            flat = self._tree(info.root)
            if flat is None:
                continue  # unreadable here: `verify` names it, repair mends it
            for digest in sorted(flat.tree_nodes | flat.data_nodes()):
                items.setdefault(digest, (digest, True, None, label))
            needs: dict[Digest, Need] = {}
            for leaf in flat.leaves.values():
                if isinstance(leaf, TensorEntry):
                    add_needs(leaf, needs)
            for digest, need in needs.items():
                items.setdefault(digest, (digest, False, need, label))
        ordered = [items[d] for d in sorted(items, key=lambda d: d.raw)]
        start = self._rng.randrange(len(ordered)) if ordered else 0
        return ordered[start:] + ordered[:start]

    def _tree(self, root: Digest) -> FlatTree | None:
        for store in (self.local, self.mirror):
            try:
                return flatten(store.objects, root, store.node_cache)
            except ChunkStoreError:
                continue
        return None

    def _check(self, item: Item, result: ReadBackResult) -> None:
        digest, is_node, need, label = item
        try:
            if is_node:
                data = self.mirror.objects.get(NODES, digest)
                ok = self.mirror.objects.node_ids.names(digest, data)
            else:
                data = self.mirror.objects.get(CHUNKS, digest)
                checked_object(self.mirror, digest, data, need, check_links=True)
                ok = True
            result.bytes_read += len(data)
        except (FileNotFoundError, ChunkStoreError):
            ok = False  # missing (a pack may be forwarded: the repair looks) or damaged
        result.objects_read += 1
        if ok:
            return
        healed = (repair_nodes(self.mirror, self.local, [digest], label) if is_node
                  else repair_objects(self.mirror, self.local, {digest: need}, label))
        if healed.fixed or healed.unfixed:
            result.damaged.append(digest.hex)
        result.healed.extend(healed.fixed)
        result.unhealed.extend(healed.unfixed)


__all__ = ["DEFAULT_READ_BACK_BYTES", "ReadBack", "ReadBackResult"]
