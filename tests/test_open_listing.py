"""Opening a store without listing its versions when nothing changed (issue 49).

An index records the store's listing stamps (a local folder's device, inode and
times) as of its last complete reconcile; an open that finds them unchanged does not
list the commit records.  Every other index must still see each version another
published, and stop listing each one another removed: these tests open the store
through two index directories (two "machines") on a real local store, the settle
margin shortened so that they need not wait ten seconds per step.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import chunkstore
import chunkstore.store
from chunkstore.backends import folderstamp
from chunkstore.backends.base import Backend
from chunkstore.backends.folderstamp import ABSENT, file_system_of, folder_stamp
from chunkstore.backends.wrappers import RequestHook

SETTLE = 0.05


@pytest.fixture
def settle_fast(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(folderstamp, "SETTLE_S", SETTLE)


def settled() -> None:
    """Wait until the folders changed so far have settled."""
    time.sleep(SETTLE * 3)


class Listings(RequestHook):
    """Counts the listings of commit records."""

    count = 0

    def request(self, operation: str, key: str) -> None:
        if operation == "list" and key.startswith("versions/"):
            Listings.count += 1


@pytest.fixture
def listings(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[Listings]]:
    def wrapped(backend: Backend, environ: object = None) -> Backend:
        return Listings(backend)

    monkeypatch.setattr(chunkstore.store, "wrap_from_env", wrapped)
    Listings.count = 0
    yield Listings


def save(path: Path, index: Path, step: int) -> str:
    with chunkstore.open(path, index_dir=str(index), create=True) as store, \
            store.new_version("r", step) as version:
        version.put("w", np.full(64, step, dtype=np.float32))
    return version.info.id


def steps(path: Path, index: Path) -> list[int]:
    with chunkstore.open(path, index_dir=str(index)) as store:
        return [v.step for v in store.versions()]


def test_an_unchanged_store_opens_without_listing_its_versions(
        tmp_path: Path, settle_fast: None, listings: type[Listings]) -> None:
    store, a = tmp_path / "store", tmp_path / "index-a"
    save(store, a, 1)
    settled()
    assert steps(store, a) == [1]  # lists, and records the stamps
    before = listings.count
    assert steps(store, a) == [1]
    assert listings.count == before  # nothing changed: no listing


def test_another_index_sees_each_version_published_and_removed_after_its_stamp(
        tmp_path: Path, settle_fast: None, listings: type[Listings]) -> None:
    store, a, b = tmp_path / "store", tmp_path / "index-a", tmp_path / "index-b"
    save(store, a, 1)
    settled()
    assert steps(store, b) == [1]  # b's stamps recorded
    second = save(store, a, 2)  # published through a: b's index does not know it
    assert steps(store, b) == [1, 2]  # changed within the margin: listed
    settled()
    assert steps(store, b) == [1, 2]
    with chunkstore.open(store, index_dir=str(a)) as through_a:
        through_a.delete(second)
    settled()
    assert steps(store, b) == [1]  # the folder changed since b's stamps
    save(store, a, 3)
    settled()  # settled before b looks: the stamp alone must tell the change
    assert steps(store, b) == [1, 3]
    with chunkstore.open(store, index_dir=str(a)) as through_a:
        through_a.tag("r@3", "best")
    settled()
    with chunkstore.open(store, index_dir=str(b)) as through_b:
        assert through_b.tags() == {"best": through_b.resolve("r@3").id}


def test_an_index_whose_versions_changed_otherwise_lists_again(
        tmp_path: Path, settle_fast: None) -> None:
    store, a = tmp_path / "store", tmp_path / "index-a"
    first = save(store, a, 1)
    save(store, a, 2)
    settled()
    assert steps(store, a) == [1, 2]
    with chunkstore.open(store, index_dir=str(a)) as opened:
        opened.reconcile()  # a full listing records the stamps (an open may use markers)
        assert opened.index.listed_as() is not None
        opened.index.remove_version(first)  # the index alone forgets a version
        assert opened.index.listed_as() is None  # the stamps no longer vouch for it
    assert steps(store, a) == [1, 2]


def test_a_rebuilt_index_forgets_the_stamps_with_its_records(
        tmp_path: Path, settle_fast: None) -> None:
    store, a = tmp_path / "store", tmp_path / "index-a"
    save(store, a, 1)
    settled()
    with chunkstore.open(store, index_dir=str(a)) as opened:
        opened.reconcile()
        assert opened.index.listed_as() is not None
        opened.index.clear()
        assert opened.index.listed_as() is None


def test_a_folder_stamp_changes_with_every_name_and_waits_to_settle(tmp_path: Path) -> None:
    folder = tmp_path / "versions"
    assert folder_stamp(str(folder), "ext4") == ABSENT
    folder.mkdir()
    now = time.time()
    assert folder_stamp(str(folder), "ext4", now) is None  # just changed: not settled
    later = now + folderstamp.SETTLE_S + 1
    first = folder_stamp(str(folder), "ext4", later)
    assert first is not None
    time.sleep(0.02)  # past the timestamp's granularity
    (folder / "a").write_bytes(b"x")
    assert folder_stamp(str(folder), "ext4", later + 1) != first
    second = folder_stamp(str(folder), "ext4", later + 1)
    time.sleep(0.02)
    os.unlink(folder / "a")
    assert folder_stamp(str(folder), "ext4", later + 2) not in (first, second)
    assert folder_stamp(str(folder), "nfs4", later + 2) is None  # times not kept
    assert folder_stamp(str(folder / "file"), "ext4", later) == ABSENT
    (folder / "file").write_bytes(b"")
    assert folder_stamp(str(folder / "file"), "ext4", later + 2) is None  # no folder


def test_the_file_system_is_the_nearest_mount_point_s(tmp_path: Path) -> None:
    table = tmp_path / "mountinfo"
    table.write_text(
        "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n"
        "40 22 0:50 / /mnt/shared rw - nfs4 server:/export rw\n"
        "41 22 0:51 / /mnt/with\\040space rw - xfs /dev/sdb1 rw\n")
    assert file_system_of("/data/store", str(table)) == "ext4"
    assert file_system_of("/mnt/shared/store", str(table)) == "nfs4"
    assert file_system_of("/mnt/sharedx/store", str(table)) == "ext4"
    assert file_system_of("/mnt/with space/store", str(table)) == "xfs"
    assert file_system_of("/x", str(tmp_path / "none")) is None
