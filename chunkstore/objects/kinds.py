"""The kinds of stored object and where each lives: the store's whole key layout.

Every object of a store is one of these kinds, named by an id: a content
digest (chunks and packs, manifest nodes, moved records) or a name (commit
records by version id, tags, save sessions, GC journal entries, tombstones, key
objects), plus the one config object.  A kind turns an id into a key and a listed key
back into an id; nothing outside :mod:`chunkstore.objects` builds a key
(docs/format.md §1 gives the same table).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Generic, TypeVar

from chunkstore.format.digest import Digest, is_hex_digest

IdT = TypeVar("IdT", Digest, str)

#: The store's config object (docs/format.md §2).
CONFIG_KEY = "chunkstore.json"


@dataclass(frozen=True)
class Kind(abc.ABC, Generic[IdT]):
    """A kind of stored object: every key of the kind starts with ``prefix``."""

    #: what the kind is called in messages ("chunk", "commit record", ...)
    name: str
    prefix: str

    @abc.abstractmethod
    def key(self, object_id: IdT) -> str:
        """The key of the object ``object_id`` names."""

    @abc.abstractmethod
    def id_of(self, key: str) -> IdT:
        """The id a listed key names; ``ValueError`` when the key is not one this kind
        writes (another tool's file, a damaged name)."""


@dataclass(frozen=True)
class DigestKind(Kind[Digest]):
    """Objects named by a content digest: ``<prefix><hex>``, or with ``fanout``
    ``<prefix><first two hex digits>/<hex>`` so that no directory grows too large."""

    fanout: bool = True

    def key(self, object_id: Digest) -> str:
        h = object_id.hex
        return f"{self.prefix}{h[:2]}/{h}" if self.fanout else f"{self.prefix}{h}"

    def id_of(self, key: str) -> Digest:
        if not key.startswith(self.prefix):
            raise ValueError(f"{key!r} is not under {self.prefix!r}")
        return Digest.parse(key.rsplit("/", 1)[-1] if self.fanout else key[len(self.prefix):])


@dataclass(frozen=True)
class NamedKind(Kind[str]):
    """Objects named by a string: ``<prefix><name>``.  With ``hex_ids`` only names of
    64 hex digits (version ids) are the kind's; listing skips the others."""

    hex_ids: bool = False

    def key(self, object_id: str) -> str:
        return f"{self.prefix}{object_id}"

    def id_of(self, key: str) -> str:
        name = key[len(self.prefix):]
        if not key.startswith(self.prefix) or (self.hex_ids and not is_hex_digest(name)):
            raise ValueError(f"{key!r} is not a {self.name} key")
        return name


#: Chunk objects, packs among them (docs/format.md §3).
CHUNKS = DigestKind("chunk", "chunks/")
#: Manifest nodes (§5).
NODES = DigestKind("node", "nodes/")
#: Commit records by version id: the commit point of a save (§7).
VERSIONS = NamedKind("commit record", "versions/", hex_ids=True)
#: Tags by name (§8).
TAGS = NamedKind("tag", "tags/")
#: Save sessions in progress (§11).
SESSIONS = NamedKind("save session", "sessions/")
#: GC journal entries and pruning horizons (§11).
JOURNAL = NamedKind("GC journal entry", "gc/")
#: Tombstones of removed versions, by version id (§11).
TOMBSTONES = NamedKind("tombstone", "removed/")
#: Writer leases of runs, by run name: one writer per run (§11.5).
LEASES = NamedKind("run lease", "leases/")
#: Moved records of repacked packs, by pack digest (§3.6).
MOVED = DigestKind("moved record", "moved/", fanout=False)
#: Restore drill records, by ``<UTC time>-<random>`` (§12).
DRILLS = NamedKind("drill record", "drills/")
#: Read leases: readers of a version, visible to every GC (§11.6).
READERS = NamedKind("read lease", "readers/")

#: Key objects of an encrypted store, by key id: each wraps the master key under one
#: password (§13).  Stored in clear, as the config is: they say how to read the rest.
KEYS = NamedKind("key", "keys/")

#: Signature objects by version id: an ECDSA signature over the commit record (§14).
SIGNATURES = NamedKind("signature", "signatures/", hex_ids=True)

#: Kinds whose objects an encrypted store keeps in clear (beside the config).
CLEAR_KINDS: tuple[Kind[Digest] | Kind[str], ...] = (KEYS,)

ALL_KINDS: tuple[Kind[Digest] | Kind[str], ...] = (
    CHUNKS, NODES, VERSIONS, TAGS, SESSIONS, JOURNAL, TOMBSTONES, MOVED, LEASES,
    DRILLS, READERS, KEYS,
    SIGNATURES)

#: Legal holds, by version id (§15): a held version is removed by no release that
#: writes them (store format 11 and later).
HOLDS = NamedKind("hold", "holds/", hex_ids=True)
ALL_KINDS += (HOLDS,)


#: Audit events, by ``<UTC time>-<random>`` so that a listing is in time order (§16):
#: append-only, removed only by ``chunkstore audit --prune-before`` (a new kind: releases
#: that do not know it never list it).
AUDIT = NamedKind("audit event", "audit/")
ALL_KINDS += (AUDIT,)

@dataclass(frozen=True)
class MarkerKind(Kind[str]):
    """Publication markers (§17), by ``<20-digit ns time>-<version id>``, or with
    :data:`REMOVED_SUFFIX` for a removal, one folder per :data:`MARKER_BUCKET_NS` of
    time: ``<prefix><first 9 digits>/<id>`` (marker layout 2), so that an opener lists
    the last minutes' markers only (one or two prefixes on S3, the few folders of the
    window on a local disk, which reads a folder whole).

    Layout 1 (``<prefix><first 7 digits>/<id>``, 2.8-hour folders) is read too: its
    keys are markers whose id keeps the folder (``<7 digits>/<time>-<id>``), so that
    GC prunes them and a purge forgets them; an open lists layout 2's folders only."""

    def key(self, object_id: str) -> str:
        if "/" in object_id:  # layout 1: the folder is in the id
            return f"{self.prefix}{object_id}"
        return f"{self.prefix}{object_id[:MARKER_BUCKET_DIGITS]}/{object_id}"

    def id_of(self, key: str) -> str:
        name = key[len(self.prefix):]
        folder, _, marker = name.partition("/")
        time_ns, dash, version_id = marker.removesuffix(REMOVED_SUFFIX).partition("-")
        if (not key.startswith(self.prefix) or len(time_ns) != MARKER_TIME_DIGITS
                or not time_ns.isascii() or not time_ns.isdigit() or dash != "-"
                or not is_hex_digest(version_id)
                or folder not in (time_ns[:MARKER_BUCKET_DIGITS],
                                  time_ns[:MARKER_BUCKET_DIGITS_1])):
            raise ValueError(f"{key!r} is not a {self.name} key")
        return marker if len(folder) == MARKER_BUCKET_DIGITS else name

    def bucket(self, time_ns: int) -> str:
        """The key prefix of every marker of the time bucket ``time_ns`` falls in."""
        return f"{self.prefix}{f'{max(time_ns, 0):0{MARKER_TIME_DIGITS}d}'[:MARKER_BUCKET_DIGITS]}/"


#: What ends the marker of a removal (the commit record about to be deleted).
REMOVED_SUFFIX = "-removed"
#: A marker's time: nanoseconds since the epoch, 20 digits (zero-padded).
MARKER_TIME_DIGITS = 20
#: The leading digits of that time that name its folder: buckets of 10**11 ns (100 s).
#: A job saving every second keeps 100 markers a folder; an open reads the two or three
#: folders its window (two or three minutes) spans.
MARKER_BUCKET_DIGITS = 9
MARKER_BUCKET_NS = 10 ** (MARKER_TIME_DIGITS - MARKER_BUCKET_DIGITS)
#: Marker layout 1's folders (read, never written): 10**13 ns, 2.8 hours.
MARKER_BUCKET_DIGITS_1 = 7

#: Publication markers: an empty object stored just before each commit record is
#: created or deleted, so that an opener learns of versions published and removed by
#: listing the last hours' markers instead of every commit record (§17).  Older
#: releases neither write nor read them: no format change.
PUBLISHED = MarkerKind("publication marker", "published/")
ALL_KINDS += (PUBLISHED,)
#: Empty, read by the key alone: nothing to seal in an encrypted store (§13.5), and
#: forging one gains nothing (the commit record it names is read and checked).
CLEAR_KINDS += (PUBLISHED,)
