"""The writer's group commit of chunk claims."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import chunkstore
from chunkstore.errors import VersionClosedError
from chunkstore.format.digest import Digest, digests_of
from chunkstore.index.lmdbindex import Claim
from chunkstore.write.writer import GroupClaims


def test_concurrent_claims_share_transactions_and_each_gets_its_own_answer() -> None:
    calls: list[list[Digest]] = []

    def claim_many(digests: list[Digest]) -> dict[Digest, Claim]:
        calls.append(digests)
        time.sleep(0.01)  # an index commit: claims arriving meanwhile queue up
        return {d: Claim.WRITE if d.raw[0] % 2 else Claim.DEDUP for d in digests}

    group = GroupClaims(claim_many)
    digests = [Digest.of(str(i).encode()) for i in range(64)]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(group.claim, digests))
    assert answers == [Claim.WRITE if d.raw[0] % 2 else Claim.DEDUP for d in digests]
    assert sorted(d.raw for batch in calls for d in batch) == sorted(d.raw for d in digests)
    assert len(calls) < len(digests) / 2  # grouped, not one commit per claim


def test_an_index_error_reaches_every_claim_of_its_batch_and_the_next_batch_still_runs() -> None:
    failing = threading.Event()
    failing.set()

    def claim_many(digests: list[Digest]) -> dict[Digest, Claim]:
        if failing.is_set():
            failing.clear()
            raise OSError("index full (injected)")
        return dict.fromkeys(digests, Claim.DEDUP)

    group = GroupClaims(claim_many)
    with pytest.raises(OSError, match="injected"):
        group.claim(Digest.of(b"a"))
    assert group.claim(Digest.of(b"b")) == Claim.DEDUP


def test_a_runs_versions_are_ordered_by_step_whatever_order_they_were_committed(
        store: chunkstore.Store) -> None:
    import numpy as np

    for step in (5, 3, 4):  # e.g. saved by machines whose clocks disagree
        with store.new_version("r", step) as v:
            v.put("w", np.full(10, step, dtype=np.int32))
    assert [v.step for v in store.versions("r")] == [3, 4, 5]
    assert store.resolve("r@latest").step == 5
    assert store.open_version("r@latest").get("w")[0] == 5


def test_small_tensors_are_claimed_in_batches_and_read_back_exactly(tmp_path: Path) -> None:
    """A state of many small tensors pays a few index transactions, not one per tensor;
    a later save reuses the unchanged ones and stores the changed ones."""
    rng = np.random.default_rng(0)
    state = {f"layers.{i}.bias": rng.standard_normal(64 + i % 7).astype(np.float32)
             for i in range(1000)}
    with chunkstore.open(tmp_path / "s", create=True) as store:
        calls: list[int] = []
        claim_small = store.index.claim_small

        def counting(session: str, digests: list[Digest]) -> Any:
            calls.append(len(digests))
            return claim_small(session, digests)

        store.index.claim_small = counting  # type: ignore[method-assign]
        with store.new_version(run="r", step=1) as version:
            for name, array in state.items():
                version.put(name, array)
        assert sum(calls) >= 1000
        assert len(calls) <= 10, f"{len(calls)} index transactions for 1000 tensors"
        state["layers.3.bias"] = state["layers.3.bias"] + 1
        with store.new_version(run="r", step=2) as version:
            for name, array in state.items():
                version.put(name, array)
        assert version.info.new_bytes == state["layers.3.bias"].nbytes
        reader = store.open_version("r@2")
        for name, array in state.items():
            np.testing.assert_array_equal(reader.get(name), array)
        assert store.verify().ok


def test_a_failed_batch_claim_aborts_the_version(tmp_path: Path) -> None:
    """A small tensor's entry exists before its batch is claimed: when the claim fails,
    the version is aborted, never committed with entries short of chunks."""
    with chunkstore.open(tmp_path / "s", create=True) as store:
        claim_small = store.index.claim_small
        failures = [OSError("index unavailable (injected)")]

        def failing_once(session: str, digests: list[Digest]) -> Any:
            if failures:
                raise failures.pop()
            return claim_small(session, digests)

        store.index.claim_small = failing_once  # type: ignore[method-assign]
        version = store.new_version(run="r", step=1)
        with pytest.raises(OSError, match="injected"):
            for i in range(1000):
                version.put(f"t{i}", np.full(16, i, dtype=np.int32))
        with pytest.raises(VersionClosedError):
            version.put("after", np.zeros(4, np.int32))
        with pytest.raises(VersionClosedError):
            version.commit()
        assert store.versions() == []
        with store.new_version(run="r", step=1) as again:
            again.put("t0", np.full(16, 0, dtype=np.int32))
        np.testing.assert_array_equal(store.open_version("r@1").get("t0"), np.zeros(16, np.int32))
        assert store.verify().ok


@pytest.mark.parametrize("count", [0, 1, 2, 300])
def test_a_batch_is_hashed_in_turns_by_the_caller_and_the_pool(
        count: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(count)
    items = [rng.bytes(int(rng.integers(0, 300_000))) for _ in range(count)]
    expected = [Digest.of(item) for item in items]
    hashed_by: set[str] = set()
    of = Digest.of

    def noting(data: bytes | memoryview) -> Digest:
        hashed_by.add(threading.current_thread().name)
        time.sleep(0.001)  # long enough that the pool's job starts before the end
        return of(data)

    monkeypatch.setattr(Digest, "of", noting)
    with ThreadPoolExecutor(2, thread_name_prefix="pool") as pool:
        digests = digests_of(items, pool, helpers=1)
    assert digests == expected
    if count > 100:
        assert len(hashed_by) == 2, hashed_by  # the caller and one worker took turns


def test_a_helpers_error_reaches_the_caller_and_holds_none_of_its_buffers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The error comes back, and no cycle through the failed job keeps the caller's
    arrays alive until a full collection (the collector is off here)."""
    import gc
    import weakref

    of = Digest.of

    def failing_in_the_pool(data: bytes | memoryview) -> Digest:
        time.sleep(0.001)
        if threading.current_thread() is not threading.main_thread():
            raise OSError("injected in a helper")
        return of(data)

    monkeypatch.setattr(Digest, "of", failing_in_the_pool)
    arrays = [np.full(1000, i, dtype=np.uint8) for i in range(200)]
    alive = [weakref.ref(array) for array in arrays]
    enabled = gc.isenabled()
    gc.disable()
    try:
        with ThreadPoolExecutor(2) as pool:
            with pytest.raises(OSError, match="injected in a helper"):
                digests_of([array.data for array in arrays], pool, helpers=1)
        del arrays
        assert sum(ref() is not None for ref in alive) == 0
    finally:
        if enabled:
            gc.enable()


def test_nothing_reads_the_buffers_once_an_interrupted_hashing_returns(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C in the caller: the jobs stop taking items, so when the interrupt reaches
    the writer (which then aborts and lets the caller reuse its arrays) no thread of
    the pool is still reading them."""
    of = Digest.of
    hashed_at: list[float] = []

    def slow(data: bytes | memoryview) -> Digest:
        if threading.current_thread() is threading.main_thread() and len(hashed_at) > 5:
            raise KeyboardInterrupt
        time.sleep(0.005)
        hashed_at.append(time.monotonic())
        return of(data)

    monkeypatch.setattr(Digest, "of", slow)
    with ThreadPoolExecutor(2) as pool:
        with pytest.raises(KeyboardInterrupt):
            digests_of([bytes([i % 256]) * 100 for i in range(300)], pool, helpers=1)
        returned = time.monotonic()
        time.sleep(0.1)
    assert [t for t in hashed_at if t > returned] == []
    assert len(hashed_at) < 100


def test_hashing_a_batch_never_waits_behind_a_busy_pool() -> None:
    """A pool busy with other work (encoding) does not hold the caller up: the job
    queued behind that work is cancelled and the caller hashes everything."""
    items = [bytes([i]) * 1000 for i in range(50)]
    release = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        busy = pool.submit(release.wait, 60)
        start = time.monotonic()
        digests = digests_of(items, pool, helpers=1)
        waited = time.monotonic() - start
        release.set()
        busy.result()
    assert digests == [Digest.of(item) for item in items]
    assert waited < 30


def test_a_pack_reused_by_many_members_is_claimed_once_per_batch(tmp_path: Path) -> None:
    """claim_small looks a pack up and claims it once for all its reused members (the
    pack, never a member: a member is not an object)."""
    rng = np.random.default_rng(1)
    state = {f"b{i}": rng.standard_normal(100).astype(np.float32) for i in range(200)}
    with chunkstore.open(tmp_path / "s", create=True) as store:
        with store.new_version(run="r", step=1) as version:
            for name, array in state.items():
                version.put(name, array)
        digests = [Digest.of(array.tobytes()) for array in state.values()]
        claimed: list[Digest] = []
        claim = store.index._claim

        def counting(txn: Any, sid: bytes, kind: bytes, digest: Digest, now: float) -> Claim:
            claimed.append(digest)
            return claim(txn, sid, kind, digest, now)

        store.index._claim = counting  # type: ignore[method-assign]
        session = store.index.open_session("test")
        found = store.index.claim_small(session, digests)
        packs = {location.pack for _, location in found.values() if location is not None}
        assert len(packs) == 1 and all(claim == Claim.DEDUP for claim, _ in found.values())
        assert claimed == list(packs)
        assert store.index.claimants(claimed[0]) == [session]
        store.index.close_session(session)


def test_a_batch_the_index_never_saw_never_waits_for_the_index_writer(
        tmp_path: Path) -> None:
    """claim_small answers WRITE for chunks with neither a record nor a pack location
    from a read transaction (the write transaction would write nothing for them), so
    such a batch does not wait while another thread holds the index's single writer;
    a batch with a chunk the index knows takes the writer and claims that chunk."""
    rng = np.random.default_rng(2)
    known = rng.standard_normal(100).astype(np.float32)
    with chunkstore.open(tmp_path / "s", create=True) as store:
        with store.new_version(run="r", step=1) as version:
            version.put("known", known)
        unseen = [Digest.of(rng.standard_normal(100).astype(np.float32).tobytes())
                  for _ in range(5)]
        session = store.index.open_session("test")
        held, release = threading.Event(), threading.Event()

        def hold_the_writer() -> None:
            with store.index.env.begin(write=True):
                held.set()
                release.wait(30)

        with ThreadPoolExecutor(2) as pool:
            holder = pool.submit(hold_the_writer)
            assert held.wait(30)
            try:
                answer = pool.submit(store.index.claim_small, session, unseen)
                found = answer.result(timeout=10)
            finally:
                release.set()
            holder.result()
        assert found == {digest: (Claim.WRITE, None) for digest in unseen}
        assert all(store.index.claimants(digest) == [] for digest in unseen)
        mixed = store.index.claim_small(session, [*unseen, Digest.of(known.tobytes())])
        claim, location = mixed[Digest.of(known.tobytes())]
        assert claim == Claim.DEDUP and location is not None
        assert store.index.claimants(location.pack) == [session]
        assert all(mixed[digest] == (Claim.WRITE, None) for digest in unseen)
        store.index.close_session(session)


def _cyclic_garbage_of(action: Callable[[], object]) -> list[object]:
    """What of this project the cyclic collector would have to free after ``action``
    (run with the collector off; everything it found is restored afterwards)."""
    import gc

    enabled, debug = gc.isenabled(), gc.get_debug()
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection finds is kept in gc.garbage
    try:
        action()
        gc.collect()
        return [thing for thing in gc.garbage
                if (getattr(thing, "__module__", None) or type(thing).__module__ or ""
                    ).startswith("chunkstore")]
    finally:
        gc.garbage.clear()
        gc.set_debug(debug)
        if enabled:
            gc.enable()


@pytest.mark.parametrize("compression", ["none", "auto"])
def test_a_save_leaves_nothing_for_the_cyclic_garbage_collector(
        tmp_path: Path, compression: str) -> None:
    """A save's objects (its writer, pack builder, claims and entries) are freed when
    the save ends, committed or failed, not left in reference cycles for a full garbage
    collection; and dropping the caller's arrays frees them."""
    import weakref

    rng = np.random.default_rng(1)
    alive: list[weakref.ref[np.ndarray]] = []

    def save(store: chunkstore.Store, step: int) -> None:
        # With 256 KiB chunks: at delta depth 0 four tensors are packed and one spans three
        # chunks; at depth 2 (small means at most 128 KiB there) two are packed, two are a
        # chunk each and one spans three chunks.
        arrays = {f"t{i}": rng.standard_normal(n).astype(np.float32)
                  for i, n in enumerate([10, 300, 40_000, 60_000, 190_000])}
        alive.extend(weakref.ref(a) for a in arrays.values())
        with store.new_version(run="r", step=step) as version:
            for name, array in arrays.items():
                version.put(name, array)

    def failing_save(store: chunkstore.Store, step: int) -> None:
        healthy = store.backend.put_if_absent_deferred

        def failing(key: str, data: bytes | memoryview) -> bool:
            if key.startswith("chunks/"):
                raise OSError("disk full (injected)")
            return healthy(key, data)

        def failing_pieces(key: str, pieces: list[bytes | memoryview]) -> bool:
            return failing(key, b"".join(pieces))  # a pack: its pieces (a local store)

        store.backend.put_if_absent_deferred = failing  # type: ignore[method-assign]
        store.backend.put_pieces_if_absent_deferred = failing_pieces  # type: ignore[method-assign]
        try:
            with pytest.raises(OSError, match="injected"):
                save(store, step)
        finally:
            del store.backend.put_if_absent_deferred
            del store.backend.put_pieces_if_absent_deferred

    def three_saves(store: chunkstore.Store) -> None:
        for step, run in ((1, save), (2, save), (3, failing_save)):  # 2: a parent
            run(store, step)
            # No collection has run since the save: its arrays are gone already.
            assert all(r() is None for r in alive), f"step {step}: the caller's arrays outlived it"

    for depth in (0, 2):
        with chunkstore.open(tmp_path / f"s{depth}", chunk_size=256 * 1024,
                             compression=compression, delta_depth=depth, create=True) as store:
            # One collection after the three saves: garbage stays garbage, so it finds
            # whatever cycle any of them left.
            assert _cyclic_garbage_of(functools.partial(three_saves, store)) == []
            assert store.verify().ok


def test_a_pack_whose_chunks_a_save_reuses_is_claimed_once_not_once_per_chunk(
        tmp_path: Path) -> None:
    """Workers that reach a pack while another checks it wait for that answer: a save
    that reuses 32 chunks of one pack commits one claim of it, not one per chunk."""
    weights = np.random.default_rng(0).standard_normal(32 * 16384).astype(np.float32)
    with chunkstore.open(tmp_path / "s", chunk_size=65536, delta_depth=2, create=True) as store:
        with store.new_version(run="r", step=1) as version:
            version.put("w", weights)
        claimed: list[Digest] = []
        claim_many = store.index.claim_many

        def slow(session: str, kind: bytes, digests: Any) -> Any:
            digests = list(digests)
            claimed.extend(digests)
            time.sleep(0.05)  # a slow index commit: the other workers reach the pack meanwhile
            return claim_many(session, kind, digests)

        store.index.claim_many = slow  # type: ignore[method-assign]
        with store.new_version(run="r", step=2) as version:
            version.put("w", weights)
        assert version.info.new_bytes == 0
        assert claimed, "the pack was never claimed"
        assert len(claimed) == len(set(claimed)), (
            f"{len(claimed)} claims of {len(set(claimed))} objects")
        np.testing.assert_array_equal(store.open_version("r@2").get("w"), weights)
        assert store.verify().ok


def test_an_identical_save_of_a_step_another_index_removed_is_published(
        tmp_path: Path) -> None:
    """Handle A saves r@1; handle B (its own index, as another machine) removes it; A,
    whose index has not heard, saves r@1 again with the same bytes.  That is not "saved
    before, publish nothing": A's save is published, reads back from a fresh handle, and
    survives GC (it returned the removed version's info, published nowhere)."""
    path = tmp_path / "s"
    x = np.arange(100_000, dtype=np.float32)
    with chunkstore.open(path, index_dir=str(tmp_path / "a"), create=True) as a, \
            chunkstore.open(path, index_dir=str(tmp_path / "b"), create=True) as b:
        with a.new_version("r", 1) as version:
            version.put("x", x)
        b.reconcile()
        b.delete("r@1")
        with a.new_version("r", 1) as version:
            version.put("x", x)
        assert version.info.id in b.stored_version_ids()
    with chunkstore.open(path, index_dir=str(tmp_path / "c"), create=True) as c:
        c.gc(grace=0)
        np.testing.assert_array_equal(c.open_version("r@1").get("x"), x)
        assert c.verify().ok


def test_two_threads_saving_one_step_through_one_handle_publish_one_version(
        tmp_path: Path) -> None:
    """Both commits meet at the same-step check at once: one publishes, the other gets
    DuplicateStepError (both published before, and r@5 named only one of them)."""
    from chunkstore.errors import DuplicateStepError

    with chunkstore.open(tmp_path / "s", chunk_size=64 * 1024, create=True) as store:
        barrier = threading.Barrier(2)
        outcomes: list[str] = []

        def save(value: float) -> None:
            version = store.new_version("r", 5)
            version.put("x", np.full(200_000, value, np.float32))
            barrier.wait()
            try:
                version.commit()
                outcomes.append("published")
            except DuplicateStepError:
                outcomes.append("duplicate")

        threads = [threading.Thread(target=save, args=(v,)) for v in (1.0, 2.0)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert sorted(outcomes) == ["duplicate", "published"]
        assert len(store.versions("r")) == 1


def test_a_new_version_that_fails_reading_its_parent_leaves_no_session(tmp_path: Path) -> None:
    """new_version() opens its sessions, then reads the parent version; an OSError there
    (EIO, or Ctrl-C) must end both sessions, or every GC waits for a save that does not
    exist."""
    from chunkstore.objects.kinds import NODES
    from chunkstore.protocol.sessions import list_sessions

    with chunkstore.open(tmp_path / "s", chunk_size=64 * 1024, create=True) as store:
        with store.new_version("r", 1) as version:
            version.put("x", np.arange(100_000, dtype=np.float32))
        root = store.latest("r").root
        store.node_cache = type(store.node_cache)()
        store.parent_cache.clear()
        real = store.backend.get

        def get(key: str) -> bytes:
            if key == NODES.key(root):
                raise OSError(5, "Input/output error")
            return real(key)

        store.backend.get = get  # type: ignore[method-assign]
        with pytest.raises(OSError):
            store.new_version("r", 2)
        store.backend.get = real  # type: ignore[method-assign]
        assert list(list_sessions(store.objects)) == []
        assert store.index.list_sessions() == {}


def test_replacing_a_step_with_the_same_tensors_and_new_meta_keeps_the_new_meta(
        tmp_path: Path) -> None:
    """replace=True with identical tensors but other meta (a loss a retention policy
    reads) publishes the new meta; it returned the old version, dropping it.  The same
    tensors and the same meta still publish nothing."""
    with chunkstore.open(tmp_path / "s", create=True) as store:
        x = np.arange(1000, dtype=np.float32)
        with store.new_version("r", 1, meta={"loss": 1.0}) as version:
            version.put("x", x)
        first = version.info.id
        with store.new_version("r", 1, meta={"loss": 0.5}, replace=True) as version:
            version.put("x", x)
        assert store.resolve("r@1").meta == {"loss": 0.5}
        assert [v.id for v in store.versions("r")] == [version.info.id] != [first]
        with store.new_version("r", 1, meta={"loss": 0.5}, replace=True) as again:
            again.put("x", x)
        assert again.info.id == version.info.id


def test_a_commit_waiting_on_a_gc_fence_does_not_hold_up_another_save_of_its_run(
        tmp_path: Path) -> None:
    """Save B of run r started before a GC fenced a chunk; save A of r started after and
    reuses that chunk, so A's commit waits for the GC, and the GC waits for B's session
    to end.  A must not hold r's commit turn while it waits: B commits at once, the GC
    finishes, then A commits (held, B waited out the GC's whole session wait)."""
    from chunkstore.index.lmdbindex import CHUNK
    from chunkstore.protocol.journal import ABANDONED, DONE, start_entry, write_entry
    from chunkstore.protocol.sessions import list_sessions

    with chunkstore.open(tmp_path / "s", create=True) as store:
        x = np.random.default_rng(0).standard_normal(1 << 18).astype(np.float32)
        with store.new_version("old", 1) as version:
            version.put("w", x)
        chunks = list(store.index.version_refs(version.info.id))
        b = store.new_version("r", 2)  # its session is stored before the GC's entry
        b.put("w", np.ones(1 << 18, np.float32))
        entry = start_entry(store.objects, [(CHUNK, c) for c in chunks])  # a GC fences x
        outcome: dict[str, float] = {}

        def other_gc() -> None:
            started = time.monotonic()
            while time.monotonic() - started < 30:
                if not [s for s in list_sessions(store.objects) if entry.id not in s.seen]:
                    entry.state = DONE
                    write_entry(store.objects, entry)
                    return
                time.sleep(0.05)
            entry.state = ABANDONED
            write_entry(store.objects, entry)

        gc_thread = threading.Thread(target=other_gc)
        gc_thread.start()
        a = store.new_version("r", 3)  # sees the entry: reusing x waits for that GC
        a.put("w", x)
        started = time.monotonic()
        a_thread = threading.Thread(target=a.commit)
        a_thread.start()
        time.sleep(0.3)  # A is waiting on the fence now
        b.commit()
        outcome["b"] = time.monotonic() - started
        a_thread.join(timeout=60)
        gc_thread.join(timeout=60)
        assert outcome["b"] < 10, outcome
        assert entry.state == DONE
        assert [v.step for v in store.versions("r")] == [2, 3]
        np.testing.assert_array_equal(store.open_version("r@3").get("w"), x)


def test_saving_the_same_step_again_says_it_stored_nothing(store: chunkstore.Store) -> None:
    """Re-running a save of the same content returns the version saved before: it says so
    (existed) and that it stored 0 bytes, where it repeated that version's new bytes."""
    array = np.arange(50_000, dtype=np.float32)
    with store.new_version(run="r", step=1) as v:
        v.put("w", array)
    assert not v.existed and v.stored_bytes == v.info.new_stored_bytes > 0
    with store.new_version(run="r", step=1) as again:
        again.put("w", array)
    assert again.existed and again.stored_bytes == 0 and again.info.id == v.info.id
