"""Packed delta chunks (chunk format 5, node format 5, store format 8): in a store with
delta chains the chunks of larger tensors are packed, deltas included, and a delta's
bases may lie in packs.  What tests/test_delta.py checks on delta objects, checked
here on packed ones: the manifest lists where every base lies, GC keeps a base's pack
while a live delta needs it (through repacks too), a damaged or missing base pack is
reported on every version that depends on it, a save never encodes against a base
whose pack GC condemned, older formats are refused what they do not have, and a base
listed longer than its chunk can be is refused before it is read."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import chunkstore
from chunkstore.codecs import SPARSE_DELTA, SUB_DELTA
from chunkstore.codecs.shuffle import plane_table
from chunkstore.errors import CorruptChunkError, CorruptNodeError
from chunkstore.format.chunkobj import CHUNK_FORMAT_VERSION, HEADER, parse_header
from chunkstore.format.digest import Digest
from chunkstore.format.manifest import (
    NODE_FORMAT_VERSION,
    PackLocation,
    Shard,
    TensorEntry,
    TreeNode,
    canonical_json,
    decode_tree,
    encode_tree,
    tensor_text,
)
from chunkstore.index.lmdbindex import CHUNK as CHUNK_KIND
from chunkstore.index.lmdbindex import ChunkRecord, ChunkState
from chunkstore.objects.kinds import CHUNKS
from chunkstore.read.chain import NO_CACHE, base_bytes, decode_chain
from chunkstore.write.delta import CHAIN_BYTES, chain_bytes
from tests.test_delta import CHUNK, DIM, ROWS, save, shard, sparse_states

# Every test here runs with reads as they come and with every ranged read mapped.
pytestmark = pytest.mark.usefixtures("read_mode")

DEPTH = 3


@pytest.fixture
def store(tmp_path: Path) -> Iterator[chunkstore.Store]:
    with chunkstore.open(tmp_path / "s", chunk_size=CHUNK, delta_depth=DEPTH,
                         create=True) as opened:
        assert opened.pack_delta_chunks  # the default
        yield opened


def chunk0_changing(store: chunkstore.Store, versions: int) -> list[str]:
    """Versions in which only chunk 0 of ``emb`` changes (one element per version)."""
    table = np.random.default_rng(5).standard_normal((ROWS, DIM)).astype(np.float32)
    ids = []
    for step in range(versions):
        table[0, step] += 1
        ids.append(save(store, step, table.copy()))
    return ids


def pack_path(store: chunkstore.Store, pack: Digest) -> Path:
    return Path(store.url) / CHUNKS.key(pack)


def flip_last_byte_then_read(store: chunkstore.Store, at: PackLocation | None,
                             version: str) -> None:
    """Flip the last byte of the member at ``at``: reading ``emb`` of ``version`` is then
    a CorruptChunkError (the hash check), whatever the read path."""
    assert at is not None
    path = pack_path(store, at.pack)
    data = bytearray(path.read_bytes())
    data[HEADER.size + at.offset + at.length - 1] ^= 0xFF
    path.write_bytes(bytes(data))
    store.base_cache.clear()
    with pytest.raises(CorruptChunkError):
        store.open_version(version).get("emb")


def ranged_reads(store: chunkstore.Store, monkeypatch: pytest.MonkeyPatch
                 ) -> list[tuple[str, int]]:
    """From now on, every ranged read of the store's backend, copied or mapped:
    (key, length)."""
    reads: list[tuple[str, int]] = []
    backend = store.backend
    real_get_range, real_view_range = backend.get_range, backend.view_range

    def get_range(key: str, start: int, length: int) -> bytes:
        reads.append((key, length))
        return real_get_range(key, start, length)

    def view_range(key: str, start: int, length: int, *, populate: bool = True
                   ) -> bytes | memoryview:
        reads.append((key, length))
        return real_view_range(key, start, length, populate=populate)

    monkeypatch.setattr(backend, "get_range", get_range)
    monkeypatch.setattr(backend, "view_range", view_range)
    return reads


def problems(store: chunkstore.Store) -> set[str | None]:
    return {problem.version for problem in store.verify().problems}


def test_deltas_and_their_bases_are_packed_and_listed_with_their_locations(
        store: chunkstore.Store) -> None:
    ids = chunk0_changing(store, DEPTH + 2)
    for version_id, depth in zip(ids, [0, 1, 2, 3, 0], strict=True):
        listed = shard(store, version_id)
        assert all(listed.packs), "every chunk of the tensor is packed"
        assert len(listed.chain(0)) == depth
        locations = listed.chain_locations(0)
        assert len(locations) == depth and all(locations), "every base lies in a pack"
        # Each base is listed where the version that wrote it lists it.
        for base, at in zip(listed.chain(0), locations, strict=True):
            owner = next(shard(store, v) for v in ids if shard(store, v).chunks[0] == base)
            assert owner.location(0) == at
        # The member named is a delta against the first listed base (its header says so).
        location = listed.location(0)
        assert location is not None
        member = pack_path(store, location.pack).read_bytes()[
            HEADER.size + location.offset : HEADER.size + location.offset + location.length]
        assert (member[4], member[7] & 1) == (CHUNK_FORMAT_VERSION, 1 if depth else 0)
        if depth:
            assert member[HEADER.size : HEADER.size + 32] == listed.chain(0)[0].raw
    for version_id, step in zip(ids, range(len(ids)), strict=True):
        expected = np.random.default_rng(5).standard_normal((ROWS, DIM)).astype(np.float32)
        expected[0, : step + 1] += 1
        np.testing.assert_array_equal(store.open_version(version_id).get("emb"), expected)
    assert store.verify().ok
    # A delta save of a dense change writes one pack, not an object per chunk.
    assert store.versions()[-1].new_stored_bytes > 0


def test_chains_round_trip_with_middle_versions_removed_and_gc_between(
        store: chunkstore.Store) -> None:
    states = sparse_states()
    saved: dict[str, np.ndarray] = {}
    for step in range(12):
        table = next(states)
        saved[save(store, step, table)] = table
        if step % 3 == 2:  # remove a version from the middle of the chains, then collect
            victim = list(saved)[len(saved) // 2]
            store.delete(victim)
            del saved[victim]
            store.gc(grace=0)
        for version_id, expected in saved.items():
            np.testing.assert_array_equal(store.open_version(version_id).get("emb"), expected)
    assert any(any(shard(store, v).base_packs) for v in saved), "no packed base was listed"
    assert store.verify().ok


def test_a_base_pack_a_live_delta_needs_survives_gc_and_goes_when_unneeded(
        store: chunkstore.Store) -> None:
    first, second = chunk0_changing(store, 2)
    (at,) = shard(store, second).chain_locations(0)
    assert at is not None and at == shard(store, first).location(0)
    store.delete(first)
    store.gc(grace=0)
    assert pack_path(store, at.pack).exists(), "GC deleted the pack of a base a live delta needs"
    table = store.open_version(second).get("emb")
    assert store.verify().ok
    store.delete(second)
    store.gc(grace=0)
    assert not pack_path(store, at.pack).exists()
    assert not [p for p in (Path(store.url) / "chunks").rglob("*") if p.is_file()]
    assert table.shape == (ROWS, DIM)


def test_a_pack_only_bases_need_is_kept_by_gc_and_counted_by_the_index(
        store: chunkstore.Store) -> None:
    """Every chunk changes a little: the second version lists the first one's pack only
    as the pack of its bases, and that alone keeps it (GC's mark, index rebuild)."""
    table = np.random.default_rng(5).standard_normal((ROWS, DIM)).astype(np.float32)
    first = save(store, 0, table.copy())
    table[:: ROWS // 4, 0] += 1  # one element in each chunk
    second = save(store, 1, table.copy())
    packs_of_first = {at.pack for at in shard(store, first).packs if at is not None}
    listed = shard(store, second)
    assert all(listed.bases) and packs_of_first.isdisjoint(
        at.pack for at in listed.packs if at is not None)
    assert {at.pack for chain in listed.base_packs for at in chain if at} == packs_of_first
    store.delete(first)
    store.rebuild_index()
    assert all(store.index.chunk(pack).refcount == 1 for pack in packs_of_first)
    store.gc(grace=0)
    assert all(pack_path(store, pack).exists() for pack in packs_of_first)
    # An index that counts no reference to them (another machine's, or a damaged one):
    # GC's mark of the live manifests keeps them all the same, and says so.
    for pack in packs_of_first:
        record = store.index.chunk(pack)
        assert record is not None
        store.index.put_chunk_record(pack, ChunkRecord(ChunkState.LIVE, record.codec_id, 0,
                                                       record.raw_length,
                                                       record.stored_length, 0.0))
    result = store.gc(grace=0)
    assert all(pack_path(store, pack).exists() for pack in packs_of_first)
    assert all(any(pack.short(16) in note for note in result.index_disagreements)
               for pack in packs_of_first)
    store.rebuild_index()
    store.base_cache.clear()
    np.testing.assert_array_equal(store.open_version(second).get("emb"), table)
    assert store.verify().ok


def test_a_flipped_byte_in_a_packed_base_is_reported_on_every_dependent_version(
        store: chunkstore.Store) -> None:
    ids = chunk0_changing(store, 3)
    location = shard(store, ids[0]).location(0)  # the root of the chain of ids[2]
    assert location is not None
    assert shard(store, ids[2]).chain_locations(0)[-1] == location
    path = pack_path(store, location.pack)
    data = bytearray(path.read_bytes())
    data[HEADER.size + location.offset + location.length - 1] ^= 0xFF
    path.write_bytes(bytes(data))
    store.base_cache.clear()
    assert problems(store) == set(ids)
    for version_id in ids:
        with pytest.raises(CorruptChunkError):
            store.open_version(version_id).get("emb")


def test_a_deleted_base_pack_is_reported_on_every_dependent_version(
        store: chunkstore.Store) -> None:
    ids = chunk0_changing(store, 3)
    middle = shard(store, ids[1]).location(0)
    assert middle is not None
    pack_path(store, middle.pack).unlink()
    store.base_cache.clear()
    assert problems(store) == set(ids[1:])
    assert store.verify(read_data=False).problems  # found without reading data too
    np.testing.assert_array_equal(store.open_version(ids[0]).get("emb").shape, (ROWS, DIM))


def test_a_packed_base_listed_longer_than_its_chunk_is_refused_before_it_is_read(
        store: chunkstore.Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """A crafted manifest that lists a base at the length of a whole pack would make a
    reader fetch and allocate all of it: the listed length is bounded by the raw
    length the base must have, as a packed chunk's own is, before anything is read."""
    _, second = chunk0_changing(store, 2)
    listed = shard(store, second)
    (base,), (at,), location = listed.chain(0), listed.chain_locations(0), listed.location(0)
    assert at is not None and location is not None
    member = pack_path(store, location.pack).read_bytes()[
        HEADER.size + location.offset : HEADER.size + location.offset + location.length]
    too_long = PackLocation(at.pack, at.offset, 200 * 1024 * 1024)
    ranges = ranged_reads(store, monkeypatch)
    store.base_cache.clear()
    with pytest.raises(CorruptChunkError, match="too long"):
        base_bytes(store, base, (), listed.chunk_bytes, location=too_long)
    with pytest.raises(CorruptChunkError, match="too long"):  # a restore's path
        decode_chain(store, listed.chunks[0], member, (base,),
                     memoryview(bytearray(listed.chunk_bytes)), NO_CACHE, locations=(too_long,))
    assert ranges == []
    # A base whose header claims another length than its chunk's is refused before its
    # own bases (bounded by that claim) are read.
    with pytest.raises(CorruptChunkError, match="a delta base of"):
        base_bytes(store, base, (), listed.chunk_bytes // 2, location=at)
    assert [length for _, length in ranges] == [at.length]
    ranges.clear()
    # Listed at its true length, the same base reads (the bound refuses only the lie).
    decode_chain(store, listed.chunks[0], member, (base,),
                 memoryview(bytearray(listed.chunk_bytes)), NO_CACHE, locations=(at,))
    assert [length for _, length in ranges] == [at.length]


def test_a_restore_reads_the_packed_bases_of_neighbouring_chunks_together(
        store: chunkstore.Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every chunk of the table changes: the newest version's chunks are deltas at depth
    2 whose bases lie side by side in two older packs.  A restore reads the members with
    one ranged read and each base pack's run with one more, not a read per base per
    chunk (on an object store, a request each); a damaged base is still found."""
    table = np.random.default_rng(5).standard_normal((ROWS, DIM)).astype(np.float32)
    ids = []
    for step in range(3):
        table[:: ROWS // 4, step] += 1  # one element in each chunk
        ids.append(save(store, step, table.copy()))
    listed = shard(store, ids[-1])
    assert all(len(listed.chain(i)) == 2 for i in range(len(listed.chunks)))
    base_packs = {at.pack for i in range(len(listed.chunks))
                  for at in listed.chain_locations(i) if at is not None}
    assert len(base_packs) == 2 and len(listed.chunks) == 4
    reads = ranged_reads(store, monkeypatch)
    store.base_cache.clear()
    np.testing.assert_array_equal(store.open_version(ids[-1]).get("emb"), table)
    assert len(reads) == 1 + len(base_packs), reads  # 1 + 2 x 4 without reading ahead
    # Past the read-ahead budget, bases are read one by one when they are used.
    from chunkstore.read import packs
    monkeypatch.setattr(packs, "PREFETCH_BYTES", 0)
    reads.clear()
    np.testing.assert_array_equal(store.open_version(ids[-1]).get("emb"), table)
    assert len(reads) == 1 + 2 * len(listed.chunks), reads
    monkeypatch.undo()
    # A flipped byte in a prefetched base is caught by the hash check, as before.
    flip_last_byte_then_read(store, listed.chain_locations(0)[0], ids[-1])


def test_a_delta_member_of_an_older_chunk_format_is_refused(store: chunkstore.Store) -> None:
    first, second = chunk0_changing(store, 2)
    location = shard(store, second).location(0)
    assert location is not None
    path = pack_path(store, location.pack)
    data = bytearray(path.read_bytes())
    assert data[HEADER.size + location.offset + 4] == CHUNK_FORMAT_VERSION
    data[HEADER.size + location.offset + 4] = 4  # chunk format 4: no delta members
    data[HEADER.size + location.offset + 5] = SUB_DELTA.id  # a codec chunk format 4 knows
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptChunkError, match="never a delta"):
        store.open_version(second).get("emb")
    assert problems(store) == {second}
    store.open_version(first).get("emb")


def test_a_save_never_encodes_against_a_base_whose_pack_gc_has_condemned(
        store: chunkstore.Store) -> None:
    (first,) = chunk0_changing(store, 1)
    location = shard(store, first).location(0)
    assert location is not None
    writer = store.new_version(run="r", step=1)  # takes the first version as its parent
    store.delete(first)
    assert store.index.condemn(CHUNK_KIND, [location.pack], time.time() + 3600) == [
        location.pack]
    table = np.random.default_rng(5).standard_normal((ROWS, DIM)).astype(np.float32)
    table[0, 0] += 1
    table[0, 1] += 1
    writer.put("emb", table)
    info = writer.commit()
    pack_path(store, location.pack).unlink()  # the condemning GC deletes it
    store.base_cache.clear()
    listed = shard(store, info.id)
    assert not any(listed.bases) and all(at is None or at.pack != location.pack
                                         for at in listed.packs)
    np.testing.assert_array_equal(store.open_version(info.id).get("emb"), table)


def test_a_repacked_base_is_read_through_its_moved_record(store: chunkstore.Store) -> None:
    """The first version's pack is mostly a tensor the next save replaces: GC repacks the
    bases the second version's deltas need into a new pack, and they are read there."""
    rng = np.random.default_rng(9)
    table = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    ids = []
    for step in range(2):
        table[0, step] += 1
        with store.new_version(run="r", step=step) as version:
            version.put("emb", table.copy())
            version.put("noise", rng.integers(0, 2**31, 12 * CHUNK // 4, dtype=np.int32))
        ids.append(version.info.id)
    (at,) = shard(store, ids[1]).chain_locations(0)
    assert at is not None
    store.delete(ids[0])
    result = store.gc(grace=0)
    assert result.packs_repacked >= 1
    store.gc(grace=0)  # the old pack goes once no save can still reuse it
    assert not pack_path(store, at.pack).exists()
    assert store.backend.exists(f"moved/{at.pack.hex}")
    store.base_cache.clear()
    np.testing.assert_array_equal(store.open_version(ids[1]).get("emb"), table)
    assert store.verify().ok


def _alter_moved_delta_member(store: chunkstore.Store, at: PackLocation, base: Digest) -> None:
    """Flip a bit of a raw plane of the moved copy of the delta member at ``at``: the
    copy still parses and decodes, but holds other bytes."""
    record = json.loads(store.backend.get(f"moved/{at.pack.hex}"))
    new_offset = next(new for old, length, new in record["members"]
                      if (old, length) == (at.offset, at.length))
    path = pack_path(store, Digest.parse(record["to"]))
    data = bytearray(path.read_bytes())
    start = HEADER.size + new_offset
    member = bytes(data[start : start + at.length])
    header = parse_header(base, member)
    assert header.base is not None, "the moved member must be a delta"
    raw_planes = [offset for mode, offset, _ in plane_table(
        memoryview(member)[header.size :], header.raw_length, header.element_size, 1)
        if mode == 0]
    assert raw_planes, "the test needs a plane stored raw (it stays decodable when altered)"
    data[start + header.size + raw_planes[0]] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_moved_delta_member_that_differs_from_its_original_never_costs_the_pack(
        store: chunkstore.Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """A delta member cannot be hash-checked without its bases, so a moved copy that
    decodes but holds other bytes (a damaged or crafted copy, a stale record) would
    pass a structural check: GC compares it byte for byte with the member in the pack
    it is about to delete, and keeps that pack when they differ."""
    import chunkstore.maintenance.gc as gc_module

    rng = np.random.default_rng(11)
    table = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    ids = []
    for step in range(3):  # every element moves a little: every chunk is a delta
        table *= np.float32(1) + rng.standard_normal(table.shape).astype(np.float32) * 1e-4
        with store.new_version(run="r", step=step) as version:
            version.put("emb", table.copy())
            version.put("noise", rng.integers(0, 2**31, 12 * CHUNK // 4, dtype=np.int32))
        ids.append(version.info.id)
    listed = shard(store, ids[2])
    assert all(len(listed.chain(i)) == 2 for i in range(len(listed.chunks)))
    at = listed.chain_locations(0)[0]  # chunk 0 of ids[1]: a delta, then a base
    assert at is not None
    real_repack = gc_module.repack

    def repack_then_alter(*args: object, **kwargs: object) -> object:
        done = real_repack(*args, **kwargs)  # type: ignore[arg-type]
        _alter_moved_delta_member(store, at, listed.chain(0)[0])
        return done

    monkeypatch.setattr(gc_module, "repack", repack_then_alter)
    store.delete(ids[1])  # its pack is now mostly noise nobody needs: repacked
    result = store.gc(grace=0)
    monkeypatch.undo()
    assert result.packs_repacked >= 1
    assert pack_path(store, at.pack).exists(), "GC deleted a pack whose moved copy is altered"
    assert any(at.pack.short() in note and "differs" in note for note in result.repack_skipped)
    store.base_cache.clear()
    np.testing.assert_array_equal(store.open_version(ids[2]).get("emb"), table)


def _packed_delta_shard() -> tuple[Shard, Digest, Digest, Digest]:
    chunk, base, pack, base_pack = (Digest(bytes([i]) * 32) for i in (1, 2, 3, 4))
    listed = Shard((0,), (4096,), 4096, (chunk,), ((base,),), (PackLocation(pack, 0, 100),),
                   ((PackLocation(base_pack, 100, 90),),))
    return listed, chunk, pack, base_pack


def test_a_packed_delta_shard_encodes_canonically_and_needs_both_packs() -> None:
    listed, chunk, pack, base_pack = _packed_delta_shard()
    entry = TensorEntry("uint8", (4096,), (listed,))
    body = listed.to_json()
    assert list(body) == ["offsets", "sizes", "chunk_bytes", "chunks", "bases", "base_packs",
                          "packs"]
    assert body["base_packs"] == [[[base_pack.hex, 100, 90]]]
    assert tensor_text(entry) == canonical_json(entry.to_json())
    assert canonical_json(entry.to_json()).index('"base_packs"') < canonical_json(
        entry.to_json()).index('"bases"')
    assert list(entry.chunk_digests()) == [pack, base_pack]
    assert list(listed.members()) == [(PackLocation(pack, 0, 100), chunk),
                                      (PackLocation(base_pack, 100, 90), listed.chain(0)[0])]
    digest, data = encode_tree(TreeNode(leaves={"t": entry}))
    assert decode_tree(digest, data).leaves["t"] == entry


@pytest.mark.parametrize("edit", ["version-4", "version-4-packed-delta", "short",
                                  "without-bases", "own-pack"])
def test_a_node_with_base_locations_it_may_not_have_is_refused(edit: str) -> None:
    listed, chunk, _, base_pack = _packed_delta_shard()
    _, data = encode_tree(TreeNode(leaves={"t": TensorEntry("uint8", (4096,), (listed,))}))
    text = data.decode()
    current = f'"format_version":{NODE_FORMAT_VERSION}'
    if edit == "version-4":
        text = text.replace(current, '"format_version":4')
    elif edit == "version-4-packed-delta":  # no base_packs, but a packed chunk with a chain
        text = text.replace(f'"base_packs":[[["{base_pack.hex}",100,90]]],', "").replace(
            current, '"format_version":4')
    elif edit == "short":
        text = text.replace(f'[[["{base_pack.hex}",100,90]]]', "[[]]")
    elif edit == "without-bases":
        text = text.replace(f'"bases":[["{listed.chain(0)[0].hex}"]],', "")
    else:  # the chunk's own digest as its base's pack
        text = text.replace(f'[[["{base_pack.hex}"', f'[[["{chunk.hex}"')
    raw = text.encode()
    with pytest.raises(CorruptNodeError):
        decode_tree(Digest.of(raw), raw)


def test_incompressible_chunks_packed_from_the_handles_copies_read_back_exact(
        store: chunkstore.Store) -> None:
    """A raw member's payload is the chunk itself; taken from a base copy whose buffer
    goes on to serve another chunk, it must be packed as it was, not as the buffer is
    when the pack is joined."""
    rng = np.random.default_rng(3)
    saved = {}
    for step in range(4):
        noise = rng.integers(0, 2**31, 24 * CHUNK // 4, dtype=np.int32)
        with store.new_version(run="r", step=step) as version:
            version.put("noise", noise)
        saved[version.info.id] = noise
        assert all(shard_of(store, version.info.id, "noise").packs)
    for version_id, noise in saved.items():
        np.testing.assert_array_equal(store.open_version(version_id).get("noise"), noise)
    assert store.verify().ok


def shard_of(store: chunkstore.Store, version_id: str, name: str) -> Shard:
    entry = store.open_version(version_id).entry(name)
    assert isinstance(entry, TensorEntry)
    (only,) = entry.shards
    return only


def _only_shard(store: chunkstore.Store, version_id: str, name: str) -> Shard:
    entry = store.open_version(version_id).entry(name)
    assert isinstance(entry, TensorEntry)
    (only,) = entry.shards
    return only


def _chain_codecs(store: chunkstore.Store, listed: Shard, i: int) -> list[int]:
    """The codec of chunk ``i``'s member and of each base of its chain, nearest first."""
    codecs_ = []
    for at in (listed.location(i), *listed.chain_locations(i)):
        assert at is not None
        data = pack_path(store, at.pack).read_bytes()
        codecs_.append(data[HEADER.size + at.offset + 5])
    return codecs_


def test_chains_are_bounded_by_their_bytes_not_only_by_their_depth(tmp_path: Path) -> None:
    """Under a delta_depth of 16, sparse updates (a few rows: sparse-delta links of a few
    hundred bytes) build chains past the old fixed depth of 2, while dense updates (every
    element: sub-delta links of most of a chunk) start over once the chain's stored bytes
    pass CHAIN_BYTES x the chunk's raw bytes; every version reads back exact."""
    with chunkstore.open(tmp_path / "s", chunk_size=CHUNK, delta_depth=16,
                         create=True) as store:
        rng = np.random.default_rng(3)
        sparse_table = rng.standard_normal((ROWS, DIM)).astype(np.float32)
        dense_table = rng.standard_normal((ROWS, DIM)).astype(np.float32)
        kept: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for step in range(12):
            sparse_table[rng.integers(0, ROWS, 2)] += np.float32(0.5)
            dense_table *= np.float32(1.0001)  # every element moves a little
            with store.new_version(run="r", step=step) as version:
                version.put("sparse", sparse_table)
                version.put("dense", dense_table)
            kept[version.info.id] = (sparse_table.copy(), dense_table.copy())
        flat = {name: _only_shard(store, version.info.id, name) for name in ("sparse", "dense")}
        sparse_depths = [len(flat["sparse"].chain(i)) for i in range(len(flat["sparse"].chunks))]
        dense_depths = {len(flat["dense"].chain(i)) for i in range(len(flat["dense"].chunks))}
        assert max(sparse_depths) > 2, sparse_depths
        assert SPARSE_DELTA.id in _chain_codecs(store, flat["sparse"], 0)
        assert 0 < max(dense_depths) <= 3, dense_depths
        for vid in kept:
            listed = _only_shard(store, vid, "dense")
            for i in range(len(listed.chunks)):
                if listed.chain(i):  # the base's chain was within the bound when used
                    raw = min(listed.chunk_bytes, ROWS * DIM * 4 - i * listed.chunk_bytes)
                    assert chain_bytes(listed.chain_locations(i)[0],
                                       listed.chain_locations(i)[1:]) <= CHAIN_BYTES * raw
        store.base_cache.clear()
        for vid, (sparse, dense) in kept.items():
            opened = store.open_version(vid)
            np.testing.assert_array_equal(opened.get("sparse"), sparse)
            np.testing.assert_array_equal(opened.get("dense"), dense)
        assert store.verify().ok


def test_sparse_links_applied_in_place_leave_cached_bases_intact(store: chunkstore.Store
                                                                  ) -> None:
    """A chain whose root comes from the base cache is not changed in place: the cached
    bytes still hash to their digests after reading every version, twice."""
    tables, ids = [], []
    for step, table in zip(range(DEPTH + 1), sparse_states(), strict=False):
        tables.append(table)
        ids.append(save(store, step, table))
    for _ in range(2):
        for vid, table in zip(ids, tables, strict=True):
            np.testing.assert_array_equal(store.open_version(vid).get("emb"), table)
            # What the reads and the saves cached is still what it names.
            for digest in list(store.base_cache._items):
                cached = store.base_cache.get(digest)
                assert cached is not None and Digest.of(cached) == digest
    assert store.base_cache._items, "the test must read chains through cached bases"


def test_members_read_after_their_runs_pages_were_released_read_right(
        store: chunkstore.Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """A restore releases each member's mapped pages (and its bases') once decoded; here
    every release drops the whole mapping's pages, so every later member and base of
    the run is read after a release: the state reads back exact, and a flipped byte in
    the run's last member is still a CorruptChunkError."""
    from chunkstore.backends import local
    from chunkstore.read import chain, members, packs
    table = np.random.default_rng(7).standard_normal((ROWS, DIM)).astype(np.float32)
    ids = []
    for step in range(3):
        table[:: ROWS // 4, step] += 1  # every chunk a delta, chains of 2
        ids.append(save(store, step, table.copy()))
    released: list[int] = []

    def release_all(view: bytes | memoryview) -> None:
        if isinstance(view, memoryview) and isinstance(view.obj, local.mmap.mmap):
            released.append(len(view))
            local.release_mapped(memoryview(view.obj))
        local.release_mapped(view)

    for module in (packs, chain, members):
        monkeypatch.setattr(module, "release_mapped", release_all, raising=False)
        monkeypatch.setattr(module, "PAGED_BYTES", 1, raising=False)  # paged however small
    store.base_cache.clear()
    np.testing.assert_array_equal(store.open_version(ids[-1]).get("emb"), table)
    mapped = local.MAP_MIN_BYTES == 1  # the read mode that maps every ranged read
    assert bool(released) == mapped
    listed = shard(store, ids[-1])
    flip_last_byte_then_read(store, listed.location(len(listed.chunks) - 1), ids[-1])
