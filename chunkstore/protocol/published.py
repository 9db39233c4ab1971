"""Publication markers: how an opener learns of versions other indexes published or
removed without listing every commit record (docs/format.md §17).

1. **Writing.**  Every path of this release that creates a commit record (a save, a
   sync, a takeover's roll-forward, a repair) first stores
   ``published/<bucket>/<20-digit ns time>-<version id>`` (empty), and every path that
   deletes one (a removal, a sync's retraction, a writer whose version was withdrawn)
   first stores ``...-<version id>-removed``: durable (flushed) before the record is
   created or deleted, so a process killed after that point always leaves a marker.  A
   marker whose change never comes (the process was killed or refused between the
   two) names no change.
2. **Reading.**  An opener lists the markers stamped from its watermark (the time
   it last listed, by its own clock) less :data:`SKEW_S` (clocks of other machines, a
   writer paused between its marker and its record) up to now plus :data:`SKEW_S`
   (on an object store by time-digit prefixes, one or two LISTs; on a local disk the
   window's 100-s folders, two or three), and changes its index only after
   looking at the commit record: a marker is a hint, never the truth.  A publication
   marker of a version the index lacks counts it in where its record is read and
   checked; a removal marker of a version the index holds counts it out where its
   record is gone.  An index version created inside the window whose publication
   marker is not listed (an older release's save; a store put back to an older copy
   of itself) makes the opener list every record instead.
3. **The safety net.**  A record created or deleted without a marker (an older
   release, a crafted or hand-copied record, a marker lost or written outside the
   window) is found by a full listing of the commit records, which runs where the
   index has no watermark, where its watermark is older than :data:`KEEP_S` less
   :data:`SKEW_S`, where its last full listing is older than :data:`FULL_LISTING_S`,
   in every GC that marks, an ``index rebuild``, a whole-store verify (which brings
   the index in line with its own listing before it compares refcounts), and where a
   selector names nothing the index holds (it lists and looks again before it
   raises): such a version is seen by an open at most that late, and at once by a
   selector naming it.
4. **Pruning.**  GC's sweep deletes markers older than :data:`KEEP_S` (a purge the
   publication markers of the purged versions; their removal markers stay, for the
   indexes that still count them).  An opener that may need a pruned one (its
   watermark is that old) lists in full instead, so pruning takes from no index what
   it needs.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from chunkstore.objects.kinds import (
    MARKER_BUCKET_DIGITS,
    MARKER_BUCKET_NS,
    MARKER_TIME_DIGITS,
    PUBLISHED,
    REMOVED_SUFFIX,
)

if TYPE_CHECKING:
    from chunkstore.objects.objectstore import ObjectStore

#: Clock skew between machines, and how long a writer may stop between its marker and
#: its record, that the marker window allows for.  Beyond it the version waits for the
#: next full listing (:data:`FULL_LISTING_S`), so this trades the markers an open lists
#: (every save of the window: a job saving 7 times a second, as the benchmarks build
#: their stores, leaves 2,000 markers in 5 minutes) against how often that wait can
#: happen (clocks kept by NTP differ by milliseconds).
SKEW_S = 60.0
#: An opener lists every commit record at least this often, markers or not.
FULL_LISTING_S = 600.0
#: Markers older than this are pruned by GC's sweep.
KEEP_S = 86400.0
_NS = 1_000_000_000


def clock_s() -> float:
    """The clock markers are stamped by, and openers' watermarks read from, in seconds:
    ``time.time_ns`` (nanoseconds in the name)."""
    return time.time_ns() / _NS


def marker_id(version_id: str, time_ns: int | None = None, *, removed: bool = False) -> str:
    """The marker of ``version_id`` (of its removal with ``removed``), stamped now (or
    at ``time_ns``)."""
    stamp = time.time_ns() if time_ns is None else time_ns
    return f"{stamp:0{MARKER_TIME_DIGITS}d}-{version_id}{REMOVED_SUFFIX if removed else ''}"


def write_marker(objects: ObjectStore, version_id: str, *, removed: bool = False) -> None:
    """Store the marker of a version whose commit record is about to be created (or,
    with ``removed``, deleted); durable with the next ``objects.flush()``, which the
    caller makes before it creates or deletes the record."""
    objects.put_if_absent_deferred(PUBLISHED, marker_id(version_id, removed=removed), b"")


@dataclass(frozen=True)
class Marker:
    """A listed marker: its time (ns), the version it names, whether of a removal."""

    time_ns: int
    version_id: str
    removed: bool


def parse_marker(marker: str) -> Marker:
    """A marker's fields (a listed marker is checked by its kind; one of layout 1 has
    its folder in front: ``<7 digits>/<time>-<id>``)."""
    stamp, _, version_id = marker.rpartition("/")[2].removesuffix(REMOVED_SUFFIX).partition("-")
    return Marker(int(stamp), version_id, marker.endswith(REMOVED_SUFFIX))


def recent_markers(objects: ObjectStore, since_s: float,
                   now_s: float | None = None) -> Iterator[Marker]:
    """The markers stamped from ``since_s`` less :data:`SKEW_S` up to ``now_s`` plus
    :data:`SKEW_S`: on a local disk, which reads a folder whole, each folder of the
    window (two or three for the minutes an open's window spans; at most a day's,
    :data:`KEEP_S`, where the caller lists in full past that); elsewhere one or two
    prefixes (a LIST request each)."""
    now_s = clock_s() if now_s is None else now_s
    first = max(int((since_s - SKEW_S) * _NS), 0)
    last = int((now_s + SKEW_S) * _NS)
    local = objects.local_path() is not None
    for prefix in _bucket_folders(first, last) if local else _time_prefixes(first, last):
        for name in objects.ids(PUBLISHED, prefix):
            marker = parse_marker(name)
            if first <= marker.time_ns <= last:
                yield marker


def _bucket_folders(first: int, last: int) -> list[str]:
    """The folders (key prefixes after ``published/``) of every marker stamped from
    ``first`` to ``last`` ns, one per :data:`MARKER_BUCKET_NS`: a local listing of a
    prefix reads the whole folder it ends in, so a prefix of the time inside a folder
    saves nothing there, and one of folder names reads ``published/`` itself (a folder
    per 100 s of the last day: :func:`prune_markers` removes older ones it empties)."""
    return [PUBLISHED.bucket(bucket * MARKER_BUCKET_NS)[len(PUBLISHED.prefix):]
            for bucket in range(first // MARKER_BUCKET_NS, last // MARKER_BUCKET_NS + 1)]


def _time_prefixes(first: int, last: int) -> list[str]:
    """Key prefixes (after ``published/``) that hold every marker stamped from ``first``
    to ``last`` ns: one or two runs of the time's leading digits, the longest that do
    (the server filters a listing by prefix only: a whole folder, or a shorter prefix,
    would return more markers), inside a folder (``017964868/01796486812``) or, for a
    window wider than a folder, of the folders' names (``01796486``: they are the
    time's leading digits too)."""
    unit = 1
    while last // unit - first // unit > 1:
        unit *= 10
    digits = MARKER_TIME_DIGITS - len(str(unit)) + 1
    heads = [f"{head * unit:0{MARKER_TIME_DIGITS}d}"[:digits]
             for head in range(first // unit, last // unit + 1)]
    return [f"{head[:MARKER_BUCKET_DIGITS]}/{head}" if digits >= MARKER_BUCKET_DIGITS else head
            for head in heads]


def prune_markers(objects: ObjectStore, now_s: float, *, dry_run: bool = False) -> int:
    """Delete the markers older than :data:`KEEP_S` (GC's sweep: it lists them all);
    how many.  Then, where the store has folders (a local disk), remove those folders
    of theirs that the prune emptied and whose whole time span is that old: no marker
    of this release is written there any more, and a local open's window and a sweep
    would otherwise walk one empty folder per 100 s ever written.  A folder that holds
    anything stays (``rmdir`` removes only an empty one)."""
    horizon = int((now_s - KEEP_S) * _NS)
    old = [m for m in objects.ids(PUBLISHED) if parse_marker(m).time_ns < horizon]
    if not dry_run:
        objects.delete_many(PUBLISHED, old)
        objects.remove_folders(PUBLISHED, sorted(
            {folder for folder in map(_folder_of, old) if _folder_end_ns(folder) <= horizon}))
    return len(old)


def _folder_of(marker: str) -> str:
    """The folder (after ``published/``, ending in ``/``) that holds ``marker``'s key,
    whatever its layout."""
    return PUBLISHED.key(marker)[len(PUBLISHED.prefix):].rpartition("/")[0] + "/"


def _folder_end_ns(folder: str) -> int:
    """The time just past the span of the markers a folder of leading time digits
    holds (100 s for layout 2's 9 digits, 2.8 hours for layout 1's 7)."""
    digits = folder.rstrip("/")
    span = int(10 ** (MARKER_TIME_DIGITS - len(digits)))
    return (int(digits) + 1) * span


def forget_markers(objects: ObjectStore, version_ids: set[str]) -> int:
    """Delete the publication markers of ``version_ids`` (a purge); how many.  Their
    removal markers stay until they are pruned: an index that still counts one of
    them counts it out from its removal marker (its tombstone is gone with the purge)."""
    named = [m for m in objects.ids(PUBLISHED)
             if not (marker := parse_marker(m)).removed and marker.version_id in version_ids]
    objects.delete_many(PUBLISHED, named)
    return len(named)
