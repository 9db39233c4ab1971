"""Power loss, not only SIGKILL (invariant 2): every state a power cut could leave
during a save, a tag and a removal, a GC, a repack, and a save that reuses objects
another writer left unsynced, on the local backend, opens,
reads back what was published, verifies, takes a save and collects
(``tools/crashstates.py`` builds and checks the states; ``tools/crashscenarios.py``
records the operations).  And the local backend's batched syncs only where syncfs
reports write-back errors.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from unittest import mock

import pytest

from chunkstore.backends import local
from chunkstore.backends.local import LocalBackend, syncfs_reports_errors
from tools.crashcheck import describe, explore
from tools.crashscenarios import SCENARIOS
from tools.crashstates import Recorder

#: Distinct states checked per operation (each twice: fresh index, index at the cut);
#: about 20 s in all on two cores.  ``python -m tools.crashscenarios`` checks them all.
BUDGET = {"save": 40, "two-filesystem save": 40, "tag+rm": 40, "prune+gc": 40, "gc": 40,
          "repack": 40, "mixed-sync save": 40}


@pytest.mark.parametrize("operation", list(SCENARIOS))
def test_every_power_cut_state_keeps_what_was_published(operation: str, tmp_path: Path) -> None:
    """For "mixed-sync save": a writer fsyncing object by object that lost the race to
    create an object fsynced its directory but not its data, left to a syncfs of the
    writer that created it, which gave up; a cut after the commit left the published
    version's chunks empty or truncated (the explorer's state: cut at the end, the
    first writer's chunk files empty or half)."""
    recording, expectations = SCENARIOS[operation](tmp_path / "store")
    report = explore(operation, recording, expectations, tmp_path / "states",
                     per_point=16, limit=BUDGET[operation])
    failures = [f"{describe(recording, state)}: {problems}"
                for state, problems in report.failures]
    assert not failures, "\n".join(failures)
    assert report.checked >= min(report.distinct, BUDGET[operation])
    assert report.crash_points > 1 and report.distinct > 1, report.summary()


def test_the_explorer_finds_a_save_that_publishes_before_its_objects_are_durable(
        tmp_path: Path) -> None:
    """The explorer's teeth: a local backend whose flush does nothing (deferred objects
    never synced before the commit record) leaves states where the published version
    has lost objects, or holds empty ones."""
    with mock.patch.object(LocalBackend, "flush", lambda self: None):
        recording, expectations = SCENARIOS["save"](tmp_path / "store")
    report = explore("save", recording, expectations, tmp_path / "states", per_point=8,
                     limit=24)
    published = [problems for state, problems in report.failures
                 if state.point == len(recording.ops)]
    assert published, report.summary()
    assert any("unreadable" in p or "reads back different" in p or "verify" in p
               for problems in published for p in problems)


@pytest.mark.parametrize(("release", "reports"), [
    ("5.4.0-150-generic", False), ("4.19.0", False), ("5.7.19", False), ("5.8.0", True),
    ("5.15.0-91-generic", True), ("6.18.44-fc-v1098", True), ("10.0", True), ("", False),
    ("unknown", False)])
def test_syncfs_is_trusted_from_linux_5_8(release: str, reports: bool) -> None:
    assert syncfs_reports_errors(release) is reports


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's system calls")
def test_syncfs_and_linkat_are_found_in_the_c_library_on_linux() -> None:
    """Without them a local store still saves durably, but an fsync per object and a
    named temp file per object (much slower): they must not go missing unnoticed."""
    assert local._SYNCFS is not None
    assert local._LINKAT is not None or not hasattr(os, "O_TMPFILE")


@pytest.mark.skipif(local._SYNCFS is None, reason="no syncfs(2) on this platform")
def test_before_linux_5_8_every_deferred_object_is_fsynced_on_its_own(tmp_path: Path) -> None:
    """syncfs(2) before 5.8 returns 0 when write-back failed: a save could publish
    objects the disk never took.  There the backend fsyncs each object and its
    directory instead of batching (it batched on every kernel)."""
    root = tmp_path / "s"
    with mock.patch.object(local.platform, "release", lambda: "5.4.0-150-generic"):
        backend = LocalBackend(str(root), batch_sync=True)
    assert not backend.batch_sync
    backend.put("config", b"x")  # the directories exist before the recording
    backend.put("chunks/ab/x", b"x")
    with Recorder(str(root)) as recorder:
        assert backend.put_if_absent_deferred("chunks/ab/ab01", b"small")
        backend.flush()
    kinds = [op.kind for op in recorder.recording.ops]
    assert "syncfs" not in kinds
    assert kinds[-2:] == ["names", "fsyncdir"] and "fsync" in kinds
    with mock.patch.object(local.platform, "release", lambda: "5.8.0"):
        assert LocalBackend(str(root), batch_sync=True).batch_sync


def test_the_explorer_finds_a_save_that_syncs_only_the_roots_file_system(
        tmp_path: Path) -> None:
    """Issue 46 item 11's observation, as the explorer models it: with ``chunks/`` on
    a file system of its own, a flush that syncfs's the root's file system alone
    leaves states, cut after the commit record, where the published version's chunk
    objects are gone or empty while its commit record is there."""
    root_only = local._one_per_device
    with mock.patch.object(local, "_one_per_device", lambda dirs: root_only(dirs)[:1]):
        recording, expectations = SCENARIOS["two-filesystem save"](tmp_path / "store")
    assert [op.device for op in recording.ops if op.kind == "syncfs"] == [0]
    report = explore("two-filesystem save", recording, expectations, tmp_path / "states",
                     per_point=8, limit=24)
    published = [problems for state, problems in report.failures
                 if state.point == len(recording.ops)]
    assert published, report.summary()


@pytest.mark.skipif(local._SYNCFS is None, reason="no syncfs(2) on this platform")
def test_flush_syncs_each_file_system_written_or_relied_on(tmp_path: Path) -> None:
    """One syncfs per file system (st_dev) a deferred write went to, or an object
    found by ``exists`` lives on (a save dedups against it), the root's always; all
    before the commit record, which is written after the flush."""
    root = tmp_path / "s"
    backend = LocalBackend(str(root), batch_sync=True)
    if not backend.batch_sync:
        pytest.skip("syncfs does not report write-back errors on this kernel")
    backend.put("config", b"x")  # the directories exist before the recording
    backend.put("chunks/ab/x", b"x")
    backend.put("nodes/cd/x", b"x")
    devices = {"chunks": 1, "nodes": 2}
    with Recorder(str(root), devices=devices) as recorder:
        assert backend.put_if_absent_deferred("chunks/ab/ab01", b"small")
        assert backend.put_if_absent_deferred("chunks/ab/ab02", b"small")
        backend.flush()
        backend.flush()  # nothing written since: the root's alone
        assert backend.exists("nodes/cd/x")  # another writer's object, relied on
        backend.flush()
    syncs = [op.device for op in recorder.recording.ops if op.kind == "syncfs"]
    assert syncs == [0, 1, 0, 0, 2]
    with Recorder(str(root), devices=devices) as recorder:
        assert backend.put_if_absent_deferred("chunks/ab/ab03", b"small")
        assert backend.put_if_absent_deferred("sessions/s1", b"s")
        backend.flush()
        backend.put_if_absent("versions/v1", b"commit")
    kinds = [(op.kind, op.device) for op in recorder.recording.ops
             if op.kind in ("syncfs", "names") and op.directory != "chunks/ab/"]
    syncs = [op.device for op in recorder.recording.ops if op.kind == "syncfs"]
    assert sorted(syncs) == [0, 1]
    commit = next(i for i, op in enumerate(recorder.recording.ops)
                  if op.kind == "names" and op.directory == "versions")
    assert all(i < commit for i, op in enumerate(recorder.recording.ops)
               if op.kind == "syncfs"), kinds
