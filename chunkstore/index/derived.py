"""Tables of what was derived from a version's manifests, bound to what the index holds.

Some answers cost a read of every version's manifest tree and never change for a
version, since versions are immutable and their nodes content-addressed: that a
verify found the version readable (the ``verified`` table, for ``verify --quick``),
and what the version adds to ``report``'s census of chains, packs and ranks (the
``census`` table).  Each such table maps a version id to a *stamp* and a payload.
The stamp is a BLAKE2b of:

- the index's *derived epoch*, a random value in ``meta`` (the key keeps its first
  name, ``verified_epoch``): a rebuild of this release replaces every table and
  ``meta`` with the new contents, one of an earlier release (which does not know
  these tables and leaves them) replaces ``meta`` and so drops the epoch, and an
  emptied index drops both; each way nothing derived before is trusted;
- the version's entry, chunk references and node references as the index holds
  them now: a version removed, or counted in again with other references, no
  longer matches what was derived from it.

A payload is trusted only while its stamp matches (:func:`read`).  The tables are
additive (older releases never read them), so they change no schema.

Every save writes one entry to each table, and a ``keep_last`` job removes one
version's entries for each it saves, so each entry stays within an LMDB leaf page:
LMDB puts a larger value on *overflow pages*, a run of contiguous pages, and a run
freed by a removal is reused only by a write that needs no more pages than the run
holds, so a job whose values are a few pages each kept growing its index file (a
census of 10 kB a save: 12 KiB steps, tests/test_steady_disk.py).  A payload longer
than :data:`PIECE_BYTES` is laid over several entries: the version's own entry holds
the stamp and the number of pieces, and ``id/N`` (2 bytes of N) each piece; every
piece is a leaf entry, and pages freed by removals are reused one at a time.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import lmdb

#: meta key of the random value that binds every derived table to this index's contents
EPOCH_KEY = b"verified_epoch"
#: bytes of a stamp at the head of each value
STAMP_BYTES = 16
#: The most payload bytes one entry holds: with a version id of 64 bytes and the
#: stamp, an entry stays under LMDB's 2,038 bytes of key and value in a 4 KiB page.
PIECE_BYTES = 1800
#: What follows the stamp in the entry of a payload laid over pieces, before their count.
_IN_PIECES = b"\xffpieces"


@dataclass(frozen=True)
class VersionTables:
    """The tables a derived value is bound to: the version entries, their chunk and
    node references, and ``meta`` (which holds the epoch)."""

    versions: Any
    refs: Any
    node_refs: Any
    meta: Any

    def parts(self, txn: lmdb.Transaction, key: bytes) -> tuple[bytes, bytes, bytes] | None:
        """A version's entry, chunk and node references as the index holds them now
        (None: the index does not know the version)."""
        entry = txn.get(key, db=self.versions)
        if entry is None:
            return None
        return (bytes(entry), bytes(txn.get(key, db=self.refs) or b""),
                bytes(txn.get(key, db=self.node_refs) or b""))


def _stamp(epoch: bytes, parts: tuple[bytes, bytes, bytes]) -> bytes:
    stamp = hashlib.blake2b(epoch, digest_size=STAMP_BYTES)
    for part in parts:
        stamp.update(len(part).to_bytes(8, "big") + part)
    return stamp.digest()


def read(txn: lmdb.Transaction, tables: VersionTables, db: Any, version_ids: Iterable[str]
         ) -> dict[str, tuple[bytes, tuple[bytes, bytes, bytes]]]:
    """The payloads in ``db`` of the versions of ``version_ids`` whose stamp matches
    what the index holds now, with the version's parts (entry, chunk and node
    references)."""
    found: dict[str, tuple[bytes, tuple[bytes, bytes, bytes]]] = {}
    epoch = txn.get(EPOCH_KEY, db=tables.meta)
    if epoch is None:
        return found
    epoch = bytes(epoch)
    for version_id in version_ids:
        key = version_id.encode()
        value = txn.get(key, db=db)
        if value is None or len(value) < STAMP_BYTES:
            continue
        parts = tables.parts(txn, key)
        value = bytes(value)
        if parts is not None and value[:STAMP_BYTES] == _stamp(epoch, parts):
            payload = _joined(txn, db, key, value[STAMP_BYTES:])
            if payload is not None:
                found[version_id] = (payload, parts)
    return found


def _piece_key(key: bytes, number: int) -> bytes:
    return key + b"/" + number.to_bytes(2, "big")


def _piece_count(head: bytes) -> int | None:
    """How many pieces a payload's own entry (less the stamp) says it is laid over;
    None where it holds the payload itself."""
    if len(head) != len(_IN_PIECES) + 2 or not head.startswith(_IN_PIECES):
        return None
    return int.from_bytes(head[len(_IN_PIECES):], "big")


def _joined(txn: lmdb.Transaction, db: Any, key: bytes, head: bytes) -> bytes | None:
    """The payload whose own entry holds ``head`` after the stamp (None: a piece is
    missing, so nothing is trusted)."""
    count = _piece_count(head)
    if count is None:
        return head
    pieces = [txn.get(_piece_key(key, number), db=db) for number in range(count)]
    if any(piece is None for piece in pieces):
        return None
    return b"".join(bytes(piece) for piece in pieces if piece is not None)


def writing_epoch(txn: lmdb.Transaction, tables: VersionTables) -> bytes:
    """The index's derived epoch, made in this write transaction if it has none."""
    epoch = txn.get(EPOCH_KEY, db=tables.meta)
    if epoch is None:
        epoch = os.urandom(16)
        txn.put(EPOCH_KEY, epoch, db=tables.meta)
    return bytes(epoch)


def write(txn: lmdb.Transaction, db: Any, epoch: bytes, version_id: str,
          parts: tuple[bytes, bytes, bytes], payload: bytes) -> None:
    """Store ``payload`` for ``version_id`` in ``db``, bound to ``epoch`` (from
    :func:`writing_epoch`) and to the version's ``parts`` as the index holds them now
    (:meth:`VersionTables.parts`, read in the same transaction)."""
    key = version_id.encode()
    delete(txn, db, key)
    stamp = _stamp(epoch, parts)
    if len(payload) <= PIECE_BYTES and _piece_count(payload) is None:
        txn.put(key, stamp + payload, db=db)
        return
    pieces = range(0, len(payload), PIECE_BYTES)
    if len(pieces) >> 16:
        return  # more pieces than 2 bytes count: left unrecorded (only a help)
    for number, start in enumerate(pieces):
        txn.put(_piece_key(key, number), payload[start:start + PIECE_BYTES], db=db)
    txn.put(key, stamp + _IN_PIECES + len(pieces).to_bytes(2, "big"), db=db)


def delete(txn: lmdb.Transaction, db: Any, key: bytes) -> None:
    """Delete what ``db`` holds of the version of ``key`` (its pieces included)."""
    value = txn.get(key, db=db)
    if value is None:
        return
    count = _piece_count(bytes(value)[STAMP_BYTES:])
    for number in range(count or 0):
        txn.delete(_piece_key(key, number), db=db)
    txn.delete(key, db=db)
