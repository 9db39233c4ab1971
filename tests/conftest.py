"""Shared fixtures: real stores on real files (and memory:// where noted)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

# Every test process, and every process a test starts, runs torch's kernels on one thread
# (set before anything imports torch): the suite's shards already share two cores,
# and an intra-op pool spinning for work on a busy core nearly doubled the CPU time of
# torch-heavy tests (test_steady_disk's 300 saves: 26.7 s of CPU, 14.7 s on one thread).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import chunkstore
from tests.quick_suite import pytest_collection_modifyitems as order_around_the_quick_run
from tests.quick_suite import quick_suite_run
from tests.shards import Shards, pytest_addoption

# The quick benchmark run of test_bench_smoke.py, started with the session, and the
# --shard option (tests/shards.py): re-exported so pytest finds them here.
__all__ = ["pytest_addoption", "quick_suite_run"]


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(Shards(), "chunkstore-shards")


#: Modules marked ``slow``, for a quick local run (``pytest -m "not slow"``): races and
#: scenarios that run for seconds in subprocesses, the protocol model checker, the
#: README's examples, the benchmark smoke run.  (`./dev test` runs everything, in three
#: shards: tests/shards.py.)
SLOW_JOB_MODULES = frozenset({
    "test_availability.py", "test_bench_smoke.py", "test_crash.py", "test_gc.py",
    "test_many_indexes.py", "test_power_loss.py", "test_protocol_model.py", "test_readme.py",
})


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the slow job's tests, then order the session around the quick benchmark run
    (tests/quick_suite.py)."""
    for item in items:
        if item.path.name in SLOW_JOB_MODULES:
            item.add_marker(pytest.mark.slow)
    order_around_the_quick_run(items)

SMALL_CHUNK = 64 * 1024
# The suite makes thousands of stores: each keeps a small space reserve for rm and gc
# on a full disk, not the default 8 MiB (tests/test_full_disk.py runs the default).
os.environ.setdefault("CHUNKSTORE_SPACE_RESERVE", str(256 << 10))


@pytest.fixture
def store_path(tmp_path: Path) -> Path:
    return tmp_path / "store"


@pytest.fixture
def store(store_path: Path) -> Iterator[chunkstore.Store]:
    """A local store with small chunks, so small arrays span several chunks."""
    with chunkstore.open(store_path, chunk_size=SMALL_CHUNK, delta_depth=2, create=True) as s:
        yield s


@pytest.fixture
def memory_store(tmp_path: Path) -> Iterator[chunkstore.Store]:
    with chunkstore.open(f"memory://cs-{uuid.uuid4().hex}", chunk_size=SMALL_CHUNK, delta_depth=2,
                         index_dir=str(tmp_path / "index"), create=True) as s:
        yield s


@pytest.fixture(params=["copied", "mapped"])
def read_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test twice: reads of a local store as they come (only ranges of 256 KiB or
    more mapped, which the small chunks of tests rarely reach), then with every ranged
    read that can be mapped mapped (``LocalBackend.view_range``), so that the races,
    kills and moved records a module tests are met by mapped reads too.  A test of an
    S3 store maps nothing, so it runs once."""
    from chunkstore.backends import local
    if request.param == "mapped":
        if "s3_endpoint" in request.fixturenames:
            pytest.skip("an S3 store's reads are never mapped: the copied run covers it")
        monkeypatch.setattr(local, "MAP_MIN_BYTES", 1)
    return str(request.param)


def tree_snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` except the index cache and the read leases of readers
    open meanwhile (a reader's presence, deleted when it closes): to prove a call
    changed nothing."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.relative_to(root).parts[0] not in ("index", "readers")
    }
