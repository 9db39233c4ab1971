"""Garbage collection: grace period, shared chunks, orphans, sessions, crashes, dry runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

import chunkstore
from chunkstore.backends.base import Backend
from chunkstore.backends.wrappers import RequestHook
from chunkstore.errors import (
    GcAbortedError,
    GcBusyError,
    InvalidInputError,
    SavesInProgressError,
)
from chunkstore.format.digest import Digest
from chunkstore.handle.tree import flatten
from chunkstore.index.lmdbindex import CHUNK, ChunkRecord, ChunkState, Claim
from chunkstore.maintenance import gc
from chunkstore.maintenance.gc import gc_lock
from chunkstore.objects.kinds import CHUNKS, NODES
from tests.conftest import SMALL_CHUNK, tree_snapshot

HOUR = 3600.0
REPO = Path(__file__).resolve().parent.parent


def later(seconds: float) -> float:
    return time.time() + seconds


def state(seed: int, shared: np.ndarray) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"model.shared": shared, "model.own": rng.standard_normal(40_000).astype(np.float32)}


def save(store: chunkstore.Store, step: int, arrays: dict[str, np.ndarray]) -> str:
    with store.new_version("r", step) as v:
        for name, array in arrays.items():
            v.put(name, array)
        v.put_data("trainer", {"step": step})
    return v.info.id


def objects(store_path: Path, prefix: str) -> set[str]:
    root = store_path / prefix
    return {p.name for p in root.rglob("*") if p.is_file()} if root.exists() else set()


def stored_bytes(store_path: Path) -> int:
    """What the chunk and node objects occupy."""
    return sum(p.stat().st_size for prefix in ("chunks", "nodes")
               for p in (store_path / prefix).rglob("*") if p.is_file())


def reachable(store: chunkstore.Store, version_id: str) -> tuple[set[str], set[str]]:
    """(chunk hexes, node hexes) a version's manifest reaches, read from the manifest."""
    flat = flatten(store.objects, store.read_record(version_id).root, store.node_cache)
    return ({d.hex for d in flat.chunk_digests()},
            {d.hex for d in flat.tree_nodes | flat.data_nodes()})


def assert_loads(store: chunkstore.Store, version_id: str, arrays: dict[str, np.ndarray]) -> None:
    reader = store.open_version(version_id)
    for name, array in arrays.items():
        np.testing.assert_array_equal(reader.get(name), array)


@pytest.fixture
def shared() -> np.ndarray:
    return np.random.default_rng(7).standard_normal(100_000).astype(np.float32)


def test_grace_keeps_fresh_garbage_and_then_frees_exactly_the_unreachable(
        store: chunkstore.Store, store_path: Path, shared: np.ndarray) -> None:
    a, b = state(1, shared), state(2, shared)
    va, vb = save(store, 1, a), save(store, 2, b)
    chunks_a, nodes_a = reachable(store, va)
    chunks_b, nodes_b = reachable(store, vb)
    assert chunks_a & chunks_b  # model.shared is deduplicated
    store.delete(va)

    fresh = store.gc(grace="1h")
    assert fresh.chunks_deleted == fresh.nodes_deleted == 0
    assert fresh.kept_by_grace == len(chunks_a - chunks_b) + len(nodes_a - nodes_b)
    assert objects(store_path, "chunks") == chunks_a | chunks_b

    doomed = [CHUNKS.key(Digest.parse(h)) for h in chunks_a - chunks_b] + [
        NODES.key(Digest.parse(h)) for h in nodes_a - nodes_b]
    doomed_bytes = sum((store_path / key).stat().st_size for key in doomed)
    result = store.gc(grace="1h", clock=lambda: later(2 * HOUR))
    assert objects(store_path, "chunks") == chunks_b
    assert objects(store_path, "nodes") == nodes_b
    assert result.chunks_deleted == len(chunks_a - chunks_b)
    assert result.nodes_deleted == len(nodes_a - nodes_b)
    assert result.bytes_freed == doomed_bytes
    assert store.verify().ok
    assert_loads(store, vb, b)
    again = store.gc(grace="1h", clock=lambda: later(3 * HOUR))
    assert again.chunks_deleted == again.nodes_deleted == again.orphans_deleted == 0


def test_deleting_one_of_two_versions_sharing_chunks_frees_only_its_own(
        store: chunkstore.Store, store_path: Path, shared: np.ndarray) -> None:
    a, b = state(1, shared), state(2, shared)
    va, vb = save(store, 1, a), save(store, 2, b)
    chunks_b, _ = reachable(store, vb)
    store.delete(vb)
    store.gc(grace=0)
    assert objects(store_path, "chunks") == reachable(store, va)[0]
    assert not (chunks_b - reachable(store, va)[0]) & objects(store_path, "chunks")
    assert_loads(store, va, a)
    assert store.verify().ok


def test_dry_run_tells_the_truth_and_changes_nothing(
        store: chunkstore.Store, store_path: Path, shared: np.ndarray) -> None:
    # Chunks as objects of their own, so the GC has some to delete (packed, the removed
    # version's chunks would share a pack with model.shared: garbage left for a repack).
    store.pack_delta_chunks = False
    va = save(store, 1, state(1, shared))
    save(store, 2, state(2, shared))
    store.delete(va)
    before = tree_snapshot(store_path)
    dry = store.gc(grace=0, dry_run=True)
    assert tree_snapshot(store_path) == before
    real = store.gc(grace=0)
    assert (dry.chunks_deleted, dry.nodes_deleted, dry.bytes_freed) == (
        real.chunks_deleted, real.nodes_deleted, real.bytes_freed)
    assert real.chunks_deleted > 0


def test_a_killed_save_leaves_orphans_collected_after_the_grace_period(
        store_path: Path) -> None:
    child = [sys.executable, str(REPO / "tests" / "crash_child.py"), str(store_path)]
    subprocess.run([*child, "1", "1"], check=True, capture_output=True, timeout=120)
    before = objects(store_path, "chunks")
    stored = stored_bytes(store_path)
    killed = subprocess.run([*child, "2", "2"], capture_output=True, timeout=120, check=False,
                            env={**os.environ, "CHUNKSTORE_FAULT": "kill-before-put:versions/:0"})
    assert killed.returncode == -signal.SIGKILL
    orphans = objects(store_path, "chunks") - before
    assert orphans
    # Its claims in the index never learnt their sizes: GC and report ask storage.
    left = stored_bytes(store_path) - stored
    with chunkstore.open(store_path, create=True) as store:
        assert len(store.index.list_sessions()) == 1  # the killed save's
        assert store.stats(full=False).awaiting_gc_bytes == left
        fresh = store.gc(grace="1h")
        assert fresh.sessions_expired == 1
        assert fresh.chunks_deleted == 0
        dry = store.gc(grace="1h", clock=lambda: later(2 * HOUR), dry_run=True)
        assert dry.bytes_freed + dry.orphan_bytes_freed == left
        result = store.gc(grace="1h", clock=lambda: later(2 * HOUR))
        assert result.chunks_deleted == len(orphans)
        assert result.bytes_freed + result.orphan_bytes_freed == left
        assert objects(store_path, "chunks") == before
        assert store.verify().ok
        assert [v.step for v in store.versions()] == [1]


def test_a_save_that_reuses_a_condemned_chunk_resurrects_and_rewrites_it(
        store: chunkstore.Store, store_path: Path, shared: np.ndarray) -> None:
    arrays = state(1, shared)
    va = save(store, 1, arrays)
    digests = store.index.version_refs(va)
    store.delete(va)
    before = later(HOUR)
    assert store.index.condemn(CHUNK, digests, before) == digests
    # An object GC condemned may already be half gone (a power cut can undo the
    # index transaction after the unlink): the writer must not trust it.
    (store_path / CHUNKS.key(digests[0])).unlink()
    session = store.index.open_session("test")
    assert store.index.claim_chunk(session, digests[0]) == Claim.WRITE
    record = store.index.chunk(digests[0])
    assert record is not None and record.state == ChunkState.WRITING
    assert store.index.start_delete(CHUNK, digests[0], before) is None  # GC's re-check says no
    store.index.close_session(session)
    vb = save(store, 2, arrays)  # the same bytes again
    assert store.gc(grace=0).chunks_deleted == 0
    assert store.verify().ok
    assert_loads(store, vb, arrays)


def test_a_claimed_chunk_is_never_deleted_even_unreferenced(
        store: chunkstore.Store, store_path: Path, shared: np.ndarray) -> None:
    va = save(store, 1, state(1, shared))
    refs = store.index.version_refs(va)
    session = store.index.open_session("a save in progress")
    for digest in refs:
        assert store.index.claim_chunk(session, digest) == Claim.DEDUP
    store.delete(va)
    result = store.gc(grace=0)
    assert result.chunks_deleted == 0
    assert result.kept_by_sessions == len(refs)
    assert {d.hex for d in refs} <= objects(store_path, "chunks")
    store.index.close_session(session)
    assert store.gc(grace=0).chunks_deleted == len(refs)


def test_sessions_of_dead_processes_expire_and_live_ones_do_not(
        store: chunkstore.Store, shared: np.ndarray) -> None:
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           check=True, capture_output=True, text=True)
    dead_pid = int(child.stdout)
    live = store.index.open_session("live")
    dead = store.index.open_session("dead")
    remote = store.index.open_session("remote")
    with store.index.env.begin(write=True, db=store.index.sessions) as txn:
        info = json.loads(txn.get(dead.encode()))
        txn.put(dead.encode(), json.dumps({**info, "pid": dead_pid,
                                           "process_start": "1"}).encode())
        info = json.loads(txn.get(remote.encode()))
        txn.put(remote.encode(), json.dumps({**info, "host": "elsewhere",
                                             "heartbeat": time.time() - 2 * HOUR}).encode())
    result = store.gc(grace="1h")
    assert result.sessions_expired == 2
    assert set(store.index.list_sessions()) == {live}


def test_a_save_whose_index_session_was_dropped_still_publishes(
        store: chunkstore.Store, shared: np.ndarray) -> None:
    """Its session in the store protects it; the index's claims are only a fast path."""
    writer = store.new_version("r", 1)
    writer.put("model.shared", shared)
    store.index.close_session(writer._session)  # what an index rebuild or GC does
    info = writer.commit()
    assert [v.id for v in store.versions()] == [info.id]
    assert store.verify().ok


def test_a_save_paused_past_half_its_lease_is_not_published(store_path: Path) -> None:
    """A process stopped longer than half the session lease (a GC elsewhere may have
    counted it dead) refuses to publish, and says why."""
    chunkstore.open(store_path, chunk_size=SMALL_CHUNK, create=True).close()
    code = ("import sys, numpy as np, chunkstore\n"
            "s = chunkstore.open(sys.argv[1])\n"
            "w = s.new_version('r', 1)\n"
            "w.put('x', np.arange(1000, dtype=np.float32))\n"
            "print('ready', flush=True); sys.stdin.readline()\n"
            "try:\n    w.commit()\nexcept chunkstore.errors.SessionExpiredError as e:\n"
            "    print('expired', e)\n")
    env = {**os.environ, "CHUNKSTORE_SESSION_LEASE": "1"}
    proc = subprocess.Popen([sys.executable, "-c", code, str(store_path)], env=env, cwd=REPO,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdin is not None
    assert proc.stdout.readline().strip() == "ready"
    os.kill(proc.pid, signal.SIGSTOP)
    time.sleep(1.5)
    os.kill(proc.pid, signal.SIGCONT)
    out, _ = proc.communicate("\n", timeout=60)
    assert out.startswith("expired") and "half the session lease" in out
    with chunkstore.open(store_path, create=True) as store:
        assert store.versions() == []


def test_a_referenced_chunk_with_a_wrong_refcount_is_kept_and_reported(
        store: chunkstore.Store, store_path: Path, shared: np.ndarray) -> None:
    va = save(store, 1, state(1, shared))
    digest = store.index.version_refs(va)[0]
    record = store.index.chunk(digest)
    assert record is not None
    store.index.put_chunk_record(digest, ChunkRecord(ChunkState.LIVE, record.codec_id, 0,
                                                     record.raw_length, record.stored_length,
                                                     0.0))
    result = store.gc(grace=0)
    assert result.chunks_deleted == 0
    assert any(digest.short(16) in d for d in result.index_disagreements)
    assert (store_path / CHUNKS.key(digest)).exists()


def test_objects_the_index_does_not_know_are_swept_after_the_grace_period(
        store: chunkstore.Store, store_path: Path, shared: np.ndarray) -> None:
    kept = save(store, 1, state(1, shared))
    stray = Digest.of(b"a chunk object whose index record was lost")
    store.backend.put(CHUNKS.key(stray), b"CSCK-not-even-valid")
    store.backend.put(NODES.key(stray), b"{}")
    first = store.gc(grace="1h")
    assert first.swept and first.orphans_deleted == 0  # the index's first sweep: too young
    # No dead session points at them: the next sweep is the scheduled one, a day on.
    waiting = store.gc(grace="1h", clock=lambda: later(2 * HOUR))
    assert not waiting.swept and waiting.orphans_deleted == 0
    assert waiting.next_sweep_due == pytest.approx(first.next_sweep_due)
    assert (store_path / CHUNKS.key(stray)).exists()
    result = store.gc(grace="1h", clock=lambda: later(25 * HOUR))
    assert result.swept and result.sweep_reason.startswith("due")
    assert result.orphans_deleted == 2
    assert not (store_path / CHUNKS.key(stray)).exists()
    assert not (store_path / NODES.key(stray)).exists()
    assert store.index.chunk(stray) is None
    assert_loads(store, kept, state(1, shared))


def test_only_one_gc_at_a_time(store: chunkstore.Store) -> None:
    with gc_lock(store.index.path) as held:
        assert held
        with pytest.raises(GcBusyError):
            store.gc(grace=0)


def test_a_gc_that_outlives_half_the_grace_period_stops(
        store: chunkstore.Store, shared: np.ndarray) -> None:
    va = save(store, 1, state(1, shared))
    save(store, 2, state(2, shared))
    store.delete(va)
    ticks = iter(range(0, 10_000_000, 1000))  # every clock read is 1000 s later
    start = later(2 * HOUR)
    with pytest.raises(GcAbortedError):
        store.gc(grace="1h", clock=lambda: start + next(ticks))
    assert store.verify().ok


GC_CHILD = """
import sys, chunkstore
with chunkstore.open(sys.argv[1]) as store:
    store.gc(grace=0)
print("finished", flush=True)
"""


@pytest.mark.parametrize("fault", ["kill-before-delete:chunks/:1", "kill-after-delete:chunks/:1",
                                   "kill-before-delete:nodes/:0",
                                   # the protocol's own steps: the journal entry, fenced
                                   # and done, and the cleanup of expired tombstones
                                   "kill-after-put:gc/:0", "kill-before-put:gc/:1",
                                   "kill-before-delete:removed/:0"])
def test_gc_killed_mid_run_leaves_a_store_that_verifies_and_heals(
        store_path: Path, shared: np.ndarray, fault: str) -> None:
    with chunkstore.open(store_path, chunk_size=SMALL_CHUNK, create=True) as store:
        old = [save(store, step, state(step, shared)) for step in (1, 2, 3)]
        keep = save(store, 4, state(4, shared))
        for vid in old:
            store.delete(vid)
        expected = reachable(store, keep)
    proc = subprocess.run([sys.executable, "-c", GC_CHILD, str(store_path)],
                          env={**os.environ, "CHUNKSTORE_FAULT": fault}, cwd=REPO,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    with chunkstore.open(store_path, chunk_size=SMALL_CHUNK, create=True) as store:
        assert store.verify().ok
        assert_loads(store, keep, state(4, shared))
        store.gc(grace=0)
        assert store.verify().ok
        assert objects(store_path, "chunks") == expected[0]
        assert objects(store_path, "nodes") == expected[1]
        assert not [r for _, r in store.index.iter_chunks() if r.state == ChunkState.DELETING]


def test_report_shows_what_gc_could_reclaim(store: chunkstore.Store, shared: np.ndarray) -> None:
    va = save(store, 1, state(1, shared))
    save(store, 2, state(2, shared))
    assert store.stats().reclaimable_bytes == 0
    store.delete(va)
    stats = store.stats()
    assert stats.reclaimable_bytes > 0
    freed = store.gc(grace=0)
    assert freed.bytes_freed >= stats.reclaimable_bytes
    assert store.stats().reclaimable_bytes == 0


@pytest.mark.parametrize(("deltas", "packs", "packed_deltas"),
                         [(False, False, False), (True, False, False), (False, True, False),
                          (True, False, True)],
                         ids=["dedup", "deltas", "packs", "packed-deltas"])
def test_saves_racing_gc_with_no_grace_never_publish_a_version_with_a_deleted_chunk(
        store_path: Path, monkeypatch: pytest.MonkeyPatch, deltas: bool, packs: bool,
        packed_deltas: bool) -> None:
    """The dedup-versus-GC race: two saving processes and a GC process, grace 0; with
    deltas, saves also encode against bases that GC keeps condemning; with packs,
    saves reuse members of packs that GC keeps deleting or repacking; with packed
    deltas, the deltas and their bases are members of such packs."""
    monkeypatch.setenv("RACE_DELTAS", "1" if deltas else "0")
    monkeypatch.setenv("RACE_PACKS", "1" if packs else "0")
    monkeypatch.setenv("RACE_PACK_DELTAS", "1" if packed_deltas else "0")
    from tests.gc_race_child import CHUNK, expected, small_state

    chunkstore.open(store_path, chunk_size=CHUNK, compression="none",
                    delta_depth=2 if deltas else 0, create=True).close()
    child = [sys.executable, str(REPO / "tests" / "gc_race_child.py"), str(store_path)]
    seconds = "6"
    procs = [subprocess.Popen([*child, "save", seconds, str(w)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=REPO) for w in (1, 2)]
    procs.append(subprocess.Popen([*child, "gc", seconds], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, cwd=REPO))
    outputs = [p.communicate(timeout=120) for p in procs]
    for proc, (_, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err
    saves = sum(int(out.split()[1]) for out, _ in outputs[:2])
    delta_chunks = sum(int(out.split()[2]) for out, _ in outputs[:2])
    gc_runs, gc_deleted, gc_repacked = (int(x) for x in outputs[2][0].split()[1:])
    assert saves >= 10 and gc_runs >= 5 and gc_deleted > 0  # the race really ran
    assert (delta_chunks > 0) == deltas
    reused = sum(int(out.split()[3]) for out, _ in outputs[:2])
    assert (reused > 0) == packs  # saves reused members of packs GC was collecting
    if not packed_deltas:  # (packed deltas: the delta saves' own packs get repacked too)
        assert (gc_repacked > 0) == packs  # ... or repacking
    with chunkstore.open(store_path, create=True) as store:
        result = store.verify()
        assert result.ok, result.problems
        versions = store.versions()
        assert len(versions) == 4  # each writer keeps its newest two
        for info in versions:
            writer = int(info.run[1:])
            reader = store.open_version(info.id)
            np.testing.assert_array_equal(reader.get("w"), expected(writer, info.step, deltas))
            if packs:
                for name, array in small_state(writer, info.step).items():
                    np.testing.assert_array_equal(reader.get(name), array)
        store.gc(grace=0)
        assert store.verify().ok


def test_gc_counts_in_a_version_the_index_lost_before_it_collects(
        store: chunkstore.Store, shared: np.ndarray) -> None:
    """A save killed between its commit record and its index update: the index lacks it."""
    arrays = state(1, shared)
    vid = save(store, 1, arrays)
    store.index.remove_version(vid)  # as if the index update never happened
    result = store.gc(grace=0)
    assert result.chunks_deleted == result.nodes_deleted == 0
    assert store.verify().ok
    assert_loads(store, vid, arrays)


def test_gc_deletes_nothing_while_a_version_on_storage_cannot_be_read(
        store: chunkstore.Store, store_path: Path, shared: np.ndarray) -> None:
    va = save(store, 1, state(1, shared))
    save(store, 2, state(2, shared))
    store.delete(va)
    store.backend.put(f"versions/{'ab' * 32}", b"{not a commit record")
    before = objects(store_path, "chunks")
    with pytest.raises(GcAbortedError, match="cannot be read"):
        store.gc(grace=0)
    assert objects(store_path, "chunks") == before


def test_a_chunk_lost_from_storage_is_rewritten_by_the_next_save_that_has_it(
        store: chunkstore.Store, store_path: Path, shared: np.ndarray) -> None:
    """After a rebuild, a missing chunk is no dedup target: a save of the same bytes heals it."""
    arrays = state(1, shared)
    va = save(store, 1, arrays)
    lost = store.index.version_refs(va)[0]
    (store_path / CHUNKS.key(lost)).unlink()
    store.rebuild_index()
    record = store.index.chunk(lost)
    assert record is not None and record.state == ChunkState.WRITING and record.refcount == 1
    assert not store.verify().ok
    save(store, 2, arrays)
    assert store.verify().ok
    assert_loads(store, va, arrays)


def test_index_rebuild_waits_for_saves_in_progress(store: chunkstore.Store,
                                                   shared: np.ndarray) -> None:
    save(store, 1, state(1, shared))
    writer = store.new_version("r", 2)
    with pytest.raises(SavesInProgressError, match="save r@2"):
        store.rebuild_index()
    writer.abort()
    assert store.rebuild_index().versions == 1


def test_a_tag_only_storage_knows_still_pins_its_version(store: chunkstore.Store,
                                                        shared: np.ndarray) -> None:
    va = save(store, 1, state(1, shared))
    save(store, 2, state(2, shared))
    store.backend.put("tags/keep", json.dumps({"version": va}).encode())  # index not told yet
    with pytest.raises(InvalidInputError, match="tagged keep"):
        store.delete(va)
    result = store.prune(keep_last=1, min_previous=0)
    assert result.removed == []
    assert store.versions()[0].id == va


def test_sessions_are_judged_by_heartbeat_outside_this_pid_namespace(
        store: chunkstore.Store) -> None:
    from chunkstore.maintenance.gc import session_is_dead

    session = store.index.open_session("mine")
    info = store.index.list_sessions()[session]
    now = time.time()
    assert not session_is_dead(info, now, HOUR)
    elsewhere = {**info, "pidns": "another-container", "pid": 1}
    assert not session_is_dead(elsewhere, now, HOUR)
    assert session_is_dead(elsewhere, now + 2 * HOUR, HOUR)


def test_a_deletion_of_an_object_referenced_again_leaves_it_to_be_rewritten(
        store: chunkstore.Store) -> None:
    digest = Digest.of(b"x")
    store.index.put_chunk_record(digest, ChunkRecord(ChunkState.DELETING, 0, 1, 1, 25, 0.0))
    assert store.index.finish_delete(CHUNK, digest)
    record = store.index.chunk(digest)
    assert record is not None and record.state == ChunkState.WRITING and record.refcount == 1


def test_temporary_files_of_killed_writes_are_removed_once_old(
        store: chunkstore.Store, store_path: Path, shared: np.ndarray) -> None:
    save(store, 1, state(1, shared))
    leftover = store_path / "chunks" / ".tmp-0123456789abcdef"
    leftover.write_bytes(b"half a chunk")
    assert store.gc(grace=0).temporaries_deleted == 0  # young: might be a write in progress
    old = time.time() - 2 * HOUR
    os.utime(leftover, (old, old))
    # Temporary files go with the orphan sweep (no sweep is due a moment after one).
    assert store.gc(grace="1h").temporaries_deleted == 0
    assert store.gc(grace="1h", dry_run=True, sweep=True).temporaries_deleted == 1
    assert leftover.exists()
    assert store.gc(grace="1h", sweep=True).temporaries_deleted == 1
    assert not leftover.exists()
    assert store.verify().ok


def test_prune_keeps_a_predecessor_that_verifies_not_just_the_one_before(
        store: chunkstore.Store, store_path: Path, shared: np.ndarray) -> None:
    ids = [save(store, step, state(step, shared)) for step in (1, 2, 3, 4)]
    own = set(store.index.version_refs(ids[2])) - set(store.index.version_refs(ids[1]))
    damaged = store_path / CHUNKS.key(next(iter(own)))
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF
    damaged.write_bytes(bytes(data))
    result = store.prune(keep_last=1)
    assert result.unverified == [ids[2]]
    assert [v.id for v in result.removed] == [ids[0], ids[2]]
    assert [v.id for v in store.versions()] == [ids[1], ids[3]]


class _DeleteBatches(RequestHook):
    """Records the size of each bulk delete of chunks and nodes, and the objects
    deleted one at a time; waits ``slow_s`` in the first two bulk deletes."""

    def __init__(self, inner: Backend, slow_s: float = 0.0) -> None:
        super().__init__(inner)
        self.sizes: list[int] = []
        self.one_by_one = 0
        self.slow_s = slow_s

    def request(self, operation: str, key: str) -> None:
        if operation == "delete" and key.startswith((CHUNKS.prefix, NODES.prefix)):
            self.one_by_one += 1

    def delete_many(self, keys: Sequence[str]) -> None:
        if keys and keys[0].startswith((CHUNKS.prefix, NODES.prefix)):
            self.sizes.append(len(keys))
            time.sleep(self.slow_s if 4 <= len(self.sizes) <= 5 else 0.0)  # 4th and 5th
        super().delete_many(keys)


@pytest.mark.parametrize("slow", [False, True])
def test_gc_deletes_in_bulk_batches_that_grow_while_fast_and_shrink_when_slow(
        store_path: Path, monkeypatch: pytest.MonkeyPatch, slow: bool) -> None:
    """Step 8 deletes through the backend's bulk delete, never one object at a time; a
    batch is one deletion in flight for the fence's timing, so the first is small and a
    batch grows only while fast, and shrinks when one takes over half RENEW_LAPSE_S."""
    rng = np.random.default_rng(7)
    wide = rng.standard_normal(300 * SMALL_CHUNK // 4).astype(np.float32)
    # No deltas: the chunks of a large tensor are objects of their own, not packed.
    with chunkstore.open(store_path, chunk_size=SMALL_CHUNK, delta_depth=0,
                         create=True) as store:
        keep = save(store, 1, {"a": np.zeros(8, np.float32)})
        gone = save(store, 2, {"wide": wide})
        chunks, _ = reachable(store, gone)
        assert len(chunks) == 300 and chunks <= objects(store_path, "chunks")
        store.delete(gone)
        # Slow: a batch over half of it; fast: every batch well under a quarter (0.2 s
        # where slow: a batch of 16 unlinks and a commit can take 50 ms on a busy machine).
        monkeypatch.setattr(gc, "RENEW_LAPSE_S", 0.8 if slow else 60.0)
        batches = _DeleteBatches(store.backend, slow_s=0.6 if slow else 0.0)
        store.backend = batches
        result = store.gc(grace=0)
        assert batches.one_by_one == 0
        assert sum(batches.sizes) == result.chunks_deleted + result.nodes_deleted > 300
        assert not chunks & objects(store_path, "chunks")
        if slow:  # one, growing while fast, then halved after each slow batch
            assert batches.sizes[:6] == [1, 4, 16, 64, 32, 16]
        else:  # one, then 4, 16, 64, then 256 (the 215 chunks left), then the nodes
            assert batches.sizes[:5] == [1, 4, 16, 64, 215]
        assert store.verify().ok
        assert store.open_version(keep).get("a").tobytes() == bytes(32)
