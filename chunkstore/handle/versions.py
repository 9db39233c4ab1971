"""Published versions as the store handle describes them, and as the index records them."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from chunkstore.format import plaindata
from chunkstore.format.digest import Digest
from chunkstore.format.records import CommitRecord
from chunkstore.index.versiontables import VersionEntry


@dataclass(frozen=True)
class VersionInfo:
    """A published version: id, run, step, creation time and sizes."""

    id: str
    run: str
    step: int
    created: float
    parent: str | None
    root: Digest
    logical_bytes: int
    new_bytes: int
    new_stored_bytes: int
    meta: dict[str, Any]

    @property
    def short_id(self) -> str:
        return self.id[:12]

    @property
    def created_iso(self) -> str:
        return dt.datetime.fromtimestamp(self.created, dt.timezone.utc).isoformat(
            timespec="seconds")

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "run": self.run, "step": self.step, "created": self.created_iso,
                "parent": self.parent, "root": self.root.hex, "logical_bytes": self.logical_bytes,
                "new_bytes": self.new_bytes, "new_stored_bytes": self.new_stored_bytes,
                "meta": plaindata.to_tree(self.meta)}


def entry_from_record(version_id: str, record: CommitRecord) -> VersionEntry:
    """The index entry of a committed version."""
    return VersionEntry(
        id=version_id, run=record.run, step=record.step, created=record.created,
        root=record.root.hex, parent=record.parent, logical_bytes=record.logical_bytes,
        new_bytes=record.new_bytes, new_stored_bytes=record.new_stored_bytes,
        meta=plaindata.to_tree(record.meta),  # type: ignore[arg-type]
    )

