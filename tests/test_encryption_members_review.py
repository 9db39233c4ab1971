"""Review attacks on encrypted store version 13 (docs/format.md §13.6): copies that move
members' ciphertext unchanged (sync, repair, repack) authenticate every member first,
crafted pack indexes and locations fail typed, a repack killed mid-way leaves a store
that verifies.  Real files, real LMDB, a real SIGKILL."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import chunkstore
from chunkstore.errors import CorruptChunkError, EncryptionError
from chunkstore.format.manifest import PackLocation
from chunkstore.objects.kinds import CHUNKS
from chunkstore.objects.sealed import SealedObjects
from tests.conftest import tree_snapshot
from tests.s3server import create_bucket, remove_bucket, s3_endpoint, storage_options
from tests.test_encryption_members import (
    PASSWORD,
    _locations,
    _open,
    _read_all,
    _rewrite,
    _save,
    _tensors,
)

REPO = Path(__file__).resolve().parent.parent
__all__ = ["s3_endpoint"]  # the session fixture, re-exported so pytest finds it here


@pytest.fixture(autouse=True)
def _fast_kdf(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHUNKSTORE_INSECURE_TEST_KDF", "1")


def _flip(path: Path, location: PackLocation) -> None:
    _rewrite(path, location.pack, lambda data: data.__setitem__(
        location.offset + location.length // 2,
        data[location.offset + location.length // 2] ^ 0x20))


def test_a_sync_copies_no_damaged_member_and_publishes_nothing(tmp_path: Path) -> None:
    """One member flipped in the source: a sync into a new store names the pack as
    failed, publishes no version, and the
    damaged ciphertext is not in the target."""
    src, tensors = tmp_path / "src", _tensors(1)
    with _open(src) as store:
        version = _save(store, 1, tensors)
        _, location = _locations(store, version)["t3"]
    _flip(src, location)
    with _open(src) as store:
        result = chunkstore.sync(store, tmp_path / "dst")
    assert not result.ok and [f.digest for f in result.failed] == [location.pack.hex]
    assert result.copied == [] and not (tmp_path / "dst" / CHUNKS.key(location.pack)).exists()
    with _open(tmp_path / "dst") as copy:
        assert copy.versions() == []


def test_repair_rewrites_a_damaged_member_of_the_target_from_the_source(
        tmp_path: Path) -> None:
    """A target (a sync of the source) with one member flipped: repair replaces the
    pack from the source's authenticated bytes; the target verifies and reads."""
    src, dst, tensors = tmp_path / "src", tmp_path / "dst", _tensors(1)
    with _open(src) as store:
        version = _save(store, 1, tensors)
        chunkstore.sync(store, dst)
    with _open(dst) as copy:
        _, location = _locations(copy, version)["t6"]
    _flip(dst, location)
    with _open(dst) as copy, _open(src) as store:
        assert _read_all(copy, version, tensors) == {"t6"}
        result = chunkstore.repair(copy, store)
        assert result.ok, result.to_json()
        assert [f.digest for f in result.fixed] == [location.pack.hex]
        assert _read_all(copy, version, tensors) == set() and copy.verify().ok
    members = location.offset + location.length  # the index is sealed again (new salt)
    assert (dst / CHUNKS.key(location.pack)).read_bytes()[:members] \
        == (src / CHUNKS.key(location.pack)).read_bytes()[:members]


def test_a_repack_leaves_a_pack_with_a_damaged_member_in_place(
        tmp_path: Path) -> None:
    """GC would repack a mostly-garbage pack, but one of its live members is flipped:
    the pack is skipped (not copied into a new pack), the moved record is not written,
    and the damage stays where verify names it."""
    path = tmp_path / "s"
    first, second = _tensors(1), _tensors(1)
    second.update({name: array + 1 for name, array in list(second.items())[:7]})
    with _open(path) as store:
        ids = [_save(store, 1, first), _save(store, 2, second)]
        found = _locations(store, ids[1])
        live = next(loc for name, (_, loc) in found.items() if name in ("t7", "t8", "t9"))
        store.delete(ids[0])
    _flip(path, live)
    with _open(path) as store:
        result = store.gc(grace=0)
        assert result.packs_repacked == 0
        assert any(live.pack.short() in s for s in result.repack_skipped), result
        assert (path / CHUNKS.key(live.pack)).exists()
        assert not (path / "moved").exists() or not list((path / "moved").iterdir())
        assert not store.verify().ok


def _index_attacks(stored: bytes, other: bytes) -> dict[str, bytes]:
    trailer = int.from_bytes(stored[-4:], "big")
    members = len(stored) - 4 - trailer
    other_trailer = int.from_bytes(other[-4:], "big")
    return {
        "length-huge": stored[:-4] + (0xFFFFFFF0).to_bytes(4, "big"),
        "length-zero": stored[:-4] + bytes(4),
        "length-short": stored[:-4] + (trailer - 16).to_bytes(4, "big"),
        "length-long": stored[:-4] + (trailer + 32).to_bytes(4, "big"),
        "index-truncated": stored[:members + trailer // 2] + stored[-4:],
        "index-dropped": stored[:members],
        "index-of-another-pack": stored[:members] + other[-4 - other_trailer:],
        "member-dropped": stored[members // 2:],
    }


def test_crafted_pack_indexes_fail_typed_and_sync_copies_nothing(tmp_path: Path) -> None:
    """Each crafted index (its stored length lying, huge, zero; truncated, dropped, or
    another pack's): a whole-pack read fails typed, a sync copies nothing of it and
    publishes no version, and the version's members still read where their bytes are
    whole."""
    src, tensors = tmp_path / "src", _tensors(1)
    with _open(src) as store:
        version = _save(store, 1, tensors)
        other_version = _save(store, 2, _tensors(7))
        (pack,) = {loc.pack for _, loc in _locations(store, version).values()}
        (other,) = {loc.pack for _, loc in _locations(store, other_version).values()}
    file = src / CHUNKS.key(pack)
    good = file.read_bytes()
    for name, crafted in _index_attacks(good, (src / CHUNKS.key(other)).read_bytes()).items():
        file.write_bytes(crafted)
        target = tmp_path / f"dst-{name}"
        with _open(src) as store:
            with pytest.raises(CorruptChunkError):
                store.objects.get(CHUNKS, pack)
            assert not store.verify().ok or store.verify().warnings, name
            result = chunkstore.sync(store, target, [version])
        assert not result.ok and result.copied == [], name
        assert not (target / CHUNKS.key(pack)).exists(), name
    file.write_bytes(good)


def test_a_location_inside_another_member_or_the_index_fails_as_corrupt(
        tmp_path: Path) -> None:
    """A location naming a member's chunk at the stored offset of another member, in the
    middle of one, on the index, past the end, or 1 TiB long: each a CorruptChunkError,
    no data (the local backend's pread asked for the whole length: MemoryError)."""
    path, tensors = tmp_path / "s", _tensors(1)
    with _open(path) as store:
        version = _save(store, 1, tensors)
        found = _locations(store, version)
        digest, a = found["t0"]
        _, b = found["t1"]
        size = (path / CHUNKS.key(a.pack)).stat().st_size
        objects = store.objects
        assert isinstance(objects, SealedObjects)
        for offset, length in ((b.offset, b.length), (a.offset + 16, a.length),
                               (a.offset, a.length - 16), (size - 200, 196),
                               (size - 10, a.length), (a.offset + size, a.length),
                               (a.offset, 1 << 40)):  # read to the end, no 1 TiB buffer
            location = PackLocation(a.pack, offset, length)
            with pytest.raises(CorruptChunkError):
                objects.open_member(digest, location,
                                    objects.member_range(a.pack, offset, length))


GC_CHILD = """
import sys, chunkstore
with chunkstore.open(sys.argv[1]) as store:
    store.gc(grace=0)
print("finished", flush=True)
"""


@pytest.mark.parametrize("fault", ["kill-after-put:moved/:0"])
def test_a_repack_killed_in_a_version_13_store_leaves_it_verifying(
        tmp_path: Path, fault: str) -> None:
    """GC repacking a version-13 pack, SIGKILLed once the moved record is stored (before
    the old pack goes; the power-cut explorer of test_encryption covers the other
    states of an encrypted repack): the store verifies, every
    kept version reads, and a GC after finishes the repack."""
    path = tmp_path / "s"
    first, second = _tensors(1), _tensors(1)
    second.update({name: array + 1 for name, array in list(second.items())[:7]})
    with _open(path) as store:
        ids = [_save(store, 1, first), _save(store, 2, second)]
        store.delete(ids[0])
    proc = subprocess.run([sys.executable, "-c", GC_CHILD, str(path)], capture_output=True,
                          env={**os.environ, "CHUNKSTORE_FAULT": fault,
                               "CHUNKSTORE_PASSWORD": PASSWORD},
                          cwd=REPO, text=True, timeout=120, check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    with _open(path) as store:
        assert store.verify().ok
        assert _read_all(store, ids[1], second) == set()
        store.gc(grace=0)
        assert store.verify().ok
        assert _read_all(store, ids[1], second) == set()
        before = tree_snapshot(path)
        chunkstore.sync(store, tmp_path / "copy")
        assert tree_snapshot(path) == before
    with _open(tmp_path / "copy") as copy:
        assert _read_all(copy, ids[1], second) == set() and copy.verify().ok


def test_a_pack_sealed_whole_in_a_version_13_store_is_not_taken_as_whole(
        tmp_path: Path) -> None:
    """A pack object sealed whole under its key (as a version-12 store lays it out)
    found in a version-13 store: its members cannot be read by their stored locations,
    so it must not open as the pack: repair rewrites it from the source (before, it
    passed repair's check, nothing was fixed, and every member stayed unreadable), and
    ``holds`` says a writer must replace it."""
    src, dst, tensors = tmp_path / "src", tmp_path / "dst", _tensors(1)
    with _open(src) as store:
        version = _save(store, 1, tensors)
        chunkstore.sync(store, dst)
        (pack,) = {loc.pack for _, loc in _locations(store, version).values()}
        plain = bytes(store.objects.get(CHUNKS, pack))
    with _open(dst) as copy:
        objects = copy.objects
        assert isinstance(objects, SealedObjects)
        (dst / CHUNKS.key(pack)).write_bytes(bytes(objects.sealer.seal(CHUNKS.key(pack),
                                                                       plain)))
    with _open(dst) as copy, _open(src) as store:
        assert _read_all(copy, version, tensors, why="is corrupt") == set(tensors)
        # not taken for the pack: a writer or a repack finding it replaces it
        assert copy.objects.holds(CHUNKS, pack, plain) is False
        result = chunkstore.repair(copy, store)
        assert result.ok, result.to_json()
        assert _read_all(copy, version, tensors) == set()


def test_a_sync_replaces_a_damaged_pack_its_target_index_does_not_know(
        tmp_path: Path) -> None:
    """The target holds the pack with one member flipped, and an index of its own that
    never recorded it (another machine's): the sync's put-if-absent finds the object,
    which fails authentication: it is replaced by the source's checked bytes, not
    reported as a failure of the source's version (before: failed, "chunk ... is
    corrupt", the destination left as it was)."""
    src, dst, tensors = tmp_path / "src", tmp_path / "dst", _tensors(1)
    with _open(src) as store:
        version = _save(store, 1, tensors)
        chunkstore.sync(store, dst)
        _, location = _locations(store, version)["t2"]
    damaged = (dst / CHUNKS.key(location.pack)).read_bytes()
    for stale in (dst / "versions", dst / "nodes"):
        shutil.rmtree(stale)
    (dst / "versions").mkdir()
    for chunk in (dst / "chunks").rglob("*"):
        if chunk.is_file():
            chunk.unlink()
    (dst / CHUNKS.key(location.pack)).write_bytes(damaged)
    _flip(dst, location)
    with _open(dst, index_dir=str(tmp_path / "fresh-index")) as copy, \
            _open(src) as store:
        before = tree_snapshot(dst)
        planned = chunkstore.sync(store, copy, dry_run=True)
        assert planned.ok and tree_snapshot(dst) == before, planned.to_json()
        result = chunkstore.sync(store, copy)
        assert result.ok, result.to_json()
        assert planned.objects_copied == result.objects_copied
        assert _read_all(copy, version, tensors) == set() and copy.verify().ok


def test_members_on_s3_fail_typed_and_heal_from_a_local_copy(s3_endpoint: str,
                                                             tmp_path: Path) -> None:
    """A version-13 store synced to moto S3: locations past the pack's end or inside
    its index fail as corrupt (a ranged GET past the end is not a backend error); a
    member flipped on S3 fails that chunk alone, a sync out of S3 reports it failed and
    copies nothing of it, and repair from the local store heals the S3 pack."""
    bucket = create_bucket(s3_endpoint)
    url, options = f"s3://{bucket}/s", storage_options(s3_endpoint)
    try:
        src, tensors = tmp_path / "src", _tensors(1)
        with _open(src) as store:
            version = _save(store, 1, tensors)
            chunkstore.sync(store, url, dst_options=options)
        with chunkstore.open(url, password=PASSWORD, storage_options=options) as remote:
            found = _locations(remote, version)
            digest, location = found["t4"]
            objects = remote.objects
            key = CHUNKS.key(location.pack)
            size = objects.backend.stat(key).size
            for offset, length in ((size + 100, location.length), (size - 4, location.length),
                                   (size - 200, 196), (location.offset, 1 << 40)):
                with pytest.raises(CorruptChunkError):
                    objects.open_member(digest, PackLocation(location.pack, offset, length),
                                        objects.member_range(location.pack, offset, length))
            data = bytearray(objects.backend.get(key))
            data[location.offset + location.length // 2] ^= 0x20
            objects.backend.put(key, bytes(data))
            assert _read_all(remote, version, tensors) == {"t4"}
            result = chunkstore.sync(remote, tmp_path / "out")
            assert not result.ok and result.copied == []
            assert not (tmp_path / "out" / key).exists()
            with _open(src) as store:
                repaired = chunkstore.repair(remote, store)
            assert repaired.ok, repaired.to_json()
            assert _read_all(remote, version, tensors) == set() and remote.verify().ok
    finally:
        remove_bucket(s3_endpoint, bucket)


def test_a_copy_between_version_13_stores_of_other_segment_sizes_is_refused(
        tmp_path: Path) -> None:
    """One master key, both of version 13, but the destination's config names another
    segment size: members' stored bytes, copied as they are, would not open there.
    Before, sync reported ok and published a version of which no member read; now sync
    and repair are refused (EncryptionError) and the destination is unchanged."""
    src, dst, tensors = tmp_path / "src", tmp_path / "dst", _tensors(1, count=3)
    with _open(src) as store:
        chunkstore.sync(store, dst)  # one master key, nothing saved yet
    config = json.loads((dst / "chunkstore.json").read_text())
    config["encryption"]["segment_size"] //= 2
    (dst / "chunkstore.json").write_text(json.dumps(config))
    with _open(src) as store:
        version = _save(store, 1, tensors)
        before = tree_snapshot(dst)
        with _open(dst) as copy:
            with pytest.raises(EncryptionError, match=r"segments of.*nothing was copied"):
                chunkstore.sync(store, copy)
            with pytest.raises(EncryptionError, match="segments of"):
                chunkstore.repair(copy, store, [version])
        assert tree_snapshot(dst) == before
