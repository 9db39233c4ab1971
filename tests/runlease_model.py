"""An abstract model of run fencing (:mod:`chunkstore.protocol.runlease`, docs/format.md
11.5), explored over every interleaving by :func:`tests.protocol_model.explore`.

Nothing here imports chunkstore.  The world is one run and two to four **writers**
(launches of one job), each a process that may be paused between any two of its
requests for as long as the others like (a crash is a pause that never ends):

- **taking the run**: list the generations (the highest, N) -> create generation
  N + 1 put-if-absent (there already: refused, ``RunInUseError``) -> list the
  slots (the highest, h) -> read slot h -> if an intent, roll it forward (name
  it in its ``@rolled-`` marker, then create its commit record put-if-absent)
  -> fence slot h + 1 put-if-absent; a fence
  that loses reads the slot that beat it, rolls it forward if an intent, and
  fences the next one -> restore from the newest version the store holds (by
  step).  Whether the holder counts as gone plays no part: any writer may take
  over at any time (``takeover=True``, or a lease that ran out while its holder
  was paused);
- **committing** each of its saves, steps one after another from what it
  restored: claim its next slot with its intent put-if-absent (taken:
  ``RunLeaseLostError``) -> delete its slot two below, if any -> check that
  generation N + 2 does not exist (else ``RunLeaseLostError``) -> create its
  commit record put-if-absent -> if that created it, look for its
  ``@withdrawn-`` marker (there: delete the record again, ``RunLeaseLostError``).
  A writer that lost stops;
- with ``Config.removals``, a **remover**: a writer that has restored (only one
  that took the run over, with ``takers_remove``) removes any version of the run
  (retention, ``chunkstore rm``, a step saved again with ``replace``): its
  tombstone and the check for a ``@rolled-`` marker (there: write the
  ``@withdrawn-`` marker), then the record's deletion.  With ``Config.batch``, one
  removal takes several versions, as a prune does: one check for all of them, then
  each record's deletion, in any order, the other processes moving in between.  A
  record of a withdrawn version is never a version (an index deletes it instead of
  counting it in).  A GC deletes the tombstone of a removed version at any time, but
  not while a taker walks (a walk outlasts no grace period), unless
  ``Config.gc_during_walks`` (``gc --grace 0``, or a walk paused past it).

Versions are named by writer and step (``A2``); each knows its step, its parent
(what its writer restored or saved before it), its writer's generation and the
slot its intent claimed.  The invariants, checked after every step on the
versions the store holds (records not withdrawn):

1. **one version per RUN@STEP**;
2. **one chain**: in step order each version follows the one before it (that
   one is among its ancestors), and generations never go down: no version of a
   writer that lost the run sits after a version of the owner that took it.
   (runlease.py says "in slot order"; a deleted slot may be claimed again, so the
   model orders by step and checks the chain itself);
3. **a taker restores from the newest version**: a writer whose versions the
   store holds restored from the newest version of every older generation (one
   it rolled forward included).  Given 1 and 2 this always holds (a version of
   an older generation comes before the writer's first, which follows what it
   restored); checked anyway, as the issue states it;
4. **a removed version stays removed**.

Abstracted away: the heartbeat, release and the judgement of a holder's liveness
(no safety decision rests on them), the earlier releases' ``leases/<run>``,
claim retries (a claim that finds its own intent), damaged objects, saves without
a lease, and the index (a restore reads the store).  A listing is one step and
sees what exists at that moment (S3 lists are strongly consistent).

**What exploring it found** (tests/test_runlease_model.py): the code's taker
never asks whether it still holds the run while it walks, so with three writers
a taker that took the run and was paused before its walk (or in it) walks on
past the slots of a newer owner, rolls the newer owner's intent forward, fences
the newer owner's next slot (which then loses its run) and saves a version
whose check fails; a third taker rolls that version forward, and the run's
history goes on from a writer that lost it (19 steps).  Checking, as a writer
does after its claim, that generation N + 2 does not exist before each
roll-forward (``taker_checks_before_roll``) and once the fence is placed
(``taker_checks_after_fence``) loses nothing in any world explored here.  Both
are needed: without the first, a deleted slot claimed again by a stale writer,
and read by a stale taker that listed it as the highest before, gives two
versions of RUN@1 (three writers); without the second, the schedule above comes
back with four writers.

Removal: a writer paused between its check and its PUT, whose save the new owner
rolled forward and removed, created the record again when it was continued (the
gap the withdrawal markers of 5370498 close; ``break_no_withdrawal`` is that code).
What stays open: a version removed while its intent is still the run's highest
slot (the run's latest version, ``chunkstore rm RUN@latest``) is rolled forward
again by the next walk, with no concurrency at all: no taker had marked it, so
the removal withdrew nothing (after a GC, a record whose objects are gone).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, fields, replace
from typing import Any, NamedTuple

from tests.protocol_model import _fast_replace

LETTERS = "ABCD"
#: A writer's next step, by where it is; "refused", "lost" and "done" are final.
TAKE, CREATE, LIST, READ, MARK, ROLL, FENCE, RECHECK, RESTORE = (
    "take", "create", "list", "read", "mark", "roll", "fence", "recheck", "restore")
CLAIM, DISCARD, CHECK, PUT, CONFIRM, DROP = (
    "claim", "discard", "check", "put", "confirm", "drop")
FINAL = ("refused", "lost", "done")


@dataclass(frozen=True)
class Fencing:
    """What each writer does.  Defaults: the protocol as runlease.py implements it."""

    # --- where the protocol leaves room: the code makes the unsafe choice -----------------------
    #: Before it rolls an intent forward, the taker checks that generation N + 2 does not
    #: exist (else it lost the run: it rolls nothing forward and restores nothing).
    taker_checks_before_roll: bool = False
    #: Once its fence is placed, the taker checks that generation N + 2 does not exist
    #: (else it lost the run and restores nothing).
    taker_checks_after_fence: bool = False
    #: A removal also withdraws a version whose intent is the run's highest slot, and a
    #: walk rolls forward no withdrawn version.
    withdraws_highest_intent: bool = False
    #: Once it named the version rolled forward, the taker looks for its tombstone (a
    #: removal began) and then rolls nothing forward.
    taker_checks_tombstone: bool = False
    #: A removal withdraws a version whose intent is in any slot, not only the highest
    #: (a walk may have read that slot while it was the highest).
    withdraws_slot_intents: bool = False

    # --- one rule broken at a time --------------------------------------------------------------
    #: A taker creates its generation with a plain put (two takers may hold one).
    break_generation_overwrite: bool = False
    #: The writer checks the generation before it claims its slot, not after.
    break_check_before_claim: bool = False
    #: The writer never checks the generation (the slots alone fence it).
    break_no_check: bool = False
    #: The taker does not roll the highest slot's intent forward.
    break_no_roll_forward: bool = False
    #: A fence that loses to an intent moves on without rolling that intent forward.
    break_no_roll_on_fence_loss: bool = False
    #: The taker places no fence: its commits start right above the highest slot.
    break_no_fence: bool = False
    #: A writer deletes its own slot once its record is published (the slots keep only
    #: what is in flight), not its slot two below at its next claim.
    break_discard_published: bool = False
    #: A claim deletes the writer's slot one below, not two below.
    break_discard_one_below: bool = False
    #: A removal never withdraws a version rolled forward, and a writer whose PUT created
    #: its record does not look for a withdrawal (the code before 5370498).
    break_no_withdrawal: bool = False

    def fixed(self) -> Fencing:
        """This protocol with the safe choices: the taker checks its generation before
        each roll-forward and once its fence is placed."""
        return replace(self, taker_checks_before_roll=True, taker_checks_after_fence=True,
                       withdraws_highest_intent=True, taker_checks_tombstone=True,
                       withdraws_slot_intents=True)

    def breaks(self) -> list[str]:
        return [f.name for f in fields(self)
                if f.name.startswith("break_") and getattr(self, f.name)]


@dataclass(frozen=True)
class Config:
    """The world: per writer, how many saves it makes once it holds the run."""

    saves: tuple[int, ...] = (2, 2)
    removals: int = 0
    #: Only a writer that took the run over (generation 2 or later) removes versions.
    takers_remove: bool = False
    #: Versions one removal takes at once (a prune, ``rm`` of several): one check of
    #: the markers and the highest slot for all of them, then each record's deletion,
    #: a step apart, in any order (a bulk delete promises none).
    batch: int = 1
    #: A GC may delete a removed version's tombstone while a taker walks (``gc --grace
    #: 0``, or a walk paused past the grace period); else only between walks.
    gc_during_walks: bool = False
    max_depth: int | None = None  # explore() reads it: None explores everything


class Version(NamedTuple):
    name: str
    step: int
    parent: str | None
    gen: int
    slot: int


class Slot(NamedTuple):
    gen: int
    version: Version | None  # None: a fence


class Writer(NamedTuple):
    pc: str
    saves: int  # saves still to make once it holds the run
    gen: int = 0  # the generation it takes (known once it listed them)
    cursor: int = 0  # the slot its walk is at; then the slot of its next claim
    seen: Version | None = None  # the intent its walk read, to roll forward
    restored: bool = False
    base: str | None = None  # the version it restored from
    last: Version | None = None  # what its next save follows: restored, then its own
    pending: Version | None = None  # its save in flight


class State(NamedTuple):
    gens: int  # generations 1..gens exist (each created one above the highest listed)
    slots: tuple[Slot | None, ...]  # slot n at index n - 1; None: absent (or deleted)
    records: frozenset[Version]  # the commit records the store holds
    rolled: frozenset[str]  # versions with a ``@rolled-`` marker
    withdrawn: frozenset[str]  # versions with a ``@withdrawn-`` marker: never versions
    history: frozenset[Version]  # every commit record ever created
    removed: frozenset[str]
    tombstoned: frozenset[str]  # versions a removal wrote the tombstone of (kept: no GC)
    writers: tuple[Writer, ...]
    removals: int  # removals left
    #: a removal under way: the remover, the records left, whether it made its check
    removing: tuple[int, tuple[Version, ...], bool] | None


for _cls in (Writer, State):
    _cls._replace = _fast_replace(_cls)  # type: ignore[method-assign]


Step = tuple[str, State]


class Model:
    def __init__(self, config: Config, protocol: Fencing) -> None:
        self.config = config
        self.protocol = protocol
        self.save_order = self._save_order(protocol)
        self.discard_below = 1 if protocol.break_discard_one_below else 2
        self._steps = {TAKE: self._take, CREATE: self._create, LIST: self._list,
                       READ: self._read, MARK: self._mark, ROLL: self._roll,
                       FENCE: self._fence, CONFIRM: self._confirm,
                       RECHECK: self._recheck, RESTORE: self._restore, CLAIM: self._claim,
                       DISCARD: self._discard, CHECK: self._check, PUT: self._put,
                       DROP: self._drop}
        idle = [i for i, n in enumerate(config.saves) if n == 0]
        self._takers = (idle[0], idle[1]) if len(idle) == 2 and not config.removals else None
        self._by_restored: dict[Any, str | None] = {}
        self._by_records: dict[tuple[frozenset[Any], ...], tuple[
            str | None, list[Version], dict[str, str | None]]] = {}

    def symmetric(self, s: State) -> State:
        """One state for each pair of worlds that differ only by swapping two writers that
        never save (``Config.saves`` 0, no removals): they name no version, so which is
        which is only their letters (:func:`tests.protocol_model.explore` explores one).
        The order is by hash: any fixed choice within one exploration will do."""
        if self._takers is None:
            return s
        i, j = self._takers
        a, b = s.writers[i], s.writers[j]
        if a == b or hash(a) <= hash(b):
            return s
        writers = list(s.writers)
        writers[i], writers[j] = b, a
        return s._replace(writers=tuple(writers))

    @staticmethod
    def _save_order(p: Fencing) -> tuple[str, ...]:
        order = [CHECK, CLAIM, DISCARD, PUT] if p.break_check_before_claim \
            else [CLAIM, DISCARD, PUT] if p.break_no_check else [CLAIM, DISCARD, CHECK, PUT]
        if not p.break_no_withdrawal:
            order.append(CONFIRM)
        if p.break_discard_published:
            order.remove(DISCARD)
            order.append(DROP)
        return tuple(order)

    def initial(self) -> State:
        writers = tuple(Writer(TAKE, n) for n in self.config.saves)
        none: frozenset[str] = frozenset()
        return State(0, (), frozenset(), none, none, frozenset(), none, none, writers,
                     self.config.removals, None)

    # --- the invariants ---------------------------------------------------------------------

    def violation(self, s: State) -> str | None:
        # Most states differ from others only in where the writers are, so what the
        # records alone decide is computed once per set of records (frozensets keep their
        # hashes): a fifth of the exploring time before.
        records = (s.records, s.withdrawn, s.removed, s.history)
        known = self._by_records.get(records)
        if known is None:
            known = self._by_records[records] = self._records_violation(s)
        bad, held, parents = known
        if bad:
            return bad
        restored = tuple((i, w.gen, w.base) for i, w in enumerate(s.writers) if w.restored)
        if not restored:
            return None
        key = (records, restored)
        if key not in self._by_restored:
            self._by_restored[key] = _restored_from_older(s, held, parents)
        return self._by_restored[key]

    @staticmethod
    def _records_violation(s: State) -> tuple[str | None, list[Version], dict[str, str | None]]:
        held = _held(s)
        parents = {v.name: v.parent for v in s.history}
        for a, b in itertools.combinations(held, 2):
            if a.step == b.step:
                return f"two versions of RUN@{a.step}: {a.name} and {b.name}", held, parents
        back = [v.name for v in held if v.name in s.removed]
        if back:
            return f"{back[0]} was removed and is there again", held, parents
        return _one_chain(held, parents), held, parents

    # --- steps --------------------------------------------------------------------------------

    def successors(self, s: State) -> list[Step]:
        out: list[Step] = []
        for i, w in enumerate(s.writers):
            if w.pc not in FINAL:
                label, t = self._steps[w.pc](s, i, w)
                out.append((f"{LETTERS[i]}: {label}", t))
        out.extend(self._removals(s))
        return out

    @staticmethod
    def _with(s: State, i: int, w: Writer, **changes: Any) -> State:
        return s._replace(writers=(*s.writers[:i], w, *s.writers[i + 1:]), **changes)

    def _lost(self, s: State, i: int, w: Writer, label: str) -> Step:
        return f"{label}, lost", self._with(s, i, w._replace(pc="lost"))

    # --- taking the run -----------------------------------------------------------------------

    def _take(self, s: State, i: int, w: Writer) -> Step:
        return (f"lists the generations (highest {s.gens})",
                self._with(s, i, w._replace(pc=CREATE, gen=s.gens + 1)))

    def _create(self, s: State, i: int, w: Writer) -> Step:
        if s.gens >= w.gen and not self.protocol.break_generation_overwrite:
            return (f"creates gen {w.gen}: there already, refused",
                    self._with(s, i, w._replace(pc="refused")))
        return (f"creates gen {w.gen}",
                self._with(s, i, w._replace(pc=LIST), gens=max(s.gens, w.gen)))

    def _list(self, s: State, i: int, w: Writer) -> Step:
        top = max((n for n, slot in enumerate(s.slots, 1) if slot), default=0)
        label = f"lists the slots (highest {top})"
        if top and not self.protocol.break_no_roll_forward:
            return label, self._with(s, i, w._replace(pc=READ, cursor=top))
        return label, self._with(s, i, self._past(w, top))

    def _past(self, w: Writer, slot: int) -> Writer:
        """The walk is done with ``slot``: fence the next one (unfenced: claim it)."""
        return w._replace(pc=RESTORE if self.protocol.break_no_fence else FENCE,
                          cursor=slot + 1, seen=None)

    def _read(self, s: State, i: int, w: Writer) -> Step:
        slot = _slot(s, w.cursor)
        if slot is None or slot.version is None:
            what = "gone" if slot is None else f"a fence of gen {slot.gen}"
            return f"reads slot {w.cursor}: {what}", self._with(s, i, self._past(w, w.cursor))
        return (f"reads slot {w.cursor}: intent of {slot.version.name}",
                self._with(s, i, w._replace(pc=MARK, seen=slot.version)))

    def _mark(self, s: State, i: int, w: Writer) -> Step:
        """Name the version rolled forward (``@rolled-``), before its record's PUT."""
        assert w.seen is not None
        if self.protocol.taker_checks_before_roll and s.gens > w.gen:
            return self._lost(s, i, w, f"checks before rolling {w.seen.name} forward: gen"
                                       f" {w.gen + 1} exists")
        if self.protocol.withdraws_highest_intent and w.seen.name in s.withdrawn:
            return (f"finds {w.seen.name} withdrawn: rolls nothing forward",
                    self._with(s, i, self._past(w, w.cursor)))
        return (f"marks {w.seen.name} rolled forward",
                self._with(s, i, w._replace(pc=ROLL), rolled=s.rolled | {w.seen.name}))

    def _roll(self, s: State, i: int, w: Writer) -> Step:
        """Look for the version's tombstone (with ``taker_checks_tombstone``), then create
        its record.  One step: a removal whose tombstone comes between the two found the
        ``@rolled-`` marker (written before the look) and withdrew the version."""
        assert w.seen is not None
        if self.protocol.taker_checks_tombstone and w.seen.name in s.tombstoned:
            return (f"finds {w.seen.name} removed (its tombstone): rolls nothing forward",
                    self._with(s, i, self._past(w, w.cursor)))
        label, t = _publish(s, w.seen)
        return f"rolls {w.seen.name} forward: {label}", self._with(t, i, self._past(w, w.cursor))

    def _fence(self, s: State, i: int, w: Writer) -> Step:
        if _slot(s, w.cursor) is None:
            after = RECHECK if self.protocol.taker_checks_after_fence else RESTORE
            return (f"fences slot {w.cursor}",
                    self._with(s, i, w._replace(pc=after, cursor=w.cursor + 1),
                               slots=_put_slot(s, w.cursor, Slot(w.gen, None))))
        label = f"fences slot {w.cursor}: taken"
        if self.protocol.break_no_roll_on_fence_loss:
            return label, self._with(s, i, w._replace(cursor=w.cursor + 1))
        return label, self._with(s, i, w._replace(pc=READ))

    def _recheck(self, s: State, i: int, w: Writer) -> Step:
        if s.gens > w.gen:
            return self._lost(s, i, w, f"checks: gen {w.gen + 1} exists")
        return f"checks: no gen {w.gen + 1}", self._with(s, i, w._replace(pc=RESTORE))

    def _restore(self, s: State, i: int, w: Writer) -> Step:
        newest = max(_held(s), key=lambda v: v.step, default=None)
        w = w._replace(pc=self._next_save(w.saves), restored=True,
                       base=newest.name if newest else None, last=newest)
        return f"restores from {w.base or 'nothing'}", self._with(s, i, w)

    # --- committing ---------------------------------------------------------------------------

    def _next_save(self, saves: int) -> str:
        return self.save_order[0] if saves else "done"

    def _advance(self, w: Writer) -> Writer:
        """``w`` past the step of its save it is at: the next one, or the next save."""
        rest = self.save_order[self.save_order.index(w.pc) + 1:]
        if rest and rest[0] == DISCARD and w.pending and w.pending.slot <= self.discard_below:
            rest = rest[1:]  # no slot that far below
        if rest:
            return w._replace(pc=rest[0])
        return w._replace(pc=self._next_save(w.saves - 1), saves=w.saves - 1, pending=None)

    @staticmethod
    def _version(i: int, w: Writer) -> Version:
        """The save in flight: the step after what the writer restored or saved last."""
        if w.pending is not None:
            return w.pending
        step = w.last.step + 1 if w.last else 1
        return Version(f"{LETTERS[i]}{step}", step, w.last.name if w.last else None, w.gen,
                       w.cursor)

    def _claim(self, s: State, i: int, w: Writer) -> Step:
        v = self._version(i, w)
        taken = _slot(s, w.cursor)
        if taken is not None:
            what = f"intent of {taken.version.name}" if taken.version else "a fence"
            return self._lost(s, i, w, f"claims slot {w.cursor} for {v.name}: taken ({what}"
                                       f" of gen {taken.gen})")
        return (f"claims slot {v.slot} for {v.name} (step {v.step})",
                self._with(s, i, self._advance(w._replace(pending=v, cursor=w.cursor + 1)),
                           slots=_put_slot(s, v.slot, Slot(w.gen, v))))

    def _discard(self, s: State, i: int, w: Writer) -> Step:
        assert w.pending is not None
        gone = w.pending.slot - self.discard_below
        return (f"deletes slot {gone}",
                self._with(s, i, self._advance(w), slots=_put_slot(s, gone, None)))

    def _check(self, s: State, i: int, w: Writer) -> Step:
        v = self._version(i, w)
        if s.gens > w.gen:
            return self._lost(s, i, w, f"checks for {v.name}: gen {w.gen + 1} exists")
        return (f"checks for {v.name}: no gen {w.gen + 1}",
                self._with(s, i, self._advance(w._replace(pending=v))))

    def _put(self, s: State, i: int, w: Writer) -> Step:
        assert w.pending is not None
        label, t = _publish(s, w.pending)
        after = self._advance(w._replace(last=w.pending))
        if after.pc == CONFIRM and t is s:  # it created nothing: nothing to confirm
            after = self._advance(after)
        return f"puts the record of {w.pending.name}: {label}", self._with(t, i, after)

    def _confirm(self, s: State, i: int, w: Writer) -> Step:
        """Right after its PUT created the record: withdrawn meanwhile, delete it again."""
        assert w.pending is not None
        v = w.pending
        if v.name in s.withdrawn:
            return self._lost(self._with(s, i, w)._replace(records=s.records - {v}), i, w,
                              f"finds {v.name} withdrawn, deletes its record")
        return f"finds {v.name} not withdrawn", self._with(s, i, self._advance(w))

    def _drop(self, s: State, i: int, w: Writer) -> Step:
        assert w.pending is not None
        return (f"deletes its slot {w.pending.slot}",
                self._with(s, i, self._advance(w), slots=_put_slot(s, w.pending.slot, None)))

    # --- removal ------------------------------------------------------------------------------

    def _removals(self, s: State) -> list[Step]:
        """A removal of ``Config.batch`` versions: their tombstones; then one check of the
        ``@rolled-`` markers and the highest slot for all of them (withdraw those it
        names); then, a step apart each, the records' deletions."""
        # A GC deletes the tombstone of a removed version once it is past its grace period;
        # unless gc_during_walks, no taker's walk outlasts that from its listing of the
        # slots to its look for the tombstone.
        walking = not self.config.gc_during_walks and any(
            w.pc in (READ, MARK, ROLL) for w in s.writers)
        expired = [] if walking else [
            (f"GC: deletes the tombstone of {name}", s._replace(tombstoned=s.tombstoned - {name}))
            for name in sorted(s.tombstoned & s.removed)]
        return expired + self._removal_steps(s)

    def _removal_steps(self, s: State) -> list[Step]:
        if s.removing is not None:
            i, left, checked = s.removing
            if not checked:
                return [self._check_removal(s, i, left)]
            return [(f"{LETTERS[i]}: deletes the record of {v.name}",
                     s._replace(records=s.records - {v}, removed=s.removed | {v.name},
                                removing=(i, tuple(u for u in left if u != v), True)
                                if len(left) > 1 else None)) for v in left]
        if not s.removals:
            return []
        least = 2 if self.config.takers_remove else 1
        out = []
        for i, w in enumerate(s.writers):
            held = _held(s)
            if not w.restored or w.gen < least or not held:
                continue
            for chosen in itertools.combinations(held, min(self.config.batch, len(held))):
                names = ", ".join(v.name for v in chosen)
                out.append((f"{LETTERS[i]}: removes {names}: writes the tombstones",
                            s._replace(removals=s.removals - 1, removing=(i, chosen, False),
                                       tombstoned=s.tombstoned | {v.name for v in chosen})))
        return out

    def _check_removal(self, s: State, i: int, chosen: tuple[Version, ...]) -> Step:
        top = max((n for n, slot in enumerate(s.slots, 1) if slot), default=0)
        highest = _slot(s, top)
        intents = {slot.version for slot in s.slots if slot is not None} \
            if self.protocol.withdraws_slot_intents else set()
        withdrawn = frozenset(v.name for v in chosen if (v.name in s.rolled or v in intents or (
            self.protocol.withdraws_highest_intent and highest is not None
            and highest.version == v)) and not self.protocol.break_no_withdrawal)
        names = ", ".join(v.name + (" (withdraws it)" if v.name in withdrawn else "")
                          for v in chosen)
        return (f"{LETTERS[i]}: checks the markers for {names}",
                s._replace(removing=(i, chosen, True), withdrawn=s.withdrawn | withdrawn))


def _held(s: State) -> list[Version]:
    """The run's versions: records not withdrawn, by step."""
    return sorted((v for v in s.records if v.name not in s.withdrawn),
                  key=lambda v: (v.step, v.name))


def _publish(s: State, v: Version) -> tuple[str, State]:
    if v in s.records:
        return "already there", s
    return "creates it", s._replace(records=s.records | {v}, history=s.history | {v})


def _restored_from_older(s: State, held: list[Version],
                         parents: dict[str, str | None]) -> str | None:
    """Invariant 3 (a writer whose versions the store holds restored from the newest
    version of every older generation)."""
    for i, w in enumerate(s.writers):
        if not w.restored or not any(v.gen == w.gen for v in held):
            continue
        upto = {w.base, *_ancestors(parents, w.base)}
        older = [v for v in held if v.gen < w.gen and v.name not in upto]
        if older:
            return (f"{LETTERS[i]} (gen {w.gen}) restored from {w.base or 'nothing'}, not"
                    f" from {older[-1].name} (gen {older[-1].gen})")
    return None


def _one_chain(held: list[Version], parents: dict[str, str | None]) -> str | None:
    """Invariant 2 (in step order, each version follows the one before it and
    generations never go down)."""
    for before, v in itertools.pairwise(held):
        if before.name not in _ancestors(parents, v.name):
            return f"the run's history forks: {v.name} does not follow {before.name}"
        if v.gen < before.gen:
            return (f"{v.name} (gen {v.gen}) follows {before.name} (gen {before.gen}) of the"
                    " writer that took the run from it")
    return None


def _ancestors(parents: dict[str, str | None], name: str | None) -> set[str]:
    found: set[str] = set()
    cur = parents.get(name) if name else None
    while cur is not None and cur not in found:
        found.add(cur)
        cur = parents.get(cur)
    return found


def _slot(s: State, n: int) -> Slot | None:
    return s.slots[n - 1] if 0 < n <= len(s.slots) else None


def _put_slot(s: State, n: int, slot: Slot | None) -> tuple[Slot | None, ...]:
    """The slots with slot ``n`` set (None: deleted)."""
    slots = s.slots + (None,) * (n - len(s.slots))
    slots = (*slots[:n - 1], slot, *slots[n:])
    while slots and slots[-1] is None:
        slots = slots[:-1]
    return slots


__all__ = ["Config", "Fencing", "Model"]
