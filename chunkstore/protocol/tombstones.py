"""Tombstones of removed versions: the grace period counted from unreachability.

Removing a version (``rm``, ``prune``) first stores ``removed/<version id>``
(canonical JSON ``{"format_version": 1, "version": ..., "root": <hex>,
"run": ..., "step": ..., "removed": <unix time>}``), then deletes the commit
record.  Every GC, from any index, rebuilt or not, marks the tree of every
tombstone younger than its grace period as live, so a reader that opened a
version just before it was removed keeps the whole grace period; a GC deletes
a tombstone once it is older than the grace period.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from chunkstore.format import plaindata
from chunkstore.format.digest import Digest, is_hex_digest
from chunkstore.objects.kinds import TOMBSTONES

if TYPE_CHECKING:
    from chunkstore.objects.objectstore import ObjectStore

TOMBSTONE_FORMAT = 1
#: A tombstone whose version is still published (a removal in progress, or one that a
#: hold stopped or a crash ended) is deleted by a GC only once it is this old, whatever
#: the GC's grace period: until then it may be a removal's only sign, which placing a
#: hold looks for (:mod:`chunkstore.protocol.holds`).
LIVE_TOMBSTONE_MIN_AGE_S = 3600.0
#: A removal stalled longer than this after storing its tombstones (a GC may have
#: deleted them since) stores them again and lists ``holds/`` again before it withdraws
#: or deletes anything (:mod:`chunkstore.handle.removal`).
MAX_REMOVAL_STALL_S = LIVE_TOMBSTONE_MIN_AGE_S / 2


@dataclass(frozen=True)
class Tombstone:
    version_id: str
    root: Digest | None  # None: unreadable, protects nothing but is still cleaned up
    removed: float
    #: False when the removal time could not be read: ``removed`` is then when the
    #: object was last written (its modification time), so that it ages like any other
    dated: bool = True


def _body(version_id: str, root: Digest, run: str, step: int) -> bytes:
    return json.dumps({"format_version": TOMBSTONE_FORMAT, "version": version_id,
                       "root": root.hex, "run": run, "step": step, "removed": time.time()},
                      sort_keys=True).encode()


def write_tombstone(objects: ObjectStore, version_id: str, root: Digest, run: str,
                    step: int, *, deferred: bool = False) -> None:
    """Store the tombstone, durable on return; or, ``deferred``, after the next
    ``objects.flush()`` (a removal of many: one flush for all).  A tombstone stored
    already (a removal that did not finish) is replaced, durably: the grace period
    counts from this removal, the version having been published until now."""
    body = _body(version_id, root, run, step)
    if not deferred or not objects.put_if_absent_deferred(TOMBSTONES, version_id, body):
        objects.put(TOMBSTONES, version_id, body)


@dataclass(frozen=True)
class RemovedVersion:
    """What a tombstone tells a person of its version: a rerun of ``rm`` names it."""

    version_id: str
    run: str | None
    step: int | None
    removed: float | None  # None: not readable

    def to_json(self) -> dict[str, object]:
        return {"id": self.version_id, "run": self.run, "step": self.step,
                "removed": self.removed}


def find_removed(objects: ObjectStore, *, prefix: str = "", run: str | None = None,
                 step: int | None = None) -> list[RemovedVersion]:
    """The versions whose tombstones are stored, by id prefix, or by run and step (which
    reads every tombstone, side by side), newest removal last."""
    ids = [vid for vid in objects.ids(TOMBSTONES, prefix) if is_hex_digest(vid)]
    with ThreadPoolExecutor(max(1, min(16, len(ids))),
                            thread_name_prefix="chunkstore-tombstones") as pool:
        found = [r for r in pool.map(lambda vid: _removed(objects, vid), ids)
                 if r is not None and (run is None or (r.run, r.step) == (run, step))]
    return sorted(found, key=lambda r: (r.removed or 0.0, r.version_id))


def _removed(objects: ObjectStore, version_id: str) -> RemovedVersion | None:
    try:
        body = plaindata.load_json(objects.get(TOMBSTONES, version_id))
    except FileNotFoundError:
        return None  # deleted by a GC since the listing
    except ValueError:
        body = None
    if not isinstance(body, dict):
        return RemovedVersion(version_id, None, None, None)
    run, step = body.get("run"), body.get("step")
    tombstone = _parse(version_id, body)
    return RemovedVersion(version_id, run if isinstance(run, str) else None,
                          step if type(step) is int else None,
                          tombstone.removed if tombstone.dated else None)


def removal_times(objects: ObjectStore, version_ids: list[str]) -> dict[str, float]:
    """When each of ``version_ids`` was removed, as its tombstone says now (read side by
    side; one whose time cannot be read, when it was last written); those gone are left
    out."""
    def read(version_id: str) -> Tombstone | None:
        try:
            return read_tombstone(objects, version_id)
        except FileNotFoundError:
            return None

    with ThreadPoolExecutor(max(1, min(16, len(version_ids))),
                            thread_name_prefix="chunkstore-tombstones") as pool:
        return {t.version_id: t.removed for t in pool.map(read, version_ids) if t is not None}


def list_tombstones(objects: ObjectStore) -> Iterator[Tombstone]:
    """Every tombstone.  One whose removal time cannot be read (not JSON, not an object,
    no finite time) counts as removed when its object was last written: it protects its
    version, if the root can be read, for a grace period from that write, then a GC
    deletes it (counted as removed at each read instead, it never aged, and its
    version's tree stayed marked for good)."""
    for version_id in objects.ids(TOMBSTONES):
        if not is_hex_digest(version_id):
            continue
        try:
            yield read_tombstone(objects, version_id)
        except FileNotFoundError:
            continue


def read_tombstone(objects: ObjectStore, version_id: str) -> Tombstone:
    """The tombstone of ``version_id``; ``FileNotFoundError`` when there is none."""
    try:  # ValueError: not JSON, too deep, or (a sealed store's) failing authentication
        body = plaindata.load_json(objects.get(TOMBSTONES, version_id))
    except ValueError:
        body = None
    tombstone = _parse(version_id, body)
    if tombstone.dated:
        return tombstone
    return dataclasses.replace(tombstone, removed=objects.stat(TOMBSTONES, version_id).mtime)


def _parse(version_id: str, body: object) -> Tombstone:
    """The tombstone ``body`` describes; one whose time cannot be read counts as removed
    now (:func:`read_tombstone` dates it by its object instead)."""
    if not isinstance(body, dict):
        return Tombstone(version_id, None, time.time(), dated=False)
    root, removed = body.get("root"), body.get("removed")
    digest = Digest.parse(root) if isinstance(root, str) and is_hex_digest(root) else None
    dated, when = False, time.time()
    if not isinstance(removed, bool) and isinstance(removed, (int, float)):
        try:
            if math.isfinite(removed):
                dated, when = True, float(removed)
        except OverflowError:  # an int past any float (10**400)
            pass
    return Tombstone(version_id, digest, when, dated)
