"""Crafted entries in the index's derived tables (``census`` and ``verified``,
:mod:`chunkstore.index.derived`): a payload's own entry claiming no pieces or more than
are stored, an unknown mark after a verified count, and an entry stamped under another
index's epoch.  None is trusted: a quick verify reads such a version, a report counts it
from its manifests; and removing the version removes what there is of it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from chunkstore.format.digest import Digest
from chunkstore.index import derived
from chunkstore.index.lmdbindex import Index
from chunkstore.index.versiontables import VersionEntry

ENTRY = VersionEntry("c" * 63 + "7", "r", 1, 0.0, "00", None, 0, 0, 0, {})
CHUNK = Digest(bytes(range(32)))


@pytest.fixture
def index(tmp_path: Path) -> Iterator[Index]:
    opened = Index(str(tmp_path / "index"))
    try:
        opened.add_version(ENTRY, [CHUNK], {}, [], census=b"x" * 4000, built_entries=3)
        assert opened.census([ENTRY.id]) and opened.verified_versions([ENTRY.id])
        yield opened
    finally:
        opened.close()


def _put_head(index: Index, db: Any, after_stamp: bytes, epoch: bytes | None = None
              ) -> None:
    """Write the version's own entry in ``db``: a true stamp (of ``epoch``, the index's
    own by default) and ``after_stamp``."""
    tables = index._derived_tables()
    with index.env.begin(write=True) as txn:
        parts = tables.parts(txn, ENTRY.id.encode())
        assert parts is not None
        stamp = derived._stamp(epoch or derived.writing_epoch(txn, tables), parts)
        txn.put(ENTRY.id.encode(), stamp + after_stamp, db=db)


@pytest.mark.parametrize("pieces", [0, 1, 3, 65535])
def test_a_count_of_pieces_not_all_stored_is_not_trusted(index: Index, pieces: int) -> None:
    """Three pieces are stored (a 4,000-byte census); a head claiming 0, 1 (a part of
    the payload), 65,535 or a verified entry in pieces is trusted only as its pieces
    join into a payload of the table's form (a census shorter than it was written is
    refused by its own length check, :func:`~chunkstore.handle.censusrecord.parse`)."""
    head = b"\xffpieces" + pieces.to_bytes(2, "big")
    _put_head(index, index.census_db, head)
    _put_head(index, index.verified, head)
    assert index.verified_versions([ENTRY.id]) == {}
    census = index.census([ENTRY.id])
    assert census == ({ENTRY.id: b"x" * 4000} if pieces == 3 else
                      {ENTRY.id: b"x" * 1800} if pieces == 1 else {} if pieces > 3
                      else {ENTRY.id: b""})
    assert index.remove_version(ENTRY.id)
    with index.env.begin() as txn:
        assert txn.stat(index.verified)["entries"] == 0
        # the pieces its head counts go with it (those it does not count: crafted)
        assert txn.stat(index.census_db)["entries"] == max(3 - pieces, 0)


@pytest.mark.parametrize("mark", [b"", b"x", b"ss", b"s\x00"])
def test_a_verified_count_with_another_mark_is_not_trusted(index: Index, mark: bytes) -> None:
    _put_head(index, index.verified, (3).to_bytes(8, "big") + mark + b"?")
    assert index.verified_versions([ENTRY.id]) == {}


def test_an_entry_stamped_under_another_epoch_is_not_trusted(index: Index) -> None:
    _put_head(index, index.verified, (3).to_bytes(8, "big") + b"s", epoch=b"\x00" * 16)
    _put_head(index, index.census_db, b"\x02" * 40, epoch=b"\x00" * 16)
    assert index.verified_versions([ENTRY.id]) == {}
    assert index.census([ENTRY.id]) == {}
