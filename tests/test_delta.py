"""Delta chunks (sub-delta; xor-delta in old chains and for complex128): chains of
every depth round-trip through removals and GC, GC keeps every base a live delta
needs (and only those), and a damaged base is reported on every version that depends
on it.

Every test runs twice: with delta chunks as objects of their own (what releases
before chunk format 5 wrote, and ``Store.pack_delta_chunks = False``) and packed
(this release's default), except those marked ``delta_objects``, which look at
the chunk objects themselves (tests/test_packed_deltas.py has their packed
counterparts)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import chunkstore
from chunkstore.backends.wrappers import ForwardingBackend
from chunkstore.codecs import SPARSE_DELTA, SUB_DELTA, XOR_DELTA
from chunkstore.errors import CorruptChunkError, InvalidSettingError, MissingChunkError
from chunkstore.format.chunkobj import ChunkHeader, encode_object, parse_header
from chunkstore.format.digest import Digest
from chunkstore.format.manifest import Shard, TensorEntry
from chunkstore.index.lmdbindex import CHUNK as CHUNK_KIND
from chunkstore.objects.kinds import CHUNKS
from chunkstore.read.chain import base_bytes, base_prefix
from chunkstore.write.delta import SKIP_SAVES, probe_length

# Every test here runs with reads as they come and with every ranged read mapped.
pytestmark = pytest.mark.usefixtures("read_mode")

CHUNK = 4096
DEPTH = 3
ROWS, DIM = 256, 16  # 16 KiB of float32: four chunks


def sparse_states(seed: int = 0, rows: int = 2) -> Iterator[np.ndarray]:
    """An embedding table of which each state changes ``rows`` random rows (a sparse
    update)."""
    rng = np.random.default_rng(seed)
    table = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    while True:
        yield table.copy()
        table[rng.integers(0, ROWS, rows)] += np.float32(0.5)


@pytest.fixture(autouse=True, params=["objects", "packed"])
def delta_layout(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    packed = request.param == "packed"
    if packed and request.node.get_closest_marker("delta_objects"):
        pytest.skip("looks at delta chunks as objects of their own")
    monkeypatch.setattr(chunkstore.handle.handle, "PACK_DELTA_CHUNKS", packed)
    return str(request.param)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[chunkstore.Store]:
    with chunkstore.open(tmp_path / "s", chunk_size=CHUNK, delta_depth=DEPTH,
                         create=True) as opened:
        yield opened


def save(store: chunkstore.Store, step: int, table: np.ndarray, run: str = "r") -> str:
    with store.new_version(run=run, step=step) as version:
        version.put("emb", table)
    return version.info.id


def shard(store: chunkstore.Store, version_id: str) -> Shard:
    entry = store.open_version(version_id).entry("emb")
    assert isinstance(entry, TensorEntry)
    (only,) = entry.shards
    return only


def object_path(store: chunkstore.Store, digest: Digest) -> Path:
    return Path(store.url) / CHUNKS.key(digest)


def header_base(store: chunkstore.Store, digest: Digest) -> Digest | None:
    return parse_header(digest, object_path(store, digest).read_bytes()).base


def test_chains_of_every_depth_round_trip_with_middle_versions_removed_and_gc_between(
        store: chunkstore.Store) -> None:
    states = sparse_states()
    saved: dict[str, np.ndarray] = {}
    depths: set[int] = set()
    for step in range(14):
        table = next(states)
        version_id = save(store, step, table)
        saved[version_id] = table
        current = shard(store, version_id)
        depths.update(len(current.chain(i)) for i in range(len(current.chunks)))
        assert all(len(current.chain(i)) <= DEPTH for i in range(len(current.chunks)))
        live = [v.id for v in store.versions("r")]
        if step % 3 == 2:  # remove one from the middle of the chain
            store.delete(live[len(live) // 2])
            saved.pop(live[len(live) // 2])
        store.gc(grace=0)
        for kept, want in saved.items():
            np.testing.assert_array_equal(store.open_version(kept).get("emb"), want)
    assert depths == set(range(DEPTH + 1)), "the test must build chains of every depth"
    result = store.verify()
    assert result.ok, result.problems


@pytest.mark.delta_objects
def test_a_chunk_reads_at_most_depth_plus_one_objects(store: chunkstore.Store) -> None:
    ids = _chunk0_changing(store, DEPTH + 2)
    for version_id, depth in zip(ids, [0, 1, 2, 3, 0], strict=True):
        newest = shard(store, version_id)
        chain = newest.chain(0)
        assert len(chain) == depth
        # The headers name exactly the listed chain, and its end is standalone.
        found, digest = [], newest.chunks[0]
        while (base := header_base(store, digest)) is not None:
            found.append(base)
            digest = base
        assert tuple(found) == chain


@pytest.mark.delta_objects
def test_a_base_needed_by_a_live_delta_survives_gc_and_goes_when_unneeded(
        store: chunkstore.Store) -> None:
    states = sparse_states()
    first = save(store, 1, next(states))
    second_table = next(states)
    second = save(store, 2, second_table)
    deltas = [(d, c) for d, c in zip(shard(store, second).chunks, shard(store, second).bases,
                                     strict=True) if c]
    assert deltas, "the second save must write deltas"
    delta, (base,) = deltas[0]
    assert header_base(store, delta) == base and base in shard(store, first).chunks

    store.delete(first)
    store.gc(grace=0)
    assert object_path(store, base).exists(), "GC deleted a base a live delta needs"
    np.testing.assert_array_equal(store.open_version(second).get("emb"), second_table)
    assert store.verify().ok

    store.delete(second)
    store.gc(grace=0)
    assert not object_path(store, delta).exists()
    assert not object_path(store, base).exists()
    assert store.verify().ok


def test_index_rebuild_counts_bases_as_references(store: chunkstore.Store) -> None:
    states = sparse_states()
    first = save(store, 1, next(states))
    save(store, 2, next(states))
    store.delete(first)
    store.rebuild_index()
    assert store.verify().ok  # refcounts of the rebuilt index include the base edges
    store.gc(grace=0)
    assert store.verify().ok


def _chunk0_changing(store: chunkstore.Store, versions: int) -> list[str]:
    """Versions in which only chunk 0 changes (row 0, one element per version)."""
    rng = np.random.default_rng(5)
    table = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    ids = []
    for step in range(versions):
        table[0, step] += 1
        ids.append(save(store, step, table.copy()))
    return ids


def _three_deep(store: chunkstore.Store) -> tuple[list[str], Digest, Digest]:
    """Three versions whose chunk 0 is a chain A <- B <- C; returns ids, A and B."""
    ids = _chunk0_changing(store, 3)
    a, b, _ = (shard(store, v).chunks[0] for v in ids)
    assert shard(store, ids[2]).chain(0) == (b, a)
    return ids, a, b


def _problems(store: chunkstore.Store) -> dict[str | None, set[str | None]]:
    found: dict[str | None, set[str | None]] = {}
    for problem in store.verify().problems:
        found.setdefault(problem.version, set()).add(problem.digest)
    return found


@pytest.mark.delta_objects
def test_a_flipped_byte_in_a_base_is_reported_on_every_dependent_version(
        store: chunkstore.Store) -> None:
    ids, a, _ = _three_deep(store)
    path = object_path(store, a)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    assert _problems(store) == {v: {a.hex} for v in ids}
    store.base_cache.clear()  # as in a process that did not save them
    with pytest.raises(CorruptChunkError):
        store.open_version(ids[2]).get("emb")


@pytest.mark.delta_objects
def test_a_base_replaced_by_another_valid_chunk_is_caught_by_the_hash(
        store: chunkstore.Store) -> None:
    """A base object that decodes cleanly to other bytes (a valid raw chunk of the same
    length): a read through the chain, which checks only its result, refuses it, as
    verify, which checks every link, does."""
    ids, a, _ = _three_deep(store)
    other = np.random.default_rng(9).integers(0, 256, CHUNK, dtype=np.uint8).tobytes()
    object_path(store, a).write_bytes(encode_object(ChunkHeader(0, 4, CHUNK, CHUNK), other))
    store.base_cache.clear()  # as in a process that did not save them
    for version_id in ids:
        with pytest.raises(CorruptChunkError, match="hashes to"):
            store.open_version(version_id).get("emb")
    assert _problems(store) == {v: {a.hex} for v in ids}


@pytest.mark.delta_objects
def test_a_deleted_base_is_reported_on_every_dependent_version(
        store: chunkstore.Store) -> None:
    ids, _, b = _three_deep(store)
    object_path(store, b).unlink()
    assert _problems(store) == {ids[1]: {b.hex}, ids[2]: {b.hex}}
    store.base_cache.clear()  # as in a process that did not save them
    with pytest.raises(MissingChunkError):
        store.open_version(ids[2]).get("emb")
    store.open_version(ids[0]).get("emb")  # needs no base: reads


@pytest.mark.delta_objects
def test_a_padded_base_is_refused_without_being_read_whole(store: chunkstore.Store) -> None:
    """A base object padded on storage (64 MiB of zeros after it) is a corrupt chunk to
    a reader and to verify, found from a read bounded by the chunk's length: no read
    of the store returns more than a chunk object can be."""
    ids = _three_deep(store)[0]
    base = shard(store, ids[1]).chain(0)[0]
    with object_path(store, base).open("r+b") as f:
        f.truncate(object_path(store, base).stat().st_size + (64 << 20))
    store.base_cache.clear()
    store.backend = reads = _LargestRead(store.backend)
    with pytest.raises(CorruptChunkError):
        store.open_version(ids[1]).get("emb")
    result = store.verify()
    store.backend = reads.inner
    assert not result.ok
    assert 0 < reads.largest < (2 << 20), reads.largest


class _LargestRead(ForwardingBackend):
    """The store's backend, noting the most bytes one read returned."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.largest = 0

    def get(self, key: str) -> bytes:
        data = self.inner.get(key)
        self.largest = max(self.largest, len(data))
        return data

    def get_range(self, key: str, start: int, length: int) -> bytes:
        data = self.inner.get_range(key, start, length)
        self.largest = max(self.largest, len(data))
        return data


@pytest.mark.delta_objects
@pytest.mark.parametrize("codec", [3, 5])
def test_a_delta_of_element_size_zero_is_a_corrupt_chunk(store: chunkstore.Store,
                                                          codec: int) -> None:
    """A delta header claiming elements of 0 bytes (a crafted or damaged object) is a
    corrupt chunk to every reader, not a division by zero."""
    states = sparse_states()
    ids = [save(store, step, next(states)) for step in range(2)]
    later = shard(store, ids[1])
    i = next(i for i in range(len(later.chunks)) if later.chain(i))
    path = object_path(store, later.chunks[i])
    data = bytearray(path.read_bytes())
    data[5], data[6] = codec, 0  # codec id, element size
    path.write_bytes(bytes(data))
    store.base_cache.clear()
    with pytest.raises(CorruptChunkError):
        store.open_version(ids[1]).get("emb")
    result = store.verify()
    assert not result.ok and any(p.kind == "corrupt-chunk" for p in result.problems)


@pytest.mark.delta_objects
def test_a_base_the_manifest_does_not_list_is_refused(store: chunkstore.Store) -> None:
    """A delta whose header names a base its version does not list (so GC would not
    keep it) is refused, even while that base is present."""
    ids, a, _ = _three_deep(store)
    c = shard(store, ids[2]).chunks[0]
    data = bytearray(object_path(store, c).read_bytes())
    assert data[5] == SPARSE_DELTA.id  # a few rows changed: the writer's sparse delta
    data[24:56] = a.raw  # now names A instead of B
    object_path(store, c).write_bytes(bytes(data))
    with pytest.raises(CorruptChunkError, match="manifest lists"):
        store.open_version(ids[2]).get("emb")
    assert _problems(store) == {ids[2]: {c.hex}}


def test_none_writes_no_deltas_and_old_stores_get_none(tmp_path: Path) -> None:
    states = sparse_states()
    with chunkstore.open(tmp_path / "raw", chunk_size=CHUNK, compression="none",
                         create=True) as raw:
        save(raw, 1, next(states))
        assert not any(shard(raw, save(raw, 2, next(states))).bases)
    with chunkstore.open(tmp_path / "off", chunk_size=CHUNK, delta_depth=0, create=True) as off:
        save(off, 1, next(states))
        assert not any(shard(off, save(off, 2, next(states))).bases)


def test_a_handle_may_build_shorter_chains_than_the_store_never_longer(
        tmp_path: Path) -> None:
    """``chunkstore.open(existing, delta_depth=N)`` bounds that handle's saves to chains
    of N (restores that decode less, for more bytes per version); the store keeps its
    own depth for other handles, and a depth above it is refused before anything is
    opened, as it was once silently ignored."""
    path = tmp_path / "s"
    states = sparse_states()
    tables = [next(states) for _ in range(12)]
    with chunkstore.open(path, chunk_size=CHUNK, delta_depth=DEPTH, create=True) as created:
        save(created, 0, tables[0])
    for depth, steps in ((1, range(1, 6)), (0, range(6, 8))):
        with chunkstore.open(path, delta_depth=depth) as capped:
            assert (capped.config.delta_depth, capped.delta_depth) == (DEPTH, depth)
            written = set()  # chain lengths of the chunks these saves wrote
            for step in steps:
                before = shard(capped, capped.latest("r").id)
                current = shard(capped, save(capped, step, tables[step]))
                for i, digest in enumerate(current.chunks):
                    if digest == before.chunks[i]:  # unchanged: reused, or stored anew
                        assert len(current.chain(i)) <= len(before.chain(i))
                    else:
                        written.add(len(current.chain(i)))
            assert written == ({0, 1} if depth else {0}), (depth, written)
    with chunkstore.open(path) as default:
        assert default.delta_depth == DEPTH
        longest = 0
        for step in range(8, 12):
            current = shard(default, save(default, step, tables[step]))
            longest = max([longest, *(len(current.chain(i)) for i in range(len(current.chunks)))])
        assert longest > 1  # the store's own depth again
        for step, version in enumerate(default.versions("r")):
            np.testing.assert_array_equal(default.open_version(version.id).get("emb"),
                                          tables[step])
    def files() -> list[tuple[str, int, int]]:
        return sorted((str(f.relative_to(path)), f.stat().st_size, f.stat().st_mtime_ns)
                      for f in path.rglob("*") if f.is_file())

    before_refusal = files()
    with pytest.raises(InvalidSettingError, match=f"created with delta depth {DEPTH}.*"
                       f"delta_depth={DEPTH + 1} cannot hold; pass 0 to {DEPTH}"):
        chunkstore.open(path, delta_depth=DEPTH + 1)
    assert files() == before_refusal  # not even the index was opened
    with chunkstore.open(path) as after:
        assert after.config.delta_depth == DEPTH and len(after.versions("r")) == 12


@pytest.mark.delta_objects
def test_a_reused_delta_keeps_its_chain_in_a_new_run(store: chunkstore.Store) -> None:
    """A run that deduplicates against another run's delta chunk lists its chain too
    (found from the headers), so removing the other run keeps it readable."""
    states = sparse_states()
    first = save(store, 1, next(states))
    table = next(states)
    second = save(store, 2, table)
    other = save(store, 1, table, run="other")
    assert shard(store, other).bases == shard(store, second).bases
    store.delete(first)
    store.delete(second)
    store.gc(grace=0)
    np.testing.assert_array_equal(store.open_version(other).get("emb"), table)
    assert store.verify().ok


def test_the_crash_tests_state_saves_a_delta(tmp_path: Path) -> None:
    """The crash tests kill delta saves too: their state has a sparse-updated table."""
    from tests.crash_child import save as crash_save

    with chunkstore.open(tmp_path / "c", chunk_size=64 * 1024, delta_depth=2,
                         create=True) as crash_store:
        crash_save(crash_store, 1)
        info = crash_save(crash_store, 2)
        entry = crash_store.open_version(info.id).entry("model.embed")
        assert isinstance(entry, TensorEntry) and any(entry.shards[0].bases)


def test_report_counts_deltas_and_their_mean_chain_depth(store: chunkstore.Store) -> None:
    _chunk0_changing(store, 3)  # chunk 0: standalone, then depth 1, then depth 2
    stats = store.stats()
    assert stats.delta_chunks == 2
    assert (stats.mean_chain_depth, stats.max_chain_depth) == (1.5, 2)
    totals = stats.to_json()["totals"]
    assert (totals["delta_chunks"], totals["mean_chain_depth"],
            totals["max_chain_depth"]) == (2, 1.5, 2)


def test_init_sets_the_delta_depth(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from chunkstore.cli import cli

    done = CliRunner().invoke(cli, ["init", str(tmp_path / "s"), "--delta-depth", "5"])
    assert done.exit_code == 0, done.output
    assert "delta depth 5" in done.output
    with chunkstore.open(tmp_path / "s", create=False) as opened:
        assert opened.config.delta_depth == 5


@pytest.mark.delta_objects
def test_a_save_never_encodes_against_a_base_gc_has_condemned(
        store: chunkstore.Store) -> None:
    """The base is claimed like a dedup target: one a GC has condemned (and is about
    to delete) is not used; the chunk is stored standalone."""
    (first,) = _chunk0_changing(store, 1)
    base = shard(store, first).chunks[0]
    writer = store.new_version(run="r", step=1)  # takes the first version as its parent
    store.delete(first)
    assert store.index.condemn(CHUNK_KIND, [base], time.time() + 3600) == [base]
    table = np.random.default_rng(5).standard_normal((ROWS, DIM)).astype(np.float32)
    table[0, 0] += 1
    table[0, 1] += 1
    writer.put("emb", table)
    info = writer.commit()
    object_path(store, base).unlink()  # the condemning GC deletes it
    store.base_cache.clear()
    assert not shard(store, info.id).chain(0)
    np.testing.assert_array_equal(store.open_version(info.id).get("emb"), table)


BIG_CHUNK = 512 * 1024  # over four probes: a delta is judged on a probe first


@pytest.mark.delta_objects
def test_the_base_prefix_is_the_prefix_of_the_decoded_base(tmp_path: Path) -> None:
    """A delta is judged against the base's first bytes before the base is read whole;
    those bytes are the decoded base's, through chains of every depth."""
    rng = np.random.default_rng(2)
    table = rng.standard_normal(2 * BIG_CHUNK // 4).astype(np.float32)
    n = probe_length(BIG_CHUNK, 4)
    assert 0 < n < BIG_CHUNK
    with chunkstore.open(tmp_path / "s", chunk_size=BIG_CHUNK, delta_depth=DEPTH,
                         create=True) as store:
        depths = set()
        for step in range(DEPTH + 1):
            table.reshape(-1, 64)[rng.integers(0, table.size // 64, 20)] += np.float32(1)
            current = shard(store, save(store, step, table))
            for i, digest in enumerate(current.chunks):
                chain = current.chain(i)
                depths.add(len(chain))
                prefix = base_prefix(store, digest, chain, n, BIG_CHUNK)
                assert prefix == bytes(base_bytes(store, digest, chain, BIG_CHUNK))[:n]
        assert depths == set(range(DEPTH + 1))


@pytest.mark.delta_objects
def test_large_chunks_take_deltas_only_where_they_pay(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    sparse = rng.standard_normal(BIG_CHUNK // 4).astype(np.float32)
    dense = rng.standard_normal(BIG_CHUNK // 4).astype(np.float32)
    with chunkstore.open(tmp_path / "s", chunk_size=BIG_CHUNK, delta_depth=DEPTH,
                         create=True) as store:
        for step in range(3):
            sparse[rng.integers(0, sparse.size, 30)] += np.float32(1)
            dense = rng.standard_normal(dense.size).astype(np.float32)  # nothing in common
            with store.new_version(run="r", step=step) as version:
                version.put("sparse", sparse)
                version.put("dense", dense)
            reader = store.open_version(version.info.id)
            np.testing.assert_array_equal(reader.get("sparse"), sparse)
            np.testing.assert_array_equal(reader.get("dense"), dense)
        entries = store.open_version("r@2").entries()
        (sparse_digest,), (dense_digest,) = (entries["sparse"].shards[0].chunks,
                                             entries["dense"].shards[0].chunks)
        assert header_base(store, sparse_digest) is not None
        assert header_base(store, dense_digest) is None
        assert store.verify().ok


def test_a_save_takes_the_runs_latest_version_as_its_parent_whatever_this_handle_saved_last(
        store: chunkstore.Store) -> None:
    """The parent a handle remembers from its own last save is used only while it is
    still the run's latest version (a save of a lower step, a removal)."""
    states = sparse_states()
    tables: dict[str, np.ndarray] = {}
    for step, remove in [(10, False), (20, False), (15, False), (30, False), (40, True),
                         (50, False)]:
        latest = store.latest("r")
        version_id = save(store, step, table := next(states))
        tables[version_id] = table
        if latest is not None and step > latest.step:
            parent, current = shard(store, latest.id), shard(store, version_id)
            # Each chunk written by this save is a delta against the parent's chunk.
            bases = {current.chain(i)[0] for i, d in enumerate(current.chunks)
                     if d not in parent.chunks and current.chain(i)}
            assert bases, "a sparse update must be saved as deltas"
            assert bases <= set(parent.chunks), step
        if remove:
            store.delete(version_id)
            del tables[version_id]
    store.gc(grace=0)
    for version_id, table in tables.items():
        np.testing.assert_array_equal(store.open_version(version_id).get("emb"), table)
    assert store.verify().ok


def test_a_position_whose_delta_did_not_pay_is_stored_standalone_for_a_few_saves(
        store: chunkstore.Store) -> None:
    rng = np.random.default_rng(4)
    table = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    save(store, 0, table)
    table = rng.standard_normal((ROWS, DIM)).astype(np.float32)  # nothing in common
    kinds = []
    for step in range(1, SKIP_SAVES + 4):
        version_id = save(store, step, table)
        kinds.append(bool(shard(store, version_id).bases))
        table = table.copy()
        table[:, 0] += np.float32(1)  # a change in every chunk that a delta stores well
    # Save 1 tried and lost; the next SKIP_SAVES do not try; then deltas again.
    assert kinds == [False] * (SKIP_SAVES + 1) + [True, True], kinds
    for version in store.versions("r"):
        store.open_version(version.id).get("emb")
    assert store.verify().ok


@pytest.mark.delta_objects
@pytest.mark.parametrize("dtype", ["int8", "uint16", "float16", "bfloat16", "float32", "int32",
                                   "float64", "int64", "complex64", "complex128"])
def test_every_element_size_takes_deltas_that_read_back_exact(tmp_path: Path,
                                                                dtype: str) -> None:
    """Sub-delta for element sizes 1, 2, 4 and 8 where most elements changed, and
    sparse-delta where a few did (small steps of either sign, and steps that wrap around
    the integer); xor-delta for 16-byte complex128."""
    rng = np.random.default_rng(7)
    wanted = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    raw = rng.integers(0, 256, 3 * CHUNK, dtype=np.uint8)
    expected = ({SUB_DELTA.id, SPARSE_DELTA.id} if wanted.itemsize <= 8
                else {XOR_DELTA.id})
    with chunkstore.open(tmp_path / "s", chunk_size=CHUNK, delta_depth=DEPTH, create=True) as store:
        kept = {}
        for step in range(DEPTH + 2):
            lanes = raw.view(f"<u{min(wanted.itemsize, 8)}")
            if step == 2:  # every element: a dense update
                lanes[::2] += np.array(1, lanes.dtype)
                lanes[1::2] -= np.array(1, lanes.dtype)
            lanes[rng.integers(0, lanes.size, 8)] += np.array(1, lanes.dtype)  # carries
            lanes[rng.integers(0, lanes.size, 8)] -= np.array(1, lanes.dtype)  # borrows
            np.subtract(lanes[:1], lanes[:1] + np.array(1, lanes.dtype), out=lanes[:1])  # wraps
            table = raw.view(wanted).copy()
            kept[save(store, step, table)] = table
        codecs_seen = {parse_header(d, object_path(store, d).read_bytes()).codec_id
                       for vid in kept for d in shard(store, vid).chunks}
        assert expected <= codecs_seen
        store.gc(grace=0)
        for version_id, table in kept.items():
            assert store.open_version(version_id).get("emb").tobytes() == table.tobytes()
        assert store.verify().ok


@pytest.mark.delta_objects
def test_a_sub_delta_on_an_xor_delta_chain_reads_back(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A store an older release wrote xor-delta chains into, extended by this release's
    sub-deltas: the mixed chain decodes link by link, verifies, and its base prefix is the
    decoded base's."""
    from chunkstore.write import delta

    table = np.random.default_rng(5).standard_normal((ROWS, DIM)).astype(np.float32)
    with chunkstore.open(tmp_path / "s", chunk_size=CHUNK, delta_depth=DEPTH, create=True) as store:
        ids, tables = [], []
        for step in range(DEPTH + 1):
            if step < 2:  # the older release: xor-delta for every element size
                monkeypatch.setattr(delta, "delta_codec", lambda itemsize: XOR_DELTA)
            else:
                monkeypatch.undo()
            table.reshape(-1)[step::CHUNK // 4] += np.float32(0.25)  # one element per chunk
            tables.append(table.copy())
            ids.append(save(store, step, tables[-1]))
        newest = shard(store, ids[-1])
        mixed = [i for i in range(len(newest.chunks)) if len(newest.chain(i)) == DEPTH]
        assert mixed, "the test must build a chain xor -> sub"
        for i in mixed:
            links = [newest.chunks[i], *newest.chain(i)[:-1]]
            kinds = [parse_header(d, object_path(store, d).read_bytes()).codec_id for d in links]
            # One element per chunk changed: sparse-delta on the older release's xor-delta.
            assert kinds == [SPARSE_DELTA.id, SPARSE_DELTA.id, XOR_DELTA.id]
            base, chain = newest.chain(i)[0], newest.chain(i)[1:]
            n = 1024
            assert base_prefix(store, base, chain, n, CHUNK) == bytes(
                base_bytes(store, base, chain, CHUNK))[:n]
        store.base_cache.clear()
        for version_id, table in zip(ids, tables, strict=True):
            np.testing.assert_array_equal(store.open_version(version_id).get("emb"), table)
        assert store.verify().ok


@pytest.mark.parametrize("depth", [2, 4])
def test_a_chain_is_read_one_object_per_link(tmp_path: Path, depth: int) -> None:
    """A chunk at chain depth d reads d+1 objects (its own head by range, then d whole
    objects), not a chain per link."""
    chunk = 256 * 1024
    table = np.random.default_rng(1).standard_normal(chunk // 4).astype(np.float32)
    with chunkstore.open(tmp_path / "s", chunk_size=chunk, delta_depth=depth, create=True) as store:
        for step in range(depth + 1):
            table[step::97] += np.float32(0.001)
            version_id = save(store, step, table.copy())
        assert len(shard(store, version_id).chain(0)) == depth
        store.base_cache.clear()
        gets: list[str] = []
        original = store.backend.get

        def counting_get(key: str) -> bytes:
            gets.append(key)
            return original(key)

        store.backend.get = counting_get  # type: ignore[method-assign]
        np.testing.assert_array_equal(store.open_version(version_id).get("emb"), table)
        chunk_gets = [k for k in gets if k.startswith("chunks/")]
        assert len(chunk_gets) <= depth and len(set(chunk_gets)) == len(chunk_gets), chunk_gets


def test_a_delta_codec_without_the_base_flag_is_refused() -> None:
    """From chunk version 2 the BASE flag is set exactly for delta codecs, sub-delta too."""
    raw = bytes(16)
    for codec_id in (3, 5):
        head = (b"CSCK" + bytes([4, codec_id, 4, 0]) + (16).to_bytes(8, "little")
                + (16).to_bytes(8, "little"))
        with pytest.raises(CorruptChunkError, match="BASE flag"):
            parse_header(Digest.of(raw), head + raw)


def test_a_position_whose_delta_paid_is_judged_against_the_ratio_measured_then(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A delta that paid is judged by the next RATIO_USES saves against the standalone
    bytes per byte measured then, encoding only the delta; a save that stores the
    position standalone because its chain is full passes that on; then it is judged
    anew, both ways.  Every version reads back exact."""
    from chunkstore.write import delta
    from chunkstore.write.delta import RATIO_USES

    assert RATIO_USES == 4  # the expected counts below follow it
    judged: list[int] = []
    real = delta.encode_with_policy

    def counting(*args: object) -> object:
        judged[-1] += 1
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(delta, "encode_with_policy", counting)
    table = np.random.default_rng(5).standard_normal((ROWS, DIM)).astype(np.float32)
    chunks = table.nbytes // CHUNK
    kept = {}
    with chunkstore.open(tmp_path / "s", chunk_size=CHUNK, delta_depth=2, create=True) as store:
        for step in range(9):
            table.reshape(-1)[step :: CHUNK // 4] += np.float32(0.25)  # every chunk changes
            judged.append(0)
            kept[save(store, step, table.copy())] = table.copy()
        depths = [len(shard(store, v).chain(0)) for v in kept]
        for version_id, expected in kept.items():
            np.testing.assert_array_equal(store.open_version(version_id).get("emb"), expected)
        assert store.verify().ok
    assert depths == [0, 1, 2, 0, 1, 2, 0, 1, 2]
    # measured at 1; its ratio serves 2, 4, 5 and 7 (3 and 6 are full chains: carried)
    assert judged == [0, chunks, 0, 0, 0, 0, 0, 0, chunks]
