"""Sync checks every byte it moves: a damaged source object never reaches the
destination, a destination object that passes its check is never replaced, a
destination holds one version per RUN@STEP, and a byte copy of a store is a store
of its own.

Real files, real LMDB and the moto S3 server; the damage is written through the
store's own backend (so the same test damages a local file and an S3 object).
"""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

import chunkstore
from chunkstore.cli import cli
from chunkstore.codecs import PACK
from chunkstore.format.chunkobj import HEADER, parse_header
from chunkstore.format.digest import Digest
from chunkstore.format.manifest import TensorEntry
from chunkstore.handle.tree import flatten
from chunkstore.objects.kinds import CHUNKS, NODES, VERSIONS
from tests.s3server import create_bucket, remove_bucket, storage_options
from tests.test_sync import CHUNK, Ends, PausedCommit, ends, s3_endpoint, save
from tests.test_sync import state as sync_state

__all__ = ["ends", "s3_endpoint"]  # fixtures, re-exported so pytest finds them here

DATA = Path(__file__).resolve().parent / "data"


def state(step: int) -> dict[str, np.ndarray]:
    """Tensors every step changes whole: chunk objects of their own (20 KiB) and
    small ones packed."""
    rng = np.random.default_rng(step)
    return {"model.w": rng.standard_normal(5 * CHUNK // 4).astype(np.float32),
            "model.b": rng.standard_normal(30).astype(np.float32)}


def save_distinct(store: chunkstore.Store, run: str, step: int) -> str:
    with store.new_version(run=run, step=step) as v:
        for name, array in state(step).items():
            v.put(name, array)
    return v.info.id


def stored_objects(store: chunkstore.Store, version: str) -> dict[Digest, bool]:
    """The chunk objects a version needs, each with whether it is a pack."""
    flat = flatten(store.objects, store.read_record(version).root, store.node_cache)
    kinds = {}
    for digest in flat.chunk_digests():
        head = store.objects.get_range(CHUNKS, digest, 0, HEADER.size)
        kinds[digest] = parse_header(digest, head).codec_id == PACK.id
    return kinds


def only_in(store: chunkstore.Store, version: str, others: list[str]) -> dict[Digest, bool]:
    """The objects ``version`` needs that none of ``others`` does."""
    mine = stored_objects(store, version)
    for other in others:
        for digest in stored_objects(store, other):
            mine.pop(digest, None)
    return mine


def damage(store: chunkstore.Store, digest: Digest, how: str) -> None:
    data = bytearray(store.objects.get(CHUNKS, digest))
    if how == "flip":
        data[len(data) // 2] ^= 0x10
        store.objects.put(CHUNKS, digest, bytes(data))
    elif how == "truncate":
        store.objects.put(CHUNKS, digest, bytes(data[: len(data) - 7]))
    else:
        store.objects.delete(CHUNKS, digest)


def sync_cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["sync", *args])
    return result.exit_code, result.output


@pytest.mark.parametrize("how", ["flip", "truncate", "delete"])
@pytest.mark.parametrize("packed", [False, True])
def test_a_damaged_source_object_never_reaches_the_destination(
        tmp_path: Path, how: str, packed: bool) -> None:
    """One object of step 2 damaged (a standalone chunk object, or a pack): the
    sync exits 3 naming step 2 and the object, publishes steps 1 and 3 whole, and
    nothing of step 2; a second sync after a repair of the source copies it."""
    src_path, dst_path = tmp_path / "src", tmp_path / "dst"
    with chunkstore.open(src_path, create=True, chunk_size=CHUNK, delta_depth=0) as src:
        ids = [save_distinct(src, "a", step) for step in (1, 2, 3)]
        victims = {d: p for d, p in only_in(src, ids[1], [ids[0], ids[2]]).items()
                   if p == packed}
        assert victims, "the state must give step 2 objects of its own of that kind"
        victim = sorted(victims)[0]
        damage(src, victim, how)
    code, out = sync_cli(str(src_path), str(dst_path))
    assert code == 3, out
    assert "a@2" in out and victim.hex[:16] in out and "chunkstore repair" in out
    with chunkstore.open(dst_path) as dst:
        assert {v.id for v in dst.versions()} == {ids[0], ids[2]}
        assert dst.verify().ok
        for step, version in ((1, ids[0]), (3, ids[2])):
            reader = dst.open_version(version)
            for name, array in state(step).items():
                assert reader.get(name).tobytes() == array.tobytes()


def test_the_api_names_the_failed_version_and_copies_the_rest(ends: Ends) -> None:
    """The same through the Python API on every pair of ends (local and S3): the
    result lists the failure with the object, and ``ok`` is false."""
    with ends.open_src(create=True, chunk_size=CHUNK, delta_depth=0) as src:
        ids = [save_distinct(src, "a", step) for step in (1, 2, 3)]
        victim = sorted(only_in(src, ids[1], [ids[0], ids[2]]))[0]
        damage(src, victim, "flip")
        dry = chunkstore.sync(src, ends.dst, dry_run=True, dst_options=ends.dst_options)
        assert [f.version for f in dry.failed] == [ids[1]] and not dry.ok
        result = chunkstore.sync(src, ends.dst, dst_options=ends.dst_options)
    assert [f.version for f in result.failed] == [ids[1]]
    assert result.failed[0].digest == victim.hex and result.failed[0].kind == "corrupt-chunk"
    assert result.copied == [ids[0], ids[2]] and not result.ok
    with ends.open_dst() as dst:
        assert {v.id for v in dst.versions()} == {ids[0], ids[2]}
        assert dst.verify().ok


def test_a_tag_of_a_version_not_copied_does_not_travel(tmp_path: Path) -> None:
    with chunkstore.open(tmp_path / "src", create=True, chunk_size=CHUNK, delta_depth=0) as src:
        ids = [save_distinct(src, "a", step) for step in (1, 2)]
        src.tag(ids[1], "best")
        src.tag(ids[0], "first")
        damage(src, sorted(only_in(src, ids[1], [ids[0]]))[0], "delete")
    result = chunkstore.sync(tmp_path / "src", tmp_path / "dst")
    assert result.tags_created == ["first"]
    with chunkstore.open(tmp_path / "dst") as dst:
        assert dst.tags() == {"first": ids[0]}


def _fixture_delta_chunk(store: chunkstore.Store) -> tuple[str, str, Digest]:
    """A version, a tensor of it and one of its chunks stored as a delta object of its
    own (as releases before chunk format 5 wrote them)."""
    for info in store.versions():
        reader = store.open_version(info.id)
        for name in reader.names():
            entry = reader.entry(name)
            if not isinstance(entry, TensorEntry):
                continue
            for shard in entry.shards:
                for i, digest in enumerate(shard.chunks):
                    if shard.location(i) is None and shard.chain(i):
                        return info.id, name, digest
    raise AssertionError("the fixture has no standalone delta chunk")


def test_a_rotted_source_never_replaces_the_destinations_intact_delta(tmp_path: Path) -> None:
    """The destination written by an older release holds a chunk as a delta object
    of its own; the source holds the same bytes standalone, rotted.  The sync
    refuses the source's version and leaves the destination's object alone: every
    version of the destination still reads back (before the check, sync replaced
    the intact delta with the rotted bytes and five entries broke)."""
    dst_path = tmp_path / "dst"
    shutil.copytree(DATA / "store-v4", dst_path)
    with chunkstore.open(dst_path) as dst:
        version, name, digest = _fixture_delta_chunk(dst)
        array = dst.open_version(version).get(name)
        before = dst.objects.get(CHUNKS, digest)
        chunk_size = dst.config.chunk_size
    with chunkstore.open(tmp_path / "src", create=True, chunk_size=chunk_size,
                         delta_depth=0) as src:
        with src.new_version(run="other", step=1) as v:
            v.put(name, np.ascontiguousarray(array))
        assert src.objects.exists(CHUNKS, digest), "the chunk must be standalone in SRC"
        damage(src, digest, "flip")
    code, out = sync_cli(str(tmp_path / "src"), str(dst_path))
    assert code == 3, out
    with chunkstore.open(dst_path) as dst:
        assert dst.objects.get(CHUNKS, digest) == before
        assert dst.verify().ok
        assert [v.run for v in dst.versions(run="other")] == []


def test_a_pack_whose_header_alone_is_damaged_is_copied_with_a_sound_header(
        tmp_path: Path) -> None:
    """verify passes a pack whose own header is damaged (reads never use it), so
    sync copies it too, with the header it was written with."""
    with chunkstore.open(tmp_path / "src", create=True, chunk_size=CHUNK) as src:
        version = save(src, "a", 1)
        pack = next(d for d, is_pack in stored_objects(src, version).items() if is_pack)
        data = bytearray(src.objects.get(CHUNKS, pack))
        data[9] ^= 0x01  # the raw length's low byte
        src.objects.put(CHUNKS, pack, bytes(data))
        assert src.verify().ok
    result = chunkstore.sync(tmp_path / "src", tmp_path / "dst")
    assert result.copied == [version] and not result.failed
    with chunkstore.open(tmp_path / "dst") as dst:
        stored = dst.objects.get(CHUNKS, pack)
        assert stored[HEADER.size:] == bytes(data[HEADER.size:])
        assert parse_header(pack, stored).raw_length == len(stored) - HEADER.size
        verified = dst.verify()
        assert verified.ok and not verified.warnings


def test_one_version_per_run_and_step(tmp_path: Path) -> None:
    """Both stores have a run ``exp`` with a step 3 of other content: the sync names
    the conflict, exits 1 and publishes nothing for it (DST's exp@3 keeps reading
    DST's bytes); the same tree saved at the same step in both is already there."""
    src_path, dst_path = tmp_path / "src", tmp_path / "dst"
    with chunkstore.open(src_path, create=True, chunk_size=CHUNK) as src:
        with src.new_version(run="exp", step=3) as v:
            v.put("w", np.arange(5000, dtype=np.float32))
        src_id = v.info.id
        with src.new_version(run="same", step=1) as v:
            v.put("w", np.ones(10, dtype=np.float32))
    with chunkstore.open(dst_path, create=True, chunk_size=CHUNK) as dst:
        with dst.new_version(run="exp", step=3) as v:
            v.put("w", np.zeros(5000, dtype=np.float32))
        dst_id = v.info.id
        with dst.new_version(run="same", step=1) as v:
            v.put("w", np.ones(10, dtype=np.float32))
        same_id = v.info.id
    code, out = sync_cli("--json", str(src_path), str(dst_path))
    assert code == 1, out
    doc = json.loads(out)
    assert doc["step_conflicts"] == [{"run": "exp", "step": 3, "src_version": src_id,
                                      "dst_version": dst_id}]
    assert doc["copied"] == [] and not doc["ok"]
    with chunkstore.open(dst_path) as dst:
        assert [v.id for v in dst.versions(run="exp")] == [dst_id]
        assert [v.id for v in dst.versions(run="same")] == [same_id]
        assert not dst.open_version("exp@3").get("w").any()


def test_a_byte_copy_of_a_store_is_another_store(tmp_path: Path) -> None:
    """``cp -a SRC COPY`` and then a sync between them: a store of its own (the
    same config, another directory), not "the source store itself"."""
    with chunkstore.open(tmp_path / "src", create=True, chunk_size=CHUNK) as src:
        save(src, "a", 1)
    shutil.copytree(tmp_path / "src", tmp_path / "copy", symlinks=True)
    with chunkstore.open(tmp_path / "src") as src:
        newer = save(src, "a", 2)
    code, out = sync_cli(str(tmp_path / "src"), str(tmp_path / "copy"))
    assert code == 0, out
    with chunkstore.open(tmp_path / "copy") as copy:
        assert copy.resolve("a@2").id == newer and copy.verify().ok
    (tmp_path / "link").symlink_to(tmp_path / "src")
    code, out = sync_cli(str(tmp_path / "link"), str(tmp_path / "src"))
    assert code == 2 and "source" in out


def test_a_damaged_node_in_the_source_is_not_copied(tmp_path: Path) -> None:
    with chunkstore.open(tmp_path / "src", create=True, chunk_size=CHUNK) as src:
        ids = [save(src, "a", step) for step in (1, 2)]
        root = src.read_record(ids[1]).root
        data = bytearray(src.objects.get(NODES, root))
        data[-2] ^= 0x01
        src.objects.put(NODES, root, bytes(data))
    result = chunkstore.sync(tmp_path / "src", tmp_path / "dst")
    assert result.copied == [ids[0]]
    assert [(f.version, f.kind) for f in result.failed] == [(ids[1], "corrupt-node")]


def test_a_gc_from_another_index_never_deletes_a_moved_record_a_sync_commits_against(
        tmp_path: Path) -> None:
    """The source repacked a pack (its members read through a moved record), so the
    sync writes the record into the destination; the sync is held after its last
    check, just before its commit record, while a GC from another index runs with the
    default grace.  Before, that GC deleted the record at once (no version reached it
    yet) and the published version's members were unreachable; now the record is
    fenced like an object, the GC waits for the sync's session, and marks it through
    the version the sync published."""
    with chunkstore.open(tmp_path / "src", create=True, chunk_size=CHUNK,
                         delta_depth=0) as src:
        old = save(src, "a", 1)
        keep = save(src, "a", 2)
        src.delete(old)
        assert src.gc(grace=0, repack_unused=0.01).packs_repacked > 0
    dst = chunkstore.open(tmp_path / "dst", create=True, chunk_size=CHUNK)
    paused = dst.backend = PausedCommit(dst.backend)
    outcome: dict[str, Any] = {}

    def run_sync() -> None:
        outcome["sync"] = chunkstore.sync(tmp_path / "src", dst, [keep])

    def run_gc() -> None:
        with chunkstore.open(tmp_path / "dst", index_dir=str(tmp_path / "other")) as other:
            outcome["gc"] = other.gc()

    syncing = threading.Thread(target=run_sync)
    syncing.start()
    assert paused.waiting.wait(60)
    assert any((tmp_path / "dst" / "moved").iterdir())
    collecting = threading.Thread(target=run_gc)
    collecting.start()
    collecting.join(1.5)  # the GC fences the record, then waits for the sync's session
    paused.go.set()
    syncing.join(60)
    collecting.join(60)
    dst.close()
    assert outcome["sync"].copied == [keep]
    assert outcome["gc"].moved_records_deleted == 0
    with chunkstore.open(tmp_path / "dst") as store:
        assert store.verify().ok
        reader = store.open_version(keep)
        for name, array in sync_state(2).items():
            assert reader.get(name).tobytes() == array.tobytes()


def small_state(step: int, shared: int) -> dict[str, np.ndarray]:
    """Ten small tensors (packed together); the first ``shared`` the same every step."""
    return {f"t{i}": np.random.default_rng(0 if i < shared else 100 * step + i)
            .standard_normal(500).astype(np.float32) for i in range(10)}


def stored_bytes(store: chunkstore.Store, version: str) -> int:
    """What a version needs stored: its members, objects of its own, nodes, record."""
    record = store.read_record(version)
    flat = flatten(store.objects, record.root, store.node_cache)
    total = len(store.objects.get(VERSIONS, version))
    total += sum(len(store.objects.get(NODES, d)) for d in flat.tree_nodes | flat.data_nodes())
    members: set[tuple[Digest, int, int]] = set()
    for leaf in flat.leaves.values():
        if isinstance(leaf, TensorEntry):
            for shard in leaf.shards:
                for i, digest in enumerate(shard.chunks):
                    at = shard.location(i)
                    if at is None:
                        total += store.objects.stat(CHUNKS, digest).size
                    else:
                        members.add((at.pack, at.offset, at.length))
    return total + sum(length for _, _, length in members)


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_version_moved_alone_costs_about_its_stored_bytes(
        tmp_path: Path, where: str, request: pytest.FixtureRequest,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The source's packs hold leftovers of removed versions: moving the newest version
    into an empty store copies the members it lists (a new pack and a moved record),
    not whole packs: at most 1.1x its stored bytes (it copied 3-4x).  The version reads
    back; the older ones synced afterwards bring their packs whole, and every version
    of the destination verifies."""
    monkeypatch.setenv("CHUNKSTORE_CACHE_DIR", str(tmp_path / "cache"))
    if where == "s3":
        endpoint = request.getfixturevalue("s3_endpoint")
        bucket = create_bucket(endpoint)
        request.addfinalizer(lambda: remove_bucket(endpoint, bucket))
        dst_url, options = f"s3://{bucket}/dst", storage_options(endpoint)
    else:
        dst_url, options = str(tmp_path / "dst"), {}
    with chunkstore.open(tmp_path / "src", create=True, chunk_size=CHUNK) as src:
        ids = []
        for step in range(1, 5):
            with src.new_version(run="r", step=step) as v:
                for name, array in small_state(step, shared=2).items():
                    v.put(name, array)
            ids.append(v.info.id)
        src.delete(ids[0])
        src.delete(ids[1])
        assert src.gc(grace=0, repack_unused=None).chunks_deleted > 0
        newest = stored_bytes(src, ids[3])
    dry = chunkstore.sync(tmp_path / "src", dst_url, [ids[3]], dry_run=True,
                          dst_options=options)
    result = chunkstore.sync(tmp_path / "src", dst_url, [ids[3]], dst_options=options)
    assert result.copied == [ids[3]] and dry.bytes_copied == result.bytes_copied
    assert result.bytes_copied <= 1.1 * newest, (result.bytes_copied, newest)
    assert chunkstore.sync(tmp_path / "src", dst_url, dst_options=options).copied == [ids[2]]
    with chunkstore.open(dst_url, storage_options=options) as dst:
        assert dst.verify().ok
        for step, version in ((3, ids[2]), (4, ids[3])):
            reader = dst.open_version(version)
            for name, array in small_state(step, shared=2).items():
                assert reader.get(name).tobytes() == array.tobytes()
