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
from typing import ClassVar

import numpy as np
import pytest

import chunkstore
import chunkstore.store
from chunkstore.backends.wrappers import RequestHook
from chunkstore.errors import RunLeaseLostError, SelectorError
from chunkstore.index.versiontables import VersionEntry
from chunkstore.objects.kinds import MARKER_BUCKET_NS, PUBLISHED, TOMBSTONES, VERSIONS
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
        for crafted in [f"000000000/{stamp}-{third}", f"{stamp[:9]}/{stamp}-{third}x",
                        f"{stamp[:9]}/{stamp}{third}", f"{stamp[:9]}/{stamp[1:]}-{third}",
                        f"{stamp[:9]}/{stamp}-{third}/x", f"{stamp[:9]}/-{third}",
                        f"{stamp[:8]}/{stamp}-{third}", f"{stamp[:9]}/{stamp[:9]}/{stamp}-{third}",
                        f"0000000/{stamp}-{third}", f"{stamp[:7]}/{stamp}-{third}x"]:
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


def test_a_sweep_removes_the_day_old_marker_folders_it_empties_and_no_other(
        tmp_path: Path) -> None:
    """On a local disk the prune removes the folders it emptied whose whole span is past
    KEEP_S (a layout-2 100-s folder and a layout-1 2.8-hour one): else ``published/``
    keeps an empty folder per 100 s ever written.  The folder of today's markers stays,
    and so does an old folder that holds anything else (a write under way there)."""
    where: tuple[str, dict[str, object]] = (str(tmp_path / "store"), {})
    first = save(where, tmp_path / "index", 1)
    root = tmp_path / "store" / PUBLISHED.prefix
    old_ns = time.time_ns() - int((published.KEEP_S + 4 * 3600) * 1e9)  # past 2.8 h folders
    with opened(where, tmp_path / "index") as store:
        emptied = marker_id(first, old_ns)
        busy = marker_id(first, old_ns + 2 * MARKER_BUCKET_NS)
        in_layout_1 = marker_id(first, old_ns + 4 * MARKER_BUCKET_NS)
        layout_1 = f"{in_layout_1[:7]}/{in_layout_1}"  # its own 2.8-hour folder
        for marker in (emptied, busy, layout_1):
            store.objects.put(PUBLISHED, marker, b"")
        (root / busy[:9] / ".tmp-0123456789abcdef").write_bytes(b"")  # a write under way
        today = sorted(p.name for p in root.iterdir())
        assert {emptied[:9], busy[:9], in_layout_1[:7]} <= set(today)
        result = store.gc(grace=0, sweep=True)
        assert result.markers_pruned == 3
        assert sorted(p.name for p in root.iterdir()) == sorted(
            set(today) - {emptied[:9], in_layout_1[:7]})
        assert [m.split("-")[1] for m in store.objects.ids(PUBLISHED)] == [first]
        assert [v.step for v in store.versions()] == [1]
        # A marker past KEEP_S in a folder whose span is not: pruned, its folder kept
        # (a marker of that span may still come, from a clock a little behind).
        start = (old_ns // MARKER_BUCKET_NS - 50) * MARKER_BUCKET_NS
        straddling = marker_id(first, start + 10 * 10**9)
        store.objects.put(PUBLISHED, straddling, b"")
        assert published.prune_markers(store.objects, (start + 11 * 10**9) / 1e9
                                       + published.KEEP_S) == 1
        assert (root / straddling[:9]).is_dir() and not any((root / straddling[:9]).iterdir())


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
    """S3's one or two prefixes, and a local disk's folders (each read whole), hold
    every marker of the window; the folders are those the window spans, no more."""
    rng = random.Random(49)
    for _ in range(500):
        first = rng.randrange(10 ** 19)
        last = first + int(10 ** rng.uniform(0, 14.95))  # up to a day (KEEP_S)
        prefixes = published._time_prefixes(first, last)
        folders = published._bucket_folders(first, last)
        assert 1 <= len(prefixes) <= 2
        assert len(folders) == last // MARKER_BUCKET_NS - first // MARKER_BUCKET_NS + 1
        for stamp in (first, last, rng.randint(first, last)):
            key = PUBLISHED.key(marker_id("ab" * 32, stamp))[len(PUBLISHED.prefix):]
            assert any(key.startswith(prefix) for prefix in prefixes), (first, last)
            assert key.rpartition("/")[0] + "/" in folders, (first, last)


def test_an_open_s_window_yields_its_markers_across_folders_and_none_outside(
        where: tuple[str, dict[str, object]], tmp_path: Path) -> None:
    """Markers every 14.3 s from 7 minutes before now to 2.5 after, in the 100-s folders
    around the window (and at its two ends): exactly those stamped inside it are
    listed, on a local disk (folder by folder) and on S3 (by prefix)."""
    with opened(where, tmp_path / "index") as store:
        now = published.clock_s()
        since = now - 250.0
        first = int((since - published.SKEW_S) * 1e9)
        last = int((now + published.SKEW_S) * 1e9)
        stamps = [int((now - 420.0) * 1e9) + int(i * 14.3e9) for i in range(40)]
        stamps += [first - 1, first, last, last + 1]
        for i, stamp in enumerate(stamps):
            store.objects.put(PUBLISHED, marker_id(f"{i:064x}", stamp), b"")
        found = sorted(m.time_ns for m in published.recent_markers(store.objects, since, now))
        assert found == sorted(s for s in stamps if first <= s <= last)


class MarkerListings(RequestHook):
    """The prefixes listed under ``published/`` and the names each listing returned."""

    listed_prefixes: ClassVar[list[tuple[str, int]]] = []

    def listed(self, prefix: str, count: int) -> None:
        if prefix.startswith(PUBLISHED.prefix):
            MarkerListings.listed_prefixes.append((prefix, count))


def test_an_open_reads_the_window_s_folders_on_a_local_disk_and_two_prefixes_on_s3(
        where: tuple[str, dict[str, object]], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A local listing reads the folder a prefix ends in whole: an open reads the few
    100-s folders of its window, not a longer stretch (30 markers an hour earlier
    stay unread); on S3 it sends one or two LIST requests, as before."""
    a, b = tmp_path / "index-a", tmp_path / "index-b"
    save(where, a, 1)
    assert steps(where, b) == [1]
    with opened(where, a) as store:
        hour_ago = time.time_ns() - 3600 * 10 ** 9
        for i in range(30):
            store.objects.put(PUBLISHED, marker_id(f"{i:064x}", hour_ago + i), b"")
    second = save(where, a, 2)
    monkeypatch.setattr(chunkstore.store, "wrap_from_env",
                        lambda backend, environ=None: MarkerListings(backend))
    MarkerListings.listed_prefixes = []
    opened_at = published.clock_s()
    with opened(where, b) as store:
        assert [v.id for v in store.versions()][-1] == second  # from a's marker
    listed = MarkerListings.listed_prefixes
    assert sum(count for _, count in listed) < 10
    if where[0].startswith("s3://"):
        assert 1 <= len(listed) <= 2
        return
    # b's watermark is its open just before: the window starts a minute before that.
    window = published._bucket_folders(int((opened_at - 2 * published.SKEW_S) * 1e9),
                                       int((published.clock_s() + published.SKEW_S) * 1e9))
    assert 1 <= len(listed) <= 3
    for prefix, _ in listed:
        assert prefix[len(PUBLISHED.prefix):] in window  # a whole folder of the window


def test_an_open_decodes_no_index_entry_for_the_markers_of_its_window(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An open's window holds every save of the last minutes (a job saving each second:
    a hundred markers, most its own): it looks their versions up in the index by key,
    so what it decodes stays the same however many saves came before it in the window.
    (It decoded each marker's index entry: a DCP save given the store by path, which
    opens it, grew by 12 us per save made in the process.)"""
    where: tuple[str, dict[str, object]] = (str(tmp_path / "store"), {})
    index = tmp_path / "index"
    decoded: list[bytes] = []
    from_json = VersionEntry.from_json.__func__  # type: ignore[attr-defined]

    def counted(cls: type[VersionEntry], data: bytes) -> VersionEntry:
        decoded.append(data)
        return from_json(cls, data)  # type: ignore[no-any-return]
    monkeypatch.setattr(VersionEntry, "from_json", classmethod(counted))
    monkeypatch.setattr(chunkstore.store, "wrap_from_env",
                        lambda backend, environ=None: MarkerListings(backend))

    def decoded_by_an_open() -> tuple[int, int]:
        """The entries one open decodes, and the markers it listed."""
        decoded.clear()
        MarkerListings.listed_prefixes = []
        opened(where, index).close()
        return len(decoded), sum(count for _, count in MarkerListings.listed_prefixes)
    for step in range(2):
        save(where, index, step)
    few, listed = decoded_by_an_open()
    assert listed >= 2
    for step in range(2, 12):
        save(where, index, step)
    many, listed = decoded_by_an_open()
    assert listed >= 12  # the markers path ran: the folder stamps did not vouch
    assert many == few


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


# --- the frozen fixtures (tools/make_markers_fixture.py) ----------------------------------

DATA = Path(__file__).parent / "data"


@pytest.mark.parametrize("layout", [1, 2])
def test_the_markers_fixture_reads_back(tmp_path: Path, layout: int) -> None:
    """The frozen markers (a publication marker per save, a removal marker for the
    version removed) keep their names and bytes; each parses to its version and kind;
    they are pruned exactly once older than KEEP_S; the store opens with the removed
    version counted out and verifies.  Layout 1's (2.8-hour folders, markers-v1) are
    listed with their folder in the id, so that a prune and a purge find their keys."""
    import shutil

    import blake3
    fixture = DATA / f"markers-v{layout}"
    expected = json.loads(fixture.with_name(f"markers-v{layout}.expected.json").read_text())
    files = {str(p.relative_to(fixture)): blake3.blake3(p.read_bytes()).hexdigest()
             for p in sorted(fixture.rglob("*")) if p.is_file()}
    assert files == expected["files"]  # frozen: never rewritten
    first, second = expected["versions"]
    folder = {1: 7, 2: 9}[layout]
    assert sorted(k for k in files if k.startswith(PUBLISHED.prefix)) == [
        f"{PUBLISHED.prefix}{m[:folder]}/{m}" for m in expected["markers"]]
    copy = tmp_path / "s"
    shutil.copytree(fixture, copy)
    with chunkstore.open(copy) as store:
        listed = sorted(store.objects.ids(PUBLISHED))
        assert sorted(PUBLISHED.key(m) for m in listed) == sorted(
            k for k in files if k.startswith(PUBLISHED.prefix))
        parsed = [published.parse_marker(m) for m in listed]
        assert [(m.version_id, m.removed) for m in parsed] == [
            (first, False), (second, False), (first, True)]
        assert all(a.time_ns < b.time_ns for a, b in itertools.pairwise(parsed))
        assert [v.id for v in store.versions("mk")] == [second]
        assert store.verify().ok
        newest = parsed[-1].time_ns / 1e9
        assert published.prune_markers(store.objects, parsed[0].time_ns / 1e9
                                       + published.KEEP_S - 1, dry_run=True) == 0
        assert published.forget_markers(store.objects, {second}) == 1
        assert published.prune_markers(store.objects, newest + published.KEEP_S + 1) == 2
        assert list(store.objects.ids(PUBLISHED)) == []
