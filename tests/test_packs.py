"""Packs of small chunks (docs/format.md §3.5): round trips, deduplication against
older packs, GC, verify, crashes.  Real files, real LMDB, real subprocesses."""

from __future__ import annotations

import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import chunkstore
from chunkstore.backends.wrappers import ForwardingBackend
from chunkstore.errors import CorruptChunkError, InvalidSettingError, MissingChunkError
from chunkstore.format.digest import Digest
from chunkstore.format.dtypes import DTYPES
from chunkstore.format.manifest import PackLocation, TensorEntry
from chunkstore.format.records import STORE_FORMAT_VERSION
from chunkstore.objects.kinds import CHUNKS
from tests.s3server import s3_endpoint
from tests.test_crash import run_child

__all__ = ["s3_endpoint"]  # the session fixture, re-exported so pytest finds it here
REPO = Path(__file__).resolve().parent.parent
CHILD = Path(__file__).with_name("pack_crash_child.py")


def _objects(root: Path, prefix: str = "chunks") -> set[str]:
    return {p.name for p in (root / prefix).rglob("*")
            if p.is_file() and not p.name.startswith(".tmp-")}


def _packs(store: chunkstore.Store, version: str) -> dict[str, PackLocation | None]:
    """Where each tensor's single chunk lies (None: an object of its own)."""
    found = {}
    for name, leaf in store.open_version(version).entries().items():
        if isinstance(leaf, TensorEntry) and leaf.shards[0].chunks:
            found[name] = leaf.shards[0].location(0)
    return found


def _array(name: str, count: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, count * DTYPES[name].itemsize, dtype=np.uint8)
    array = raw.view(DTYPES[name])
    if name == "bool":
        array = raw % 2 == 1
    return array


def _small_state(step: int, count: int = 40) -> dict[str, np.ndarray]:
    """Small tensors: most unchanged between steps, a few changed."""
    state = {f"layer{i}.w": np.random.default_rng(i).standard_normal(64 + i)
             .astype(np.float32) for i in range(count)}
    for i in range(3):
        state[f"layer{i}.w"] = state[f"layer{i}.w"] + np.float32(step)
    state["step"] = np.array(step, dtype=np.int64)
    return state


def _save(store: chunkstore.Store, step: int, state: dict[str, np.ndarray],
          run: str = "r") -> str:
    with store.new_version(run, step) as version:
        for name, array in state.items():
            version.put(name, array)
    return version.info.id


def _check(store: chunkstore.Store, version: str, state: dict[str, np.ndarray]) -> None:
    reader = store.open_version(version)
    assert sorted(reader.names()) == sorted(state)
    for name, array in state.items():
        got = reader.get(name)
        assert got.dtype == array.dtype and got.shape == array.shape, name
        assert got.tobytes() == np.ascontiguousarray(array).tobytes(), name


@pytest.fixture
def pstore(tmp_path: Path) -> Iterator[chunkstore.Store]:
    with chunkstore.open(tmp_path / "store", chunk_size=64 * 1024, create=True) as store:
        yield store


# --- round trips ------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_every_dtype_round_trips_packed(pstore: chunkstore.Store, name: str) -> None:
    state = {f"t{n}": _array(name, n, n) for n in (1, 7, 100, 4096)}
    state["scalar"] = _array(name, 1, 99).reshape(())
    version = _save(pstore, 1, state)
    assert all(location is not None for location in _packs(pstore, version).values())
    _check(pstore, version, state)
    outs = {n: np.empty_like(a) for n, a in state.items()}
    pstore.open_version(version).get_many_into([(n, outs[n], None) for n in state])
    assert all(outs[n].tobytes() == state[n].tobytes() for n in state)
    assert pstore.verify().ok


def test_bfloat16_written_through_a_uint16_view_round_trips(pstore: chunkstore.Store) -> None:
    array = (np.arange(300, dtype=np.float32) / 7).astype(ml_dtypes.bfloat16)
    with pstore.new_version("r", 1) as version:
        version.put("b", array.view(np.uint16), dtype="bfloat16")
    assert pstore.open_version(version.info.id).get("b").tobytes() == array.tobytes()


def test_thousands_of_tiny_tensors_are_a_few_objects(tmp_path: Path) -> None:
    root = tmp_path / "store"
    rng = np.random.default_rng(0)
    names = sorted(DTYPES)
    state = {f"block{i // 100}.p{i % 100}": _array(names[i % len(names)],
                                                   int(rng.integers(1, 300)), i)
             for i in range(3000)}
    with chunkstore.open(root, create=True) as store:
        version = _save(store, 1, state)
        chunks = _objects(root)
        assert len(chunks) <= 3, "thousands of small chunks are stored in a few packs"
        _check(store, version, state)
        stats = store.stats()
        assert stats.packs == len(chunks) and stats.packed_chunks == len(
            {chunkstore.format.digest.Digest.of(np.ascontiguousarray(a).tobytes()) for a in
             state.values() if a.nbytes})
        assert store.verify().ok


def test_pack_size_bounds_the_packs(tmp_path: Path) -> None:
    root = tmp_path / "store"
    state = {f"t{i}": _array("uint8", 10_000, i) for i in range(20)}  # incompressible
    with chunkstore.open(root, compression="none", pack_size=50_000, create=True) as store:
        version = _save(store, 1, state)
        _check(store, version, state)
        sizes = [p.stat().st_size for p in (root / "chunks").rglob("*") if p.is_file()]
        # five members (10,024 bytes each) reach the size: four packs
        assert len(sizes) == 4 and max(sizes) < 60_100
    with pytest.raises(InvalidSettingError):
        chunkstore.open(root, pack_size=0, create=True)


def test_a_memory_store_reads_members_by_range(memory_store: chunkstore.Store) -> None:
    state = _small_state(1)
    version = _save(memory_store, 1, state)
    assert all(location is not None for location in _packs(memory_store, version).values())
    _check(memory_store, version, state)
    assert memory_store.verify().ok


@pytest.mark.s3
def test_an_s3_store_reads_members_by_ranged_get(s3_endpoint: str, tmp_path: Path) -> None:
    from tests.s3server import create_bucket, remove_bucket, storage_options
    bucket = create_bucket(s3_endpoint)
    try:
        with chunkstore.open(f"s3://{bucket}/store", index_dir=str(tmp_path / "index"),
                             storage_options=storage_options(s3_endpoint), create=True) as store:
            state = _small_state(1)
            first = _save(store, 1, state)
            assert all(loc is not None for loc in _packs(store, first).values())
            second = _save(store, 2, _small_state(2))
            assert _packs(store, second)["layer9.w"] == _packs(store, first)["layer9.w"]
            _check(store, first, state)
            _check(store, second, _small_state(2))
            assert store.verify().ok
    finally:
        remove_bucket(s3_endpoint, bucket)


def test_the_same_chunk_twice_in_one_save_is_packed_once(pstore: chunkstore.Store) -> None:
    same = np.arange(100, dtype=np.int32)
    version = _save(pstore, 1, {"a": same, "b": same.copy(), "c": same + 1})
    packs = _packs(pstore, version)
    assert packs["a"] == packs["b"] and packs["a"] != packs["c"]
    assert packs["a"] is not None and packs["c"] is not None
    assert packs["c"].offset == packs["a"].length  # nothing between members


# --- deduplication against older packs ---------------------------------------------------


def test_a_later_save_reuses_members_of_an_older_pack(pstore: chunkstore.Store,
                                                      tmp_path: Path) -> None:
    root = tmp_path / "store"
    first = _save(pstore, 1, _small_state(1))
    before = _objects(root)
    state = _small_state(2)
    second = _save(pstore, 2, state)
    new = _objects(root) - before
    old, now = _packs(pstore, first), _packs(pstore, second)
    changed = {"layer0.w", "layer1.w", "layer2.w", "step"}
    assert all(now[n] == old[n] for n in now if n not in changed)  # referenced there
    assert len(new) == 1  # one pack, holding only the changed chunks
    (pack,) = new
    assert {now[n].pack.hex for n in changed} == {pack}  # type: ignore[union-attr]
    info = pstore.resolve("r@2")
    assert info.new_bytes == sum(state[n].nbytes for n in changed)
    _check(pstore, second, state)
    # A new handle (and a rebuilt index) dedups the same way.
    pstore.close()
    with chunkstore.open(root, create=True) as store:
        store.rebuild_index()
        before = _objects(root)
        third = _save(store, 3, {n: a for n, a in state.items()}, run="other")
        assert _objects(root) == before  # nothing new: every chunk reused
        assert _packs(store, third) == now
        assert store.verify().ok


def test_a_lost_pack_is_written_again_not_referenced(pstore: chunkstore.Store,
                                                     tmp_path: Path) -> None:
    root = tmp_path / "store"
    state = _small_state(1)
    first = _save(pstore, 1, state)
    (pack,) = {loc.pack for loc in _packs(pstore, first).values() if loc}
    (root / CHUNKS.key(pack)).unlink()
    problems = pstore.verify().problems
    assert {(p.kind, p.version) for p in problems} == {("missing-chunk", first)}
    second = _save(pstore, 2, state)
    # The same members in the same order make the same pack: it is stored again.
    assert {loc.pack for loc in _packs(pstore, second).values() if loc} == {pack}
    assert (root / CHUNKS.key(pack)).is_file()
    _check(pstore, second, state)
    _check(pstore, first, state)
    assert pstore.verify().ok


# --- GC ----------------------------------------------------------------------------------


def test_gc_keeps_a_pack_while_a_live_version_needs_it(pstore: chunkstore.Store,
                                                       tmp_path: Path) -> None:
    root = tmp_path / "store"
    first = _save(pstore, 1, _small_state(1))
    (pack,) = {loc.pack for loc in _packs(pstore, first).values() if loc}
    state = _small_state(2)
    second = _save(pstore, 2, state)
    pstore.delete(first)
    pstore.gc(grace=0)
    assert pack.hex in _objects(root), "the second version reads members of the first pack"
    _check(pstore, second, state)
    assert pstore.verify().ok
    assert pstore.stats().packed_garbage_bytes > 0  # the first version's changed members
    pstore.delete(second)
    result = pstore.gc(grace=0)
    assert _objects(root) == set() and result.chunks_deleted == 2
    # A save after the packs are gone writes its members again.
    third = _save(pstore, 3, state)
    _check(pstore, third, state)
    assert pstore.verify().ok


# --- verify ------------------------------------------------------------------------------


def test_a_flipped_byte_in_a_member_is_reported_on_every_version(pstore: chunkstore.Store,
                                                                 tmp_path: Path) -> None:
    root = tmp_path / "store"
    ids = [_save(pstore, step, _small_state(step)) for step in (1, 2, 3)]
    location = _packs(pstore, ids[0])["layer20.w"]  # unchanged: in the first pack
    assert location is not None and all(_packs(pstore, v)["layer20.w"] == location for v in ids)
    path = root / CHUNKS.key(location.pack)
    data = bytearray(path.read_bytes())
    data[24 + location.offset + location.length - 1] ^= 0x40  # the member's last byte
    path.write_bytes(bytes(data))
    problems = pstore.verify().problems
    assert {(p.kind, p.version) for p in problems} == {("corrupt-chunk", v) for v in ids}
    with pytest.raises(CorruptChunkError):
        pstore.open_version(ids[2]).get("layer20.w")
    reader = pstore.open_version(ids[2])  # the other members still read
    assert reader.get("layer21.w").tobytes() == _small_state(3)["layer21.w"].tobytes()


def test_a_deleted_pack_is_reported_on_every_version(pstore: chunkstore.Store,
                                                     tmp_path: Path) -> None:
    root = tmp_path / "store"
    ids = [_save(pstore, step, _small_state(step)) for step in (1, 2, 3)]
    location = _packs(pstore, ids[0])["layer30.w"]
    assert location is not None
    (root / CHUNKS.key(location.pack)).unlink()
    problems = pstore.verify().problems
    assert {(p.kind, p.version, p.digest) for p in problems} == {
        ("missing-chunk", v, location.pack.hex) for v in ids}
    with pytest.raises(MissingChunkError):
        pstore.open_version(ids[1]).get("layer30.w")


def test_a_damaged_pack_header_is_reported(pstore: chunkstore.Store, tmp_path: Path) -> None:
    """As a warning: no read uses it (see the next-but-one test), so no version breaks."""
    root = tmp_path / "store"
    state = _small_state(1)
    version = _save(pstore, 1, state)
    location = _packs(pstore, version)["layer5.w"]
    assert location is not None
    path = root / CHUNKS.key(location.pack)
    data = bytearray(path.read_bytes())
    data[5] = 0  # codec raw: no longer a pack
    path.write_bytes(bytes(data))
    result = pstore.verify()
    assert result.ok, result.problems
    assert [(w.kind, w.digest) for w in result.warnings] == [("pack-header", location.pack.hex)]
    np.testing.assert_array_equal(pstore.open_version(version).get("layer5.w"),
                                  state["layer5.w"])


def test_a_location_that_lies_is_refused(pstore: chunkstore.Store) -> None:
    """A manifest listing another member's location: the hash check refuses it."""
    state = {"a": np.arange(50, dtype=np.int16), "b": np.arange(50, dtype=np.int16) * 3}
    version = _save(pstore, 1, state)
    packs = _packs(pstore, version)
    assert packs["a"] is not None and packs["b"] is not None
    from chunkstore.read.reader import read_chunk_into
    out = memoryview(bytearray(100))
    with pytest.raises(CorruptChunkError, match="hashes to"):
        read_chunk_into(pstore, Digest.of(state["a"].tobytes()), out, location=packs["b"])


# --- old stores --------------------------------------------------------------------------


def test_a_version_3_store_is_upgraded_by_its_first_save(tmp_path: Path) -> None:
    root = tmp_path / "store-v3"
    shutil.copytree(REPO / "tests" / "data" / "store-v3", root)
    with chunkstore.open(root, create=False) as store:
        assert store.config.format_version == 3
        old = store.versions()
        state = _small_state(1)
        version = _save(store, 1, state, run="later")
        assert store.config.format_version == STORE_FORMAT_VERSION
        assert all(loc is not None for loc in _packs(store, version).values())
        _check(store, version, state)
        for info in old:
            store.open_version(info.id).get("model.layers.0.w")
        assert store.verify().ok
        assert store.config.delta_depth == 3  # kept across the upgrade


# --- crashes -----------------------------------------------------------------------------


def _run_child(root: Path, first: int, last: int, fault: str | None
               ) -> subprocess.CompletedProcess[str]:
    return run_child(root, first, last, fault, child=CHILD, timeout=120)


def _check_published(root: Path, steps: list[int]) -> None:
    from tests.pack_crash_child import RUN, make_state
    with chunkstore.open(root, create=False) as store:
        assert [v.step for v in store.versions(RUN)] == steps
        for step in steps:
            _check(store, store.resolve(f"{RUN}@{step}").id, make_state(step))
        result = store.verify()
        assert result.ok, result.problems


@pytest.fixture(scope="module")
def saved_by_a_child(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh store into which a child process saved steps 1 and 2 (and exited): made
    once for the module, each crash test below works on a copy of it."""
    root = tmp_path_factory.mktemp("packed") / "store"
    done = _run_child(root, 1, 2, None)
    assert done.returncode == 0, done.stderr
    return root


@pytest.mark.parametrize("fault", [
    "kill-before-put:chunks/:0", "kill-after-put:chunks/:0", "kill-before-put:chunks/:1",
    "kill-after-put:chunks/:1", "kill-before-put:nodes/:0", "kill-before-put:versions/:0",
    "kill-after-put:versions/:0", "kill-before-delete:sessions/:0",
])
def test_a_packed_save_killed_anywhere_leaves_every_published_version_readable(
        tmp_path: Path, saved_by_a_child: Path, fault: str) -> None:
    root = tmp_path / "store"
    shutil.copytree(saved_by_a_child, root, symlinks=True)  # the same bytes, index included
    result = _run_child(root, 3, 3, fault)
    assert result.returncode == -signal.SIGKILL, result.stderr
    after_commit = fault in ("kill-after-put:versions/:0", "kill-before-delete:sessions/:0")
    published = [1, 2, 3] if after_commit else [1, 2]
    _check_published(root, published)
    again = _run_child(root, published[-1] + 1, published[-1] + 2, None)
    assert again.returncode == 0, again.stderr
    _check_published(root, [*published, published[-1] + 1, published[-1] + 2])
    with chunkstore.open(root, create=False) as store:
        store.delete(f"crash@{published[0]}")
        store.gc(grace=0)  # the killed save's orphan packs go, and nothing else
        assert store.verify().ok
    _check_published(root, [*published[1:], published[-1] + 1, published[-1] + 2])


# --- many indexes ------------------------------------------------------------------------


def test_a_pack_another_index_deleted_is_not_reused(tmp_path: Path) -> None:
    """Index A still believes the pack stored; GC on index B deleted it.  On an object
    store (no existence check) only the GC journal tells A: its save writes the members
    again instead of referencing the deleted pack."""
    import uuid
    url = f"memory://packs-{uuid.uuid4().hex}"
    state = _small_state(1)
    with chunkstore.open(url, index_dir=str(tmp_path / "a"), create=True) as a:
        first = _save(a, 1, state)
        (pack,) = {loc.pack for loc in _packs(a, first).values() if loc}
        with chunkstore.open(url, index_dir=str(tmp_path / "b"), create=True) as b:
            b.delete(first)
            assert b.gc(grace=0).chunks_deleted == 1
            assert not b.backend.exists(CHUNKS.key(pack))
        second = _save(a, 2, state)
        _check(a, second, state)
        assert a.backend.exists(CHUNKS.key(pack))  # the same members: the same pack, again
        a.reconcile()  # counts out the version B removed
        assert a.verify().ok


def test_neighbouring_members_are_read_together() -> None:
    from chunkstore.read.members import READ_GAP_BYTES, READ_RUN_BYTES, read_runs
    a, b = Digest.of(b"a"), Digest.of(b"b")
    out = memoryview(bytearray(1))

    def at(pack: Digest, offset: int, length: int = 100) -> tuple[Digest, PackLocation,
                                                                  memoryview]:
        return Digest.of(b"%d" % offset), PackLocation(pack, offset, length), out

    runs = read_runs([at(a, 200), at(b, 0), at(a, 0), at(a, 100),
                      at(a, 300 + READ_GAP_BYTES + 1), at(a, 10**8, READ_RUN_BYTES)])
    shapes = sorted([(r[0][1].pack.hex, [m[1].offset for m in r]) for r in runs])
    assert shapes == sorted([(a.hex, [0, 100, 200]), (a.hex, [300 + READ_GAP_BYTES + 1]),
                             (a.hex, [10**8]), (b.hex, [0])])


def test_a_restore_of_many_small_tensors_reads_each_pack_in_few_ranges(
        pstore: chunkstore.Store) -> None:
    state = {f"t{i}": np.full(100 + i, i, dtype=np.int32) for i in range(300)}
    version = _save(pstore, 1, state)
    calls: list[str] = []

    class CountingBackend(ForwardingBackend):
        def get_range(self, key: str, start: int, length: int) -> bytes:
            calls.append(key)
            return self.inner.get_range(key, start, length)

    pstore.backend = CountingBackend(pstore.backend)
    outs = {n: np.empty_like(a) for n, a in state.items()}
    pstore.open_version(version).get_many_into([(n, outs[n], None) for n in state])
    assert all(outs[n].tobytes() == state[n].tobytes() for n in state)
    assert len(calls) == 1  # 300 members of one pack: one ranged read


# --- hostile manifests ---------------------------------------------------------------------


_C, _P = Digest.of(b"chunk").hex, Digest.of(b"pack").hex


@pytest.mark.parametrize(("packs", "bases"), [
    ({"x": 1}, None), ([], None), ([None, None], None), ([[_P, 0]], None),
    ([[_P, -1, 100]], None), ([[_P, 0, 23]], None), ([[_P, 0, True]], None),
    ([[_P, 2**28, 100]], None), ([[_P, 0, 2**29]], None), ([[_C, 0, 100]], None),
    ([["zz", 0, 100]], None), ([[_P, 0, 100]], [[_P]]),
])
def test_a_malformed_pack_location_is_a_corrupt_node(packs: object, bases: object) -> None:
    import json

    from chunkstore.errors import CorruptNodeError
    from chunkstore.format.manifest import decode_tree
    shard: dict[str, object] = {"chunk_bytes": 4096, "chunks": [_C], "offsets": [0],
                                "sizes": [10], "packs": packs}
    if bases is not None:
        shard["bases"] = bases
    body = {"entries": {"w": {"tensor": {"dtype": "uint8", "shape": [10], "shards": [shard]}}},
            "format_version": 3, "kind": "tree"}
    data = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    if packs == [] and bases is None:  # absent: a chunk of its own
        decode_tree(Digest.of(data), data)
        return
    with pytest.raises(CorruptNodeError):
        decode_tree(Digest.of(data), data)


@pytest.fixture
def pack_large(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of larger tensors packed on the local disk too (as on object stores)."""
    import chunkstore.write.writer

    monkeypatch.setattr(chunkstore.write.writer, "PACK_LARGE_TENSORS", True)


def test_chunks_of_large_tensors_are_packed_and_reused(tmp_path: Path, pack_large: None
                                                       ) -> None:
    """A table of many chunks, a few rows changed per save: each save packs the chunks
    it must write (a few objects, not one per chunk), reuses the others from older
    packs, and every version reads back exact; GC and verify follow."""
    rng = np.random.default_rng(7)
    table = rng.standard_normal((4096, 64)).astype(np.float32)  # 1 MiB: 16 chunks
    with chunkstore.open(tmp_path / "store", chunk_size=64 * 1024, pack_size=256 * 1024,
                         compression="none", create=True) as store:
        versions, states = [], []
        for step in range(4):
            table = table.copy()
            table[step * 1000 : step * 1000 + 10] += 1  # touches one chunk
            states.append({"table": table, "bias": np.arange(10, dtype=np.float32) * step})
            before = _objects(tmp_path / "store")
            versions.append(_save(store, step, states[-1]))
            written = _objects(tmp_path / "store") - before
            assert len(written) <= (6 if step == 0 else 1), written  # packs, not 16 chunks
        (entry,) = [e for n, e in store.open_version(versions[-1]).entries().items()
                    if n == "table"]
        assert isinstance(entry, TensorEntry)
        locations = entry.shards[0].packs
        assert len(locations) == 16 and all(loc is not None for loc in locations)
        first = {loc.pack for loc in _entry_packs(store, versions[0])}
        assert first & {loc.pack for loc in locations if loc is not None}  # reused
        for version, state in zip(versions, states, strict=True):
            _check(store, version, state)
        store.delete(versions[0])
        store.gc(grace=0)
        assert store.verify().ok
        for version, state in zip(versions[1:], states[1:], strict=True):
            _check(store, version, state)


def _entry_packs(store: chunkstore.Store, version: str) -> list[PackLocation]:
    entry = store.open_version(version).entries()["table"]
    assert isinstance(entry, TensorEntry)
    return [loc for loc in entry.shards[0].packs if loc is not None]


@pytest.mark.s3
def test_an_s3_store_packs_the_chunks_of_large_tensors(s3_endpoint: str,
                                                       tmp_path: Path) -> None:
    from tests.s3server import create_bucket, remove_bucket, storage_options
    bucket = create_bucket(s3_endpoint)
    try:
        with chunkstore.open(f"s3://{bucket}/store", index_dir=str(tmp_path / "index"),
                             chunk_size=64 * 1024, compression="none",
                             storage_options=storage_options(s3_endpoint), create=True) as store:
            state = {"table": np.arange(200_000, dtype=np.float32)}  # 13 chunks
            version = _save(store, 1, state)
            assert len(_entry_packs(store, version)) == 13
            chunks = [k for k in store.backend.list("chunks/")]
            assert len(chunks) == 1  # one pack (8 MiB target), not 13 objects
            _check(store, version, state)
            assert store.verify().ok
    finally:
        remove_bucket(s3_endpoint, bucket)


def test_a_store_of_the_largest_chunk_size_keeps_its_chunks_readable(tmp_path: Path) -> None:
    """With the largest chunk size (256 MiB) and delta chains, an incompressible chunk
    would make a member whose location ends past the largest pack a reader accepts: it
    is stored as an object of its own, and the version reads back."""
    from chunkstore.format.manifest import MAX_CHUNK_BYTES

    data = np.frombuffer(np.random.default_rng(0).bytes(MAX_CHUNK_BYTES), dtype=np.uint8)
    with chunkstore.open(tmp_path / "s", chunk_size=MAX_CHUNK_BYTES, delta_depth=2,
                         create=True) as store:
        with store.new_version(run="r", step=1) as version:
            version.put("big", data)
        entry = store.open_version("r@1").entry("big")
        assert isinstance(entry, TensorEntry)
        assert entry.shards[0].location(0) is None
        assert np.array_equal(store.open_version("r@1").get("big"), data)
        assert store.verify().ok


def test_a_pack_is_sealed_before_a_member_would_end_past_the_largest_pack(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Members are packed in order until the next would end past the largest pack a
    location may point into (made 3 MiB here, for writer and reader alike, so 1 MiB
    chunks show it): then a new pack starts.  Every location stays within it and the
    version reads back."""
    from chunkstore.format import manifest
    from chunkstore.read import packs
    limit = 3 << 20
    monkeypatch.setattr(manifest, "MAX_PACK_BYTES", limit)
    monkeypatch.setattr(packs, "MAX_PACK_BYTES", limit)
    data = np.frombuffer(np.random.default_rng(1).bytes(8 << 20), dtype=np.uint8)
    with chunkstore.open(tmp_path / "s", chunk_size=1 << 20, delta_depth=2,
                         pack_size=64 << 20, create=True) as store:
        with store.new_version(run="r", step=1) as version:
            version.put("t", data)
        entry = store.open_version("r@1").entry("t")
        assert isinstance(entry, TensorEntry)
        locations = [entry.shards[0].location(i) for i in range(8)]
        assert all(at is not None and at.offset + at.length <= limit for at in locations)
        assert len({at.pack for at in locations if at is not None}) == 4  # 2 members each
        assert np.array_equal(store.open_version("r@1").get("t"), data)
        assert store.verify().ok


@pytest.mark.parametrize("damage", ["magic", "format version", "bytes appended"])
def test_damage_to_a_packs_own_header_is_a_warning_while_reads_are_whole(
        tmp_path: Path, damage: str) -> None:
    """Reads never use a pack's own header (each member is checked by its own header
    and hash), so damage there breaks no version: verify passes with a warning
    naming the pack (it reported every version using the pack as corrupt while every
    read returned exact bytes)."""
    path = tmp_path / "s"
    arrays = {f"b{i}": np.arange(64, dtype=np.float32) + i for i in range(10)}
    with chunkstore.open(path, create=True) as store:
        with store.new_version("r", 1) as version:
            for name, array in arrays.items():
                version.put(name, array)
        entry = store.open_version("r@1").entry("b0")
        assert isinstance(entry, TensorEntry)
        location = entry.shards[0].location(0)
        assert location is not None  # packed
    pack_file = path / CHUNKS.key(location.pack)
    raw = bytearray(pack_file.read_bytes())
    if damage == "magic":
        raw[0] ^= 0xFF
    elif damage == "format version":
        raw[4] = 0xEE
    else:
        raw += b"\0" * 16
    pack_file.chmod(0o644)
    pack_file.write_bytes(bytes(raw))
    with chunkstore.open(path, create=True) as store:
        reader = store.open_version("r@1")
        for name, array in arrays.items():
            np.testing.assert_array_equal(reader.get(name), array)
        result = store.verify()
        assert result.ok, result.problems
        assert [(w.kind, w.digest) for w in result.warnings] == [
            ("pack-header", location.pack.hex)]
