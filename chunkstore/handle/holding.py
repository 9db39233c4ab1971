"""Placing and releasing legal holds (``chunkstore hold`` / ``release``); the order of
each step and why no interleaving with a removal loses a confirmed hold is argued in
:mod:`chunkstore.protocol.holds`."""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

from chunkstore.errors import HoldUnconfirmedError, SelectorError
from chunkstore.format.digest import is_hex_digest
from chunkstore.format.records import HOLDS_STORE_FORMAT_VERSION
from chunkstore.objects.kinds import LEASES, TOMBSTONES, VERSIONS
from chunkstore.protocol import audit
from chunkstore.protocol.audit import versions_named
from chunkstore.protocol.holds import Hold, check_reason, read_hold, release_hold, store_hold
from chunkstore.protocol.runlease import withdrawn_name

if TYPE_CHECKING:
    from chunkstore.handle.handle import StoreHandle

#: How long placing a hold waits for a removal that started before it to finish.
DEFAULT_HOLD_WAIT_S = 10.0


def upgrade_for_holds(store: StoreHandle) -> None:
    """Make the store version 11 before its first hold object (docs/format.md §2): a
    release that does not honour holds then refuses the store.  Atomic; concurrent
    upgraders write the same bytes; an encrypted store keeps its ``encryption``."""
    if store.config.format_version >= HOLDS_STORE_FORMAT_VERSION:
        return
    store.upgrade_format()  # first what any write needs (versions 1-8)
    config = dataclasses.replace(store.config, format_version=HOLDS_STORE_FORMAT_VERSION)
    store.objects.replace_config(config.encode())
    store.config = config


def place_hold(store: StoreHandle, selector: str, reason: str, *,
               wait_s: float = DEFAULT_HOLD_WAIT_S) -> Hold:
    """Hold the version ``selector`` names; return the stored hold once it is confirmed
    (:mod:`chunkstore.protocol.holds`).  Holding a held version replaces its reason."""
    reason = check_reason(reason)
    info = store.resolve(selector)
    if not store.objects.exists(VERSIONS, info.id):  # the index lags a removal elsewhere
        raise SelectorError(selector, f"version {info.short_id} was removed from the store")
    upgrade_for_holds(store)
    audit.record(store.objects, "hold", reason=reason, versions=versions_named([info]))
    hold = store_hold(store.objects, info.id, reason)  # 1. durable
    if store.objects.exists(LEASES, withdrawn_name(info.run, info.id)):
        # A removal withdrew it (after a takeover, docs/format.md §11.5) having listed
        # holds/ before step 1: its record is never a version again (the next index to
        # find it deletes it), whether or not that removal lived to delete it.
        release_hold(store.objects, info.id)
        raise SelectorError(selector, f"version {info.short_id} was withdrawn by a removal"
                            " that started before the hold; nothing is held")
    # 2. then look for a removal that may have listed holds/ before step 1
    if not store.objects.exists(TOMBSTONES, info.id):
        return hold
    deadline, delay = time.monotonic() + wait_s, 0.05
    while True:
        # The tombstone first, the record second: a purge deletes its tombstone only
        # after the record, so a tombstone gone with the record still there was expired
        # by GC, not removed by the removal that wrote it.
        tombstone = store.objects.exists(TOMBSTONES, info.id)
        if not store.objects.exists(VERSIONS, info.id):
            release_hold(store.objects, info.id)  # it holds nothing: the version is gone
            raise SelectorError(selector, f"version {info.short_id} was removed by a removal"
                                " that started before the hold; nothing is held")
        if not tombstone:
            return hold  # that removal ended without removing it (GC expired its tombstone)
        if time.monotonic() >= deadline:
            raise HoldUnconfirmedError(info.id, wait_s)
        time.sleep(delay)
        delay = min(delay * 2, 1.0)


def release_version(store: StoreHandle, selector: str) -> Hold:
    """Delete the hold of the version ``selector`` names (or, by full id, a hold whose
    version is not listed: a damaged or stray hold object); return what it recorded.
    ``SelectorError`` when the version is not held."""
    version_id = selector.lower() if isinstance(selector, str) and is_hex_digest(selector) \
        else store.resolve(selector).id
    hold = read_hold(store.objects, version_id)
    if hold is None:
        raise SelectorError(selector, f"version {version_id[:12]} is not held"
                            " (`chunkstore log STORE` marks the held versions)")
    audit.record(store.objects, "release", reason=hold.reason,
                 versions=[{"id": version_id}])
    release_hold(store.objects, version_id)
    return hold

