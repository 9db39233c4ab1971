"""Round trips: every dtype, empty and 0-d arrays, chunk boundaries, non-contiguous input."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import chunkstore
from chunkstore.format.dtypes import DTYPES
from chunkstore.format.manifest import TensorEntry
from tests.conftest import SMALL_CHUNK


def _random_array(dtype: np.dtype, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    raw = np.random.default_rng(seed).integers(0, 256, size=int(np.prod(shape)) * dtype.itemsize,
                                                dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_every_dtype_round_trips_bit_exact(store: chunkstore.Store, name: str) -> None:
    dtype = DTYPES[name]
    array = _random_array(dtype, (70, 130), seed=len(name))
    if name == "bool":
        array = array.view(np.uint8) % 2 == 1
    with store.new_version(run="r", step=1) as v:
        v.put("x", array)
    got = store.open_version("r@1").get("x")
    assert got.dtype == dtype
    assert got.shape == array.shape
    assert got.tobytes() == array.tobytes()


@pytest.mark.parametrize("shape", [(0,), (0, 5), (), (1,), (3, 0, 2)])
def test_empty_and_zero_dim(store: chunkstore.Store, shape: tuple[int, ...]) -> None:
    array = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) + 7
    with store.new_version(run="r", step=1) as v:
        v.put("x", array)
    got = store.open_version("latest").get("x")
    assert got.shape == shape
    np.testing.assert_array_equal(got, array)


@pytest.mark.parametrize("nbytes", [SMALL_CHUNK - 8, SMALL_CHUNK, SMALL_CHUNK + 8,
                                    3 * SMALL_CHUNK, 3 * SMALL_CHUNK + 4])
def test_sizes_on_and_off_chunk_boundaries(store: chunkstore.Store, nbytes: int) -> None:
    array = _random_array(np.dtype(np.float32), (nbytes // 4,))
    with store.new_version(run="r", step=1) as v:
        v.put("x", array)
    reader = store.open_version("r@1")
    entry = reader.entry("x")
    assert isinstance(entry, TensorEntry)
    assert sum(1 for _ in entry.chunk_digests()) == -(-nbytes // SMALL_CHUNK)
    assert reader.get("x").tobytes() == array.tobytes()


def test_chunk_boundaries_align_to_elements(tmp_path: Path) -> None:
    """No element straddles two chunks: chunk_bytes is a multiple of the element size."""
    with chunkstore.open(tmp_path / "s", chunk_size=4096, create=True) as s:
        array = _random_array(np.dtype("<c16"), (1000,))
        with s.new_version(run="r", step=1) as v:
            v.put("z", array)
        reader = s.open_version("latest")
        entry = reader.entry("z")
        assert isinstance(entry, TensorEntry)
        assert entry.shards[0].chunk_bytes % 16 == 0
        assert len(entry.shards[0].chunks) == -(-array.nbytes // 4096)
        assert reader.get("z").tobytes() == array.tobytes()


def test_non_contiguous_and_big_endian_inputs(store: chunkstore.Store) -> None:
    base = _random_array(np.dtype(np.float64), (64, 96))
    transposed = base.T
    strided = base[::3, 1::2]
    big_endian = base.astype(">f8")
    with store.new_version(run="r", step=1) as v:
        v.put("t", transposed)
        v.put("s", strided)
        v.put("be", big_endian)
    r = store.open_version("latest")
    np.testing.assert_array_equal(r.get("t"), transposed)
    np.testing.assert_array_equal(r.get("s"), strided)
    np.testing.assert_array_equal(r.get("be"), base)
    assert r.get("be").dtype == np.dtype("<f8")


def test_bfloat16_stored_from_a_uint16_view(store: chunkstore.Store) -> None:
    """How torch_bridge hands over bf16: the raw 16-bit words plus the dtype name."""
    values = np.linspace(-3, 3, 1000, dtype=np.float32).astype(ml_dtypes.bfloat16)
    with store.new_version(run="r", step=1) as v:
        v.put("w", values.view(np.uint16), dtype="bfloat16")
    r = store.open_version("latest")
    got = r.get("w")
    assert got.dtype == np.dtype(ml_dtypes.bfloat16)
    assert got.tobytes() == values.tobytes()
    out = np.empty(1000, dtype=np.int16)
    r.get_into("w", out, dtype="bfloat16")
    assert out.tobytes() == values.tobytes()


def test_get_into_fills_the_callers_buffer(store: chunkstore.Store) -> None:
    array = _random_array(np.dtype(np.float32), (300, 300))
    with store.new_version(run="r", step=1) as v:
        v.put("x", array)
    out = np.zeros_like(array)
    returned = store.open_version("latest").get_into("x", out)
    assert returned is out
    assert out.tobytes() == array.tobytes()


@pytest.mark.parametrize("policy", ["none", "zstd", "shuffle-zstd", "auto"])
def test_every_codec_policy_round_trips(tmp_path: Path, policy: str) -> None:
    smooth = np.cumsum(np.ones(50_000, dtype=np.float32) * 0.001)
    ints = np.arange(50_000, dtype=np.int64) % 7
    noise = _random_array(np.dtype(np.float32), (50_000,))
    with chunkstore.open(tmp_path / policy, chunk_size=SMALL_CHUNK, compression=policy,
                         create=True) as s:
        with s.new_version(run="r", step=1) as v:
            v.put("smooth", smooth)
            v.put("ints", ints)
            v.put("noise", noise)
        r = s.open_version("latest")
        for name, array in [("smooth", smooth), ("ints", ints), ("noise", noise)]:
            assert r.get(name).tobytes() == array.tobytes()
        assert s.verify().ok
        stats = s.stats()
        if policy == "none":
            assert stats.compression_ratio < 1.0  # headers only, nothing shrinks
        else:
            assert stats.compression_ratio > 1.2


def test_plain_data_round_trips_with_tags(store: chunkstore.Store) -> None:
    value = {
        "epoch": 3, "lr": 1e-3, "nan": float("nan"), "inf": float("-inf"), "big": 2**80,
        "tuple": (1, (2, "x")), "bytes": b"\x00\xff", "by_int": {0: "a", 1: {"b": None}},
        "$weird": True, "list": [1.5, False, None], "np": np.float32(0.5),
    }
    with store.new_version(run="r", step=1) as v:
        v.put_data("trainer", value)
    got = store.open_version("latest").get_data("trainer")
    assert got["nan"] != got["nan"]
    for key, expected in value.items():
        if key != "nan":
            assert got[key] == expected, key
    assert isinstance(got["tuple"], tuple)


def test_memory_backend_round_trip(memory_store: chunkstore.Store) -> None:
    array = _random_array(np.dtype(np.float32), (100_000,))
    with memory_store.new_version(run="r", step=1) as v:
        v.put("x", array)
    assert memory_store.open_version("latest").get("x").tobytes() == array.tobytes()
    assert memory_store.verify().ok


@settings(max_examples=25, deadline=None)
@given(hnp.arrays(
    dtype=st.sampled_from([np.dtype(n) for n in ("<f4", "<i2", "<u1", "<f8", "?", "<c8")]),
    shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=40),
))
def test_any_array_round_trips(tmp_path_factory: pytest.TempPathFactory, array: np.ndarray) -> None:
    path = tmp_path_factory.mktemp("h")
    with chunkstore.open(path / "s", chunk_size=4096, create=True) as s:
        with s.new_version(run="r", step=1) as v:
            v.put("a", array)
        got = s.open_version("latest").get("a")
    assert got.shape == array.shape and got.dtype == array.dtype
    assert got.tobytes() == array.tobytes()


def test_get_many_into_reads_every_entry_and_checks_every_buffer_first(
        store: chunkstore.Store) -> None:
    rng = np.random.default_rng(3)
    arrays = {f"layer{i}.w": rng.standard_normal(1000 * (i + 1)).astype(np.float32)
              for i in range(20)}
    with store.new_version("r", 1) as v:
        for name, array in arrays.items():
            v.put(name, array)
    reader = store.open_version("latest")
    outs = {name: np.zeros_like(array) for name, array in arrays.items()}
    reader.get_many_into((name, out, None) for name, out in outs.items())
    for name, array in arrays.items():
        np.testing.assert_array_equal(outs[name], array)
    fresh = {name: np.zeros_like(array) for name, array in arrays.items()}
    wrong = np.zeros(5, dtype=np.float32)
    with pytest.raises(chunkstore.errors.ShapeMismatchError):
        reader.get_many_into([*((n, o, None) for n, o in fresh.items()), ("layer0.w", wrong, None)])
    assert all(not out.any() for out in fresh.values())  # nothing read before the check failed


def _read_concurrency(store: chunkstore.Store, arrays: dict[str, np.ndarray],
                      monkeypatch: pytest.MonkeyPatch) -> int:
    """The most read jobs one get_many_into ran at once (each held 10 ms); every array
    must read back exact."""
    import threading
    import time

    import chunkstore.read.reader

    lock = threading.Lock()
    running = [0, 0]  # now, most

    def tracked(real: Any) -> Any:
        def read(*args: object, **kwargs: object) -> None:
            with lock:
                running[0] += 1
                running[1] = max(running)
            try:
                time.sleep(0.01)
                real(*args, **kwargs)
            finally:
                with lock:
                    running[0] -= 1
        return read

    with store.new_version(run="r", step=1) as version:
        for name, array in arrays.items():
            version.put(name, array)
    for name in ("read_chunk_into", "read_members_into"):  # objects, runs of a pack
        reader = chunkstore.read.reader
        monkeypatch.setattr(reader, name, tracked(getattr(reader, name)))
    outs = {name: np.empty_like(array) for name, array in arrays.items()}
    store.open_version("r@1").get_many_into((name, out, None) for name, out in outs.items())
    for name, array in arrays.items():
        np.testing.assert_array_equal(outs[name], array)
    return running[1]


def test_a_local_read_runs_at_most_a_job_per_core_and_an_object_store_read_more(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading from a local store is CPU work: one call's chunk reads run on at most a
    thread per core, the pool's other threads asleep.  From other stores (each read
    waits on a request) every thread reads."""
    import os

    rng = np.random.default_rng(0)
    arrays = {f"t{i}": rng.standard_normal(40_000).astype(np.float32) for i in range(24)}
    cores = os.cpu_count() or 1
    # Small chunks and packs: dozens of read jobs, objects on the disk, runs of packs in memory.
    with chunkstore.open(tmp_path / "s", chunk_size=65536, threads=8, delta_depth=0,
                         pack_size=65536, create=True) as store:
        assert 1 <= _read_concurrency(store, arrays, monkeypatch) <= min(8, cores)
    monkeypatch.undo()
    with chunkstore.open(f"memory://cs-{os.urandom(8).hex()}", chunk_size=65536, threads=8,
                         delta_depth=0, pack_size=65536,
                         index_dir=str(tmp_path / "memory-index"), create=True) as store:
        most = _read_concurrency(store, arrays, monkeypatch)
        assert most <= 8
        if cores < 8:
            assert most > cores


def test_a_local_store_defaults_to_fewer_worker_threads_than_an_object_store(
        tmp_path: Path) -> None:
    """Local writes wait less than requests: twice the cores, at least 4 threads locally
    and at least 8 for an object store (whose requests are in flight at once)."""
    import os

    cores = os.cpu_count() or 2
    with chunkstore.open(tmp_path / "s", create=True) as store:
        assert store.threads == min(32, max(4, 2 * cores))
    with chunkstore.open(f"memory://cs-{os.urandom(8).hex()}", create=True,
                         index_dir=str(tmp_path / "memory-index")) as store:
        assert store.threads == min(32, max(8, 2 * cores))
    with chunkstore.open(tmp_path / "t", threads=3, create=True) as store:
        assert store.threads == 3
