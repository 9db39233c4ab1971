"""Writer leases with fencing: one writer per run, whatever pauses, kills or clocks do.

Two launches of one training job (a scheduler retry while the first still runs, a
copy-pasted command, a job paused past its lease and continued) would otherwise both
save to the run, and its history would mix two trajectories.  Three kinds of objects,
all under ``leases/`` (docs/format.md §11.5):

- ``<run>@gen-<N>`` (N zero-padded to 12 digits): **generation N** of the run, created
  put-if-absent by the writer that takes the run, rewritten by its heartbeat every
  :data:`HEARTBEAT_S`, marked ``released`` when it closes, never deleted.  The run
  belongs to the writer of its highest generation.
- ``<run>@slot-<N>``: **commit slot N**, created put-if-absent, never rewritten.  A
  writer's *intent* (its generation, the version id and the commit record's bytes),
  or a new owner's *fence* (its generation, no record).
- ``<run>``: the lease of earlier releases (format 1), still written (format 2: the
  generation added) so that they keep refusing a second writer; informative here.

**Taking the run** (:meth:`RunLease.acquire`):

1. List the generations; the highest, N, unless released, names the holder.  A live
   holder is an error naming it (:class:`RunInUseError`) unless ``takeover=True``.  A
   holder is gone when, on this host and pid namespace, its process is gone; seen
   from another host, when its generation object has not been rewritten for
   :data:`RUN_LEASE_S` *by the store's clock*: the object's stored time against the
   stored time of a probe this process writes now.  No two machines' clocks are ever
   compared, so a launch whose clock runs ahead takes nothing.  A damaged object (not
   JSON, a directory) is set aside with :class:`LeaseSetAsideWarning`.
2. Create generation N + 1 put-if-absent: of two takers one wins, the other is
   refused.  From here on every writer of an older generation is stale.
3. Walk the slots: the highest, if an intent, is rolled forward (its commit record
   created put-if-absent with the very bytes its writer would create), then the next
   slot is fenced put-if-absent; a fence that loses to an intent rolls that intent
   forward and fences the next.  The new owner's own commits start after its fence.
   Before each roll-forward and once the fence is placed, the taker checks that
   generation N + 2 does not exist (:class:`RunInUseError`): a taker paused in its
   walk must not walk on past a newer owner's slots (tests/runlease_model.py found
   the run going on from the writer that had lost it).  A version withdrawn (below)
   is not rolled forward.  Only then does the caller restore (it sees the
   rolled-forward version).

**Committing** (:meth:`RunLease.claim`, then :meth:`RunLease.check`, both called by the
writer with every object durable, right before the commit record): claim the writer's
next slot with its intent, put-if-absent (a lost race is :class:`RunLeaseLostError`);
then check that generation N + 1 does not exist (else :class:`RunLeaseLostError`:
nothing is published); then create the commit record.  After a claim the writer
deletes its slot two below (the walk needs only the highest).

**Why no interleaving breaks it.**  Let writer A hold generation g and B create g + 1.
A creates a commit record only after its claim of slot k succeeded *and* a later check
found no generation g + 1: so B's creation of g + 1 follows A's claim, and B's walk,
which lists the slots after that creation, sees slot k.  No slot above k exists then
(slots are claimed one above the last, and the only slots ever deleted lie two below
the highest), so k is the highest: B rolls A's record forward itself and fences k + 1,
and restores from it.  A's later PUT of the same bytes changes nothing; A's next claim
(k + 1) meets the fence, or, if A's counter points at a deleted slot, its check meets
generation g + 1: A publishes nothing more.  A claim that B's walk did not see
followed B's creation of g + 1, so its check fails and its record is never created
(unless it is the highest slot, which the walk rolls forward: at worst the save in
flight at a takeover is published by the taker, before anything of the taker's).  So
the run's commit records are, in slot order, one chain: each owner's versions follow
every version of the owners before it, and no stale writer publishes after a takeover.
One RUN@STEP then has one version as long as each owner saves increasing steps from
what it restored (a step saved again replaces the older version, as before).

A writer that was paused between its check and its PUT is covered: the PUT publishes
the record B already rolled forward.  And if B (or anyone) removed that version before
A is continued (retention, or B saving the same step again, which replaces it), A's
PUT creates a record of a removed version, perhaps of a second version of its
RUN@STEP, whose objects a GC may have deleted.  So B names every version it rolls
forward, before its PUT, in a marker ``<run>@rolled-<id>``; a removal of a version so
named, or of one whose intent is the run's highest slot (the next walk would roll it
forward: a latest version removed between two launches), first writes
``<run>@withdrawn-<id>`` (:func:`needs_withdrawal`, :func:`withdraw`), then deletes
the record.  A record of a withdrawn version is never a version: A, whose PUT created it,
finds the marker right after (:meth:`RunLease.confirm`), deletes the record and
reports the run lost; an index that finds it (A killed before that) deletes it
instead of counting it in (:func:`~chunkstore.maintenance.reconcile.count_in`).
Every listing goes through an index, so no reader ever sees it.

A taker's walk may also have read an intent before a removal of its version looked
for the markers, and name it rolled forward after: the owner claimed its next slot in
between (so the intent is no longer the highest) and removed the version (retention;
tests/runlease_model.py found it, with a third launch).  The slot the walk read is
still there when the removal looks (:class:`Withdrawals`), so a removal withdraws
every version whose intent is in any slot.  The walk also looks for the version's
tombstone once its marker is written, which every removal writes before it looks for
the markers; alone that look would not do: a GC deletes the tombstone after the grace
period (at once with ``gc --grace 0``), and a walk paused past it created the record
of a version whose objects that GC deleted.  A removal of many versions looks at the
markers and the slots once, after all their tombstones.  Saves that do not go through
a lease (the low-level ``new_version``, releases before this protocol) are not fenced.

**What a walk rolls forward is whole.**  A writer killed after its claim leaves an
intent whose objects no version reaches and whose save session is dead: a GC would
collect them once the grace period is over, and a later takeover's walk would create a
record naming objects that are gone.  So a GC keeps the tree of every intent in any
slot whose version is not withdrawn (:func:`pending_roots`, marked by
:func:`chunkstore.maintenance.mark.mark_pending`), as it keeps a read lease's, in both
of its marks and *before* it lists the commit records.  Why that suffices: the intent's
objects were durable when its slot was claimed, and slots are never rewritten.  A slot
a mark's listing finds keeps its tree (induction over deletions: the first object of it
a GC deletes was reached by that GC's mark).  A slot the listing does not find was
deleted before, which happens only once the slot two above it is claimed, by its own
writer after it published the version, or by a newer owner whose walk rolled it
forward (or found it removed) first: so its record was created before the listing of
the commit records that follows, which marks it, or it was removed since (its
tombstone marks it for the grace period, and it is withdrawn).  A withdrawn version is
never rolled forward, so its intent keeps nothing: ``rm RUN@latest`` frees its data.
The cost: a killed writer's claimed save holds its new objects until the run's next
takeover publishes it (then retention governs it); a GC that marks adds a listing of
``leases/`` and a read of each slot (two or three per run), twice.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import threading
import time
import uuid
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from chunkstore.errors import (
    ChunkStoreError,
    FormatVersionError,
    LeaseSetAsideWarning,
    RunInUseError,
    RunLeaseLostError,
)
from chunkstore.format import plaindata
from chunkstore.format.digest import Digest
from chunkstore.format.records import CommitRecord
from chunkstore.index.lmdbindex import pid_namespace
from chunkstore.objects.kinds import LEASES, TOMBSTONES, VERSIONS
from chunkstore.protocol.published import write_marker
from chunkstore.protocol.sessions import owner_info, owner_is_dead

if TYPE_CHECKING:
    from chunkstore.objects.objectstore import ObjectStore

#: Format of the lease object ``leases/<run>`` and of generation objects (2: generations).
LEASE_FORMAT = 2
SLOT_FORMAT = 1
#: Format of the ``@rolled-`` and ``@withdrawn-`` markers.
MARKER_FORMAT = 1
#: Environment variable: seconds without a heartbeat (by the store's clock) after which
#: a run's writer on another machine counts as gone.
RUN_LEASE_ENV_VAR = "CHUNKSTORE_RUN_LEASE"
RUN_LEASE_S = float(os.environ.get(RUN_LEASE_ENV_VAR, "60"))
HEARTBEAT_S = min(10.0, RUN_LEASE_S / 6)
#: This process's clock for the times a lease records (``since``, ``heartbeat``: for
#: people); no decision rests on it.  Tests offset it to play a machine whose clock is off.
clock: Callable[[], float] = time.time
_NUMBER = re.compile(r"[0-9]{12}")
_MAX_SLOT_WALK = 10_000


def _name(run: str, what: str, number: int) -> str:
    return f"{run}@{what}-{number:012d}"


def rolled_name(run: str, version_id: str) -> str:
    """``<run>@rolled-<id>``: a taker rolled this version forward; its writer, if it
    was stopped before its own PUT, may still create the record."""
    return f"{run}@rolled-{version_id}"


def withdrawn_name(run: str, version_id: str) -> str:
    """``<run>@withdrawn-<id>``: that version was removed after it was rolled forward;
    a record of it found later is its stopped writer's late PUT, never a version."""
    return f"{run}@withdrawn-{version_id}"


def needs_withdrawal(objects: ObjectStore, run: str, version_id: str) -> bool:
    """Whether removing the version must withdraw it: a taker rolled it forward (its
    stopped writer may still PUT it), or its intent is in one of the run's commit slots
    (a walk may have read it, or may yet: the next one rolls the highest forward).  See
    :class:`Withdrawals`."""
    return Withdrawals(objects, run).needed(version_id)


class Withdrawals:
    """Which of a run's versions a removal must withdraw, from one look at the run's
    lease objects: a listing of its slots, a read of each (the discards keep two or
    three, and a fence each takeover), a listing of its ``@rolled-`` markers.

    Made after the tombstone of every version it is asked about is written, and after
    they were listed as published.  A version is withdrawn when a marker names it, or
    when its intent is in any slot, not only the highest: a taker's walk may have read
    that slot while it was the highest and be paused before its marker (the owner
    claimed the slot above since).  Its later look for the tombstone does not cover
    that walk alone: a GC deletes the tombstone once the grace period is over (at once
    with ``gc --grace 0``), and then the walk would create the record of a version
    whose objects are gone.  The slot such a walk read is still there: a slot is deleted
    only once the slot two above it is claimed, and the writer that claims it took the
    run after the walk read the slot (an older one's claims fail their check from the
    walk's generation on, and the walk's own check before its marker fails if a newer
    one exists then), so its walk found this intent the highest and named it rolled
    forward before that claim (the removal then finds the marker), or found the intent
    above it and fenced the slot two above, which is never claimed.

    - a marker written since its listing names a version a walk rolls forward after
      that; the walk looks for the tombstone next, finds it and rolls nothing forward;
    - a slot claimed since holds a fence or a version saved since, none of those asked
      about (each of them was published, its slot claimed, before this look).

    A slot that cannot be read (gone since the listing, or damaged: set aside) names no
    version.
    """

    def __init__(self, objects: ObjectStore, run: str) -> None:
        self._intents = frozenset(
            (_read(objects, _name(run, "slot", number), SLOT_FORMAT) or {}).get("version")
            for number in _numbers(objects, run, "slot"))
        prefix = f"{run}@rolled-"
        self._rolled = frozenset(name[len(prefix):] for name in objects.ids(LEASES, prefix))

    def needed(self, version_id: str) -> bool:
        """Whether removing ``version_id`` (of this run) must withdraw it first."""
        return version_id in self._rolled or version_id in self._intents


def withdraw(objects: ObjectStore, run: str, version_id: str) -> None:
    """Before a rolled-forward version's record is deleted: mark it withdrawn, so that
    a late PUT of it by its stopped writer is never counted in (:func:`withdrawn`)."""
    objects.put(LEASES, withdrawn_name(run, version_id), json.dumps(
        {"format_version": MARKER_FORMAT, "version": version_id}, sort_keys=True).encode())


def withdrawn(objects: ObjectStore) -> frozenset[str]:
    """The ids of every withdrawn version (one listing of ``leases/``)."""
    return frozenset(name.rpartition("@withdrawn-")[2] for name in objects.ids(LEASES)
                     if "@withdrawn-" in name)


def pending_roots(objects: ObjectStore) -> list[Digest]:
    """The root of every intent in any run's commit slots whose version is not withdrawn:
    what a GC keeps, so that the walk that rolls the intent forward publishes a whole
    version (one listing of ``leases/`` and a read of each slot; see
    :func:`chunkstore.maintenance.mark.mark_pending` for the order that makes it safe).
    A slot that cannot be read or whose record does not check protects nothing: no walk
    rolls it forward."""
    names = list(objects.ids(LEASES))
    gone = {name.rpartition("@withdrawn-")[2] for name in names if "@withdrawn-" in name}
    roots = set()
    for name in names:
        run, _, number = name.rpartition("@slot-")
        if not run or not _NUMBER.fullmatch(number):
            continue
        try:  # as the walk reads it (_read, _roll_forward): what it skips, this skips
            intent = plaindata.load_json(objects.get(LEASES, name))
        except (ValueError, OSError):  # discarded since (a claim two above), damaged
            continue
        version, record = (intent.get("version"), intent.get("record")) \
            if isinstance(intent, dict) else (None, None)
        if not isinstance(version, str) or not isinstance(record, str) or version in gone:
            continue  # a fence, or a version removed since
        try:
            roots.add(CommitRecord.decode(version, record.encode()).root)
        except ChunkStoreError:
            continue  # set aside by the walk too
    return sorted(roots, key=lambda digest: digest.raw)


def _numbers(objects: ObjectStore, run: str, what: str) -> list[int]:
    prefix = f"{run}@{what}-"
    return sorted(int(name[len(prefix):]) for name in objects.ids(LEASES, prefix)
                  if _NUMBER.fullmatch(name[len(prefix):]))


def _read(objects: ObjectStore, name: str, supported: int | None = LEASE_FORMAT
           ) -> dict[str, Any] | None:
    """A lease object as stored; None when absent or set aside (damaged: warned).  One of
    a format newer than ``supported`` is refused (:class:`FormatVersionError`): its
    writer follows rules this release does not know (None: read it anyway, to name its
    holder in a message)."""
    try:
        data = plaindata.load_json(objects.get(LEASES, name))
    except FileNotFoundError:
        return None
    except (ValueError, OSError) as exc:  # not JSON, too deep, a directory, unreadable
        reason = f"{type(exc).__name__}: {exc}"
    else:
        if isinstance(data, dict):
            found = data.get("format_version")
            if supported is not None and type(found) is int and found > supported:
                raise FormatVersionError(f"leases/{name}", found, supported)
            return data
        reason = f"a JSON {type(data).__name__}, not an object"
    warnings.warn(LeaseSetAsideWarning(f"leases/{name}", reason), stacklevel=3)
    return None


def read_lease(objects: ObjectStore, run: str) -> dict[str, Any] | None:
    """What holds the run now: its highest generation unless released, else a lease of an
    earlier release; None when nobody does."""
    return _holder(objects, run)[0]


def _holder(objects: ObjectStore, run: str) -> tuple[dict[str, Any] | None, str, int]:
    """(the holder, the object that tells whether it lives, the highest generation)."""
    top = max(_numbers(objects, run, "gen"), default=0)
    if top:
        info = _read(objects, _name(run, "gen", top))
        if info is not None and info.get("released") is not True:
            return info, _name(run, "gen", top), top
    legacy = _read(objects, run)
    if legacy is not None and "generation" not in legacy:  # an earlier release's writer
        return legacy, run, top
    return None, run, top


def _on_this_host(info: dict[str, Any]) -> bool:
    pid = info.get("pid")
    return (info.get("host") == socket.gethostname() and isinstance(pid, int)
            and not isinstance(pid, bool) and 0 < pid < 2**31
            and info.get("pidns") == pid_namespace())


def describe_holder(info: dict[str, Any], now: float) -> str:
    since = info.get("since")
    beat = info.get("heartbeat")
    parts = [f"host {info.get('host', '?')}", f"pid {info.get('pid', '?')}"]
    if isinstance(since, (int, float)) and not isinstance(since, bool) and math.isfinite(since):
        parts.append("since " + time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)))
    if isinstance(beat, (int, float)) and not isinstance(beat, bool) and math.isfinite(beat):
        parts.append(f"last heartbeat {max(0.0, now - beat):.0f} s ago (its clock)")
    return ", ".join(parts)


class RunLease:
    """A run's writer lease held by this process (see the module docstring).  Called, it
    checks the lease (:meth:`check`): the writer's ``before_commit``."""

    def __init__(self, objects: ObjectStore, run: str, purpose: str = "checkpointer") -> None:
        self.objects = objects
        self.run = run
        self.token = uuid.uuid4().hex
        self.generation = 0
        self._info: dict[str, Any] = {"format_version": LEASE_FORMAT, "run": run,
                                      "token": self.token, "purpose": purpose,
                                      **owner_info()}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._next_slot = 0
        self.held = False
        #: what the lease replaced: None, or the holder taken over (gone or not)
        self.took_over: dict[str, Any] | None = None
        #: the version of the highest intent the walk found (rolled forward if needed)
        self.head: str | None = None

    # --- taking the run ---------------------------------------------------------------------

    def acquire(self, *, takeover: bool = False) -> None:
        """Hold the run, or raise :class:`RunInUseError` naming its live holder."""
        holder, name, top = _holder(self.objects, self.run)
        if holder is not None and not takeover and not self._gone(holder, name):
            self._refuse(holder)
        self.generation = top + 1  # judged the holder of ``top``: taken only if still next
        now = clock()
        self._info.update(generation=self.generation, since=now, heartbeat=now)
        if not self.objects.put_if_absent(LEASES, _name(self.run, "gen", self.generation),
                                          self._body()):
            taker = _read(self.objects, _name(self.run, "gen", self.generation), None) or {}
            raise RunInUseError(self.run, taker, (
                f"run {self.run!r} was just taken by another process"
                f" ({describe_holder(taker, clock())})"))
        self.took_over = holder
        self.held = True
        self._fence()
        self._write_legacy()
        self._thread = threading.Thread(target=self._beat, name="chunkstore-run-lease",
                                        daemon=True)
        self._thread.start()

    def _refuse(self, holder: dict[str, Any]) -> None:
        here = holder.get("pid") == self._info["pid"] and holder.get("host") == self._info[
            "host"]
        raise RunInUseError(self.run, holder, (
            f"run {self.run!r} is being written by "
            + ("another Checkpointer of this process (close it first, or drop it: a"
               " collected one gives the run back)" if here else "another process")
            + f" ({describe_holder(holder, clock())}): a run has one writer. Wait for it to"
            " finish, pick another run name, or, if that job is gone (it counts as gone"
            f" once its process is, or, seen from another machine, {RUN_LEASE_S:.0f} s"
            " after its last heartbeat reached the store), pass takeover=True"))

    def _gone(self, holder: dict[str, Any], name: str) -> bool:
        if _on_this_host(holder):
            return owner_is_dead(holder, clock(), math.inf)  # the process, nothing else
        age = self._stored_age(name)
        return age is None or age > RUN_LEASE_S

    def _stored_age(self, name: str) -> float | None:
        """Seconds since ``name`` was last written, by the store's clock alone: its stored
        time against that of a probe written now.  None when it is gone."""
        try:
            then = self.objects.stat(LEASES, name).mtime
        except FileNotFoundError:
            return None
        probe = f"{self.run}@probe-{self.token}"
        self.objects.put(LEASES, probe, b"{}")
        try:
            return self.objects.stat(LEASES, probe).mtime - then
        finally:
            self.objects.discard(LEASES, probe)

    def _fence(self) -> None:
        """Roll the highest intent forward and fence the slot above it (module docstring,
        step 3); this writer's commits start above the fence.  Before each roll-forward
        and once the fence is placed, the run must still be this generation's: a taker
        paused in its walk must not walk on past a newer owner's slots."""
        slot = max(_numbers(self.objects, self.run, "slot"), default=0)
        if slot:
            self._roll_forward(slot)
        fence = json.dumps({"format_version": SLOT_FORMAT, "generation": self.generation,
                            "token": self.token}, sort_keys=True).encode()
        for _ in range(_MAX_SLOT_WALK):
            slot += 1
            if self.objects.put_if_absent(LEASES, _name(self.run, "slot", slot), fence):
                self._next_slot = slot + 1
                self._still_next()
                return
            self._roll_forward(slot)  # a stale writer's claim won the race: it goes first
        raise RunInUseError(self.run, {}, f"run {self.run!r}: more than {_MAX_SLOT_WALK}"
                            " commit slots claimed while this process took the run")

    def _still_next(self) -> None:
        """:class:`RunInUseError` when a newer generation took the run during the walk."""
        newer = _name(self.run, "gen", self.generation + 1)
        if self.objects.exists(LEASES, newer):
            self.held = False
            taker = _read(self.objects, newer, None) or {}
            raise RunInUseError(self.run, taker, (
                f"run {self.run!r} was taken by another process while this one took it"
                f" ({describe_holder(taker, clock())})"))

    def _roll_forward(self, slot: int) -> None:
        """Publish the intent in ``slot`` (if it is one, and its version was not removed
        since: withdrawn) as its writer would."""
        intent = _read(self.objects, _name(self.run, "slot", slot), SLOT_FORMAT)
        version, record = (intent or {}).get("version"), (intent or {}).get("record")
        if not isinstance(version, str) or not isinstance(record, str):
            return  # a fence, or set aside
        data = record.encode()
        try:
            if CommitRecord.decode(version, data).run != self.run:
                return
        except ChunkStoreError as exc:
            warnings.warn(LeaseSetAsideWarning(f"leases/{_name(self.run, 'slot', slot)}",
                                               str(exc)), stacklevel=3)
            return
        self._still_next()
        if self.objects.exists(LEASES, withdrawn_name(self.run, version)):
            return  # published and removed since (a late PUT of it is never counted in)
        # Named first: whoever removes the version from now on withdraws it instead.
        self.objects.put(LEASES, rolled_name(self.run, version), json.dumps(
            {"format_version": MARKER_FORMAT, "generation": self.generation,
             "token": self.token, "version": version}, sort_keys=True).encode())
        # Then its tombstone: a removal that began before the marker was written (and so
        # may not have withdrawn it) wrote the tombstone before it looked for the marker.
        if self.objects.exists(TOMBSTONES, version):
            return
        write_marker(self.objects, version)  # as a save's: openers elsewhere count it in
        self.objects.flush()
        self.objects.put_if_absent(VERSIONS, version, data)
        self.head = version

    # --- committing -------------------------------------------------------------------------

    def claim(self, version_id: str, record: bytes) -> None:
        """Claim this writer's next commit slot for ``version_id`` (every object it needs
        durable): :class:`RunLeaseLostError` when a new owner fenced it."""
        slot = self._next_slot
        name = _name(self.run, "slot", slot)
        body = json.dumps({"format_version": SLOT_FORMAT, "generation": self.generation,
                           "token": self.token, "version": version_id,
                           "record": record.decode()}, sort_keys=True).encode()
        if not self.objects.put_if_absent(LEASES, name, body):
            found = _read(self.objects, name, SLOT_FORMAT) or {}
            if found.get("token") != self.token or found.get("version") != version_id:
                self.held = False
                raise RunLeaseLostError(self.run, self._successor())
        self._next_slot = slot + 1
        if slot > 2:
            self.objects.discard(LEASES, _name(self.run, "slot", slot - 2))

    def check(self) -> None:
        """Raise :class:`RunLeaseLostError` if a newer generation took the run."""
        if not self.held or self.objects.exists(LEASES, _name(self.run, "gen",
                                                              self.generation + 1)):
            self.held = False
            raise RunLeaseLostError(self.run, self._successor())

    __call__ = check

    def check_known(self) -> None:
        """:class:`RunLeaseLostError` if this process already knows the run was taken (a
        check or the heartbeat, which looks every :data:`HEARTBEAT_S`, found the newer
        generation): before a save writes anything, at no request; the commit checks
        the store itself (:meth:`check`)."""
        if not self.held:
            raise RunLeaseLostError(self.run, self._successor())

    def confirm(self, version_id: str) -> None:
        """Right after this writer's commit PUT *created* ``version_id``: if the run's
        new owner had rolled it forward and removed it meanwhile (this writer was
        stopped between :meth:`check` and its PUT), delete the record again and raise
        :class:`RunLeaseLostError`.  One existence check per save."""
        if not self.objects.exists(LEASES, withdrawn_name(self.run, version_id)):
            return
        # An opener elsewhere may have counted it in from its publication marker.
        write_marker(self.objects, version_id, removed=True)
        self.objects.flush()
        self.objects.discard(VERSIONS, version_id)
        self.held = False
        raise RunLeaseLostError(self.run, self._successor())

    def _successor(self) -> dict[str, Any] | None:
        return _read(self.objects, _name(self.run, "gen", self.generation + 1), None)

    # --- liveness and release ---------------------------------------------------------------

    def _body(self) -> bytes:
        return json.dumps(self._info, sort_keys=True).encode()

    def _write_legacy(self) -> None:
        """The lease object earlier releases honour (best effort: informative here)."""
        try:
            self.objects.put(LEASES, self.run, self._body())
        except OSError as exc:  # a directory in its place, say
            warnings.warn(LeaseSetAsideWarning(f"leases/{self.run}", str(exc)), stacklevel=3)

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                with self._lock:
                    if not self.held:
                        return
                    if self.objects.exists(LEASES, _name(self.run, "gen",
                                                         self.generation + 1)):
                        self.held = False  # taken over: the next save says so
                        return
                    self._info["heartbeat"] = clock()
                    self.objects.put(LEASES, _name(self.run, "gen", self.generation),
                                     self._body())
                    self.objects.put(LEASES, self.run, self._body())
            except Exception:  # a missed beat; the next one retries
                continue

    def release(self) -> None:
        """Stop the heartbeat, mark the generation released and delete the earlier
        releases' lease if it is still this one (idempotent)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        with self._lock:
            if not self.held:
                return
            self.held = False
            self._info["released"] = True
            self.objects.put(LEASES, _name(self.run, "gen", self.generation), self._body())
            legacy = _read(self.objects, self.run, None)
            if legacy is not None and legacy.get("token") == self.token:
                self.objects.discard(LEASES, self.run)
