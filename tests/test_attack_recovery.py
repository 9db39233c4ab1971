"""Adversarial review of the recovery paths: sync's checks, repair, the mirror's
read-back and GC's fenced moved-record deletion.

Each test is one attack on the promise "every copy checks: bytes that move between
stores are hash-checked before anything publishes them; no path overwrites an object
that passes its check; a failure is never reported as success", on "a crash at any
instant leaves every published version loadable" and on "bad input gets a typed
error and changes nothing".  A test that holds stays as a regression test; one that
found a hole is marked ``xfail(strict=True)`` with the hole in one line.

Real files, real LMDB, real subprocesses (SIGKILL, SIGSTOP) and a real tmpfs.
Crafted inputs are written the way a hostile or buggy writer would: a manifest node
that hashes to its key but lists the wrong members, a moved record that parses but
maps members wrongly, a data node that hashes right but does not parse.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import chunkstore
from chunkstore.backends.wrappers import ForwardingBackend
from chunkstore.errors import ChunkStoreError
from chunkstore.format.digest import Digest
from chunkstore.format.manifest import TensorEntry
from chunkstore.handle.tree import flatten
from chunkstore.maintenance.readback import ReadBack
from chunkstore.objects.kinds import CHUNKS, MOVED, NODES, VERSIONS
from tests.test_full_disk import PREFIX
from tests.test_sync import save
from tests.test_sync import state as sync_state

REPO = Path(__file__).resolve().parent.parent
CHUNK = 4096


# --- helpers --------------------------------------------------------------------------------


def small_state(step: int, shared: int = 0) -> dict[str, np.ndarray]:
    """Ten small tensors of one size (packed together, 2 KiB members of equal length);
    the first ``shared`` are the same every step."""
    return {f"t{i}": np.random.default_rng(i if i < shared else 100 * step + i)
            .standard_normal(500).astype(np.float32) for i in range(10)}


def save_small(store: chunkstore.Store, run: str, step: int, shared: int = 0) -> str:
    with store.new_version(run=run, step=step) as v:
        for name, array in small_state(step, shared).items():
            v.put(name, array)
        v.put_data("trainer", {"step": step})
    return v.info.id


def node_json(store: chunkstore.Store, digest: Digest) -> dict[str, Any]:
    return json.loads(store.objects.get(NODES, digest))


def dumps(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def craft_version(path: Path, base: str, step: int,
                  edit: Callable[[chunkstore.Store, dict[str, Any]], None]) -> str:
    """A version of ``base``'s run at ``step`` whose root node is ``base``'s edited by
    ``edit``: every object hashes to its key (node, record), so only a read that
    decodes what the node lists can tell it is wrong.  Published by an index rebuild."""
    with chunkstore.open(path) as store:
        record = json.loads(store.objects.get(VERSIONS, base))
        root = node_json(store, Digest.parse(record["root"]))
        edit(store, root)
        data = dumps(root)
        digest = Digest.of(data)
        store.objects.put(NODES, digest, data)
        record.update(root=digest.hex, step=step, parent=base)
        record_bytes = dumps(record)
        version = Digest.of(record_bytes).hex
        store.objects.put(VERSIONS, version, record_bytes)
        store.rebuild_index()
        return version


def packs_of(entry: dict[str, Any]) -> list[list[Any]]:
    """The pack locations a tensor entry of a tree node's JSON lists (one chunk each)."""
    return entry["tensor"]["shards"][0]["packs"]


def readable(store: chunkstore.Store, version: str) -> bool:
    """Whether every entry of ``version`` reads back (hash-checked)."""
    try:
        reader = store.open_version(version)
        for name in reader.names():
            entry = reader.entry(name)
            if isinstance(entry, TensorEntry):
                reader.get(name)
            else:
                reader.get_data(name)
    except ChunkStoreError:
        return False
    return True


def tree_files(root: Path) -> dict[str, bytes]:
    """Every stored object's bytes (the index and temp files aside)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not str(p.relative_to(root)).startswith(("index", "sessions"))}


def repacked_source(path: Path) -> tuple[str, Digest, Digest]:
    """A source whose step-1 pack was repacked (old pack gone, a moved record to the new
    one): the kept version, the old pack and the pack it moved to."""
    with chunkstore.open(path, create=True, chunk_size=CHUNK, delta_depth=0) as src:
        old = save_small(src, "a", 1, shared=4)
        keep = save_small(src, "a", 2, shared=4)
        src.delete(old)
        assert src.gc(grace=0, repack_unused=0.01).packs_repacked > 0
        moved = list(src.objects.ids(MOVED))
        assert moved, "the GC must have repacked a pack"
        record = json.loads(src.objects.get(MOVED, moved[0]))
        return keep, moved[0], Digest.parse(record["to"])


# --- 1. crafted inputs to sync -------------------------------------------------------------


def _swap_members(_store: chunkstore.Store, root: dict[str, Any]) -> None:
    entries = root["entries"]
    a, b = packs_of(entries["t0"])[0], packs_of(entries["t1"])[0]
    assert a[0] == b[0] and a[2] == b[2], "t0 and t1 must be equal-length members of a pack"
    a[1], b[1] = b[1], a[1]


def _span_past_the_end(store: chunkstore.Store, root: dict[str, Any]) -> None:
    location = packs_of(root["entries"]["t1"])[0]
    size = store.objects.stat(CHUNKS, Digest.parse(location[0])).size
    location[1] = size - location[2] // 2  # starts inside the pack, ends past it


@pytest.mark.parametrize("edit", [
    pytest.param(_swap_members, id="swapped-members"),
    pytest.param(_span_past_the_end, id="span-past-the-end")])
def test_a_manifest_whose_members_do_not_decode_is_not_published(
        tmp_path: Path, edit: Callable[[chunkstore.Store, dict[str, Any]], None]) -> None:
    """A version whose (hash-right) root lists t0 and t1 at each other's offsets in a
    pack whose content hashes right, or t1 at a span that ends past the pack: a read
    of it fails in SRC, so the sync must name it (exit 3) and not publish it."""
    with chunkstore.open(tmp_path / "src", create=True, chunk_size=CHUNK) as src:
        good = save_small(src, "a", 1)
    bad = craft_version(tmp_path / "src", good, 2, edit)
    with chunkstore.open(tmp_path / "src") as src:
        assert not readable(src, bad) and readable(src, good)
    result = chunkstore.sync(tmp_path / "src", tmp_path / "dst")
    with chunkstore.open(tmp_path / "dst") as dst:
        published = {v.id for v in dst.versions()}
        dst_ok = dst.verify().ok
    assert result.copied == [good]
    assert [f.version for f in result.failed] == [bad] and not result.ok
    assert published == {good} and dst_ok


def test_a_moved_record_that_maps_members_wrongly_is_not_published(tmp_path: Path) -> None:
    """SRC repacked a pack; its moved record is then rewritten (it parses, it names the
    right packs) so that two equal-length members point at each other's bytes.  A read
    of the version fails in SRC; the sync must not publish it in DST."""
    keep, old_pack, _ = repacked_source(tmp_path / "src")
    with chunkstore.open(tmp_path / "src") as src:
        record = json.loads(src.objects.get(MOVED, old_pack))
        members = record["members"]
        assert len(members) >= 2 and members[0][1] == members[1][1]
        members[0][2], members[1][2] = members[1][2], members[0][2]
        src.objects.put(MOVED, old_pack, dumps(record))
        src.node_cache = type(src.node_cache)()
        assert not readable(src, keep)
    result = chunkstore.sync(tmp_path / "src", tmp_path / "dst")
    with chunkstore.open(tmp_path / "dst") as dst:
        published = [v.id for v in dst.versions()]
        readable_there = readable(dst, keep) if published else None
    assert published == [] and readable_there is None, "a version that does not read was published"
    assert [f.version for f in result.failed] == [keep]


def test_a_data_node_that_hashes_right_but_does_not_parse_is_not_published(
        tmp_path: Path) -> None:
    with chunkstore.open(tmp_path / "src", create=True, chunk_size=CHUNK) as src:
        good = save_small(src, "a", 1)

    def garbage_data(store: chunkstore.Store, root: dict[str, Any]) -> None:
        data = b"\x00not a data node\xff"
        digest = Digest.of(data)
        store.objects.put(NODES, digest, data)
        root["entries"]["trainer"]["data"]["node"] = digest.hex

    bad = craft_version(tmp_path / "src", good, 2, garbage_data)
    with chunkstore.open(tmp_path / "src") as src:
        assert not readable(src, bad)
    result = chunkstore.sync(tmp_path / "src", tmp_path / "dst")
    with chunkstore.open(tmp_path / "dst") as dst:
        published = {v.id for v in dst.versions()}
    assert published == {good}, "a version whose data node does not parse was published"
    assert [f.version for f in result.failed] == [bad]


def test_a_future_format_commit_record_is_neither_copied_nor_overwritten(
        tmp_path: Path) -> None:
    """SRC holds a commit record of the next record format (hashing to its id): the sync
    copies the other versions, does not publish it and says it did not; a repair of a
    store holding it (from a store that lacks it) replaces nothing."""
    with chunkstore.open(tmp_path / "src", create=True, chunk_size=CHUNK) as src:
        good = save_small(src, "a", 1)
        record = json.loads(src.objects.get(VERSIONS, good))
        record.update(format_version=2, step=2)
        future_bytes = dumps(record)
        future = Digest.of(future_bytes).hex
        src.objects.put(VERSIONS, future, future_bytes)
        src.rebuild_index()
        listed = {v.id for v in src.versions()}
    result = chunkstore.sync(tmp_path / "src", tmp_path / "dst")
    assert result.copied == [good]
    if future in listed:  # listed: it must be named as not copied
        assert [f.version for f in result.failed] == [future] and not result.ok
    with chunkstore.open(tmp_path / "dst") as dst:
        assert [v.id for v in dst.versions()] == [good]
        assert not dst.objects.exists(VERSIONS, future) and dst.verify().ok
    before = tree_files(tmp_path / "src")
    fixed = chunkstore.repair(tmp_path / "src", tmp_path / "dst")
    assert not fixed.fixed
    assert tree_files(tmp_path / "src") == before


# --- 2. repair -------------------------------------------------------------------------------


def standalone_chunks(store: chunkstore.Store, version: str) -> list[Digest]:
    """The version's chunk objects of their own (not packed), sorted."""
    flat = flatten(store.objects, store.read_record(version).root, store.node_cache)
    found = set()
    for leaf in flat.leaves.values():
        if isinstance(leaf, TensorEntry):
            for shard in leaf.shards:
                for i, digest in enumerate(shard.chunks):
                    if shard.location(i) is None and not shard.chain(i):
                        found.add(digest)
    return sorted(found, key=lambda d: d.raw)


def needed_objects(store: chunkstore.Store, version: str) -> set[Digest]:
    """Every chunk object (packs included) a read of ``version`` opens, delta bases too."""
    flat = flatten(store.objects, store.read_record(version).root, store.node_cache)
    found = set()
    for leaf in flat.leaves.values():
        if isinstance(leaf, TensorEntry):
            for shard in leaf.shards:
                for i, digest in enumerate(shard.chunks):
                    at = shard.location(i)
                    found.add(at.pack if at is not None else digest)
                    for base, where in zip(shard.chain(i), shard.chain_locations(i),
                                           strict=True):
                        found.add(where.pack if where is not None else base)
    return found


def flip(store: chunkstore.Store, kind: Any, digest: Digest, at: float = 0.5) -> None:
    data = bytearray(store.objects.get(kind, digest))
    data[int(len(data) * at)] ^= 0x40
    store.objects.put(kind, digest, bytes(data))


def test_repair_from_another_store_with_the_same_run_names_replaces_nothing(
        tmp_path: Path) -> None:
    """OTHER is another store whose run ``a`` has steps 1 and 2 with other content: it
    holds none of STORE's objects under their keys, so the repair fixes nothing, names
    the damage as unfixed, writes nothing and exits with damage remaining."""
    with chunkstore.open(tmp_path / "store", create=True, chunk_size=CHUNK,
                         delta_depth=0) as store:
        ids = [save(store, "a", step) for step in (1, 2)]
        victim = standalone_chunks(store, ids[1])[0]
        flip(store, CHUNKS, victim)
        root = store.read_record(ids[1]).root
        flip(store, NODES, root, at=0.9)
    with chunkstore.open(tmp_path / "other", create=True, chunk_size=CHUNK) as other:
        for step in (1, 2):
            with other.new_version(run="a", step=step) as v:
                v.put("model.frozen", np.zeros(3000, dtype=np.float32) + step)
    before = tree_files(tmp_path / "store")
    dry = chunkstore.repair(tmp_path / "store", tmp_path / "other", dry_run=True)
    result = chunkstore.repair(tmp_path / "store", tmp_path / "other")
    assert not result.ok and not result.fixed and not dry.fixed
    assert {f.digest for f in result.unfixed} >= {root.hex}
    assert tree_files(tmp_path / "store") == before


def test_repair_mends_a_moved_record_that_maps_members_wrongly(tmp_path: Path) -> None:
    """STORE repacked a pack after OTHER got a copy of the version (OTHER holds the old
    pack whole); STORE's moved record is then damaged so that it still parses but two
    members point at each other's bytes.  OTHER's checked pack mends it (reads take a
    pack before its moved record)."""
    with chunkstore.open(tmp_path / "store", create=True, chunk_size=CHUNK,
                         delta_depth=0) as store:
        old = save_small(store, "a", 1, shared=4)
        keep = save_small(store, "a", 2, shared=4)
    assert chunkstore.sync(tmp_path / "store", tmp_path / "other").ok
    with chunkstore.open(tmp_path / "store") as store:
        store.delete(old)
        assert store.gc(grace=0, repack_unused=0.01).packs_repacked > 0
        pack = next(iter(store.objects.ids(MOVED)))
        record = json.loads(store.objects.get(MOVED, pack))
        members = record["members"]
        members[0][2], members[1][2] = members[1][2], members[0][2]
        store.objects.put(MOVED, pack, dumps(record))
    with chunkstore.open(tmp_path / "store") as store:
        assert not readable(store, keep)
    result = chunkstore.repair(tmp_path / "store", tmp_path / "other")
    assert result.ok, (result.fixed, result.unfixed, result.problems_after)
    with chunkstore.open(tmp_path / "store") as store:
        assert readable(store, keep)


def test_a_delta_base_damaged_only_in_dst_is_named_by_verify_and_mended_by_repair(
        tmp_path: Path) -> None:
    """DST has step 1; an object step 2 reuses (a chunk object every version shares, a
    dedup hit the sync does not read) rots in DST only.  ``sync --verify`` of step 2
    must not say ok; ``repair DST --from SRC`` then mends it and both read back."""
    with chunkstore.open(tmp_path / "src", create=True, chunk_size=CHUNK) as src:
        first = save(src, "a", 1)
    assert chunkstore.sync(tmp_path / "src", tmp_path / "dst").ok
    with chunkstore.open(tmp_path / "src") as src:
        second = save(src, "a", 2)
    with chunkstore.open(tmp_path / "src") as src:
        shared = needed_objects(src, first) & needed_objects(src, second)
    with chunkstore.open(tmp_path / "dst") as dst:
        assert shared
        for digest in shared:
            flip(dst, CHUNKS, digest)
    result = chunkstore.sync(tmp_path / "src", tmp_path / "dst", verify=True)
    assert result.copied == [second]
    assert not result.ok and result.problems, "the damage DST holds was reported as success"
    assert chunkstore.repair(tmp_path / "dst", tmp_path / "src").ok
    with chunkstore.open(tmp_path / "dst") as dst:
        assert dst.verify().ok
        for step, version in ((1, first), (2, second)):
            reader = dst.open_version(version)
            for name, array in sync_state(step).items():
                assert reader.get(name).tobytes() == array.tobytes()


# --- 3. dry runs tell the truth --------------------------------------------------------------


def _counts(result: Any) -> tuple[Any, ...]:
    return (result.copied, result.objects_copied, result.bytes_copied,
            [f.version for f in result.failed])


def test_a_sync_dry_run_counts_what_the_real_run_copies_with_shared_leftover_packs(
        tmp_path: Path) -> None:
    """Two versions list members of one pack that holds leftovers of removed versions:
    the pack travels as a new pack and a moved record, once.  The dry run's objects and
    bytes are the real run's."""
    with chunkstore.open(tmp_path / "src", create=True, chunk_size=CHUNK) as src:
        ids = [save_small(src, "r", step, shared=3) for step in range(1, 5)]
        src.delete(ids[0])
        src.delete(ids[1])
        assert src.gc(grace=0, repack_unused=None).chunks_deleted > 0
    dry = chunkstore.sync(tmp_path / "src", tmp_path / "dst", dry_run=True)
    real = chunkstore.sync(tmp_path / "src", tmp_path / "dst")
    assert real.copied == ids[2:]
    assert _counts(dry) == _counts(real)
    with chunkstore.open(tmp_path / "dst") as dst:
        assert dst.verify().ok and all(readable(dst, v) for v in ids[2:])


def test_a_sync_dry_run_counts_a_damaged_leftover_in_dst_as_the_real_run_does(
        tmp_path: Path) -> None:
    """DST holds an object of the version to come that no version there references and
    that rotted (a killed sync's orphan): the real run replaces it with checked bytes,
    and the dry run must count it as copied too."""
    with chunkstore.open(tmp_path / "src", create=True, chunk_size=CHUNK,
                         delta_depth=0) as src:
        first = save(src, "a", 1)
        second = save(src, "b", 1)  # other content? no: the same state, another run
    assert chunkstore.sync(tmp_path / "src", tmp_path / "dst", [first]).ok
    with chunkstore.open(tmp_path / "dst") as dst:
        victim = standalone_chunks(dst, first)[0]
        dst.delete(first)
        dst.gc(grace=0)
        assert not dst.objects.exists(CHUNKS, victim)
        data = bytearray((tmp_path / "src" / "chunks" / victim.hex[:2] / victim.hex)
                         .read_bytes())
        data[len(data) // 2] ^= 0x40
        dst.objects.put(CHUNKS, victim, bytes(data))  # an orphan, rotted
    dry = chunkstore.sync(tmp_path / "src", tmp_path / "dst", [second], dry_run=True)
    real = chunkstore.sync(tmp_path / "src", tmp_path / "dst", [second])
    assert real.copied == [second]
    with chunkstore.open(tmp_path / "dst") as dst:
        assert dst.verify().ok
    assert _counts(dry) == _counts(real)


def _repair_names(result: Any) -> list[tuple[str, str]]:
    return sorted((f.kind, f.digest) for f in result.fixed + result.unfixed)


def test_a_repair_dry_run_names_what_the_real_run_fixes(tmp_path: Path) -> None:
    """A damaged root node and a damaged chunk object below it: the dry run must name
    both, as the real run fixes both."""
    with chunkstore.open(tmp_path / "store", create=True, chunk_size=CHUNK,
                         delta_depth=0) as store:
        ids = [save(store, "a", step) for step in (1, 2)]
    assert chunkstore.sync(tmp_path / "store", tmp_path / "other").ok
    with chunkstore.open(tmp_path / "store") as store:
        own = set(standalone_chunks(store, ids[1])) - set(standalone_chunks(store, ids[0]))
        flip(store, CHUNKS, sorted(own, key=lambda d: d.raw)[0])
        flip(store, NODES, store.read_record(ids[1]).root, at=0.9)
    dry = chunkstore.repair(tmp_path / "store", tmp_path / "other", dry_run=True)
    real = chunkstore.repair(tmp_path / "store", tmp_path / "other")
    assert real.ok
    assert _repair_names(dry) == _repair_names(real)


# --- 4. a sync killed or stopped at each step ------------------------------------------------


SYNC_CHILD = """
import os, signal, socket, sys, time
if sys.argv[5] == "stop":  # another machine's sync: GC judges it by its heartbeat alone
    socket.gethostname = lambda: "another-machine"
import chunkstore
from chunkstore.errors import ChunkStoreError
from chunkstore.backends import local as backend
from chunkstore.maintenance import synccopy
from chunkstore.objects import objectstore
src, dst, version, point, how = sys.argv[1:6]
state = {"copied": False}

def halt(where):
    print("at", where, flush=True)
    if how == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    else:
        time.sleep(60)

put_if_absent = backend.LocalBackend.put_if_absent
def patched_put_if_absent(self, key, data):
    if point == "moved" and key.startswith("moved/"):
        halt(key)
    if point == "commit" and key.startswith("versions/"):
        halt(key)
    return put_if_absent(self, key, data)
backend.LocalBackend.put_if_absent = patched_put_if_absent

run = synccopy.VersionCopy.run
def patched_run(self, root):
    copied = run(self, root)
    state["copied"] = self.session is not None
    return copied
synccopy.VersionCopy.run = patched_run

flush = objectstore.ObjectStore.flush
def patched_flush(self):
    if point == "flush" and state["copied"]:
        state["copied"] = False
        halt("flush")
    return flush(self)
objectstore.ObjectStore.flush = patched_flush
try:
    result = chunkstore.sync(src, dst, [version])
    print("result", result.copied, flush=True)
except ChunkStoreError as exc:
    print("error", type(exc).__name__, exc, flush=True)
    sys.exit(9)
"""


def leftover_source(path: Path) -> list[str]:
    """A source whose packs hold leftovers of removed versions (steps 1, 2): a sync of
    step 4 alone compacts them (a new pack, then a moved record)."""
    with chunkstore.open(path, create=True, chunk_size=CHUNK) as src:
        ids = [save_small(src, "r", step, shared=3) for step in range(1, 5)]
        src.delete(ids[0])
        src.delete(ids[1])
        assert src.gc(grace=0, repack_unused=None).chunks_deleted > 0
    return ids


def start_child(src: Path, dst: Path, version: str, point: str, how: str,
                env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    child = subprocess.Popen(
        [sys.executable, "-c", SYNC_CHILD, str(src), str(dst), version, point, how],
        stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})
    assert child.stdout is not None
    deadline = time.monotonic() + 60
    while True:
        line = child.stdout.readline()
        if line.startswith("at "):
            return child
        assert line and time.monotonic() < deadline and child.poll() is None, line


def assert_step4_whole(dst_path: Path, version: str) -> None:
    with chunkstore.open(dst_path) as dst:
        assert dst.verify().ok
        reader = dst.open_version(version)
        for name, array in small_state(4, shared=3).items():
            assert reader.get(name).tobytes() == array.tobytes()


@pytest.mark.parametrize("point", [
    "moved", "commit"])
def test_a_sync_killed_inside_a_compaction_leaves_nothing_partial_and_a_rerun_finishes(
        tmp_path: Path, point: str) -> None:
    """SIGKILL after the compacted pack, before its moved record ("moved"), or after
    the record, before the commit record ("commit"): DST publishes nothing and
    verifies; a dry run then counts what the rerun copies; the rerun publishes the
    version whole."""
    ids = leftover_source(tmp_path / "src")
    dst_path = tmp_path / "dst"
    child = start_child(tmp_path / "src", dst_path, ids[3], point, "sleep")
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert child.stdout is not None
    child.stdout.close()
    with chunkstore.open(dst_path) as dst:
        assert dst.versions() == [] and dst.verify().ok
        assert dst.objects.exists(MOVED, next(iter(dst.objects.ids(MOVED)))) \
            if point == "commit" else not list(dst.objects.ids(MOVED))
    dry = chunkstore.sync(tmp_path / "src", dst_path, [ids[3]], dry_run=True)
    real = chunkstore.sync(tmp_path / "src", dst_path, [ids[3]])
    assert real.copied == [ids[3]] and real.ok
    assert _counts(dry) == _counts(real)
    assert_step4_whole(dst_path, ids[3])


GC_CHILD = """
import json, sys, chunkstore
with chunkstore.open(sys.argv[1], index_dir=sys.argv[2]) as store:
    result = store.gc(grace=0)
print(json.dumps({"chunks": result.chunks_deleted,
                  "moved": result.moved_records_deleted}), flush=True)
"""


@pytest.mark.parametrize("point", [
    "flush",
    "commit"])
def test_a_sync_stopped_while_a_gc_from_another_index_runs_publishes_nothing_broken(
        tmp_path: Path, point: str) -> None:
    """The sync (a compaction of step 4: new pack, moved record) is SIGSTOPped after it
    copied the version's objects, at its flush ("flush") or at the commit record's PUT
    ("commit"), for longer than its session's lease; a GC with no grace runs from
    another index meanwhile and takes the session for dead.  After SIGCONT, whatever
    the sync publishes reads back whole, and a rerun finishes."""
    ids = leftover_source(tmp_path / "src")
    dst_path = tmp_path / "dst"
    lease = {"CHUNKSTORE_SESSION_LEASE": "2"}
    with chunkstore.open(dst_path, create=True, chunk_size=CHUNK):
        pass
    child = start_child(tmp_path / "src", dst_path, ids[3], point, "stop", lease)
    deadline = time.monotonic() + 30
    while Path(f"/proc/{child.pid}/stat").read_text().split()[2] != "T":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(3)  # past the lease: the session's heartbeat is stale
    gc = subprocess.run([sys.executable, "-c", GC_CHILD, str(dst_path),
                         str(tmp_path / "other-index")], capture_output=True, text=True,
                        timeout=120, env={**os.environ, "PYTHONPATH": str(REPO), **lease},
                        check=False)
    assert gc.returncode == 0, gc.stderr[-2000:]
    child.send_signal(signal.SIGCONT)
    out, _ = child.communicate(timeout=60)
    with chunkstore.open(dst_path) as dst:
        published = [v.id for v in dst.versions()]
        whole = dst.verify().ok and all(readable(dst, v) for v in published)
    assert whole, f"a published version does not read back (gc {gc.stdout.strip()}, sync {out})"
    chunkstore.sync(tmp_path / "src", dst_path, [ids[3]])
    assert_step4_whole(dst_path, ids[3])


# --- 5. a destination that lies, a full disk ---------------------------------------------------


class DropsWrites(ForwardingBackend):
    """Says it stored chunk objects and nodes that it drops."""

    def put_if_absent(self, key: str, data: bytes | memoryview) -> bool:
        if key.startswith(("chunks/", "nodes/")):
            return True
        return super().put_if_absent(key, data)


class ReadsWrong(ForwardingBackend):
    """Returns chunk objects with one bit flipped."""

    def get(self, key: str) -> bytes:
        data = super().get(key)
        if key.startswith("chunks/") and data:
            return data[:-1] + bytes([data[-1] ^ 1])
        return data

    def get_range(self, key: str, start: int, length: int) -> bytes:
        return self.get(key)[start:start + length]


class FailsMidway(ForwardingBackend):
    """Raises an I/O error at the third chunk object written."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.writes = 0

    def put_if_absent(self, key: str, data: bytes | memoryview) -> bool:
        if key.startswith("chunks/"):
            self.writes += 1
            if self.writes == 3:
                raise OSError(5, "Input/output error", key)
        return super().put_if_absent(key, data)


@pytest.mark.parametrize("liar", [DropsWrites, ReadsWrong])
def test_a_destination_that_lies_is_never_reported_as_success_by_sync_verify(
        tmp_path: Path, liar: type[ForwardingBackend]) -> None:
    with chunkstore.open(tmp_path / "src", create=True, chunk_size=CHUNK) as src:
        ids = [save(src, "a", step) for step in (1, 2)]
    dst = chunkstore.open(tmp_path / "dst", create=True, chunk_size=CHUNK)
    dst.backend = liar(dst.backend)
    try:
        result = chunkstore.sync(tmp_path / "src", dst, verify=True)
    except ChunkStoreError:
        result = None  # a typed failure is no success either
    finally:
        dst.close()
    assert result is None or (not result.ok and result.problems), "damage reported as success"
    with chunkstore.open(tmp_path / "dst") as honest:  # the truth: what is really stored
        for version in [v.id for v in honest.versions()]:
            if liar is ReadsWrong:
                assert readable(honest, version)
    assert ids


def test_a_destination_failing_midway_is_a_typed_error_and_a_rerun_finishes(
        tmp_path: Path) -> None:
    with chunkstore.open(tmp_path / "src", create=True, chunk_size=CHUNK,
                         delta_depth=0) as src:
        ids = {save(src, "a", step): ("a", step) for step in (1, 2)}
    dst = chunkstore.open(tmp_path / "dst", create=True, chunk_size=CHUNK)
    dst.backend = FailsMidway(dst.backend)
    with pytest.raises((ChunkStoreError, OSError)):  # an I/O error (exit 4)
        chunkstore.sync(tmp_path / "src", dst)
    dst.close()
    with chunkstore.open(tmp_path / "dst") as honest:
        published = [v.id for v in honest.versions()]
        assert honest.verify().ok and all(readable(honest, v) for v in published)
    result = chunkstore.sync(tmp_path / "src", tmp_path / "dst", verify=True)
    assert result.ok and set(result.copied) | set(published) == set(ids)


FULL_DISK_CHILD = """
import json, os, sys
import chunkstore
from chunkstore.errors import ChunkStoreError
src, disk = sys.argv[1], sys.argv[2]
dst = os.path.join(disk, "dst")
with chunkstore.open(dst, create=True, chunk_size=4096):
    pass
filler = os.path.join(disk, "filler")
with open(filler, "wb") as out:  # leave about 64 KiB
    free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
    out.write(b"x" * max(0, free - (64 << 10)))
report = {}
try:
    chunkstore.sync(src, dst)
    report["first"] = "ok"
except ChunkStoreError as exc:
    report["first"] = type(exc).__name__
except Exception as exc:
    report["first"] = "untyped " + type(exc).__name__
with chunkstore.open(dst) as store:
    published = [v.id for v in store.versions()]
    report["published"] = len(published)
    report["verify_ok"] = store.verify().ok
os.remove(filler)
report["second_ok"] = chunkstore.sync(src, dst, verify=True).ok
print(json.dumps(report))
"""


@pytest.mark.skipif(PREFIX is None, reason="needs `unshare` for a tmpfs of the test's own")
def test_a_sync_into_a_full_disk_is_a_typed_error_and_publishes_nothing_partial(
        tmp_path: Path) -> None:
    assert PREFIX is not None
    with chunkstore.open(tmp_path / "src", create=True, chunk_size=CHUNK) as src:
        for step in (1, 2, 3):
            with src.new_version(run="a", step=step) as v:
                v.put("w", np.random.default_rng(step).standard_normal(60_000)
                      .astype(np.float32))
    disk = tmp_path / "disk"
    disk.mkdir()
    script = 'mount -t tmpfs -o size="$1" tmpfs "$2" && shift 2 && exec "$@"'
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("CHUNKSTORE_SPACE_RESERVE", None)
    done = subprocess.run([*PREFIX, "sh", "-c", script, "sh", "8m", str(disk),
                           sys.executable, "-c", FULL_DISK_CHILD, str(tmp_path / "src"),
                           str(disk)], capture_output=True, text=True, timeout=120,
                          env=env, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["first"] == "StorageFullError", report
    assert report["verify_ok"] and report["second_ok"], report


# --- 6. the mirror's read-back ---------------------------------------------------------------


def test_the_read_back_never_overwrites_the_mirror_with_the_local_tiers_rot(
        tmp_path: Path) -> None:
    """An object rots in the local tier and differently in the mirror: the read-back
    names it unhealed and leaves the mirror's bytes as they are; an object rotten only
    in the local tier is never touched in the mirror."""
    with chunkstore.open(tmp_path / "local", create=True, chunk_size=CHUNK,
                         delta_depth=0) as local:
        ids = [save(local, "a", step) for step in (1, 2)]
    assert chunkstore.sync(tmp_path / "local", tmp_path / "mirror").ok
    with chunkstore.open(tmp_path / "local") as local, \
            chunkstore.open(tmp_path / "mirror") as mirror:
        both, local_only = standalone_chunks(local, ids[1])[:2]
        flip(local, CHUNKS, both, at=0.3)
        flip(mirror, CHUNKS, both, at=0.7)
        flip(local, CHUNKS, local_only)
        before = tree_files(tmp_path / "mirror")
        result = ReadBack(mirror, local, budget_bytes=1 << 30).step()
    assert result.cycle_done
    assert [f.digest for f in result.unhealed] == [both.hex] and not result.healed
    assert tree_files(tmp_path / "mirror") == before
