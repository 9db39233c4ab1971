"""The store protocol (docs/format.md section 11), model-checked over every interleaving.

:mod:`tests.protocol_model` models writers with their own indexes, GCs,
version removal, index deletion and rebuild, a reader and a clock; here it
is explored exhaustively on a few small worlds, each chosen so that its whole
reachable state space is explored (no depth cut), and:

- the protocol must be clean: no published version, no object a save in
  progress has obtained, and no version a reader opened within the grace
  period of its removal, ever references a deleted object;
- each ``break_*`` variant (one rule of the protocol broken) must be caught:
  the explorer finds, and prints, the shortest schedule that loses data.

``Protocol()`` is the protocol as the code implements it.  Three of its
choices (``wait_every_blocker``, ``gc_stops_when_lapsed``,
``finish_deletions_blindly``) were first implemented the unsafe way; this
explorer found a schedule losing data for each (two GCs at once; a GC paused
past the lease; a killed GC's deletions finished blindly), and the code was
changed.  ``Protocol().fixed()`` names the safe choices explicitly.
"""

from __future__ import annotations

import pytest

from tests.protocol_model import Config, Model, Protocol, Result, explore

# Two writers on their own indexes (x; x and y), one GC, a removal, an index
# deletion and a rebuild: the save/GC handshake with stale indexes.
SAVES = Config(contents=((0,), (0, 1)), gcs=1, writer_lapses=0, gc_lapses=0, gc_crashes=0)
# Two GCs on their own indexes at once, two writers.
TWO_GCS = Config(contents=((0,), (0, 1)), gcs=2, index_drops=0, rebuilds=0, writer_lapses=0,
                 gc_lapses=0, gc_crashes=0)
# Processes paused past the lease and killed: a writer, a GC that runs twice.
FAILURES = Config(contents=((0,),), gcs=1, gc_runs=2, index_drops=0, rebuilds=0)
# A grace period of one tick, a clock, a reader and tombstones.
GRACE = Config(contents=((0,), (0, 1)), gcs=1, grace=1, max_clock=2, reader=True,
               writer_lapses=0, gc_lapses=0, gc_crashes=0, index_drops=0, rebuilds=0)
WORLDS = {"saves": SAVES, "two_gcs": TWO_GCS, "failures": FAILURES, "grace": GRACE}

IMPLEMENTED = Protocol()
SAFE = Protocol().fixed()


def check(name: str, config: Config, protocol: Protocol) -> Result:
    result = explore(Model(config, protocol))
    print(f"\n[{name}] {', '.join(protocol.breaks()) or 'unbroken'}: {result.report()}")
    return result


@pytest.mark.parametrize("world", list(WORLDS))
def test_protocol_as_implemented_loses_nothing(world: str) -> None:
    result = check(world, WORLDS[world], IMPLEMENTED)
    assert result.violation is None, result.report()
    assert result.complete


@pytest.mark.parametrize("world", list(WORLDS))
def test_protocol_with_safe_choices_loses_nothing(world: str) -> None:
    result = check(world, WORLDS[world], SAFE)
    assert result.violation is None, result.report()
    assert result.complete, "the whole reachable space must be explored"
    assert result.states > 1000


# Each break, and a world small enough for it where the explorer must find a schedule.
BREAKS = {
    "break_session_wait": SAVES,
    "break_journal_before_session": SAVES,
    "break_ignore_fence": SAVES,
    "break_no_fence_wait": SAVES,
    "break_delete_before_journal": SAVES,
    "break_no_remark": SAVES,
    "break_rebuild_objects_first": SAVES,
    "break_publish_when_lapsed": FAILURES,
    "break_grace_from_write_time": GRACE,
    "break_record_before_tombstone": GRACE,
}


@pytest.mark.parametrize("broken", list(BREAKS))
def test_explorer_finds_the_schedule_of_each_break(broken: str) -> None:
    protocol = Protocol(**{broken: True}).fixed()
    result = check(broken, BREAKS[broken], protocol)
    assert result.violation is not None, f"{broken}: no schedule found"
    assert result.schedule


@pytest.mark.parametrize("unsafe", ["wait_every_blocker", "gc_stops_when_lapsed",
                                    "finish_deletions_blindly"])
def test_explorer_finds_the_schedule_of_each_unsafe_choice(unsafe: str) -> None:
    """Each of the three choices, alone made unsafe, loses data in some world."""
    flip = {unsafe: not getattr(SAFE, unsafe)}
    protocol = Protocol(**{**{f: getattr(SAFE, f) for f in (
        "wait_every_blocker", "gc_stops_when_lapsed", "finish_deletions_blindly")}, **flip})
    results = [check(name, config, protocol) for name, config in
               (("two_gcs", TWO_GCS), ("failures", FAILURES))]
    assert any(r.violation is not None for r in results), f"{unsafe}: no schedule found"


def test_model_sanity() -> None:
    """The model can do what the invariant is about: delete, dedup, publish, read."""
    model = Model(SAVES, SAFE)
    labels = set()
    seen = {model.initial()}
    frontier = [model.initial()]
    while frontier:
        nxt = []
        for s in frontier:
            for label, t in model.successors(s):
                labels.add(label)
                if t not in seen:
                    seen.add(t)
                    nxt.append(t)
        frontier = nxt
    for what in ("deletes x", "dedups x", "publishes", "writes y", "records seen",
                 "waited out entry", "index is deleted", "index rebuild lists objects x",
                 "abandons", "reads entry 0 (done"):
        assert any(what in label for label in labels), what
