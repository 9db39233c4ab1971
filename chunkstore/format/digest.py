"""Content ids.

A :class:`Digest` is the BLAKE3-256 of some bytes; a chunk's id is its content's
digest as the store names chunks (:class:`ChunkIds`: plain BLAKE3, or keyed BLAKE3 in an
encrypted store).  Where an object of each kind
lives in a store is decided in one place, :mod:`chunkstore.objects.kinds`.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from concurrent.futures import Executor, Future, wait
from dataclasses import dataclass

import blake3

DIGEST_SIZE = 32
_HEX = re.compile(r"[0-9a-f]{64}\Z")  # \Z: "$" would match before a final newline

@dataclass(frozen=True, order=True)
class Digest:
    """A 32-byte BLAKE3 content id."""

    raw: bytes

    def __post_init__(self) -> None:
        if len(self.raw) != DIGEST_SIZE:
            raise ValueError(f"a digest is {DIGEST_SIZE} bytes, got {len(self.raw)}")

    @classmethod
    def of(cls, data: bytes | memoryview) -> Digest:
        """Hash ``data``; large inputs release the GIL so threads overlap."""
        return cls(blake3.blake3(data).digest())

    def is_hash_of(self, data: bytes | memoryview) -> bool:
        """Whether ``data`` hashes to this digest (what a read checks of every chunk;
        no Digest is made for the comparison)."""
        return blake3.blake3(data).digest() == self.raw

    @classmethod
    def parse(cls, text: str) -> Digest:
        """Parse 64 lowercase hex characters; ``ValueError`` otherwise."""
        if not _HEX.match(text):
            raise ValueError(f"not a digest: {text!r}")
        # 64 hex digits are DIGEST_SIZE bytes: the checks of __init__ have nothing to
        # refuse, and a manifest parses one digest per chunk, pack and base it lists.
        digest = object.__new__(cls)
        object.__setattr__(digest, "raw", bytes.fromhex(text))
        return digest

    @property
    def hex(self) -> str:
        return self.raw.hex()

    def short(self, length: int = 12) -> str:
        return self.hex[:length]

    def __str__(self) -> str:
        return self.hex


@dataclass(frozen=True)
class ChunkIds:
    """How a store names the content of its chunks (and packs): BLAKE3, or in an
    encrypted store BLAKE3 keyed with a key derived from the master key, so that an id
    tells nothing about the content to whoever lacks the key (docs/format.md §13)."""

    key: bytes | None = None

    @property
    def keyed(self) -> bool:
        return self.key is not None

    def of(self, data: bytes | memoryview) -> Digest:
        """The id of a chunk with content ``data``."""
        if self.key is None:
            return Digest.of(data)
        return Digest(blake3.blake3(data, key=self.key).digest())

    def of_pieces(self, pieces: Sequence[bytes | memoryview]) -> Digest:
        """:meth:`of` the pieces laid end to end, without joining them."""
        hasher = blake3.blake3() if self.key is None else blake3.blake3(key=self.key)
        for piece in pieces:
            hasher.update(piece)
        return Digest(hasher.digest())

    def names(self, digest: Digest, data: bytes | memoryview) -> bool:
        """Whether ``digest`` is the id of content ``data`` (what a read checks)."""
        if self.key is None:
            return digest.is_hash_of(data)
        return blake3.blake3(data, key=self.key).digest() == digest.raw

    def __repr__(self) -> str:  # never the key
        return f"ChunkIds(keyed={self.keyed})"


#: The ids of an unencrypted store.
PLAIN_IDS = ChunkIds()


def digests_of(items: Sequence[bytes | memoryview], executor: Executor, helpers: int,
               ids: ChunkIds = PLAIN_IDS) -> list[Digest]:
    """The digest of every item, hashed by the caller and up to ``helpers`` jobs of
    ``executor`` taking items in turn.

    BLAKE3's own threads gain nothing on inputs under about 1 MiB, so a batch of
    small tensors is spread over threads instead.  A job the pool has not started
    when the caller runs out of items (its threads busy encoding) is cancelled: the
    caller has hashed everything, and never waits behind other work.  However the
    call ends (an error in a job, an interrupt in the caller), no job takes another
    item and the started ones are waited for: nothing reads ``items`` after it
    returns, and no frame left behind holds a job's error (a cycle that would keep
    the caller's buffers until a full collection).
    """
    digests: list[Digest | None] = [None] * len(items)
    lock = threading.Lock()
    taken = 0

    def hash_in_turn() -> None:
        nonlocal taken
        while True:
            with lock:
                i, taken = taken, taken + 1
            if i >= len(items):
                return
            digests[i] = ids.of(items[i])

    jobs: list[Future[None]] = []
    try:
        for _ in range(min(helpers, len(items) - 1)):
            jobs.append(executor.submit(hash_in_turn))
        hash_in_turn()
    finally:
        with lock:
            taken = len(items)
        started = [job for job in jobs if not job.cancel()]
        jobs.clear()
        wait(started)  # each ends after the item in hand
    error = next((e for e in map(Future.exception, started) if e is not None), None)
    started.clear()
    if error is not None:
        try:
            raise error
        finally:
            del error
    return digests  # type: ignore[return-value]  # every place was filled


def is_hex_digest(text: str) -> bool:
    return bool(_HEX.match(text))
