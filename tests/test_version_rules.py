"""One version per RUN@STEP; what a save refuses early; removing what cannot be read."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import chunkstore
from chunkstore.digest import tag_key, version_key
from chunkstore.errors import CorruptRecordError, DuplicateStepError, InvalidInputError
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
    with pytest.raises(InvalidInputError, match="2\\*\\*63"):
        store.new_version("r", 2**63)


def test_an_unreadable_version_can_be_removed_by_its_id(
        store: chunkstore.Store, store_path: Path) -> None:
    good = save(store, 1, 1.0)
    bad = "ab" * 32
    store.backend.put(version_key(bad), b"{not a commit record")
    store.backend.put(tag_key("pinned"), json.dumps({"version": bad, "created": 1.0}).encode())
    with pytest.raises(CorruptRecordError):
        store.open_version(bad)
    removed = store.delete(bad)
    assert removed.id == bad
    assert not (store_path / version_key(bad)).exists()
    assert not (store_path / tag_key("pinned")).exists()
    assert [v.id for v in store.versions()] == [good]
    assert store.verify().ok


def test_a_damaged_tag_can_be_removed(store: chunkstore.Store, store_path: Path) -> None:
    save(store, 1, 1.0)
    store.backend.put(tag_key("best"), b'{"version": 5}')
    assert store.stored_tags() == {}
    store.reconcile()  # no crash on the damaged tag
    assert store.untag("best")
    assert not (store_path / tag_key("best")).exists()


def test_the_cli_removes_an_unreadable_version_by_its_id(store: chunkstore.Store,
                                                        store_path: Path) -> None:
    import subprocess
    import sys

    good = save(store, 1, 1.0)
    bad = "cd" * 32
    store.backend.put(version_key(bad), b"\x00 not json")
    cli = [sys.executable, "-m", "chunkstore"]
    done = subprocess.run([*cli, "rm", str(store_path), bad], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert not (store_path / version_key(bad)).exists()
    assert [v.id for v in store.versions()] == [good]
