"""``chunkstore repair STORE --from OTHER``: what is missing or damaged in STORE is
rewritten from OTHER's checked bytes, objects of every kind, and nothing whole is
ever replaced.

Real files, real LMDB, the moto S3 server for a mirror on S3, a repair SIGKILLed
mid-run and run again.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
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
from tests.s3server import create_bucket, remove_bucket, s3_endpoint, storage_options

__all__ = ["s3_endpoint"]  # the session fixture, re-exported so pytest finds it here

CHUNK = 4096
REPO = Path(__file__).resolve().parent.parent


def state(step: int) -> dict[str, np.ndarray]:
    """A tensor of several chunks that changes a little each step (deltas), a frozen
    one, and small ones (packed)."""
    big = np.random.default_rng(0).standard_normal(6 * CHUNK // 4).astype(np.float32)
    big[: step * 50] += np.float32(step)
    return {"model.big": big,
            "model.frozen": np.random.default_rng(1).standard_normal(3 * CHUNK // 4)
            .astype(np.float32),
            "model.bias": np.arange(40, dtype=np.float32) * step}


def fill(store: chunkstore.Store, steps: range = range(1, 5)) -> list[str]:
    store.pack_delta_chunks = False  # deltas as objects of their own too
    ids = []
    for step in steps:
        with store.new_version(run="r", step=step, meta={"step": step}) as v:
            for name, array in state(step).items():
                v.put(name, array)
            v.put_data("trainer", {"step": step})
        ids.append(v.info.id)
    return ids


def assert_whole(store: chunkstore.Store, ids: list[str]) -> None:
    assert store.verify().ok
    for step, version in enumerate(ids, start=1):
        reader = store.open_version(version)
        for name, array in state(step).items():
            assert reader.get(name).tobytes() == array.tobytes()
        assert reader.get_data("trainer") == {"step": step}


def objects_by_kind(store: chunkstore.Store, version: str) -> dict[str, Digest]:
    """One object of each kind the version needs: tree and data nodes, a standalone
    chunk, a delta chunk with its base, a pack."""
    record = store.read_record(version)
    flat = flatten(store.objects, record.root, store.node_cache)
    found: dict[str, Digest] = {"tree-node": record.root,
                                "data-node": sorted(flat.data_nodes())[0]}
    for leaf in flat.leaves.values():
        if not isinstance(leaf, TensorEntry):
            continue
        for shard in leaf.shards:
            for i, digest in enumerate(shard.chunks):
                location = shard.location(i)
                if location is not None:
                    found.setdefault("pack", location.pack)
                elif shard.chain(i):
                    found.setdefault("delta", digest)
                    found.setdefault("base", shard.chain(i)[0])
    for digest in flat.chunk_digests():
        head = parse_header(digest, store.objects.get_range(CHUNKS, digest, 0, HEADER.size + 32))
        if head.base is None and head.codec_id != PACK.id and digest != found.get("base"):
            found.setdefault("chunk", digest)
    assert set(found) == {"tree-node", "data-node", "pack", "delta", "base", "chunk"}, found
    return found


def damage(store: chunkstore.Store, kind: Any, key: Any, how: str) -> None:
    if how == "delete":
        store.objects.delete(kind, key)
        return
    data = bytearray(store.objects.get(kind, key))
    data[len(data) // 2] ^= 0x04
    store.objects.put(kind, key, bytes(data))


def files(root: Path) -> dict[str, tuple[int, int]]:
    """Every object file with its inode and mtime: a replaced file gets another inode."""
    return {str(p.relative_to(root)): (p.stat().st_ino, p.stat().st_mtime_ns)
            for p in root.rglob("*") if p.is_file()
            and p.relative_to(root).parts[0] in ("chunks", "nodes", "versions", "moved")}


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[Path, Path, list[str]]]:
    """A store and a whole copy of it made by sync (the mirror)."""
    local, mirror = tmp_path / "local", tmp_path / "mirror"
    with chunkstore.open(local, create=True, chunk_size=CHUNK, delta_depth=3) as store:
        ids = fill(store)
    assert chunkstore.sync(local, mirror).ok
    yield local, mirror, ids


@pytest.mark.parametrize("how", ["delete", "flip"])
def test_objects_of_every_kind_are_rewritten_and_nothing_whole_is_touched(
        pair: tuple[Path, Path, list[str]], how: str) -> None:
    """A commit record, a tree node, a data node, a standalone chunk, a delta, a delta
    base and a pack, each deleted or bit-flipped: repair names each, rewrites it from
    the mirror, every version reads back and verify is clean; every other object file
    is the same file as before (same inode and mtime)."""
    local, mirror, ids = pair
    with chunkstore.open(local) as store:
        victims = objects_by_kind(store, ids[-1])
        for name, digest in victims.items():
            damage(store, NODES if name.endswith("node") else CHUNKS, digest, how)
        if how == "flip":  # a missing record is a removed version: flip only
            damage(store, VERSIONS, ids[1], how)
        assert not store.verify().ok
    before = files(local)
    result = CliRunner().invoke(cli, ["repair", str(local), "--from", str(mirror), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    fixed = {f["digest"] for f in doc["fixed"]}
    assert fixed == {d.hex for d in victims.values()} | ({ids[1]} if how == "flip" else set())
    assert doc["ok"] and not doc["unfixed"] and not doc["problems_after"]
    with chunkstore.open(local) as store:
        assert_whole(store, ids)
    after = files(local)
    touched = {name for name in before if after.get(name) != before[name]}
    assert touched <= {name for name in after if any(d in name for d in fixed)}


def test_a_dry_run_changes_nothing_and_names_what_it_would_fix(
        pair: tuple[Path, Path, list[str]]) -> None:
    local, mirror, ids = pair
    with chunkstore.open(local) as store:
        victim = objects_by_kind(store, ids[-1])["chunk"]
        damage(store, CHUNKS, victim, "flip")
    before = files(local)
    result = CliRunner().invoke(cli, ["repair", "--dry-run", str(local), "--from",
                                      str(mirror)])
    assert result.exit_code == 3, result.output
    assert f"would fix chunk {victim.hex[:16]}" in result.output
    assert files(local) == before
    assert CliRunner().invoke(cli, ["repair", str(local), "--from", str(mirror)]).exit_code == 0
    assert CliRunner().invoke(cli, ["repair", "--dry-run", str(local), "--from",
                                    str(mirror)]).exit_code == 0


def test_damage_in_both_copies_is_reported_not_fixed(pair: tuple[Path, Path, list[str]]
                                                     ) -> None:
    """The mirror's copy of the object is damaged too: it is not written (a repair never
    moves bytes that fail their check); the command exits 3 naming the object, and the
    other damage is still fixed."""
    local, mirror, ids = pair
    with chunkstore.open(local) as store:
        victims = objects_by_kind(store, ids[-1])
        damage(store, CHUNKS, victims["chunk"], "flip")
        damage(store, CHUNKS, victims["pack"], "delete")
        damaged = store.objects.get(CHUNKS, victims["chunk"])
    with chunkstore.open(mirror) as other:
        damage(other, CHUNKS, victims["chunk"], "flip")
    result = CliRunner().invoke(cli, ["repair", str(local), "--from", str(mirror)])
    assert result.exit_code == 3, result.output
    assert f"not fixed: chunk {victims['chunk'].hex[:16]}" in result.output
    assert "still damaged" in result.output
    with chunkstore.open(local) as store:
        assert store.objects.get(CHUNKS, victims["chunk"]) == damaged
        assert store.objects.exists(CHUNKS, victims["pack"])


def test_a_mirror_on_s3_repairs_a_local_store(tmp_path: Path, s3_endpoint: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHUNKSTORE_CACHE_DIR", str(tmp_path / "cache"))
    bucket = create_bucket(s3_endpoint)
    try:
        url, options = f"s3://{bucket}/mirror", storage_options(s3_endpoint)
        local = tmp_path / "local"
        with chunkstore.open(local, create=True, chunk_size=CHUNK, delta_depth=3) as store:
            ids = fill(store)
        assert chunkstore.sync(local, url, dst_options=options).ok
        with chunkstore.open(local) as store:
            for digest in objects_by_kind(store, ids[2]).values():
                damage(store, NODES if store.objects.exists(NODES, digest) else CHUNKS,
                       digest, "delete")
        result = chunkstore.repair(local, url, ["r@3"], source_options=options)
        assert result.ok and len(result.fixed) == 6
        with chunkstore.open(local) as store:
            assert_whole(store, ids)
    finally:
        remove_bucket(s3_endpoint, bucket)


def test_the_mirror_holding_a_delta_against_another_base_gives_a_standalone_object(
        tmp_path: Path) -> None:
    """The other store holds the chunk as a delta against a base the damaged store's
    manifest does not list: repair writes a standalone encoding of its checked bytes,
    which the manifest reads."""
    local, other = tmp_path / "local", tmp_path / "other"
    with chunkstore.open(local, create=True, chunk_size=CHUNK, delta_depth=0) as store:
        with store.new_version(run="r", step=2) as v:
            v.put("model.big", state(2)["model.big"])
        version = v.info.id
        digest = store.open_version(version).entry("model.big").shards[0].chunks[0]
        damage(store, CHUNKS, digest, "delete")
    with chunkstore.open(other, create=True, chunk_size=CHUNK, delta_depth=3) as store:
        store.pack_delta_chunks = False
        for step in (1, 2):
            with store.new_version(run="r", step=step) as v:
                v.put("model.big", state(step)["model.big"])
        assert parse_header(digest, store.objects.get(CHUNKS, digest)).base is not None
    result = chunkstore.repair(local, other)
    assert result.ok and [f.digest for f in result.fixed] == [digest.hex]
    with chunkstore.open(local) as store:
        assert parse_header(digest, store.objects.get(CHUNKS, digest)).base is None
        assert store.open_version(version).get("model.big").tobytes() \
            == state(2)["model.big"].tobytes()


def test_bad_input_changes_nothing(pair: tuple[Path, Path, list[str]]) -> None:
    local, mirror, _ = pair
    before = files(local)
    for args in (["repair", str(local), "--from", str(local)],
                 ["repair", str(local), "--from", str(local.parent / "nowhere")],
                 ["repair", str(local), "nope@1", "--from", str(mirror)],
                 ["repair", str(local)]):
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 2, (args, result.output)
    assert files(local) == before
    assert not (local.parent / "nowhere").exists()


REPAIR_CHILD = """
import sys, chunkstore
from chunkstore.backends import local as backend
put = backend.LocalBackend.put
def slow_put(self, key, data):
    put(self, key, data)
    print("put", key, flush=True)
    import time; time.sleep(0.2)
backend.LocalBackend.put = slow_put
chunkstore.repair(sys.argv[1], sys.argv[2])
"""


def test_a_repair_killed_midway_leaves_objects_whole_and_a_rerun_finishes(
        pair: tuple[Path, Path, list[str]]) -> None:
    """SIGKILL after the first objects are written: every object is as it was or whole
    (verify names only what is still damaged), and a second repair finishes."""
    local, mirror, ids = pair
    with chunkstore.open(local) as store:
        for digest in objects_by_kind(store, ids[-1]).values():
            damage(store, NODES if store.objects.exists(NODES, digest) else CHUNKS, digest,
                   "flip")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.Popen([sys.executable, "-c", REPAIR_CHILD, str(local), str(mirror)],
                             stdout=subprocess.PIPE, text=True, env=env)
    assert child.stdout is not None
    deadline = time.monotonic() + 60
    while "put" not in child.stdout.readline():
        assert time.monotonic() < deadline and child.poll() is None
    child.send_signal(signal.SIGKILL)
    child.wait()
    child.stdout.close()
    with chunkstore.open(local) as store:
        found = store.verify()
        assert not found.ok and all(p.kind in ("corrupt-chunk", "corrupt-node", "missing-chunk")
                                    for p in found.problems)
    assert chunkstore.repair(local, mirror).ok
    with chunkstore.open(local) as store:
        assert_whole(store, ids)
    assert not [p for p in local.rglob("*") if ".tmp" in p.name]


def test_sync_verify_names_damage_already_there_and_verify_names_the_repair(
        pair: tuple[Path, Path, list[str]]) -> None:
    """A local object deleted after the mirror has the version: ``sync MIRROR LOCAL
    r@4 --verify`` finds the version already there, reads it back, exits 1 and names
    the repair (it said "1 already there" and exited 0); ``verify`` names it too; after
    the repair both are clean."""
    local, mirror, ids = pair
    with chunkstore.open(local) as store:
        damage(store, CHUNKS, objects_by_kind(store, ids[-1])["pack"], "delete")
    result = CliRunner().invoke(cli, ["sync", str(mirror), str(local), "r@4", "--verify"])
    assert result.exit_code == 1, result.output
    assert "1 already there" in result.output and "chunkstore repair" in result.output
    result = CliRunner().invoke(cli, ["verify", str(local)])
    assert result.exit_code == 1 and f"chunkstore repair {local} --from OTHER" in result.output
    assert CliRunner().invoke(cli, ["repair", str(local), "--from", str(mirror)]).exit_code == 0
    result = CliRunner().invoke(cli, ["sync", str(mirror), str(local), "r@4", "--verify"])
    assert result.exit_code == 0, result.output
    assert CliRunner().invoke(cli, ["verify", str(local)]).exit_code == 0


def test_locations_that_are_no_store_are_typed_errors(pair: tuple[Path, Path, list[str]]
                                                      ) -> None:
    local, mirror, _ = pair
    for store, source in ((123, mirror), (local, None), (local, local),
                          (local, local / ".." / local.name)):
        with pytest.raises(chunkstore.errors.InvalidInputError):
            chunkstore.repair(store, source)  # type: ignore[arg-type]
