"""The store config object and commit records (see docs/format.md)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from chunkstore import plaindata
from chunkstore.digest import Digest
from chunkstore.errors import CorruptRecordError, FormatVersionError, NotAStoreError

STORE_FORMAT = "chunkstore"
STORE_FORMAT_VERSION = 1
RECORD_FORMAT = "chunkstore.version"
RECORD_FORMAT_VERSION = 1
DEFAULT_CHUNK_SIZE = 4 * 1024 * 1024
MIN_CHUNK_SIZE = 4096
MAX_CHUNK_SIZE = 256 * 1024 * 1024


def _dumps(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode("utf-8")


@dataclass(frozen=True)
class StoreConfig:
    chunk_size: int
    compression: str
    created: float

    def encode(self) -> bytes:
        return _dumps({"format": STORE_FORMAT, "format_version": STORE_FORMAT_VERSION,
                       "chunk_size": self.chunk_size, "compression": self.compression,
                       "created": self.created})

    @classmethod
    def decode(cls, url: str, data: bytes) -> StoreConfig:
        try:
            obj = json.loads(data)
            if obj.get("format") != STORE_FORMAT:
                raise NotAStoreError(url, "chunkstore.json names another format")
        except (ValueError, AttributeError) as exc:
            raise NotAStoreError(url, f"chunkstore.json is not valid JSON: {exc}") from exc
        if obj.get("format_version") != STORE_FORMAT_VERSION:
            raise FormatVersionError("store", obj.get("format_version"), STORE_FORMAT_VERSION)
        return cls(int(obj["chunk_size"]), str(obj["compression"]), float(obj["created"]))


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
        if Digest.of(data).hex != version_id:
            raise CorruptRecordError(version_id, "content does not match its version id")
        try:
            obj = json.loads(data)
            if obj.get("format") != RECORD_FORMAT:
                raise CorruptRecordError(version_id, f"format is {obj.get('format')!r}")
        except (ValueError, AttributeError) as exc:
            raise CorruptRecordError(version_id, f"not valid JSON: {exc}") from exc
        if obj.get("format_version") != RECORD_FORMAT_VERSION:
            raise FormatVersionError(f"version {version_id[:12]}", obj.get("format_version"),
                                     RECORD_FORMAT_VERSION)
        try:
            return cls(
                run=str(obj["run"]), step=int(obj["step"]), parent=obj["parent"],
                created=float(obj["created"]), root=Digest.parse(obj["root"]),
                meta=plaindata.from_tree(obj["meta"]), logical_bytes=int(obj["logical_bytes"]),
                new_bytes=int(obj["new_bytes"]), new_stored_bytes=int(obj["new_stored_bytes"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptRecordError(version_id, f"missing or malformed field: {exc!r}") from exc


def now() -> float:
    return time.time()
