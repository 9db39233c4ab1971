"""A resumable, seeded, per-epoch-shuffling sampler for a plain DataLoader."""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import numpy as np
from torch.utils.data import Sampler

from chunkstore.errors import InvalidInputError


class ResumableSampler(Sampler[int]):
    """Yields each index of ``data_source`` once per epoch, in a seeded order, resumably.

    The order of epoch ``e`` depends only on ``(seed, e)``.  ``state_dict()``
    holds epoch, seed and offset (indices handed out so far in the epoch), so
    a restored sampler continues mid-epoch without repeating or skipping an
    example.  Iterating again after an epoch is exhausted starts the next one.

    The offset counts indices the DataLoader *took*: exact with
    ``num_workers=0``; worker processes prefetch ahead (``prefetch_factor``
    batches per worker), and those batches count as consumed.
    """

    def __init__(self, data_source: Sized, seed: int = 0, shuffle: bool = True) -> None:
        self.data_source = data_source
        self.seed = int(seed)
        self.shuffle = shuffle
        self.epoch = 0
        self.offset = 0
        self._epoch_named = False  # set_epoch() named the epoch the next __iter__ serves

    def __len__(self) -> int:
        return len(self.data_source)

    def order(self, epoch: int) -> np.ndarray:
        """The index order of ``epoch``."""
        size = len(self.data_source)
        if not self.shuffle:
            return np.arange(size)
        generator = np.random.default_rng(np.random.SeedSequence([self.seed, epoch]))
        return generator.permutation(size)

    def __iter__(self) -> Iterator[int]:
        size = len(self.data_source)
        named, self._epoch_named = self._epoch_named, False
        if self.offset >= size:
            if named:  # set_epoch() named an epoch that is used up: nothing is left of it
                return
            self.epoch += 1  # plain re-iteration: the next epoch
            self.offset = 0
        order = self.order(self.epoch)
        while self.offset < size:
            index = int(order[self.offset])
            self.offset += 1
            yield index

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning, unless it is the epoch in progress."""
        if epoch != self.epoch:
            self.epoch, self.offset = epoch, 0
        self._epoch_named = True

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed,
                "shuffle": self.shuffle, "size": len(self.data_source)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        size = len(self.data_source)
        if state["size"] != size:
            raise InvalidInputError(f"the sampler was saved over {state['size']} examples,"
                                    f" the data source now has {size}")
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        self.seed, self.shuffle = int(state["seed"]), bool(state["shuffle"])
