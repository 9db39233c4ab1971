"""Crash safety (invariants 1 and 2): a save SIGKILLed at any point publishes
nothing half-written, and every version published before it stays loadable.

Each test saves in a real subprocess (``tests/crash_child.py``) into a real
local store with a real LMDB index, kills it (``CHUNKSTORE_FAULT`` at a chosen
write, or a plain SIGKILL from here at a random moment), then reopens the
store in this process and checks it.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import chunkstore
from chunkstore.backends.wrappers import FAULT_ENV_VAR
from chunkstore.errors import SelectorError
from chunkstore.format.manifest import TensorEntry
from chunkstore.handle.tree import load_tree
from chunkstore.index.lmdbindex import Index
from tests.conftest import SMALL_CHUNK
from tests.crash_child import (
    NODE_SIZE_ENV_VAR,
    PACK_DELTAS_ENV_VAR,
    RUN,
    THREADS,
    make_state,
    open_store,
    save,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
CHILD = Path(__file__).with_name("crash_child.py")
# A step's new objects (see make_state): 12 chunks of 64 KiB (one of them a delta
# against the previous step's), 4 manifest nodes.
NEW_CHUNKS_PER_STEP = 12
NEW_NODES_PER_STEP = 4


def _files(store_path: Path, prefix: str) -> set[str]:
    """Names of the objects under ``prefix`` (not the temp files a kill leaves behind)."""
    return {p.name for p in (store_path / prefix).rglob("*")
            if p.is_file() and not p.name.startswith(".tmp-")}


def run_child(store_path: Path, first: int, last: int, fault: str | None, *,
              child: Path = CHILD, timeout: float = 60, packed: bool = False
              ) -> subprocess.CompletedProcess[str]:
    """Run a crash child (saves ``first``..``last`` into the store) with ``fault``
    injected, if any; ``packed``: it packs its delta chunks."""
    env = {k: v for k, v in os.environ.items() if k not in (FAULT_ENV_VAR, PACK_DELTAS_ENV_VAR)}
    env[PACK_DELTAS_ENV_VAR] = "1" if packed else "0"
    if fault is not None:
        env[FAULT_ENV_VAR] = fault
    return subprocess.run([sys.executable, str(child), str(store_path), str(first), str(last)],
                          env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=timeout, check=False)


def _check_version(store: chunkstore.Store, step: int) -> chunkstore.VersionInfo:
    """The version saved at ``step`` loads bit-exact, through get and get_into."""
    arrays, data = make_state(step)
    reader = store.open_version(f"{RUN}@{step}")
    assert sorted(reader.names()) == sorted([*arrays, "trainer"])
    for name, expected in arrays.items():
        got = reader.get(name)
        assert got.dtype == expected.dtype and got.shape == expected.shape
        assert got.tobytes() == expected.tobytes(), name
        out = np.empty_like(expected)
        reader.get_into(name, out)
        assert out.tobytes() == expected.tobytes(), name
    assert reader.get_data("trainer") == data
    assert reader.info.meta == {"step": step}
    return reader.info


def _check_store(store_path: Path, steps: list[int]) -> list[str]:
    """Reopen: exactly ``steps`` are published, each complete; verify is clean."""
    with chunkstore.open(store_path, create=False) as store:
        assert [v.step for v in store.versions(RUN)] == steps
        ids = [_check_version(store, step).id for step in steps]
        result = store.verify()
        assert result.ok, result.problems
        assert result.versions_checked == len(steps)
        assert sorted(store.stored_version_ids()) == sorted(ids)
    return ids


KILL_AFTER_SCRIPT = """
import sys
from chunkstore.backends import open_backend
from chunkstore.backends.wrappers import wrap_from_env
backend = wrap_from_env(open_backend(sys.argv[1]))
backend.put("versions/other-prefix", b"x")
for i in range(3):
    backend.put_if_absent(f"chunks/c{i}", b"x")
    print(f"returned c{i}", flush=True)
"""


def test_kill_after_put_dies_once_the_write_is_durable(tmp_path: Path) -> None:
    env = {**os.environ, FAULT_ENV_VAR: "kill-after-put:chunks/:1"}
    result = subprocess.run([sys.executable, "-c", KILL_AFTER_SCRIPT, str(tmp_path)], env=env,
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
                            check=False)
    assert result.returncode == -signal.SIGKILL, result.stderr
    assert result.stdout.split() == ["returned", "c0"]  # the second write never returned...
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == [
        "c0", "c1", "other-prefix"]  # ...but it landed


@pytest.fixture
def two_versions(store_path: Path) -> list[str]:
    """A store holding steps 1 and 2, saved (and closed) by this process, every chunk an
    object of its own (the tests below count them)."""
    chunkstore.open(store_path, chunk_size=SMALL_CHUNK, delta_depth=2, create=True).close()
    with open_store(str(store_path)) as store:
        store.pack_delta_chunks = False
        ids = [save(store, 1).id, save(store, 2).id]
    return ids


@pytest.mark.parametrize(
    ("fault", "new_chunks", "new_nodes"),
    [
        pytest.param("kill-before-put:sessions/:0", 0, 0, id="before-the-session"),
        pytest.param("kill-after-put:sessions/:0", 0, 0, id="after-the-session"),
        pytest.param("kill-before-put:chunks/:0", 0, 0, id="before-first-chunk"),
        pytest.param("kill-before-put:chunks/:5", 5, 0, id="before-sixth-chunk"),
        pytest.param(f"kill-before-put:chunks/:{NEW_CHUNKS_PER_STEP - 1}",
                     NEW_CHUNKS_PER_STEP - 1, 0, id="before-last-chunk"),
        pytest.param("kill-before-put:nodes/:0", NEW_CHUNKS_PER_STEP, 0, id="before-nodes"),
        pytest.param("kill-before-put:nodes/:2", NEW_CHUNKS_PER_STEP, 2, id="between-nodes"),
        pytest.param("kill-before-put:versions/:0", NEW_CHUNKS_PER_STEP, NEW_NODES_PER_STEP,
                     id="before-commit-record"),
    ],
)  # fmt: skip
def test_kill_before_the_commit_record_publishes_nothing(
    store_path: Path, two_versions: list[str], fault: str, new_chunks: int, new_nodes: int
) -> None:
    chunks_before = _files(store_path, "chunks")
    nodes_before = _files(store_path, "nodes")

    result = run_child(store_path, 3, 3, fault)

    assert result.returncode == -signal.SIGKILL, result.stderr
    assert "saved" not in result.stdout
    # The child died where the fault says.  Writes within a phase run in
    # parallel, so up to THREADS - 1 of those before the fatal one may not
    # have landed yet; a phase before the fatal one finished completely.
    in_flight = THREADS - 1
    written_chunks = len(_files(store_path, "chunks") - chunks_before)
    written_nodes = len(_files(store_path, "nodes") - nodes_before)
    assert new_chunks - in_flight <= written_chunks <= new_chunks
    assert new_nodes - in_flight <= written_nodes <= new_nodes
    if new_nodes or fault.startswith("kill-before-put:nodes/"):
        assert written_chunks == NEW_CHUNKS_PER_STEP
    if fault.startswith("kill-before-put:versions/"):
        assert written_nodes == NEW_NODES_PER_STEP
    assert _check_store(store_path, [1, 2]) == two_versions
    with chunkstore.open(store_path, create=False) as store:
        with pytest.raises(SelectorError, match="no version at step 3"):
            store.resolve(f"{RUN}@3")
        assert store.latest(RUN).step == 2  # type: ignore[union-attr]
    # A later save (another process, like a restarted job) completes normally.
    again = run_child(store_path, 3, 4, None)
    assert again.returncode == 0, again.stderr
    _check_store(store_path, [1, 2, 3, 4])


def test_kill_after_the_commit_record_publishes_the_version(
    store_path: Path, two_versions: list[str]
) -> None:
    result = run_child(store_path, 3, 3, "kill-after-put:versions/:0")

    assert result.returncode == -signal.SIGKILL, result.stderr
    assert "saved" not in result.stdout  # the commit call never returned
    records = _files(store_path, "versions")
    assert len(records) == 3
    (new_id,) = records - set(two_versions)
    index = Index(str(store_path / "index"))  # the index never heard of it...
    try:
        assert index.version(new_id) is None
    finally:
        index.close()
    # ...but the commit record is the commit: opening the store counts it in.
    ids = _check_store(store_path, [1, 2, 3])
    assert ids[2] == new_id
    with chunkstore.open(store_path, create=False) as store:
        reconciled = store.stats()
        assert store.versions(RUN)[2].parent == two_versions[1]
        store.rebuild_index()
        rebuilt = store.stats()
    # The index reconcile built holds the same chunk sizes a full rebuild finds.
    assert (reconciled.chunks, reconciled.unique_raw_bytes) == (
        rebuilt.chunks, rebuilt.unique_raw_bytes)
    again = run_child(store_path, 4, 4, None)
    assert again.returncode == 0, again.stderr
    _check_store(store_path, [1, 2, 3, 4])


def test_kill_while_removing_the_session_after_the_commit_publishes_the_version(
    store_path: Path, two_versions: list[str]
) -> None:
    result = run_child(store_path, 3, 3, "kill-before-delete:sessions/:0")

    assert result.returncode == -signal.SIGKILL, result.stderr
    assert len(_files(store_path, "sessions")) == 1  # the dead process's session is left
    _check_store(store_path, [1, 2, 3])
    with chunkstore.open(store_path, create=False) as store:
        store.delete(f"{RUN}@1")
        start = time.monotonic()
        result_gc = store.gc(grace=0, session_wait=60)
        # A dead save's session is not waited for: its process is gone.
        assert time.monotonic() - start < 30 and result_gc.deferred == 0
        assert result_gc.chunks_deleted > 0
    _check_store(store_path, [2, 3])


@pytest.mark.parametrize(("node_size", "packed"), [(0, False), (200, False), (0, True)],
                         ids=["node-per-branch", "split-tree", "packed-deltas"])
def test_kill_at_random_moments_while_saving_in_a_loop(store_path: Path, node_size: int,
                                                       packed: bool) -> None:
    """node_size 200: every level of the names is split into continuation nodes;
    packed: the saves pack their delta chunks, several packs a save."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    chunkstore.open(store_path, chunk_size=SMALL_CHUNK, delta_depth=2, create=True).close()
    published: list[int] = []
    env = {k: v for k, v in os.environ.items() if k not in (FAULT_ENV_VAR, PACK_DELTAS_ENV_VAR)}
    env[NODE_SIZE_ENV_VAR] = str(node_size)
    env[PACK_DELTAS_ENV_VAR] = "1" if packed else "0"
    for _ in range(4):
        first = published[-1] + 1 if published else 1
        child = subprocess.Popen(
            [sys.executable, str(CHILD), str(store_path), str(first)],
            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=env,
        )
        try:
            assert child.stdout is not None
            first_line = child.stdout.readline()  # wait until it is saving in earnest
            assert first_line.startswith(f"saved {first} "), child.stderr.read()  # type: ignore[union-attr]
            time.sleep(rng.uniform(0.0, 0.25))
            child.send_signal(signal.SIGKILL)
            rest, errors = child.communicate(timeout=30)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        assert child.returncode == -signal.SIGKILL, f"seed {seed}: {errors}"
        reported = [int(line.split()[1]) for line in [first_line, *rest.splitlines()]]
        with chunkstore.open(store_path, create=False) as store:
            steps = [v.step for v in store.versions(RUN)]
        # Every save that returned is published; at most the one in flight joins
        # them (killed after its commit record), and nothing else appears.
        assert steps[: len(published) + len(reported)] == published + reported, f"seed {seed}"
        assert len(steps) - len(published) - len(reported) in (0, 1), f"seed {seed}"
        published = steps
        _check_store(store_path, published)
    again = run_child(store_path, published[-1] + 1, published[-1] + 1, None, packed=packed)
    assert again.returncode == 0, again.stderr
    _check_store(store_path, [*published, published[-1] + 1])
    with chunkstore.open(store_path, create=False) as store:
        entry = store.open_version(f"{RUN}@{published[-1] + 1}").entry("model.embed")
        assert isinstance(entry, TensorEntry)
        assert any(entry.shards[0].packs) == packed, "the layout under test was not written"
        # The last version the loop's children saved (run_child saves with node_size 0).
        root = load_tree(store.objects, store.resolve(f"{RUN}@{published[-1]}").root,
                         store.node_cache)
        assert bool(root.more) == (node_size > 0), "the layout under test was not written"


@pytest.mark.parametrize("fault", [
    "kill-before-put:chunks/:0", "kill-before-put:chunks/:2", "kill-after-put:chunks/:2",
    "kill-before-put:nodes/:0", "kill-before-put:versions/:0", "kill-after-put:versions/:0",
], ids=["before-first-pack", "before-third-pack", "after-third-pack", "before-nodes",
        "before-commit-record", "after-commit-record"])
def test_kill_during_a_packed_delta_save_leaves_every_published_version_readable(
        store_path: Path, fault: str) -> None:
    """Saves that pack their delta chunks and whose bases lie in packs (chunk format 5),
    killed at each step of a save: what was published stays exact, verify is clean,
    later saves and a GC at grace 0 keep it so."""
    chunkstore.open(store_path, chunk_size=SMALL_CHUNK, delta_depth=2, create=True).close()
    setup = run_child(store_path, 1, 2, None, packed=True)
    assert setup.returncode == 0, setup.stderr
    with chunkstore.open(store_path, create=False) as store:
        entry = store.open_version(f"{RUN}@2").entry("model.embed")
        assert isinstance(entry, TensorEntry)
        (shard,) = entry.shards
        assert any(shard.packs) and any(shard.bases) and shard.base_packs, \
            "the saves must write packed deltas on packed bases"
    packs_before = len(_files(store_path, "chunks"))

    result = run_child(store_path, 3, 3, fault, packed=True)

    assert result.returncode == -signal.SIGKILL, result.stderr
    if fault == "kill-after-put:chunks/:2":
        assert len(_files(store_path, "chunks")) - packs_before >= 3  # several packs a save
    published = [1, 2, 3] if fault.endswith("versions/:0") and "after" in fault else [1, 2]
    _check_store(store_path, published)
    again = run_child(store_path, published[-1] + 1, published[-1] + 2, None, packed=True)
    assert again.returncode == 0, again.stderr
    published += [published[-1] + 1, published[-1] + 2]
    _check_store(store_path, published)
    with chunkstore.open(store_path, create=False) as store:
        store.delete(f"{RUN}@1")
        store.gc(grace=0)
    _check_store(store_path, published[1:])
