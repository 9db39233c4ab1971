"""The cryptography of an encrypted store (docs/format.md §13): subkeys, and objects
sealed in segments.

1. **Subkeys.**  A store's random 256-bit master key (wrapped in key objects,
   :mod:`chunkstore.objects.keys`) is never used directly: HKDF-SHA256 derives one
   subkey for sealing objects and one for chunk ids (keyed BLAKE3,
   :class:`~chunkstore.format.digest.ChunkIds`), so neither use can leak into the other.
2. **A key per object.**  Each object is sealed under its own AES-256-GCM key, keyed
   BLAKE3 of its storage key under the sealing subkey: an object copied or renamed to
   another key is opened under another key and fails, and random 96-bit nonces (or
   salts, 4.) stay far inside GCM's limit however large the store grows (each object's
   key seals only the few versions ever written under that name).
3. **Segments.**  An object's encoding is cut into segments of ``segment_size`` bytes
   (64 KiB), the last always shorter (empty where the length is a multiple), each
   stored as ``nonce (12) || ciphertext || tag (16)`` with the segment's index and the
   object's key as associated data.  A range of the encoding is read as the segments
   that cover it, so ranged reads (chunk headers, pack members, payloads read into a
   caller's buffer) keep working at any offset with at most two segments' extra bytes,
   and a repack or copy moves nothing it must not: a segment moved to another index or
   object fails its tag.  A stored object whose last segment is full was truncated at a
   segment boundary: it is refused (:class:`AuthenticationError`).
4. **A salt per write** (sealing 2, store version 12).  Each write draws one 96-bit
   salt; segment ``i``'s nonce is the salt XOR ``i`` (big-endian, in the last 8 bytes),
   so the nonce every segment stores names its write, and GCM authenticates it.  A reader
   takes the salt from the first segment it opens and refuses any other segment whose
   nonce is not that salt XOR its index: segments of two writes of one name (a tag, a
   session rewritten) no longer splice into bytes never written, and a ranged read still
   needs nothing but the segments it reads.  Sealing 1 (store versions 10 and 11) draws
   every nonce at random and binds a segment to its name and index only.
5. **Pack members on their own** (sealing 3, store version 13).  Each pack member is
   sealed as an object of its own under its chunk id, not under its pack's key
   (:mod:`chunkstore.objects.sealedpacks`): a repack copies its ciphertext unchanged.
   A pack's members are sealed side by side into the pack's buffer
   (:meth:`Sealer.seal_into`), their salts and its index's drawn at once
   (:func:`fresh_salts`): each still its own random salt.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import blake3
import numpy as np

from chunkstore.errors import MissingDependencyError
from chunkstore.format import records

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

#: The segment size a new encrypted store records in its config.
SEGMENT_SIZE = records.SEGMENT_SIZE
NONCE_SIZE = 12
TAG_SIZE = 16
#: Stored bytes each segment adds to the encoding's.
SEGMENT_OVERHEAD = NONCE_SIZE + TAG_SIZE
KEY_SIZE = 32

RandomBytes = Callable[[int], bytes]
#: Where every key, salt and nonce comes from.  tools/make_encrypted_fixture.py replaces
#: it with a seeded generator, so that its fixture's bytes are reproducible; nothing else may.
random_source: RandomBytes = os.urandom


def fresh_bytes(count: int) -> bytes:
    """``count`` random bytes from :data:`random_source`."""
    return random_source(count)


def fresh_salts(count: int) -> list[bytes]:
    """``count`` salts (:data:`NONCE_SIZE` random bytes each) for as many writes: one
    draw, sliced (a pack's members and its index: one system call a pack, not one a
    member, each of which lets go of the GIL and may wait to get it back behind a
    save's other threads).  A replaced :data:`random_source` (the fixture tool's seeded
    stream) is drawn from once a salt, as each write drew before, so the bytes it
    makes stay what they were."""
    if random_source is not os.urandom:
        return [random_source(NONCE_SIZE) for _ in range(count)]
    drawn = os.urandom(NONCE_SIZE * count)
    return [drawn[at:at + NONCE_SIZE] for at in range(0, len(drawn), NONCE_SIZE)]


class AuthenticationError(Exception):
    """Raised when a stored object fails authentication (tampered, truncated, renamed,
    or sealed under another key); the object layer turns it into the kind's corrupt error."""


def aead_class() -> type[AESGCM]:
    """AES-GCM from the ``cryptography`` package, or what to install."""
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError:
        raise MissingDependencyError(
            "encrypted stores need the `cryptography` package, which is not installed;"
            " install it with: pip install cryptography (what the [encrypt] extra"
            " installs)") from None
    return AESGCM


def subkey(master: bytes, purpose: str) -> bytes:
    """HKDF-SHA256 of the master key for one ``purpose`` ("objects", "chunk ids")."""
    aead_class()  # the same package; a clear error where it is missing
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF
    return HKDF(algorithm=hashes.SHA256(), length=KEY_SIZE, salt=None,
                info=f"chunkstore {purpose}".encode()).derive(master)


def stored_size(size: int, segment: int = SEGMENT_SIZE) -> int:
    """The stored size of an encoding of ``size`` bytes."""
    return size + (size // segment + 1) * SEGMENT_OVERHEAD


def plain_size(stored: int, segment: int = SEGMENT_SIZE) -> int:
    """The encoding's size for ``stored`` bytes (0 where no valid object has that size)."""
    full, rest = divmod(stored, segment + SEGMENT_OVERHEAD)
    return full * segment + rest - SEGMENT_OVERHEAD if rest >= SEGMENT_OVERHEAD else 0


def scratch(size: int) -> memoryview:
    """A fresh writable buffer of ``size`` bytes, not zero-filled: every byte is written
    before it is read, and a zero-filled ``bytearray`` of a chunk's size costs as much as
    copying it (measured: 0.7-1.9 GB/s against numpy's empty, which reuses freed heap)."""
    return memoryview(np.empty(size, dtype=np.uint8).data).cast("B")


def byte_views(pieces: Sequence[bytes | memoryview]) -> list[memoryview]:
    """``pieces`` as flat byte views (what :meth:`Sealer.seal_into` takes)."""
    return [memoryview(piece).cast("B") for piece in pieces]


def _segments(pieces: Sequence[memoryview], step: int, gather: memoryview | None = None
              ) -> Iterator[memoryview]:
    """The ``step``-byte segments of ``pieces`` (byte views) laid end to end, then the
    shorter last one (empty where the length is a multiple of ``step``): views of the
    pieces, except a segment that straddles pieces, gathered into ``gather`` (or a
    fresh buffer; each view is valid until the next is taken)."""
    gather, held = scratch(step) if gather is None else gather, 0
    for number, piece in enumerate(pieces):
        at = 0
        if held:  # the rest of a segment begun in the pieces before
            at = min(step - held, len(piece))
            gather[held:held + at] = piece[:at]
            held += at
            if held < step:
                continue
            yield gather
            held = 0
        while len(piece) - at >= step:
            yield piece[at:at + step]
            at += step
        if number == len(pieces) - 1:
            yield piece[at:]  # the last segment, straight from the last piece
            return
        gather[:len(piece) - at] = piece[at:]
        held = len(piece) - at
    yield gather[:held]  # no pieces, or a last piece that did not complete its segment


class Sealer:
    """Seals and opens objects under one store's sealing subkey (see the module docstring)."""

    def __init__(self, objects_key: bytes, segment: int = SEGMENT_SIZE,
                 salted: bool = True, members: bool = False) -> None:
        self._key = objects_key
        self.segment = segment
        #: one salt per write, in every segment's nonce (sealing 2; see the module docstring)
        self.salted = salted
        #: each pack member sealed on its own (sealing 3, :mod:`chunkstore.objects.sealedpacks`)
        self.members = members
        self._aead = aead_class()

    def _cipher(self, name: str) -> AESGCM:
        return self._aead(blake3.blake3(name.encode(), key=self._key).digest())

    def seal(self, name: str, data: bytes | memoryview | list[bytes | memoryview]
             ) -> memoryview:
        """The stored bytes of the object stored as ``name`` whose encoding is ``data``,
        or the pieces of ``data`` laid end to end (a pack's header and members: each
        segment is sealed straight from its piece, and only a segment that straddles
        two pieces is gathered first, so the pieces are never joined)."""
        pieces = byte_views(data if isinstance(data, list) else [data])
        target = scratch(stored_size(sum(map(len, pieces)), self.segment))
        self.seal_into(name, pieces, target)
        return target

    def seal_into(self, name: str, pieces: Sequence[memoryview], target: memoryview,
                  gather: memoryview | None = None, salt: bytes | None = None) -> None:
        """:meth:`seal` written into ``target``, exactly the stored size of ``pieces``
        (byte views, :func:`byte_views`): a pack seals its members side by side into
        one buffer, never into a buffer each that is then joined.  ``gather``: a
        segment's worth of scratch for a segment that straddles pieces, and ``salt``:
        this write's, from :func:`fresh_salts` (sealing 2 and 3), where the caller
        seals many objects in a row."""
        step = self.segment
        count = len(target) // (step + SEGMENT_OVERHEAD) + 1
        cipher = self._cipher(name)
        if not self.salted:
            salt = b""
        elif salt is None:
            salt = fresh_bytes(NONCE_SIZE)
        nonces = b"" if self.salted else fresh_bytes(NONCE_SIZE * count)
        # Segment i's associated data: the name, a zero byte, i (8 bytes, big-endian); its
        # nonce (sealing 2): the salt's first 4 bytes, then its last 8 XOR i.
        prefix, low = name.encode() + b"\0", int.from_bytes(salt[4:], "big")
        encrypt, at = cipher.encrypt_into, 0
        for index, piece in enumerate(_segments(pieces, step, gather)):
            nonce = salt[:4] + (low ^ index).to_bytes(8, "big") if self.salted \
                else nonces[index * NONCE_SIZE:(index + 1) * NONCE_SIZE]
            target[at:at + NONCE_SIZE] = nonce
            end = at + NONCE_SIZE + len(piece) + TAG_SIZE
            encrypt(nonce, piece, prefix + index.to_bytes(8, "big"),
                    target[at + NONCE_SIZE:end])
            at = end
        if at != len(target):
            raise ValueError(f"sealed {at} bytes into a target of {len(target)}")

    def open(self, name: str, stored: bytes | memoryview) -> bytes:
        """The encoding of a whole stored object; :class:`AuthenticationError` if it
        fails (a truncated object included)."""
        out = scratch(plain_size(len(stored), self.segment))
        if self.open_into(name, 0, stored, out, 0) != len(out) \
                or len(stored) != stored_size(len(out), self.segment):
            raise AuthenticationError("the object is truncated")
        return bytes(out)

    def span(self, start: int, length: int) -> tuple[int, int]:
        """The stored range (start, length) holding bytes ``start`` to ``start + length``
        of an encoding: the segments that cover them."""
        step = self.segment + SEGMENT_OVERHEAD
        first, last = start // self.segment, (start + max(length, 1) - 1) // self.segment
        return first * step, (last - first + 1) * step

    def open_into(self, name: str, start: int, stored: bytes | memoryview,
                  out: memoryview, skip: int, *, salt: bytes | None = None) -> int:
        """Open the whole segments ``stored`` holds (read from :meth:`span` of ``start``)
        into ``out``, dropping the first ``skip`` bytes of their encoding; the bytes
        written (fewer than ``len(out)`` only where the object ends first).  ``salt``:
        the nonce of the object's first segment, where an earlier call opened it (each
        segment here must then be of the same write)."""
        view, cipher = memoryview(stored).cast("B"), self._cipher(name)
        index, full = start // self.segment, self.segment + SEGMENT_OVERHEAD
        prefix, at, written, stop = name.encode() + b"\0", 0, 0, len(view)
        # the salt's first 4 bytes, once a segment gave them, and its last 8 as a number
        head = None if salt is None else salt[:4]
        low = 0 if salt is None else int.from_bytes(salt[4:], "big")
        while at < stop:  # every segment read is authenticated, if none is used
            end = min(at + full, stop)
            size = end - at - SEGMENT_OVERHEAD
            if size < 0:
                raise AuthenticationError(f"segment {index} is truncated")
            nonce = view[at:at + NONCE_SIZE]
            if self.salted:  # every segment of one write: the same salt
                if head is None:
                    head, low = bytes(nonce[:4]), int.from_bytes(nonce[4:], "big") ^ index
                elif nonce != head + (low ^ index).to_bytes(8, "big"):
                    raise AuthenticationError(f"segment {index} is of another write than"
                                              " the segments before it")
            body, associated = view[at + NONCE_SIZE:end], prefix + index.to_bytes(8, "big")
            try:
                if skip == 0 and written + size <= len(out):  # wholly wanted: in place
                    cipher.decrypt_into(nonce, body, associated, out[written:written + size])
                    written += size
                else:
                    take = max(0, min(size - skip, len(out) - written))
                    plain = cipher.decrypt(nonce, body, associated)
                    out[written:written + take] = plain[skip:skip + take]
                    written, skip = written + take, max(0, skip - size)
            except Exception as exc:  # InvalidTag (and a nonce of the wrong size)
                raise AuthenticationError(f"segment {index} fails authentication") from exc
            at, index = end, index + 1
            if size < self.segment:
                return written  # the last segment: the object ends here
        if len(view) and written < len(out):  # more was asked for, and no last segment
            raise AuthenticationError("the object is truncated at a segment boundary")
        return written

    def open_paged(self, name: str, stored: memoryview, out: memoryview,
                   populate: Callable[[memoryview], None],
                   release: Callable[[memoryview], None], grain: int) -> int:
        """:meth:`open_into` of a whole object (from its first segment) in groups of
        whole segments of about ``grain`` stored bytes, each ``populate``-d before it is
        opened and ``release``-d after: a mapped object is never resident whole.  Every
        segment is authenticated, and must be of the same write, as one call checks."""
        step = self.segment + SEGMENT_OVERHEAD
        group = max(1, grain // step) * step
        salt, written = None, 0
        for at in range(0, len(stored), group):
            piece = stored[at:at + group]
            populate(piece)
            try:
                # a group before the last holds whole segments: as many bytes as it opens
                end = len(out) if at + group >= len(stored) else \
                    min(len(out), written + group // step * self.segment)
                done = self.open_into(name, at // step * self.segment, piece,
                                      out[written:end], 0, salt=salt)
                salt = bytes(piece[:NONCE_SIZE]) if salt is None else salt
            finally:
                release(piece)
            written += done
            if written < end:
                break  # the object ended first (the caller's length check refuses it)
        return written
