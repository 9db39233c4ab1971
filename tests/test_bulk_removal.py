"""Removal in bulk (chunkstore/handle/removal.py): ``prune`` and ``rm`` of many versions
write every tombstone, look at each run's lease objects once, delete the records in
one bulk delete and count them out of the index in one transaction.

Real files, a real LMDB index, real subprocesses killed by ``CHUNKSTORE_FAULT``; the
run leases are the real :class:`RunLease`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import chunkstore
from chunkstore.backends.wrappers import FAULT_ENV_VAR, RequestHook
from chunkstore.errors import InvalidInputError, RunLeaseLostError, SelectorError
from chunkstore.objects.kinds import LEASES, TOMBSTONES, VERSIONS
from chunkstore.protocol.runlease import RunLease, withdrawn_name

REPO_ROOT = Path(__file__).resolve().parent.parent
RUN = "r"


def _arrays(step: int) -> dict[str, np.ndarray]:
    return {"w": np.full(256, step, dtype=np.float32), "base": np.arange(512, dtype=np.int32)}


def _save(store: chunkstore.Store, step: int, lease: RunLease | None = None
          ) -> chunkstore.VersionInfo:
    writer = store.new_version(RUN, step)
    if lease is not None:  # a save as the Checkpointer makes it: claim, check, commit
        writer.before_commit = lease
    for name, array in _arrays(step).items():
        writer.put(name, array)
    return writer.commit()


def _filled(path: Path, steps: int) -> list[str]:
    with chunkstore.open(path, create=True) as store:
        return [_save(store, step).id for step in range(1, steps + 1)]


def _loads(store: chunkstore.Store, version_id: str) -> None:
    reader = store.open_version(version_id)
    for name, expected in _arrays(reader.info.step).items():
        assert reader.get(name).tobytes() == expected.tobytes(), (version_id[:12], name)


class Counting(RequestHook):
    """Requests by operation and kind of object (no background thread runs here)."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def request(self, operation: str, key: str) -> None:
        with self._lock:
            self.counts[f"{operation} {key.split('/', 1)[0]}"] += 1


def test_a_prune_of_many_removes_each_with_its_tombstone_and_keeps_the_rest(
        tmp_path: Path) -> None:
    ids = _filled(tmp_path / "s", 30)
    with chunkstore.open(tmp_path / "s") as store:
        counting = Counting(store.backend)
        store.backend = counting
        result = store.prune(keep_last=5)
        assert [v.id for v in result.removed] == ids[:25]
        assert [v.id for v in store.versions(RUN)] == ids[25:]
        assert sorted(store.stored_version_ids()) == sorted(ids[25:])
        assert all(store.objects.exists(TOMBSTONES, vid) for vid in ids[:25])
        # One bulk delete of the records, one look at the run's lease objects.
        assert counting.counts["delete_many versions"] == 1
        assert counting.counts["delete versions"] == 0
        assert counting.counts["list leases"] <= 2
        assert counting.counts["put removed"] == 25
        verified = store.verify()  # refcounts included: the index counted each one out
        assert verified.ok, [p.to_json() for p in verified.problems]
        store.gc(grace=0)
        verified = store.verify()
        assert verified.ok, [p.to_json() for p in verified.problems]
        for vid in ids[25:]:
            _loads(store, vid)


def test_rm_of_many_checks_every_selector_and_tag_before_removing_any(tmp_path: Path) -> None:
    ids = _filled(tmp_path / "s", 6)
    with chunkstore.open(tmp_path / "s") as store:
        store.tag(ids[3], "best")
        with pytest.raises(SelectorError):
            store.delete_many([ids[0], ids[1], "r@99"])
        with pytest.raises(InvalidInputError, match=rf"{ids[3][:8]}\w* is tagged best"):
            store.delete_many([ids[0], ids[3]])
        assert sorted(store.stored_version_ids()) == sorted(ids)
        assert not any(store.objects.exists(TOMBSTONES, vid) for vid in ids)
        removed = store.delete_many([ids[0], f"{RUN}@2", ids[0], ids[3]], force=True)
        assert [v.id for v in removed] == [ids[0], ids[1], ids[3]]
        assert sorted(store.stored_version_ids()) == sorted(ids[2:3] + ids[4:])
        assert store.tags() == {} and store.stored_tags() == {}


def test_a_bulk_removal_withdraws_the_rolled_forward_and_the_highest_intent_only(
        tmp_path: Path) -> None:
    """A saves r@1..4 under its lease; B takes the run over (rolling A's r@4 forward: its
    ``@rolled-`` marker) and saves r@5 and r@6 (the highest slot's intent).  Removing
    r@1, r@2, r@4 and r@6 in one call withdraws r@4 and r@6, and only them."""
    store = chunkstore.open(str(tmp_path / "s"), create=True)
    first, second = RunLease(store.objects, RUN), RunLease(store.objects, RUN)
    try:
        first.acquire()
        saved = [_save(store, step, first).id for step in range(1, 5)]
        second.acquire(takeover=True)
        assert second.head == saved[3]
        saved += [_save(store, step, second).id for step in (5, 6)]
        store.delete_many([saved[0], saved[1], saved[3], saved[5]])
        withdrawn = {vid for vid in saved
                     if store.objects.exists(LEASES, withdrawn_name(RUN, vid))}
        assert withdrawn == {saved[3], saved[5]}
        assert sorted(store.stored_version_ids()) == sorted([saved[2], saved[4]])
    finally:
        first.release()
        second.release()
        store.close()


def test_a_taker_does_not_roll_forward_a_version_removed_after_it_read_its_intent(
        tmp_path: Path) -> None:
    """The schedule tests/runlease_model.py found (``taker_checks_tombstone``): A owns the
    run and saved r@1; C takes the run and reads slot 2 (r@1's intent), paused there; A
    claims slot 3 for r@2 (its check then fails: C's generation exists), so r@1's intent
    is no longer the highest, and removes r@1 (no marker yet).  C's walk goes on: it
    named r@1 rolled forward and created its record again, before the removal withdrew
    every version whose intent is in a slot (and the walk looked for the tombstone)."""
    store = chunkstore.open(str(tmp_path / "s"), create=True)
    try:
        with removed_behind_a_paused_walk(store, _save) as (taker, version):
            # Withdrawn: its intent is still in slot 2, which a walk may have read (the
            # tombstone alone does not cover a walk that outlasts a GC's grace period:
            # test_removal_attacks' grace-0 test).
            assert store.objects.exists(LEASES, withdrawn_name(RUN, version.id))
            taker._roll_forward(2)  # the walk, from its read of slot 2 on
            assert not store.objects.exists(VERSIONS, version.id)
            assert taker.head is None
    finally:
        store.close()


Save = Callable[[chunkstore.Store, int, RunLease], chunkstore.VersionInfo]


@contextlib.contextmanager
def removed_behind_a_paused_walk(store: chunkstore.Store, save: Save
                                 ) -> Iterator[tuple[RunLease, chunkstore.VersionInfo]]:
    """The owner of run ``r`` saved r@1; a taker took the run (generation 2) and is
    paused before its walk; the owner's next save claimed slot 3 and lost the run; r@1
    was removed.  Yields the taker (``taker._roll_forward(2)`` continues its walk from
    its read of slot 2) and r@1; releases both leases after."""
    owner, taker = RunLease(store.objects, RUN), RunLease(store.objects, RUN)
    walk = taker._fence
    try:
        owner.acquire()
        version = save(store, 1, owner)
        taker._fence = lambda: None  # type: ignore[method-assign]
        taker.acquire(takeover=True)  # generation 2, paused before its walk
        with pytest.raises(RunLeaseLostError):
            save(store, 2, owner)  # claims slot 3, then finds generation 2
        store.delete(version.id)
        yield taker, version
    finally:
        taker._fence = walk  # type: ignore[method-assign]
        owner.release()
        taker.release()


def _prune_in_a_child(path: Path, fault: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != FAULT_ENV_VAR}
    if fault is not None:
        env[FAULT_ENV_VAR] = fault
    return subprocess.run([sys.executable, "-m", "chunkstore", "prune", str(path),
                           "--keep-last", "4"], env=env, cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120, check=False)


@pytest.mark.parametrize("fault", [
    "kill-before-put:removed/:0", "kill-before-put:removed/:5", "kill-after-put:removed/:11",
    "kill-before-delete:versions/:0", "kill-before-delete:versions/:6",
    "kill-after-delete:versions/:11",
])
def test_a_prune_killed_at_any_step_leaves_every_published_version_whole(
        tmp_path: Path, fault: str) -> None:
    """SIGKILL in the middle of a prune of 12 versions, among the tombstones or among
    the records' deletes: every version still published loads and verifies, every one
    whose record is gone has its tombstone, and the prune run again finishes the job."""
    path = tmp_path / "s"
    ids = _filled(path, 16)
    killed = _prune_in_a_child(path, fault)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    with chunkstore.open(path) as store:
        published = set(store.stored_version_ids())
        assert set(ids[12:]) <= published
        assert [v.id for v in store.versions(RUN)] == [vid for vid in ids if vid in published]
        for vid in published:
            _loads(store, vid)
        assert all(store.objects.exists(TOMBSTONES, vid) for vid in set(ids) - published)
        verified = store.verify()
        assert verified.ok, [p.to_json() for p in verified.problems]
        store.gc(grace=0)  # removed only what no published version reaches
        for vid in published:
            _loads(store, vid)
    finished = _prune_in_a_child(path, None)
    assert finished.returncode == 0, finished.stderr
    with chunkstore.open(path) as store:
        assert [v.id for v in store.versions(RUN)] == ids[12:]
        store.gc(grace=0)
        verified = store.verify()
        assert verified.ok, [p.to_json() for p in verified.problems]
        for vid in ids[12:]:
            _loads(store, vid)
