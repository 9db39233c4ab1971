"""A wrapper that keeps in memory the objects read through it while ``recording``, and
serves later reads of them (whole, by range, into a buffer) from memory.

``chunkstore drill`` times a restore's download apart from its hash check and its
materialization: it reads every object the version needs once, recording, then the
ordinary read path runs over the copies in memory.  Writes and deletes pass through
and drop the copy.
"""

from __future__ import annotations

import threading

from chunkstore.backends.base import Backend
from chunkstore.backends.wrappers import ForwardingBackend


class PrefetchBackend(ForwardingBackend):
    """Objects read while ``recording`` are kept; reads of kept objects use memory."""

    recording = True

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self._kept: dict[str, bytes] = {}
        self._lock = threading.Lock()

    @property
    def kept_bytes(self) -> int:
        with self._lock:
            return sum(map(len, self._kept.values()))

    def _copy(self, key: str) -> bytes | None:
        with self._lock:
            return self._kept.get(key)

    def _drop(self, key: str) -> None:
        with self._lock:
            self._kept.pop(key, None)

    def get(self, key: str) -> bytes:
        data = self._copy(key)
        if data is None:
            data = self.inner.get(key)
            if self.recording:
                with self._lock:
                    self._kept[key] = data
        return data

    def get_range(self, key: str, start: int, length: int) -> bytes:
        data = self._copy(key)
        if data is None:
            return self.inner.get_range(key, start, length)
        return data[start:start + length]

    def view_range(self, key: str, start: int, length: int, *, populate: bool = True
                   ) -> bytes | memoryview:
        data = self._copy(key)
        if data is None:
            return self.inner.view_range(key, start, length, populate=populate)
        return memoryview(data)[start:start + length]

    def read_into(self, key: str, start: int, buffer: memoryview) -> int:
        data = self._copy(key)
        if data is None:
            return self.inner.read_into(key, start, buffer)
        part = data[start:start + len(buffer)]
        buffer[:len(part)] = part
        return len(part)

    def put(self, key: str, data: bytes | memoryview) -> None:
        self._drop(key)
        super().put(key, data)

    def put_if_absent(self, key: str, data: bytes | memoryview) -> bool:
        self._drop(key)
        return super().put_if_absent(key, data)

    def delete(self, key: str) -> bool:
        self._drop(key)
        return super().delete(key)
