"""``rm --purge``: the removed versions' unshared data is deleted at once, what others
share is reported (and which versions), and a save running meanwhile is not broken."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import chunkstore
from chunkstore.cli import cli
from chunkstore.errors import HeldVersionError
from chunkstore.maintenance.purge import PurgeResult
from chunkstore.objects.kinds import CHUNKS
from tests.conftest import tree_snapshot

SHARED = np.random.default_rng(1).standard_normal(60_000).astype(np.float32)


def _own(step: int) -> np.ndarray:
    return np.random.default_rng(100 + step).standard_normal(50_000).astype(np.float32)


def _save(store: chunkstore.Store, step: int) -> str:
    with store.new_version("r", step) as v:
        v.put("shared", SHARED)
        v.put("own", _own(step))
    return v.info.id


def _filled(path: Path, steps: int = 3) -> list[str]:
    with chunkstore.open(path, create=True, chunk_size=65536) as store:
        store.raw_tensor_bytes = 0
        return [_save(store, step) for step in range(steps)]


def _chunk_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in (path / CHUNKS.prefix).rglob("*") if p.is_file())


def test_purge_frees_the_unshared_bytes_and_names_the_versions_sharing_the_rest(
        tmp_path: Path) -> None:
    path = tmp_path / "s"
    ids = _filled(path)
    before = _chunk_bytes(path)
    with chunkstore.open(path) as store:
        own_bytes = store.resolve("r@1").new_stored_bytes
        result = store.purge("r@1")
        assert [i.id for i in result.removed] == [ids[1]]
        assert result.bytes_freed >= own_bytes > 0
        assert before - _chunk_bytes(path) == pytest.approx(own_bytes, rel=0.05)
        assert result.bytes_shared > 0 and result.objects_kept == 0
        assert set(result.shared_with) == {ids[0], ids[2]} and not result.shared_with_more
        assert [v.step for v in store.versions()] == [0, 2]
        assert store.verify().ok
        for step in (0, 2):
            np.testing.assert_array_equal(store.open_version(f"r@{step}").get("own"),
                                          _own(step))
        assert not list((path / "removed").glob("*"))  # its tombstone protects nothing


def test_purge_refuses_a_held_version_and_changes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "s"
    _filled(path, 2)
    with chunkstore.open(path) as store:
        store.hold("r@0", "evidence")
        before = tree_snapshot(path / "chunks") | tree_snapshot(path / "versions")
        with pytest.raises(HeldVersionError, match="evidence"):
            store.purge("r@0")
        assert tree_snapshot(path / "chunks") | tree_snapshot(path / "versions") == before


def test_purge_keeps_what_a_version_removed_earlier_still_reaches(tmp_path: Path) -> None:
    """Grace 0 is for the purged version only: a version removed before it keeps its
    grace period, for the data the two shared too."""
    path = tmp_path / "s"
    with chunkstore.open(path, create=True, chunk_size=65536) as store:
        store.raw_tensor_bytes = 0
        for step in range(2):
            with store.new_version("r", step) as v:
                v.put("shared", SHARED)  # only these two versions have it
        with store.new_version("r", 2) as v:
            v.put("other", _own(2))
        store.delete("r@0")  # a reader may still read it: the grace period
        result = store.purge("r@1")
        assert result.bytes_freed == 0 or result.objects_kept > 0
        assert result.objects_kept > 0 and result.bytes_kept > 0 and not result.shared_with
        assert store.gc(grace=0).bytes_freed >= result.bytes_kept  # later, it goes


def _purge_in_a_thread(store: chunkstore.Store, selector: str) -> tuple[threading.Thread,
                                                                         list[object]]:
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(store.purge(selector, session_wait=60.0))
        except Exception as exc:  # handed to the test
            outcome.append(exc)
    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


def test_a_purge_during_a_save_that_reuses_its_chunks_does_not_break_the_save(
        tmp_path: Path) -> None:
    """A save on another index deduplicates against the purged version's data before the
    purge fences it; the purge waits for the save's session and keeps what the new
    version needs.  (Checked: with the purge's wait for sessions removed, the save's
    version loses its data and this test fails.)"""
    path = tmp_path / "s"
    _filled(path, 2)
    purged = _own(1)  # r@1's pack holds it alone (r@0's pack holds SHARED too)
    with chunkstore.open(path) as a, \
            chunkstore.open(path, index_dir=str(tmp_path / "b")) as b:
        with b.new_version("r", 7) as v:
            v.put("own", purged)  # reuses r@0's chunks: no write
            thread, outcome = _purge_in_a_thread(a, "r@1")
            time.sleep(0.5)  # the purge is past its fence, waiting for this session
            assert thread.is_alive()
        thread.join(timeout=120)
        (result,) = outcome
        assert isinstance(result, PurgeResult), result
        assert result.gc is not None and result.gc.sessions_waited_for >= 1
        assert v.info.id in result.shared_with
        for store in (a, b):
            store.reconcile()
            np.testing.assert_array_equal(store.open_version("r@7").get("own"), purged)
            assert store.verify().ok


def test_rm_purge_reports_in_json(tmp_path: Path) -> None:
    path = tmp_path / "s"
    ids = _filled(path)
    out = CliRunner().invoke(cli, ["rm", str(path), "r@2", "--purge", "--json"])
    assert out.exit_code == 0, out.output
    body = json.loads(out.stdout)
    assert body["purged"] is True and [v["id"] for v in body["removed"]] == [ids[2]]
    assert body["bytes_freed"] > 0 and body["bytes_shared"] > 0
    assert set(body["shared_with"]) == {ids[0], ids[1]}
    text = CliRunner().invoke(cli, ["rm", str(path), "r@1", "--purge"]).stdout
    assert "freed" in text and ids[0][:12] in text
    assert "--purge" in CliRunner().invoke(cli, ["rm", "--help"]).output
