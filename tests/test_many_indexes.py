"""Many indexes on one store: every published version stays whole.

Each "machine" is a separate process with its own index directory
(``tests/machine_child.py``), on a local directory store and on the S3
server; the scenarios are the ones the review of the single-index protocol
reproduced as data loss.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import pytest

import chunkstore
from chunkstore.backends.wrappers import ForwardingBackend
from chunkstore.errors import BackendError, GcAbortedError
from chunkstore.format.manifest import TensorEntry
from chunkstore.objects.kinds import CHUNKS, VERSIONS
from tests.machine_child import CHUNK_SIZE, loop_state, state
from tests.s3server import create_bucket, remove_bucket, s3_endpoint, storage_options

__all__ = ["s3_endpoint"]  # the session fixture, re-exported so pytest finds it here

REPO = Path(__file__).resolve().parent.parent
HOUR = 3600.0


class Cluster:
    """A store and a way to run one operation on a named machine (its own index)."""

    def __init__(self, url: str, root: Path, env: dict[str, str]) -> None:
        self.url, self.root, self.env = url, root, env

    def index_dir(self, machine: str) -> str:
        return str(self.root / f"index-{machine}")

    def popen(self, machine: str, *args: object) -> subprocess.Popen[str]:
        command = [sys.executable, str(REPO / "tests" / "machine_child.py"), self.url,
                   self.index_dir(machine), *map(str, args)]
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, cwd=REPO, env=self.env)

    def run(self, machine: str, *args: object) -> Any:
        proc = self.popen(machine, *args)
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        return json.loads(out.splitlines()[-1])

    def run_in_a_row(self, machine: str, *ops: tuple[object, ...]) -> list[Any]:
        """Run ``ops`` one after the other on ``machine``, in one process (each opens the
        store afresh, as its own process would); their results."""
        args = [word for op in ops for word in ("--", *op)][1:]
        proc = self.popen(machine, *args)
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        results = [json.loads(line) for line in out.splitlines()[-len(ops):]]
        assert len(results) == len(ops), out
        return results

    def open(self, machine: str) -> chunkstore.Store:
        options = {}
        if self.url.startswith("s3://"):
            options = storage_options(self.env["CHUNKSTORE_TEST_S3_ENDPOINT"])
        return chunkstore.open(self.url, index_dir=self.index_dir(machine),
                               storage_options=options, create=True)

    def assert_all_whole(self, machine: str, expected: dict[str, dict[str, np.ndarray]]
                         ) -> None:
        """verify is clean and every version in ``expected`` reads back exact."""
        with self.open(machine) as store:
            result = store.verify()
            assert result.ok, result.problems
            for version_id, arrays in expected.items():
                reader = store.open_version(version_id)
                for name, array in arrays.items():
                    np.testing.assert_array_equal(reader.get(name), array)


@pytest.fixture(params=["local", "s3"])
def cluster(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Cluster]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    if request.param == "local":
        url = str(tmp_path / "store")
        chunkstore.open(url, chunk_size=CHUNK_SIZE, index_dir=str(tmp_path / "setup"),
                        create=True).close()
        yield Cluster(url, tmp_path, env)
        return
    endpoint = request.getfixturevalue("s3_endpoint")
    bucket = create_bucket(endpoint)
    url = f"s3://{bucket}/store"
    env.update({k: v for k, v in os.environ.items() if k.startswith("AWS_")})
    env["CHUNKSTORE_TEST_S3_ENDPOINT"] = endpoint
    chunkstore.open(url, chunk_size=CHUNK_SIZE, index_dir=str(tmp_path / "setup"),
                    storage_options=storage_options(endpoint), create=True).close()
    try:
        yield Cluster(url, tmp_path, env)
    finally:
        remove_bucket(endpoint, bucket)


def test_a_gc_on_another_machine_never_breaks_a_later_save_of_the_same_bytes(
        cluster: Cluster) -> None:
    """Machine B's GC deletes what A removed; A saves those bytes again: A must write them."""
    a1, a2, removed = cluster.run_in_a_row("a", ("save", "a", 1, 1), ("save", "a", 2, 2),
                                           ("rm", "a@1"))
    assert removed == a1
    b1, result = cluster.run_in_a_row("b", ("save", "b", 1, 3),
                                      ("gc", HOUR, 2 * HOUR))  # default grace, 2 h later
    assert result["orphans_deleted"] + result["chunks_deleted"] > 0  # a@1's objects went
    again = cluster.run("a", "save", "a", 3, 1)  # a@1's bytes, from A's stale index
    cluster.assert_all_whole("a", {a2: state(2), b1: state(3), again: state(1)})
    cluster.assert_all_whole("c", {a2: state(2), b1: state(3), again: state(1)})


def test_a_chunk_lost_from_storage_is_never_deduplicated_against_again(
        cluster: Cluster) -> None:
    """An operator deletes a chunk: the next save that has it writes it again (locally
    a dedup hit is stat-checked; on S3 the first read or verify that finds it missing
    tells the index, and a process checks each object once before it reuses it), and
    verify names every broken version."""
    first = cluster.run("a", "save", "a", 1, 1)
    with cluster.open("a") as store:
        lost = store.index.version_refs(first)[0]
        store.backend.delete(CHUNKS.key(lost))
        if store.backend.local_path() is None:
            assert not store.verify().ok  # finds it missing, and the index forgets it
    later = cluster.run_in_a_row("a", *[("save", "a", step, 1) for step in (2, 3)])
    cluster.assert_all_whole("a", {v: state(1) for v in [first, *later]})


def test_a_reader_keeps_the_grace_period_after_removal_and_index_rebuild(
        tmp_path: Path) -> None:
    """Objects written long ago, a version removed now, the index rebuilt: GC with the
    default grace must not delete under a reader that opened the version."""
    url = tmp_path / "store"
    arrays = state(1)
    with chunkstore.open(url, chunk_size=CHUNK_SIZE, create=True) as store:
        with store.new_version("r", 1) as version:
            for name, array in arrays.items():
                version.put(name, array)
        for path in (url / "chunks").rglob("*"):
            if path.is_file():
                os.utime(path, (time.time() - 2 * HOUR,) * 2)  # saved two hours ago
        reader = store.open_version("r@1")
        store.delete("r@1")
        store.rebuild_index()
        result = store.gc(grace="1h")
        assert result.chunks_deleted + result.orphans_deleted == 0
        for name, array in arrays.items():
            np.testing.assert_array_equal(reader.get(name), array)
        # While the reader is open its read lease keeps the version whole, whatever the
        # grace; once it is closed and the grace period has passed, the same GC frees it.
        result = store.gc(grace="1h", clock=lambda: time.time() + 2 * HOUR)
        assert result.chunks_deleted + result.orphans_deleted == 0
        assert result.readers_protected == 1
        reader.close()
        result = store.gc(grace="1h", clock=lambda: time.time() + 2 * HOUR)
        assert result.chunks_deleted + result.orphans_deleted > 0
        assert not list((url / "removed").iterdir())  # the tombstone went too


def test_an_index_failure_after_the_commit_is_a_published_save(
        store: chunkstore.Store, store_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Once the commit record exists the save has succeeded: an index that cannot be
    written (here its map is full) is repaired on the next open, never raised."""
    arrays = state(1)

    def full(*args: object, **kwargs: object) -> bool:
        raise lmdb.MapFullError("mdb_put: MDB_MAP_FULL: Environment mapsize limit reached")

    monkeypatch.setattr(store.index, "add_version", full)
    with store.new_version("r", 1) as version:
        for name, array in arrays.items():
            version.put(name, array)
    assert "published, but the index was not updated" in caplog.text
    monkeypatch.undo()
    assert not list((store_path / "sessions").iterdir())  # the session ended anyway
    assert store.versions() == []  # the index missed it ...
    store.reconcile()  # ... until the next open or GC reconciles it
    assert [v.id for v in store.versions()] == [version.info.id]
    assert store.verify().ok


def test_index_deleted_under_a_writer_while_another_process_collects(
        tmp_path: Path) -> None:
    """A writer saves (and removes old versions) in a loop; a GC with no grace runs in
    a loop from other processes; the store's index directory is deleted repeatedly.
    Every save that reported success must read back exact."""
    url = tmp_path / "store"
    chunkstore.open(url, chunk_size=CHUNK_SIZE, create=True).close()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = [sys.executable, str(REPO / "tests" / "machine_child.py"), str(url),
             str(url / "index")]
    seconds = 8
    writer = subprocess.Popen([*child, "save-loop", "w", str(seconds)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)
    collector = subprocess.Popen([*child, "gc-loop", str(seconds)], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)
    stop = threading.Event()

    def delete_index() -> None:
        while not stop.wait(0.7):
            shutil.rmtree(url / "index", ignore_errors=True)

    deleter = threading.Thread(target=delete_index)
    deleter.start()
    try:
        out, err = writer.communicate(timeout=300)
        gc_out, gc_err = collector.communicate(timeout=300)
    finally:
        stop.set()
        deleter.join()
    assert writer.returncode == 0, err
    assert collector.returncode == 0, gc_err
    published = json.loads(out.splitlines()[-1])
    gc_stats = json.loads(gc_out.splitlines()[-1])
    assert len(published) >= 10 and gc_stats["runs"] >= 3 and gc_stats["deleted"] > 0
    with chunkstore.open(url, create=True) as store:
        result = store.verify()
        assert result.ok, result.problems
        live = {v.id: v for v in store.versions()}
        assert set(live) <= set(published) and len(live) == 2
        for info in live.values():
            np.testing.assert_array_equal(store.open_version(info.id).get("w"),
                                          loop_state("w", info.step))


#: A writer that saves once, says so, waits for a line on stdin, then saves three more
#: (keeping the newest two) and checks its own index against the store (verify).
PAUSED_WRITER = """
import json, sys
import chunkstore
from tests.machine_child import loop_state, save
with chunkstore.open(sys.argv[1]) as store:
    ids = [save(store, "w", 0, {"w": loop_state("w", 0)})]
    print("ready", flush=True)
    sys.stdin.readline()
    for step in range(1, 4):
        ids.append(save(store, "w", step, {"w": loop_state("w", step)}))
        for info in store.versions("w")[:-2]:
            store.delete_listed(info.id)
    result = store.verify()
    print(json.dumps({"ids": ids, "problems": [p.message for p in result.problems]}))
"""


@pytest.mark.parametrize("during", [False, True], ids=["before-open", "during-open"])
@pytest.mark.parametrize("first", ["lock.mdb", "data.mdb"])
def test_an_index_half_deleted_under_a_writer_is_never_paired_with_a_new_file(
        tmp_path: Path, first: str, during: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """``rm -rf index/`` while a job runs unlinks the index's files one at a time; a
    process that opens the store between two unlinks finds one of LMDB's two files
    (data.mdb, lock.mdb: the writer mutex, reader table and last transaction id),
    which the running job still uses, beside a new one of the other.  Two lock files
    on one data file, or one lock file on two data files, let two writers write at
    once and a writer reuse pages under readers it does not see (an abort in
    ``mdb_page_touch``, a damaged index).  The open that comes between (another
    process's save; the unlink before it, or between its look at the directory and
    LMDB's open) must start a new index of both files, and every process goes on,
    its own index verifying (break-checked: without the fix LMDB opens the file left,
    whose inode the test sees again; without the undoing of what an open made during
    the deletion, the retry pairs the new file with the old)."""
    url = tmp_path / "store"
    chunkstore.open(url, chunk_size=CHUNK_SIZE, create=True).close()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    writer = subprocess.Popen([sys.executable, "-c", PAUSED_WRITER, str(url)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)
    try:
        assert writer.stdout is not None and writer.stdout.readline() == "ready\n"
        left = "data.mdb" if first == "lock.mdb" else "lock.mdb"
        in_use = (url / "index" / left).stat().st_ino
        if during:
            real_open = lmdb.open

            def unlinked_first(path: str, **options: Any) -> lmdb.Environment:
                monkeypatch.setattr(lmdb, "open", real_open)
                (url / "index" / first).unlink()
                return real_open(path, **options)

            monkeypatch.setattr(lmdb, "open", unlinked_first)
        else:
            (url / "index" / first).unlink()  # rm's first unlink; the other still there
        with chunkstore.open(url) as store:  # another process would open it here
            with store.new_version("other", 0) as version:
                version.put("w", loop_state("other", 0))
            assert store.verify().ok
        assert lmdb.open is real_open if during else True  # the unlink came in the open
        now = url / "index" / left
        assert not now.exists() or now.stat().st_ino != in_use  # not paired with it
        shutil.rmtree(url / "index", ignore_errors=True)  # rm goes on
        out, err = writer.communicate("go\n", timeout=120)
    finally:
        writer.kill()
    assert writer.returncode == 0, err
    done = json.loads(out.splitlines()[-1])
    assert done["problems"] == []
    with chunkstore.open(url) as store:
        assert store.verify().ok
        assert {v.id for v in store.versions("w")} == set(done["ids"][-2:])
        for info in store.versions("w"):
            np.testing.assert_array_equal(store.open_version(info.id).get("w"),
                                          loop_state("w", info.step))


def test_index_rebuild_refuses_during_saves_and_no_save_fails_because_of_it(
        cluster: Cluster, tmp_path: Path) -> None:
    """Rebuilds from another process while one saves in a loop: a rebuild either refuses
    (a save is in progress, seen in the store) or runs between saves; no save fails."""
    refused = tmp_path / "refused"  # the writer goes on until a rebuild was refused
    stop = tmp_path / "stop"  # the rebuilds go on until the writer has ended
    writer = cluster.popen("a", "save-loop", "w", 3, refused)
    # Rebuild as often as we can while it saves: one rebuild after another, each opening
    # the store afresh, in a process of their own.
    rebuilder = cluster.popen("a", "rebuild-loop", stop, refused)
    finished: list[tuple[str, str]] = []  # read its output as it comes: a full pipe blocks it
    reader = threading.Thread(target=lambda: finished.append(rebuilder.communicate(timeout=300)))
    reader.start()
    try:
        out, err = writer.communicate(timeout=300)
    finally:
        stop.touch()
        reader.join()
    assert rebuilder.returncode == 0, finished[0][1]
    outcomes: list[dict[str, Any]] = json.loads(finished[0][0].splitlines()[-1])
    assert writer.returncode == 0, err  # no save raised
    published = json.loads(out.splitlines()[-1])
    assert len(published) >= 3
    assert any("refused" in o for o in outcomes), outcomes  # it did run during saves
    with cluster.open("a") as store:
        live = store.versions("w")
        # At least the newest two: while a rebuild ran, the writer's index could lag
        # behind the store, and its retention then keeps more, never less.
        assert len(live) >= 2 and {v.id for v in live} <= set(published)
        for info in live:
            np.testing.assert_array_equal(store.open_version(info.id).get("w"),
                                          loop_state("w", info.step))
        assert store.verify().ok


def test_index_rebuild_refuses_while_a_save_on_another_index_is_in_progress(
        cluster: Cluster) -> None:
    """The save in progress is seen through the store, not through the rebuilding index."""
    with cluster.open("a") as store:
        writer = store.new_version("a", 1)
        writer.put("x", np.arange(5000, dtype=np.float32))
        outcome = cluster.run("b", "rebuild")
        assert "refused" in outcome and "save a@1" in outcome["refused"]
        writer.commit()
    assert "refused" not in cluster.run("b", "rebuild")
    cluster.assert_all_whole("b", {writer.info.id: {"x": np.arange(5000, dtype=np.float32)}})


def test_an_index_idle_past_the_journals_pruning_trusts_nothing_it_may_have_missed(
        cluster: Cluster) -> None:
    """GC prunes journal entries older than a day; an index that has not read the
    journal since then forgets every dedup target instead of trusting them."""
    a1, a2, removed = cluster.run_in_a_row("a", ("save", "a", 1, 1), ("save", "a", 2, 2),
                                           ("rm", "a@1"))
    assert removed == a1
    first, later = cluster.run_in_a_row("b", ("gc", HOUR, 2 * HOUR),
                                        ("gc", HOUR, 2 * 24 * HOUR))  # then two days on
    assert first["orphans_deleted"] + first["chunks_deleted"] > 0
    assert first["journal_entries_pruned"] == 0  # a day old at most: kept
    assert later["journal_entries_pruned"] >= 1
    with cluster.open("b") as store:
        keys = list(store.backend.list("gc/"))
        assert [k for k in keys if k.startswith("gc/horizon-")], keys
    again = cluster.run("a", "save", "a", 3, 1)  # a@1's bytes, from A's idle index
    cluster.assert_all_whole("a", {a2: state(2), again: state(1)})


def test_a_batch_claim_taken_before_another_indexs_gc_finished_is_not_trusted() -> None:
    """Small tensors are claimed in a batch (their packs, here) before the save waits
    out the GC fence.  A GC of another index fenced both packs; the save waits for it
    on the first, then applies its deletions; the second pack must not be reused on
    the strength of the claim the batch took before (a remote store has no cheap
    existence check to catch it)."""
    from chunkstore.index.lmdbindex import CHUNK
    from chunkstore.protocol.journal import DONE, start_entry, write_entry

    a, b = np.full(16, 1, np.int32), np.full(16, 2, np.int32)
    with chunkstore.open(f"memory://cs-{os.urandom(8).hex()}", threads=1, create=True) as store:
        packs = []
        for step, (name, value) in enumerate([("a", a), ("b", b)], start=1):
            with store.new_version(run="old", step=step) as version:  # one pack each
                version.put(name, value)
            entry = store.open_version(version.info.id).entry(name)
            assert isinstance(entry, TensorEntry)
            location = entry.shards[0].location(0)
            assert location is not None
            packs.append(location.pack)
            # Another machine removed the version; this index has not noticed.
            store.backend.delete(VERSIONS.key(version.info.id))
        gc_entry = start_entry(store.objects, [(CHUNK, p) for p in packs])  # the other GC

        def other_gc_deletes() -> None:
            time.sleep(0.3)  # while the save waits on the entry for the first pack
            for pack in packs:
                store.backend.delete(CHUNKS.key(pack))
            gc_entry.state = DONE
            write_entry(store.objects, gc_entry)

        with store.new_version(run="r", step=1) as version:
            collector = threading.Thread(target=other_gc_deletes)
            collector.start()
            version.put("a", a)
            version.put("b", b)
        collector.join()
        reader = store.open_version("r@1")
        np.testing.assert_array_equal(reader.get("a"), a)
        np.testing.assert_array_equal(reader.get("b"), b)
        # This index still counts the versions removed behind its back (a refcount
        # problem only, which reconcile repairs); no object is missing or damaged.
        problems = [p for p in store.verify().problems if p.kind != "refcount"]
        assert problems == []


def test_a_delta_base_another_indexs_gc_fenced_is_never_encoded_against() -> None:
    """A save encodes a changed chunk against the same chunk of the run's previous
    version, which another machine removed; that machine's GC fenced the bases and
    deletes them while the save runs.  The save claims each base as it claims a
    chunk it deduplicates against, so it waits out the fence and then stores the
    chunks whole: the new version reads back and nothing it lists is missing."""
    from chunkstore.index.lmdbindex import CHUNK
    from chunkstore.protocol.journal import DONE, start_entry, write_entry

    rng = np.random.default_rng(3)
    table = rng.standard_normal((256, 16)).astype(np.float32)  # 16 KiB: four chunks
    with chunkstore.open(f"memory://cs-{os.urandom(8).hex()}", threads=1, chunk_size=4096,
                         delta_depth=2, create=True) as store:
        with store.new_version(run="r", step=0) as version:
            version.put("emb", table)
        entry = store.open_version(version.info.id).entry("emb")
        assert isinstance(entry, TensorEntry)
        bases = list(entry.shards[0].chunks)
        # Another machine removed the version; this index has not noticed.
        store.backend.delete(VERSIONS.key(version.info.id))
        gc_entry = start_entry(store.objects, [(CHUNK, d) for d in bases])  # the other GC

        def other_gc_deletes() -> None:
            time.sleep(0.3)  # while the save waits on the entry for the first base
            for digest in bases:
                store.backend.delete(CHUNKS.key(digest))
            gc_entry.state = DONE
            write_entry(store.objects, gc_entry)

        changed = table.copy()
        changed.reshape(-1)[::1024] += np.float32(1)  # one element in every chunk
        collector = threading.Thread(target=other_gc_deletes)
        with store.new_version(run="r", step=1) as version:
            collector.start()
            version.put("emb", changed)
        collector.join()
        store.base_cache.clear()
        np.testing.assert_array_equal(store.open_version("r@1").get("emb"), changed)
        problems = [p for p in store.verify().problems if p.kind != "refcount"]
        assert problems == []


@pytest.fixture(params=["memory", "s3"])
def recreated(request: pytest.FixtureRequest, tmp_path: Path
              ) -> Iterator[tuple[str, dict[str, Any], Any]]:
    """A remote store's URL, its options, and a way to delete everything in it (as a
    user who empties the prefix and starts over does)."""
    if request.param == "memory":
        url = f"memory://cs-{os.urandom(8).hex()}"

        def wipe() -> None:
            with chunkstore.open(url, create=False, index_dir=str(tmp_path / "x")) as store:
                for key in list(store.backend.list("")):
                    store.backend.delete(key)

        yield url, {}, wipe
        return
    import s3fs

    endpoint = request.getfixturevalue("s3_endpoint")
    bucket = create_bucket(endpoint)
    url = f"s3://{bucket}/store"
    try:
        yield url, storage_options(endpoint), lambda: s3fs.S3FileSystem(
            **storage_options(endpoint)).rm(f"{bucket}/store", recursive=True)
    finally:
        remove_bucket(endpoint, bucket)


def test_a_store_deleted_and_created_again_never_dedups_against_the_old_ones_index(
        recreated: tuple[str, dict[str, Any], Any], tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """An index records the store it describes.  Emptied and created again at the same
    location, the store is another: the index still calls every old object stored,
    and a remote store has no cheap existence check to catch it.  It is emptied and
    rebuilt, so the first save of the new store writes what it needs and reads back."""
    url, options, wipe = recreated
    index_dir = str(tmp_path / "index")
    weights = np.arange(50_000, dtype=np.float32)
    with chunkstore.open(url, index_dir=index_dir, storage_options=options, create=True) as store:
        with store.new_version(run="r", step=1) as version:
            version.put("w", weights)
    wipe()
    # Another machine saves into the new store meanwhile, so the index cannot be rebuilt
    # now (a rebuild waits for saves in progress): it must not keep its old records.
    with chunkstore.open(url, index_dir=str(tmp_path / "other"),
                         storage_options=options, create=True) as other:
        elsewhere = other.new_version(run="other", step=1)
        with chunkstore.open(url, index_dir=index_dir, storage_options=options,
                             create=True) as store:
            with store.new_version(run="r", step=1) as version:
                version.put("w", weights)
                version.put_data("trainer", {"step": 1})
            assert version.info.new_bytes > 0  # written again, not deduplicated
            np.testing.assert_array_equal(store.open_version("r@1").get("w"), weights)
            assert store.verify().ok
        elsewhere.abort()
    assert any("described another store" in r.getMessage() for r in caplog.records)
    # The same store opened again keeps its index: no warning, the version is reused.
    caplog.clear()
    with chunkstore.open(url, index_dir=index_dir, storage_options=options, create=True) as store:
        with store.new_version(run="r", step=2) as version:
            version.put("w", weights)
        assert version.info.new_bytes == 0
    assert not any("described another store" in r.getMessage() for r in caplog.records)


def test_an_index_that_names_no_store_is_kept_and_named(tmp_path: Path) -> None:
    """An index made by an earlier release names no store: it is taken to describe the
    store it is opened on (its records kept) and names it from then on."""
    from chunkstore.index.lmdbindex import STORE_KEY

    index_dir = tmp_path / "index"
    weights = np.arange(10_000, dtype=np.float32)
    with chunkstore.open(tmp_path / "s", index_dir=str(index_dir), create=True) as store:
        with store.new_version(run="r", step=1) as version:
            version.put("w", weights)
        named = store.index.env.begin().get(STORE_KEY, db=store.index.meta)
        assert named is not None
        store.rebuild_index()  # a rebuilt index still names its store
        assert store.index.env.begin().get(STORE_KEY, db=store.index.meta) == named
        with store.index.env.begin(write=True) as txn:  # as an earlier release left it
            txn.delete(STORE_KEY, db=store.index.meta)
    with chunkstore.open(tmp_path / "s", index_dir=str(index_dir), create=True) as store:
        assert store.index.env.begin().get(STORE_KEY, db=store.index.meta) == named
        with store.new_version(run="r", step=2) as version:
            version.put("w", weights)
        assert version.info.new_bytes == 0  # its records were kept


def test_a_store_put_back_to_an_older_copy_never_dedups_against_what_the_copy_lacks(
        recreated: tuple[str, dict[str, Any], Any], tmp_path: Path) -> None:
    """A bucket put back to an older copy of itself (or objects a lifecycle rule
    expired) keeps the store's ``created`` time, so its index still calls stored the
    objects the copy lacks, and a remote store has no cheap existence check.  A store
    handle checks each object once before it first reuses it: the next save writes
    again what is gone and reads back, and verify is clean."""
    from chunkstore.backends import open_backend

    url, options, _ = recreated
    index_dir = str(tmp_path / "index")
    older = np.arange(50_000, dtype=np.float32)
    newer = older + 1
    # Random bits: no delta of anything, so the next save reuses it as a member of
    # the pack this save writes (the other reuse path from the delta chunk of "w").
    noise = np.random.default_rng(0).integers(0, 2**31, 3_000, dtype=np.int64)
    with chunkstore.open(url, index_dir=index_dir, storage_options=options, create=True) as store:
        with store.new_version(run="r", step=1) as version:
            version.put("w", older)
    backend = open_backend(url, **options)
    copy = {key: backend.get(key) for key in backend.list("")}
    with chunkstore.open(url, index_dir=index_dir, storage_options=options, create=True) as store:
        with store.new_version(run="r", step=2) as version:
            version.put("w", newer)
            version.put("noise", noise)
            version.put_data("trainer", {"step": 2})
        assert version.info.new_bytes > 0
    for key in list(backend.list("")):  # the store as the copy holds it, nothing else
        if key not in copy:
            backend.delete(key)
    for key, data in copy.items():
        backend.put(key, data)
    with chunkstore.open(url, index_dir=index_dir, storage_options=options, create=True) as store:
        assert [v.step for v in store.versions("r")] == [1]
        with store.new_version(run="r", step=3) as version:
            version.put("w", newer)
            version.put("noise", noise)
            version.put_data("trainer", {"step": 2})
        assert version.info.new_bytes > 0  # written again, not deduplicated
        np.testing.assert_array_equal(store.open_version("r@3").get("w"), newer)
        np.testing.assert_array_equal(store.open_version("r@3").get("noise"), noise)
        np.testing.assert_array_equal(store.open_version("r@1").get("w"), older)
        assert store.verify().ok
        # Once per handle: what this handle found stored, or stored and published, is
        # not asked about again.
        store.backend = counting = _CountingExists(store.backend)
        with store.new_version(run="r", step=4) as version:
            version.put("w", newer)
        assert version.info.new_bytes == 0
        store.backend = counting.inner
        assert counting.checked == []


class _CountingExists(ForwardingBackend):
    """The store's backend, noting every chunk or node it is asked whether it holds."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.checked: list[str] = []

    def exists(self, key: str) -> bool:
        if key.startswith(("chunks/", "nodes/")):
            self.checked.append(key)
        return self.inner.exists(key)

    def stat(self, key: str) -> Any:
        if key.startswith(("chunks/", "nodes/")):
            self.checked.append(key)
        return self.inner.stat(key)


def test_a_journal_entry_pruned_between_the_listing_and_its_read_is_not_taken_as_applied(
        tmp_path: Path) -> None:
    """Another GC prunes a finished entry this index never applied, after the sync
    listed the journal and before it read the entry.  What that entry deleted cannot be
    known: the save distrusts the index (checks every reuse), and the index is not
    recorded as synced past the entry, so the next sync sees the new horizon and stops
    treating any record as stored."""
    from chunkstore.index.lmdbindex import CHUNK, ChunkState
    from chunkstore.objects.kinds import JOURNAL
    from chunkstore.objects.objectstore import ObjectStore
    from chunkstore.protocol.journal import (
        HORIZON_PREFIX,
        entry_time_ns,
        list_entry_ids,
        read_entry,
        sync_journal,
    )

    path = tmp_path / "s"
    with chunkstore.open(path, index_dir=str(tmp_path / "b"), create=True) as b:
        with b.new_version(run="r", step=1) as version:
            version.put("w", np.arange(20_000, dtype=np.float32))
    with chunkstore.open(path, index_dir=str(tmp_path / "a"), create=True) as a:  # counts r@1 in
        with chunkstore.open(path, index_dir=str(tmp_path / "b"), create=True) as b:
            b.delete(version.info.id)
            b.gc(grace=0)
            (entry_id,) = list_entry_ids(b.objects)
            entry = read_entry(b.objects, entry_id)
        assert entry is not None
        deleted = [d for kind, d in entry.objects() if kind == CHUNK]
        assert deleted and all(a.index.record(CHUNK, d).state == ChunkState.LIVE
                               for d in deleted)
        fence = sync_journal(ObjectStore(_PrunedAfterListing(a.backend, entry_id)), a.index)
        assert fence.distrust_index
        synced = a.index.journal_synced()
        assert synced is not None and synced <= entry_time_ns(entry_id)
        sync_journal(a.objects, a.index)  # the next save's sync sees the horizon
        assert all(a.index.record(CHUNK, d).state == ChunkState.WRITING for d in deleted)
    assert list(a.backend.list(f"{JOURNAL.prefix}{HORIZON_PREFIX}"))
    assert not a.backend.exists(JOURNAL.key(entry_id))


class _PrunedAfterListing(ForwardingBackend):
    """The store as a GC elsewhere prunes one journal entry right after this backend's
    next listing of the journal: the horizon marker first, then the entry (as
    ``prune_journal`` does)."""

    def __init__(self, inner: Any, entry_id: str) -> None:
        super().__init__(inner)
        self.entry_id: str | None = entry_id

    def list(self, prefix: str = "") -> Iterator[str]:
        from chunkstore.objects.kinds import JOURNAL
        from chunkstore.protocol.journal import HORIZON_PREFIX, entry_time_ns

        keys = list(self.inner.list(prefix))
        if prefix == JOURNAL.prefix and self.entry_id is not None:
            horizon = entry_time_ns(self.entry_id)
            self.inner.put(f"{JOURNAL.prefix}{HORIZON_PREFIX}{horizon:020d}", b"")
            self.inner.delete(JOURNAL.key(self.entry_id))
            self.entry_id = None
        return iter(keys)


class _DeleteThenFail(ForwardingBackend):
    """The first chunk DELETE takes effect and its answer is lost (a reset connection,
    Ctrl-C): the caller sees an error for an object that is gone."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.fired = False

    def delete(self, key: str) -> bool:
        existed = self.inner.delete(key)
        if key.startswith("chunks/") and not self.fired:
            self.fired = True
            raise BackendError(f"DELETE {key}: connection reset")
        return existed


def test_a_gc_interrupted_by_a_deletion_that_took_effect_names_every_candidate(
        tmp_path: Path) -> None:
    """A GC's first deletion takes effect and then raises: its journal entry must still
    name everything it may have deleted, so another index stops deduplicating against
    the deleted chunk (here a long-lived handle on a remote store, which found the
    chunk stored before and does not ask again)."""
    from chunkstore.protocol.journal import list_entry_ids, read_entry

    url = f"memory://cs-{os.urandom(8).hex()}"
    weights = np.random.default_rng(0).standard_normal(300_000).astype(np.float32)
    with chunkstore.open(url, index_dir=str(tmp_path / "b"), create=True) as b:
        with b.new_version(run="old", step=1) as version:
            version.put("w", weights)
        with chunkstore.open(url, index_dir=str(tmp_path / "a"), create=True) as a:
            a.delete("old@1")
            a.backend = _DeleteThenFail(a.backend)
            with pytest.raises(BackendError):
                a.gc(grace=0)
            a.backend = a.backend.inner
            (entry_id,) = list_entry_ids(a.objects)
            entry = read_entry(a.objects, entry_id)
            assert entry is not None and entry.chunks  # names what it may have deleted
        with b.new_version(run="new", step=1) as version:
            version.put("w", weights)
    with chunkstore.open(url, index_dir=str(tmp_path / "c"), create=True) as c:
        np.testing.assert_array_equal(c.open_version("new@1").get("w"), weights)
        assert c.verify().ok


def test_node_claims_taken_before_another_indexs_gc_finished_are_not_trusted(
        tmp_path: Path) -> None:
    """A commit claims its version's nodes in one batch, then waits out the GC entry
    that names the first; that GC deletes them all meanwhile.  The batch's answers for
    the other nodes are stale once the entry is applied: each is claimed again, found
    deleted, and written (as chunk batches are, since 'claim_small')."""
    import threading

    from chunkstore.index.lmdbindex import NODE
    from chunkstore.objects.kinds import NODES
    from chunkstore.protocol.journal import DONE, start_entry, write_entry

    url = f"memory://cs-{os.urandom(8).hex()}"
    with chunkstore.open(url, threads=1, index_dir=str(tmp_path / "i"), node_size=0,
                         create=True) as store:
        def content(version: Any) -> None:
            version.put("m.a", np.arange(16, dtype=np.int32))
            version.put("n.b", np.arange(16, dtype=np.int32) * 2)
            version.put_data("cfg", {"lr": 0.1, "name": "x"})

        with store.new_version(run="old", step=1) as version:
            content(version)
        old = version.info
        nodes = sorted(store.index.version_node_refs(old.id), key=lambda d: d.hex)
        assert len(nodes) > 2
        # Another machine removed the old version (this index has not noticed) and its
        # GC fences the old version's nodes, then deletes them while this save waits.
        store.backend.delete(VERSIONS.key(old.id))
        entry = start_entry(store.objects, [(NODE, d) for d in nodes])

        def other_gc_deletes() -> None:
            time.sleep(0.3)
            for digest in nodes:
                store.backend.delete(NODES.key(digest))
            entry.state = DONE
            write_entry(store.objects, entry)

        other = threading.Thread(target=other_gc_deletes)
        with store.new_version(run="r", step=1) as version:  # reads the journal: active
            content(version)
            other.start()
        other.join()
    with chunkstore.open(url, index_dir=str(tmp_path / "fresh"), create=True) as fresh:
        got = fresh.open_version("r@1")
        np.testing.assert_array_equal(got.get("n.b"), np.arange(16, dtype=np.int32) * 2)
        assert got.get_data("cfg") == {"lr": 0.1, "name": "x"}
        assert fresh.verify().ok


class _FlakyGet(ForwardingBackend):
    """The first GET of one key fails as a busy server's would (a transient error)."""

    def __init__(self, inner: Any, key: str) -> None:
        super().__init__(inner)
        self.key, self.failed = key, False

    def get(self, key: str) -> bytes:
        if key == self.key and not self.failed:
            self.failed = True
            raise BackendError(f"GET {key}: 503 slow down")
        return self.inner.get(key)


def test_a_removed_version_whose_tree_cannot_be_read_now_keeps_everything(
        tmp_path: Path) -> None:
    """A version removed within the grace period keeps its whole tree for a reader that
    opened it before.  A GET of one of its subtree nodes fails once (a transient error):
    the GC deletes nothing (it stops), and the reader reads on."""
    from chunkstore.objects.kinds import NODES

    root = tmp_path / "s"
    rng = np.random.default_rng(1)
    first, second = (rng.standard_normal(200_000).astype(np.float32) for _ in range(2))
    with chunkstore.open(root, index_dir=str(tmp_path / "b"), node_size=0, create=True) as b:
        with b.new_version(run="old", step=1) as version:
            version.put("m.a", first)
            version.put("m.b", second)
            version.put("x", np.arange(10))
        reader = b.open_version("old@1")
        subtree = [d for d in b.index.version_node_refs(reader.info.id)
                   if d.hex != reader.info.root.hex]
        assert len(subtree) == 1
        b.delete("old@1")  # its tombstone is young: a grace period starts
        written_long_ago = time.time() - 2 * HOUR
        for folder in ("chunks", "nodes"):
            for path in (root / folder).rglob("*"):
                if path.is_file():
                    os.utime(path, (written_long_ago, written_long_ago))
        with chunkstore.open(root, index_dir=str(tmp_path / "a"), node_size=0, create=True) as a:
            a.backend = _FlakyGet(a.backend, NODES.key(subtree[0]))
            with pytest.raises(GcAbortedError):
                a.gc(grace="1h")
            a.backend = a.backend.inner
            assert a.gc(grace="1h").chunks_deleted + a.gc(grace="1h").orphans_deleted == 0
        np.testing.assert_array_equal(reader.get("m.a"), first)
        np.testing.assert_array_equal(reader.get("m.b"), second)


def test_a_damaged_copy_of_a_node_a_save_must_write_is_replaced_not_kept(
        tmp_path: Path) -> None:
    """A node object is stored but damaged, and no version this index knows lists it (a
    removed version's, seen by a new index): the save that needs it writes it, finds a
    copy stored, and keeps the copy only if it holds the node's bytes; here it does not,
    so it is replaced and the version reads back."""
    from chunkstore.objects.kinds import NODES

    root = tmp_path / "s"
    weights = np.arange(10_000, dtype=np.float32)
    with chunkstore.open(root, index_dir=str(tmp_path / "a"), create=True) as a:
        with a.new_version(run="r", step=1) as version:
            version.put("w", weights)
        tree = version.info.root
        a.delete(version.info.id)
    path = root / NODES.key(tree)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with chunkstore.open(root, index_dir=str(tmp_path / "b"),
                         create=True) as b:  # never counted r@1
        with b.new_version(run="r", step=2) as version:
            version.put("w", weights)
        assert version.info.root == tree
    with chunkstore.open(root, index_dir=str(tmp_path / "c"), create=True) as c:
        np.testing.assert_array_equal(c.open_version("r@2").get("w"), weights)
        assert c.verify().ok


@pytest.mark.parametrize("tree", ["newer format", "never readable"])
def test_a_tombstone_that_never_ages_never_stops_every_gc(tmp_path: Path, tree: str) -> None:
    """A tombstone whose removal time cannot be read counts as removed now at every run,
    so it never ages out: if its tree cannot be read (a node of a newer format, or a GET
    that always fails) GC must not stop on it run after run; it goes on as for damage."""
    from chunkstore.format.digest import Digest
    from chunkstore.objects.kinds import NODES

    root = tmp_path / "s"
    with chunkstore.open(root, index_dir=str(tmp_path / "i"), create=True) as store:
        with store.new_version(run="r", step=1) as version:
            version.put("w", np.arange(10, dtype=np.float32))
        node = json.dumps({"format_version": 99, "kind": "tree", "entries": {}}).encode()
        digest = Digest.of(node)
        store.backend.put(NODES.key(digest), node)
        removed = "ab" * 32
        store.backend.put(f"removed/{removed}", json.dumps(
            {"format_version": 1, "version": removed, "root": digest.hex, "run": "x",
             "step": 1, "removed": 10**400}).encode())
        if tree == "never readable":
            store.backend = _AlwaysFailingGet(store.backend, NODES.key(digest))
        for _ in range(2):
            store.gc(grace=0)
        np.testing.assert_array_equal(store.open_version("r@1").get("w"),
                                      np.arange(10, dtype=np.float32))


class _AlwaysFailingGet(ForwardingBackend):
    """Every GET of one key fails (a 403 that does not go away)."""

    def __init__(self, inner: Any, key: str) -> None:
        super().__init__(inner)
        self.key = key

    def get(self, key: str) -> bytes:
        if key == self.key:
            raise BackendError(f"GET {key}: 403 forbidden")
        return self.inner.get(key)


def test_a_handle_forgets_the_oldest_objects_it_found_stored_not_all(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past its bound the handle forgets the oldest quarter of what it found stored, not
    everything (a save reusing more objects than the bound asked about every one of
    them again at every save)."""
    import chunkstore.handle.handle as store_module
    from chunkstore.format.digest import Digest
    from chunkstore.index.lmdbindex import CHUNK

    monkeypatch.setattr(store_module, "SEEN_STORED_MAX", 8)
    with chunkstore.open(f"memory://cs-{os.urandom(8).hex()}",
                         index_dir=str(tmp_path / "i"), create=True) as store:
        digests = [Digest.of(bytes([i])) for i in range(9)]
        store.saw_stored(CHUNK, digests)
        assert [store.seen_stored(CHUNK, d) for d in digests] == [False] * 2 + [True] * 7


def test_handles_capping_chains_differently_on_two_indexes_keep_every_version_whole(
        tmp_path: Path) -> None:
    """One run saved in turns by a handle capped at ``delta_depth=1`` on one index and
    the store's own depth on another, each GC run from the other index with no grace
    after a middle version is removed: every chain either handle built or reused lists
    what GC must keep, so every kept version reads back and verify is clean."""
    path = tmp_path / "s"
    rng = np.random.default_rng(5)
    table = rng.standard_normal((256, 16)).astype(np.float32)  # 16 KiB: four chunks
    chunkstore.open(path, chunk_size=4096, delta_depth=4, create=True).close()
    saved: dict[str, np.ndarray] = {}
    for step in range(12):
        capped = step // 3 % 2 == 0
        table = table.copy()
        table[rng.integers(0, 256, 3)] += np.float32(0.5)  # a sparse update: deltas pay
        with chunkstore.open(path, index_dir=str(tmp_path / ("a" if capped else "b")),
                             delta_depth=1 if capped else None) as writer:
            with writer.new_version(run="r", step=step) as version:
                version.put("emb", table)
            saved[version.info.id] = table
        with chunkstore.open(path, index_dir=str(tmp_path / ("b" if capped else "a"))
                             ) as collector:
            live = [v.id for v in collector.versions("r")]
            if step % 3 == 2:
                collector.delete(live[len(live) // 2])
                saved.pop(live[len(live) // 2])
            collector.gc(grace=0)
            for kept, want in saved.items():
                np.testing.assert_array_equal(collector.open_version(kept).get("emb"), want)
    with chunkstore.open(path, index_dir=str(tmp_path / "a")) as store:
        chains = set()
        for kept in store.versions("r"):
            entry = store.open_version(kept.id).entry("emb")
            assert isinstance(entry, TensorEntry)
            chains.update(len(s.chain(i)) for s in entry.shards for i in range(len(s.chunks)))
        assert max(chains) > 1, chains  # the uncapped handle built longer chains
        problems = [p for p in store.verify().problems if p.kind != "refcount"]
        assert problems == []
