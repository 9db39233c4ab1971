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
            found[version_id] = (value[STAMP_BYTES:], parts)
    return found


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
    txn.put(version_id.encode(), _stamp(epoch, parts) + payload, db=db)
