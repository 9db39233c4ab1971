"""Publication markers: an open learns of versions other indexes published, and of
those they removed, without listing the commit records (chunkstore.protocol.published).

Two index directories play two machines on one store: a real local folder (changed
within the folder stamp's settle margin, so the stamp never vouches) and a bucket on
the moto S3 server.  The listings of ``versions/`` are counted by a request hook.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import chunkstore
import chunkstore.store
from chunkstore.errors import RunLeaseLostError, SelectorError
from chunkstore.objects.kinds import PUBLISHED, TOMBSTONES, VERSIONS
from chunkstore.protocol import published
from chunkstore.protocol.published import marker_id
from chunkstore.protocol.runlease import RunLease, withdraw
from tests.s3server import create_bucket, remove_bucket, s3_endpoint, storage_options
from tests.test_open_listing import Listings, listings

__all__ = ["listings", "s3_endpoint"]  # fixtures, re-exported so pytest finds them here

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(params=["local", "s3"])
def where(request: pytest.FixtureRequest, tmp_path: Path
          ) -> Iterator[tuple[str, dict[str, object]]]:
    if request.param == "local":
        yield str(tmp_path / "store"), {}
        return
    endpoint = request.getfixturevalue("s3_endpoint")
    bucket = create_bucket(endpoint)
    try:
        yield f"s3://{bucket}/ckpts", {"storage_options": storage_options(endpoint)}
    finally:
        remove_bucket(endpoint, bucket)


def opened(where: tuple[str, dict[str, object]], index: Path) -> chunkstore.Store:
    url, options = where
    return chunkstore.open(url, index_dir=str(index), create=True, **options)  # type: ignore[arg-type]


def save(where: tuple[str, dict[str, object]], index: Path, step: int) -> str:
    with opened(where, index) as store, store.new_version("r", step) as version:
        version.put("w", np.full(64, step, dtype=np.float32))
    return version.info.id


def steps(where: tuple[str, dict[str, object]], index: Path) -> list[int]:
    with opened(where, index) as store:
        return [v.step for v in store.versions()]


def test_an_open_sees_versions_published_and_removed_elsewhere_without_listing_them(
        where: tuple[str, dict[str, object]], tmp_path: Path,
        listings: type[Listings]) -> None:
    a, b = tmp_path / "index-a", tmp_path / "index-b"
    save(where, a, 1)
    assert steps(where, b) == [1]  # b's first open lists in full: no watermark yet
    before = listings.count
    second = save(where, a, 2)
    assert steps(where, b) == [1, 2]  # from a's marker
    with opened(where, a) as through_a:
        through_a.delete(second)
        through_a.gc(grace=0)  # its tombstone deleted at once
        assert not list(through_a.objects.ids(TOMBSTONES))
    before = listings.count  # (a's GC listed)
    assert steps(where, b) == [1]  # from the removal marker
    assert listings.count == before


def test_markers_without_a_record_or_with_crafted_names_name_no_version(
        tmp_path: Path, listings: type[Listings]) -> None:
    where: tuple[str, dict[str, object]] = (str(tmp_path / "store"), {})
    a, b = tmp_path / "index-a", tmp_path / "index-b"
    first = save(where, a, 1)
    assert steps(where, b) == [1]
    third = save(where, a, 3)
    with opened(where, a) as store:
        # A marker whose save never created its record; names of other tools' files.
        store.objects.put(PUBLISHED, marker_id("ab" * 32), b"")
        # A removal marker of a version still published: it stays.
        store.objects.put(PUBLISHED, marker_id(first, removed=True), b"")
        (mine,) = [m for m in store.objects.ids(PUBLISHED) if m.endswith(third)]
        store.objects.delete(PUBLISHED, mine)
        stamp = mine.split("-")[0]
        for crafted in [f"0000000/{stamp}-{third}", f"{stamp[:7]}/{stamp}-{third}x",
                        f"{stamp[:7]}/{stamp}{third}", f"{stamp[:7]}/{stamp[1:]}-{third}",
                        f"{stamp[:7]}/{stamp}-{third}/x", f"{stamp[:7]}/-{third}"]:
            store.objects.backend.put(f"published/{crafted}", b"")
    before = listings.count
    assert steps(where, b) == [1]  # r@3 has no marker of its own
    assert listings.count == before
    with opened(where, b) as store:  # its last full listing over ten minutes ago
        full_s, markers_s = store.index.markers_listed() or (0.0, 0.0)
        store.index.set_markers_listed(full_s - published.FULL_LISTING_S - 1, markers_s)
    assert steps(where, b) == [1, 3]  # the periodic full listing finds it
    assert listings.count == before + 1


_KILLED_BETWEEN_MARKER_AND_RECORD = """
import sys
import numpy as np
import chunkstore
with chunkstore.open(sys.argv[1], index_dir=sys.argv[2]) as store:
    with store.new_version("r", 2) as version:
        version.put("w", np.full(64, 2, dtype=np.float32))
"""


def test_a_save_killed_between_its_marker_and_its_record_publishes_nothing(
        tmp_path: Path) -> None:
    where: tuple[str, dict[str, object]] = (str(tmp_path / "store"), {})
    a, b = tmp_path / "index-a", tmp_path / "index-b"
    save(where, a, 1)
    assert steps(where, b) == [1]
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("CHUNKSTORE_FAULT")},
           "CHUNKSTORE_FAULT": "kill-before-put:versions/:0"}
    killed = subprocess.run(
        [sys.executable, "-c", _KILLED_BETWEEN_MARKER_AND_RECORD, where[0], str(a)],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    with opened(where, b) as store:
        named = [m.split("-")[1] for m in store.objects.ids(PUBLISHED)]
        assert len(named) == 2  # the killed save's marker was durable before its record
        assert sum(store.objects.exists(VERSIONS, v) for v in named) == 1
        assert [v.step for v in store.versions()] == [1]
    assert steps(where, a) == [1]


def test_a_sweep_prunes_markers_older_than_a_day_only(tmp_path: Path) -> None:
    where: tuple[str, dict[str, object]] = (str(tmp_path / "store"), {})
    first = save(where, tmp_path / "index", 1)
    with opened(where, tmp_path / "index") as store:
        old = marker_id(first, time.time_ns() - int((published.KEEP_S + 60) * 1e9))
        store.objects.put(PUBLISHED, old, b"")
        result = store.gc(grace=0, sweep=True)
        assert result.markers_pruned == 1
        assert [m.split("-")[1] for m in store.objects.ids(PUBLISHED)] == [first]


def test_a_purge_leaves_the_purged_version_its_removal_marker_only(tmp_path: Path) -> None:
    """Its tombstone goes with the purge: an index that still counts the version counts
    it out from the removal marker."""
    where: tuple[str, dict[str, object]] = (str(tmp_path / "store"), {})
    a, b = tmp_path / "index-a", tmp_path / "index-b"
    first = save(where, a, 1)
    second = save(where, a, 2)
    assert steps(where, b) == [1, 2]
    with opened(where, a) as store:
        store.purge(second)
        assert {m.partition("-")[2] for m in store.objects.ids(PUBLISHED)} == {
            first, f"{second}-removed"}
        assert not list(store.objects.ids(TOMBSTONES))
    assert steps(where, b) == [1]
    with opened(where, b) as store:
        assert store.verify(read_data=False).ok


def test_an_index_emptied_by_a_rebuild_that_stopped_lists_in_full(tmp_path: Path) -> None:
    where: tuple[str, dict[str, object]] = (str(tmp_path / "store"), {})
    first = save(where, tmp_path / "index", 1)
    save(where, tmp_path / "index", 2)
    with opened(where, tmp_path / "index") as store:
        (older,) = [m for m in store.objects.ids(PUBLISHED) if m.endswith(first)]
        store.objects.delete(PUBLISHED, older)  # as if saved long ago
        store.index.clear()  # the first step of a rebuild, killed after it
    assert steps(where, tmp_path / "index") == [1, 2]


def test_the_window_s_prefixes_hold_every_marker_in_it_and_few_outside() -> None:
    rng = random.Random(49)
    for _ in range(2000):
        first = rng.randrange(10 ** 19)
        last = first + int(10 ** rng.uniform(0, 15))
        prefixes = published._time_prefixes(first, last)
        assert 1 <= len(prefixes) <= 2 or all(p.endswith("/") for p in prefixes)
        for stamp in (first, last, rng.randint(first, last)):
            key = PUBLISHED.key(marker_id("ab" * 32, stamp))[len(PUBLISHED.prefix):]
            assert any(key.startswith(prefix) for prefix in prefixes), (first, last)


def test_a_record_written_without_a_marker_is_found_once_a_selector_names_it(
        tmp_path: Path, listings: type[Listings]) -> None:
    """A record no marker announced (a crafted one, an older release's save): an open
    from the markers does not see it, a selector naming it lists every record and
    finds it (one listing), and a selector naming nothing lists once and raises."""
    where: tuple[str, dict[str, object]] = (str(tmp_path / "store"), {})
    a, b = tmp_path / "index-a", tmp_path / "index-b"
    save(where, a, 1)
    assert steps(where, b) == [1]
    third = save(where, a, 3)
    with opened(where, a) as store:
        (mine,) = [m for m in store.objects.ids(PUBLISHED) if m.endswith(third)]
        store.objects.delete(PUBLISHED, mine)
    before = listings.count
    with opened(where, b) as store:
        assert [v.step for v in store.versions()] == [1]
        assert listings.count == before
        assert store.resolve("r@3").id == third
        assert listings.count == before + 1
        with pytest.raises(SelectorError, match="no version at step 4"):
            store.resolve("r@4")
        assert listings.count == before + 2
        with pytest.raises(SelectorError, match="expected RUN@STEP"):
            store.resolve("r@x")  # not a miss: no listing
        assert listings.count == before + 2


def test_changes_no_marker_announced_are_lined_up_by_a_whole_verify(
        tmp_path: Path) -> None:
    """A record deleted with no removal marker, its tombstone gone, and one created
    with no publication marker (an older release's rm and save, or by hand): the index
    lags until a full listing; a whole verify lists, so it counts both in line before
    comparing refcounts and reports nothing."""
    where: tuple[str, dict[str, object]] = (str(tmp_path / "store"), {})
    a, b = tmp_path / "index-a", tmp_path / "index-b"
    save(where, a, 1)
    second = save(where, a, 2)
    assert steps(where, b) == [1, 2]
    third = save(where, a, 3)
    with opened(where, a) as store:
        store.delete(second)
        store.gc(grace=0)
        store.objects.delete_many(PUBLISHED, [m for m in store.objects.ids(PUBLISHED)
                                              if m.endswith((third, "-removed"))])
    with opened(where, b) as store:
        assert [v.step for v in store.versions()] == [1, 2]  # until a full listing
        result = store.verify(read_data=False)
        assert result.ok, result.problems
        assert [v.step for v in store.versions()] == [1, 3]


def test_a_writer_deleting_its_own_withdrawn_record_leaves_a_removal_marker(
        tmp_path: Path) -> None:
    """A stopped writer whose late PUT created a record the run's new owner had
    withdrawn deletes it again (RunLease.confirm): an index that counted the version in
    counts it out at its next open, from that removal marker alone."""
    where: tuple[str, dict[str, object]] = (str(tmp_path / "store"), {})
    a, b = tmp_path / "index-a", tmp_path / "index-b"
    save(where, a, 1)
    second = save(where, a, 2)
    assert steps(where, b) == [1, 2]
    with opened(where, a) as store:
        withdraw(store.objects, "r", second)
        with pytest.raises(RunLeaseLostError):
            RunLease(store.objects, "r").confirm(second)
        assert not store.objects.exists(VERSIONS, second)
        assert not list(store.objects.ids(TOMBSTONES))
    assert steps(where, b) == [1]


# --- the frozen fixture (tools/make_markers_fixture.py) -----------------------------------

FIXTURE = Path(__file__).parent / "data" / "markers-v1"


def test_the_markers_fixture_reads_back(tmp_path: Path) -> None:
    """The frozen markers (a publication marker per save, a removal marker for the
    version removed) keep their names and bytes; each parses to its version and kind;
    they are pruned exactly once older than KEEP_S; the store opens with the removed
    version counted out and verifies."""
    import shutil

    import blake3
    expected = json.loads(FIXTURE.with_name("markers-v1.expected.json").read_text())
    files = {str(p.relative_to(FIXTURE)): blake3.blake3(p.read_bytes()).hexdigest()
             for p in sorted(FIXTURE.rglob("*")) if p.is_file()}
    assert files == expected["files"]  # frozen: never rewritten
    first, second = expected["versions"]
    parsed = [published.parse_marker(m) for m in expected["markers"]]
    assert [(m.version_id, m.removed) for m in parsed] == [
        (first, False), (second, False), (first, True)]
    assert all(a.time_ns < b.time_ns for a, b in itertools.pairwise(parsed))
    copy = tmp_path / "s"
    shutil.copytree(FIXTURE, copy)
    with chunkstore.open(copy) as store:
        assert sorted(store.objects.ids(PUBLISHED)) == expected["markers"]
        assert [v.id for v in store.versions("mk")] == [second]
        assert store.verify().ok
        newest = parsed[-1].time_ns / 1e9
        assert published.prune_markers(store.objects, parsed[0].time_ns / 1e9
                                       + published.KEEP_S - 1, dry_run=True) == 0
        assert published.prune_markers(store.objects, newest + published.KEEP_S + 1) == 3
        assert list(store.objects.ids(PUBLISHED)) == []
