"""Capturing state trees: what every kind of node becomes, entry names, and the errors
that name a bad value's path (the walk's fast paths by exact type must not change any)."""

from __future__ import annotations

import enum
from collections import OrderedDict, defaultdict
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from chunkstore.errors import NotSerializableError  # noqa: E402
from chunkstore.format.names import MAX_NAME_LENGTH  # noqa: E402
from torch_bridge.capture.state import EntryNames, capture  # noqa: E402


class Level(enum.IntEnum):
    HIGH = 2


def _capture(key: str, tree: Any) -> Any:
    return capture(key, tree, EntryNames({"_torch_bridge"}))


def test_every_kind_of_node_becomes_plain_data_and_records() -> None:
    t = torch.arange(6.0).reshape(2, 3)
    array = np.arange(4, dtype=np.int16)
    tree = OrderedDict([
        ("w", t),
        ("nested", {1: [t, (2, t)], (1, "x"): None, 2.5: b"b", None: True, b"k": 7}),
        ("plain", [bytearray(b"ab"), np.float32(1.5), np.int64(3), np.bool_(True), "s"]),
        ("array", array),
        ("enum", Level.HIGH),
        ("defaults", defaultdict(int, {"a": 1})),
        ("param", torch.nn.Parameter(torch.ones(2))),
    ])
    captured = _capture("m", tree)
    assert captured.skeleton == {
        "w": None,
        "nested": {1: [None, (2, None)], (1, "x"): None, 2.5: b"b", None: True, b"k": 7},
        "plain": [b"ab", 1.5, 3, True, "s"],
        "array": None, "enum": 2, "defaults": {"a": 1}, "param": None}
    assert type(captured.skeleton) is dict
    assert type(captured.skeleton["nested"][1]) is list
    assert type(captured.skeleton["nested"][1][1]) is tuple
    plain = captured.skeleton["plain"]
    assert [type(v) for v in plain] == [bytes, float, int, bool, str]
    assert captured.section()["tensors"] == [
        [["w"], "m.w", "torch", "float32", [2, 3]],
        [["nested", 1, 0], "m.nested.1.0", "torch", "float32", [2, 3]],
        [["nested", 1, 1, 1], "m.nested.1.1.1", "torch", "float32", [2, 3]],
        [["array"], "m.array", "numpy", "int16", [4]],
        [["param"], "m.param", "torch", "float32", [2]],
    ]
    assert captured.values[0] is t and captured.values[3] is array
    assert captured.module_metadata is None


def test_a_tensor_or_a_list_at_the_top_is_captured() -> None:
    t = torch.zeros(3, dtype=torch.bfloat16)
    top = _capture("t", t)
    assert top.skeleton is None
    assert top.section()["tensors"] == [[[], "t", "torch", "bfloat16", [3]]]
    listed = _capture("l", [t, 1, (t,)])
    assert listed.skeleton == [None, 1, (None,)]
    assert [r.entry for r in listed.records] == ["l.0", "l.2.0"]


def test_module_metadata_is_captured_beside_the_tree() -> None:
    state = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2)).state_dict()
    captured = _capture("model", state)
    assert captured.module_metadata == {k: dict(v) for k, v in state._metadata.items()}
    assert captured.module_metadata["1"]["version"] == 2
    assert [r.entry for r in captured.records] == [f"model.{k}" for k in state]


def test_entry_names_are_made_valid_and_unique() -> None:
    long_key = "k" * MAX_NAME_LENGTH
    tree = {"a.b": torch.ones(1), "a": {"b": torch.ones(1)}, "x/y": torch.ones(1),
            "": torch.ones(1), long_key: torch.ones(1), 3: torch.ones(1)}
    names = EntryNames({"_torch_bridge"})
    first = capture("s", tree, names)
    assert [r.entry for r in first.records] == ["s.a.b", "s.a.b~2", "s.x_y", "s._", "s.t5",
                                                "s.3"]
    second = capture("s", tree, names)  # the same names taken again in one version
    assert len({r.entry for r in first.records + second.records}) == 12


@pytest.mark.parametrize(("tree", "where", "what"), [
    ({"a": {"b": object()}}, r"s\['a'\]\['b'\]", "object"),
    ({"a": [1, {2, 3}]}, r"s\['a'\]\[1\]", "set"),
    ({"a": (1, 1 + 2j)}, r"s\['a'\]\[1\]", "complex"),
    ({"a": {object(): 1}}, r"s\['a'\]<key", "object"),
    ({"a": {(1, object()): 1}}, r"s\['a'\]<key", "tuple"),
    ({"a": torch.ones(2).to_sparse()}, r"s\['a'\].*layout", "Tensor"),
    ({"a": torch.ones(2, device="meta")}, r"s\['a'\].*meta device", "Tensor"),
    ({"a": [torch.empty(2, dtype=torch.bits8)]}, r"s\['a'\]\[0\].*dtype", "Tensor"),
    ({"a": np.array([object()])}, r"s\['a'\]", "ndarray of object"),
    (OrderedDict(a=range(3)), r"s\['a'\]", "range"),
])
def test_a_bad_value_fails_naming_its_path(tree: Any, where: str, what: str) -> None:
    with pytest.raises(NotSerializableError, match=where) as raised:
        _capture("s", tree)
    assert what in str(raised.value)


def test_the_first_bad_value_in_walk_order_is_named() -> None:
    tree = {"first": torch.ones(2, device="meta"), "second": object()}
    with pytest.raises(NotSerializableError, match=r"s\['first'\]"):
        _capture("s", tree)


def test_keys_whose_names_collide_with_a_suffixed_name_each_get_their_own_entry() -> None:
    """'a.b', the path ('a', 'b') and a key 'a.b~3' (the suffix the second would get):
    each tensor gets a name of its own, and the state saves and restores exactly."""
    import tempfile

    import torch

    from torch_bridge import Checkpointer
    from torch_bridge.capture.state import EntryNames

    names = EntryNames({"_torch_bridge"})
    claimed = [names.claim("k", path) for path in [("a.b~3",), ("a.b",), ("a", "b")]]
    assert len(set(claimed)) == 3
    state = {"a.b~3": torch.tensor([0.0]), "a.b": torch.tensor([1.0]),
             "a": {"b": torch.tensor([2.0])}}
    with tempfile.TemporaryDirectory() as d, Checkpointer(d, run="r") as ckpt:
        ckpt.save(1, k=state)
        target = {"a.b~3": torch.zeros(1), "a.b": torch.zeros(1), "a": {"b": torch.zeros(1)}}
        ckpt.restore(k=target, rng=False)
    assert [target["a.b~3"].item(), target["a.b"].item(), target["a"]["b"].item()] == [0, 1, 2]
