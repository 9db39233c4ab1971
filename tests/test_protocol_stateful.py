"""The store protocol on real code: random sequences of saves, removals, GCs, index
deletions, rebuilds and readers on a local store seen by two "machines" (two
handles, each with its own index directory), checked with hypothesis.

After every step: every published version reads back exactly the arrays it
was saved with (read through a third handle with its own index, reconciled
from the store), and ``verify`` finds nothing wrong.  A reader opened on a
version keeps reading it exactly for as long as the grace period promises
(until a GC whose grace has run out since the version's removal).

The abstract protocol behind this is model-checked in test_protocol_model.py, and run
fencing (one writer per run) in test_runlease_model.py; the schedules those checkers
found are played at the end of this file on real code.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import chunkstore
from chunkstore.errors import RunInUseError, RunLeaseLostError, SavesInProgressError
from chunkstore.protocol.runlease import RunLease
from chunkstore.read.reader import VersionReader
from chunkstore.write.writer import VersionWriter

CHUNK = 4096
GRACE = 3600.0
MACHINES = (0, 1)


def _pool() -> list[np.ndarray]:
    """Arrays that share chunks with each other, so that saves deduplicate."""
    rng = np.random.default_rng(8)
    base = rng.standard_normal(3000).astype(np.float32)  # 3 chunks
    tail_changed = base.copy()
    tail_changed[2500:] += 1  # shares its first two chunks with base
    return [
        base,
        tail_changed,
        base[:1024].copy(),  # exactly base's first chunk
        rng.standard_normal(1500).astype(np.float32),
        np.arange(300, dtype=np.int64),
    ]


POOL = _pool()
NAMES = ("model.w", "model.b", "opt.m")
contents = st.dictionaries(st.sampled_from(NAMES), st.integers(0, len(POOL) - 1),
                           min_size=1, max_size=2)


class TwoMachines(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="cs-stateful-"))
        self.path = str(self.root / "store")
        self.stores = [self._open(m) for m in MACHINES]
        self.observer = chunkstore.open(self.path, index_dir=str(self.root / "index-observer"),
                                        create=True)
        self.steps = [0, 0]
        #: version id -> {name: pool index}, for every version published and not removed
        self.expected: dict[str, dict[str, int]] = {}
        #: version id -> removal time, for versions removed
        self.removed: dict[str, float] = {}
        #: open readers: (reader, version id, contents, still protected by the grace period)
        self.readers: list[list[object]] = []
        self.pending: dict[int, tuple[VersionWriter, dict[str, int]]] = {}

    def _open(self, machine: int) -> chunkstore.Store:
        return chunkstore.open(self.path, chunk_size=CHUNK,
                               index_dir=str(self.root / f"index-{machine}"), create=True)

    def teardown(self) -> None:
        for writer, _ in self.pending.values():
            writer.abort()
        for store in (*self.stores, self.observer):
            store.close()
        shutil.rmtree(self.root, ignore_errors=True)

    # --- saves ------------------------------------------------------------------------------

    def _next_step(self, machine: int) -> tuple[str, int]:
        self.steps[machine] += 1
        return f"m{machine}", self.steps[machine]

    @rule(machine=st.sampled_from(MACHINES), content=contents)
    def save(self, machine: int, content: dict[str, int]) -> None:
        run, step = self._next_step(machine)
        with self.stores[machine].new_version(run, step) as v:
            for name, i in content.items():
                v.put(name, POOL[i])
        self.expected[v.info.id] = content

    @precondition(lambda self: len(self.pending) < 2)
    @rule(machine=st.sampled_from(MACHINES), content=contents)
    def begin_save(self, machine: int, content: dict[str, int]) -> None:
        """A save that stays in progress (its session open) while other rules run."""
        if machine in self.pending:
            return
        run, step = self._next_step(machine)
        writer = self.stores[machine].new_version(run, step)
        for name, i in content.items():
            writer.put(name, POOL[i])
        # Let its chunk writes finish (every dedup decision taken, every chunk stored):
        # a write in flight would otherwise race the rules that follow in real time, which
        # the GC's shifted clock does not share (its sweep would take the write's young
        # temporary file for one hours old), and hypothesis needs runs to repeat.
        for tensor in writer._tensors.values():
            for future in tensor.futures:
                future.result()
        self.pending[machine] = (writer, content)

    @precondition(lambda self: bool(self.pending))
    @rule(data=st.data(), commit=st.booleans())
    def finish_pending(self, data: st.DataObject, commit: bool) -> None:
        """Commit a save in progress, or abort it (what it wrote becomes orphans)."""
        machine = data.draw(st.sampled_from(sorted(self.pending)))
        writer, content = self.pending.pop(machine)
        if commit:
            self.expected[writer.commit().id] = content
        else:
            writer.abort()

    # --- removal ----------------------------------------------------------------------------

    def _remove(self, version: str, machine: int) -> None:
        store = self.stores[machine]
        store.reconcile()  # what opening the store on that machine would do
        store.delete(version)
        self.expected.pop(version)
        self.removed[version] = time.time()

    @precondition(lambda self: bool(self.expected))
    @rule(data=st.data(), machine=st.sampled_from(MACHINES))
    def remove(self, data: st.DataObject, machine: int) -> None:
        self._remove(data.draw(st.sampled_from(sorted(self.expected))), machine)

    @precondition(lambda self: len(self.expected) > 1)
    @rule(machine=st.sampled_from(MACHINES))
    def remove_all(self, machine: int) -> None:
        """Retention gone wild: every version removed, so GC frees their objects."""
        for version in sorted(self.expected):
            self._remove(version, machine)

    # --- GC ---------------------------------------------------------------------------------

    def _gc(self, machine: int, grace: float, offset: float) -> None:
        # A save in progress in this process outlives any wait (rules run one at a time),
        # so the GC defers whatever the wait: keep it short then (a few polls).
        wait = 0.03 if self.pending else 5.0
        started = time.time()
        result = self.stores[machine].gc(grace=grace, clock=lambda: time.time() + offset,
                                         session_wait=wait)
        if result.deferred:
            assert self.pending, "gc deferred deletions with no save in progress"
        if offset - grace >= 0:  # the grace of every version removed so far has run out
            for reader in self.readers:
                if self.removed.get(str(reader[1]), started) < started:
                    reader[3] = False

    @rule(machine=st.sampled_from(MACHINES))
    def gc_no_grace(self, machine: int) -> None:
        self._gc(machine, 0.0, 0.0)

    @rule(machine=st.sampled_from(MACHINES), offset=st.sampled_from([0.0, 2 * GRACE]))
    def gc_with_grace(self, machine: int, offset: float) -> None:
        self._gc(machine, GRACE, offset)

    @rule(machine=st.sampled_from(MACHINES))
    def gc_interrupted(self, machine: int) -> None:
        """A GC whose first chunk deletion fails (a transient backend error)."""
        store = self.stores[machine]
        real_delete = store.backend.delete
        failed: list[str] = []

        def delete(key: str) -> bool:
            if key.startswith("chunks/") and not failed:
                failed.append(key)
                raise OSError("injected: backend error while deleting")
            return real_delete(key)

        store.backend.delete = delete  # type: ignore[method-assign]
        try:
            self._gc(machine, 0.0, 0.0)
        except OSError:
            assert failed
        finally:
            store.backend.delete = real_delete  # type: ignore[method-assign]

    # --- indexes ----------------------------------------------------------------------------

    @rule(machine=st.sampled_from(MACHINES))
    def delete_index(self, machine: int) -> None:
        if machine in self.pending:
            return
        self.stores[machine].close()
        shutil.rmtree(self.root / f"index-{machine}")
        self.stores[machine] = self._open(machine)

    @rule(machine=st.sampled_from(MACHINES))
    def rebuild_index(self, machine: int) -> None:
        if self.pending:
            with pytest.raises(SavesInProgressError):
                self.stores[machine].rebuild_index()
        else:
            self.stores[machine].rebuild_index()

    # --- readers ----------------------------------------------------------------------------

    @precondition(lambda self: bool(self.expected) and len(self.readers) < 3)
    @rule(data=st.data())
    def open_reader(self, data: st.DataObject) -> None:
        version = data.draw(st.sampled_from(sorted(self.expected)))
        self.observer.reconcile()
        reader = self.observer.open_version(version)
        self.readers.append([reader, version, self.expected[version], True])

    @precondition(lambda self: bool(self.readers))
    @rule(data=st.data())
    def read_reader(self, data: st.DataObject) -> None:
        reader, version, content, protected = self.readers.pop(
            data.draw(st.integers(0, len(self.readers) - 1)))
        assert isinstance(reader, VersionReader) and isinstance(content, dict)
        if protected:
            self._check(reader, content, f"reader of {version}")

    # --- invariant --------------------------------------------------------------------------

    @staticmethod
    def _check(reader: VersionReader, content: dict[str, int], what: str) -> None:
        assert sorted(reader.names()) == sorted(content), what
        for name, i in content.items():
            got = reader.get(name)
            assert got.dtype == POOL[i].dtype and np.array_equal(got, POOL[i]), (what, name)

    @invariant()
    def every_published_version_reads_back_exactly(self) -> None:
        self.observer.reconcile()
        listed = {v.id for v in self.observer.versions()}
        assert listed == set(self.expected), (listed, set(self.expected))
        for version, content in self.expected.items():
            self._check(self.observer.open_version(version), content, version)
        result = self.observer.verify()
        assert result.ok, [p.to_json() for p in result.problems]


TwoMachines.TestCase.settings = settings(
    max_examples=20, stateful_step_count=18, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_two_machines = TwoMachines.TestCase


def test_interrupted_gc_then_a_save_on_another_index(tmp_path: Path) -> None:
    """The sequence the model checker found (tests/protocol_model.py, ``finish_deletions_
    blindly``), on real code: a GC interrupted mid-delete leaves a DELETING record in its
    index; a version published meanwhile from another index reuses the object; the next GC
    on the first index must not delete it."""
    path = str(tmp_path / "store")
    a = chunkstore.open(path, chunk_size=CHUNK, index_dir=str(tmp_path / "index-a"), create=True)
    g = chunkstore.open(path, chunk_size=CHUNK, index_dir=str(tmp_path / "index-g"), create=True)
    try:
        with a.new_version("r", 1) as v:
            v.put("w", POOL[0])
        a.delete(v.info.id)
        real_delete_many = g.backend.delete_many
        failed: list[str] = []

        def delete_many(keys: Sequence[str]) -> None:  # GC deletes in bulk
            if any(key.startswith("chunks/") for key in keys) and not failed:
                failed.extend(keys)
                raise OSError("injected: backend error while deleting")
            real_delete_many(keys)

        g.backend.delete_many = delete_many  # type: ignore[method-assign]
        with pytest.raises(OSError):
            g.gc(grace=0, session_wait=5)
        g.backend.delete_many = real_delete_many  # type: ignore[method-assign]
        with a.new_version("r", 2) as v:
            v.put("w", POOL[0])
        g.gc(grace=0, session_wait=5)
        result = a.verify()
        assert result.ok, [p.to_json() for p in result.problems]
        assert np.array_equal(a.open_version(v.info.id).get("w"), POOL[0])
    finally:
        a.close()
        g.close()


# --- run fencing: the schedules tests/test_runlease_model.py found, on real code ------------


def _fenced_save(store: chunkstore.Store, lease: RunLease, step: int,
                 array: np.ndarray) -> chunkstore.VersionInfo:
    """A save of run ``r`` as the Checkpointer makes it: claim, check, commit record."""
    writer = store.new_version("r", step)
    writer.before_commit = lease
    writer.put("w", array)
    return writer.commit()


def test_a_stale_taker_does_not_continue_the_run_after_its_new_owner(tmp_path: Path) -> None:
    """A takes the run and is paused before its walk; B takes it over and saves step 1; A's
    walk then goes on.  Before, it fenced B's next slot, A saved step 2 (its check
    failed) and C's walk rolled it forward: the run held A's step 2 after B's step 1, and
    B had lost its run to A's fence.  Now A's walk finds generation 2 and gives up (it
    rolls nothing forward, fences nothing), and B's step 2 follows its step 1."""
    store = chunkstore.open(str(tmp_path / "store"), chunk_size=CHUNK, create=True)
    a, b, c = (RunLease(store.objects, "r") for _ in range(3))
    try:
        walk = a._fence
        a._fence = lambda: None  # type: ignore[method-assign]
        a.acquire()  # generation 1, and paused before its walk
        b.acquire(takeover=True)  # generation 2
        b1 = _fenced_save(store, b, 1, POOL[0])
        with pytest.raises(RunInUseError):
            walk()  # A's walk, before: rolled B1 forward and fenced B's next slot
        with pytest.raises(RunLeaseLostError):
            _fenced_save(store, a, 2, POOL[1])
        b2 = _fenced_save(store, b, 2, POOL[3])  # before: RunLeaseLostError
        c.acquire(takeover=True)  # generation 3: rolls the highest intent forward
        store.reconcile()
        assert [v.id for v in store.versions("r")] == [b1.id, b2.id]
    finally:
        for lease in (a, b, c):
            lease.release()
        store.close()


def test_a_removed_latest_version_stays_removed_at_the_next_launch(tmp_path: Path) -> None:
    """A run's latest version removed between two launches (``chunkstore rm r@1``) must not
    come back when the next launch takes the run (after a GC, the record would name
    deleted objects)."""
    store = chunkstore.open(str(tmp_path / "store"), chunk_size=CHUNK, create=True)
    first, second = RunLease(store.objects, "r"), RunLease(store.objects, "r")
    try:
        first.acquire()
        version = _fenced_save(store, first, 1, POOL[0])
        first.release()
        store.delete(version.id)
        second.acquire()
        store.reconcile()
        assert version.id not in {v.id for v in store.versions()}
    finally:
        second.release()
        store.close()
