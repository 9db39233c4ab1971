"""Shared fixtures: real stores on real files (and memory:// where noted)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import chunkstore
from tests.quick_suite import pytest_collection_modifyitems, quick_suite_run

# The quick benchmark run of test_bench_smoke.py, started with the session, and the hook
# that moves the tests reading it to the end: re-exported so pytest finds them here.
__all__ = ["pytest_collection_modifyitems", "quick_suite_run"]

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


def tree_snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` except the index cache: to prove a call changed nothing."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.relative_to(root).parts[0] != "index"
    }
