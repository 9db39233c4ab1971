"""Damaged and hostile stores (issue 9): every item has a test that failed before.

Each test seeds a real store with one crafted object and checks that reads
refuse it with the typed error the format names, that ``verify`` reports it
instead of crashing or passing, and that the good version stays usable.
"""

from __future__ import annotations

import contextlib
import json
import math
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import chunkstore
from chunkstore.codecs import ZSTD
from chunkstore.errors import (
    BackendError,
    ChunkStoreError,
    ConfigRecoveredWarning,
    CorruptChunkError,
    CorruptConfigError,
    CorruptNodeError,
    CorruptRecordError,
    CorruptTagError,
    FormatVersionError,
    InvalidNameError,
    NotSerializableError,
    StorageFullError,
)
from chunkstore.format import plaindata
from chunkstore.format.chunkobj import ChunkHeader, decode_object, encode_object
from chunkstore.format.digest import Digest
from chunkstore.format.manifest import decode_data, decode_tree
from chunkstore.format.records import (
    MAX_CHUNK_SIZE,
    STORE_FORMAT_VERSION,
    CommitRecord,
    StoreConfig,
    Tag,
)
from chunkstore.objects.kinds import CHUNKS, NODES, TAGS, VERSIONS

W = np.arange(1024, dtype="<f4")


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    path = tmp_path / "store"
    # Without delta chains: the larger tensor's chunks are objects of their own, which
    # the tests below damage on disk.
    with chunkstore.open(path, chunk_size=4096, delta_depth=0, create=True) as store:
        with store.new_version(run="good", step=1) as v:
            v.put("w", W)
            v.put("h", np.ones(4096, dtype="<f4") / 3)  # four chunks, shuffle-zstd
            v.put_data("trainer", {"epoch": 3})
    return path


def _dumps(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()  # \ud800 escaped


def _put(path: Path, key: str, data: bytes) -> None:
    (path / key).parent.mkdir(parents=True, exist_ok=True)
    (path / key).write_bytes(data)


def _node(path: Path, body: dict[str, Any] | bytes) -> Digest:
    data = body if isinstance(body, bytes) else _dumps({"format_version": 1, **body})
    digest = Digest.of(data)
    _put(path, NODES.key(digest), data)
    return digest


def _tree(path: Path, entries: dict[str, Any]) -> Digest:
    return _node(path, {"kind": "tree", "entries": entries})


def _record(path: Path, root: Digest, **fields: Any) -> str:
    record = CommitRecord(run="bad", step=7, parent=None, created=time.time(), root=root, meta={},
                          logical_bytes=0, new_bytes=0, new_stored_bytes=0)
    obj = json.loads(record.encode()[1])
    obj.update(fields)
    data = _dumps(obj) if "raw" not in fields else fields["raw"]
    version_id = Digest.of(data).hex
    _put(path, VERSIONS.key(version_id), data)
    return version_id


def _good_root(path: Path) -> dict[str, Any]:
    with chunkstore.open(path, create=False) as store:
        root = store.resolve("good@1").root
    return json.loads((path / NODES.key(root)).read_bytes())


def _tensor(shape: list[int], chunks: list[str], chunk_bytes: int = 4096,
            shards: list[dict[str, Any]] | None = None,
            packs: list[Any] | None = None) -> dict[str, Any]:
    if shards is None:
        shards = [{"offsets": [0] * len(shape), "sizes": shape, "chunk_bytes": chunk_bytes,
                   "chunks": chunks, **({"packs": packs} if packs else {})}]
    return {"tensor": {"dtype": "float32", "shape": shape, "shards": shards}}


def _check_reported(path: Path, version_id: str | None, kind: str) -> None:
    """verify reports ``kind`` (for the version) and the good version still reads."""
    with chunkstore.open(path, create=False) as store:
        problems = store.verify().problems
        assert (kind, version_id) in {(p.kind, p.version) for p in problems}, problems
        reader = store.open_version("good@1")
        assert np.array_equal(reader.get("w"), W)
        assert reader.get_data("trainer") == {"epoch": 3}


# --- 1. an empty shards list is not a tensor ---------------------------------------------------


def test_empty_shards_list_is_refused_and_reported(store_dir: Path) -> None:
    root = _tree(store_dir, {"w": _tensor([1048576], [], shards=[])})
    vid = _record(store_dir, root)
    with pytest.raises(CorruptNodeError, match="cover 0 of"):
        decode_tree(root, (store_dir / NODES.key(root)).read_bytes())
    _check_reported(store_dir, vid, "corrupt-node")


# --- 2. what verify passes reads back ---------------------------------------------------------


def test_chunk_of_the_wrong_length_fails_verify(store_dir: Path) -> None:
    good = _good_root(store_dir)
    w_shard = good["entries"]["w"]["tensor"]["shards"][0]
    w_chunk = w_shard["chunks"][0]  # 4096 bytes, packed
    # 512 float32 = 2048 bytes in one chunk: the real chunk is twice as long.
    root = _tree(store_dir, {"w": _tensor([512], [w_chunk], packs=w_shard["packs"])})
    vid = _record(store_dir, root)
    _check_reported(store_dir, vid, "corrupt-chunk")
    with chunkstore.open(store_dir, create=False) as store:
        reader = store.open_version(vid)
        with pytest.raises(CorruptChunkError, match="expects 2048"):
            reader.get("w")


@pytest.mark.parametrize("shape", [[10**15], [2**40, 2**40], [2**62, 2**62]])
def test_huge_shapes_are_refused_before_allocating(store_dir: Path, shape: list[int]) -> None:
    root = _tree(store_dir, {"w": _tensor(shape, [Digest.of(b"c").hex])})
    vid = _record(store_dir, root)
    _check_reported(store_dir, vid, "corrupt-node")


def test_an_empty_shape_of_huge_extents_is_refused(store_dir: Path) -> None:
    """[2**62, 2**62, 0] holds no byte, but numpy cannot make it ("array is too big", an
    untyped ValueError from get()): a corrupt node, which verify reports."""
    shape = [2**62, 2**62, 0]
    root = _tree(store_dir, {"w": _tensor(shape, [])})
    vid = _record(store_dir, root)
    _check_reported(store_dir, vid, "corrupt-node")
    with chunkstore.open(store_dir, create=False) as store, pytest.raises(CorruptNodeError):
        store.open_version(vid).get("w")


def test_chunk_bytes_above_the_store_chunk_size(store_dir: Path) -> None:
    good = _good_root(store_dir)
    w_shard = good["entries"]["w"]["tensor"]["shards"][0]
    root = _tree(store_dir, {"w": _tensor([1024], w_shard["chunks"], chunk_bytes=8192,
                                          packs=w_shard["packs"])})
    vid = _record(store_dir, root)
    _check_reported(store_dir, vid, "corrupt-node")


# --- 3. verify reports, never crashes ---------------------------------------------------------


def _h_chunk(path: Path) -> Path:
    good = _good_root(path)
    digest = good["entries"]["h"]["tensor"]["shards"][0]["chunks"][0]
    return path / CHUNKS.key(Digest.parse(digest))


@pytest.mark.parametrize("bit", range(64, 128))
def test_raw_length_bit_flips_are_reported(store_dir: Path, bit: int) -> None:
    chunk = _h_chunk(store_dir)
    data = bytearray(chunk.read_bytes())
    assert data[5] == 2  # shuffle-zstd
    data[bit // 8] ^= 1 << (bit % 8)
    chunk.write_bytes(bytes(data))
    with chunkstore.open(store_dir, create=False) as store:
        result = store.verify()
        assert {p.kind for p in result.problems} == {"corrupt-chunk"}
        assert np.array_equal(store.open_version("good@1").get("w"), W)


def test_data_node_nested_990_deep(store_dir: Path) -> None:
    data = b'{"format_version":1,"kind":"data","value":' + b"[" * 990 + b"]" * 990 + b"}"
    leaf = _node(store_dir, data)
    root = _tree(store_dir, {"trainer": {"data": {"node": leaf.hex, "nbytes": 1980}}})
    vid = _record(store_dir, root)
    with pytest.raises(CorruptNodeError):
        decode_data(leaf, data)
    _check_reported(store_dir, vid, "corrupt-node")


# --- 4. one malformed object never takes the store down (decoding side) -----------------------


def test_tag_naming_a_number(store_dir: Path) -> None:
    _put(store_dir, TAGS.key("best"), b'{"version": 5}')
    with pytest.raises(CorruptTagError):
        Tag.decode("best", b'{"version": 5}')
    _check_reported(store_dir, None, "corrupt-tag")


def test_record_whose_meta_nests_990_deep(store_dir: Path) -> None:
    root = _tree(store_dir, {})
    record = CommitRecord(run="bad", step=7, parent=None, created=1.0, root=root, meta={"m": 1},
                          logical_bytes=0, new_bytes=0, new_stored_bytes=0)
    deep = record.encode()[1].replace(b'{"m":1}', b"[" * 990 + b"]" * 990)
    vid = _record(store_dir, root, raw=deep)
    with pytest.raises(CorruptRecordError):
        CommitRecord.decode(vid, (store_dir / VERSIONS.key(vid)).read_bytes())
    _check_reported(store_dir, vid, "corrupt-record")


def test_tree_node_nested_100000_deep(store_dir: Path) -> None:
    deep = b'{"a":' * 100_000 + b"1" + b"}" * 100_000
    body = b'{"entries":{"a":' + deep + b'},"format_version":1,"kind":"tree"}'
    root = _node(store_dir, body)
    vid = _record(store_dir, root)
    _check_reported(store_dir, vid, "corrupt-node")


def test_config_without_chunk_size(store_dir: Path) -> None:
    config = json.loads((store_dir / "chunkstore.json").read_bytes())
    del config["chunk_size"]
    (store_dir / "chunkstore.json").write_bytes(_dumps(config))
    # A store's damaged config is recovered from its manifests (docs/format.md §2.1).
    with pytest.warns(ConfigRecoveredWarning, match="chunk_size"), \
            chunkstore.open(store_dir, create=False) as store:
        assert store.chunk_size == 4096
    with pytest.raises(CorruptConfigError, match="chunk_size"):
        StoreConfig.decode("x", (store_dir / "chunkstore.json").read_bytes())


def test_manifest_fanning_out_ten_ways_ten_deep(store_dir: Path) -> None:
    good = _good_root(store_dir)
    child = _tree(store_dir, {"w": good["entries"]["w"]})
    for _ in range(10):
        child = _tree(store_dir, {str(i): {"tree": child.hex} for i in range(10)})
    vid = _record(store_dir, child)
    started = time.monotonic()
    _check_reported(store_dir, vid, "corrupt-node")
    assert time.monotonic() - started < 30


# --- 6. readers refuse what writers refuse ----------------------------------------------------


@pytest.mark.parametrize("name", ["..", "a/b", "a\x00b", "", "a.b", "x\ud800"])
def test_tree_component_a_writer_refuses(store_dir: Path, name: str) -> None:
    good = _good_root(store_dir)
    root = _tree(store_dir, {name: good["entries"]["w"]})
    vid = _record(store_dir, root)
    _check_reported(store_dir, vid, "corrupt-node")


def test_two_leaves_with_one_full_name(store_dir: Path) -> None:
    good = _good_root(store_dir)
    sub = _tree(store_dir, {"b": good["entries"]["w"]})
    data = (b'{"entries":{"a":{"tree":"' + sub.hex.encode() + b'"},"a":'
            + _dumps(good["entries"]["w"]) + b'},"format_version":1,"kind":"tree"}')
    root = _node(store_dir, data)
    vid = _record(store_dir, root)
    _check_reported(store_dir, vid, "corrupt-node")


@pytest.mark.parametrize("fields", [
    {"run": "../x"}, {"run": "latest"}, {"step": -1}, {"step": True}, {"step": 1.5},
    {"raw": b'{"created":1e999,"format":"chunkstore.version","format_version":1,'
            b'"logical_bytes":0,"meta":{},"new_bytes":0,"new_stored_bytes":0,"parent":null,'
            b'"root":"' + Digest.of(b"r").hex.encode() + b'","run":"r","step":1}'},
    {"meta": [1, 2]}, {"parent": "xyz"},
])
def test_record_a_writer_refuses(store_dir: Path, fields: dict[str, Any]) -> None:
    vid = _record(store_dir, _tree(store_dir, {}), **fields)
    with pytest.raises(CorruptRecordError):
        CommitRecord.decode(vid, (store_dir / VERSIONS.key(vid)).read_bytes())
    _check_reported(store_dir, vid, "corrupt-record")


# --- 7. bad input gets a typed error ----------------------------------------------------------


def test_lone_surrogates_and_huge_ints_are_refused_early(store_dir: Path) -> None:
    with chunkstore.open(store_dir, create=False) as store:
        with pytest.raises(NotSerializableError, match="surrogate"):
            store.new_version(run="r", step=1, meta={"note": "\ud800"})
        with pytest.raises(NotSerializableError, match="surrogate"):
            store.new_version(run="r", step=1, meta={"\udfff": 1})
        with pytest.raises(NotSerializableError, match="digits"):
            store.new_version(run="r", step=1, meta={"n": 10**5000})
        with store.new_version(run="r", step=1) as v:
            with pytest.raises(InvalidNameError, match="surrogate"):
                v.put("w\ud800", W)
            with pytest.raises(NotSerializableError):
                v.put_data("x", {"big": -(10**4400)})
            v.put("w", W)
        assert [x.run for x in store.versions()] == ["good", "r"]


def test_a_full_disk_is_a_typed_error(tmp_path: Path) -> None:
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)],
                          capture_output=True, check=False)
    if done.returncode:
        pytest.skip("mounting a small tmpfs needs privileges this machine lacks")
    try:
        with chunkstore.open(mount / "s", chunk_size=4096, compression="none",
                             create=True) as store:
            with pytest.raises(StorageFullError, match="no space left"):
                with store.new_version(run="r", step=1) as v:
                    v.put("w", np.random.default_rng(0).random(100_000))
            assert store.versions() == []
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_an_unreachable_s3_server_is_a_backend_error() -> None:
    options = {"endpoint_url": "http://127.0.0.1:9", "key": "k", "secret": "s",
               "client_kwargs": {"region_name": "us-east-1"},
               "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1}}
    with pytest.raises(BackendError, match=r"127\.0\.0\.1:9"):
        chunkstore.open("s3://bucket/store", storage_options=options, create=True)


# --- 8. the format's former known deviations ---------------------------------------------------


def _object(chunk: Path) -> tuple[Digest, bytearray]:
    return Digest.parse(chunk.name), bytearray(chunk.read_bytes())


def test_unknown_flag_bits_are_refused(store_dir: Path) -> None:
    digest, data = _object(_h_chunk(store_dir))
    data[7] |= 0x04
    with pytest.raises(CorruptChunkError, match="flag"):
        decode_object(digest, bytes(data))


def test_bytes_after_the_zstd_frame_are_refused(store_dir: Path) -> None:
    digest, data = _object(_h_chunk(store_dir))
    raw = bytes(decode_object(digest, bytes(data)))
    frame = ZSTD.encode(memoryview(raw), 4)
    exact = encode_object(ChunkHeader(ZSTD.id, 4, len(raw), len(frame)), frame)
    assert bytes(decode_object(digest, exact)) == raw
    padded = encode_object(ChunkHeader(ZSTD.id, 4, len(raw), len(frame) + 1), frame + b"\x00")
    with pytest.raises(CorruptChunkError, match="after the zstd frame"):
        decode_object(digest, padded)


@pytest.mark.parametrize("version", ["true", "1.0"])
def test_versions_that_only_compare_equal_to_one(store_dir: Path, version: str) -> None:
    config = (store_dir / "chunkstore.json").read_bytes()
    current = b'"format_version":%d' % STORE_FORMAT_VERSION
    assert current in config
    for fake in (version.encode(), b"%d.0" % STORE_FORMAT_VERSION):  # == in Python, not versions
        bumped = config.replace(current, b'"format_version":' + fake)
        with pytest.raises(FormatVersionError):
            StoreConfig.decode("x", bumped)
    root = _node(store_dir, b'{"entries":{},"format_version":' + version.encode()
                 + b',"kind":"tree"}')
    vid = _record(store_dir, root)
    _check_reported(store_dir, vid, "format-version")


def test_all_errors_of_this_module_are_typed() -> None:
    """The decoders under test raise nothing but chunkstore.errors types."""
    for bad in (b"", b"{", b"[]", b'{"format":"chunkstore.version"}', b"\xff"):
        with pytest.raises(ChunkStoreError):
            CommitRecord.decode(Digest.of(bad).hex, bad)
        with pytest.raises(ChunkStoreError):
            decode_tree(Digest.of(bad), bad)
    assert math.isfinite(plaindata.decode(b"1e308"))
    huge = b'{"version": "' + Digest.of(b"v").hex.encode() + b'", "created": ' + b"9" * 400 + b"}"
    with pytest.raises(CorruptTagError, match="finite"):  # found by tools/fuzz_decoders.py
        Tag.decode("best", huge)


def test_a_digest_followed_by_a_newline_is_not_a_digest(store_dir: Path) -> None:
    """A regular expression ending in '$' also matches before a final newline: a digest
    with one (in a manifest, or a key) is not a digest, and a stray key
    ``versions/<hex>\\n`` is ignored as every key that is not a version's is."""
    from chunkstore.format.digest import Digest, is_hex_digest

    hexed = "ab" * 32
    assert is_hex_digest(hexed) and not is_hex_digest(hexed + "\n")
    with pytest.raises(ValueError):
        Digest.parse(hexed + "\n")
    with chunkstore.open(store_dir, create=True) as store:
        versions = [v.id for v in store.versions()]
        (store_dir / "versions" / (versions[0] + "\n")).write_bytes(b"junk")
        assert [v.id for v in store.versions()] == versions
        result = store.verify()
        assert result.ok, result.problems


def test_a_tag_named_like_a_version_id_never_stands_for_that_version(store_dir: Path) -> None:
    """No writer names a tag like a version id; one crafted so (``tags/<id of
    good@1>`` pointing at good@2) must not make that id select good@2: the id selects
    its own version, and verify reports the tag."""
    with chunkstore.open(store_dir, create=True) as store:
        with store.new_version(run="good", step=2) as version:
            version.put("w", W + 1)
        first, second = (v.id for v in store.versions("good"))
    body = json.dumps({"version": second, "created": time.time()}).encode()
    for name in (first, first[:8]):
        (store_dir / "tags" / name).parent.mkdir(parents=True, exist_ok=True)
        (store_dir / "tags" / name).write_bytes(body)
    with chunkstore.open(store_dir, create=True) as store:
        assert store.resolve(first).id == first
        assert store.resolve(first[:8]).id == first
        result = store.verify()
        assert {p.kind for p in result.problems} == {"corrupt-tag"}


@pytest.mark.parametrize("step", ["\u00b2", "1" * 5000, "\u0661"])
def test_a_step_that_is_not_plain_ascii_digits_is_a_selector_error(
        store_dir: Path, step: str) -> None:
    """'²' and Arabic-Indic digits are digits to str.isdigit(), and int() refuses the
    first and a 5,000-digit step: each is a SelectorError, not a ValueError."""
    from chunkstore.errors import SelectorError

    with chunkstore.open(store_dir, create=True) as store, pytest.raises(SelectorError):
        store.resolve(f"good@{step}")


def _crafted(kind: str) -> tuple[str, bytes]:
    """One hostile GC journal entry, tombstone or session object: (key, bytes)."""
    import socket

    from chunkstore.index.lmdbindex import pid_namespace

    deep = b"[" * 100_000 + b"]" * 100_000
    entry = f"gc/{time.time_ns():020d}-{'0' * 12}"
    tombstone = f"removed/{'cd' * 32}"
    session = f"sessions/{'ef' * 16}"
    return {
        "journal entry naming a number": (entry, json.dumps(
            {"format_version": 1, "id": entry[3:], "state": "done", "chunks": [5],
             "nodes": []}).encode()),
        "journal entry nested deep": (entry, deep),
        "tombstone removed at 10**400": (tombstone, json.dumps(
            {"format_version": 1, "version": "cd" * 32, "root": "ab" * 32,
             "removed": 10**400}).encode()),
        "tombstone nested deep": (tombstone, deep),
        "session nested deep": (session, deep),
        "session of a pid past any": (session, json.dumps(
            {"format_version": 1, "host": socket.gethostname(), "pid": 10**30,
             "pidns": pid_namespace(), "heartbeat": time.time()}).encode()),
    }[kind]


@pytest.mark.parametrize("kind", ["journal entry naming a number", "journal entry nested deep",
                                  "tombstone removed at 10**400", "tombstone nested deep",
                                  "session nested deep", "session of a pid past any"])
def test_a_crafted_protocol_object_never_stops_the_store_from_opening(
        store_dir: Path, kind: str) -> None:
    """One bad GC journal entry, tombstone or session object in the store: the store
    still opens, lists and verifies, and GC ends with a result or a typed error (these
    raised TypeError, RecursionError and OverflowError from every command)."""
    from chunkstore.errors import ChunkStoreError

    key, data = _crafted(kind)
    (store_dir / key).parent.mkdir(parents=True, exist_ok=True)
    (store_dir / key).write_bytes(data)
    with chunkstore.open(store_dir, create=True) as store:
        assert [v.run for v in store.versions()] == ["good"]
        assert store.verify().ok
        with contextlib.suppress(ChunkStoreError):  # a result or a typed error
            store.gc(grace=0, session_wait=0.5)
        np.testing.assert_array_equal(store.open_version("good@1").get("w"), W)


def test_a_tensor_its_chunks_cannot_hold_is_corrupt_not_out_of_memory(tmp_path: Path) -> None:
    """A node (valid hashes) whose tensor claims 1 TiB, listing a real small chunk 4,096
    times as 256 MiB chunks: get() checks the chunks' lengths when the buffer cannot be
    had and names the damage (it raised numpy's MemoryError, no chunk checked)."""
    path = tmp_path / "store"
    with chunkstore.open(path, chunk_size=MAX_CHUNK_SIZE, create=True) as store:
        with store.new_version(run="good", step=1) as version:
            version.put("w", W)
    shard = _good_root(path)["entries"]["w"]["tensor"]["shards"][0]
    count = 2**40 // MAX_CHUNK_SIZE
    packs = shard.get("packs")
    root = _tree(path, {"w": _tensor([2**38], shard["chunks"] * count,
                                     chunk_bytes=MAX_CHUNK_SIZE,
                                     packs=packs * count if packs else None)})
    version_id = _record(path, root)
    with chunkstore.open(path, create=False) as store:
        with pytest.raises(CorruptChunkError, match="the manifest lists it as 268435456"):
            store.open_version(version_id).get("w")
