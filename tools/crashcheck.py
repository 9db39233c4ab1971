"""Checking the power-cut states :mod:`tools.crashstates` builds: each in a directory
of its own, the store opens (with a fresh index, and with the index as the cut left
it), every version published before the cut reads back bit-exact, ``verify`` finds
no damage, a save of the interrupted operation's content publishes and reads back,
and a GC run a lease after the reboot completes without deferring and deletes
nothing a version needs (everything read back again).
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import chunkstore
from chunkstore.backends import local
from tools.crashstates import (
    FULL,
    Content,
    CrashState,
    Recording,
    crash_points,
    crash_states,
    distinct_states,
    nominal_count,
    unsynced,
)

#: A lease and a minute: the GC of a check runs this long after the cut.
REBOOT_SHIFT_S = 960.0


# --- 3. checking a state ------------------------------------------------------------------------


@dataclass
class Expectations:
    """What a state must satisfy: ``versions`` published before the operation (by
    id, with their content), the ids the operation publishes or starts to remove (from
    its marks), and ``redo``: the content of a save to make in the state (None: none)."""

    versions: dict[str, Content]
    published: dict[str, Content] = field(default_factory=dict)
    redo: Content | None = None
    tags: dict[str, str] = field(default_factory=dict)

    def at(self, recording: Recording, point: int) -> tuple[dict[str, Content], dict[str, str]]:
        """The versions that must read back at ``point``, and the tags that must name them."""
        expected = dict(self.versions)
        tags: dict[str, str] = {}
        for op in recording.ops[:point]:
            if op.kind != "mark":
                continue
            what, _, name = op.label.partition(" ")
            if what == "published":
                expected[name] = self.published[name]
            elif what == "removing":
                expected.pop(name, None)
            elif what == "tagged":
                tags[name] = self.tags[name]
        return expected, tags


@contextlib.contextmanager
def after_reboot(shift_s: float = REBOOT_SHIFT_S) -> Iterator[None]:
    """This process as seen after a reboot ``shift_s`` later: another boot (so the
    recorded process's session and index records are of a dead one) and the clock
    moved on past the lease."""
    real = time.time
    with mock.patch("chunkstore.protocol.sessions.pid_namespace", lambda: "rebooted"), \
            mock.patch("chunkstore.index.lmdbindex.pid_namespace", lambda: "rebooted"), \
            mock.patch("time.time", lambda: real() + shift_s):
        yield


def materialize(files: dict[str, bytes], root: Path) -> None:
    for path, data in files.items():
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)


def check_state(files: dict[str, bytes], expected: dict[str, Content], tags: dict[str, str],
                redo: Content | None, workdir: Path, index: Path | None = None) -> list[str]:
    """Problems of one crash state (empty: none); see the module docstring, step 3.
    ``index``: an index directory to open the store with (copied), else a fresh one."""
    if workdir.exists():
        shutil.rmtree(workdir)
    root, index_dir = workdir / "store", workdir / "index"
    materialize(files, root)
    if index is not None:
        shutil.copytree(index, index_dir)
    problems: list[str] = []
    with after_reboot():
        try:
            with chunkstore.open(root, create=False, index_dir=str(index_dir)) as store:
                _check_store(store, expected, tags, redo, problems)
        except Exception as exc:  # a state that cannot be opened is the finding
            problems.append(f"{type(exc).__name__}: {exc}")
    return problems


def _check_store(store: chunkstore.Store, expected: dict[str, Content], tags: dict[str, str],
                 redo: Content | None, problems: list[str]) -> None:
    _read_back(store, expected, problems, "after the cut")
    for name, version_id in tags.items():
        named = store.resolve(name).id
        if named != version_id:
            problems.append(f"tag {name} names {named[:12]}, not {version_id[:12]}")
    _verify(store, problems, "after the cut")
    expected = dict(expected)
    if redo is not None:
        try:
            with store.new_version("redo", 1) as version:
                for name, array in redo[0].items():
                    version.put(name, array)
                for name, data in redo[1].items():
                    version.put_data(name, data)
            expected[version.info.id] = redo
        except Exception as exc:
            problems.append(f"a save of the interrupted content failed: {type(exc).__name__}:"
                            f" {exc}")
    result = store.gc(grace=0, session_wait=2.0, clock=time.time)
    if result.deferred:
        problems.append(f"gc deferred {result.deferred} objects (sessions after a reboot)")
    _read_back(store, expected, problems, "after gc")
    _verify(store, problems, "after gc")


def _read_back(store: chunkstore.Store, expected: dict[str, Content], problems: list[str],
               when: str) -> None:
    for version_id, (arrays, data) in expected.items():
        try:
            reader = store.open_version(version_id)
            for name, array in arrays.items():
                got = reader.get(name)
                if got.dtype != array.dtype or got.tobytes() != array.tobytes():
                    problems.append(f"{when}: {version_id[:12]} {name} reads back different")
            for name, value in data.items():
                if reader.get_data(name) != value:
                    problems.append(f"{when}: {version_id[:12]} {name} data differs")
        except Exception as exc:
            problems.append(f"{when}: {version_id[:12]} unreadable: {type(exc).__name__}: {exc}")


def _verify(store: chunkstore.Store, problems: list[str], when: str) -> None:
    result = store.verify()
    if not result.ok:
        problems.extend(f"{when}: verify: {p}" for p in result.problems[:3])


# --- running an operation -----------------------------------------------------------------------


@dataclass
class Report:
    """What exploring one operation found."""

    operation: str
    calls: int
    crash_points: int
    nominal: int
    built: int = 0
    distinct: int = 0
    checked: int = 0
    #: States with a save session object in them: a GC right after the reboot waits a
    #: lease for it (its owner, of another boot, counts as another host's).
    sessions_left: int = 0
    failures: list[tuple[CrashState, list[str]]] = field(default_factory=list)

    def summary(self) -> str:
        return (f"{self.operation}: {self.calls} calls, {self.crash_points} crash points,"
                f" {self.nominal} states allowed, {self.built} built, {self.distinct} distinct,"
                f" {self.checked} checks (fresh index, index at the cut, index before),"
                f" {len(self.failures)} with problems; {self.sessions_left} leave a session"
                " object")


def explore(operation: str, recording: Recording, expectations: Expectations, workdir: Path,
            per_point: int = 16, limit: int | None = None, seed: int = 0) -> Report:
    """Build the crash states of ``recording`` and check them (at most ``limit``
    distinct ones, spread over the crash points)."""
    points = crash_points(recording.ops)
    report = Report(operation, sum(op.kind != "mark" for op in recording.ops), len(points),
                    nominal_count(recording))
    counted = _Counting(crash_states(recording, per_point, seed))
    states = list(distinct_states(recording, counted))
    report.built, report.distinct = counted.count, len(states)
    if limit is not None and len(states) > limit:
        states = random.Random(seed).sample(states, limit)
        states.sort(key=lambda s: s[0].point)
    for number, (state, files) in enumerate(states):
        expected, tags = expectations.at(recording, state.point)
        for label, index in _indexes(recording, state.point):
            problems = check_state(files, expected, tags, expectations.redo,
                                   workdir / f"state-{number}", index)
            shutil.rmtree(workdir / f"state-{number}", ignore_errors=True)
            report.checked += 1
            if problems:
                report.failures.append((state, [f"[{label}] {p}" for p in problems]))
        if any(path.startswith("sessions/") for path in files):
            report.sessions_left += 1
    return report


def _indexes(recording: Recording, point: int) -> list[tuple[str, Path | None]]:
    """The indexes to open a state with: a fresh one, the one the cut left, and the
    one from before the operation (stale: it knows nothing the operation did)."""
    found: list[tuple[str, Path | None]] = [("fresh index", None)]
    if point in recording.indexes:
        found.append(("index at the cut", Path(recording.indexes[point])))
    if point and 0 in recording.indexes:
        found.append(("index before the operation", Path(recording.indexes[0])))
    return found


class _Counting:
    def __init__(self, states: Iterator[CrashState]) -> None:
        self.states, self.count = states, 0

    def __iter__(self) -> Iterator[CrashState]:
        for state in self.states:
            self.count += 1
            yield state


def describe(recording: Recording, state: CrashState) -> str:
    """A crash state in words: where the cut fell and what it lost."""
    ops = recording.ops
    lost = [i for i in unsynced(recording, state.point)[0] if i not in state.kept]
    before = next((op.label for op in reversed(ops[: state.point]) if op.kind == "mark"),
                  "start")
    barrier = ops[state.point].kind if state.point < len(ops) else "end"
    names = [f"{path}{'' if inode is not None else ' (unlink)'}"
             for i in lost for path, inode in ops[i].changes
             if not os.path.basename(path).startswith(local.LocalBackend.TEMP_PREFIX)]
    data = [f"{n}:{share}" for n, share in state.data if share != FULL]
    return (f"cut before call {state.point} ({barrier}; last mark: {before});"
            f" lost names: {names or 'none'}; file data: {data or 'all'}")
