"""The index's version tables: the entries by id, and two orders over them.

A save asks the index three things about its run: the newest version (the parent,
and what the delta learner reads), the versions of its ``RUN@STEP`` (a step saved
before, or replaced), and nothing else.  Answered from a listing of every version,
each of those cost a JSON decode per version in the store, three times per save
(296,000 decodes for 50 saves at 2,000 versions, issue 49): a job's saving cost
grew with its history.  So the index keeps, beside ``versions`` (id -> entry):

- ``versions_by_run``: run, NUL, step (8 bytes big-endian), creation time (8
  bytes, ordered as the float is), id -> empty.  Its order within a run is the
  order :meth:`~chunkstore.handle.handle.StoreHandle.versions` gives a run's
  versions (step, then creation time, then id), so a run's newest version, the
  versions of one ``RUN@STEP`` and a run's newest N are each one cursor seek; run
  names (letters, digits, ``_.+=-``) hold no NUL, so each run's keys are one
  contiguous range, and the next run is a seek past it;
- ``versions_by_time``: creation time, id -> empty: the store's newest version
  (``latest``) by the order of a listing of every version (time, then id).

Both are written in the write transaction that writes or deletes the entry
(:meth:`~chunkstore.index.lmdbindex.Index.add_version`, ``remove_version``),
whatever counts a version in or out (a save, ``reconcile`` for what other indexes
and processes did, a rebuild), so a reader in any process sees the three tables
agree.  They are derived from ``versions`` alone: an index of an earlier schema
gets them where it is opened (:func:`fill`).  A reader that finds the counts of
the three tables differ (an older release, which knows only ``versions``, wrote
into this index since) answers from ``versions`` itself (:func:`in_step`), until
the next open migrates the index again.
"""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import lmdb

log = logging.getLogger("chunkstore.index.lmdbindex")  # the index's own voice


@dataclass(frozen=True)
class VersionEntry:
    id: str
    run: str
    step: int
    created: float
    root: str
    parent: str | None
    logical_bytes: int
    new_bytes: int
    new_stored_bytes: int
    meta: dict[str, Any]

    def to_json(self) -> bytes:
        return json.dumps(self.__dict__, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> VersionEntry:
        return cls(**json.loads(data))


_STEP = struct.Struct(">Q")
_BITS = struct.Struct(">Q")
_FLOAT = struct.Struct(">d")
_SIGN = 1 << 63
_ALL = (1 << 64) - 1
#: The highest step a key holds (a record's is at most 2**63 - 1).
_LAST_STEP = (1 << 64) - 1
#: Bytes of a ``versions_by_run`` key after the run's NUL: step, then time.
_ORDER_BYTES = 16


def time_key(created: float) -> bytes:
    """``created`` as 8 bytes that sort as the floats do (negative ones included)."""
    bits = _BITS.unpack(_FLOAT.pack(created))[0]
    return _BITS.pack(bits ^ _ALL if bits & _SIGN else bits | _SIGN)


def names_a_run(run: str) -> bool:
    """Whether ``run`` can have keys (a NUL, never in a run name, ends a key's run)."""
    return "\0" not in run


def run_prefix(run: str) -> bytes:
    """What every key of ``run`` starts with."""
    return run.encode() + b"\0"


def step_prefix(run: str, step: int) -> bytes:
    return run_prefix(run) + _STEP.pack(step)


def by_run_key(run: str, step: int, created: float, version_id: str) -> bytes:
    return step_prefix(run, step) + time_key(created) + version_id.encode()


def by_time_key(created: float, version_id: str) -> bytes:
    return time_key(created) + version_id.encode()


def id_of_run_key(key: bytes) -> str:
    run_end = key.index(b"\0")
    return key[run_end + 1 + _ORDER_BYTES:].decode()


def put(txn: lmdb.Transaction, tables: tuple[Any, Any], entry: VersionEntry) -> None:
    """Add ``entry`` to both orders."""
    by_run, by_time = tables
    txn.put(by_run_key(entry.run, entry.step, entry.created, entry.id), b"", db=by_run)
    txn.put(by_time_key(entry.created, entry.id), b"", db=by_time)


def delete(txn: lmdb.Transaction, tables: tuple[Any, Any], entry: VersionEntry) -> None:
    """Take ``entry`` out of both orders."""
    by_run, by_time = tables
    txn.delete(by_run_key(entry.run, entry.step, entry.created, entry.id), db=by_run)
    txn.delete(by_time_key(entry.created, entry.id), db=by_time)


def in_step(txn: lmdb.Transaction, versions: Any, tables: tuple[Any, Any]) -> bool:
    """Whether both orders hold as many keys as ``versions`` holds entries (a
    constant-time check: LMDB keeps each table's count)."""
    count = txn.stat(versions)["entries"]
    return all(txn.stat(table)["entries"] == count for table in tables)


def prefixed(txn: lmdb.Transaction, table: Any, prefix: bytes, *,
             newest_first: bool = False) -> Iterator[bytes]:
    """The keys of ``table`` that start with ``prefix``, in key order or (``newest_first``)
    the reverse, found by a seek, never a scan of the table."""
    cursor = txn.cursor(db=table)
    if not newest_first:
        if not cursor.set_range(prefix):
            return
        for key in cursor.iternext(values=False):
            raw = bytes(key)
            if not raw.startswith(prefix):
                return
            yield raw
        return
    # The first key past every key with the prefix, then step back.
    after = _after(prefix)
    found = cursor.set_range(after) if after is not None else False
    moved = cursor.prev() if found else cursor.last()
    if not moved:
        return
    for key in cursor.iterprev(values=False):
        raw = bytes(key)
        if not raw.startswith(prefix):
            return
        yield raw


def _after(prefix: bytes) -> bytes | None:
    """The least key greater than every key that starts with ``prefix`` (None: none)."""
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return None
    return stripped[:-1] + bytes([stripped[-1] + 1])


def run_names(txn: lmdb.Transaction, by_run: Any) -> Iterator[str]:
    """Every run, in order: one seek per run, past the run's keys."""
    cursor = txn.cursor(db=by_run)
    if not cursor.first():
        return
    while True:
        key = bytes(cursor.key())
        run = key[:key.index(b"\0")]
        yield run.decode()
        if not cursor.set_range(run + b"\x01"):
            return


def fill(txn: lmdb.Transaction, versions: Any, tables: tuple[Any, Any]) -> None:
    """Make both orders afresh from ``versions`` (a migration, or a repair): emptied
    first, as a release that knew only ``versions`` may have left them stale."""
    for table in tables:
        txn.drop(table, delete=False)
    for _, value in txn.cursor(db=versions):
        put(txn, tables, VersionEntry.from_json(bytes(value)))


class VersionLookups:
    """The index's questions about versions (a part of
    :class:`~chunkstore.index.lmdbindex.Index`, which opens the tables): by id, and in
    the orders, each a seek."""

    env: lmdb.Environment
    path: str
    versions_db: Any
    versions_by_run: Any
    versions_by_time: Any
    _warned_orders: bool

    def _orders(self) -> tuple[Any, Any]:
        return self.versions_by_run, self.versions_by_time

    def version(self, version_id: str) -> VersionEntry | None:
        with self.env.begin(db=self.versions_db) as txn:
            data = txn.get(version_id.encode())
        return VersionEntry.from_json(data) if data else None

    def versions(self) -> list[VersionEntry]:
        """Every version, oldest first (by time, then id): a decode of each."""
        with self.env.begin(db=self.versions_db) as txn:
            entries = [VersionEntry.from_json(v) for _, v in txn.cursor()]
        return sorted(entries, key=lambda e: (e.created, e.id))

    def version_ids(self) -> set[str]:
        """The id of every version (no entry decoded)."""
        with self.env.begin(db=self.versions_db) as txn:
            return {bytes(k).decode() for k in txn.cursor().iternext(values=False)}

    def held_version_ids(self, version_ids: Iterable[str]) -> set[str]:
        """Those of ``version_ids`` this index holds, in one read (no entry decoded)."""
        with self.env.begin(db=self.versions_db) as txn:
            return {vid for vid in version_ids if txn.get(vid.encode()) is not None}

    def version_ids_since(self, created: float) -> set[str] | None:
        """The ids of the versions created at or after ``created``, by a seek; None where
        the order by time does not hold every version (:meth:`_orders_in_step`)."""
        with self.env.begin() as txn:
            if not self._orders_in_step(txn):
                return None
            cursor = txn.cursor(db=self.versions_by_time)
            if not cursor.set_range(time_key(created)):
                return set()
            return {bytes(key)[8:].decode() for key in cursor.iternext(values=False)}

    def versions_with_prefix(self, prefix: str) -> list[VersionEntry]:
        """The versions whose id starts with ``prefix``, by a seek."""
        with self.env.begin() as txn:
            return self._entries(txn, (key.decode() for key in prefixed(
                txn, self.versions_db, prefix.encode())))

    # --- versions in order: seeks, not listings --------------------------------------------

    def latest_version(self, run: str | None = None) -> VersionEntry | None:
        """The newest version: of ``run`` by step (then time, id), else of the store by
        time (then id), as the last of :meth:`run_versions` or :meth:`versions`."""
        found = self.newest_versions(run, 1)
        return found[0] if found else None

    def version_count(self, run: str | None = None) -> int:
        """How many versions the store (or ``run``) holds: LMDB's own count for the store,
        a walk over the run's keys (no entry decoded) for a run."""
        if run is not None and not names_a_run(run):
            return 0
        with self.env.begin() as txn:
            if run is None:
                return int(txn.stat(self.versions_db)["entries"])
            if not self._orders_in_step(txn):
                return len(self._listed(txn, run))
            return sum(1 for _ in prefixed(txn, self.versions_by_run, run_prefix(run)))

    def newest_versions(self, run: str | None, count: int | None) -> list[VersionEntry]:
        """The ``count`` newest versions of ``run`` (None: of the store), newest first;
        every one with ``count`` None.  Only the entries returned are decoded."""
        if run is not None and not names_a_run(run):
            return []
        with self.env.begin() as txn:
            if not self._orders_in_step(txn):
                listed = self._listed(txn, run)
                return listed[::-1][:count]
            if run is None:
                keys = prefixed(txn, self.versions_by_time, b"", newest_first=True)
                ids = (key[8:].decode() for key in keys)
            else:
                keys = prefixed(txn, self.versions_by_run, run_prefix(run),
                                newest_first=True)
                ids = (id_of_run_key(key) for key in keys)
            return self._entries(txn, ids, count)

    def run_versions(self, run: str, step: int | None = None) -> list[VersionEntry]:
        """The versions of ``run`` (of ``RUN@STEP`` with ``step``), oldest first: by
        step, then time, then id."""
        if not names_a_run(run) or (step is not None and not 0 <= step <= _LAST_STEP):
            return []
        with self.env.begin() as txn:
            if not self._orders_in_step(txn):
                return [e for e in self._listed(txn, run) if step is None or e.step == step]
            prefix = run_prefix(run) if step is None else step_prefix(run, step)
            return self._entries(txn, (id_of_run_key(key) for key in
                                       prefixed(txn, self.versions_by_run, prefix)))

    def runs(self) -> list[str]:
        """Every run with a version, sorted: a seek per run."""
        with self.env.begin() as txn:
            if not self._orders_in_step(txn):
                return sorted({e.run for e in self._listed(txn, None)})
            return list(run_names(txn, self.versions_by_run))

    def _orders_in_step(self, txn: lmdb.Transaction) -> bool:
        """Whether the orders hold what ``versions`` holds; else (an older release wrote
        into this index since it was opened) the answers come from a listing, said once."""
        if in_step(txn, self.versions_db, self._orders()):
            return True
        if not self._warned_orders:
            self._warned_orders = True
            log.warning("the index at %s holds versions its orders by run and time lack (an"
                        " older release wrote into it?): versions are looked up by listing"
                        " them until the index is opened again", self.path)
        return False

    def _entries(self, txn: lmdb.Transaction, ids: Iterable[str], count: int | None = None
                 ) -> list[VersionEntry]:
        """The entries of ``ids`` (the first ``count``), read in ``txn``."""
        found: list[VersionEntry] = []
        for version_id in ids:
            if count is not None and len(found) >= count:
                break
            data = txn.get(version_id.encode(), db=self.versions_db)
            if data is not None:  # the orders agree with the entries (in_step)
                found.append(VersionEntry.from_json(bytes(data)))
        return found

    def _listed(self, txn: lmdb.Transaction, run: str | None) -> list[VersionEntry]:
        """What the orders answer, from the entries themselves: the orders lag them
        (an older release wrote into this index; the next open migrates it again)."""
        entries = [VersionEntry.from_json(bytes(v)) for _, v in txn.cursor(db=self.versions_db)]
        if run is None:
            return sorted(entries, key=lambda e: (e.created, e.id))
        return sorted((e for e in entries if e.run == run),
                      key=lambda e: (e.step, e.created, e.id))
