"""``report``: logical and physical bytes, dedup and compression, amplification."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from chunkstore.store import Store


@dataclass(frozen=True)
class VersionStats:
    id: str
    run: str
    step: int
    created: str
    logical_bytes: int
    new_bytes: int
    new_stored_bytes: int


@dataclass
class StoreStats:
    """Sizes over the whole store.  Amplification = physical / logical of the latest version."""

    versions: list[VersionStats] = field(default_factory=list)
    chunks: int = 0
    unique_raw_bytes: int = 0  # the chunks' bytes before encoding
    physical_bytes: int = 0  # what the chunk and node objects occupy
    logical_bytes_total: int = 0  # sum over versions of their logical bytes
    latest_logical_bytes: int = 0
    reclaimable_chunks: int = 0  # chunks and nodes no version references: GC frees them
    reclaimable_bytes: int = 0  # ... once the grace period has passed
    reclaimable_now_bytes: int = 0  # ... of which unreferenced for longer than the grace period
    grace_s: float = 0.0

    @property
    def amplification(self) -> float:
        return self.physical_bytes / self.latest_logical_bytes if self.latest_logical_bytes else 0.0

    @property
    def dedup_ratio(self) -> float:
        """Logical bytes of all versions per unique raw byte (higher is better)."""
        return self.logical_bytes_total / self.unique_raw_bytes if self.unique_raw_bytes else 0.0

    @property
    def compression_ratio(self) -> float:
        """Unique raw bytes per stored byte (higher is better)."""
        return self.unique_raw_bytes / self.physical_bytes if self.physical_bytes else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "versions": [v.__dict__ for v in self.versions],
            "totals": {
                "versions": len(self.versions), "chunks": self.chunks,
                "logical_bytes_total": self.logical_bytes_total,
                "latest_logical_bytes": self.latest_logical_bytes,
                "unique_raw_bytes": self.unique_raw_bytes,
                "physical_bytes": self.physical_bytes,
                "dedup_ratio": round(self.dedup_ratio, 4),
                "compression_ratio": round(self.compression_ratio, 4),
                "amplification": round(self.amplification, 4),
                "reclaimable_objects": self.reclaimable_chunks,
                "reclaimable_bytes": self.reclaimable_bytes,
                "reclaimable_now_bytes": self.reclaimable_now_bytes,
                "grace_s": self.grace_s,
            },
        }


def stats(store: Store, grace_s: float = 3600.0, now: float | None = None) -> StoreStats:
    """Sizes of ``store``; what GC could reclaim now and after a grace of ``grace_s``."""
    import time

    from chunkstore.index import ChunkState

    now = time.time() if now is None else now
    result = StoreStats(grace_s=grace_s)
    for info in store.versions():
        result.versions.append(VersionStats(info.id, info.run, info.step, info.created_iso,
                                            info.logical_bytes, info.new_bytes,
                                            info.new_stored_bytes))
        result.logical_bytes_total += info.logical_bytes
    if result.versions:
        result.latest_logical_bytes = result.versions[-1].logical_bytes
    for _, record in store.index.iter_chunks():
        result.chunks += 1
        result.unique_raw_bytes += record.raw_length
        result.physical_bytes += record.stored_length
    result.physical_bytes += store.index.node_bytes()
    for kind, digest, since in store.index.unreferenced():
        found = store.index.record(kind, digest)
        if found is None or found.state == ChunkState.DELETING:
            continue
        result.reclaimable_chunks += 1
        result.reclaimable_bytes += found.stored_length
        if since <= now - grace_s:
            result.reclaimable_now_bytes += found.stored_length
    return result
