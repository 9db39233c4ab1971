"""Golden tests for the on-disk format (docs/format.md).

Three kinds of checks:

- every frozen fixture under ``tests/data/`` stays readable and unchanged
  (old stores must stay readable forever);
- today's encoder reproduces the newest fixture byte for byte, and the byte
  layouts are pinned here by hand (independently of the code's constants),
  so a format change cannot happen by accident;
- objects that carry a format version newer than this release reads are
  refused with :class:`FormatVersionError`, never returned as data;
- the protocol objects a fixture holds (run leases, commit slots, lease markers, read
  leases: docs/format.md §11.5, §11.6) mean to today's reader what they meant.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import blake3
import numpy as np
import pytest
import zstandard

import chunkstore
from chunkstore.codecs import RAW, SHUFFLE_ZSTD, SPARSE_DELTA, SUB_DELTA, XOR_DELTA, ZSTD
from chunkstore.errors import ChunkStoreError, FormatVersionError, HeldVersionError, RunInUseError
from chunkstore.format import plaindata
from chunkstore.format.chunkobj import (
    CHUNK_FORMAT_VERSION,
    ChunkHeader,
    decode_object,
    encode_object,
    parse_header,
)
from chunkstore.format.digest import Digest
from chunkstore.format.manifest import (
    NODE_FORMAT_VERSION,
    DataEntry,
    PackLocation,
    Shard,
    TensorEntry,
    TreeNode,
    decode_data,
    decode_tree,
    encode_data,
    encode_tree,
)
from chunkstore.format.records import (
    RECORD_FORMAT_VERSION,
    STORE_FORMAT_VERSION,
    STORE_FORMAT_VERSIONS,
    CommitRecord,
    StoreConfig,
)
from chunkstore.handle.tree import flatten
from chunkstore.handle.versions import entry_from_record
from chunkstore.objects.kinds import CHUNKS, LEASES, NODES, READERS, TAGS, VERSIONS
from chunkstore.protocol.readleases import (
    READ_LEASE_FORMAT,
    expired_read_leases,
    list_read_leases,
)
from chunkstore.protocol.runlease import LEASE_FORMAT, MARKER_FORMAT, SLOT_FORMAT, RunLease
from tests.conftest import tree_snapshot

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "tests" / "data"
TOOL = REPO / "tools" / "make_format_fixture.py"
FIXTURE_NAMES = sorted((p.name.removesuffix(".expected.json")
                        for p in DATA.glob("store-v*.expected.json")),
                       key=lambda n: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", n)])
#: The format versions this release writes (fixtures before store-v11 name the first four
#: alone: a lease format bumped without a fixture leaves no fixture that matches).
CURRENT_VERSIONS = {"store": STORE_FORMAT_VERSION, "record": RECORD_FORMAT_VERSION,
                    "node": NODE_FORMAT_VERSION, "chunk": CHUNK_FORMAT_VERSION,
                    "lease": LEASE_FORMAT, "lease_slot": SLOT_FORMAT,
                    "lease_marker": MARKER_FORMAT, "read_lease": READ_LEASE_FORMAT}
BLAKE3_OF_NOTHING = "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"


def _expected(name: str) -> dict[str, Any]:
    result: dict[str, Any] = json.loads((DATA / f"{name}.expected.json").read_text())
    return result


def _current_fixture() -> str | None:
    """The newest fixture written with the format versions this release writes."""
    matching = [n for n in FIXTURE_NAMES if _expected(n)["format_versions"] == CURRENT_VERSIONS]
    return matching[-1] if matching else None


#: Fixtures holding protocol objects (store-v11 on), with what a reader must make of them.
PROTOCOL_FIXTURES = [n for n in FIXTURE_NAMES if "protocol" in _expected(n)]


def _late_records(name: str) -> set[str]:
    """Keys of the records in the fixture that are never versions: an index that finds
    one deletes it (a withdrawn version's late PUT, docs/format.md §11.5)."""
    return {VERSIONS.key(v) for v in _expected(name).get("protocol", {}).get("late_records", [])}


def _load_tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_format_fixture", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _copy_fixture(name: str, tmp_path: Path) -> Path:
    """A private copy: opening a store creates its index inside it, never in the repo."""
    copy = tmp_path / name
    shutil.copytree(DATA / name, copy)
    return copy


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def v1_copy(tmp_path: Path) -> Path:
    return _copy_fixture("store-v1", tmp_path)


@pytest.fixture
def v1_store(v1_copy: Path) -> Iterator[chunkstore.Store]:
    with chunkstore.open(v1_copy, create=False) as store:
        yield store


def test_fixture_set_is_complete() -> None:
    assert "store-v1" in FIXTURE_NAMES
    for name in FIXTURE_NAMES:
        assert (DATA / name / "chunkstore.json").is_file(), name


# --- (a) every fixture stays readable ------------------------------------------------------


def _check_entries(reader: Any, entries: dict[str, Any]) -> None:
    assert reader.names() == sorted(entries)
    for name, want in entries.items():
        if want["kind"] == "data":
            assert plaindata.to_tree(reader.get_data(name)) == want["value"], name
            continue
        array = reader.get(name)
        assert chunkstore.format.dtypes.dtype_name(array.dtype) == want["dtype"], name
        assert list(array.shape) == want["shape"], name
        assert array.nbytes == want["nbytes"], name
        assert blake3.blake3(array.tobytes()).hexdigest() == want["blake3"], name


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_fixture_reads_back_exactly(name: str, tmp_path: Path) -> None:
    expected = _expected(name)
    root = _copy_fixture(name, tmp_path)
    late = _late_records(name)  # deleted by the first index to find them
    before = {k: v for k, v in tree_snapshot(root).items() if k not in late}
    with chunkstore.open(root, create=False) as store:
        assert store.chunk_size == expected["chunk_size"]
        assert [v.id for v in store.versions()] == [v["id"] for v in expected["versions"]]
        parent = None
        for want in expected["versions"]:
            info = store.resolve(f"{want['run']}@{want['step']}")
            assert (info.id, info.run, info.step) == (want["id"], want["run"], want["step"])
            assert plaindata.to_tree(info.meta) == want["meta"]
            assert info.parent == want.get("parent", parent)  # older fixtures: one run
            parent = info.id
            _check_entries(store.open_version(info.id), want["entries"])
        for tag, selector in expected["tags"].items():
            assert store.resolve(tag).id == store.resolve(selector).id
            assert store.tags() == {tag: store.resolve(selector).id}
        # store-v12 on: a legal hold, read from the store; the held version is not removed
        assert {vid: h.reason for vid, h in store.holds().items()} \
            == expected.get("holds", {})
        for held in expected.get("holds", {}):
            with pytest.raises(HeldVersionError):
                store.delete(held)
        result = store.verify()
        assert result.ok, result.to_json()
        assert result.versions_checked == len(expected["versions"])
        # a pack is one file, and verify reads each of its members on its own
        assert result.chunks_checked == (sum(expected["codec_counts"].values())
                                         - expected.get("awaiting_gc_chunks", 0)
                                         + expected.get("awaiting_gc_packs", 0)
                                         - expected["codec_counts"].get("pack", 0)
                                         + expected.get("packed_chunks", 0))
    assert tree_snapshot(root) == before, "reading a store must not change it"


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_fixture_index_is_rebuildable(name: str, tmp_path: Path) -> None:
    """The LMDB index is a cache: rebuilt from the objects alone, the store verifies."""
    expected = _expected(name)
    with chunkstore.open(_copy_fixture(name, tmp_path), create=False) as store:
        rebuilt = store.rebuild_index()
        assert rebuilt.versions == len(expected["versions"])
        assert rebuilt.skipped == []
        assert rebuilt.unreferenced_chunks == (expected.get("awaiting_gc_chunks", 0)
                                               + expected.get("repacked_into", 0))
        assert store.verify().ok
        assert store.tags() == {t: store.resolve(s).id for t, s in expected["tags"].items()}


def test_records_reencode_to_their_own_bytes(v1_store: chunkstore.Store) -> None:
    """Decoding then encoding a commit record gives back its bytes and its id."""
    for info in v1_store.versions():
        stored = v1_store.backend.get(VERSIONS.key(info.id))
        version_id, data = v1_store.read_record(info.id).encode()
        assert (version_id, data) == (info.id, stored)


# --- (b) the fixtures themselves never change ----------------------------------------------


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_fixture_objects_are_unchanged(name: str) -> None:
    expected = _expected(name)["objects"]
    actual = {key: blake3.blake3(data).hexdigest()
              for key, data in _files(DATA / name).items()}
    assert sorted(actual) == sorted(expected), "objects added to or removed from the fixture"
    changed = sorted(key for key in expected if actual[key] != expected[key])
    assert changed == [], f"fixture objects edited (never edit a fixture): {changed}"


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_fixture_objects_carry_their_format_versions(name: str) -> None:
    """Each object states the version its fixture was written with, and is named by its hash."""
    expected = _expected(name)
    versions, root = expected["format_versions"], DATA / name
    config = json.loads((root / "chunkstore.json").read_bytes())
    assert (config["format"], config["format_version"]) == ("chunkstore", versions["store"])
    census: dict[int, int] = {}
    for path in (root / "chunks").rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert (data[:4], data[4]) == (b"CSCK", versions["chunk"]), path.name
            census[data[5]] = census.get(data[5], 0) + 1
    codec_ids = {"raw": 0, "zstd": 1, "shuffle-zstd": 2, "xor-delta": 3, "pack": 4,
                 "sub-delta": 5}
    assert census == {codec_ids[n]: c for n, c in expected["codec_counts"].items()}
    for path in (root / "nodes").rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert blake3.blake3(data).hexdigest() == path.name
            assert path.parent.name == path.name[:2]
            assert json.loads(data)["format_version"] == versions["node"]
    for path in (root / "versions").iterdir():
        data = path.read_bytes()
        assert blake3.blake3(data).hexdigest() == path.name
        record = json.loads(data)
        assert (record["format"], record["format_version"]) == ("chunkstore.version",
                                                                 versions["record"])
    for path in (root / "leases").glob("*") if "lease" in versions else ():
        kind = ("lease_slot" if "@slot-" in path.name else "lease_marker"
                if "@rolled-" in path.name or "@withdrawn-" in path.name else "lease")
        assert json.loads(path.read_bytes())["format_version"] == versions[kind], path.name
    for path in (root / "readers").glob("*") if "read_lease" in versions else ():
        assert json.loads(path.read_bytes())["format_version"] == versions["read_lease"]
    holds = sorted(p.name for p in (root / "holds").glob("*"))
    assert holds == sorted(expected.get("holds", {}))
    for held_id in holds:
        hold = json.loads((root / "holds" / held_id).read_bytes())
        assert (hold["format"], hold["format_version"], hold["version"]) == (
            "chunkstore.hold", versions["hold"], held_id)


# --- (c) today's encoder reproduces the current fixture byte for byte ----------------------


def _chunk_difference(key: str, want: bytes, got: bytes) -> str:
    """Say whether a chunk differs in its header/codec choice or only in compressed bytes."""
    if got[:16] != want[:16]:
        return (f"{key}: header differs ({want[:24].hex()} -> {got[:24].hex()}): another"
                " codec, element size or length (see docs/format.md, Changing the format)")
    digest = Digest.parse(key.rsplit("/", 1)[-1])
    try:
        same = bytes(decode_object(digest, got)) == bytes(decode_object(digest, want))
    except ChunkStoreError as exc:
        return f"{key}: does not decode: {exc}"
    return (f"{key}: same header and content, other compressed bytes"
            f" ({len(want)} -> {len(got)} bytes{'' if same else ', CONTENT DIFFERS'});"
            f" zstandard {zstandard.__version__} (libzstd {zstandard.ZSTD_VERSION})")


@pytest.fixture(scope="module")
def rebuilt_current(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    name = _current_fixture()
    if name is None:
        pytest.fail(f"no fixture pins format versions {CURRENT_VERSIONS}: a format version"
                    " was bumped, so add a new fixture (tools/make_format_fixture.py --name"
                    " store-vN) and keep the old ones")
    root = tmp_path_factory.mktemp("golden") / name
    _load_tool().build(root)
    return name, root


def test_encoder_reproduces_manifest_nodes(rebuilt_current: tuple[str, Path]) -> None:
    name, root = rebuilt_current
    want = {k: v for k, v in _files(DATA / name).items() if k.startswith("nodes/")}
    got = {k: v for k, v in _files(root).items() if k.startswith("nodes/")}
    assert sorted(got) == sorted(want)
    changed = [k for k in want if got[k] != want[k]]
    assert not changed, f"manifest nodes encode differently: {changed}"


def test_encoder_reproduces_chunk_objects(rebuilt_current: tuple[str, Path]) -> None:
    name, root = rebuilt_current
    want = {k: v for k, v in _files(DATA / name).items() if k.startswith("chunks/")}
    got = {k: v for k, v in _files(root).items() if k.startswith("chunks/")}
    assert sorted(got) == sorted(want), "other chunk keys: the chunking changed"
    differences = [_chunk_difference(k, want[k], got[k]) for k in want if got[k] != want[k]]
    assert not differences, "\n".join(differences)


def test_encoder_reproduces_records_config_and_tags(rebuilt_current: tuple[str, Path]) -> None:
    """Records, config and tags carry creation times; every other field is reproduced."""
    name, root = rebuilt_current

    def loaded(base: Path, prefix: str) -> list[dict[str, Any]]:
        docs = [json.loads(v) for k, v in _files(base).items() if k.startswith(prefix)]
        for doc in docs:
            for volatile in ("created", "parent", "version"):
                doc.pop(volatile, None)
        return sorted(docs, key=lambda d: json.dumps(d, sort_keys=True))

    for prefix in ("versions/", "chunkstore.json", "tags/"):
        assert loaded(root, prefix) == loaded(DATA / name, prefix), prefix


# --- (d) byte layouts pinned by hand, independent of the code's constants -----------------


def _hand_header(codec_id: int, element_size: int, raw_length: int, payload_length: int,
                 flags: int = 0, version: int = 6) -> bytes:
    return (b"CSCK" + bytes([version, codec_id, element_size, flags])
            + raw_length.to_bytes(8, "little") + payload_length.to_bytes(8, "little"))


def test_chunk_header_layout_raw() -> None:
    raw = bytes(range(12))
    hand = _hand_header(0, 4, 12, 12) + raw
    assert len(hand) == 24 + 12
    assert encode_object(ChunkHeader(RAW.id, 4, 12, 12), RAW.encode(memoryview(raw), 4)) == hand
    assert bytes(decode_object(Digest.of(raw), hand)) == raw


def test_chunk_header_layout_zstd() -> None:
    raw = b"abcd" * 64
    payload = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(raw)
    hand = _hand_header(1, 1, len(raw), len(payload)) + payload
    assert encode_object(ChunkHeader(ZSTD.id, 1, len(raw), len(payload)),
                         ZSTD.encode(memoryview(raw), 1)) == hand
    assert bytes(decode_object(Digest.of(raw), hand)) == raw


def test_chunk_header_layout_with_base_key() -> None:
    """Version 1 reserved BASE: a reader parses the digest and no codec uses it."""
    base = Digest.of(b"base")
    head = _hand_header(0, 2, 4, 4, flags=1, version=1) + base.raw
    parsed = parse_header(Digest.of(b"wxyz"), head + b"wxyz")
    assert (parsed.base, parsed.size, parsed.payload_length) == (base, 56, 4)
    assert bytes(decode_object(Digest.of(b"wxyz"), head + b"wxyz")) == b"wxyz"
    # Version 2 sets BASE exactly for a delta codec.
    with pytest.raises(ChunkStoreError, match="BASE flag"):
        parse_header(Digest.of(b"wxyz"), _hand_header(0, 2, 4, 4, flags=1) + base.raw)
    with pytest.raises(ChunkStoreError, match="unknown codec id 3"):
        parse_header(Digest.of(b"wxyz"), _hand_header(3, 2, 4, 4, flags=1, version=1)
                     + base.raw)


def test_xor_delta_layout() -> None:
    """Codec 3: header, base digest, then the shuffle payload of (chunk XOR base)."""
    base_raw = np.arange(1024, dtype=np.float32).tobytes()
    new = np.arange(1024, dtype=np.float32)
    new[[3, 700]] = -1
    raw = new.tobytes()
    xor = bytes(a ^ b for a, b in zip(raw, base_raw, strict=True))
    payload = _shuffle_payload(xor, 4)
    base = Digest.of(base_raw)
    obj = _hand_header(3, 4, len(raw), len(payload), flags=1) + base.raw + payload
    assert encode_object(ChunkHeader(XOR_DELTA.id, 4, len(raw), len(payload), base),
                         XOR_DELTA.encode(memoryview(xor), 4)) == obj
    assert bytes(decode_object(Digest.of(raw), obj, base=base_raw)) == raw
    with pytest.raises(ChunkStoreError, match="hashes to"):
        decode_object(Digest.of(raw), obj, base=raw)  # another base: caught by the hash
    one_plane = _shuffle_payload(xor, 1)
    assert bytes(XOR_DELTA.encode(memoryview(xor), 1)) == one_plane


@pytest.mark.parametrize("element_size", [1, 2, 4, 8])
def test_sub_delta_layout(element_size: int) -> None:
    """Codec 5 (chunk version 4): header, base digest, then the shuffle payload of the
    zigzag of (chunk - base), element by element as little-endian unsigned integers,
    modulo 2^(8 x element size); computed here with Python integers."""
    rng = np.random.default_rng(element_size)
    base_raw = rng.integers(0, 256, 512 * element_size, dtype=np.uint8).tobytes()
    new = bytearray(base_raw)
    for i in (0, 3, 100, 511):  # small steps either way, and one wrapping around
        old = int.from_bytes(base_raw[i * element_size:(i + 1) * element_size], "little")
        step = {0: 1, 3: -1, 100: 300, 511: 2 ** (8 * element_size - 1)}[i]
        new[i * element_size:(i + 1) * element_size] = (
            (old + step) % 2 ** (8 * element_size)).to_bytes(element_size, "little")
    raw, bits = bytes(new), 8 * element_size
    image = b""
    for i in range(0, len(raw), element_size):
        d = (int.from_bytes(raw[i:i + element_size], "little")
             - int.from_bytes(base_raw[i:i + element_size], "little")) % 2 ** bits
        signed = d - 2 ** bits if d >= 2 ** (bits - 1) else d
        zigzag = 2 * signed if signed >= 0 else -2 * signed - 1
        image += zigzag.to_bytes(element_size, "little")
    payload = _shuffle_payload(image, element_size)
    base = Digest.of(base_raw)
    obj = _hand_header(5, element_size, len(raw), len(payload), flags=1) + base.raw + payload
    assert bytes(SUB_DELTA.image_of(memoryview(raw), base_raw, element_size)) == image
    assert encode_object(ChunkHeader(SUB_DELTA.id, element_size, len(raw), len(payload), base),
                         SUB_DELTA.encode(memoryview(image), element_size)) == obj
    assert bytes(decode_object(Digest.of(raw), obj, base=base_raw)) == raw
    with pytest.raises(ChunkStoreError, match="hashes to"):
        decode_object(Digest.of(raw), obj, base=raw)  # another base: caught by the hash
    with pytest.raises(ChunkStoreError, match="unknown codec id 5"):
        parse_header(Digest.of(raw), _hand_header(5, element_size, len(raw), len(payload),
                                                  flags=1, version=3) + base.raw)


def _zigzag(new: bytes, old: bytes, element_size: int) -> bytes:
    bits = 8 * element_size
    d = (int.from_bytes(new, "little") - int.from_bytes(old, "little")) % 2 ** bits
    signed = d - 2 ** bits if d >= 2 ** (bits - 1) else d
    return (2 * signed if signed >= 0 else -2 * signed - 1).to_bytes(element_size, "little")


@pytest.mark.parametrize("element_size", [1, 2, 4, 8])
def test_sparse_delta_layout(element_size: int) -> None:
    """Codec 6 (chunk version 6): u32 run count, u32 table length, a zstd frame of (gap,
    count) u32 pairs, then a mode byte and the runs' zigzag images: raw (mode 0) where
    compressing does not halve them, else (mode 1) a codec-5 shuffle payload.  Runs
    four or fewer unchanged elements apart are one run.  Built here by hand."""
    rng = np.random.default_rng(element_size)
    n = 512
    base_raw = rng.integers(0, 256, n * element_size, dtype=np.uint8).tobytes()
    changed = [3, 5, 6, 8, 100, 101, 300, 511]  # 3..8 one run (gaps of 1); then 100..101
    new = bytearray(base_raw)
    for k, i in enumerate(changed):
        old = int.from_bytes(base_raw[i * element_size:(i + 1) * element_size], "little")
        new[i * element_size:(i + 1) * element_size] = (
            (old + (k + 1) * (-1) ** k) % 2 ** (8 * element_size)).to_bytes(element_size,
                                                                           "little")
    raw = bytes(new)
    runs = [(3, 6), (100, 2), (300, 1), (511, 1)]  # (start, count)
    table, end, values = b"", 0, b""
    for start, count in runs:
        table += (start - end).to_bytes(4, "little") + count.to_bytes(4, "little")
        end = start + count
        for i in range(start, end):
            at = slice(i * element_size, (i + 1) * element_size)
            values += _zigzag(raw[at], base_raw[at], element_size)
    packed_table = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(table)
    payload = (len(runs).to_bytes(4, "little") + len(packed_table).to_bytes(4, "little")
               + packed_table + bytes([0]) + values)  # ten values: compressing cannot halve
    base = Digest.of(base_raw)
    obj = _hand_header(6, element_size, len(raw), len(payload), flags=1) + base.raw + payload
    image = SPARSE_DELTA.image_of(memoryview(raw), base_raw, element_size)
    assert encode_object(ChunkHeader(SPARSE_DELTA.id, element_size, len(raw), len(payload),
                                     base), SPARSE_DELTA.encode(image, element_size)) == obj
    assert bytes(decode_object(Digest.of(raw), obj, base=base_raw)) == raw
    assert bytes(SPARSE_DELTA.decode(memoryview(payload), len(raw), element_size)) == bytes(image)
    # Mode 1: the same runs' images as a codec-5 payload decode alike.
    packed = (payload[:8 + len(packed_table)] + bytes([1])
              + _shuffle_payload(values, element_size))
    obj = _hand_header(6, element_size, len(raw), len(packed), flags=1) + base.raw + packed
    assert bytes(decode_object(Digest.of(raw), obj, base=base_raw)) == raw
    with pytest.raises(ChunkStoreError, match="unknown codec id 6"):
        parse_header(Digest.of(raw), _hand_header(6, element_size, len(raw), len(payload),
                                                  flags=1, version=5) + base.raw)


@pytest.mark.parametrize("damage", ["run past the end", "empty run", "values short",
                                    "unknown mode", "table short", "runs without table"])
def test_sparse_delta_refuses_damaged_payloads(damage: str) -> None:
    """Each malformed sparse-delta payload is a corrupt chunk, not a guess or a crash."""
    base_raw = bytes(range(64))
    raw = bytearray(base_raw)
    raw[8] ^= 1
    image = SPARSE_DELTA.image_of(memoryview(bytes(raw)), base_raw, 4)
    payload = bytearray(SPARSE_DELTA.encode(image, 4))
    count, length = int.from_bytes(payload[:4], "little"), int.from_bytes(payload[4:8], "little")
    table = zstandard.ZstdDecompressor().decompress(bytes(payload[8:8 + length]))
    rest = payload[8 + length:]

    def rebuild(pairs: bytes, tail: bytes | bytearray, runs: int = count) -> bytes:
        frame = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(pairs)
        return (runs.to_bytes(4, "little") + len(frame).to_bytes(4, "little") + frame
                + bytes(tail))

    bad = {
        "run past the end": lambda: rebuild((15).to_bytes(4, "little") + (2).to_bytes(4, "little"),
                                            rest + rest[1:]),
        "empty run": lambda: rebuild(table[:4] + (0).to_bytes(4, "little"), rest[:1]),
        "values short": lambda: rebuild(table, rest[:-1]),
        "unknown mode": lambda: rebuild(table, bytes([7]) + rest[1:]),
        "table short": lambda: rebuild(table[:-4], rest),
        "runs without table": lambda: (0).to_bytes(4, "little") + (0).to_bytes(4, "little")
        + bytes(rest),
    }[damage]()
    obj = (_hand_header(6, 4, len(raw), len(bad), flags=1) + Digest.of(base_raw).raw + bad)
    with pytest.raises(ChunkStoreError, match="corrupt"):
        decode_object(Digest.of(bytes(raw)), obj, base=base_raw)


def test_sub_delta_refuses_other_element_sizes() -> None:
    """An element size that is no machine integer's is refused as corrupt, not guessed."""
    raw = bytes(range(48))
    payload = _shuffle_payload(raw, 3)
    obj = _hand_header(5, 3, len(raw), len(payload), flags=1) + Digest.of(raw).raw + payload
    with pytest.raises(ChunkStoreError, match="element size"):
        decode_object(Digest.of(raw), obj, base=raw)


def test_pack_layout() -> None:
    """Codec 4 (chunk version 3): a pack's content is complete member chunk objects end
    to end, stored as they are; its key is the digest of the content; a shard lists
    ``[pack, offset, length]`` (offset into the content) for each packed chunk."""
    a, b = bytes(range(12)), b"xyz" * 5
    member_a = _hand_header(0, 4, 12, 12) + a
    member_b = _hand_header(0, 1, 15, 15) + b
    content = member_a + member_b
    pack = _hand_header(4, 1, len(content), len(content)) + content
    key = Digest.of(content)
    assert encode_object(ChunkHeader(4, 1, len(content), len(content)), content) == pack
    assert bytes(decode_object(key, pack)) == content
    with pytest.raises(ChunkStoreError, match="unknown codec id 4"):
        parse_header(key, _hand_header(4, 1, len(content), len(content), version=2))
    shard = Shard((0,), (15,), 4096, (Digest.of(b),), (),
                  (PackLocation(key, len(member_a), len(member_b)),))
    assert shard.to_json()["packs"] == [[key.hex, 36, 39]]
    assert list(TensorEntry("uint8", (15,), (shard,)).chunk_digests()) == [key]


def _shuffle_payload(raw: bytes, element_size: int) -> bytes:
    """Plane i holds byte i of every element; a plane that zstd does not shrink stays raw.
    (Planes of at most 64 KiB, so the encoder's probe never applies.)"""
    planes = [raw[i::element_size] for i in range(element_size)]
    table, bodies = bytearray([element_size]), b""
    for plane in planes:
        packed = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(plane)
        mode, body = (1, packed) if len(packed) < len(plane) else (0, plane)
        table += bytes([mode]) + len(body).to_bytes(4, "little")
        bodies += body
    return bytes(table) + bodies


@pytest.mark.parametrize("element_size", [2, 4, 8])
def test_shuffle_payload_layout(element_size: int) -> None:
    # 2048 elements: byte 0 noisy (kept raw), the rest constant or smooth (compressed).
    rng = np.random.default_rng(element_size)
    elements = np.zeros((2048, element_size), dtype=np.uint8)
    elements[:, 0] = rng.integers(0, 256, 2048, dtype=np.uint8)
    elements[:, -1] = np.arange(2048) // 256
    raw = elements.tobytes()
    hand = _shuffle_payload(raw, element_size)
    modes = [hand[1 + 5 * i] for i in range(element_size)]
    assert modes[0] == 0 and modes[-1] == 1, "the test data must exercise both plane modes"
    assert bytes(SHUFFLE_ZSTD.encode(memoryview(raw), element_size)) == hand
    obj = _hand_header(2, element_size, len(raw), len(hand)) + hand
    assert bytes(decode_object(Digest.of(raw), obj)) == raw


def test_key_layout() -> None:
    empty = Digest.parse(BLAKE3_OF_NOTHING)
    assert Digest.of(b"") == empty
    assert CHUNKS.key(empty) == f"chunks/af/{BLAKE3_OF_NOTHING}"
    assert NODES.key(empty) == f"nodes/af/{BLAKE3_OF_NOTHING}"
    assert VERSIONS.key(BLAKE3_OF_NOTHING) == f"versions/{BLAKE3_OF_NOTHING}"
    assert TAGS.key("best") == "tags/best"


def test_store_config_bytes() -> None:
    assert StoreConfig(4096, "auto", 1.25, 4).encode() == (
        b'{"chunk_size":4096,"compression":"auto","created":1.25,"delta_depth":4,'
        b'"format":"chunkstore","format_version":9}')
    old = (b'{"chunk_size":4096,"compression":"auto","created":1.25,"format":"chunkstore",'
           b'"format_version":1}')
    assert StoreConfig.decode("x", old).delta_depth == 0  # version 1: no deltas


def test_a_version_1_store_is_read_as_it_is_and_upgraded_by_its_first_write(
        v1_copy: Path) -> None:
    """Reading changes nothing; the first save (a session, a version-2 object) makes the
    store the current version (with no deltas: it had no delta_depth), so releases that
    do not honour sessions refuse it from then on."""
    config = (v1_copy / "chunkstore.json").read_bytes()
    with chunkstore.open(v1_copy, create=False) as store:
        assert store.config.format_version == 1
        store.verify()
        store.stats()
        assert (v1_copy / "chunkstore.json").read_bytes() == config
        with store.new_version("later", 1) as version:
            version.put("x", np.arange(10, dtype=np.int64))
    upgraded = json.loads((v1_copy / "chunkstore.json").read_bytes())
    assert upgraded["format_version"] == STORE_FORMAT_VERSION
    assert upgraded.pop("delta_depth") == 0
    assert {k: v for k, v in upgraded.items() if k != "format_version"} == {
        k: v for k, v in json.loads(config).items() if k != "format_version"}
    with chunkstore.open(v1_copy, create=False) as store:
        assert store.config.format_version == STORE_FORMAT_VERSION
        assert len(store.versions()) == 3 and store.verify().ok


def test_tree_node_bytes() -> None:
    d1, d2, d3, d4, d5 = (Digest(bytes([i]) * 32) for i in (1, 2, 3, 4, 5))
    node = TreeNode(subtrees={"w": d1}, leaves={
        "w": TensorEntry("float32", (2, 3), (Shard((0, 0), (2, 3), 4096, (d2,)),)),
        "\u00e9": DataEntry(d3, 5),
        "v": TensorEntry("uint8", (2,), (Shard((0,), (2,), 1, (d4, d5), ((d3,), ())),)),
    })
    digest, data = encode_tree(node)
    assert data == (
        '{"entries":{"v":{"tensor":{"dtype":"uint8","shape":[2],"shards":[{"bases":'
        f'[["{d3.hex}"],[]],"chunk_bytes":1,"chunks":["{d4.hex}","{d5.hex}"],"offsets":[0],'
        '"sizes":[2]}]}},'
        '"w":{"tensor":{"dtype":"float32","shape":[2,3],"shards":[{"chunk_bytes":'
        f'4096,"chunks":["{d2.hex}"],"offsets":[0,0],"sizes":[2,3]}}]}},"tree":"{d1.hex}"}},'
        f'"\u00e9":{{"data":{{"nbytes":5,"node":"{d3.hex}"}}}}}},"format_version":6,'
        '"kind":"tree"}').encode()
    assert digest.hex == blake3.blake3(data).hexdigest()
    assert decode_tree(digest, data) == node


def test_data_node_bytes_and_tags() -> None:
    value = {"a": [1, 2.5, None, True], "t": (1, "\u00e9"), "b": b"\x00\xff",
             "f": [float("nan"), float("inf"), float("-inf")], "$k": 1}
    digest, data, nbytes = encode_data(value)
    payload = (b'{"$dict":[["a",[1,2.5,null,true]],["t",{"$tuple":[1,"\\u00e9"]}],'
               b'["b",{"$bytes":"AP8="}],["f",[{"$float":"nan"},{"$float":"inf"},'
               b'{"$float":"-inf"}]],["$k",1]]}')
    assert data == b'{"format_version":6,"kind":"data","value":' + payload + b"}"
    assert nbytes == len(payload)
    assert digest.hex == blake3.blake3(data).hexdigest()
    decoded = decode_data(digest, data)
    assert plaindata.to_tree(decoded) == plaindata.to_tree(value)
    assert plaindata.encode({1: {"x": 1}}) == b'{"$dict":[[1,{"x":1}]]}'


def test_commit_record_bytes_and_id() -> None:
    root = Digest(b"\x11" * 32)
    record = CommitRecord(run="r", step=7, parent=None, created=1.5, root=root,
                          meta={"k": (1, b"\x00"), "n": "\u00e9"}, logical_bytes=10,
                          new_bytes=4, new_stored_bytes=30)
    version_id, data = record.encode()
    assert data == (
        '{"created":1.5,"format":"chunkstore.version","format_version":1,"logical_bytes":10,'
        '"meta":{"k":{"$tuple":[1,{"$bytes":"AA=="}]},"n":"\u00e9"},"new_bytes":4,'
        f'"new_stored_bytes":30,"parent":null,"root":"{root.hex}","run":"r","step":7}}'
    ).encode()
    assert version_id == blake3.blake3(data).hexdigest()
    assert CommitRecord.decode(version_id, data) == record


# --- (e) newer format versions are refused, never read -------------------------------------


def _bumped_json(data: bytes, version: int) -> bytes:
    obj = json.loads(data)
    obj["format_version"] = version
    return json.dumps(obj, sort_keys=True, separators=(",", ":"),
                      ensure_ascii=False).encode("utf-8")


def _put(root: Path, key: str, data: bytes) -> None:
    path = root / key
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def _add_record(root: Path, record: CommitRecord, version: int | None = None) -> str:
    version_id, data = record.encode()
    if version is not None:
        data = _bumped_json(data, version)
        version_id = blake3.blake3(data).hexdigest()
    _put(root, VERSIONS.key(version_id), data)
    return version_id


def _first_record(root: Path) -> CommitRecord:
    expected = _expected("store-v1")
    version_id = expected["versions"][0]["id"]
    return CommitRecord.decode(version_id, (root / VERSIONS.key(version_id)).read_bytes())


def test_newer_store_version_is_refused(v1_copy: Path) -> None:
    config = v1_copy / "chunkstore.json"
    config.write_bytes(_bumped_json(config.read_bytes(), max(STORE_FORMAT_VERSIONS) + 1))
    before = _files(v1_copy)
    with pytest.raises(FormatVersionError) as info:
        chunkstore.open(v1_copy, create=False)
    assert (info.value.found, info.value.supported) == (max(STORE_FORMAT_VERSIONS) + 1,
                                                        STORE_FORMAT_VERSION)
    assert _files(v1_copy) == before, "a refused store must not be touched (no index either)"


def test_newer_record_version_is_refused(v1_copy: Path) -> None:
    record = _first_record(v1_copy)
    newer = _add_record(v1_copy, CommitRecord(**{**record.__dict__, "step": 99}),
                        RECORD_FORMAT_VERSION + 1)
    with chunkstore.open(v1_copy, create=False) as store:
        assert newer not in {v.id for v in store.versions()}, "an unreadable version is listed"
        with pytest.raises(FormatVersionError) as info:
            store.read_record(newer)
        assert info.value.found == RECORD_FORMAT_VERSION + 1
        problems = store.verify().problems
        assert [(p.kind, p.version) for p in problems] == [("format-version", newer)]
        _check_entries(store.open_version("fmt@1"),
                       _expected("store-v1")["versions"][0]["entries"])


def test_newer_tree_node_version_is_refused(v1_copy: Path) -> None:
    record = _first_record(v1_copy)
    root_bytes = (v1_copy / NODES.key(record.root)).read_bytes()
    newer_root = _bumped_json(root_bytes, NODE_FORMAT_VERSION + 1)
    newer_digest = Digest.of(newer_root)
    _put(v1_copy, NODES.key(newer_digest), newer_root)
    version_id = _add_record(v1_copy, CommitRecord(**{**record.__dict__, "root": newer_digest,
                                                      "step": 99}))
    with pytest.raises(FormatVersionError):
        decode_tree(newer_digest, newer_root)
    with chunkstore.open(v1_copy, create=False) as store:
        assert version_id not in {v.id for v in store.versions()}
        with pytest.raises(FormatVersionError):
            flatten(store.objects, newer_digest, store.node_cache)
        info = store.info_from_entry(entry_from_record(version_id, store.read_record(version_id)))
        with pytest.raises(FormatVersionError):
            chunkstore.read.reader.VersionReader(store, info)
        problems = store.verify().problems
        assert [(p.kind, p.version) for p in problems] == [("format-version", version_id)]


def test_newer_data_node_version_is_refused(v1_copy: Path) -> None:
    newer = _bumped_json(encode_data({"epoch": 5})[1], NODE_FORMAT_VERSION + 1)
    data_digest = Digest.of(newer)
    _put(v1_copy, NODES.key(data_digest), newer)
    root_digest, root = encode_tree(TreeNode(leaves={"trainer": DataEntry(data_digest, 11)}))
    _put(v1_copy, NODES.key(root_digest), root)
    record = _first_record(v1_copy)
    _add_record(v1_copy, CommitRecord(**{**record.__dict__, "root": root_digest, "step": 99}))
    with chunkstore.open(v1_copy, create=False) as store:
        reader = store.open_version("fmt@99")
        with pytest.raises(FormatVersionError) as info:
            reader.get_data("trainer")
        assert info.value.found == NODE_FORMAT_VERSION + 1


def _bump_chunk(root: Path) -> tuple[str, bytes]:
    """Raise the version byte of the first chunk of ``model.counts`` (fmt@1); keep its key."""
    node = json.loads((root / NODES.key(_first_record(root).root)).read_bytes())
    model = json.loads((root / NODES.key(Digest.parse(node["entries"]["model"]["tree"])))
                       .read_bytes())
    digest = model["entries"]["counts"]["tensor"]["shards"][0]["chunks"][0]
    path = root / CHUNKS.key(Digest.parse(digest))
    data = bytearray(path.read_bytes())
    data[4] = CHUNK_FORMAT_VERSION + 1
    path.write_bytes(bytes(data))
    return digest, bytes(data)


def test_newer_chunk_version_is_never_returned(v1_copy: Path) -> None:
    digest, data = _bump_chunk(v1_copy)
    with pytest.raises(ChunkStoreError):
        decode_object(Digest.parse(digest), data)
    with chunkstore.open(v1_copy, create=False) as store:
        with pytest.raises(ChunkStoreError):
            store.open_version("fmt@1").get("model.counts")
        assert store.open_version("fmt@1").get("head").shape == (3, 4)
        assert not store.verify().ok


def test_newer_chunk_version_raises_format_version_error(v1_copy: Path) -> None:
    digest, data = _bump_chunk(v1_copy)
    with pytest.raises(FormatVersionError):
        decode_object(Digest.parse(digest), data)
    with chunkstore.open(v1_copy, create=False) as store:
        with pytest.raises(FormatVersionError):
            store.open_version("fmt@1").get("model.counts")
        assert {p.kind for p in store.verify().problems} == {"format-version"}


def test_verify_reports_an_edited_data_node(v1_copy: Path) -> None:
    record = _first_record(v1_copy)
    root = decode_tree(record.root, (v1_copy / NODES.key(record.root)).read_bytes())
    trainer = root.leaves["trainer"]
    assert isinstance(trainer, DataEntry)
    path = v1_copy / NODES.key(trainer.digest)
    path.write_bytes(path.read_bytes().replace(b'"epoch":3', b'"epoch":5'))
    with chunkstore.open(v1_copy, create=False) as store:
        assert not store.verify().ok


# --- (f) protocol objects: run leases, commit slots, markers, read leases -------------------


@pytest.mark.parametrize("name", PROTOCOL_FIXTURES)
def test_a_late_record_of_a_withdrawn_version_is_never_listed(name: str, tmp_path: Path
                                                              ) -> None:
    """A record its stopped writer PUT after the run's new owner had rolled the version
    forward and removed it (``@rolled-`` and ``@withdrawn-``, docs/format.md §11.5): no
    reader lists it, and every index that finds it deletes it, a fresh one or one that
    deleted it before (in the copy: the fixture keeps it)."""
    expected = _expected(name)
    listed = [v["id"] for v in expected["versions"]]
    root = _copy_fixture(name, tmp_path)
    late = {key: (root / key).read_bytes() for key in sorted(_late_records(name))}
    assert late and {k.removeprefix("versions/") for k in late} <= set(
        expected["protocol"]["withdrawn"])
    for again in ("a fresh index", "the index that deleted them", "a rebuilt index"):
        if again != "a rebuilt index":
            for key, data in late.items():
                _put(root, key, data)  # the late PUT (again), before the index looks
        with chunkstore.open(root, create=False) as store:
            if again == "a rebuilt index":
                for key, data in late.items():
                    _put(root, key, data)
                assert store.rebuild_index().versions == len(listed)
            assert [v.id for v in store.versions()] == listed, again
            for data in late.values():
                record = json.loads(data)
                with pytest.raises(ChunkStoreError):
                    store.resolve(f"{record['run']}@{record['step']}")
            assert store.verify().ok
        assert not any((root / key).exists() for key in late), again


@pytest.mark.parametrize("name", PROTOCOL_FIXTURES)
def test_the_next_launch_takes_the_run_from_its_gone_holder_and_rolls_nothing_forward(
        name: str, tmp_path: Path) -> None:
    """The run's highest generation is held by a process on another machine: it lives
    while its object was written within a lease by the store's clock, and once not, the
    next launch takes the run without ``takeover``; the highest commit slot is a fence,
    so its walk rolls nothing forward (the withdrawn intent below it stays unpublished).
    A checkout does not keep mtimes: the copy's holder object is set to the time it was
    last written, or to now."""
    expected = _expected(name)
    protocol = expected["protocol"]
    run, holder = protocol["run"], protocol["holder"]
    root = _copy_fixture(name, tmp_path)
    generation = root / LEASES.key(f"{run}@gen-{holder['generation']:012d}")
    os.utime(generation, None)  # just rewritten by its holder: alive
    with chunkstore.open(root, create=False) as store:
        records = sorted(store.objects.ids(VERSIONS))
        with pytest.raises(RunInUseError, match=re.escape(holder["host"])):
            RunLease(store.objects, run).acquire()
    os.utime(generation, (holder["heartbeat"], holder["heartbeat"]))  # its last heartbeat
    with chunkstore.open(root, create=False) as store:
        lease = RunLease(store.objects, run)
        lease.acquire()
        try:
            assert lease.generation == holder["generation"] + 1
            assert lease.took_over is not None
            assert {k: lease.took_over.get(k) for k in holder} == holder
            assert lease.head is None, "a version rolled forward past the fence"
            top = max(int(n) for n in protocol["slots"])
            assert protocol["slots"][str(top)] == "fence"
            assert store.objects.exists(LEASES, f"{run}@slot-{top + 1:012d}")  # its fence
            assert sorted(store.objects.ids(VERSIONS)) == records
            store.reconcile()
            assert [v.id for v in store.versions()] == [v["id"] for v in expected["versions"]]
        finally:
            lease.release()


@pytest.mark.parametrize("name", PROTOCOL_FIXTURES)
def test_gc_deletes_the_expired_read_lease_which_protects_nothing(name: str, tmp_path: Path
                                                                  ) -> None:
    """A reader killed long ago on another machine left its lease (docs/format.md §11.6):
    it protects nothing (what only its removed version reaches is deleted), a GC deletes
    it, and every listed version stays whole."""
    expected = _expected(name)
    protocol = expected["protocol"]
    root = _copy_fixture(name, tmp_path)
    reached = protocol["reached_by_expired_readers_only"]
    assert reached and all((root / key).is_file() for key in reached)
    with chunkstore.open(root, create=False) as store:
        leases = {lease.id: lease.version for lease in list_read_leases(store.objects)}
        assert leases == protocol["expired_read_leases"]
        assert sorted(expired_read_leases(store.objects)) == sorted(leases)
        store.gc(grace=0)
        assert list(store.objects.ids(READERS)) == []
        assert [key for key in reached if (root / key).exists()] == []
        assert [v.id for v in store.versions()] == [v["id"] for v in expected["versions"]]
        # store-v12 on: a legal hold, read from the store; the held version is not removed
        assert {vid: h.reason for vid, h in store.holds().items()} \
            == expected.get("holds", {})
        for held in expected.get("holds", {}):
            with pytest.raises(HeldVersionError):
                store.delete(held)
        result = store.verify()
        assert result.ok, result.to_json()
        assert result.versions_checked == len(expected["versions"])
        for want in expected["versions"]:
            _check_entries(store.open_version(want["id"]), want["entries"])
