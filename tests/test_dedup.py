"""Dedup: identical state writes no chunk; a one-chunk change writes about one chunk."""

from __future__ import annotations

from pathlib import Path

import numpy as np

import chunkstore
from chunkstore.format.digest import Digest
from chunkstore.objects.kinds import CHUNKS
from tests.conftest import SMALL_CHUNK


def _chunk_files(store_path: Path) -> set[str]:
    return {p.name for p in (store_path / "chunks").rglob("*") if p.is_file()}


def _state(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "model.layer0.w": rng.standard_normal((256, 256)).astype(np.float32),
        "model.layer1.w": rng.standard_normal((256, 256)).astype(np.float32),
        "optim.m": rng.standard_normal(100_000).astype(np.float32),
    }


def _save(
    store: chunkstore.Store, step: int, state: dict[str, np.ndarray]
) -> chunkstore.VersionInfo:
    with store.new_version(run="r", step=step) as v:
        for name, array in state.items():
            v.put(name, array)
        v.put_data("trainer", {"step": step})
    return v.info


def test_identical_resave_writes_no_chunk(store: chunkstore.Store, store_path: Path) -> None:
    state = _state()
    first = _save(store, 1, state)
    before = _chunk_files(store_path)
    second = _save(store, 2, state)
    assert _chunk_files(store_path) == before
    assert second.new_bytes == 0
    assert first.new_bytes == sum(a.nbytes for a in state.values())
    # only the changed plain data and the tree nodes above it are new (the tensor
    # entries in those nodes list where each packed chunk lies: about 90 bytes a chunk)
    assert 0 < second.new_stored_bytes < 4096


def test_one_chunk_change_writes_about_one_chunk(store: chunkstore.Store,
                                                 store_path: Path) -> None:
    state = _state()
    _save(store, 1, state)
    before = _chunk_files(store_path)
    changed = dict(state)
    optim = state["optim.m"].copy()
    start = 3 * SMALL_CHUNK // 4  # element index inside the fourth chunk
    optim[start : start + SMALL_CHUNK // 4] += 1.0  # exactly one chunk's worth of elements
    changed["optim.m"] = optim
    info = _save(store, 2, changed)
    new_files = _chunk_files(store_path) - before
    assert len(new_files) == 1
    assert info.new_bytes == SMALL_CHUNK
    reader = store.open_version("r@2")
    assert reader.get("optim.m").tobytes() == optim.tobytes()
    assert store.open_version("r@1").get("optim.m").tobytes() == state["optim.m"].tobytes()


def test_unchanged_subtrees_are_shared(store: chunkstore.Store, store_path: Path) -> None:
    store.node_size = 0  # a node per branch of the names (inlining is tested elsewhere)
    state = _state()
    _save(store, 1, state)
    nodes_before = {p.name for p in (store_path / "nodes").rglob("*") if p.is_file()}
    changed = dict(state)
    changed["model.layer1.w"] = state["model.layer1.w"] + 1
    _save(store, 2, changed)
    nodes_after = {p.name for p in (store_path / "nodes").rglob("*") if p.is_file()}
    # new: root, "model" subtree, layer1 subtree, trainer data; layer0 and optim are shared
    assert len(nodes_after - nodes_before) == 4


def test_dedup_across_runs_and_within_a_version(store: chunkstore.Store,
                                                store_path: Path) -> None:
    zeros = np.zeros(4 * SMALL_CHUNK // 4, dtype=np.float32)
    with store.new_version(run="a", step=1) as v:
        v.put("z1", zeros)
        v.put("z2", zeros.copy())
    assert len(_chunk_files(store_path)) == 1  # eight identical chunks, one object
    with store.new_version(run="b", step=1) as v:
        v.put("z", zeros)
    assert v.info.new_bytes == 0
    assert store.verify().ok


def test_dedup_across_codecs(tmp_path: Path) -> None:
    """The key names the content: a chunk stored compressed dedups a raw save of it."""
    smooth = np.cumsum(np.full(SMALL_CHUNK, 0.01, dtype=np.float32))
    path = tmp_path / "s"
    with chunkstore.open(path, chunk_size=SMALL_CHUNK, compression="auto", create=True) as s:
        with s.new_version(run="r", step=1) as v:
            v.put("x", smooth)
    with chunkstore.open(path, compression="none", create=True) as s:
        with s.new_version(run="r", step=2) as v:
            v.put("x", smooth)
        assert v.info.new_bytes == 0
        assert s.open_version("r@2").get("x").tobytes() == smooth.tobytes()


def _small_packed(path: Path) -> tuple[chunkstore.Store, np.ndarray, np.ndarray]:
    """A store (chunks of larger tensors stored as objects) whose r@1 holds a small
    tensor, packed; and a larger tensor whose first chunk has the small one's bytes."""
    small = np.arange(SMALL_CHUNK // 4, dtype=np.float32)
    store = chunkstore.open(path, chunk_size=SMALL_CHUNK, compression="none", delta_depth=0,
                            create=True)
    with store.new_version(run="r", step=1) as v:
        v.put("small", small)
    return store, small, np.concatenate([small, small + 1])


def test_a_chunk_of_a_larger_tensor_dedups_against_a_packed_small_tensor(
        tmp_path: Path) -> None:
    """A small tensor is packed; a chunk of a larger tensor with the same bytes is
    referenced inside that pack, not written again as an object of its own."""
    store, _, large = _small_packed(tmp_path / "s")
    with store:
        with store.new_version(run="r", step=2) as v:
            v.put("large", large)
        assert v.info.new_bytes == SMALL_CHUNK  # only the second chunk is new
        assert store.open_version("r@2").get("large").tobytes() == large.tobytes()
        assert store.verify().ok


def test_a_chunk_of_a_deleted_pack_is_written_again_not_referenced(tmp_path: Path) -> None:
    """The index remembers where a chunk lay inside a pack the store lost behind its back
    (a GC of this index forgets it with the pack: tests/test_steady_disk.py): the
    location is a hint only, the pack is claimed and checked like every dedup target,
    and the chunk is written again."""
    store, small, large = _small_packed(tmp_path / "s")
    with store:
        store.delete("r@1")
        digest = Digest.of(small.tobytes())
        location = store.index.pack_location(digest)
        assert location is not None, "the test needs a stale location"
        store.objects.delete(CHUNKS, location.pack)
        with store.new_version(run="r", step=2) as v:
            v.put("large", large)
        assert v.info.new_bytes == 2 * SMALL_CHUNK
        assert store.index.pack_location(digest) is None  # the stale location is forgotten
        assert store.open_version("r@2").get("large").tobytes() == large.tobytes()
        assert store.verify().ok
