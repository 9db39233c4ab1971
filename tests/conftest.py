"""Shared fixtures: real stores on real files (and memory:// where noted)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import chunkstore
from tests.background import (
    background_lane,
    pytest_collection_modifyitems,
    pytest_configure,
)

# Commands tests read the outcome of, run in the background from the start of the session
# (the fixture, and the hooks that order the tests and declare the marker): re-exported so
# pytest finds them here.
__all__ = ["background_lane", "pytest_collection_modifyitems", "pytest_configure"]

SMALL_CHUNK = 64 * 1024


@pytest.fixture
def store_path(tmp_path: Path) -> Path:
    return tmp_path / "store"


@pytest.fixture
def store(store_path: Path) -> Iterator[chunkstore.Store]:
    """A local store with small chunks, so small arrays span several chunks."""
    with chunkstore.open(store_path, chunk_size=SMALL_CHUNK, delta_depth=2) as s:
        yield s


@pytest.fixture
def memory_store(tmp_path: Path) -> Iterator[chunkstore.Store]:
    with chunkstore.open(f"memory://cs-{uuid.uuid4().hex}", chunk_size=SMALL_CHUNK, delta_depth=2,
                         index_dir=str(tmp_path / "index")) as s:
        yield s


def tree_snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` except the index cache: to prove a call changed nothing."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.relative_to(root).parts[0] != "index"
    }
