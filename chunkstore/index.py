"""The LMDB index: chunk records with refcounts, versions, tags, write sessions.

Everything here can be rebuilt from the manifests (``chunkstore index
rebuild``): the manifests are the truth, the index is the fast path.  All
mutations happen in LMDB write transactions, which serialise across threads
and processes, so a writer's dedup claim and a GC's condemnation of the same
chunk can never interleave.

Chunk states:

- ``WRITING``: claimed by a session that is writing the object; not yet a
  dedup target (the object may not be durable).
- ``LIVE``: the object is durable; a valid dedup target.
- ``CONDEMNED``: GC found it unreferenced past the grace period; a writer that
  wants it resurrects it (back to LIVE) in its claim transaction.
- ``DELETING``: GC is deleting the object; a writer waits for the record to go
  and then writes the chunk anew.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import lmdb

from chunkstore.digest import Digest
from chunkstore.errors import BackendError

INDEX_SCHEMA = 1
DEFAULT_MAP_SIZE = 1 << 36
_CHUNK = struct.Struct("<BBxxIQQd")


class ChunkState(IntEnum):
    WRITING = 0
    LIVE = 1
    CONDEMNED = 2
    DELETING = 3


class Claim(IntEnum):
    """What a session's claim on a chunk found."""

    DEDUP = 0  # durable object present: reference it, write nothing
    WRITE = 1  # absent or not yet durable: write it (put-if-absent)
    WAIT = 2  # GC is deleting it: retry shortly, then write


@dataclass(frozen=True)
class ChunkRecord:
    state: ChunkState
    codec_id: int
    refcount: int
    raw_length: int
    stored_length: int
    since: float  # when the state or refcount last changed to what it is

    def pack(self) -> bytes:
        return _CHUNK.pack(self.state, self.codec_id, self.refcount, self.raw_length,
                           self.stored_length, self.since)

    @classmethod
    def unpack(cls, data: bytes | memoryview) -> ChunkRecord:
        state, codec_id, refcount, raw, stored, since = _CHUNK.unpack(data)
        return cls(ChunkState(state), codec_id, refcount, raw, stored, since)


@dataclass(frozen=True)
class NewChunk:
    """A chunk a session wrote: what the commit records about it."""

    digest: Digest
    codec_id: int
    raw_length: int
    stored_length: int


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


class Index:
    """One LMDB environment; safe to share between threads and processes."""

    def __init__(self, path: str, map_size: int = DEFAULT_MAP_SIZE) -> None:
        os.makedirs(path, exist_ok=True)
        self.path = path
        try:
            # metasync=False: each commit still flushes the data pages, and a
            # system crash can at worst undo the last transaction, never
            # corrupt the tree; the index is rebuildable from the manifests.
            self.env = lmdb.open(path, map_size=map_size, max_dbs=12, metasync=False,
                                 max_readers=256)
        except lmdb.Error as exc:
            raise BackendError(f"cannot open the index at {path}: {exc};"
                               " run `chunkstore index rebuild`") from exc
        self.chunks = self.env.open_db(b"chunks")
        self.nodes = self.env.open_db(b"nodes")
        self.versions_db = self.env.open_db(b"versions")
        self.refs = self.env.open_db(b"refs")
        self.tags_db = self.env.open_db(b"tags")
        self.sessions = self.env.open_db(b"sessions")
        self.claims = self.env.open_db(b"claims")  # digest + session id
        self.session_claims = self.env.open_db(b"session_claims")  # session id + digest
        self.meta = self.env.open_db(b"meta")

    def close(self) -> None:
        self.env.close()

    def sync(self) -> None:
        self.env.sync(True)

    # --- chunks --------------------------------------------------------------------------

    def chunk(self, digest: Digest) -> ChunkRecord | None:
        with self.env.begin(db=self.chunks) as txn:
            data = txn.get(digest.raw)
        return ChunkRecord.unpack(data) if data else None

    def iter_chunks(self) -> Iterator[tuple[Digest, ChunkRecord]]:
        with self.env.begin(db=self.chunks) as txn:
            for key, value in txn.cursor():
                yield Digest(bytes(key)), ChunkRecord.unpack(value)

    def claim_chunk(self, session_id: str, digest: Digest) -> Claim:
        """Record that the session uses ``digest`` and say whether to write it."""
        sid = session_id.encode()
        with self.env.begin(write=True) as txn:
            data = txn.get(digest.raw, db=self.chunks)
            record = ChunkRecord.unpack(data) if data else None
            if record is not None and record.state == ChunkState.DELETING:
                return Claim.WAIT
            txn.put(digest.raw + sid, b"", db=self.claims)
            txn.put(sid + digest.raw, b"", db=self.session_claims)
            if record is None:
                fresh = ChunkRecord(ChunkState.WRITING, 0, 0, 0, 0, time.time())
                txn.put(digest.raw, fresh.pack(), db=self.chunks)
                return Claim.WRITE
            if record.state == ChunkState.CONDEMNED:
                # Resurrect under this transaction: GC re-checks the state
                # before deleting, so it will now leave the chunk alone.
                revived = ChunkRecord(ChunkState.LIVE, record.codec_id, record.refcount,
                                      record.raw_length, record.stored_length, time.time())
                txn.put(digest.raw, revived.pack(), db=self.chunks)
                return Claim.DEDUP
            return Claim.DEDUP if record.state == ChunkState.LIVE else Claim.WRITE

    def is_claimed(self, digest: Digest) -> bool:
        with self.env.begin(db=self.claims) as txn:
            cursor = txn.cursor()
            return cursor.set_range(digest.raw) and bytes(cursor.key()).startswith(digest.raw)

    # --- nodes ---------------------------------------------------------------------------

    def has_node(self, digest: Digest) -> bool:
        with self.env.begin(db=self.nodes) as txn:
            return txn.get(digest.raw) is not None

    # --- sessions ------------------------------------------------------------------------

    def open_session(self, purpose: str) -> str:
        session_id = uuid.uuid4().hex
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                "purpose": purpose}
        with self.env.begin(write=True, db=self.sessions) as txn:
            txn.put(session_id.encode(), json.dumps(info).encode())
        return session_id

    def list_sessions(self) -> dict[str, dict[str, Any]]:
        with self.env.begin(db=self.sessions) as txn:
            return {bytes(k).decode(): json.loads(v) for k, v in txn.cursor()}

    def _drop_session(self, txn: lmdb.Transaction, session_id: str) -> None:
        sid = session_id.encode()
        cursor = txn.cursor(db=self.session_claims)
        digests = []
        if cursor.set_range(sid):
            for key in cursor.iternext(values=False):
                if not bytes(key).startswith(sid):
                    break
                digests.append(bytes(key)[len(sid):])
        for raw in digests:
            txn.delete(sid + raw, db=self.session_claims)
            txn.delete(raw + sid, db=self.claims)
        txn.delete(sid, db=self.sessions)

    def close_session(self, session_id: str) -> None:
        """Forget a session's claims (abort, or after its commit transaction)."""
        with self.env.begin(write=True) as txn:
            self._drop_session(txn, session_id)

    # --- versions ------------------------------------------------------------------------

    def add_version(self, entry: VersionEntry, refs: Iterable[Digest], nodes: dict[Digest, int],
                    new_chunks: Iterable[NewChunk], session_id: str | None = None) -> None:
        """Count one version in: its chunks' refcounts, nodes, and the chunks it wrote."""
        now = time.time()
        with self.env.begin(write=True) as txn:
            if txn.get(entry.id.encode(), db=self.versions_db) is not None:
                if session_id:
                    self._drop_session(txn, session_id)
                return
            for chunk in new_chunks:
                rec = ChunkRecord(ChunkState.LIVE, chunk.codec_id, 0, chunk.raw_length,
                                  chunk.stored_length, now)
                old = txn.get(chunk.digest.raw, db=self.chunks)
                if old is None or ChunkRecord.unpack(old).state == ChunkState.WRITING:
                    txn.put(chunk.digest.raw, rec.pack(), db=self.chunks)
            ref_list = sorted(set(refs))
            for digest in ref_list:
                self._bump(txn, digest, +1, now)
            for digest, size in nodes.items():
                txn.put(digest.raw, struct.pack("<Q", size), db=self.nodes)
            txn.put(entry.id.encode(), entry.to_json(), db=self.versions_db)
            txn.put(entry.id.encode(), b"".join(d.raw for d in ref_list), db=self.refs)
            if session_id:
                self._drop_session(txn, session_id)

    def remove_version(self, version_id: str) -> bool:
        """Count a version out; return whether the index knew it."""
        now = time.time()
        key = version_id.encode()
        with self.env.begin(write=True) as txn:
            if txn.get(key, db=self.versions_db) is None:
                return False
            refs = bytes(txn.get(key, db=self.refs) or b"")
            for i in range(0, len(refs), 32):
                self._bump(txn, Digest(refs[i:i + 32]), -1, now)
            txn.delete(key, db=self.versions_db)
            txn.delete(key, db=self.refs)
            for tag, target in list(txn.cursor(db=self.tags_db)):
                if bytes(target) == key:
                    txn.delete(bytes(tag), db=self.tags_db)
        return True

    def _bump(self, txn: lmdb.Transaction, digest: Digest, delta: int, now: float) -> None:
        data = txn.get(digest.raw, db=self.chunks)
        if data is None:
            # A chunk known only from a manifest (e.g. during rebuild): its
            # size is filled in when the store stats it.
            rec = ChunkRecord(ChunkState.LIVE, 0, 0, 0, 0, now)
        else:
            rec = ChunkRecord.unpack(data)
        count = max(rec.refcount + delta, 0)
        state = ChunkState.LIVE if rec.state != ChunkState.DELETING else rec.state
        since = now if count == 0 or rec.refcount == 0 else rec.since
        new = ChunkRecord(state, rec.codec_id, count, rec.raw_length, rec.stored_length, since)
        txn.put(digest.raw, new.pack(), db=self.chunks)

    def version(self, version_id: str) -> VersionEntry | None:
        with self.env.begin(db=self.versions_db) as txn:
            data = txn.get(version_id.encode())
        return VersionEntry.from_json(data) if data else None

    def versions(self) -> list[VersionEntry]:
        with self.env.begin(db=self.versions_db) as txn:
            entries = [VersionEntry.from_json(v) for _, v in txn.cursor()]
        return sorted(entries, key=lambda e: (e.created, e.id))

    def version_refs(self, version_id: str) -> list[Digest]:
        with self.env.begin(db=self.refs) as txn:
            refs = bytes(txn.get(version_id.encode()) or b"")
        return [Digest(refs[i:i + 32]) for i in range(0, len(refs), 32)]

    # --- tags ----------------------------------------------------------------------------

    def set_tag(self, tag: str, version_id: str) -> None:
        with self.env.begin(write=True, db=self.tags_db) as txn:
            txn.put(tag.encode(), version_id.encode())

    def delete_tag(self, tag: str) -> bool:
        with self.env.begin(write=True, db=self.tags_db) as txn:
            return bool(txn.delete(tag.encode()))

    def tags(self) -> dict[str, str]:
        with self.env.begin(db=self.tags_db) as txn:
            return {bytes(k).decode(): bytes(v).decode() for k, v in txn.cursor()}

    # --- whole-index operations ----------------------------------------------------------

    def clear(self) -> None:
        """Drop every record (the first step of a rebuild)."""
        with self.env.begin(write=True) as txn:
            for db in (self.chunks, self.nodes, self.versions_db, self.refs, self.tags_db,
                       self.sessions, self.claims, self.session_claims):
                txn.drop(db, delete=False)

    def put_chunk_record(self, digest: Digest, record: ChunkRecord) -> None:
        with self.env.begin(write=True, db=self.chunks) as txn:
            txn.put(digest.raw, record.pack())

    def node_bytes(self) -> int:
        with self.env.begin(db=self.nodes) as txn:
            return sum(struct.unpack("<Q", v)[0] for _, v in txn.cursor())
