"""The restore path's fast ways give the same bytes and the same refusals: a sub-delta
link applied from its planes in one pass (native and numpy), runs of pack members
split by the bytes they decode to, scratch buffers released after a read."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import chunkstore
from chunkstore.codecs import SUB_DELTA, native
from chunkstore.errors import CorruptChunkError
from chunkstore.format.digest import Digest
from chunkstore.format.manifest import PackLocation
from chunkstore.read import scratch
from chunkstore.read.members import READ_RUN_RAW_BYTES, read_runs

# Every test here runs with reads as they come and with every ranged read mapped.
pytestmark = pytest.mark.usefixtures("read_mode")


def _image(rng: np.random.Generator, length: int, size: int) -> np.ndarray:
    image = rng.integers(0, 256, length, dtype=np.uint8)
    image[: length // 2] = 0  # a zero run, as elements a save left alone give
    image[length // 2 : length // 2 + 8 * size] = 0
    return image


@pytest.mark.parametrize("size", [1, 2, 4, 8])
@pytest.mark.parametrize("elements", [0, 1, 63, 64, 65, 1000, 4099])
def test_a_link_applied_in_one_pass_gives_the_bytes_of_join_and_add(
        size: int, elements: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(size * 7 + elements)
    raw = rng.integers(0, 256, size * elements, dtype=np.uint8)
    base = rng.integers(0, 256, size * elements, dtype=np.uint8)
    raw[: len(raw) // 2] = base[: len(raw) // 2]  # unchanged elements: a zero image
    payload = memoryview(SUB_DELTA.encode(SUB_DELTA.image_of(raw.data, base.data, size), size))
    expected = bytearray(len(raw))
    SUB_DELTA.decode_into(payload, memoryview(expected), size)
    SUB_DELTA.apply_base(memoryview(expected), base.data, size)
    assert bytes(expected) == raw.tobytes()
    out = bytearray(len(raw))
    SUB_DELTA.decode_onto(payload, base.data, memoryview(out), size)
    assert out == expected
    monkeypatch.setattr(native, "MODULE", None)  # the numpy fallback: the same bytes
    fallback = bytearray(len(raw))
    SUB_DELTA.decode_onto(payload, base.data, memoryview(fallback), size)
    assert fallback == expected


@pytest.mark.skipif(native.MODULE is None, reason="the native extension is not built")
def test_the_native_one_pass_loop_matches_join_then_add() -> None:
    assert native.MODULE is not None
    rng = np.random.default_rng(3)
    for size in (1, 2, 4, 8):
        for elements in (0, 5, 64, 200, 4097):
            image = _image(rng, size * elements, size)
            base = rng.integers(0, 256, size * elements, dtype=np.uint8)
            planes = list(np.ascontiguousarray(image.reshape(-1, size).T)) if elements \
                else [b""] * size
            out = np.empty_like(base)
            native.MODULE.join_unzigzag_add(planes, base, out)
            expected = image.copy()
            native.MODULE.unzigzag_add(expected, base, size)
            assert out.tobytes() == expected.tobytes(), (size, elements)


@pytest.mark.skipif(native.MODULE is None, reason="the native extension is not built")
def test_the_native_one_pass_loop_refuses_other_lengths() -> None:
    assert native.MODULE is not None
    base, out = bytes(16), bytearray(16)
    with pytest.raises(ValueError):
        native.MODULE.join_unzigzag_add([bytes(4)] * 3, base, out)  # element size 3
    with pytest.raises(ValueError):
        native.MODULE.join_unzigzag_add([bytes(4), bytes(5)] * 2, base, out)
    with pytest.raises(ValueError):
        native.MODULE.join_unzigzag_add([bytes(4)] * 4, bytes(12), out)


def test_a_damaged_link_is_a_corrupt_chunk_on_the_one_pass_path(tmp_path: Path) -> None:
    """A link whose payload does not decode is refused, naming it, never returned."""
    rng = np.random.default_rng(0)
    table = rng.standard_normal((512, 64)).astype(np.float32)
    with chunkstore.open(tmp_path / "s", create=True, chunk_size=32 * 1024) as store:
        for step in range(3):
            table[::37, step] += 1
            with store.new_version(run="r", step=step) as version:
                version.put("t", table)
        reader = store.open_version("r@2")
        assert reader.get("t").tobytes() == table.tobytes()
        damaged = 0
        for path in sorted((tmp_path / "s" / "chunks").rglob("*")):
            if path.is_file() and path.stat().st_size > 4096:
                data = bytearray(path.read_bytes())
                data[-1] ^= 0xFF  # the end of the last member's payload
                path.chmod(0o644)
                path.write_bytes(bytes(data))
                damaged += 1
        assert damaged
        store.base_cache.clear()
        with pytest.raises(CorruptChunkError):
            store.open_version("r@2").get("t")


def test_runs_are_split_by_the_bytes_their_members_decode_to() -> None:
    pack = Digest.of(b"pack")
    big = memoryview(bytearray(READ_RUN_RAW_BYTES // 4))
    members = [(Digest.of(b"%d" % i), PackLocation(pack, 100 * i, 100), big, ((), ()))
               for i in range(10)]
    runs = read_runs(members)
    assert [len(run) for run in runs] == [4, 4, 2]  # 4 x a quarter: 8 MiB decoded
    assert [m for run in runs for m in run] == members


def test_a_read_releases_its_scratch_buffers(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    table = rng.standard_normal((256, 64)).astype(np.float32)
    with chunkstore.open(tmp_path / "s", create=True, chunk_size=16 * 1024) as store:
        for step in range(3):
            # Every element moves (sub-delta links, decoded through the scratch buffers;
            # a chain of sparse-delta links is decoded in the caller's buffer).
            table *= np.float32(1.0001)
            with store.new_version(run="r", step=step) as version:
                version.put("t", table)
        seen: list[int] = []
        real = scratch.release

        def release() -> None:
            seen.append(len(getattr(scratch._local, "buffers", {})))
            real()
        scratch.release = release  # type: ignore[assignment]
        try:
            store.base_cache.clear()
            assert store.open_version("r@2").get("t").tobytes() == table.tobytes()
        finally:
            scratch.release = real  # type: ignore[assignment]
        assert seen and max(seen) > 0  # the chains used them, and each job let them go


@pytest.mark.parametrize("cached", [False, True], ids=["decoded", "cached-bases"])
def test_a_chain_of_links_is_read_through_one_scratch_buffer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cached: bool) -> None:
    """The root and the links go to the caller's buffer and one scratch buffer in turn,
    the last into the caller's (a chunk's worth less memory per read job than two
    scratch buffers), at every depth: odd and even numbers of links, the root decoded
    or found in the base cache."""
    from chunkstore.read import chain

    rng = np.random.default_rng(2)
    table = rng.standard_normal((256, 64)).astype(np.float32)
    states = []
    slots: list[str] = []
    real = chain.scratch

    def recording(slot: str, size: int) -> memoryview:
        slots.append(slot)
        return real(slot, size)

    with chunkstore.open(tmp_path / "s", create=True, chunk_size=16 * 1024) as store:
        for step in range(5):  # chains of 0 to 4 sub-delta links
            table *= np.float32(1.0001)
            states.append(table.copy())
            with store.new_version(run="r", step=step) as version:
                version.put("t", table)
        monkeypatch.setattr(chain, "scratch", recording)
        for step, expected in enumerate(states):
            if not cached:
                store.base_cache.clear()
            with store.open_version(f"r@{step}") as reader:
                out = np.zeros_like(expected)
                reader.get_into("t", out)
                assert out.tobytes() == expected.tobytes()
                assert reader.get("t").tobytes() == expected.tobytes()
    assert slots and set(slots) == {"chain-0"}
