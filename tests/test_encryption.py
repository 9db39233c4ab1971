"""Encrypted stores (docs/format.md §13): every object sealed in the object layer, chunk
ids keyed, the master key wrapped by key objects; real stores, local and on the S3 server.

Each safety test was broken once (see the commit that adds it) and seen to fail.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import blake3
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import chunkstore
from chunkstore.codecs import PACK
from chunkstore.errors import (
    CorruptChunkError,
    CorruptConfigError,
    EncryptionError,
    IntegrityError,
    NotEncryptedError,
    PasswordRequiredError,
    WrongPasswordError,
)
from chunkstore.format import plaindata
from chunkstore.format.chunkobj import HEADER, parse_header
from chunkstore.format.chunkobj import MAGIC as CHUNK_MAGIC
from chunkstore.maintenance.readback import ReadBack
from chunkstore.objects import crypto
from chunkstore.objects.crypto import SEGMENT_OVERHEAD, AuthenticationError, Sealer, plain_size
from chunkstore.objects.keys import TEST_KDF_ENV, unlock
from chunkstore.objects.kinds import CHUNKS, NODES, VERSIONS
from chunkstore.objects.sealed import SealedObjects
from tests.conftest import tree_snapshot
from tests.s3server import create_bucket, remove_bucket, s3_endpoint, storage_options

__all__ = ["s3_endpoint"]  # the session fixture, re-exported so pytest finds it here

PASSWORD = "correct horse battery staple"
CHUNK = 256 * 1024  # chunks of four segments and more


@pytest.fixture(autouse=True)
def _fast_kdf(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TEST_KDF_ENV, "1")  # the documented test-only scrypt cost


def _open(url: str | Path, **kwargs: Any) -> chunkstore.Store:
    kwargs.setdefault("password", PASSWORD)
    return chunkstore.open(url, **kwargs)


def _create(url: str | Path, **kwargs: Any) -> chunkstore.Store:
    return _open(url, create=True, encrypt=True, chunk_size=CHUNK, pack_size=64 * 1024,
                 **kwargs)


class State:
    """Four versions: a large tensor updated sparsely (deltas), small ones (packs)."""

    def __init__(self) -> None:
        rng = np.random.default_rng(0)
        self.big = rng.standard_normal(300_000).astype(np.float32)  # 1.2 MB: 5 chunks
        self.small = {f"layer{i}.bias": rng.standard_normal(64).astype(np.float32)
                      for i in range(20)}

    def save(self, store: chunkstore.Store, steps: range = range(1, 5)) -> None:
        for step in steps:
            self.big[:: 97 * step] += 1.0
            with store.new_version(run="r", step=step) as version:
                version.put("w", self.big)
                for name, array in self.small.items():
                    version.put(name, array + step)
                version.put_data("trainer", {"step": step})

    def check(self, store: chunkstore.Store, selector: str = "r@4") -> None:
        reader = store.open_version(selector)
        np.testing.assert_array_equal(reader.get("w"), self.big)
        out = np.empty_like(self.big)
        reader.get_into("w", out)
        np.testing.assert_array_equal(out, self.big)
        np.testing.assert_array_equal(reader.get("layer3.bias"), self.small["layer3.bias"] + 4)
        assert reader.get_data("trainer") == {"step": 4}


def _stored_plainly(path: Path) -> tuple[set[str], list[Path]]:
    """The kinds of object stored under ``path``, and the objects that hold a plain
    encoding (JSON, a chunk object's magic, a format name), the config aside.  (Unlike
    tests/test_architecture.py's, a first byte ``{`` alone is no sign: a random nonce
    starts so once in 256.)"""
    stored = [p for p in path.rglob("*") if p.is_file() and "index" not in p.parts
              and p.name != "chunkstore.json"]
    plain = []
    for p in stored:
        data = p.read_bytes()
        try:
            json.loads(data)
            plain.append(p)
        except ValueError:
            if data.startswith(CHUNK_MAGIC) or b"format_version" in data or b'"run"' in data:
                plain.append(p)
    return {p.relative_to(path).parts[0] for p in stored}, plain


# --- round trips -------------------------------------------------------------------------------


def test_every_object_kind_round_trips_sealed(tmp_path: Path, read_mode: str) -> None:
    """Saves (packs, standalone chunks, deltas, nodes, records, tags, sessions), reads
    (copied and mapped), verify, removal and GC work on an encrypted store, and no
    object but the config and key objects holds a plain encoding."""
    path, state = tmp_path / "s", State()
    with _create(path) as store:
        assert isinstance(store.objects, SealedObjects)
        state.save(store)
        store.tag("r@4", "best")
        store.delete("r@1")
        kinds, plain = _stored_plainly(path)
        assert {"chunks", "nodes", "versions", "tags", "removed", "keys"} <= kinds
        assert [p for p in plain if p.parts[-2] != "keys"] == []
        assert store.gc(grace=0).chunks_deleted > 0
        assert store.verify().ok
        state.check(store, "best")
    kinds, plain = _stored_plainly(path)
    assert "gc" in kinds
    assert [p for p in plain if p.parts[-2] != "keys"] == []
    with _open(path) as store:  # a fresh handle: everything read from the store
        state.check(store, "best")
        assert [v.step for v in store.versions()] == [2, 3, 4]


@pytest.mark.s3
def test_round_trip_on_s3(s3_endpoint: str, tmp_path: Path,
                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHUNKSTORE_CACHE_DIR", str(tmp_path / "cache"))
    bucket = create_bucket(s3_endpoint)
    url, options = f"s3://{bucket}/ckpts", storage_options(s3_endpoint)
    try:
        state = State()
        with _create(url, storage_options=options) as store:
            state.save(store)
            store.tag("r@4", "best")
            store.delete("r@1")
            store.gc(grace=0)
            assert store.verify().ok
        with _open(url, storage_options=options,
                   index_dir=str(tmp_path / "other-index")) as store:
            state.check(store, "best")
            assert store.verify().ok
        with pytest.raises(WrongPasswordError):
            _open(url, storage_options=options, password="wrong")
    finally:
        remove_bucket(s3_endpoint, bucket)


def test_chunk_ids_are_keyed_and_dedup_stays_in_the_store(tmp_path: Path) -> None:
    state = State()
    with _create(tmp_path / "a") as a, _create(tmp_path / "b") as b:
        state.save(a, range(1, 2))
        state.big[:: 97] -= 1.0  # the same state again, into b
        state.save(b, range(1, 2))
        ids_a, ids_b = set(a.objects.ids(CHUNKS)), set(b.objects.ids(CHUNKS))
        assert ids_a and not ids_a & ids_b, "two stores' master keys name chunks apart"
        plain = {blake3.blake3(state.big.tobytes()[i:i + CHUNK]).digest()
                 for i in range(0, state.big.nbytes, CHUNK)}
        assert not plain & {d.raw for d in ids_a}, "a chunk id is its content's plain hash"
        # A re-save of unchanged state writes no chunk: dedup works under keyed ids.
        with a.new_version(run="r", step=2) as version:
            version.put("w", state.big)
        assert set(a.objects.ids(CHUNKS)) == ids_a
        assert version.info.new_bytes == 0


# --- passwords ---------------------------------------------------------------------------------


def test_a_wrong_or_missing_password_is_refused_and_changes_nothing(tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "s"
    with _create(path) as store:
        State().save(store, range(1, 2))
    before = tree_snapshot(path)
    with pytest.raises(WrongPasswordError, match="wrong password"):
        _open(path, password="not it")
    monkeypatch.delenv("CHUNKSTORE_PASSWORD", raising=False)
    monkeypatch.delenv("CHUNKSTORE_PASSWORD_FILE", raising=False)
    with pytest.raises(PasswordRequiredError, match="encrypted and no password"):
        chunkstore.open(path)
    assert tree_snapshot(path) == before
    monkeypatch.setenv("CHUNKSTORE_PASSWORD", PASSWORD)  # the environment's, as the CLI's
    with chunkstore.open(path) as store:
        assert [v.step for v in store.versions()] == [1]


def test_a_plain_store_refuses_a_password_and_encrypt(tmp_path: Path) -> None:
    path = tmp_path / "s"
    chunkstore.open(path, create=True).close()
    before = tree_snapshot(path)
    with pytest.raises(NotEncryptedError, match="not encrypted"):
        chunkstore.open(path, password=PASSWORD)
    with pytest.raises(EncryptionError, match="chosen when a store is created"):
        chunkstore.open(path, encrypt=True, password=PASSWORD)
    with pytest.raises(PasswordRequiredError):
        chunkstore.open(tmp_path / "new", create=True, encrypt=True)
    with pytest.raises(NotEncryptedError, match="without encrypt=True"):
        chunkstore.open(tmp_path / "new", create=True, password=PASSWORD)
    assert not (tmp_path / "new").exists()
    assert tree_snapshot(path) == before


# --- tampering ---------------------------------------------------------------------------------


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _objects_of(store: chunkstore.Store) -> dict[str, Path]:
    """A standalone chunk, a pack, the newest version's root node and commit record."""
    root = Path(store.url)
    found: dict[str, Path] = {}
    for digest in store.objects.ids(CHUNKS):
        header = parse_header(digest, store.objects.get_range(CHUNKS, digest, 0, HEADER.size + 32))
        name = "pack" if header.codec_id == PACK.id else "chunk"
        if name == "chunk" and store.objects.stat(CHUNKS, digest).size < 3 * 65536:
            continue  # a chunk of one segment: the segments test wants several
        found.setdefault(name, root / CHUNKS.key(digest))
    latest = store.latest("r")
    assert latest is not None
    found["node"] = root / NODES.key(latest.root)
    found["record"] = root / VERSIONS.key(latest.id)
    return found


@pytest.fixture
def saved(tmp_path: Path) -> Iterator[tuple[Path, State]]:
    path, state = tmp_path / "s", State()
    with _create(path) as store:
        store.pack_delta_chunks = False  # the large tensor's chunks: objects of their own
        state.save(store, range(1, 3))
    yield path, state


@pytest.mark.parametrize("kind", ["chunk", "pack", "node", "record"])
@pytest.mark.parametrize("where", ["nonce", "ciphertext", "tag"])
def test_a_flipped_bit_is_corruption_never_data(saved: tuple[Path, State], kind: str,
                                                where: str) -> None:
    """A bit flipped in a sealed chunk, pack (one member), node or commit record is
    a typed integrity error on read and a problem verify names with its version."""
    path, _ = saved
    with _open(path) as store:
        victim = _objects_of(store)[kind]
        newest = store.latest("r")
        ids = {v.id for v in store.versions()}
    assert newest is not None
    size = victim.stat().st_size
    offset = {"nonce": 3, "ciphertext": min(size, 65536) // 2, "tag": min(size, 65564) - 5}
    if kind == "pack":  # sealed member by member (version 13): the last member's tag
        index = int.from_bytes(victim.read_bytes()[-4:], "big")
        offset["tag"] = size - 4 - index - 5
    _flip(victim, offset[where])
    with _open(path) as store:
        result = store.verify()
        assert not result.ok
        kinds = {p.kind for p in result.problems}
        assert kinds & {"corrupt-chunk", "corrupt-node", "corrupt-record"}, result.problems
        damaged = {p.version for p in result.problems}
        assert None not in damaged and damaged <= ids
        if kind == "node":
            assert damaged == {newest.id}
        if kind == "record":  # its tree is intact: verify names the record alone
            assert (kinds, damaged) == ({"corrupt-record"}, {newest.id})
            return
        for version_id in damaged:
            with pytest.raises(IntegrityError):
                reader = store.open_version(version_id)
                for name in reader.names():
                    reader.get(name) if name != "trainer" else reader.get_data(name)
        for version_id in ids - damaged:
            assert store.open_version(version_id).get_data("trainer")


def test_an_object_renamed_to_another_id_fails(saved: tuple[Path, State]) -> None:
    path, _ = saved
    with _open(path) as store:
        chunks = [d for d in store.objects.ids(CHUNKS)]
        a, b = chunks[0], chunks[1]
        (path / CHUNKS.key(b)).write_bytes((path / CHUNKS.key(a)).read_bytes())
        with pytest.raises(CorruptChunkError, match="fails authentication"):
            store.objects.get(CHUNKS, b)
        with pytest.raises(CorruptChunkError):
            store.objects.get_range(CHUNKS, b, 10, 20)
        assert not store.verify().ok


def test_moved_and_truncated_segments_fail(saved: tuple[Path, State]) -> None:
    path, _ = saved
    with _open(path) as store:
        victim = _objects_of(store)["chunk"]
        digest = CHUNKS.id_of(victim.relative_to(path).as_posix())
        original = victim.read_bytes()
        step = store.objects.sealer.segment + SEGMENT_OVERHEAD
        assert len(original) > 2 * step
        swapped = original[step:2 * step] + original[:step] + original[2 * step:]
        truncated = original[:step * (len(original) // step)]
        for damaged in (swapped, truncated, original[:-1], original + b"\0"):
            victim.write_bytes(damaged)
            with pytest.raises(CorruptChunkError):
                store.objects.get(CHUNKS, digest)
        victim.write_bytes(swapped)
        with pytest.raises(CorruptChunkError):  # a ranged read meets the moved segment
            store.objects.get_range(CHUNKS, digest, step, 100)


def test_checkpointer_saves_and_restores_and_falls_back_on_an_encrypted_store(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Checkpointer, unchanged but for the password: async saves into an encrypted
    store, a restore in a fresh Checkpointer (password from CHUNKSTORE_PASSWORD), and a
    fallback past a newest version whose sealed root node was tampered with."""
    torch = pytest.importorskip("torch")
    from torch_bridge import Checkpointer, RestoreFallbackWarning

    def model_of(seed: int) -> Any:
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 8))

    model, path = model_of(0), tmp_path / "s"
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    states = []
    with _create(path) as store, Checkpointer(store, run="r", async_save=True) as ckpt:
        for step in (1, 2):
            optimizer.zero_grad()
            model(torch.randn(4, 64)).pow(2).mean().backward()
            optimizer.step()
            ckpt.save(step, model=model, optimizer=optimizer)
            states.append({k: v.clone() for k, v in model.state_dict().items()})
        ckpt.wait()
    monkeypatch.setenv("CHUNKSTORE_PASSWORD", PASSWORD)
    fresh = model_of(9)
    optimizer = torch.optim.Adam(fresh.parameters(), lr=0.01)
    with Checkpointer(path, run="r") as ckpt:
        assert ckpt.restore(model=fresh, optimizer=optimizer) == 2
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in states[1].items())
    with chunkstore.open(path) as store:
        _flip(_objects_of(store)["node"], 40)
    with Checkpointer(path, run="r") as ckpt, pytest.warns(RestoreFallbackWarning,
                                                           match="restored step 1"):
        assert ckpt.restore(model=fresh, optimizer=optimizer) == 1
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in states[0].items())


def test_sync_and_repair_refuse_stores_keyed_apart(tmp_path: Path) -> None:
    """A plain store and an encrypted one (or two encrypted ones) name chunks apart: a
    copy by key between them is refused, typed, and changes nothing."""
    with _create(tmp_path / "enc") as enc:
        State().save(enc, range(1, 2))
    with chunkstore.open(tmp_path / "plain", create=True, chunk_size=CHUNK) as plain:
        State().save(plain, range(1, 2))
    with _create(tmp_path / "other") as other:
        other_before = tree_snapshot(tmp_path / "other")
    plain_before = tree_snapshot(tmp_path / "plain")
    with _open(tmp_path / "enc") as enc, chunkstore.open(tmp_path / "plain") as plain, \
            _open(tmp_path / "other") as other:
        for src, dst in ((plain, enc), (enc, plain), (enc, other)):
            with pytest.raises(EncryptionError, match="nothing was copied"):
                chunkstore.sync(src, dst)
        with pytest.raises(EncryptionError):
            chunkstore.repair(plain, enc)
    assert tree_snapshot(tmp_path / "plain") == plain_before
    assert tree_snapshot(tmp_path / "other") == other_before


def test_a_lost_config_of_an_encrypted_store_is_refused_not_recovered(tmp_path: Path) -> None:
    """A plain store's lost config is recovered from its records; an encrypted store's
    records are sealed, so it is refused with the fix, and nothing changes."""
    path = tmp_path / "s"
    with _create(path) as store:
        State().save(store, range(1, 2))
    config = (path / "chunkstore.json").read_bytes()
    (path / "chunkstore.json").unlink()
    before = tree_snapshot(path)
    for password in (PASSWORD, None):
        with pytest.raises(CorruptConfigError, match=r"encrypted .* copy of its"):
            chunkstore.open(path, password=password)
    assert tree_snapshot(path) == before
    (path / "chunkstore.json").write_bytes(config)
    with _open(path) as store:
        assert store.verify().ok


def test_many_indexes_on_one_encrypted_store(tmp_path: Path) -> None:
    """Two handles with indexes of their own (as on two machines): one saves and removes,
    the other collects; each sees the other's work through the sealed protocol objects
    (sessions, journal, tombstones) and every version left reads back."""
    path, state = tmp_path / "s", State()
    with _create(path, index_dir=str(tmp_path / "index-a")) as a:
        state.save(a, range(1, 3))
    with _open(path, index_dir=str(tmp_path / "index-b")) as b:
        assert [v.step for v in b.versions()] == [1, 2]
    with _open(path, index_dir=str(tmp_path / "index-a")) as a:
        state.save(a, range(3, 5))
        a.delete("r@1")
    with _open(path, index_dir=str(tmp_path / "index-b")) as b:  # learns a's saves, removal
        assert [v.step for v in b.versions()] == [2, 3, 4]
        assert b.gc(grace=0).chunks_deleted > 0
    with _open(path, index_dir=str(tmp_path / "index-a")) as a:  # learns b's deletions
        assert a.gc(grace=0).chunks_deleted == 0
    for index in ("index-a", "index-b"):
        with _open(path, index_dir=str(tmp_path / index)) as store:
            assert [v.step for v in store.versions()] == [2, 3, 4]
            state.check(store)
            assert store.verify().ok


def test_sync_creates_an_encrypted_copy_with_the_same_keys(tmp_path: Path) -> None:
    """A sync of an encrypted store into a new location makes its encrypted copy (the
    config and key objects: one master key, the same passwords), copies the versions as
    sealed objects by key, and syncs into it again later; the copy reads with the
    source's password and holds no plain object."""
    state = State()
    with _create(tmp_path / "src") as src:
        state.save(src, range(1, 3))
        result = chunkstore.sync(src, tmp_path / "copy")
        assert result.created and len(result.copied) == 2
        state.save(src, range(3, 5))
        assert len(chunkstore.sync(src, tmp_path / "copy").copied) == 2
    assert sorted(p.name for p in (tmp_path / "copy" / "keys").iterdir()) == \
        sorted(p.name for p in (tmp_path / "src" / "keys").iterdir())
    assert [p for p in _stored_plainly(tmp_path / "copy")[1] if p.parts[-2] != "keys"] == []
    with _open(tmp_path / "copy") as copy, _open(tmp_path / "src") as src:
        assert [v.step for v in copy.versions()] == [1, 2, 3, 4]
        state.check(copy)
        assert copy.verify().ok
        # a mirror's read-back checks its nodes under the store's keyed node ids
        read = ReadBack(copy, src, budget_bytes=1 << 30).step()
        assert read.objects_read and read.cycle_done and not read.damaged, read
    with pytest.raises(WrongPasswordError):
        _open(tmp_path / "copy", password="not it")


def test_a_tiered_checkpointer_mirrors_an_encrypted_store(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    from torch_bridge import Checkpointer
    monkeypatch.setenv("CHUNKSTORE_PASSWORD", PASSWORD)
    _create(tmp_path / "local").close()
    model = torch.nn.Linear(64, 64)
    with Checkpointer(tmp_path / "local", run="r", mirror=str(tmp_path / "mirror")) as ckpt:
        for step in (1, 2):
            ckpt.save(step, model=model)
        ckpt.wait(mirror=True, timeout=120)
        assert ckpt.mirror_pending == []
    with _open(tmp_path / "mirror") as mirror:
        assert isinstance(mirror.objects, SealedObjects)
        assert [v.step for v in mirror.versions()] == [1, 2]
        assert mirror.verify().ok


# --- crashes (tests/crash_child.py and test_gc's GC child, on an encrypted store) -----------


@pytest.mark.parametrize("fault", ["kill-before-put:chunks/:2", "kill-before-put:nodes/:0",
                                   "kill-before-put:versions/:0", "kill-after-put:versions/:0"])
def test_a_save_killed_into_an_encrypted_store_publishes_nothing_partial(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: str) -> None:
    """SIGKILL at each step of a save (real child processes, the password from the
    environment): what was published reads back exactly and verifies; a killed save
    is either whole or invisible; a later save completes."""
    from tests.conftest import SMALL_CHUNK
    from tests.test_crash import _check_store, run_child
    path = tmp_path / "s"
    chunkstore.open(path, chunk_size=SMALL_CHUNK, delta_depth=2, create=True, encrypt=True,
                    password=PASSWORD).close()
    monkeypatch.setenv("CHUNKSTORE_PASSWORD", PASSWORD)
    assert run_child(path, 1, 2, None).returncode == 0
    killed = run_child(path, 3, 3, fault)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    published = [1, 2, 3] if fault.startswith("kill-after-put:versions/") else [1, 2]
    _check_store(path, published)
    assert run_child(path, published[-1] + 1, published[-1] + 1, None).returncode == 0
    _check_store(path, [*published, published[-1] + 1])


@pytest.mark.parametrize("fault", ["kill-before-delete:chunks/:0", "kill-after-put:gc/:0"])
def test_a_gc_killed_in_an_encrypted_store_leaves_it_verifying(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: str) -> None:
    from tests.test_gc import GC_CHILD
    path, state = tmp_path / "s", State()
    with _create(path) as store:
        state.save(store)
        store.delete("r@1")
        store.delete("r@2")
    proc = subprocess.run([sys.executable, "-c", GC_CHILD, str(path)], capture_output=True,
                          env={**os.environ, "CHUNKSTORE_FAULT": fault,
                               "CHUNKSTORE_PASSWORD": PASSWORD},
                          cwd=Path(__file__).resolve().parent.parent, text=True, timeout=120,
                          check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    with _open(path) as store:
        assert store.verify().ok
        state.check(store)
        store.gc(grace=0)
        assert store.verify().ok
        state.check(store)


@pytest.mark.parametrize("operation", ["save", "gc", "repack"])
def test_every_power_cut_state_of_an_encrypted_store_keeps_what_was_published(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, operation: str) -> None:
    """The power-loss explorer (tools/crashstates.py) on an encrypted store: every state a
    cut could leave during a save, a GC and a repack opens (with the password), reads
    back what was published, verifies, takes a save and collects."""
    from tools.crashcheck import describe, explore
    from tools.crashscenarios import ENCRYPT_ENV_VAR, SCENARIOS
    monkeypatch.setenv(ENCRYPT_ENV_VAR, "1")
    monkeypatch.setenv("CHUNKSTORE_PASSWORD", PASSWORD)
    recording, expectations = SCENARIOS[operation](tmp_path / "store")
    assert (tmp_path / "store" / "keys").is_dir(), "the scenario's store is not encrypted"
    report = explore(operation, recording, expectations, tmp_path / "states", per_point=8,
                     limit=20)
    failures = [f"{describe(recording, state)}: {problems}"
                for state, problems in report.failures]
    assert not failures, "\n".join(failures)
    assert report.crash_points > 1 and report.checked > 1, report.summary()


# --- the sealer itself -------------------------------------------------------------------------


def _sealer(segment: int = 4096) -> Sealer:
    return Sealer(os.urandom(32), segment)


@settings(max_examples=60, deadline=None)
@given(data=st.binary(min_size=0, max_size=20_000), start=st.integers(0, 21_000),
       length=st.integers(0, 21_000))
def test_ranged_reads_open_any_range(data: bytes, start: int, length: int) -> None:
    sealer = _sealer()
    stored = bytes(sealer.seal("chunks/ab/x", data))
    assert plain_size(len(stored), sealer.segment) == len(data)
    assert bytes(sealer.open("chunks/ab/x", stored)) == data
    at, size = sealer.span(start, length)
    out = bytearray(length)
    written = sealer.open_into("chunks/ab/x", start, stored[at:at + size], memoryview(out),
                               start % sealer.segment)
    assert bytes(out[:written]) == data[start:start + length]
    with pytest.raises(AuthenticationError):
        sealer.open("chunks/ab/y", stored)  # another object's name


@settings(max_examples=60, deadline=None)
@given(data=st.binary(min_size=0, max_size=20_000),
       cuts=st.lists(st.integers(0, 20_000), max_size=8))
def test_an_encoding_in_pieces_is_sealed_as_the_pieces_joined(data: bytes,
                                                              cuts: list[int]) -> None:
    """A pack reaches the sealer as its pieces (header, members' headers and payloads),
    segments straddling them: the stored bytes are those of the pieces joined."""
    bounds = sorted({0, len(data), *(cut for cut in cuts if cut <= len(data))})
    pieces: list[bytes | memoryview] = [memoryview(data)[a:b]
                                        for a, b in itertools.pairwise(bounds)]
    sealer, salt = _sealer(), os.urandom(12)
    with pytest.MonkeyPatch.context() as patch:  # both writes draw the same salt
        patch.setattr(crypto, "random_source", lambda size: salt)
        stored = bytes(sealer.seal("chunks/ab/p", pieces))
        assert stored == bytes(sealer.seal("chunks/ab/p", data))
    assert bytes(sealer.open("chunks/ab/p", stored)) == data


@settings(max_examples=60, deadline=None)
@given(data=st.binary(min_size=32, max_size=12_000))
def test_ciphertext_never_holds_a_window_of_the_plaintext(data: bytes) -> None:
    stored = bytes(_sealer().seal("chunks/00/c", data))
    windows = {data[i:i + 32] for i in range(len(data) - 31)}
    assert not any(stored[i:i + 32] in windows for i in range(len(stored) - 31))


# --- the frozen encrypted store (tools/make_encrypted_fixture.py) ------------------------------

DATA = Path(__file__).resolve().parent / "data"
#: Each frozen encrypted store and its store version: encrypted-v1 was written before
#: version 12 (random nonces, plain node ids), encrypted-v2 before version 13 (packs
#: sealed whole); both are read, never rebuilt.
FIXTURES = {"encrypted-v1": 10, "encrypted-v2": 12, "encrypted-v3": 13}


def _fixture_tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "make_encrypted_fixture", DATA.parent.parent / "tools" / "make_encrypted_fixture.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _expected(fixture: str) -> dict[str, Any]:
    result: dict[str, Any] = json.loads((DATA / f"{fixture}.expected.json").read_text())
    return result


@pytest.mark.parametrize("fixture", sorted(FIXTURES))
def test_the_encrypted_fixture_is_unchanged_and_reads_back(tmp_path: Path,
                                                           fixture: str) -> None:
    tool, expected = _fixture_tool(), _expected(fixture)
    copy = tmp_path / fixture
    shutil.copytree(DATA / fixture, copy)
    assert tool.files_of(copy) == expected["files"], "never edit a fixture"
    config = json.loads((copy / "chunkstore.json").read_bytes())
    assert (config["format_version"], config["encryption"]["cipher"]) \
        == (FIXTURES[fixture], "aes-256-gcm")
    with pytest.raises(WrongPasswordError):
        chunkstore.open(copy, password="not it")
    with chunkstore.open(copy, password=expected["password"]) as store:
        assert store.config.encryption is not None
        master, _ = unlock(store.objects, store.url, store.config.identity(),
                           expected["password"], store.config.encryption.sealing)
        assert master.hex() == expected["master_key"]
        assert [(v.id, v.step) for v in store.versions()] == [
            (v["id"], v["step"]) for v in expected["versions"]]
        for want in expected["versions"]:
            reader = store.open_version(want["id"])
            assert {name: tool.tensor_hash(reader.get(name)) for name in want["tensors"]} \
                == want["tensors"]
            assert {name: plaindata.to_tree(reader.get_data(name)) for name in want["data"]} \
                == want["data"]
        assert store.resolve(expected["tag"]).step == 1
        assert store.verify().ok


def test_today_s_writer_rebuilds_the_encrypted_fixture_byte_for_byte(tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With the fixture's seeded random bytes and clock, a save writes exactly the frozen
    bytes: the segment layout, nonces, per-object keys, associated data, keyed ids and
    key object of §13 cannot change by accident."""
    monkeypatch.delenv(TEST_KDF_ENV)  # the fixture's key has the real scrypt cost
    tool = _fixture_tool()
    assert FIXTURES[tool.FIXTURE] == 13
    tool.build(tmp_path / tool.FIXTURE)
    assert tool.files_of(tmp_path / tool.FIXTURE) == _expected(tool.FIXTURE)["files"]


def test_a_version_10_store_keeps_its_sealing_and_a_copy_into_12_is_refused(
        tmp_path: Path) -> None:
    """encrypted-v1 (store version 10) still takes saves, sealed as before (random nonces,
    plain node ids) and read back; a sync or repair between it and encrypted-v2 (the same
    master key and chunk ids, node ids keyed apart) is refused and changes nothing."""
    copies = {}
    for fixture in FIXTURES:
        copies[fixture] = tmp_path / fixture
        shutil.copytree(DATA / fixture, copies[fixture])
    password = _expected("encrypted-v1")["password"]
    assert password == _expected("encrypted-v2")["password"]
    with chunkstore.open(copies["encrypted-v1"], password=password) as old:
        assert old.config.encryption is not None and old.config.encryption.sealing == 1
        assert isinstance(old.objects, SealedObjects) and not old.objects.sealer.salted
        with old.new_version(run="enc", step=3) as version:
            version.put_data("note", {"step": 4})
        root = old.resolve("enc@3").root
        node = old.objects.get(NODES, root)
        assert blake3.blake3(node).digest() == root.raw  # plain node ids, as version 10's
        assert old.open_version("enc@3").get_data("note") == {"step": 4}
        assert old.verify().ok
        refuses_copies_both_ways(old, copies["encrypted-v2"], password,
                                 r"keyed ids.*nothing was copied")
    assert json.loads((copies["encrypted-v1"] / "chunkstore.json").read_bytes()
                      )["format_version"] == 10


def refuses_copies_both_ways(old: chunkstore.Store, other: Path, password: str,
                             match: str) -> None:
    """The store at ``other`` shares ``old``'s key but not its sealing: sync either way
    raises :class:`EncryptionError` matching ``match``, repair raises too, and nothing
    under ``other`` changes."""
    before = tree_snapshot(other)
    with chunkstore.open(other, password=password) as new:
        assert new.objects.chunk_ids == old.objects.chunk_ids
        for src, dst in ((old, new), (new, old)):
            with pytest.raises(EncryptionError, match=match):
                chunkstore.sync(src, dst)
        with pytest.raises(EncryptionError):
            chunkstore.repair(new, old)
    assert tree_snapshot(other) == before


def test_a_damaged_copy_of_a_pack_is_replaced_by_the_save_that_writes_it_again(
        tmp_path: Path) -> None:
    """A save hands its packs to the object layer as pieces, sealed straight from them;
    where a copy of the pack is stored already and fails authentication (an orphan a
    save with another index left, then damaged), the save stores the pieces again,
    sealed whole under a fresh salt, and the version reads back."""
    state = {f"b{i}": np.full(100, i, np.float32) for i in range(20)}

    def save(index: str, step: int) -> None:
        with chunkstore.open(tmp_path / "s", create=True, encrypt=True, password="pw",
                             index_dir=str(tmp_path / index)) as store, \
                store.new_version(run=f"r{step}", step=step) as version:
            for name, array in state.items():  # no parent: nothing reused through one
                version.put(name, array)

    save("first", 0)
    (pack,) = [p for p in (tmp_path / "s" / "chunks").rglob("*") if p.is_file()]
    good = pack.read_bytes()
    pack.chmod(0o644)
    damaged = good[:-1] + bytes([good[-1] ^ 1])
    pack.write_bytes(damaged)
    save("second", 1)  # an index that never saw the pack: it writes it, finds the copy
    assert pack.read_bytes() not in (damaged, good) and len(pack.read_bytes()) == len(good)
    outs = {name: np.empty_like(array) for name, array in state.items()}
    with chunkstore.open(tmp_path / "s", password="pw", index_dir=str(tmp_path / "second")
                         ) as store:
        store.open_version("r1@1").get_many_into((name, out, None) for name, out in outs.items())
    assert all(np.array_equal(outs[name], array) for name, array in state.items())


@pytest.mark.parametrize("encrypt", [True, False])
def test_a_damaged_orphan_pack_is_replaced_by_the_save_that_writes_it_again(
        tmp_path: Path, encrypt: bool) -> None:
    """The pack of a large tensor's chunks (policy none) goes to the object layer as its
    pieces (joined there, or sealed straight from them); where a damaged copy is stored
    already (an orphan: its version was removed, so another index never heard of it),
    the save finds it, and stores the pieces again whole."""
    state = {"big": np.arange(300_000, dtype=np.float32)}
    password = "pw" if encrypt else None

    def opened(index: str) -> chunkstore.Store:
        return chunkstore.open(tmp_path / "s", create=True, encrypt=encrypt, password=password,
                               compression="none", index_dir=str(tmp_path / index))

    with opened("first") as store:
        with store.new_version(run="r", step=0) as version:
            version.put("big", state["big"])
        store.delete("r@0")  # the chunk stays, referenced by no version, until a GC
    (chunk,) = [p for p in (tmp_path / "s" / "chunks").rglob("*") if p.is_file()]  # the pack
    good = chunk.read_bytes()
    chunk.chmod(0o644)
    damaged = good[:-1] + bytes([good[-1] ^ 1])
    chunk.write_bytes(damaged)
    with opened("second") as store:
        with store.new_version(run="r", step=1) as version:
            version.put("big", state["big"])
        assert chunk.read_bytes() != damaged and len(chunk.read_bytes()) == len(good)
        out = np.empty_like(state["big"])
        store.open_version("r@1").get_many_into([("big", out, None)])
    assert np.array_equal(out, state["big"])
