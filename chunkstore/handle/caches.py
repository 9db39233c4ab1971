"""Caches a store handle keeps for its reads and saves (the node cache is
:class:`chunkstore.handle.tree.NodeCache`)."""

from __future__ import annotations

import threading
from collections import OrderedDict

from chunkstore.format.digest import Digest


class BaseCache:
    """Decoded, verified chunk bytes by digest; at most ``budget`` bytes in all."""

    def __init__(self, budget: int) -> None:
        self._items: OrderedDict[Digest, bytes | memoryview] = OrderedDict()
        self._budget = budget
        self._size = 0
        self._lock = threading.Lock()

    def get(self, digest: Digest) -> bytes | memoryview | None:
        with self._lock:
            raw = self._items.get(digest)
            if raw is not None:
                self._items.move_to_end(digest)
            return raw

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._size = 0

    def put(self, digest: Digest, raw: bytes | memoryview) -> None:
        if len(raw) > self._budget:
            return
        if isinstance(raw, memoryview) and raw.readonly:
            # A view of stored bytes (a raw chunk inside a pack run read whole, or a
            # mapped file): keep the chunk's bytes alone, not the run or the mapping.
            raw = bytes(raw)
        with self._lock:
            if digest in self._items:
                return
            self._items[digest] = raw
            self._size += len(raw)
            while self._size > self._budget:
                _, old = self._items.popitem(last=False)
                self._size -= len(old)
