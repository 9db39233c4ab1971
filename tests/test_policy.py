"""What the ``auto`` policy stores: raw what will not compress, found from a probe, and
byte planes each on their own (compressed only where that pays)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import chunkstore
from chunkstore import codecs
from chunkstore.codecs import policy, shuffle
from chunkstore.codecs.shuffle import plane_table


def _noise(nbytes: int, seed: int = 0) -> np.ndarray:
    """float32 values from uniformly random bits: no plane of them compresses."""
    bits = np.random.default_rng(seed).integers(0, 2**32, nbytes // 4, dtype=np.uint32)
    return bits.view(np.float32)


def _weights(nbytes: int, seed: int = 0) -> np.ndarray:
    """Trained-weight-like float32: the exponent plane compresses, the mantissa does not."""
    return (np.random.default_rng(seed).standard_normal(nbytes // 4) * 0.02).astype(np.float32)


def test_a_chunk_that_will_not_compress_is_stored_raw_after_a_probe_of_its_prefix(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the probe is compressed, and the payload is the chunk's own bytes (no copy)."""
    compressed: list[int] = []
    real = codecs.SHUFFLE_ZSTD.encode

    def encode(raw: memoryview, element_size: int) -> bytes:
        compressed.append(len(raw))
        return real(raw, element_size)

    monkeypatch.setattr(codecs.SHUFFLE_ZSTD, "encode", encode)
    raw = memoryview(_noise(1 << 20).view(np.uint8))
    codec, payload = policy.encode_with_policy("auto", raw, "float32", 4)
    assert codec is codecs.RAW
    assert payload is raw
    assert compressed == [policy.PROBE_BYTES]


def test_a_plane_that_will_not_compress_is_kept_raw_after_a_probe() -> None:
    """Each plane is probed: the mantissa planes of weights stay raw (their bytes, no zstd
    frame), the exponent plane is compressed; the payload decodes to the chunk."""
    chunk = _weights(1 << 20)
    raw = memoryview(chunk.view(np.uint8))
    codec, payload = policy.encode_with_policy("auto", raw, "float32", 4)
    assert codec is codecs.SHUFFLE_ZSTD
    table = plane_table(memoryview(payload), len(raw), 4, 2)
    modes = [mode for mode, _, _ in table]
    assert modes[:2] == [0, 0] and modes[3] == 1  # low mantissa raw, exponent compressed
    assert table[3][2] < 0.5 * len(raw) // 4
    decoded = codecs.SHUFFLE_ZSTD.decode(memoryview(payload), len(raw), 4)
    assert bytes(decoded) == bytes(raw)
    plane = np.ascontiguousarray(_noise(1 << 18).view(np.uint8))
    mode, body = shuffle._compress_plane(plane)
    assert mode == 0 and bytes(body) == plane.tobytes()


def test_a_store_keeps_incompressible_tensors_raw_and_reads_them_back(tmp_path: Path) -> None:
    """Through a save: random bits cost their size (a raw chunk), weights less."""
    noise, weights = _noise(1 << 22, seed=1), _weights(1 << 22, seed=2)
    with chunkstore.open(tmp_path / "s", compression="auto", delta_depth=0, create=True) as store:
        with store.new_version(run="r", step=1) as version:
            version.put("noise", noise)
        noisy = version.info.new_stored_bytes
        with store.new_version(run="r", step=2) as version:
            version.put("weights", weights)
        compressed = version.info.new_stored_bytes
        got = store.open_version("r@2")
        np.testing.assert_array_equal(got.get("weights"), weights)
        np.testing.assert_array_equal(store.open_version("r@1").get("noise"), noise)
    assert noisy >= noise.nbytes
    assert compressed < 0.9 * weights.nbytes


def test_auto_stores_a_tensor_under_raw_tensor_bytes_raw_and_others_compress_it(
        tmp_path: Path) -> None:
    """Compressing a small tensor costs more time than writing the bytes it saves
    (benchmarks/bench_compress_rule.py): ``auto`` stores it raw; a tensor of
    ``RAW_TENSOR_BYTES`` or more, a handle with ``raw_tensor_bytes = 0`` and the
    explicit policies still compress it; every one reads back exact."""
    limit = policy.RAW_TENSOR_BYTES
    small = np.full(limit // 4 - 1, 1 / 3, dtype=np.float32)  # 4 bytes under the limit
    large = np.full(limit // 4, 1 / 3, dtype=np.float32)

    def stored(compression: str, array: np.ndarray, raw_below: int | None = None) -> int:
        path = tmp_path / f"{compression}-{array.nbytes}-{raw_below}"
        with chunkstore.open(path, compression=compression, create=True) as store:
            assert store.raw_tensor_bytes == limit
            if raw_below is not None:
                store.raw_tensor_bytes = raw_below
            with store.new_version(run="r", step=1) as version:
                version.put("t", array)
            np.testing.assert_array_equal(store.open_version("r@1").get("t"), array)
            return version.info.new_stored_bytes

    assert stored("auto", small) >= small.nbytes  # raw (and the manifest)
    assert stored("auto", large) < 0.25 * large.nbytes
    assert stored("auto", small, raw_below=0) < 0.25 * small.nbytes
    assert stored("shuffle-zstd", small) < 0.25 * small.nbytes
    assert stored("zstd", small) < 0.25 * small.nbytes
    # A tensor of several chunks is compressed whatever its size, also where its chunks
    # are packed as small tensors are (an object store without delta chains).
    with chunkstore.open(f"memory://cs-{os.urandom(8).hex()}", chunk_size=4096, delta_depth=0,
                         index_dir=str(tmp_path / "memory-index"), create=True) as store:
        with store.new_version(run="r", step=1) as version:
            version.put("t", small)
        np.testing.assert_array_equal(store.open_version("r@1").get("t"), small)
    assert version.info.new_stored_bytes < 0.5 * small.nbytes
    assert policy.tensor_policy("auto", limit - 1, limit) == "none"
    assert policy.tensor_policy("auto", limit, limit) == "auto"
    assert policy.tensor_policy("zstd", 1, limit) == "zstd"
