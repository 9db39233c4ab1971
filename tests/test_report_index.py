"""``report`` from the index: its GC figures against GC's dry run, and its kept census.

By default ``report`` takes what awaits GC, and what a GC deletes now, from the
index's refcounts, and each version's census (chains, packs, ranks) from the index's
``census`` table where an earlier report recorded it.  These tests make garbage the
real way (a prune, a save killed by SIGKILL through the fault hook) and check the
index's figures against ``--full`` (GC's dry run with the sweep), name what the
index cannot see (orphans no index record names, after a rebuild), and check that a
recorded census is trusted no longer once its version is removed or the index
rebuilt.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import chunkstore
from chunkstore.backends.base import Backend
from chunkstore.backends.wrappers import RequestHook
from chunkstore.maintenance.report import GC_FROM_DRY_RUN, GC_FROM_INDEX, StoreStats, stats
from chunkstore.objects.kinds import NODES
from tests.test_cli import run

REPO = Path(__file__).resolve().parents[1]
CHILD = [sys.executable, str(REPO / "tests" / "crash_child.py")]
HOUR = 3600.0


def _saved(store_path: Path, first: int, last: int, fault: str | None = None) -> int:
    env = dict(os.environ) if fault is None else {**os.environ, "CHUNKSTORE_FAULT": fault}
    done = subprocess.run([*CHILD, str(store_path), str(first), str(last)], env=env,
                          capture_output=True, timeout=120, check=False)
    return done.returncode


def _gc_figures(result: StoreStats) -> tuple[int, int, int, int]:
    return (result.awaiting_gc_objects, result.awaiting_gc_bytes,
            result.reclaimable_now_objects, result.reclaimable_now_bytes)


def _both(store: chunkstore.Store, now: float) -> tuple[StoreStats, StoreStats]:
    fast = stats(store, HOUR, now=now, full=False)
    full = stats(store, HOUR, now=now, full=True)
    assert (fast.gc_source, full.gc_source) == (GC_FROM_INDEX, GC_FROM_DRY_RUN)
    return fast, full


def test_after_a_prune_the_index_figures_agree_with_the_dry_run(store_path: Path) -> None:
    assert _saved(store_path, 1, 6) == 0
    with chunkstore.open(store_path, create=False) as store:
        for info in store.versions()[:3]:
            store.delete(info.id)
        for now in (time.time(), time.time() + 2 * HOUR):  # within the grace, and past it
            fast, full = _both(store, now)
            assert _gc_figures(fast) == _gc_figures(full)
            assert fast.awaiting_gc_objects > 0
        assert fast.reclaimable_now_objects == fast.awaiting_gc_objects
        assert store.gc(grace="1h", clock=lambda: time.time() + 2 * HOUR).bytes_freed \
            == fast.reclaimable_now_bytes


def test_a_killed_saves_leftovers_the_index_knows_agree_and_those_it_does_not_are_named(
        store_path: Path, tmp_path: Path) -> None:
    assert _saved(store_path, 1, 2) == 0
    elsewhere = str(tmp_path / "other-machine")  # an index built before the kill
    with chunkstore.open(store_path, create=False, index_dir=elsewhere) as other:
        assert stats(other, full=False).awaiting_gc_objects == 0
    assert _saved(store_path, 3, 3, "kill-before-put:versions/:0") == -signal.SIGKILL
    later = time.time() + 2 * HOUR
    with chunkstore.open(store_path, create=False) as store:
        # The killed save's objects are in its own index (its session wrote them).
        fast, full = _both(store, later)
        assert fast.awaiting_gc_objects > 0
        assert _gc_figures(fast) == _gc_figures(full)
        seen_by_its_own = full
    with chunkstore.open(store_path, create=False, index_dir=elsewhere) as other:
        # Another index never heard of them: orphans that only GC's sweep finds, so
        # --full alone counts them.
        fast, full = _both(other, later)
        assert _gc_figures(fast) == (0, 0, 0, 0)
        assert full.awaiting_gc_objects == seen_by_its_own.awaiting_gc_objects
        swept = other.gc(grace="1h", clock=lambda: later)
        assert swept.orphans_deleted == full.reclaimable_now_objects > 0


def test_the_command_says_where_its_gc_figures_come_from(store_path: Path) -> None:
    assert _saved(store_path, 1, 2) == 0
    totals = json.loads(run("report", str(store_path), "--json").output)["totals"]
    assert totals["gc_source"] == "index"
    assert "only a sweep finds" in run("report", str(store_path)).output
    full = json.loads(run("report", str(store_path), "--json", "--full").output)["totals"]
    assert full["gc_source"] == "gc-dry-run"
    assert "only a sweep finds" not in run("report", str(store_path), "--full").output


def _census(result: StoreStats) -> tuple[object, ...]:
    return (result.chunks, result.unique_raw_bytes, result.delta_chunks,
            result.mean_chain_depth, result.max_chain_depth, result.packs,
            result.packed_chunks, result.packed_garbage_bytes)


def test_saves_record_their_census_and_a_report_after_them_reads_no_manifest(
        store_path: Path) -> None:
    """A job's saves record each version's census as they count it in (issue 49: the
    first report after them read every manifest, 3.7 s at 10,000 versions); what it
    says is what reading the manifests says."""
    assert _saved(store_path, 1, 5) == 0
    with chunkstore.open(store_path, create=False) as store:
        ids = [info.id for info in store.versions()]
        assert set(store.index.census(ids)) == set(ids)  # the saves' own index
        reads = _NodeReads(store.backend)
        store.backend = reads
        recorded = stats(store, full=False)
        store.backend = reads.inner
        assert reads.nodes == 0
        assert recorded.max_chain_depth > 0  # the embedding's deltas
        store.index.note_census([(vid, b"") for vid in ids])  # unreadable: read again
        read = stats(store, full=False)
        assert set(store.index.census(ids)) == set(ids)
        assert _census(read) == _census(recorded)


#: form 2, no packs, one chain (of a chunk whose digest starts ab..), no members
_FORGED = struct.pack("<BBIII", 2, 0, 0, 1, 0) + b"\xab" * 8 + bytes([99])


def _forged(store: chunkstore.Store, version_id: str) -> None:
    """Record a census for ``version_id`` no manifest gives (a chain of 99 bases), to
    see whether a report trusts it."""
    store.index.note_census([(version_id, _FORGED)])
    assert stats(store, full=False).max_chain_depth == 99  # trusted while it holds


def test_a_census_is_not_trusted_once_its_version_is_removed(store_path: Path) -> None:
    assert _saved(store_path, 1, 3) == 0
    with chunkstore.open(store_path, create=False) as store:
        victim = store.versions()[0].id
        _forged(store, victim)
        store.delete(victim)
        assert store.index.census([victim]) == {}
        assert stats(store, full=False).max_chain_depth < 99


def test_a_census_is_not_trusted_once_another_index_removed_its_version(
        store_path: Path, tmp_path: Path) -> None:
    assert _saved(store_path, 1, 3) == 0
    with chunkstore.open(store_path, create=False) as store:
        victim = store.versions()[0].id
        _forged(store, victim)
    with chunkstore.open(store_path, create=False, index_dir=str(tmp_path / "other")) as other:
        other.delete(victim)
    with chunkstore.open(store_path, create=False) as store:
        assert victim not in {info.id for info in store.versions()}
        assert store.index.census([victim]) == {}
        assert stats(store, full=False).max_chain_depth < 99


def test_a_census_is_not_trusted_after_an_index_rebuild(store_path: Path) -> None:
    assert _saved(store_path, 1, 3) == 0
    with chunkstore.open(store_path, create=False) as store:
        kept = store.versions()[-1].id
        _forged(store, kept)
        store.rebuild_index()
        # The rebuild counts the version in from its manifests, census included.
        assert store.index.census([kept]).get(kept) not in (None, _FORGED)
        assert stats(store, full=False).max_chain_depth < 99


def test_an_index_that_counts_versions_in_records_their_census(
        store_path: Path, tmp_path: Path) -> None:
    """A new index (another machine's, a deleted one's) reads every version's manifests
    as it counts them in: their census is recorded then, so its first report reads no
    manifest (issue 49: 4 s at 10,000 versions), and says what reading them says."""
    assert _saved(store_path, 1, 5) == 0
    with chunkstore.open(store_path, create=False, index_dir=str(tmp_path / "new")) as store:
        ids = [info.id for info in store.versions()]
        assert set(store.index.census(ids)) == set(ids)
        reads = _NodeReads(store.backend)
        store.backend = reads
        recorded = stats(store, full=False)
        store.backend = reads.inner
        assert reads.nodes == 0
        store.index.note_census([(vid, b"") for vid in ids])  # unreadable: read again
        assert _census(stats(store, full=False)) == _census(recorded)
        assert recorded.max_chain_depth > 0


class _NodeReads(RequestHook):
    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self.nodes = 0

    def request(self, operation: str, key: str) -> None:
        self.nodes += operation == "get" and key.startswith(NODES.prefix)


def test_a_census_recorded_in_another_form_or_damaged_is_counted_again(
        store_path: Path) -> None:
    assert _saved(store_path, 1, 3) == 0
    with chunkstore.open(store_path, create=False) as store:
        read = stats(store, full=False)
        kept = store.versions()[-1].id
        recorded = store.index.census([kept])[kept]
        for payload in (b'{"census": 1, "depths": {}, "members": [], "ranked": false}',
                        b"\xff not a census", recorded[:-1], recorded + b"\x00",
                        b"\x03" + recorded[1:],  # another form
                        recorded[:1] + b"\x04" + recorded[2:],  # an unknown flag
                        # a member whose pack is past the packs listed
                        struct.pack("<BBIII", 2, 0, 0, 0, 1) + struct.pack("<8sIIII",
                                                                           b"x" * 8, 0, 0, 1, 1)):
            store.index.note_census([(kept, payload)])
            assert _census(stats(store, full=False)) == _census(read)
            assert store.index.census([kept])[kept] != payload  # recorded again


def test_a_sync_records_the_census_of_what_it_copies(tmp_path: Path) -> None:
    """A copy into another store is a save there: the destination's index records each
    copied version's census, so a report there reads no manifest."""
    with chunkstore.open(tmp_path / "src", create=True) as src:
        for step in range(2):
            with src.new_version("r", step) as version:
                version.put("w", np.full(64, step, dtype=np.float32))  # packed
                version.put("b", np.arange(64, dtype=np.float32))
    chunkstore.sync(tmp_path / "src", tmp_path / "dst")
    with chunkstore.open(tmp_path / "dst", create=False) as dst:
        ids = [info.id for info in dst.versions()]
        assert len(ids) == 2 and set(dst.index.census(ids)) == set(ids)
        reads = _NodeReads(dst.backend)
        dst.backend = reads
        recorded = stats(dst, full=False)
        dst.backend = reads.inner
        assert reads.nodes == 0 and recorded.packed_chunks == 3
        dst.index.note_census([(vid, b"") for vid in ids])  # unreadable: read again
        assert _census(stats(dst, full=False)) == _census(recorded)


def test_the_garbage_in_packs_from_the_census_is_what_gcs_mark_finds(tmp_path: Path) -> None:
    """The census names chunks and packs by their digests' first 8 bytes; the bytes of
    removed versions' members left in live packs come out as GC's mark counts them."""
    with chunkstore.open(tmp_path / "s", create=True) as store:
        ids = []
        for step in range(3):
            with store.new_version("r", step) as version:
                version.put("w", np.full(64, step, dtype=np.float32))
                version.put("b", np.full(64, 9, dtype=np.float32) if step else
                            np.arange(64, dtype=np.float32))
            ids.append(version.info.id)
        # Step 1's pack holds its "w", listed by no version once it is removed, and the
        # "b" step 2 lists too: garbage inside a live pack.
        store.delete(ids[0])
        store.delete(ids[1])
        fast = stats(store, full=False)
        assert fast.packed_garbage_bytes > 0
        assert fast.packed_garbage_bytes == stats(store, full=True).packed_garbage_bytes
