"""Manifest nodes that parse but do not describe a readable tensor are refused as corrupt."""

from __future__ import annotations

import enum
import json
from collections import OrderedDict
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkstore.errors import CorruptNodeError, NotSerializableError
from chunkstore.format import plaindata
from chunkstore.format.digest import Digest
from chunkstore.format.manifest import NODE_FORMAT_VERSION, decode_data, decode_tree

CHUNK = Digest.of(b"x").hex


def _tree(tensor: dict[str, Any]) -> tuple[Digest, bytes]:
    body = {"format_version": NODE_FORMAT_VERSION, "kind": "tree",
            "entries": {"w": {"tensor": tensor}}}
    data = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return Digest.of(data), data


def _tensor(shape: list[int], chunks: int, chunk_bytes: int = 64, offsets: list[int] | None = None,
            sizes: list[int] | None = None) -> dict[str, Any]:
    return {"dtype": "float32", "shape": shape, "shards": [{
        "offsets": offsets if offsets is not None else [0] * len(shape),
        "sizes": sizes if sizes is not None else shape,
        "chunk_bytes": chunk_bytes, "chunks": [CHUNK] * chunks}]}


def test_a_well_formed_tensor_entry_decodes() -> None:
    node = decode_tree(*_tree(_tensor([40], chunks=3)))  # 160 bytes in 64-byte chunks
    assert len(node.leaves["w"].shards[0].chunks) == 3  # type: ignore[union-attr]


@pytest.mark.parametrize(("tensor", "words"), [
    (_tensor([40], chunks=2), "needs 3 chunk keys, has 2"),
    (_tensor([40], chunks=4), "needs 3 chunk keys, has 4"),
    (_tensor([40], chunks=3, chunk_bytes=0), "chunk_bytes must be an integer in"),
    (_tensor([40], chunks=3, chunk_bytes=66), "not a positive multiple"),
    (_tensor([40], chunks=1, offsets=[30], sizes=[20]), "outside shape"),
    (_tensor([4, 10], chunks=3, sizes=[40]), "rank"),
    (_tensor([-4], chunks=0), "shape must be an integer in"),
    (_tensor([True], chunks=1), "shape must be an integer in"),  # JSON true is no integer
    (_tensor([40], chunks=3, offsets=[0, 0]), "rank"),  # one shard, sizes as the shape
])
def test_a_tensor_whose_chunks_do_not_cover_it_is_corrupt(tensor: dict[str, Any],
                                                          words: str) -> None:
    with pytest.raises(CorruptNodeError, match=words):
        decode_tree(*_tree(tensor))


def test_a_dict_key_that_cannot_be_a_key_is_corrupt_data_not_a_crash() -> None:
    value = {"$dict": [[{"a": 1, "b": 2}, 1]]}
    body = {"format_version": NODE_FORMAT_VERSION, "kind": "data", "value": value}
    data = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    with pytest.raises(CorruptNodeError, match="malformed"):
        decode_data(Digest.of(data), data)
    assert plaindata.decode(plaindata.encode({(1, 2): 3})) == {(1, 2): 3}


# --- plain data: the fast encoder agrees with the full walk ----------------------------------

class _Level(enum.IntEnum):
    LOW = 1


_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=10**4300),
    st.floats(allow_nan=True, allow_infinity=True), st.text(), st.binary(max_size=8),
    st.sampled_from(["$x", "\ud800", "a\udfffb", "é"]),
    st.sampled_from([np.int64(3), np.float32(0.5), np.bool_(True), _Level.LOW,
                     bytearray(b"ab")]))
_keys = st.one_of(st.text(max_size=4), st.sampled_from(["$k", "\ud800"]), st.integers(),
                  st.tuples(st.integers()), st.none(), st.binary(max_size=2))


def _containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.lists(children, max_size=4), st.tuples(children, children),
        st.dictionaries(st.text(max_size=4), children, max_size=4),
        st.dictionaries(_keys, children, max_size=4),
        st.dictionaries(st.text(max_size=3), children, max_size=3).map(OrderedDict),
        st.lists(st.lists(children, max_size=2), max_size=2).map(tuple))


@settings(max_examples=400, deadline=None)
@given(st.recursive(_scalars, _containers, max_leaves=20))
def test_plain_data_fast_encoding_is_the_full_walks(value: Any) -> None:
    """``to_tree`` tries a walk without paths first; whatever it returns is exactly what
    the full walk returns, and what it cannot take gets the full walk's tree or error."""
    try:
        slow = plaindata._to_json(value, "$", 0)
    except NotSerializableError as exc:
        with pytest.raises(NotSerializableError) as raised:
            plaindata.to_tree(value)
        assert str(raised.value) == str(exc)
        return
    assert _same(plaindata.to_tree(value), slow)
    try:
        fast = plaindata._fast_tree(value, 0)
    except plaindata._Unusual:
        return
    assert _same(fast, slow)


def _same(a: Any, b: Any) -> bool:
    """Equal as canonical JSON (NaN is never equal to itself as a float)."""
    dump = lambda t: json.dumps(t, sort_keys=True, separators=(",", ":"), allow_nan=True)  # noqa: E731
    return dump(a) == dump(b)


def test_plain_data_nesting_at_the_limit_encodes_as_the_full_walk() -> None:
    for depth in (plaindata.MAX_DEPTH - 1, plaindata.MAX_DEPTH, plaindata.MAX_DEPTH + 1):
        value: Any = 1
        for _ in range(depth):
            value = [value]
        try:
            want = plaindata._to_json(value, "$", 0)
        except NotSerializableError:
            with pytest.raises(NotSerializableError):
                plaindata.to_tree(value)
            continue
        assert plaindata.to_tree(value) == want


_json_leaves = st.one_of(
    st.none(), st.booleans(), st.integers(), st.builds(lambda: 10**4400), st.floats(),
    st.text(max_size=4), st.sampled_from(["\ud800", "$", "é"]))


def _json_containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    keys = st.one_of(st.text(max_size=3), st.sampled_from(["$x", "$tuple", "\udc00"]))
    pair = st.one_of(st.lists(children, min_size=2, max_size=2), st.lists(children, max_size=3))
    return st.one_of(
        st.lists(children, max_size=4), st.dictionaries(keys, children, max_size=3),
        st.builds(lambda b: {"$tuple": b}, st.one_of(st.lists(children, max_size=3), children)),
        st.builds(lambda b: {"$dict": b}, st.one_of(st.lists(pair, max_size=3), children)),
        st.builds(lambda b: {"$float": b}, st.sampled_from(["nan", "inf", "-inf", "x", 1])),
        st.builds(lambda b: {"$bytes": b}, st.sampled_from(["AAE=", "!!", "\u00e9", 3])),
        st.builds(lambda b: {"$other": b}, children))


@settings(max_examples=500, deadline=None)
@given(st.recursive(_json_leaves, _json_containers, max_leaves=25))
def test_plain_data_fast_decoding_is_the_iterative_walks(tree: Any) -> None:
    """``from_tree`` tries a recursive walk first; it returns exactly what the iterative
    walk returns, and raises the same error where that one refuses the tree."""
    try:
        want = plaindata._from_tree_iteratively(tree)
    except ValueError as exc:
        with pytest.raises(ValueError) as raised:
            plaindata.from_tree(tree)
        assert str(raised.value) == str(exc)
        return
    got = plaindata.from_tree(tree)
    assert repr(got) == repr(want) and type(got) is type(want)
    try:
        fast = plaindata._fast_value(tree, 0)
    except plaindata._Unusual:
        return
    assert repr(fast) == repr(want)


def test_plain_data_nested_past_the_fast_walk_decodes_iteratively() -> None:
    for depth in (plaindata.FAST_DEPTH - 1, plaindata.FAST_DEPTH + 1, plaindata.MAX_DEPTH + 1):
        tree: Any = {"$tuple": [1]}
        for _ in range(depth):
            tree = [tree]
        try:
            want = plaindata._from_tree_iteratively(tree)
        except ValueError:
            with pytest.raises(ValueError, match="nested deeper"):
                plaindata.from_tree(tree)
            continue
        assert plaindata.from_tree(tree) == want


def test_a_key_too_large_to_print_gets_the_typed_error() -> None:
    """The error names where the bad value sits even when its key cannot be printed
    (Python refuses to print an int of more than 4,300 digits)."""
    with pytest.raises(NotSerializableError, match="too large to print"):
        plaindata.encode({(10**5000,): 1})
    with pytest.raises(NotSerializableError, match="too large to print"):
        plaindata.encode({10**5000: 1, "x": [10**5000]})
