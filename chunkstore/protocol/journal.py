"""The GC journal: what every GC is about to delete, or deleted, written in the store.

An index on one machine cannot see what a GC on another machine (or on a
deleted or rebuilt index) did.  So a GC writes, before it deletes anything,
one journal entry ``gc/<entry id>`` naming every object it may delete, and
marks it ``done`` after the deletions.  Every save reads the journal after
storing its session object (:mod:`chunkstore.protocol.sessions`) and before its first
deduplication decision:

- entries ``done`` or ``abandoned`` (or whose GC died) are applied to the
  save's index once: their objects stop being deduplication targets (a save
  that needs one writes it again, keeping an intact object it finds);
- entries still ``fenced`` (a GC is waiting for older sessions, or deleting)
  form the save's :class:`Fence`: it never reuses their objects, and before
  writing one it waits until the entry is no longer active.

Entry ids start with the creation time in nanoseconds, so the listing is in
creation order.  The object is canonical JSON::

    {"format_version": 1, "id": ..., "state": "fenced" | "done" | "abandoned",
     "created": ..., "heartbeat": ..., "host": ..., "pid": ..., "pidns": ...,
     "process_start": ..., "chunks": [<hex>, ...], "nodes": [<hex>, ...]}

The journal does not keep one entry per collection (docs/format.md §11.2): a
finished entry that names nothing tells no index anything and goes at once
(:func:`finish_entry`); finished entries are pruned behind a horizon marker
(:func:`prune_journal`), after a day, or on a local store as soon as the
pruning GC's own index has applied them.  The marker names the indexes known to
have applied everything behind it (the pruner's, when it has); any other index
whose last sync is not clearly past the horizon stops treating any object as
present.  So a job whose own index collects after every save keeps a journal of
one marker, and an index that was away still never deduplicates against what
was deleted meanwhile.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from chunkstore.errors import BackendError, GcAbortedError
from chunkstore.format import plaindata
from chunkstore.format.digest import Digest
from chunkstore.index.lmdbindex import CHUNK, NODE
from chunkstore.index.writegate import OPEN_WAIT_S, WriterBusy
from chunkstore.objects.kinds import JOURNAL
from chunkstore.protocol.sessions import (
    HEARTBEAT_S,
    LEASE_S,
    owner_info,
    owner_is_silent,
    stored_time,
    with_stored_heartbeat,
)

if TYPE_CHECKING:
    from chunkstore.index.lmdbindex import Index
    from chunkstore.objects.objectstore import ObjectStore

log = logging.getLogger(__name__)

JOURNAL_FORMAT = 1
FENCED, DONE, ABANDONED = "fenced", "done", "abandoned"
#: How long a save waits for a live GC (one that keeps renewing its entry) to finish
#: with an object it needs before it gives up with an error.
FENCE_WAIT_S = max(600.0, LEASE_S + 2 * HEARTBEAT_S)
#: A running GC begins no deletion once the last renewal of its fenced entry that
#: succeeded was *sent* longer ago than this (:func:`check_renewed`, before every
#: deletion): a save may count it gone from then on.  Half a heartbeat; at least a
#: second, so that a short lease (tests) on a loaded machine does not stop every GC...
RENEW_LAPSE_S = max(HEARTBEAT_S / 2, 1.0)
#: ... and renews it three times as often (a thread of its own, so that a long step
#: between two of the run's checks does not make it look gone).
RENEW_S = RENEW_LAPSE_S / 3
#: A save counts a fenced entry it has watched stay byte for byte the same for this long
#: (on its own clock) as one no live GC renews, whatever times it holds, so no crafted
#: or stale entry holds a save up for more than one heartbeat (two seconds where the
#: heartbeat is shorter).  Why that is safe: the bytes the save first saw were written
#: by a renewal sent before it looked; the GC begins no deletion :data:`RENEW_LAPSE_S`
#: after sending its last successful renewal, so none after half the watch, and the
#: other half is for a deletion in flight.
FENCE_STALE_S = 2 * RENEW_LAPSE_S
#: Finished entries older than this are pruned by GC, behind a horizon marker (an index
#: that has not synced for this long less :data:`SYNC_MARGIN_S` forgets its dedup
#: targets once; every save and every open syncs).
JOURNAL_KEEP_S = 24 * 3600.0
#: An index counts as having missed a pruned entry created up to this long before its
#: last sync (clock skew between machines, PUTs still in flight while it listed).
SYNC_MARGIN_S = 3600.0
#: An index's sync time is rewritten when older than this even if nothing else changed
#: (so that it never falls a day behind, where a pruned entry's horizon would make it
#: forget every record); else a sync that changes nothing writes nothing.
SYNC_REFRESH_S = 3600.0
#: ``gc/horizon-<20 digits>``: entries created before that time (ns) may have been pruned.
HORIZON_PREFIX = "horizon-"
#: The format of a horizon marker's body, ``{"format_version": 1, "applied_by": [<index
#: id>, ...]}``; an empty body (as every release before it wrote) names no index.
HORIZON_FORMAT = 1
#: At most this many index ids in a marker (a longer list is not read: names none).
HORIZON_MAX_IDS = 64
#: Ids of applied entries gone from the journal are dropped from an index by a sync
#: that writes anyway, or by one that finds at least this many.
STALE_APPLIED_MAX = 32


def new_entry_id() -> str:
    return f"{time.time_ns():020d}-{uuid.uuid4().hex[:12]}"


@dataclass
class JournalEntry:
    """One GC run's entry: its state and the objects it may delete."""

    id: str
    state: str
    info: dict[str, Any]
    chunks: frozenset[Digest] = frozenset()
    nodes: frozenset[Digest] = frozenset()
    #: a hash of the bytes read (None for an entry this process wrote): what a save
    #: watches change while it waits
    signature: bytes | None = None
    # The renewal of a running GC's entry (start_entry, write_entry): monotonic time
    # of the last successful write, and whether it lapsed.
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    _renewed: float | None = field(default=None, repr=False, compare=False)
    _lapsed: bool = field(default=False, repr=False, compare=False)
    _stop: threading.Event = field(default_factory=threading.Event, repr=False, compare=False)
    _thread: threading.Thread | None = field(default=None, repr=False, compare=False)

    def active(self, now: float) -> bool:
        """Its GC may still delete its objects: fenced, and the GC process neither gone
        nor silent for a lease (:func:`~chunkstore.protocol.sessions.owner_is_silent`)."""
        return self.state == FENCED and not owner_is_silent(self.info, now)

    def objects(self) -> Iterator[tuple[bytes, Digest]]:
        for digest in self.chunks:
            yield CHUNK, digest
        for digest in self.nodes:
            yield NODE, digest

    def contains(self, kind: bytes, digest: Digest) -> bool:
        return digest in (self.chunks if kind == CHUNK else self.nodes)

    def encode(self) -> bytes:
        body = {**self.info, "format_version": JOURNAL_FORMAT, "id": self.id,
                "state": self.state, "chunks": sorted(d.hex for d in self.chunks),
                "nodes": sorted(d.hex for d in self.nodes)}
        return json.dumps(body, sort_keys=True).encode()

    @classmethod
    def decode(cls, entry_id: str, data: bytes) -> JournalEntry:
        """Parse an entry; ``ValueError`` when it is not one this release can read."""
        body = plaindata.load_json(data)  # ValueError for nesting too deep, NaN, ...
        if not isinstance(body, dict) or body.get("format_version") != JOURNAL_FORMAT \
                or isinstance(body.get("format_version"), bool) \
                or body.get("state") not in (FENCED, DONE, ABANDONED):
            raise ValueError(f"gc journal entry {entry_id}: not a journal entry")
        chunks, nodes = body.pop("chunks", []), body.pop("nodes", [])
        if not isinstance(chunks, list) or not isinstance(nodes, list) \
                or not all(isinstance(h, str) for h in (*chunks, *nodes)):
            raise ValueError(f"gc journal entry {entry_id}: object lists malformed")
        state = body.pop("state")
        return cls(entry_id, state, body, frozenset(Digest.parse(h) for h in chunks),
                   frozenset(Digest.parse(h) for h in nodes))


def entry_time_ns(entry_id: str) -> int:
    """When an entry was created (ns), from its id; 0 for a malformed id."""
    head = entry_id[:20]
    return int(head) if len(head) == 20 and head.isdigit() else 0


@dataclass(frozen=True)
class Listing:
    """One listing of ``gc/``: entry ids in creation order, and the pruning horizon."""

    entry_ids: list[str]
    horizon_ns: int | None
    horizon_names: list[str]

    def markers(self) -> list[tuple[int, str]]:
        """(horizon in ns, name) of every horizon marker listed."""
        return [(entry_time_ns(name[len(HORIZON_PREFIX):]), name)
                for name in self.horizon_names]


def list_journal(objects: ObjectStore) -> Listing:
    ids, horizons = [], []
    for name in objects.ids(JOURNAL):
        if name.startswith(HORIZON_PREFIX):
            horizons.append(name)
        else:
            ids.append(name)
    times = [entry_time_ns(name[len(HORIZON_PREFIX):]) for name in horizons]
    return Listing(ids, max(times) if times else None, horizons)


def marker_body(applied_by: Iterable[str]) -> bytes:
    return json.dumps({"format_version": HORIZON_FORMAT, "applied_by": sorted(applied_by)},
                      sort_keys=True).encode()


def marker_applied_by(objects: ObjectStore, name: str) -> frozenset[str] | None:
    """The indexes a horizon marker names; None when it is gone.  A body this release
    cannot read (an older marker's empty one included) names none."""
    try:
        data = objects.get(JOURNAL, name)
    except FileNotFoundError:
        return None
    try:
        body = plaindata.load_json(data) if data else None
    except ValueError:
        return frozenset()
    version = body.get("format_version") if isinstance(body, dict) else None
    named = body.get("applied_by") if isinstance(body, dict) and not isinstance(
        version, bool) and version == HORIZON_FORMAT else None
    if not isinstance(named, list) or len(named) > HORIZON_MAX_IDS \
            or not all(isinstance(n, str) for n in named):
        return frozenset()
    return frozenset(named)


def missed_pruned(objects: ObjectStore, index: Index, listing: Listing,
                  synced: int | None) -> bool:
    """Whether ``index`` may have missed entries pruned behind a horizon: a marker
    not clearly before its last sync (:data:`SYNC_MARGIN_S`) that does not name it.
    A marker replaced since the listing (a GC pruned again) is judged by a new
    listing's markers, which cover everything it covered."""
    own = index.identity(create=False)
    for _ in range(3):
        recent = [name for horizon, name in listing.markers()
                  if synced is None or synced - int(SYNC_MARGIN_S * 1e9) <= horizon]
        replaced = False
        for name in recent:
            named = marker_applied_by(objects, name)
            if named is None:
                replaced = True
                break
            if own is None or own not in named:
                return True
        if not replaced:
            return False
        listing = list_journal(objects)
    return True


def list_entry_ids(objects: ObjectStore) -> list[str]:
    return list_journal(objects).entry_ids


def read_entry(objects: ObjectStore, entry_id: str) -> JournalEntry | None:
    """The entry, None if it is gone; ``ValueError`` if it cannot be read.  A heartbeat
    no live GC writes (see :func:`~chunkstore.protocol.sessions.with_stored_heartbeat`)
    is replaced by the entry's stored time: a crafted or damaged entry never fences
    objects for longer than a lease past its last write."""
    try:
        data = objects.get(JOURNAL, entry_id)
    except FileNotFoundError:
        return None
    entry = JournalEntry.decode(entry_id, data)
    entry.signature = hashlib.sha256(data).digest()
    info = with_stored_heartbeat(entry.info, time.time(),
                                 functools.partial(stored_time, objects, JOURNAL, entry_id))
    if info is None:
        return None  # pruned meanwhile
    entry.info = info
    return entry


def write_entry(objects: ObjectStore, entry: JournalEntry) -> None:
    """Store the entry with a new heartbeat.  A ``fenced`` entry whose renewal lapsed
    (no successful write for :data:`RENEW_LAPSE_S`: the process was stopped, or the
    store unreachable) is not written again: saves may have counted its GC gone and
    written its objects, so the run stops (:class:`GcAbortedError`).  Writing it in
    any other state ends its renewal."""
    with entry._lock:
        if entry.state == FENCED:
            _raise_if_lapsed(entry)
        if entry.state != FENCED:
            entry._stop.set()
        entry.info["heartbeat"] = time.time()
        sent = time.monotonic()
        objects.put(JOURNAL, entry.id, entry.encode())
        entry._renewed = sent
    thread = entry._thread
    if entry.state != FENCED and thread is not None and thread is not threading.current_thread():
        thread.join()


def check_renewed(entry: JournalEntry) -> None:
    """Called by a GC right before each deletion: :class:`GcAbortedError` unless the
    last successful renewal of its fenced entry was sent within :data:`RENEW_LAPSE_S`
    (a save that watched the entry for :data:`FENCE_STALE_S` may count it gone).  Takes
    no lock: a renewal in flight does not hold up the deletions."""
    _raise_if_lapsed(entry)


def _raise_if_lapsed(entry: JournalEntry) -> None:
    if entry._lapsed or (entry._renewed is not None
                         and time.monotonic() - entry._renewed > RENEW_LAPSE_S):
        entry._lapsed = True  # never renewed again
        raise GcAbortedError(
            f"gc could not renew its journal entry {entry.id} for {RENEW_LAPSE_S:.0f}s"
            " (paused, or the store unreachable): saves may count it gone, so it"
            " stopped deleting; run it again")


def _renew(objects: ObjectStore, entry: JournalEntry) -> None:
    """Rewrite a fenced entry every :data:`RENEW_S` until it leaves that state or its
    renewal lapses (then :func:`write_entry` stops the run at its next check)."""
    while not entry._stop.wait(RENEW_S):
        with entry._lock:
            if entry._stop.is_set() or entry.state != FENCED:
                return
            if entry._renewed is None or time.monotonic() - entry._renewed > RENEW_LAPSE_S:
                entry._lapsed = True  # stopped for a while: never renewed again
                return
            entry.info["heartbeat"] = time.time()
            sent = time.monotonic()
            try:
                objects.put(JOURNAL, entry.id, entry.encode())
            except Exception as exc:  # retried at the next beat; a lapse ends the run
                log.debug("gc journal entry %s not renewed: %s", entry.id, exc)
                continue
            entry._renewed = sent


def start_entry(objects: ObjectStore, condemned: Iterable[tuple[bytes, Digest]],
                index_id: str | None = None) -> JournalEntry:
    """Write a new ``fenced`` entry naming the ``condemned`` objects: from now on no save
    that reads the journal reuses them, and the GC may delete them once older sessions
    end.  A thread renews it until it is written in another state.  ``index_id``: the
    GC's index (:meth:`~chunkstore.index.lmdbindex.Index.identity`), recorded as
    ``index`` so that other GCs see that this index collects here too."""
    chunks = frozenset(d for k, d in condemned if k == CHUNK)
    nodes = frozenset(d for k, d in condemned if k == NODE)
    now = time.time()
    info: dict[str, Any] = {**owner_info(), "created": now}
    if index_id is not None:
        info["index"] = index_id
    entry = JournalEntry(new_entry_id(), FENCED, info, chunks, nodes)
    write_entry(objects, entry)
    entry._thread = threading.Thread(target=_renew, args=(objects, entry), daemon=True,
                                     name="chunkstore-gc-entry")
    entry._thread.start()
    return entry


#: When this process first read each (entry id, signature): a save's wait for an entry
#: counts from its first sight of the bytes, in this save or an earlier one.
_FIRST_SEEN: dict[tuple[str, bytes], float] = {}
_FIRST_SEEN_LOCK = threading.Lock()
_FIRST_SEEN_MAX = 4096


def first_seen(entry: JournalEntry) -> float:
    """The monotonic time this process first read ``entry`` as it is now."""
    key = (entry.id, entry.signature or b"")
    with _FIRST_SEEN_LOCK:
        if key not in _FIRST_SEEN:
            if len(_FIRST_SEEN) >= _FIRST_SEEN_MAX:
                for old in list(_FIRST_SEEN)[: _FIRST_SEEN_MAX // 4]:
                    del _FIRST_SEEN[old]
            _FIRST_SEEN[key] = time.monotonic()
        return _FIRST_SEEN[key]


@dataclass
class Fence:
    """The active GC journal entries a save knows of; their objects are off limits."""

    objects: ObjectStore
    index: Index
    active: dict[str, JournalEntry] = field(default_factory=dict)
    #: An entry could not be read: no index record can be trusted for deduplication.
    distrust_index: bool = False
    #: Bumped each time a finished entry is applied to the index, before it leaves
    #: ``active``: an index answer taken before an apply may be stale (a claim taken
    #: earlier is trusted only while this is unchanged).
    generation: int = 0
    _apply_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def blocking(self, kind: bytes, digest: Digest) -> str | None:
        """The id of an active entry that names the object, if any."""
        for entry_id, entry in list(self.active.items()):  # workers pop concurrently
            if entry.contains(kind, digest):
                return entry_id
        return None

    def observe(self, entry: JournalEntry) -> None:
        """Start the staleness clock of an entry read (see :func:`first_seen`)."""
        first_seen(entry)

    def wait(self, entry_id: str, deadline_s: float = FENCE_WAIT_S) -> None:
        """Wait until the entry's GC is finished (or dead); then forget its objects.

        The GC is judged by what this process sees, not by the times the entry
        holds: an entry that stays the same bytes for :data:`FENCE_STALE_S` is one no
        live GC renews (a crafted one, or one whose GC was stopped or cut off), and
        the save goes on.  An entry that keeps changing is a live GC: waited for up
        to ``deadline_s``, then an error.
        """
        deadline = time.monotonic() + deadline_s
        delay = 0.02
        while True:
            try:
                entry = read_entry(self.objects, entry_id)
            except ValueError:
                entry = None
            if entry is None or not entry.active(time.time()):
                break
            unchanged = time.monotonic() - first_seen(entry)
            if unchanged > FENCE_STALE_S:
                log.warning("gc journal entry %s has not changed for %.0fs: no live gc"
                            " renews it; its objects are written again", entry_id, unchanged)
                break
            if time.monotonic() > deadline:
                raise BackendError(
                    f"a gc run (journal entry {entry_id}) has been deleting objects this"
                    f" save needs for {deadline_s:.0f}s; is it stuck? (see `gc/` in the store)")
            time.sleep(delay)
            delay = min(delay * 2, 1.0)
        # Applied, then counted, then dropped from ``active``, in that order: a
        # worker that finds no active entry naming an object sees the index as
        # the entry left it, and a claim it took before then as stale.
        with self._apply_lock:
            gone = self.active.get(entry_id)
            if gone is not None:
                self.index.apply_journal(entry_id, gone.objects())
                self.generation += 1
                del self.active[entry_id]


def sync_journal(objects: ObjectStore, index: Index) -> Fence:
    """Apply finished journal entries to ``index``; return the still-active ones.

    Called by a save after its session object is stored, by GC, and when a store
    is opened.  An index that may have missed entries GC has since pruned (its
    last sync is older than the horizon) forgets every dedup target first.  What
    changes in the index is written in one transaction, and only when something
    does change (an entry to apply, a sync time to lower, or one more than
    :data:`SYNC_REFRESH_S` old): opening a store takes no write transaction.  When
    another process holds the index's writer past the gate's deadline (stopped,
    say), nothing is written and the fence distrusts every index record.
    """
    started_ns = time.time_ns()
    listing = list_journal(objects)
    fence = Fence(objects, index)
    synced = index.journal_synced()
    forget = missed_pruned(objects, index, listing, synced)
    # Every marker listed is accounted for once this sync is recorded (named, clearly
    # before the last sync, or everything forgotten): recorded when that changes.
    markers = set(listing.horizon_names)
    new_markers = markers if markers != index.journal_markers() else None
    applied = index.journal_applied()
    listed = set(listing.entry_ids)
    # Applied entries the journal no longer holds (pruned): their ids need no record.
    pruned = [i for i in applied if i not in listed and entry_time_ns(i) < started_ns]
    covered_ns = started_ns  # every entry created before this is applied after this sync
    now = time.time()
    finished: list[JournalEntry] = []
    for entry_id in listing.entry_ids:
        if entry_id in applied:
            continue
        try:
            entry = read_entry(objects, entry_id)
        except ValueError:
            entry = None
        if entry is None:
            # Unreadable, or listed and gone: a GC pruned it since the listing, and its
            # horizon marker, stored after the listing, went unseen.  What it deleted is
            # not known: nothing is trusted now, and the index is not called synced past
            # it, so the next sync meets the horizon and forgets every record.
            fence.distrust_index = True
            covered_ns = min(covered_ns, entry_time_ns(entry_id))
            continue
        if entry.active(now):
            fence.active[entry_id] = entry
            fence.observe(entry)
            covered_ns = min(covered_ns, entry_time_ns(entry_id))
        else:
            finished.append(entry)
    stale = synced is None or covered_ns < synced \
        or covered_ns - synced > int(SYNC_REFRESH_S * 1e9)
    if forget or finished or stale or new_markers is not None \
            or len(pruned) >= STALE_APPLIED_MAX:
        try:
            index.record_journal_sync([(e.id, list(e.objects())) for e in finished],
                                      covered_ns, forget, wait_s=OPEN_WAIT_S,
                                      markers=new_markers, pruned=pruned)
        except WriterBusy:
            log.warning("the index at %s is busy (another process holds its writer): the"
                        " GC journal was read but not applied to it; its records are not"
                        " trusted for deduplication now", index.path)
            fence.distrust_index = True
    return fence


def finish_entry(objects: ObjectStore, entry: JournalEntry, index: Index) -> None:
    """Store a run's entry in its final state (``done`` or ``abandoned``), then: one that
    names nothing is deleted at once (no index has anything to learn from it; a save
    that listed it and finds it gone distrusts its index for that save, as for any
    entry gone between listing and read), and one that names objects is marked applied
    to the run's own index, which saw every deletion."""
    write_entry(objects, entry)
    if not entry.chunks and not entry.nodes:
        objects.delete(JOURNAL, entry.id)
        return
    index.mark_journal_applied([entry.id])


def _journal_is_own(objects: ObjectStore, index: Index, listing: Listing) -> bool:
    """Whether every entry and marker in the journal comes from GCs of ``index``: no
    other index has collected here for the week entries stay (its entries and markers
    would show it), so pruning early makes no other collecting index forget."""
    own = index.identity()
    for name in listing.horizon_names:
        named = marker_applied_by(objects, name)
        if named is None or own not in named:
            return False
    for entry_id in listing.entry_ids:
        try:
            entry = read_entry(objects, entry_id)
        except ValueError:
            return False
        if entry is not None and entry.info.get("index") != own:
            return False
    return True


def prune_journal(objects: ObjectStore, now: float, keep_s: float = JOURNAL_KEEP_S,
                  index: Index | None = None, keep: Iterable[str] = ()) -> int:
    """Delete finished entries older than ``keep_s``, and on a local store those
    ``index`` (the pruning GC's own) has applied, but for ``keep`` (the run's own
    entry), while the journal holds only entries and markers of that index's GCs;
    return how many.

    The horizon marker goes first: from the moment an entry may be missing,
    every index whose last sync is older knows it cannot trust its records,
    unless the marker names it.  It names ``index`` when that index applied every
    entry pruned now and had accounted for every marker the listing holds, by name
    (:meth:`~chunkstore.index.lmdbindex.Index.journal_markers`).  Early pruning is
    for local stores only (docs/format.md §11.2): the indexes of other machines,
    which no marker names, would forget every record at each of their syncs.
    """
    listing = list_journal(objects)
    cutoff_ns = int((now - keep_s) * 1e9)
    early = index is not None and objects.local_path() is not None \
        and _journal_is_own(objects, index, listing)
    applied = index.journal_applied() if index is not None else set()
    kept = set(keep)
    prunable = []
    for entry_id in listing.entry_ids:
        old = entry_time_ns(entry_id) < cutoff_ns
        if not old and not (early and entry_id in applied and entry_id not in kept):
            continue
        try:
            entry = read_entry(objects, entry_id)
        except ValueError:
            continue  # unreadable: left for an operator (saves distrust their index)
        if entry is not None and not entry.active(time.time()):
            prunable.append(entry_id)
    if not prunable:
        return 0
    horizon = max(*(entry_time_ns(e) for e in prunable), listing.horizon_ns or 0)
    named = index is not None and all(e in applied for e in prunable) \
        and set(listing.horizon_names) <= index.journal_markers()
    marker = f"{HORIZON_PREFIX}{horizon:020d}"
    objects.put(JOURNAL, marker, marker_body([index.identity() or ""] if index is not None
                                             and named else []))
    for name in listing.horizon_names:
        if name != marker:
            objects.delete(JOURNAL, name)
    for entry_id in prunable:
        objects.delete(JOURNAL, entry_id)
    if index is not None:
        index.record_journal_prune(marker if named else None, prunable)
    return len(prunable)
