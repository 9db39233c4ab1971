"""``verify --quick`` over a whole store trusts what an earlier verify read, or what the
save that built a version recorded, and no more.

A version a verify found readable, or one its own save built (it encoded the tree and
knows its references exactly), is remembered in the index (bound to its entry and
references there and to the index's verify epoch); a later quick verify only checks
each of its objects present, by a listing.  Each test runs on both (the ``saved``
fixture).  These tests damage the real files of a
local store after the index remembered its versions, and change the store through
another index, and check that the quick verify still finds what it promises to
find, and trusts nothing a rebuilt index or another index's removal invalidated.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import chunkstore
from chunkstore.backends.base import Backend
from chunkstore.backends.wrappers import RequestHook
from chunkstore.format.digest import Digest
from chunkstore.index.lmdbindex import ChunkRecord, ChunkState
from chunkstore.maintenance.verify import VerifyResult
from chunkstore.objects.kinds import CHUNKS, NODES, VERSIONS
from tests.conftest import SMALL_CHUNK
from tests.s3server import s3_endpoint, two_indexes
from tests.test_report_index import _saved

__all__ = ["s3_endpoint"]  # the session fixture, re-exported so pytest finds it here

VERSIONS_SAVED = 4


def _state(step: int) -> dict[str, np.ndarray]:
    """Two tensors; "moving" changes at every step, "fixed" never."""
    return {"fixed": np.arange(20_000, dtype=np.float32),
            "moving": np.full(20_000, step, dtype=np.float32)}


def _save(store: chunkstore.Store, step: int) -> str:
    with store.new_version("r", step) as v:
        for name, array in _state(step).items():
            v.put(name, array)
        v.put_data("trainer", {"step": step})
    return v.info.id


@pytest.fixture(params=["verified", "by-saves"])
def saved(store_path: Path, request: pytest.FixtureRequest) -> Iterator[list[str]]:
    """A store of a few versions its index remembers readable: fully verified once, or
    as its saves recorded them (no verify)."""
    with chunkstore.open(store_path, chunk_size=SMALL_CHUNK, create=True) as store:
        ids = [_save(store, step) for step in range(VERSIONS_SAVED)]
        by_saves = {vid: v.by_its_save for vid, v in store.index.verified_versions(ids).items()}
        assert by_saves == dict.fromkeys(ids, True)
        if request.param == "verified":
            assert store.verify().ok
            assert not any(v.by_its_save for v in store.index.verified_versions(ids).values())
    yield ids


def _quick(store_path: Path, index_dir: Path | None = None) -> VerifyResult:
    extra = {} if index_dir is None else {"index_dir": str(index_dir)}
    with chunkstore.open(store_path, create=False, **extra) as store:
        return store.verify(read_data=False)


def _own_chunk(store_path: Path, version_id: str) -> Digest:
    """A chunk object only ``version_id`` needs."""
    with chunkstore.open(store_path, create=False) as store:
        mine = set(store.index.version_refs(version_id))
        others = {d for vid in store.index.version_ids() - {version_id}
                  for d in store.index.version_refs(vid)}
    return sorted(mine - others)[0]


def test_a_quick_verify_trusts_what_a_verify_read(store_path: Path, saved: list[str]) -> None:
    result = _quick(store_path)
    assert result.ok and result.versions_checked == VERSIONS_SAVED
    assert result.versions_trusted == VERSIONS_SAVED
    assert [v.entries for v in result.versions] == [3] * VERSIONS_SAVED
    assert [v.step for v in result.versions] == list(range(VERSIONS_SAVED))


def test_a_chunk_deleted_after_the_verify_is_found(store_path: Path, saved: list[str]) -> None:
    victim = saved[1]
    chunk = _own_chunk(store_path, victim)
    (store_path / CHUNKS.key(chunk)).unlink()

    result = _quick(store_path)
    # one finding per chunk read that needs it (here a pack of several chunks)
    assert {(p.kind, p.digest) for p in result.problems} == {("missing-chunk", chunk.hex)}
    assert [v.id for v in result.versions if v.damaged] == [victim]
    assert result.versions_trusted == VERSIONS_SAVED - 1  # the others still are


def test_a_node_deleted_after_the_verify_is_found(store_path: Path, saved: list[str]) -> None:
    victim = saved[2]
    with chunkstore.open(store_path, create=False) as store:
        root = store.read_record(victim).root  # the root node only this version has
    (store_path / NODES.key(root)).unlink()

    result = _quick(store_path)
    assert not result.ok
    assert {p.version for p in result.problems} == {victim}
    assert [v.id for v in result.versions if v.damaged] == [victim]


def test_a_wrong_refcount_is_found_with_every_version_trusted(
        store_path: Path, saved: list[str]) -> None:
    with chunkstore.open(store_path, create=False) as store:
        digest = store.index.version_refs(saved[0])[0]
        record = store.index.chunk(digest)
        assert record is not None
        store.index.put_chunk_record(digest, ChunkRecord(
            ChunkState.LIVE, record.codec_id, record.refcount + 1, record.raw_length,
            record.stored_length, record.since))

    result = _quick(store_path)
    assert result.versions_trusted == VERSIONS_SAVED
    assert [(p.kind, p.digest) for p in result.problems] == [("refcount", digest.hex)]


def test_nothing_is_trusted_after_an_index_rebuild(store_path: Path, saved: list[str]) -> None:
    with chunkstore.open(store_path, create=False) as store:
        store.rebuild_index()
    first = _quick(store_path)
    assert first.ok and first.versions_trusted == 0  # read whole again ...
    assert _quick(store_path).versions_trusted == VERSIONS_SAVED  # ... and remembered


def test_a_version_another_index_removed_is_not_trusted_nor_reported(
        store_path: Path, saved: list[str], tmp_path: Path) -> None:
    victim = saved[1]
    chunk = _own_chunk(store_path, victim)
    with chunkstore.open(store_path, create=False, index_dir=str(tmp_path / "other")) as other:
        other.delete(victim)
        other.gc(grace=0)
    assert not (store_path / CHUNKS.key(chunk)).exists()
    assert not (store_path / VERSIONS.key(victim)).exists()

    result = _quick(store_path)
    assert result.ok, result.problems
    assert victim not in {v.id for v in result.versions}
    assert result.versions_trusted == VERSIONS_SAVED - 1


def test_a_damaged_record_is_trusted_by_quick_and_found_by_a_full_verify(
        store_path: Path, saved: list[str]) -> None:
    """What --quick documents: a record or manifest read once is not read again."""
    record = store_path / VERSIONS.key(saved[3])
    record.write_bytes(record.read_bytes()[:-5])
    assert _quick(store_path).ok
    with chunkstore.open(store_path, create=False) as store:
        assert [p.kind for p in store.verify().problems] == ["corrupt-record"]


def test_a_verify_of_one_version_remembers_nothing(store_path: Path) -> None:
    """prune, sync, drill and mirror verify single versions: no index write for them
    (the version stays as its save recorded it)."""
    with chunkstore.open(store_path, chunk_size=SMALL_CHUNK, create=True) as store:
        version = _save(store, 0)
        assert store.verify(version).ok and store.verify(version, read_data=False).ok
        assert store.index.verified_versions([version])[version].by_its_save


class _Reads(RequestHook):
    """Counts the reads of commit records and manifest nodes."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self.manifests = 0

    def request(self, operation: str, key: str) -> None:
        self.manifests += operation in ("get", "get_range") and key.startswith(
            (NODES.prefix, VERSIONS.prefix))


def test_a_quick_verify_right_after_saves_reads_no_manifest(store_path: Path) -> None:
    """A job's own index: its saves recorded each version readable, so the first quick
    verify lists the objects and reads no record and no node (issue 49: 4.3 s at 10,000
    versions, every record and tree read)."""
    with chunkstore.open(store_path, chunk_size=SMALL_CHUNK, create=True) as store:
        for step in range(VERSIONS_SAVED):
            _save(store, step)
        reads = _Reads(store.backend)
        store.backend = reads
        result = store.verify(read_data=False)
        store.backend = reads.inner
    assert result.ok and result.versions_trusted == VERSIONS_SAVED
    assert [v.entries for v in result.versions] == [3] * VERSIONS_SAVED
    assert reads.manifests == 0


def test_a_version_removed_after_its_save_recorded_it_is_trusted_no_more(
        store_path: Path, saved: list[str]) -> None:
    with chunkstore.open(store_path, create=False) as store:
        store.delete(saved[0])
        assert store.index.verified_versions(saved).keys() == set(saved[1:])
        assert store.index.census(saved).keys() == set(saved[1:])
    assert _quick(store_path).versions_trusted == VERSIONS_SAVED - 1


def test_a_version_another_index_saved_is_read(store_path: Path, saved: list[str],
                                                 tmp_path: Path) -> None:
    """Counted in from the store, not built by this index's save: read whole once."""
    with chunkstore.open(store_path, create=False, index_dir=str(tmp_path / "other")) as other:
        theirs = _save(other, VERSIONS_SAVED)
    first = _quick(store_path)
    assert first.ok and first.versions_checked == VERSIONS_SAVED + 1
    assert first.versions_trusted == VERSIONS_SAVED  # theirs read
    with chunkstore.open(store_path, create=False) as store:
        assert not store.index.verified_versions([theirs])[theirs].by_its_save
    assert _quick(store_path).versions_trusted == VERSIONS_SAVED + 1


def test_a_version_whose_save_was_killed_after_its_record_is_read(store_path: Path) -> None:
    """SIGKILL between the commit record and the index update: the version is published,
    its save recorded nothing; the next open counts it in and the quick verify reads it."""
    assert _saved(store_path, 1, 2) == 0
    assert _saved(store_path, 3, 3, "kill-after-put:versions/:0") == -signal.SIGKILL
    with chunkstore.open(store_path, create=False) as store:
        ids = [info.id for info in store.versions()]
        assert len(ids) == 3
        assert set(store.index.verified_versions(ids)) == set(ids[:2])
        result = store.verify(read_data=False)
    assert result.ok and result.versions_trusted == 2
    assert _quick(store_path).versions_trusted == 3


class _Keys(RequestHook):
    """The keys read (GET, ranged or not)."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self.read: set[str] = set()

    def request(self, operation: str, key: str) -> None:
        if operation in ("get", "get_range"):
            self.read.add(key)


def test_on_s3_a_quick_verify_trusts_its_saves_and_reads_another_indexs(
        s3_endpoint: str, tmp_path: Path) -> None:
    """Two machines' indexes on one bucket (moto): A's quick verify reads none of the
    records A's saves wrote, reads the one B saved, and still names a pack of A's
    deleted from the bucket."""
    with two_indexes(s3_endpoint, tmp_path) as (a, b):
        mine = [_save(a, step) for step in range(2)]
        theirs = _save(b, 2)
        keys = _Keys(a.backend)
        a.backend = keys
        result = a.verify(read_data=False)
        a.backend = keys.inner
        assert result.ok and result.versions_checked == 3 and result.versions_trusted == 2
        assert VERSIONS.key(theirs) in keys.read
        assert not {VERSIONS.key(vid) for vid in mine} & keys.read
        own = set(a.index.version_refs(mine[1])) - set(a.index.version_refs(mine[0])) \
            - set(a.index.version_refs(theirs))
        victim = sorted(own)[0]
        a.backend.delete(CHUNKS.key(victim))
        found = a.verify(read_data=False)
        assert [v.id for v in found.versions if v.damaged] == [mine[1]]
        assert {p.kind for p in found.problems} == {"missing-chunk"}


def _flip_middle(path: Path) -> None:
    """Flip a bit of the stored object at ``path``, in place, in its middle."""
    damaged = bytearray(path.read_bytes())
    damaged[len(damaged) // 2] ^= 0x10
    path.write_bytes(bytes(damaged))


def _save_sharing_data(store: chunkstore.Store, step: int) -> str:
    """A version whose data node is the same in every version (one changing tensor)."""
    with store.new_version("r", step) as v:
        v.put("moving", np.full(2_000, step, dtype=np.float32))
        v.put_data("const", {"lr": 0.1})
    return v.info.id


@pytest.mark.parametrize("damaged_object", ["node", "record"])
def test_a_version_a_full_verify_found_damaged_is_not_trusted_after_it(
        store_path: Path, saved: list[str], damaged_object: str) -> None:
    """A node or commit record flipped in place after the version was remembered:
    --quick does not read it (documented), but once a full verify read it damaged, the
    index no longer holds it readable, so the next quick verify reads it and names it
    too."""
    with chunkstore.open(store_path, create=False) as store:
        root = store.read_record(saved[2]).root  # the root node only this version has
    damaged_path = store_path / (NODES.key(root) if damaged_object == "node"
                                 else VERSIONS.key(saved[2]))
    _flip_middle(damaged_path)
    assert _quick(store_path).ok  # trusted, as docs/recovery.md says
    with chunkstore.open(store_path, create=False) as store:
        full = store.verify()
    assert [v.id for v in full.versions if v.damaged] == [saved[2]]
    quick = _quick(store_path)
    assert [v.id for v in quick.versions if v.damaged] == [saved[2]]
    assert quick.versions_trusted == VERSIONS_SAVED - 1


def test_a_node_damaged_before_a_save_that_reused_it_is_trusted_with_that_save(
        store_path: Path) -> None:
    """What docs/recovery.md says a save's record gives up: a save reuses a stored node
    without reading it, so a node damaged before the save is trusted with its version
    by --quick; a full verify names both versions, and every later quick verify too."""
    with chunkstore.open(store_path, chunk_size=SMALL_CHUNK, create=True) as store:
        first = _save_sharing_data(store, 0)
        before = set(store.index.version_node_refs(first))
    for digest in before:
        _flip_middle(store_path / NODES.key(digest))
    with chunkstore.open(store_path, create=False) as store:
        second = _save_sharing_data(store, 1)
        assert set(store.index.version_node_refs(second)) & before  # reused, not read
        assert store.verify(read_data=False).versions_trusted == 2
        full = store.verify()
    assert {v.id for v in full.versions if v.damaged} == {first, second}
    quick = _quick(store_path)
    assert {v.id for v in quick.versions if v.damaged} == {first, second}


def test_a_damaged_node_a_trusted_version_shares_is_named_with_it(
        store_path: Path, tmp_path: Path) -> None:
    """The quick verify reads the version another index saved and finds a node damaged
    that a version this index's save recorded shares: both are named, as a quick verify
    before the saves' records named them, and neither is trusted after it."""
    with chunkstore.open(store_path, chunk_size=SMALL_CHUNK, create=True,
                         index_dir=str(tmp_path / "other")) as other:
        theirs = _save_sharing_data(other, 0)
    with chunkstore.open(store_path, create=False) as store:
        mine = _save_sharing_data(store, 1)
        shared = set(store.index.version_node_refs(mine)) \
            & set(store.index.version_node_refs(theirs))
        assert len(shared) == 1 and store.index.verified_versions([mine])[mine].by_its_save
    _flip_middle(store_path / NODES.key(shared.pop()))
    for _ in range(2):
        quick = _quick(store_path)
        assert {v.id for v in quick.versions if v.damaged} == {theirs, mine}
        assert quick.versions_trusted == 0
