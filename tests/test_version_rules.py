"""One version per RUN@STEP; what a save refuses early; removing what cannot be read."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import chunkstore
from chunkstore.errors import CorruptRecordError, DuplicateStepError, InvalidInputError
from chunkstore.objects.kinds import TAGS, VERSIONS
from tests.conftest import tree_snapshot


def save(store: chunkstore.Store, step: int, value: float, **kwargs: object) -> str:
    with store.new_version("r", step, **kwargs) as version:  # type: ignore[arg-type]
        version.put("w", np.full(20_000, value, dtype=np.float32))
    return version.info.id


def test_saving_a_step_again_with_the_same_content_publishes_nothing(
        store: chunkstore.Store) -> None:
    first = save(store, 1, 1.0)
    again = save(store, 1, 1.0)
    assert again == first
    assert [v.id for v in store.versions()] == [first]


def test_saving_a_step_again_with_other_content_is_refused_and_changes_nothing(
        store: chunkstore.Store, store_path: Path) -> None:
    first = save(store, 1, 1.0)
    before = {k: v for k, v in tree_snapshot(store_path).items()
              if k.split("/")[0] in ("versions", "tags", "removed")}
    with pytest.raises(DuplicateStepError, match=r"already has a version at step 1") as caught:
        save(store, 1, 2.0)
    assert caught.value.existing == first
    after = {k: v for k, v in tree_snapshot(store_path).items()
             if k.split("/")[0] in ("versions", "tags", "removed")}
    assert after == before
    assert store.resolve("r@1").id == first


def test_replace_publishes_the_new_content_in_place_of_the_old(store: chunkstore.Store) -> None:
    first = save(store, 1, 1.0)
    second = save(store, 1, 2.0, replace=True)
    assert [v.id for v in store.versions()] == [second]
    assert store.resolve("r@1").id == second
    np.testing.assert_array_equal(store.open_version("r@1").get("w"),
                                  np.full(20_000, 2.0, dtype=np.float32))
    assert first != second and store.verify().ok


@pytest.mark.parametrize("meta", [["a list"], "a string", 5])
def test_meta_that_is_not_a_dict_is_refused_when_the_version_is_created(
        store: chunkstore.Store, meta: object) -> None:
    with pytest.raises(InvalidInputError, match="meta must be a dict"):
        store.new_version("r", 1, meta=meta)  # type: ignore[arg-type]


def test_a_step_beyond_what_a_record_holds_is_refused(store: chunkstore.Store) -> None:
    with pytest.raises(InvalidInputError, match="below 2"):
        store.new_version("r", 2**63)


def test_an_unreadable_version_can_be_removed_by_its_id(
        store: chunkstore.Store, store_path: Path) -> None:
    good = save(store, 1, 1.0)
    bad = "ab" * 32
    store.backend.put(VERSIONS.key(bad), b"{not a commit record")
    store.backend.put(TAGS.key("pinned"), json.dumps({"version": bad, "created": 1.0}).encode())
    with pytest.raises(CorruptRecordError):
        store.open_version(bad)
    removed = store.delete(bad)
    assert removed.id == bad
    assert not (store_path / VERSIONS.key(bad)).exists()
    assert not (store_path / TAGS.key("pinned")).exists()
    assert [v.id for v in store.versions()] == [good]
    assert store.verify().ok


def test_a_damaged_tag_can_be_removed(store: chunkstore.Store, store_path: Path) -> None:
    save(store, 1, 1.0)
    store.backend.put(TAGS.key("best"), b'{"version": 5}')
    assert store.stored_tags() == {}
    store.reconcile()  # no crash on the damaged tag
    assert store.untag("best")
    assert not (store_path / TAGS.key("best")).exists()


def test_the_cli_removes_an_unreadable_version_by_its_id(store: chunkstore.Store,
                                                        store_path: Path) -> None:
    import subprocess
    import sys

    good = save(store, 1, 1.0)
    bad = "cd" * 32
    store.backend.put(VERSIONS.key(bad), b"\x00 not json")
    cli = [sys.executable, "-m", "chunkstore"]
    done = subprocess.run([*cli, "rm", str(store_path), bad], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert not (store_path / VERSIONS.key(bad)).exists()
    assert [v.id for v in store.versions()] == [good]


# --- report and gc agree (what is live, what awaits gc) --------------------------------------


def _saved_many(store: chunkstore.Store, count: int) -> list[str]:
    rng = np.random.default_rng(0)
    shared = rng.standard_normal(40_000).astype(np.float32)
    ids = []
    for step in range(count):
        with store.new_version("r", step) as version:
            version.put("shared", shared)
            version.put("own", rng.standard_normal(30_000).astype(np.float32))
        ids.append(version.info.id)
    return ids


def _gc_would_delete(store: chunkstore.Store, grace: float) -> tuple[int, int]:
    result = store.gc(grace=grace, dry_run=True)
    return (result.chunks_deleted + result.nodes_deleted + result.orphans_deleted,
            result.bytes_freed + result.orphan_bytes_freed)


def test_report_counts_removed_versions_as_awaiting_gc_not_as_stored_data(
        store: chunkstore.Store) -> None:
    ids = _saved_many(store, 6)
    before = store.stats()
    for vid in ids[:3]:
        store.delete(vid)
    after = store.stats()
    assert before.awaiting_gc_bytes == 0
    # The live data and its dedup ratio are those of the remaining versions only.
    assert after.live_bytes < before.live_bytes
    assert after.chunks < before.chunks
    assert after.awaiting_gc_bytes == before.live_bytes - after.live_bytes
    assert after.physical_bytes == before.physical_bytes
    assert (after.awaiting_gc_objects, after.awaiting_gc_bytes) == _gc_would_delete(store, 0)
    assert after.reclaimable_now_bytes == 0  # removed just now: the grace period runs


def test_report_and_gc_agree_after_an_index_rebuild(store: chunkstore.Store) -> None:
    ids = _saved_many(store, 6)
    for vid in ids[:3]:
        store.delete(vid)
    store.rebuild_index()
    stats = store.stats()
    assert stats.awaiting_gc_objects > 0
    assert (stats.awaiting_gc_objects, stats.awaiting_gc_bytes) == _gc_would_delete(store, 0)
    result = store.gc(grace=0)
    deleted = result.chunks_deleted + result.nodes_deleted + result.orphans_deleted
    assert deleted == stats.awaiting_gc_objects
    assert store.stats().awaiting_gc_objects == 0 and store.verify().ok


def test_removing_a_version_another_index_removed_first_is_not_an_error(
        store_path: Path, tmp_path: Path) -> None:
    """Retention on two machines: the second to remove a version finds it gone."""
    with chunkstore.open(store_path, chunk_size=4096, index_dir=str(tmp_path / "a"),
                         create=True) as a, \
            chunkstore.open(store_path, index_dir=str(tmp_path / "b"), create=True) as b:
        first = save(a, 1, 1.0)
        save(a, 2, 2.0)
        b.reconcile()
        assert first in {v.id for v in b.versions()}  # b lists it ...
        a.delete(first)  # ... a removes it
        b.delete_listed(first)  # no error, whether or not b's index still lists it
        assert first not in {v.id for v in b.versions()}
        assert b.delete_listed(first) is False  # gone from both: done, not an error
        with pytest.raises(chunkstore.errors.SelectorError):
            b.delete(first)
        assert b.verify().ok
