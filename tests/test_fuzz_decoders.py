"""Fuzzing every decoder with valid objects mutated (bit flips, truncation, splices,
huge numbers, deep nesting).

For every input a decoder either raises a ``chunkstore.errors`` type or
returns a value that round-trips through the encoder; no input makes it
allocate more than a bound proportional to the input.  ``tools/fuzz_decoders.py``
runs the same targets for as long as asked.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chunkstore import codecs
from chunkstore.errors import ChunkStoreError
from chunkstore.format import plaindata
from chunkstore.format.chunkobj import HEADER, ChunkHeader, decode_object, encode_object
from chunkstore.format.digest import Digest
from chunkstore.format.manifest import (
    DataEntry,
    Shard,
    TensorEntry,
    TreeNode,
    decode_data,
    decode_tree,
    encode_data,
    encode_tree,
)
from chunkstore.format.records import STORE_FORMAT_VERSION, CommitRecord, StoreConfig, Tag


class FuzzFailure(AssertionError):
    """A decoder broke its contract on an input (kept for the report)."""


@dataclass(frozen=True)
class Target:
    name: str
    seeds: tuple[bytes, ...]
    run: Callable[[bytes, bytes], None]  # (seed, mutated): decode, check the round trip
    json: bool  # seeds are JSON text (JSON-aware mutations apply)


# --- seeds ------------------------------------------------------------------------------------

_VALUES: list[object] = [
    {"epoch": 3, "lr": 0.001, "name": "héllo ✓", "flags": [True, False, None]},
    {1: "a", (2, "b"): b"\x00\xff", "nan": float("nan"), "$x": {"$y": [(), {}]}},
    [[[[1, 2.5e-300, -(10**40)]]], (float("inf"), -0.0)],
    "plain", 0, {},
]


def _chunk_seeds() -> tuple[bytes, ...]:
    rng = np.random.default_rng(7)
    raws = [
        (rng.standard_normal(512).astype("<f4").tobytes(), 4),
        (np.arange(300, dtype="<i2").tobytes(), 2),
        (rng.standard_normal(64).astype("<f8").tobytes(), 8),
        (bytes(2048), 1),
    ]
    seeds = []
    for raw, size in raws:
        for codec in (codecs.RAW, codecs.ZSTD, codecs.SHUFFLE_ZSTD):
            if codec is codecs.SHUFFLE_ZSTD and size < 2:
                continue
            payload = codec.encode(memoryview(raw), size)
            header = ChunkHeader(codec.id, size, len(raw), len(payload))
            seeds.append(encode_object(header, payload))
    return tuple(seeds)


def _delta_seeds() -> tuple[tuple[bytes, bytes, Digest], ...]:
    """(delta chunk object, its base's raw bytes, its key): sub-delta for element sizes
    1, 2, 4 and 8, xor-delta for 4 and 16, a few elements changed against the base."""
    rng = np.random.default_rng(11)
    seeds = []
    for size, codec in ((1, codecs.SUB_DELTA), (2, codecs.SUB_DELTA), (4, codecs.SUB_DELTA),
                        (8, codecs.SUB_DELTA), (4, codecs.XOR_DELTA), (16, codecs.XOR_DELTA)):
        base = rng.standard_normal(128 * size // 4).astype("<f4").tobytes()
        raw = bytearray(base)
        for i in rng.integers(0, len(raw), 6):
            raw[i] ^= 0x10
        payload = codec.encode(codec.image_of(memoryview(bytes(raw)), base, size), size)
        header = ChunkHeader(codec.id, size, len(raw), len(payload), Digest.of(base))
        seeds.append((encode_object(header, payload), base, Digest.of(bytes(raw))))
    return tuple(seeds)


def _tree_seeds() -> tuple[bytes, ...]:
    chunk = Digest.of(b"chunk")
    tensor = TensorEntry("float32", (3, 40), (Shard((0, 0), (3, 40), 256, (chunk,) * 2),))
    scalar = TensorEntry("bfloat16", (), (Shard((), (), 2, (chunk,)),))
    empty = TensorEntry("int8", (0, 5), (Shard((0, 0), (0, 5), 4096, ()),))
    node = TreeNode(subtrees={"layers": Digest.of(b"t"), "w": Digest.of(b"u")},
                    leaves={"w": tensor, "s": scalar, "e": empty,
                            "trainer": DataEntry(Digest.of(b"d"), 11)})
    return (encode_tree(node)[1], encode_tree(TreeNode())[1])


def _record_seed() -> bytes:
    record = CommitRecord(run="exp-1", step=100, parent=Digest.of(b"p").hex, created=1.7e9,
                          root=Digest.of(b"r"), meta={"code_rev": "abc", "ds": ("toy", 2),
                                                      "ids": {3: [1.5, None]}},
                          logical_bytes=36126, new_bytes=100, new_stored_bytes=50)
    return record.encode()[1]


# --- decoders and their round trips ----------------------------------------------------------


def _config(_seed: bytes, data: bytes) -> None:
    config = StoreConfig.decode("fuzz://store", data)
    # encode() writes the current store version (an older config is upgraded).
    assert StoreConfig.decode("fuzz://store", config.encode()) == dataclasses.replace(
        config, format_version=STORE_FORMAT_VERSION)


def _tag(_seed: bytes, data: bytes) -> None:
    tag = Tag.decode("best", data)
    assert Tag.decode("best", tag.encode()) == tag


def _record(_seed: bytes, data: bytes) -> None:
    record = CommitRecord.decode(Digest.of(data).hex, data)
    version_id, again = record.encode()
    assert CommitRecord.decode(version_id, again).encode() == (version_id, again)


def _tree(_seed: bytes, data: bytes) -> None:
    node = decode_tree(Digest.of(data), data)
    digest, again = encode_tree(node)
    assert decode_tree(digest, again) == node


def _data(_seed: bytes, data: bytes) -> None:
    value = decode_data(Digest.of(data), data)
    digest, again, _ = encode_data(value)
    assert encode_data(decode_data(digest, again))[1] == again


def _plain(_seed: bytes, data: bytes) -> None:
    try:
        value = plaindata.decode(data)
    except ValueError:
        return  # plaindata's own contract: ValueError on malformed input
    again = plaindata.encode(value)
    assert plaindata.encode(plaindata.decode(again)) == again


def _raw_of(seed: bytes) -> bytes:
    codec = codecs.by_id(seed[5])
    assert codec is not None
    raw_length = int.from_bytes(seed[8:16], "little")
    return bytes(codec.decode(memoryview(seed)[HEADER.size:], raw_length, seed[6]))


_CHUNK_SEEDS = _chunk_seeds()
_CHUNK_KEYS = {seed: Digest.of(_raw_of(seed)) for seed in _CHUNK_SEEDS}


def _chunk(seed: bytes, data: bytes) -> None:
    """Checked against the key of the seed's content: a mutation that still decodes
    must give exactly that content."""
    digest = _CHUNK_KEYS[seed]
    raw = bytes(decode_object(digest, data))
    assert Digest.of(raw) == digest
    out = bytearray(len(raw))
    decode_object(digest, data, memoryview(out))
    assert out == raw


_DELTA_SEEDS = {seed: (base, key) for seed, base, key in _delta_seeds()}


def _delta(seed: bytes, data: bytes) -> None:
    """A mutated delta object decoded against its seed's base: a typed error, or exactly
    the content the seed's key names."""
    base, digest = _DELTA_SEEDS[seed]
    raw = bytes(decode_object(digest, data, None, base))
    assert Digest.of(raw) == digest
    out = bytearray(len(raw))
    decode_object(digest, data, memoryview(out), base)
    assert out == raw


def _codec(seed: bytes, data: bytes) -> None:
    """Each codec's decode on the payload alone, with the header's lengths as they
    are after the mutation: ``ValueError`` is the codec's contract."""
    if len(data) < HEADER.size or codecs.by_id(data[5]) is None:
        return
    codec = codecs.by_id(data[5])
    assert codec is not None
    raw_length = min(int.from_bytes(data[8:16], "little"), 1 << 22)
    try:
        raw = codec.decode(memoryview(data)[HEADER.size:], raw_length, data[6])
    except ValueError:
        return
    assert len(raw) == raw_length


TARGETS: tuple[Target, ...] = (
    Target("config", (StoreConfig(4096, "auto", 1795957998.3202538).encode(),), _config, True),
    Target("tag", (Tag("best", Digest.of(b"v").hex, 1795957998.38).encode(),), _tag, True),
    Target("record", (_record_seed(),), _record, True),
    Target("tree", _tree_seeds(), _tree, True),
    Target("data", tuple(encode_data(v)[1] for v in _VALUES), _data, True),
    Target("plain", tuple(plaindata.encode(v) for v in _VALUES), _plain, True),
    Target("chunk", _CHUNK_SEEDS, _chunk, False),
    Target("codec", _CHUNK_SEEDS, _codec, False),
    Target("delta", tuple(_DELTA_SEEDS), _delta, False),
    Target("delta-codec", tuple(_DELTA_SEEDS), _codec, False),
)


# --- mutations ------------------------------------------------------------------------------

_HOSTILE_JSON = [b"9" * 5000, b"1e999", b"-1", b"18446744073709551616", b"true", b"1.0", b"null",
                 b'"\\ud800"', b'"a/../b"', b'""', b'"\\u0000"', b"[]", b"{}", b"NaN",
                 b'{"$tuple":1}', b'{"$dict":[[[],1]]}', b"2e308", b"-0", b'"latest"',
                 b"4611686018427387905", b'[' * 700 + b']' * 700]
_VALUE_START = re.compile(rb'[0-9\-tfn"\[{]')
_VALUE_END = re.compile(rb"[,\]}]")
_HOSTILE_U64 = [0, 1, 2**31, 2**32 - 1, 2**40, 2**63, 2**64 - 1]


def _flip(data: bytes, rnd: random.Random) -> bytes:
    out = bytearray(data)
    for _ in range(rnd.randint(1, 4)):
        if out:
            out[rnd.randrange(len(out))] ^= 1 << rnd.randrange(8)
    return bytes(out)


def _truncate(data: bytes, rnd: random.Random) -> bytes:
    return data[: rnd.randrange(len(data) + 1)]


def _splice(data: bytes, rnd: random.Random, other: bytes) -> bytes:
    a, b = sorted(rnd.randrange(len(data) + 1) for _ in range(2))
    c, d = sorted(rnd.randrange(len(other) + 1) for _ in range(2))
    return data[:a] + other[c:d] + data[b:]


def _huge_field(data: bytes, rnd: random.Random) -> bytes:
    """Overwrite a header field (binary) or a JSON number with something extreme."""
    if data[:4] == b"CSCK" and len(data) >= HEADER.size:
        offset = rnd.choice([8, 16])
        value = rnd.choice(_HOSTILE_U64)
        return data[:offset] + value.to_bytes(8, "little") + data[offset + 8:]
    found = _VALUE_START.search(data, rnd.randrange(len(data) + 1)) or _VALUE_START.search(data)
    if found is None:
        return data
    i = found.start()
    end = _VALUE_END.search(data, i + 1)
    j = end.start() if end else len(data)
    return data[:i] + rnd.choice(_HOSTILE_JSON) + data[j:]


def _deep(data: bytes, rnd: random.Random) -> bytes:
    """Wrap part of the text in deep nesting (of tags, lists or objects)."""
    depth = rnd.choice([2, 199, 200, 201, 300, 610, 990, 5000, 100_000])
    opener, closer = rnd.choice([(b"[", b"]"), (b'{"$tuple":[', b"]}"), (b'{"a":', b"}")])
    i = rnd.randrange(len(data) + 1)
    j = rnd.randrange(i, len(data) + 1)
    return data[:i] + opener * depth + data[i:j] + closer * depth + data[j:]


def _json_edit(data: bytes, rnd: random.Random) -> bytes:
    """Replace one value inside parsed JSON and re-serialise (reaches semantic checks)."""
    try:
        tree = json.loads(data)
    except (ValueError, RecursionError):
        return data
    containers = [tree] if isinstance(tree, (dict, list)) else []
    found: list[tuple[object, object]] = []
    while containers and len(found) < 200:
        node = containers.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node)  # type: ignore[union-attr]
        for key, child in items:
            found.append((node, key))
            if isinstance(child, (dict, list)):
                containers.append(child)
    if not found:
        return data
    node, key = rnd.choice(found)
    node[key] = json.loads(rnd.choice(_HOSTILE_JSON[1:-1]).replace(b"NaN", b"null"))  # type: ignore[index]
    return json.dumps(tree, sort_keys=True, separators=(",", ":")).encode()


def mutate(target: Target, rnd: random.Random) -> tuple[bytes, bytes]:
    """(seed, mutated input): one to three mutations of one of the target's seeds."""
    seed = rnd.choice(target.seeds)
    data = seed
    for _ in range(rnd.randint(1, 3)):
        choices = [_flip, _truncate, _huge_field, _splice]
        if target.json:
            choices += [_deep, _json_edit]
        how = rnd.choice(choices)
        other = rnd.choice(target.seeds)
        data = _splice(data, rnd, other) if how is _splice else how(data, rnd)  # type: ignore[operator]
    return seed, data


def check(target: Target, seed: bytes, data: bytes) -> None:
    """Run one input; raise :class:`FuzzFailure` if the decoder broke its contract."""
    bound = (1 << 20) + 64 * len(data) + (32 * (1 << 20) if not target.json else 0)
    tracemalloc.start()
    try:
        target.run(seed, data)
    except ChunkStoreError:
        pass
    except Exception as exc:
        raise FuzzFailure(f"{target.name}: {type(exc).__name__}: {exc} on {data[:200]!r}"
                          ) from exc
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    if peak > bound:
        raise FuzzFailure(f"{target.name}: allocated {peak} bytes for a {len(data)}-byte input")


# --- the CI run: a few thousand inputs in all -------------------------------------------------

_BY_NAME = {t.name: t for t in TARGETS}


@settings(max_examples=2400, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(_BY_NAME)), rnd=st.randoms(use_true_random=False))
def test_decoders_raise_only_typed_errors_and_round_trip(name: str, rnd: random.Random) -> None:
    target = _BY_NAME[name]
    check(target, *mutate(target, rnd))


def test_every_seed_decodes() -> None:
    """The mutations start from valid objects (else the fuzzing proves little)."""
    for target in TARGETS:
        for seed in target.seeds:
            target.run(seed, seed)
