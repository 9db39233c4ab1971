"""The codecs' native loops and their numpy fallbacks give the same bytes.

Every shuffle codec and the delta chain decoder split and join planes through
chunkstore.codecs.planes, and the sub-delta codec takes its lanes' zigzag
differences through chunkstore.codecs.native where it is built; a store
written with one implementation must read with the other, so both are checked
against plain numpy and each other.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkstore.codecs import GIL_FREE_COPY_BYTES, copy_bytes, native, planes
from chunkstore.codecs.shuffle import SHUFFLE_ZSTD
from chunkstore.codecs.sparsedelta import SPARSE_DELTA
from chunkstore.codecs.subdelta import SUB_DELTA, unzigzag_add_numpy, zigzag_numpy
from chunkstore.codecs.xordelta import XOR_DELTA

IMPLEMENTATIONS = ["numpy"] + (["native"] if native.NATIVE else [])
MODULES = [None] + ([native.MODULE] if native.NATIVE else [])


@pytest.fixture(params=IMPLEMENTATIONS)
def implementation(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "numpy":
        monkeypatch.setattr(native, "MODULE", None)
    return str(request.param)


def test_the_native_loops_are_built_where_a_compiler_is() -> None:
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler) is None:
        pytest.skip(f"no C compiler ({compiler}): the numpy fallback is expected")
    assert native.NATIVE, ("chunkstore/codecs/_native.c was not built: reinstall the package"
                           " (pip install -e .) and read the compiler's errors")


@settings(max_examples=150, deadline=None)
@given(size=st.sampled_from([1, 2, 3, 4, 8, 16]), count=st.integers(0, 300),
       seed=st.integers(0, 2**32 - 1))
def test_split_and_join_match_a_transpose(size: int, count: int, seed: int) -> None:
    raw = np.random.default_rng(seed).integers(0, 256, size * count, dtype=np.uint8)
    expected = np.ascontiguousarray(raw.reshape(-1, size).T)
    for split in (planes.split_numpy, *([native.MODULE.split] if native.NATIVE else [])):
        out = np.full((size, count), 0xA5, dtype=np.uint8)
        split(raw.tobytes(), out, size)
        assert np.array_equal(out, expected)
    for join in (planes.join_numpy, *([native.MODULE.join] if native.NATIVE else [])):
        back = bytearray(b"\x5a" * (size * count))
        join([expected[j].tobytes() for j in range(size)], back)
        assert bytes(back) == raw.tobytes()


@pytest.mark.parametrize("size", [2, 4, 8])
def test_split_planes_of_an_unaligned_view(implementation: str, size: int) -> None:
    """A chunk cut out of a tensor at any offset (a memoryview slice) splits right."""
    raw = np.arange(7 + size * 1001, dtype=np.uint64).astype(np.uint8)
    view = memoryview(raw.tobytes())[7:]
    result = planes.split_planes(view, size)
    assert np.array_equal(result, np.frombuffer(view, np.uint8).reshape(-1, size).T)


def test_bad_arguments_are_refused_before_anything_is_written(implementation: str) -> None:
    out = bytearray(b"x" * 12)
    with pytest.raises(ValueError, match="one length"):
        planes.split(b"a" * 8, out, 4)
    with pytest.raises(ValueError, match="one length"):
        planes.split(b"a" * 12, out, 8)  # 12 is not whole elements of 8
    with pytest.raises(ValueError):
        planes.split(b"a" * 12, out, 0)
    with pytest.raises(ValueError, match="plane 1 holds 2 bytes"):
        planes.join([b"abc", b"ab", b"abc", b"abc"], out)
    with pytest.raises(ValueError, match="divides"):
        planes.join([b"abcd"] * 5, out)
    with pytest.raises(ValueError, match="divides"):
        planes.join([], out)
    assert out == bytearray(b"x" * 12)
    with pytest.raises(ValueError):
        planes.split_planes(b"a" * 10, 4)


def test_join_refuses_a_read_only_output(implementation: str) -> None:
    with pytest.raises((TypeError, ValueError, BufferError)):
        planes.join([b"ab", b"cd"], b"wxyz")


@pytest.mark.parametrize("codec", [SHUFFLE_ZSTD, XOR_DELTA, SUB_DELTA], ids=lambda c: c.name)
def test_payloads_read_back_whichever_implementation_wrote_them(
        codec: SHUFFLE_ZSTD.__class__, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(5)
    raw = rng.standard_normal(50_000).astype(np.float32).tobytes()
    base = (np.frombuffer(raw, np.float32) * np.float32(1.001)).tobytes()
    payloads = []
    for module in MODULES:
        monkeypatch.setattr(native, "MODULE", module)
        image = codec.image_of(memoryview(raw), base, 4) if codec.needs_base else raw
        payloads.append(codec.encode(memoryview(image), 4))
    assert all(p == payloads[0] for p in payloads)  # the same bytes on disk either way
    for module in MODULES:
        monkeypatch.setattr(native, "MODULE", module)
        decoded = codec.decode(memoryview(payloads[0]), len(raw), 4)
        if codec.needs_base:
            codec.apply_base(decoded, base, 4)
        assert bytes(decoded) == raw


@settings(max_examples=150, deadline=None)
@given(size=st.sampled_from([1, 2, 4, 8]), count=st.integers(0, 300),
       seed=st.integers(0, 2**32 - 1), near=st.booleans())
def test_sub_delta_lanes_match_numpy(size: int, count: int, seed: int, near: bool) -> None:
    """zigzag(raw - base) and its inverse, native and numpy, on random lanes and on
    lanes a few units apart (the small differences of either sign the codec is for)."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, size * count, dtype=np.uint8)
    if near:
        lane = np.dtype(f"<u{size}")
        step = rng.integers(-3, 4, count).astype(lane)  # wraps: -1 is all ones
        raw = (base.view(lane) + step).view(np.uint8)
    else:
        raw = rng.integers(0, 256, size * count, dtype=np.uint8)
    expected = bytes(zigzag_numpy(memoryview(raw.tobytes()), base.tobytes(), size))
    if near:  # |d| <= 3 zigzags to at most 6: every byte but the lowest is zero
        image = np.frombuffer(expected, np.uint8).reshape(-1, size)
        assert not image[:, 1:].any() and (image[:, 0] <= 6).all()
    images = [expected]
    if native.NATIVE:
        out = bytearray(b"\xee" * (size * count))
        native.MODULE.zigzag_delta(raw.tobytes(), base.tobytes(), out, size)
        images.append(bytes(out))
    assert all(image == expected for image in images)
    for add in (unzigzag_add_numpy, *([native.MODULE.unzigzag_add] if native.NATIVE else [])):
        image = bytearray(expected)
        add(memoryview(image), base.tobytes(), size)
        assert bytes(image) == raw.tobytes()


@pytest.mark.skipif(not native.NATIVE, reason="the native loops are not built")
def test_sub_delta_lanes_refuse_bad_lengths() -> None:
    out = bytearray(8)
    with pytest.raises(ValueError, match="one length"):
        native.MODULE.zigzag_delta(b"a" * 8, b"a" * 4, out, 4)
    with pytest.raises(ValueError, match="1, 2, 4 or 8"):
        native.MODULE.zigzag_delta(b"a" * 8, b"a" * 8, out, 3)
    with pytest.raises(ValueError, match="one length"):
        native.MODULE.unzigzag_add(out, b"a" * 4, 2)
    assert out == bytearray(8)
    with pytest.raises(TypeError):
        native.MODULE.unzigzag_add(b"a" * 8, b"a" * 8, 2)  # read-only image


@pytest.mark.skipif(sys.version_info < (3, 12), reason="__buffer__ in Python needs 3.12")
def test_a_plane_that_empties_the_list_while_joined_does_not_crash_the_process() -> None:
    """join holds its own references to the planes: a plane whose __buffer__ empties the
    list it came in freed the items the loop was still using (a segfault, in a
    subprocess here).  Checked with Python 3.12 by hand when this was fixed (the old
    build: SIGSEGV; the new: returns); CI's Python 3.11 cannot define __buffer__."""
    code = (
        "from chunkstore.codecs import _native\n"
        "class Evil:\n"
        "    def __buffer__(self, flags):\n"
        "        planes.clear()\n"
        "        return memoryview(b'ab')\n"
        "planes = [Evil(), bytearray(b'cd'), bytearray(b'ef')]\n"
        "out = bytearray(6)\n"
        "_native.join(planes, out)\n"
        "print(bytes(out))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr


@settings(max_examples=100, deadline=None)
@given(size=st.sampled_from([1, 2, 4, 8]), count=st.integers(1, 400),
       seed=st.integers(0, 2**32 - 1), changed=st.integers(0, 60))
def test_sparse_delta_runs_read_back_whichever_implementation_applies_them(
        size: int, count: int, seed: int, changed: int) -> None:
    """A sparse update's payload (codec 6) decodes onto its base, and applies in place,
    to the same bytes with the native loop and with numpy; a dense one too (every
    element listed)."""
    rng = np.random.default_rng(seed)
    lane = np.dtype(f"<u{size}")
    base = rng.integers(0, 256, size * count, dtype=np.uint8)
    raw = base.view(lane).copy()
    at = rng.integers(0, count, min(changed, count))
    raw[at] += rng.integers(-3, 4, len(at)).astype(lane)  # wraps: -1 is all ones
    raw_bytes = raw.view(np.uint8).tobytes()
    image = SPARSE_DELTA.image_of(memoryview(raw_bytes), base.tobytes(), size)
    payload = memoryview(SPARSE_DELTA.encode(image, size))
    for module in MODULES:
        native.MODULE = module
        try:
            out = memoryview(bytearray(len(raw_bytes)))
            SPARSE_DELTA.decode_onto(payload, base.tobytes(), out, size)
            assert bytes(out) == raw_bytes
            in_place = memoryview(bytearray(base.tobytes()))
            SPARSE_DELTA.apply_in_place(payload, in_place, size)
            assert bytes(in_place) == raw_bytes
        finally:
            native.MODULE = MODULES[-1]


@pytest.mark.skipif(not native.NATIVE, reason="the native loops are not built")
def test_sparse_delta_runs_outside_the_chunk_are_refused_with_nothing_changed() -> None:
    chunk = bytearray(16)
    runs = np.array([0, 3], dtype=np.int64)
    for counts, values in ((np.array([1, 2], np.int64), b"\x01" * 12),  # 3 + 2 > 4
                           (np.array([1, 0], np.int64), b"\x01" * 4),  # a run of none
                           (np.array([1, 1], np.int64), b"\x01" * 4)):  # values short
        with pytest.raises(ValueError, match="sparse-delta"):
            native.MODULE.unzigzag_add_runs(chunk, runs, counts, values, 4)
        assert chunk == bytearray(16)


@pytest.mark.parametrize("size", [0, 1, GIL_FREE_COPY_BYTES - 1, GIL_FREE_COPY_BYTES,
                                  3 * GIL_FREE_COPY_BYTES + 5])
def test_copy_bytes_fills_the_buffer_and_refuses_another_length(size: int) -> None:
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    out = bytearray(size)
    copy_bytes(memoryview(out), data)
    assert out == data
    for other in (1, size + 1):  # one byte would broadcast through numpy
        if other != size:
            with pytest.raises(ValueError):
                copy_bytes(memoryview(bytearray(size)), bytes(other))
