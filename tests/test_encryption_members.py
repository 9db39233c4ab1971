"""Encrypted store version 13 (docs/format.md §13.6): each pack member sealed on its own,
its chunk id as associated data, so that a repack copies member ciphertext unchanged,
and attacks on members: moved, swapped, flipped, truncated, spliced from another write.
Real files, real LMDB."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import chunkstore
from chunkstore.errors import CorruptChunkError, IntegrityError
from chunkstore.format.digest import Digest
from chunkstore.format.manifest import PackLocation, TensorEntry
from chunkstore.objects import crypto, sealedpacks
from chunkstore.objects.crypto import SEGMENT_OVERHEAD, SEGMENT_SIZE, stored_size
from chunkstore.objects.kinds import CHUNKS, MOVED
from chunkstore.objects.sealed import OPEN_GRAIN, SealedObjects
from chunkstore.objects.sealedpacks import member_name
from tests.test_encryption import refuses_copies_both_ways

PASSWORD = "member password"
DATA = Path(__file__).resolve().parent / "data"


@pytest.fixture(autouse=True)
def _fast_kdf(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHUNKSTORE_INSECURE_TEST_KDF", "1")


def _open(path: Path, **kwargs: Any) -> chunkstore.Store:
    return chunkstore.open(path, create=True, encrypt=True, password=PASSWORD, **kwargs)


def _tensors(step: int, count: int = 10, size: int = 256) -> dict[str, np.ndarray]:
    """``count`` incompressible float32 tensors of ``size`` values (members of one length)."""
    return {f"t{i}": np.random.default_rng(1000 * step + i).standard_normal(size)
            .astype(np.float32) for i in range(count)}


def _save(store: chunkstore.Store, step: int, tensors: dict[str, np.ndarray]) -> str:
    with store.new_version("r", step) as version:
        for name, array in tensors.items():
            version.put(name, array)
    return version.info.id


def _locations(store: chunkstore.Store, version: str) -> dict[str, tuple[Digest, PackLocation]]:
    found = {}
    for name, leaf in store.open_version(version).entries().items():
        assert isinstance(leaf, TensorEntry)
        location = leaf.shards[0].location(0)
        assert location is not None
        found[name] = (leaf.shards[0].chunks[0], location)
    return found


def _bad_chunks(store: chunkstore.Store) -> set[str]:
    result = store.verify()
    return {(p.digest or "")[:16] for p in result.problems if p.kind == "corrupt-chunk"}


@pytest.fixture
def saved(tmp_path: Path) -> Iterator[tuple[Path, str, dict[str, np.ndarray]]]:
    path, tensors = tmp_path / "s", _tensors(1)
    with _open(path) as store:
        version = _save(store, 1, tensors)
    yield path, version, tensors


def _read_all(store: chunkstore.Store, version: str, tensors: dict[str, np.ndarray],
              why: str = "fails authentication") -> set[str]:
    """The names that fail to read, each for ``why`` (the object layer's check, not only
    the hash after it); any other must read back exactly."""
    failed = set()
    reader = store.open_version(version)
    for name, array in tensors.items():
        try:
            assert reader.get(name).tobytes() == array.tobytes(), name
        except IntegrityError as exc:
            assert why in str(exc), exc
            failed.add(name)
    return failed


def test_each_member_is_sealed_on_its_own_under_its_chunk_id(saved: tuple[Path, str, Any]
                                                             ) -> None:
    """The stored pack is its members, each sealed as ``pack member <chunk id>`` and
    listed by stored offset and length, then its index: a member's bytes open under its
    own chunk id (from wherever they are copied), never under another's."""
    path, version, tensors = saved
    with _open(path) as store:
        assert store.config.format_version == 13
        objects = store.objects
        assert isinstance(objects, SealedObjects) and objects.sealed_members
        found = _locations(store, version)
        (pack,) = {location.pack for _, location in found.values()}
        stored = (path / CHUNKS.key(pack)).read_bytes()
        at = 0
        for _, (digest, location) in sorted(found.items(), key=lambda f: f[1][1].offset):
            assert location.offset == at  # locations count stored bytes, members abut
            member = stored[at:at + location.length]
            plain = objects.sealer.open(member_name(digest), member)
            assert location.length == stored_size(len(plain))
            elsewhere = PackLocation(Digest(bytes(32)), 999, location.length)
            assert bytes(objects.open_member(digest, elsewhere, member)) == plain
            at += location.length
        assert at + int.from_bytes(stored[-4:], "big") + 4 == len(stored)
        other = next(d for d, _ in found.values() if d != digest)
        with pytest.raises(CorruptChunkError, match="fails authentication"):
            objects.open_member(other, location, member)
        assert _read_all(store, version, tensors) == set()
        assert store.verify().ok


def test_no_two_members_or_packs_share_a_salt(tmp_path: Path) -> None:
    """A pack's members and index take their salts from one draw, sliced
    (:func:`crypto.fresh_salts`): still, no two members of a pack, of two saves, and no
    two indexes share one (what each member's first nonce, and each index's, is)."""
    path = tmp_path / "s"
    with _open(path) as store:
        ids = [_save(store, step, _tensors(step)) for step in (1, 2)]
        located = [location for version in ids
                   for _, location in _locations(store, version).values()]
    packs = {location.pack: (path / CHUNKS.key(location.pack)).read_bytes()
             for location in located}
    salts = [packs[at.pack][at.offset:at.offset + crypto.NONCE_SIZE] for at in located]
    for stored in packs.values():
        index = len(stored) - 4 - int.from_bytes(stored[-4:], "big")
        salts.append(stored[index:index + crypto.NONCE_SIZE])
    assert len(packs) == 2 and len(located) == 20
    assert len(set(salts)) == len(salts)


def test_a_repack_copies_member_ciphertext_unchanged(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """GC repacks a mostly-garbage pack of a version-13 store: the live members' stored
    bytes land in the new pack byte for byte (the moved record's offsets and lengths are
    stored ones), no member is sealed again, and every version reads through the record."""
    path = tmp_path / "s"
    first, second = _tensors(1), _tensors(1)
    second.update({name: array + 1 for name, array in list(second.items())[:7]})
    with _open(path) as store:
        ids = [_save(store, 1, first), _save(store, 2, second)]
        old = {location.pack for _, location in _locations(store, ids[0]).values()}
        (old_pack,) = old
        old_bytes = (path / CHUNKS.key(old_pack)).read_bytes()
        store.delete(ids[0])
        sealed_names: list[str] = []
        real_seal = crypto.Sealer.seal_into

        def seal_into(self: crypto.Sealer, name: str, *args: Any) -> None:
            sealed_names.append(name)
            real_seal(self, name, *args)

        monkeypatch.setattr(crypto.Sealer, "seal_into", seal_into)
        result = store.gc(grace=0)
        monkeypatch.undo()
        assert result.packs_repacked == 1
        assert not (path / CHUNKS.key(old_pack)).exists()
        assert not [n for n in sealed_names if n.startswith(sealedpacks.MEMBER_PREFIX)]
        (record_file,) = (path / "moved").iterdir()
        record = json.loads(store.objects.get(MOVED, Digest.parse(record_file.name)))
        new_bytes = (path / CHUNKS.key(Digest.parse(record["to"]))).read_bytes()
        assert len(record["members"]) == 3
        for old_offset, length, new_offset in record["members"]:
            assert new_bytes[new_offset:new_offset + length] \
                == old_bytes[old_offset:old_offset + length]
        assert _read_all(store, ids[1], second) == set()
        assert store.verify().ok


def _rewrite(path: Path, pack: Digest, change: Any) -> None:
    file = path / CHUNKS.key(pack)
    data = bytearray(file.read_bytes())
    change(data)
    file.write_bytes(bytes(data))


def test_a_member_moved_to_another_offset_reads_only_where_its_location_says(
        saved: tuple[Path, str, dict[str, np.ndarray]]) -> None:
    """A member's ciphertext copied over its neighbour's place in the same pack: read
    at its listed location (now zeros) and as the neighbour (its bytes there) both fail
    as corrupt chunks; at a location that names the new offset it opens."""
    path, version, tensors = saved
    with _open(path) as store:
        found = _locations(store, version)
        (a_digest, a), (b_digest, b) = found["t0"], found["t1"]
        assert a.length == b.length
        member = (path / CHUNKS.key(a.pack)).read_bytes()[a.offset:a.offset + a.length]

        def move(data: bytearray) -> None:
            data[b.offset:b.offset + b.length] = member
            data[a.offset:a.offset + a.length] = bytes(a.length)
        _rewrite(path, a.pack, move)
        assert _read_all(store, version, tensors) == {"t0", "t1"}
        assert _bad_chunks(store) == {a_digest.hex[:16], b_digest.hex[:16]}
        there = PackLocation(a.pack, b.offset, b.length)
        opened = store.objects.open_member(a_digest, there, store.objects.member_range(
            a.pack, b.offset, b.length))
        assert len(opened) == a.length - SEGMENT_OVERHEAD  # one segment


def test_members_swapped_fail_as_the_chunks_they_are_listed_as(
        saved: tuple[Path, str, dict[str, np.ndarray]]) -> None:
    """Two members' ciphertexts exchanged (same lengths, so every location still fits):
    each fails authentication under the chunk id its location lists, verify names both
    chunks, and every other member of the pack reads."""
    path, version, tensors = saved
    with _open(path) as store:
        found = _locations(store, version)
        (a_digest, a), (b_digest, b) = found["t2"], found["t5"]

        def swap(data: bytearray) -> None:
            data[a.offset:a.offset + a.length], data[b.offset:b.offset + b.length] = \
                data[b.offset:b.offset + b.length], data[a.offset:a.offset + a.length]
        _rewrite(path, a.pack, swap)
        assert _read_all(store, version, tensors) == {"t2", "t5"}
        assert _bad_chunks(store) == {a_digest.hex[:16], b_digest.hex[:16]}


def test_a_bit_flipped_in_one_member_fails_that_chunk_alone(
        saved: tuple[Path, str, dict[str, np.ndarray]]) -> None:
    path, version, tensors = saved
    with _open(path) as store:
        digest, location = _locations(store, version)["t7"]

        def flip(data: bytearray) -> None:
            data[location.offset + location.length // 2] ^= 0x10
        _rewrite(path, location.pack, flip)
        assert _read_all(store, version, tensors) == {"t7"}
        result = store.verify()
        assert not result.ok
        assert {(p.kind, p.version) for p in result.problems} == {("corrupt-chunk", version)}
        assert _bad_chunks(store) == {digest.hex[:16]}


def test_a_truncated_pack_fails_the_members_it_cut(
        saved: tuple[Path, str, dict[str, np.ndarray]], tmp_path: Path) -> None:
    """A pack cut in the middle of a member: that member and those after it fail (typed),
    the members before it read; the whole pack (a sync's check) fails and nothing is
    copied."""
    path, version, tensors = saved
    with _open(path) as store:
        found = _locations(store, version)
        cut = found["t4"][1]
        _rewrite(path, cut.pack, lambda data: data.__delitem__(
            slice(cut.offset + cut.length // 2, None)))
        after = {name for name, (_, loc) in found.items() if loc.offset >= cut.offset}
        assert _read_all(store, version, tensors, why="ends before") == after
        assert not store.verify().ok
        with pytest.raises(CorruptChunkError):
            store.objects.get(CHUNKS, cut.pack)


def test_a_member_spliced_from_another_write_of_it_fails(tmp_path: Path) -> None:
    """A member of two segments whose first segment is of one write and the rest of
    another (the same chunk sealed again, with another salt) fails; each write whole
    reads."""
    path, tensors = tmp_path / "s", _tensors(1, count=3, size=30_000)  # 120 KB members
    with _open(path, chunk_size=256 * 1024, delta_depth=0) as store:
        version = _save(store, 1, tensors)
        digest, location = _locations(store, version)["t1"]
        objects = store.objects
        assert isinstance(objects, SealedObjects)
        stored = (path / CHUNKS.key(location.pack)).read_bytes()
        member = stored[location.offset:location.offset + location.length]
        plain = bytes(objects.open_member(digest, location, member))
        again = bytes(objects.sealer.seal(member_name(digest), plain))
        assert len(again) == len(member) and again != member
        step = SEGMENT_SIZE + SEGMENT_OVERHEAD
        for head, tail in ((member, again), (again, member)):
            spliced = head[:step] + tail[step:]
            _rewrite(path, location.pack, lambda data, spliced=spliced: data.__setitem__(
                slice(location.offset, location.offset + location.length), spliced))
            with pytest.raises(CorruptChunkError, match="another write"):
                store.open_version(version).get("t1")
        _rewrite(path, location.pack, lambda data: data.__setitem__(
            slice(location.offset, location.offset + location.length), again))
        assert _read_all(store, version, tensors) == set()


def test_a_damaged_pack_index_is_a_warning_and_the_versions_read(
        saved: tuple[Path, str, dict[str, np.ndarray]]) -> None:
    """The index (header and member list, sealed under the pack's key) is used by whole-
    pack reads only: damaged, verify warns (pack-header) and every member still reads."""
    path, version, tensors = saved
    with _open(path) as store:
        (_, location) = _locations(store, version)["t0"]
        _rewrite(path, location.pack, lambda data: data.__setitem__(
            len(data) - 10, data[len(data) - 10] ^ 1))
        assert _read_all(store, version, tensors) == set()
        result = store.verify()
        assert result.ok and [w.kind for w in result.warnings] == ["pack-header"]


def test_a_version_12_store_keeps_packing_whole_and_a_copy_into_13_is_refused(
        tmp_path: Path) -> None:
    """encrypted-v2 (store version 12) takes a save whose packs are sealed whole as
    before (the stored pack opens as one object) and reads back; sync and repair between
    it and encrypted-v3 (one master key, one naming, packs laid out apart) are refused
    with what to do, and change nothing."""
    copies = {name: tmp_path / name for name in ("encrypted-v2", "encrypted-v3")}
    for name, copy in copies.items():
        shutil.copytree(DATA / name, copy)
    password = json.loads((DATA / "encrypted-v2.expected.json").read_text())["password"]
    with chunkstore.open(copies["encrypted-v2"], password=password) as old:
        assert not old.objects.sealed_members
        tensors = _tensors(5)
        version = _save(old, 5, tensors)
        (_, location) = _locations(old, version)["t0"]
        objects = old.objects
        assert isinstance(objects, SealedObjects)
        whole = objects.sealer.open(CHUNKS.key(location.pack),
                                    (copies["encrypted-v2"] / CHUNKS.key(location.pack))
                                    .read_bytes())
        assert len(whole) == 24 + sum(loc.length for _, loc in
                                      _locations(old, version).values())
        assert _read_all(old, version, tensors) == set() and old.verify().ok
        refuses_copies_both_ways(old, copies["encrypted-v3"], password,
                                 r"lay them out apart.*nothing was")
    assert json.loads((copies["encrypted-v2"] / "chunkstore.json").read_bytes()
                      )["format_version"] == 12


def test_a_restore_falls_back_past_a_version_with_a_flipped_member(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Checkpointer on a version-13 store: one member of the newest version flipped,
    restore warns and takes the version before."""
    torch = pytest.importorskip("torch")
    from torch_bridge import Checkpointer, RestoreFallbackWarning

    path, states = tmp_path / "s", []
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
    with _open(path) as store, Checkpointer(store, run="r") as ckpt:
        for step in (1, 2):
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.add_(1.0)
            ckpt.save(step, model=model)
            states.append({k: v.clone() for k, v in model.state_dict().items()})
        newest = store.latest("r")
        assert newest is not None
        packed = [leaf.shards[0].location(0) for leaf in
                  store.open_version(newest.id).entries().values()
                  if isinstance(leaf, TensorEntry) and leaf.shards[0].packs]
    location = next(loc for loc in packed if loc is not None)
    _rewrite(path, location.pack, lambda data: data.__setitem__(
        location.offset + location.length // 2, data[location.offset + location.length // 2] ^ 4))
    monkeypatch.setenv("CHUNKSTORE_PASSWORD", PASSWORD)
    with Checkpointer(path, run="r") as ckpt, pytest.warns(RestoreFallbackWarning,
                                                           match="restored step 1"):
        assert ckpt.restore(model=model) == 1
    assert all(torch.equal(model.state_dict()[k], v) for k, v in states[0].items())


def test_a_restore_opens_each_member_of_a_chain_apart_and_fails_on_a_flipped_base(
        tmp_path: Path) -> None:
    """Read jobs open each sealed member of a delta chain into a buffer of its depth
    (chunkstore.read.scratch.member_buffer): the newest of four versions reads back
    exactly through a chain of three packed bases; a base flipped two links down fails
    the versions that need it as failing authentication, and on the same handle the
    version before it still reads exactly."""
    path, rng = tmp_path / "s", np.random.default_rng(7)
    table = rng.standard_normal((64, 64)).astype(np.float32)  # four chunks of 4 KiB
    tables, ids = [], []
    with _open(path, chunk_size=4096, delta_depth=3) as store:
        for step in range(4):
            table[0, step] += 1  # chunk 0 changes in every version: a chain of depth 3
            tables.append(table.copy())
            with store.new_version("r", step) as version:
                version.put("emb", tables[-1])
            ids.append(version.info.id)
        entry = store.open_version(ids[-1]).entry("emb")
        assert isinstance(entry, TensorEntry)
        (shard,) = entry.shards
        assert len(shard.chain(0)) == 3 and None not in shard.chain_locations(0)
        assert store.open_version(ids[-1]).get("emb").tobytes() == tables[-1].tobytes()
        base = shard.chain_locations(0)[1]  # version 1's chunk 0, itself a delta
        assert base is not None
        _rewrite(path, base.pack, lambda data: data.__setitem__(
            base.offset + base.length // 2, data[base.offset + base.length // 2] ^ 1))
        for failing in ids[1:]:
            with pytest.raises(CorruptChunkError, match="fails authentication"):
                store.open_version(failing).get("emb")
        assert store.open_version(ids[0]).get("emb").tobytes() == tables[0].tobytes()


def test_a_member_opened_part_by_part_is_checked_across_its_parts(tmp_path: Path) -> None:
    """A member longer than a part of a paged open (OPEN_GRAIN: populated, opened and
    released part by part) still fails where its parts are of two writes, spliced at
    the first segment of a later part, and where a byte of a later part is flipped;
    each write whole reads."""
    path, tensors = tmp_path / "s", _tensors(1, count=2, size=400_000)  # 1.3 MB members
    with _open(path, chunk_size=2 * 1024 * 1024) as store:
        version = _save(store, 1, tensors)
        digest, location = _locations(store, version)["t1"]
        objects = store.objects
        assert isinstance(objects, SealedObjects)
        step = SEGMENT_SIZE + SEGMENT_OVERHEAD
        split = OPEN_GRAIN // step * step  # where the second part begins
        assert location.length > split + step
        stored = (path / CHUNKS.key(location.pack)).read_bytes()
        member = stored[location.offset:location.offset + location.length]
        plain = bytes(objects.open_member(digest, location, member))
        again = bytes(objects.sealer.seal(member_name(digest), plain))

        def put(data: bytes) -> None:
            _rewrite(path, location.pack, lambda pack: pack.__setitem__(
                slice(location.offset, location.offset + location.length), data))

        for spliced in (member[:split] + again[split:], again[:split] + member[split:]):
            put(spliced)
            with pytest.raises(CorruptChunkError, match="another write"):
                store.open_version(version).get("t1")
        flipped = bytearray(again)
        flipped[split + step + 100] ^= 1
        put(bytes(flipped))
        with pytest.raises(CorruptChunkError, match="fails authentication"):
            store.open_version(version).get("t1")
        put(again)
        assert _read_all(store, version, tensors) == set()
