"""Group commit for a save's chunk claims in the index."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Generic, TypeVar

from chunkstore.format.digest import Digest

T = TypeVar("T")


class GroupClaims(Generic[T]):
    """Group commit for chunk claims: the worker threads' claims that arrive while
    one LMDB transaction runs go together into the next one, so a save of many
    small tensors pays for a few index commits, not one per chunk.  ``claim_many``
    claims a list of digests in one transaction and answers for each (a
    :class:`~chunkstore.index.lmdbindex.Claim`, or what ``Index.claim_small`` answers)."""

    def __init__(self, claim_many: Callable[[list[Digest]], dict[Digest, T]]) -> None:
        self._claim_many = claim_many
        self._lock = threading.Lock()
        self._queue: list[tuple[Digest, Future[T]]] = []
        self._leader = False

    def claim(self, digest: Digest) -> T:
        future: Future[T] = Future()
        with self._lock:
            self._queue.append((digest, future))
            lead = not self._leader
            self._leader = True
        if lead:
            self._drain()
        return future.result()

    def _drain(self) -> None:
        while True:
            with self._lock:
                batch, self._queue = self._queue, []
                if not batch:
                    self._leader = False
                    return
            try:
                results = self._claim_many([d for d, _ in batch])
            except BaseException as exc:
                for _, future in batch:
                    future.set_exception(exc)
                continue
            for digest, future in batch:
                future.set_result(results[digest])
