"""The store config object and commit records (see docs/format.md)."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Any

from chunkstore.errors import (
    CorruptConfigError,
    CorruptRecordError,
    CorruptTagError,
    FormatVersionError,
    InvalidNameError,
    NotAStoreError,
)
from chunkstore.format import plaindata
from chunkstore.format.digest import Digest, is_hex_digest
from chunkstore.format.manifest import MAX_DELTA_DEPTH, exact_int, is_version
from chunkstore.format.names import check_label

STORE_FORMAT = "chunkstore"
STORE_FORMAT_VERSION = 9
#: Store versions this release reads: 2 is 1 plus the keys of docs/format.md §11
#: (save sessions, the GC journal, tombstones), which every writer must honour; 3 adds
#: ``delta_depth`` (stores of versions 1 and 2 get no deltas); 4 adds packs of small
#: chunks (chunk format 3, node format 3), which a release reading only 3 would not
#: find the members of; 5 adds tree nodes with inlined subtrees (node format 4), which
#: a release reading only 4 could not mark; 6 adds moved records of repacked packs
#: (docs/format.md §3.6), without which a release reading only 5 would not find the
#: members of a pack GC deleted after copying them; 7 adds sub-delta chunks (chunk format
#: 4), which a release reading only 6 could not decode; 8 adds packed delta chunks and
#: packed bases (chunk format 5, node format 5), which a release reading only 7 would
#: refuse, and whose GC could not mark the packs a chain needs; 9 adds sparse-delta
#: chunks (chunk format 6), which a release reading only 8 could not decode.
#: 10 is 9 encrypted (docs/format.md §13): only an encrypted store is of version 10, so
#: a release that cannot decrypt refuses it rather than reading ciphertext as objects;
#: unencrypted stores stay at 9.  11 is 9 or 10 with legal holds (``holds/``,
#: docs/format.md §15): a store is upgraded to it before its first hold object is
#: written, so that a release that does not honour holds refuses it rather than remove
#: a held version; its config has an ``encryption`` field exactly when the store is
#: encrypted.  12 is 11 encrypted with the sealing of docs/format.md §13.3 that binds
#: every segment to one write (a salt per write) and keyed node ids (§13.4); stores of
#: 10 (and 11 encrypted) keep their sealing, read and written as before
#: (:attr:`Encryption.sealing` 1).  13 is 12 with each pack member sealed on its own
#: (docs/format.md §13.6): pack locations and moved records count stored bytes, which a
#: release reading only 12 would take for the encoding's.  Every new encrypted store is
#: of version 13, held or not; stores of 12 keep sealing 2, read and written as before.
FIRST_ENCRYPTED_STORE_FORMAT_VERSION = 10
HOLDS_STORE_FORMAT_VERSION = 11
SALTED_STORE_FORMAT_VERSION = 12
MEMBERS_STORE_FORMAT_VERSION = 13
#: The store version of a new encrypted store (its sealing: :data:`NEW_SEALING`).
ENCRYPTED_STORE_FORMAT_VERSION = MEMBERS_STORE_FORMAT_VERSION
STORE_FORMAT_VERSIONS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13)
#: The store version of each sealing (docs/format.md §13.1): 2 and 3 only ever that one.
SEALING_STORE_VERSIONS = {2: SALTED_STORE_FORMAT_VERSION, 3: MEMBERS_STORE_FORMAT_VERSION}
#: The sealing of a new encrypted store.
NEW_SEALING = 3
READABLE_STORE_VERSIONS = STORE_FORMAT_VERSIONS
RECORD_FORMAT = "chunkstore.version"
RECORD_FORMAT_VERSION = 1
DEFAULT_CHUNK_SIZE = 4 * 1024 * 1024
MIN_CHUNK_SIZE = 4096
MAX_CHUNK_SIZE = 256 * 1024 * 1024
MAX_COUNT = 2**63 - 1  # steps and byte counts of a record
#: Chain depth of new stores: a cap only.  What bounds a chain is its stored bytes
#: (chunkstore.write.delta.CHAIN_BYTES: a base is used while its chain stores at most
#: twice the chunk's raw bytes), so dense updates, whose deltas store most of a full
#: copy, still start over after 2 links, and sparse ones, whose sparse-delta links
#: store a tenth of it and cost a reader what changed, go ten or more deep.  Measured
#: on the suite's sparse-embedding workload (10 versions, 9% of rows touched per save;
#: the worker of benchmarks.suite on a recorded trace): at a fixed depth of 2 the
#: store held 1,016.9 MB after 10 versions (3.77x the touched rows per later
#: version), at 16 with the byte bound 452.0 MB (1.10x); restoring the newest
#: version then reads a chain of 9 (0.29 s against 0.11 s for the oldest).  A store
#: keeps the depth it was created with; 0 turns deltas off.
DEFAULT_DELTA_DEPTH = 16


def _dumps(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode("utf-8")


#: The ciphers, chunk id schemes and key derivations an encrypted store's config may name.
CIPHERS = ("aes-256-gcm",)
CHUNK_ID_SCHEMES = ("blake3-keyed",)
#: The segment sizes a reader accepts (bounds what one segment read allocates).
MIN_SEGMENT_SIZE, MAX_SEGMENT_SIZE = 4096, 16 * 1024 * 1024
#: The segment size of new encrypted stores (chunkstore.objects.crypto).
SEGMENT_SIZE = 64 * 1024


@dataclass(frozen=True)
class Encryption:
    """How an encrypted store seals its objects (its config's ``encryption``, §13)."""

    cipher: str = "aes-256-gcm"
    segment_size: int = SEGMENT_SIZE
    chunk_ids: str = "blake3-keyed"
    #: 3 (store version 13): as 2, and each pack member sealed on its own; 2 (store
    #: version 12): a salt per write in every segment, node ids keyed; 1 (store versions
    #: 10 and 11): neither.  Said by the store version, not by this block.
    sealing: int = NEW_SEALING

    def encode(self) -> dict[str, Any]:
        return {"cipher": self.cipher, "segment_size": self.segment_size,
                "chunk_ids": self.chunk_ids, "keys": "keys/"}

    @property
    def keyed_nodes(self) -> bool:
        """Whether node ids are keyed like chunk ids (docs/format.md §13.4)."""
        return self.sealing >= 2

    @classmethod
    def decode(cls, obj: object, sealing: int = NEW_SEALING) -> Encryption:
        """``ValueError`` for a block this release cannot read; a cipher or scheme it
        does not know is a newer store's (``FormatVersionError``)."""
        if not isinstance(obj, dict):
            raise ValueError(f"encryption is {obj!r}, not an object")
        cipher, ids = obj.get("cipher"), obj.get("chunk_ids")
        if cipher not in CIPHERS or ids not in CHUNK_ID_SCHEMES:
            raise FormatVersionError("store encryption", f"{cipher}/{ids}",
                                     f"{'/'.join(CIPHERS)} with {'/'.join(CHUNK_ID_SCHEMES)}")
        size = exact_int(obj.get("segment_size"), "segment_size", MIN_SEGMENT_SIZE,
                         MAX_SEGMENT_SIZE)
        return cls(cipher, size, ids, sealing)


@dataclass(frozen=True)
class StoreConfig:
    chunk_size: int
    compression: str
    created: float
    #: the longest delta chain a writer builds (0: no deltas; stores of versions 1 and 2)
    delta_depth: int = DEFAULT_DELTA_DEPTH
    #: The store version found (a store this release creates or upgrades is the current one).
    format_version: int = STORE_FORMAT_VERSION
    #: how the store is encrypted (None: it is not; docs/format.md §13)
    encryption: Encryption | None = None

    def identity(self) -> str:
        """What tells this store from another at the same location: its creation time,
        to the precision it was written with (a store deleted and created again has
        another; an upgrade keeps it)."""
        return f"created {self.created!r}"

    def encode(self) -> bytes:
        """The config as this release writes it: the current store version, or
        :data:`HOLDS_STORE_FORMAT_VERSION` for a store that has it (holds, plain or of
        sealing 1); an encrypted store of sealing 2 is always
        :data:`ENCRYPTED_STORE_FORMAT_VERSION`, one of sealing 1
        :data:`FIRST_ENCRYPTED_STORE_FORMAT_VERSION` until its first hold."""
        body = {"format": STORE_FORMAT, "format_version": STORE_FORMAT_VERSION,
                "chunk_size": self.chunk_size, "compression": self.compression,
                "created": self.created, "delta_depth": self.delta_depth}
        if self.encryption is not None:
            body["format_version"] = FIRST_ENCRYPTED_STORE_FORMAT_VERSION
            body["encryption"] = self.encryption.encode()
        if self.format_version >= HOLDS_STORE_FORMAT_VERSION:
            body["format_version"] = HOLDS_STORE_FORMAT_VERSION
        if self.encryption is not None and self.encryption.sealing >= 2:
            body["format_version"] = SEALING_STORE_VERSIONS[self.encryption.sealing]
        return _dumps(body)

    @classmethod
    def decode(cls, url: str, data: bytes) -> StoreConfig:
        """Parse ``chunkstore.json``: ``NotAStoreError`` for another file,
        ``FormatVersionError`` for a newer store, ``CorruptConfigError`` for a damaged one."""
        try:
            obj = plaindata.load_json(data)
        except ValueError as exc:
            raise NotAStoreError(url, f"chunkstore.json is not valid JSON: {exc}") from exc
        if not isinstance(obj, dict):
            raise NotAStoreError(url, "chunkstore.json is not valid JSON for a config (not an"
                                 " object)")
        if obj.get("format") != STORE_FORMAT:
            raise NotAStoreError(url, "chunkstore.json names another format")
        version = next((v for v in STORE_FORMAT_VERSIONS
                        if is_version(obj.get("format_version"), v)), None)
        if version is None:
            raise FormatVersionError("store", obj.get("format_version"), STORE_FORMAT_VERSION)
        try:
            chunk_size = exact_int(obj.get("chunk_size"), "chunk_size", MIN_CHUNK_SIZE,
                                   MAX_CHUNK_SIZE)
            if chunk_size % 64:
                raise ValueError(f"chunk_size {chunk_size} is not a multiple of 64")
            compression = obj.get("compression")
            if not (isinstance(compression, str) and plaindata.is_unicode(compression)):
                raise ValueError(f"compression is {compression!r}, not a policy name")
            depth = 0 if version < 3 else exact_int(obj.get("delta_depth"), "delta_depth",
                                                    0, MAX_DELTA_DEPTH)
            encryption = None
            sealings = {v: sealing for sealing, v in SEALING_STORE_VERSIONS.items()}
            if version == FIRST_ENCRYPTED_STORE_FORMAT_VERSION or version in sealings or (
                    version == HOLDS_STORE_FORMAT_VERSION and "encryption" in obj):
                encryption = Encryption.decode(obj.get("encryption"), sealings.get(version, 1))
            elif "encryption" in obj:
                raise ValueError(f"format_version {version} has no encryption")
            return cls(chunk_size, compression, _time(obj.get("created"), "created"), depth,
                       version, encryption)
        except ValueError as exc:
            raise CorruptConfigError(url, str(exc)) from exc


def _time(value: object, what: str) -> float:
    """A finite JSON number (seconds since the epoch)."""
    if type(value) not in (int, float):
        raise ValueError(f"{what} must be a number, not {value!r}")
    try:
        seconds = float(value)  # type: ignore[arg-type]
    except OverflowError:  # an integer beyond the float range
        seconds = math.inf
    if not math.isfinite(seconds):
        raise ValueError(f"{what} must be a finite number of seconds")
    return seconds


@dataclass(frozen=True)
class CommitRecord:
    """What a version is: its root node, run, step, parent and statistics."""

    run: str
    step: int
    parent: str | None
    created: float
    root: Digest
    meta: dict[str, Any]
    logical_bytes: int
    new_bytes: int
    new_stored_bytes: int

    def encode(self) -> tuple[str, bytes]:
        """Return (version id, record bytes); the id is the BLAKE3 of the bytes."""
        data = _dumps({
            "format": RECORD_FORMAT, "format_version": RECORD_FORMAT_VERSION,
            "run": self.run, "step": self.step, "parent": self.parent,
            "created": self.created, "root": self.root.hex,
            "meta": plaindata.to_tree(self.meta),
            "logical_bytes": self.logical_bytes, "new_bytes": self.new_bytes,
            "new_stored_bytes": self.new_stored_bytes,
        })
        return Digest.of(data).hex, data

    @classmethod
    def decode(cls, version_id: str, data: bytes) -> CommitRecord:
        """Parse and check a commit record; every failure is a typed error."""
        if Digest.of(data).hex != version_id:
            raise CorruptRecordError(version_id, "content does not match its version id")
        try:
            obj = plaindata.load_json(data)
        except ValueError as exc:
            raise CorruptRecordError(version_id, f"not valid JSON: {exc}") from exc
        if not isinstance(obj, dict) or obj.get("format") != RECORD_FORMAT:
            found = obj.get("format") if isinstance(obj, dict) else type(obj).__name__
            raise CorruptRecordError(version_id, f"format is {found!r}")
        if not is_version(obj.get("format_version"), RECORD_FORMAT_VERSION):
            raise FormatVersionError(f"version {version_id[:12]}", obj.get("format_version"),
                                     RECORD_FORMAT_VERSION)
        try:
            return cls._from_json(obj)
        except (InvalidNameError, ValueError) as exc:
            raise CorruptRecordError(version_id, f"missing or malformed field: {exc}") from exc

    @classmethod
    def _from_json(cls, obj: dict[str, Any]) -> CommitRecord:
        parent = obj.get("parent")
        if parent is not None and not (isinstance(parent, str) and is_hex_digest(parent)):
            raise ValueError(f"parent is {parent!r}, not a version id or null")
        root = obj.get("root")
        if not (isinstance(root, str) and is_hex_digest(root)):
            raise ValueError(f"root is {root!r}, not a digest")
        meta = plaindata.from_tree(obj.get("meta"))
        if not isinstance(meta, dict):
            raise ValueError(f"meta is a {type(meta).__name__}, not a dict")
        def count(field: str) -> int:
            return exact_int(obj.get(field), field, high=MAX_COUNT)

        return cls(
            run=check_label(obj.get("run")), step=count("step"), parent=parent,
            created=_time(obj.get("created"), "created"), root=Digest.parse(root), meta=meta,
            logical_bytes=count("logical_bytes"), new_bytes=count("new_bytes"),
            new_stored_bytes=count("new_stored_bytes"),
        )


@dataclass(frozen=True)
class Tag:
    """What ``tags/<name>`` holds: the version it names and when it was set."""

    name: str
    version: str
    created: float

    def encode(self) -> bytes:
        # Tags are mutable pointers: Python's default json.dumps, not canonical JSON.
        return json.dumps({"version": self.version, "created": self.created}).encode()

    @classmethod
    def decode(cls, name: str, data: bytes) -> Tag:
        """Parse a tag object; ``CorruptTagError`` for anything a writer would not write."""
        try:
            check_label(name, "tag")
            if looks_like_a_version_id(name):  # it would shadow the version it names
                raise ValueError("the name looks like a version id (no writer makes one)")
            obj = plaindata.load_json(data)
            if not isinstance(obj, dict):
                raise ValueError("not a JSON object")
            version = obj.get("version")
            if not (isinstance(version, str) and is_hex_digest(version)):
                raise ValueError(f"version is {version!r}, not a version id")
            return cls(name, version, _time(obj.get("created"), "created"))
        except (InvalidNameError, ValueError) as exc:
            raise CorruptTagError(name, str(exc)) from exc


#: The fewest hex characters a version id prefix has, as a selector.
MIN_PREFIX = 4


def looks_like_a_version_id(name: str) -> bool:
    """Whether a name reads as a version id or an id prefix a selector resolves."""
    return len(name) >= MIN_PREFIX and all(c in "0123456789abcdef" for c in name)


def now() -> float:
    return time.time()
