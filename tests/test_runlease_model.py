"""Run fencing (chunkstore/protocol/runlease.py, docs/format.md 11.5), model-checked over
every interleaving of two to four writers of one run (:mod:`tests.runlease_model`).

- Two writers, the protocol as implemented, no removal: nothing breaks (one version
  per RUN@STEP, one chain, each taker restores from the newest version).
- Three writers, as implemented before the taker checked its generation in its walk
  (``BEFORE``; found by this model): a taker paused before its walk walks on past a
  newer owner's slots, fences the newer owner's next slot and saves a version whose
  check fails; a third taker rolls it forward, after the newer owner's version (19
  steps).  Each of the two checks that close it (``Fencing.fixed()``: the taker
  checks its generation before each roll-forward and once its fence is placed) is
  needed: without the first, a deleted slot claimed again by a stale writer and
  read by a stale taker gives two versions of RUN@1 (25 steps); without the second,
  the three-writer schedule comes back with a fourth writer (26 steps, slow).
- Each rule of the protocol broken alone, on top of the safe choices, is caught.
  The fence is the exception: without it the history stays one chain (a stale
  writer's claim in the new owner's first slot fails its check; the new owner then
  loses the run, RunLeaseLostError, instead of the stale writer).
- Removal: a stopped writer's PUT no longer re-creates a version the new owner
  rolled forward and removed (the withdrawal markers; without them it does).  A
  version removed while its intent is the run's highest slot was rolled forward
  again by the next walk (found by this model); the removal now withdraws it too, and
  the walk rolls forward nothing withdrawn (``withdraws_highest_intent``).
  tests/test_protocol_stateful.py plays both schedules on the real code.
- Removal with a third launch (found by this model): a taker that read the intent of
  the owner's A1, while the owner claimed its next slot (so A1's intent is no longer
  the highest) and removed A1 (nothing to withdraw yet), rolled A1 forward again.  The
  taker now looks for the version's tombstone once its ``@rolled-`` marker is written
  (``taker_checks_tombstone``): the removal wrote the tombstone before it looked for
  the marker, so one of the two sees the other's.  That held only while the tombstone
  did: with a GC that deletes it mid-walk (``gc_during_walks``: ``gc --grace 0``, or a
  walk paused past the grace period; readers have read leases, walks do not) A1 came
  back.  The removal now withdraws every version whose intent is in any slot
  (``withdraws_slot_intents``): with it nothing is lost however early tombstones go,
  with or without the tombstone check.  A bulk removal (a prune) checks the markers
  and the slots once per batch, after the batch's tombstones, and loses nothing
  (``batch``).
"""

from __future__ import annotations

import dataclasses
import functools

import pytest

from tests.protocol_model import Result, explore
from tests.runlease_model import Config, Fencing, Model, State

SAFE = Fencing().fixed()
#: The code makes every safe choice (the taker's checks and the removal's withdrawal of
#: the highest intent came after this model found what their absence loses).
IMPLEMENTED = SAFE
BEFORE = Fencing()

# Two writers, three saves each.
TWO = Config(saves=(3, 3))
# Three writers; the third may only take the run and roll forward.
STALE_TAKER = Config(saves=(1, 1, 0))
# Three writers, one save each; and more saves (the breaks' and the safe choices' worlds).
THREE = Config(saves=(1, 1, 1))
STALE_CLAIM = Config(saves=(1, 2, 0))
THREE_SAVES = Config(saves=(2, 2, 1))
# Four writers, two of which only take the run and roll forward (slow: 15-25 s; C and D
# are interchangeable, and explored as one, see Model.symmetric).
FOUR = Config(saves=(1, 1, 0, 0))
# A writer that saves once, and a taker that removes a version (it took the run over).
TAKER_REMOVES = Config(saves=(1, 0), removals=1, takers_remove=True)
# The same, but the writer itself may remove its version (``chunkstore rm RUN@latest``).
OWNER_REMOVES = Config(saves=(1, 0), removals=1)
# A writer that saves twice; a prune (or ``rm`` of several) removes two versions at once,
# with one look at the markers and the highest slot for both (chunkstore.handle.removal),
# by a taker or by the owner itself, and a third launch that only takes the run over.
TAKER_PRUNES = Config(saves=(2, 0, 0), removals=1, takers_remove=True, batch=2)
OWNER_PRUNES = Config(saves=(2, 0), removals=1, batch=2)
# The owner saves twice and removes a version (retention), a taker walks, and a GC may
# delete a tombstone at any time, walks included (``gc --grace 0``).
OWNER_REMOVES_GC_ANY_TIME = Config(saves=(2, 0), removals=1, gc_during_walks=True)


def check(name: str, config: Config, protocol: Fencing) -> Result:
    result, _ = _explored(config, protocol)
    print(f"\n[{name}] {', '.join(protocol.breaks()) or 'unbroken'}: {result.report()}")
    return result


@functools.cache
def _explored(config: Config, protocol: Fencing) -> tuple[Result, frozenset[str]]:
    """``config`` explored under ``protocol``, with the label of every transition taken
    (cached: the sanity test reads the labels of worlds the other tests explore)."""
    labels: set[str] = set()
    return explore(Model(config, protocol), labels=labels), frozenset(labels)


def test_the_code_makes_every_safe_choice() -> None:
    assert IMPLEMENTED == SAFE


def test_two_writers_as_implemented_lose_nothing() -> None:
    result = check("two", TWO, IMPLEMENTED)
    assert result.violation is None, result.report()
    assert result.complete, "the whole reachable space must be explored"
    assert result.states > 1000


def test_the_code_before_the_walks_checks_lost_the_run_to_a_stale_taker() -> None:
    """A took the run (gen 1) and was paused before its walk; B took it over (gen 2) and
    claimed a slot; A's walk rolls B's intent forward, fences B's next slot, restores
    from B's version and saves A2 (its check fails); C's walk rolls A2 forward: the run
    goes on from A, after B's version, and B's next save fails."""
    result = check("stale_taker", STALE_TAKER, BEFORE)
    assert result.violation == "A2 (gen 1) follows B1 (gen 2) of the writer that took the" \
                               " run from it", result.report()
    assert "A: rolls B1 forward: creates it" in result.schedule
    assert result.schedule[-1] == "C: rolls A2 forward: creates it"


@pytest.mark.parametrize("world", [
    "two", "three", "three_saves",
    pytest.param("four", marks=[pytest.mark.slow, pytest.mark.slow_job]),
])
def test_safe_fencing_loses_nothing(world: str) -> None:
    config = {"two": TWO, "three": THREE, "three_saves": THREE_SAVES, "four": FOUR}[world]
    result = check(world, config, SAFE)
    assert result.violation is None, result.report()
    assert result.complete, "the whole reachable space must be explored"
    assert result.states > 1000


# Each safe choice, alone made as the code makes it: (a) a stale taker listed slot 2 (B's
# fence), B claimed 3 and 4 and deleted 2, stale A claimed 2 again, the taker rolls A1
# forward: two versions of RUN@1; (b) the stale taker's schedule above, with a fourth writer.
# (c) A owns the run and saves A1; C takes it and reads slot 2 (A1's intent); A claims
# slot 3 for A2, so A1's is no longer the highest, and removes A1 (nothing to withdraw:
# no marker yet); C marks A1 rolled forward and creates its record again (the removal's
# withdrawal of every slot's intent and the taker's look for the tombstone each close it
# while tombstones outlive walks); (d) the same with a GC that deletes A1's tombstone
# mid-walk: the look for the tombstone no longer closes it.
UNSAFE_CHOICES = {
    "taker_checks_before_roll": (STALE_CLAIM, "two versions of RUN@1: A1 and B1"),
    "taker_checks_after_fence": (FOUR, "A2 (gen 1) follows B1 (gen 2)"),
    "taker_checks_tombstone": (TAKER_PRUNES, "A1 was removed and is there again"),
    "withdraws_slot_intents": (OWNER_REMOVES_GC_ANY_TIME, "A1 was removed and is there again"),
}
#: Choices that are needed only as a pair: each stands in for the other.
TOGETHER = {"taker_checks_tombstone": {"withdraws_slot_intents": False}}


@pytest.mark.parametrize("choice", [
    "taker_checks_before_roll", "taker_checks_tombstone", "withdraws_slot_intents",
    pytest.param("taker_checks_after_fence", marks=[pytest.mark.slow, pytest.mark.slow_job]),
])
def test_each_safe_choice_is_needed(choice: str) -> None:
    config, violation = UNSAFE_CHOICES[choice]
    result = check(choice, config, dataclasses.replace(
        SAFE, **{choice: False}, **TOGETHER.get(choice, {})))
    assert result.violation is not None and result.violation.startswith(violation), \
        result.report()


# Each rule broken, on top of the safe choices, in the smallest world that catches it.
BREAKS = {
    # two takers list gen 0 and both create gen 1: both pass every check
    "break_generation_overwrite": (Config(saves=(2, 2)), "two versions of RUN@1"),
    # A checks, B takes over, saves twice and deletes slot 2, A claims it: published
    "break_check_before_claim": (Config(saves=(2, 2)), "two versions of RUN@1"),
    "break_no_check": (Config(saves=(2, 2)), "two versions of RUN@1"),
    # B fences above A's intent in flight and restores without it; A's PUT publishes it
    "break_no_roll_forward": (Config(saves=(2, 2)), "two versions of RUN@1"),
    # a stale taker's fence covers B's intent in flight; C's walk sees only that fence
    "break_no_roll_on_fence_loss": (THREE, "two versions of RUN@1"),
    # B claims 3 and deletes 2 before its check; stale A claims 2; C rolls both forward
    "break_discard_one_below": (THREE, "two versions of RUN@1"),
    # A deletes its slots once published; B claims the same slot A's next claim meets free
    "break_discard_published": (Config(saves=(2, 1, 1)), "two versions of RUN@2"),
    # B rolls A1 forward and removes it; stopped A's PUT creates it again (before 5370498)
    "break_no_withdrawal": (TAKER_REMOVES, "A1 was removed and is there again"),
}


@pytest.mark.slow_job  # the model's own power: ./dev test-slow
@pytest.mark.parametrize("broken", list(BREAKS))
def test_explorer_finds_the_schedule_of_each_break(broken: str) -> None:
    config, violation = BREAKS[broken]
    result = check(broken, config, Fencing(**{broken: True}).fixed())
    assert result.violation is not None, f"{broken}: no schedule found"
    assert result.violation.startswith(violation), result.report()


def test_the_fence_decides_who_loses_not_what_is_published() -> None:
    """Without the taker's fence, a stale writer may claim the new owner's first slot:
    its check fails, so it publishes nothing, and the new owner loses the run instead."""
    protocol = Fencing(break_no_fence=True).fixed()
    result = check("no_fence", THREE, protocol)
    assert result.violation is None, result.report()
    assert result.complete


def test_a_stopped_writer_does_not_publish_a_withdrawn_version() -> None:
    """A stopped between its check and its PUT; B rolls A1 forward, restores from it and
    removes it (withdrawing it); A's PUT creates the record, finds the marker and deletes
    it again.  (Without the markers, ``break_no_withdrawal``, A1 is back.)"""
    result = check("taker_removes", TAKER_REMOVES, SAFE)
    assert result.violation is None, result.report()
    assert result.complete


def test_a_removed_latest_version_stays_removed() -> None:
    """The owner removes its latest version (``chunkstore rm RUN@latest``) and the next
    taker walks: the removal withdrew it (its intent is the highest slot), so the walk
    rolls nothing forward."""
    result = check("owner_removes", OWNER_REMOVES, SAFE)
    assert result.violation is None, result.report()
    assert result.complete


def test_without_withdrawing_the_highest_intent_a_removed_latest_version_comes_back() -> None:
    result = check("owner_removes", OWNER_REMOVES,
                   dataclasses.replace(SAFE, withdraws_highest_intent=False,
                                       withdraws_slot_intents=False))
    assert result.violation == "A1 was removed and is there again", result.report()
    assert "A: removes A1: writes the tombstones" in result.schedule
    assert result.schedule[-1] == "B: rolls A1 forward: creates it"


@pytest.mark.parametrize("world", ["taker_prunes", "owner_prunes"])
def test_a_bulk_removal_checked_once_loses_nothing(world: str) -> None:
    """One check of the markers and the highest slot for a batch of removals, the
    deletes after it in any order while writers and takers move: every removed version
    stays removed, and the history stays one chain."""
    config = TAKER_PRUNES if world == "taker_prunes" else OWNER_PRUNES
    result = check(world, config, SAFE)
    assert result.violation is None, result.report()
    assert result.complete


def test_a_bulk_removal_that_withdraws_no_highest_intent_brings_a_version_back() -> None:
    result = check("owner_prunes", OWNER_PRUNES,
                   dataclasses.replace(SAFE, withdraws_highest_intent=False,
                                       withdraws_slot_intents=False))
    assert result.violation == "A1 was removed and is there again", result.report()


def test_model_sanity() -> None:
    """The model does what fencing is about: refuse a second taker of one generation, roll
    an intent forward (or find it there), lose a fence to a claim and a claim to a fence,
    fail a check, delete a slot, and a taker lose the run at each of its checks."""
    labels: set[str] = set()
    for config in (TWO, THREE, TAKER_REMOVES, OWNER_REMOVES):
        result, found = _explored(config, SAFE)
        assert result.complete
        labels |= found
    for what in ("creates gen 2: there already, refused", "rolls A1 forward: creates it",
                 "rolls A1 forward: already there", "fences slot 2: taken",
                 "reads slot 1: a fence of gen 1", "taken (a fence of gen 2), lost",
                 "checks for A2: gen 2 exists, lost", "deletes slot 1", "restores from B1",
                 "checks before rolling A1 forward: gen 2 exists, lost",
                 "checks: gen 2 exists, lost", "puts the record of A1: already there",
                 "checks the markers for A1 (withdraws it)", "finds A1 withdrawn",
                 "finds A1 not withdrawn", "finds A1 withdrawn: rolls nothing forward"):
        assert any(what in label for label in labels), what


class _Unreduced(Model):
    def symmetric(self, s: State) -> State:
        return s


def test_two_writers_that_never_save_are_explored_as_one() -> None:
    """The reduction of Model.symmetric loses nothing: with writers B and C that only take
    the run, the reduced exploration is about half the whole one and takes every
    transition it takes (up to B and C's names).  (That it still finds a break's
    schedule, at the same depth, test_each_safe_choice_is_needed's FOUR world shows.)"""
    world = Config(saves=(1, 0, 0))
    runs = []
    for model in (Model(world, SAFE), _Unreduced(world, SAFE)):
        labels: set[str] = set()
        result = explore(model, labels=labels)
        assert result.complete and result.violation is None, result.report()
        runs.append((result.states, {label.replace("C:", "B:") for label in labels}))
    (reduced, seen), (whole, seen_whole) = runs
    assert reduced < 0.6 * whole
    assert seen == seen_whole



def test_a_tombstone_a_gc_deleted_mid_walk_lets_the_walk_bring_a_version_back() -> None:
    """The taker read A1's intent; A claimed slot 2 for A2 (its check fails), so A1's
    intent is no longer the highest, and removed A1 (no marker yet); a GC with grace 0
    deleted A1's tombstone; the walk names A1 rolled forward, finds no tombstone and
    creates A1's record again (whose objects that GC deleted).  Found by this model with
    the tombstone check alone (tests/test_removal_attacks.py plays it on the real code)."""
    result = check("owner_removes_gc_any_time", OWNER_REMOVES_GC_ANY_TIME,
                   dataclasses.replace(SAFE, withdraws_slot_intents=False))
    assert result.violation == "A1 was removed and is there again", result.report()
    assert "GC: deletes the tombstone of A1" in result.schedule


@pytest.mark.parametrize("tombstone_check", [True, False])
def test_withdrawing_every_slot_intent_needs_no_tombstone_to_outlive_a_walk(
        tombstone_check: bool) -> None:
    """A removal that withdraws every version whose intent is in a slot loses nothing
    however early a GC deletes the tombstones, and needs no look for the tombstone."""
    for config in (OWNER_REMOVES_GC_ANY_TIME,
                   dataclasses.replace(TAKER_PRUNES, gc_during_walks=True),
                   dataclasses.replace(OWNER_PRUNES, gc_during_walks=True)):
        result = check("gc_any_time", config, dataclasses.replace(
            SAFE, taker_checks_tombstone=tombstone_check))
        assert result.violation is None, result.report()
        assert result.complete
