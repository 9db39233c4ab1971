"""Damaged stores (invariant 5 and the chunk-object contract): every kind of
damage gives a specific typed error on read, never wrong data, and ``verify``
reports it with the right problem kind.

The damage is done to the real files of a local store, and every read goes
through a freshly opened store (no cache from the save survives).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import blake3
import numpy as np
import pytest

import chunkstore
from chunkstore.codecs import RAW, SHUFFLE_ZSTD, ZSTD
from chunkstore.errors import (
    CorruptChunkError,
    CorruptNodeError,
    CorruptRecordError,
    FormatVersionError,
    IntegrityError,
    MissingChunkError,
)
from chunkstore.format.chunkobj import HEADER
from chunkstore.format.digest import Digest
from chunkstore.format.manifest import NODE_FORMAT_VERSION, TensorEntry, decode_tree
from chunkstore.format.records import STORE_FORMAT_VERSIONS
from tests.conftest import SMALL_CHUNK

# 4 chunks of 64 KiB (the last one short); compresses well under every codec.
WEIGHTS = (np.arange(60_000) % 251).astype(np.float32)
OTHER = np.arange(1000, dtype=np.int64) * 7
TRAINER = {"epoch": 3, "lr": 0.01, "tags": ("a", "b")}

Reopen = Callable[[], chunkstore.Store]


@dataclass
class Saved:
    path: Path
    version_id: str
    root: str  # hex digest of the root tree node
    chunk: str  # hex digest of the second chunk of "w"
    data_node: str  # hex digest of the "trainer" data node


def _object_path(store_path: Path, prefix: str, hex_digest: str) -> Path:
    return store_path / prefix / hex_digest[:2] / hex_digest


def _save(store_path: Path, compression: str) -> Saved:
    # node_size 0: "model" is a tree node of its own, for the damaged-subtree tests.
    with chunkstore.open(store_path, chunk_size=SMALL_CHUNK, compression=compression,
                         node_size=0, create=True) as store:
        with store.new_version(run="r", step=1) as version:
            version.put("model.w", WEIGHTS)
            version.put("model.other", OTHER)
            version.put_data("trainer", TRAINER)
        reader = store.open_version("r@1")
        weights = reader.entry("model.w")
        trainer = reader.entry("trainer")
        assert isinstance(weights, TensorEntry) and not isinstance(trainer, TensorEntry)
        return Saved(store_path, version.info.id, version.info.root.hex,
                     weights.shards[0].chunks[1].hex, trainer.digest.hex)


@pytest.fixture(params=["none", "zstd", "shuffle-zstd"])
def saved(request: pytest.FixtureRequest, store_path: Path) -> Saved:
    """A store with one version whose chunks use the codec the policy names."""
    saved = _save(store_path, request.param)
    codec = {"none": RAW, "zstd": ZSTD, "shuffle-zstd": SHUFFLE_ZSTD}[request.param]
    assert _object_path(store_path, "chunks", saved.chunk).read_bytes()[5] == codec.id
    return saved


@pytest.fixture
def raw_saved(store_path: Path) -> Saved:
    return _save(store_path, "none")


@pytest.fixture
def reopen(store_path: Path) -> Iterator[Reopen]:
    """Opens the store afresh (after the test damaged it); closes it at the end."""
    stores: list[chunkstore.Store] = []

    def reopen_() -> chunkstore.Store:
        stores.append(chunkstore.open(store_path, create=False))
        return stores[-1]

    yield reopen_
    for store in stores:
        store.close()


def _problem_kinds(store: chunkstore.Store) -> set[str]:
    result = store.verify()
    assert not result.ok
    return {p.kind for p in result.problems}


def _assert_chunk_error_on_every_read(store: chunkstore.Store, error: type[IntegrityError],
                                      digest: str) -> None:
    reader = store.open_version("r@1")
    with pytest.raises(error) as raised:
        reader.get("model.w")
    assert raised.value.digest == digest  # type: ignore[attr-defined]
    assert digest[:16] in str(raised.value)
    out = np.zeros_like(WEIGHTS)
    with pytest.raises(error):
        reader.get_into("model.w", out)
    # Entries that do not use the damaged chunk still load, bit-exact.
    assert reader.get("model.other").tobytes() == OTHER.tobytes()
    assert reader.get_data("trainer") == TRAINER


# --- chunks ---------------------------------------------------------------------------------


@pytest.mark.parametrize("offset", [HEADER.size, -1], ids=["first-payload-byte", "last-byte"])
def test_flipped_byte_in_a_chunk_is_detected(saved: Saved, reopen: Reopen, offset: int
                                             ) -> None:
    path = _object_path(saved.path, "chunks", saved.chunk)
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))

    store = reopen()
    _assert_chunk_error_on_every_read(store, CorruptChunkError, saved.chunk)
    result = store.verify()
    assert [(p.kind, p.digest, p.version) for p in result.problems] == [
        ("corrupt-chunk", saved.chunk, saved.version_id)]


def test_flipped_byte_in_a_raw_chunk_is_detected_by_get_into(raw_saved: Saved,
                                                             reopen: Reopen) -> None:
    """Raw chunks are read straight into the caller's buffer; the hash is still checked."""
    path = _object_path(raw_saved.path, "chunks", raw_saved.chunk)
    data = bytearray(path.read_bytes())
    data[HEADER.size + 1000] ^= 0x80
    path.write_bytes(bytes(data))

    store = reopen()
    out = np.empty_like(WEIGHTS)
    with pytest.raises(CorruptChunkError, match="hashes to") as raised:
        store.open_version("r@1").get_into("model.w", out)
    assert raised.value.digest == raw_saved.chunk


def test_flipped_header_byte_is_detected(saved: Saved, reopen: Reopen) -> None:
    path = _object_path(saved.path, "chunks", saved.chunk)
    data = bytearray(path.read_bytes())
    data[0] ^= 0xFF  # the magic
    path.write_bytes(bytes(data))

    store = reopen()
    _assert_chunk_error_on_every_read(store, CorruptChunkError, saved.chunk)
    assert _problem_kinds(store) == {"corrupt-chunk"}


@pytest.mark.parametrize("keep", [HEADER.size - 4, HEADER.size, HEADER.size + 100, -1],
                         ids=["inside-header", "header-only", "short-payload", "last-byte-cut"])
def test_truncated_chunk_is_detected(saved: Saved, reopen: Reopen, keep: int) -> None:
    path = _object_path(saved.path, "chunks", saved.chunk)
    data = path.read_bytes()
    path.write_bytes(data[:keep])

    store = reopen()
    _assert_chunk_error_on_every_read(store, CorruptChunkError, saved.chunk)
    with pytest.raises(CorruptChunkError, match="truncated"):
        store.open_version("r@1").get("model.w")
    assert _problem_kinds(store) == {"corrupt-chunk"}


def test_padded_chunk_is_detected(saved: Saved, reopen: Reopen) -> None:
    path = _object_path(saved.path, "chunks", saved.chunk)
    path.write_bytes(path.read_bytes() + b"\x00")

    store = reopen()
    _assert_chunk_error_on_every_read(store, CorruptChunkError, saved.chunk)
    assert _problem_kinds(store) == {"corrupt-chunk"}


def test_deleted_chunk_is_missing(saved: Saved, reopen: Reopen) -> None:
    _object_path(saved.path, "chunks", saved.chunk).unlink()

    store = reopen()
    _assert_chunk_error_on_every_read(store, MissingChunkError, saved.chunk)
    result = store.verify()
    assert [(p.kind, p.digest) for p in result.problems] == [("missing-chunk", saved.chunk)]
    # Without reading data, verify still sees that the object is gone.
    assert [p.kind for p in store.verify(read_data=False).problems] == ["missing-chunk"]


def test_chunk_swapped_for_another_chunk_is_detected(raw_saved: Saved, reopen: Reopen
                                                     ) -> None:
    """A well-formed object under the wrong name (e.g. a botched copy) is still caught."""
    with chunkstore.open(raw_saved.path, create=True) as store:
        first = store.open_version("r@1").entry("model.w").shards[0].chunks[0]  # type: ignore[union-attr]
    target = _object_path(raw_saved.path, "chunks", raw_saved.chunk)
    target.write_bytes(_object_path(raw_saved.path, "chunks", first.hex).read_bytes())

    store = reopen()
    _assert_chunk_error_on_every_read(store, CorruptChunkError, raw_saved.chunk)


# --- commit records -------------------------------------------------------------------------


def _write_record(store_path: Path, body: dict[str, object]) -> str:
    data = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    version_id = blake3.blake3(data).hexdigest()
    (store_path / "versions" / version_id).write_bytes(data)
    return version_id


def test_commit_record_with_a_newer_format_version(raw_saved: Saved, reopen: Reopen) -> None:
    record = json.loads((raw_saved.path / "versions" / raw_saved.version_id).read_bytes())
    record.update(format_version=2, step=2)
    newer = _write_record(raw_saved.path, record)

    store = reopen()
    with pytest.raises(FormatVersionError, match="upgrade chunkstore") as raised:
        store.read_record(newer)
    assert (raised.value.found, raised.value.supported) == (2, 1)
    with pytest.raises(FormatVersionError):
        store.open_version(newer)
    # It is never listed as loadable; the version this release wrote still is.
    assert [v.id for v in store.versions()] == [raw_saved.version_id]
    assert store.open_version("latest").get("model.w").tobytes() == WEIGHTS.tobytes()
    result = store.verify()
    assert [(p.kind, p.version) for p in result.problems] == [("format-version", newer)]


def test_commit_record_that_does_not_match_its_id(raw_saved: Saved, reopen: Reopen) -> None:
    path = raw_saved.path / "versions" / raw_saved.version_id
    path.write_bytes(path.read_bytes().replace(b'"step":1', b'"step":9'))

    store = reopen()
    with pytest.raises(CorruptRecordError, match="does not match its version id"):
        store.read_record(raw_saved.version_id)
    result = store.verify()
    assert [(p.kind, p.version) for p in result.problems] == [
        ("corrupt-record", raw_saved.version_id)]


def test_store_config_with_a_newer_format_version(raw_saved: Saved) -> None:
    path = raw_saved.path / "chunkstore.json"
    config = json.loads(path.read_bytes())
    config["format_version"] = max(STORE_FORMAT_VERSIONS) + 1
    path.write_text(json.dumps(config))
    with pytest.raises(FormatVersionError,
                       match=f"store has format version {max(STORE_FORMAT_VERSIONS) + 1}"):
        chunkstore.open(raw_saved.path, create=False)


# --- manifest nodes -------------------------------------------------------------------------


def _flip_json_byte(path: Path) -> None:
    """Change one digit in the node's JSON: still parses, no longer matches its hash."""
    data = path.read_bytes()
    at = data.index(b'"format_version":') + len(b'"format_version":')
    path.write_bytes(data[:at] + b"7" + data[at + 1:])


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_damaged_root_node(raw_saved: Saved, reopen: Reopen, damage: str) -> None:
    path = _object_path(raw_saved.path, "nodes", raw_saved.root)
    if damage == "flip":
        _flip_json_byte(path)
    elif damage == "truncate":
        path.write_bytes(path.read_bytes()[:-10])
    else:
        path.unlink()

    store = reopen()
    with pytest.raises(CorruptNodeError) as raised:
        store.open_version(raw_saved.version_id)
    assert raised.value.digest == raw_saved.root
    result = store.verify()
    assert [(p.kind, p.version) for p in result.problems] == [
        ("corrupt-node", raw_saved.version_id)]


def test_damaged_subtree_node(raw_saved: Saved, reopen: Reopen) -> None:
    root_path = _object_path(raw_saved.path, "nodes", raw_saved.root)
    root = decode_tree(Digest.parse(raw_saved.root), root_path.read_bytes())
    model = root.subtrees["model"].hex
    _flip_json_byte(_object_path(raw_saved.path, "nodes", model))

    store = reopen()
    with pytest.raises(CorruptNodeError, match="does not match its hash") as raised:
        store.open_version("r@1")
    assert raised.value.digest == model
    assert _problem_kinds(store) == {"corrupt-node"}


def test_damaged_data_node(raw_saved: Saved, reopen: Reopen) -> None:
    path = _object_path(raw_saved.path, "nodes", raw_saved.data_node)
    path.write_bytes(path.read_bytes().replace(b'"epoch":3', b'"epoch":4'))

    store = reopen()
    reader = store.open_version("r@1")
    with pytest.raises(CorruptNodeError, match="does not match its hash") as raised:
        reader.get_data("trainer")
    assert raised.value.digest == raw_saved.data_node
    assert reader.get("model.w").tobytes() == WEIGHTS.tobytes()
    result = store.verify()
    assert [(p.kind, p.digest) for p in result.problems] == [
        ("corrupt-node", raw_saved.data_node)]


def test_node_with_a_newer_format_version(raw_saved: Saved, reopen: Reopen) -> None:
    """A version whose tree a newer release wrote: a format error, not corruption."""
    node = json.loads(_object_path(raw_saved.path, "nodes", raw_saved.root).read_bytes())
    node["format_version"] = NODE_FORMAT_VERSION + 1
    data = json.dumps(node, sort_keys=True, separators=(",", ":")).encode()
    node_hex = blake3.blake3(data).hexdigest()
    node_path = _object_path(raw_saved.path, "nodes", node_hex)
    node_path.parent.mkdir(exist_ok=True)
    node_path.write_bytes(data)
    record = json.loads((raw_saved.path / "versions" / raw_saved.version_id).read_bytes())
    record.update(root=node_hex, step=2)
    newer = _write_record(raw_saved.path, record)

    store = reopen()
    with pytest.raises(FormatVersionError, match="manifest node"):
        store.open_version(newer)
    assert [v.id for v in store.versions()] == [raw_saved.version_id]
    result = store.verify()
    assert [(p.kind, p.version) for p in result.problems] == [("format-version", newer)]
