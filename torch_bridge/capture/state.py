"""State trees (state dicts) to tensor entries plus a plain-data skeleton, and back.

A state tree is what ``state_dict()`` returns: dicts, lists and tuples whose
leaves are tensors, numpy arrays or plain values.  Capturing it yields

- one tensor entry per tensor or array, named ``<key>.<path>`` (``model.fc.weight``,
  ``optimizer.state.0.exp_avg``), and
- a *section* of plain data: the skeleton (the tree with every tensor replaced
  by None) and, per tensor, its path in the tree, entry name, kind and dtype.

Paths, not markers inside the skeleton, say where tensors go, so no user value
can be mistaken for a tensor.  Every leaf is checked at capture time: a value
the safe encoding cannot hold fails the save with the key path that holds it.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from chunkstore.errors import InvalidNameError, NotSerializableError
from chunkstore.format.names import check_entry_name
from torch_bridge.capture.tensors import STORED_NAMES, check_storable

Path = tuple[Any, ...]
PLAIN_TYPES = (type(None), bool, int, float, str, bytes)
_KEY_TYPES = (type(None), bool, int, float, str, bytes)
_HINT = ("checkpoints hold tensors, numpy arrays, None, bool, int, float, str, bytes,"
         " lists, tuples and dicts; convert the value or keep it out of state_dict()")


def path_text(key: str, path: Path) -> str:
    """``optimizer['state'][0]['exp_avg']``: where a value sits, for messages."""
    return key + "".join(f"[{part!r}]" for part in path)


@dataclass
class TensorRecord:
    """Where one tensor of a state tree lives: its path and its entry."""

    path: Path
    entry: str
    kind: str  # "torch" or "numpy"
    dtype: str  # chunkstore dtype name
    shape: tuple[int, ...]

    def to_plain(self) -> list[Any]:
        return [list(self.path), self.entry, self.kind, self.dtype, list(self.shape)]

    @classmethod
    def from_plain(cls, value: list[Any]) -> TensorRecord:
        path, entry, kind, dtype, shape = value
        return cls(tuple(path), entry, kind, dtype, tuple(shape))


@dataclass
class CapturedState:
    """One state tree, taken apart: its plain section and its tensors (live references)."""

    key: str
    skeleton: Any
    records: list[TensorRecord] = field(default_factory=list)
    values: list[torch.Tensor | np.ndarray] = field(default_factory=list)
    module_metadata: Any = None

    def section(self) -> dict[str, Any]:
        return {"skeleton": self.skeleton, "tensors": [r.to_plain() for r in self.records],
                "module_metadata": self.module_metadata}


class EntryNames:
    """Hands out unique, valid entry names for one version."""

    def __init__(self, reserved: set[str]) -> None:
        self._used = set(reserved)

    def claim(self, key: str, path: Path) -> str:
        name = _valid_name(key, path) or f"{key}.t{len(self._used)}"
        base, n = name, len(self._used)
        while name in self._used:  # a suffixed name may be taken too ("a.b~3" as a key)
            name, n = f"{base}~{n}", n + 1
        self._used.add(name)
        return name


@functools.lru_cache(maxsize=1 << 16)
def _valid_name(key: str, path: Path) -> str | None:
    """The entry name for ``path``, or None when it is not a valid name.

    Cached: a training loop saves the same paths every time, and checking a
    name costs more than copying a small tensor.
    """
    name = ".".join([key, *(_component(p) for p in path)])
    try:
        check_entry_name(name)
    except InvalidNameError:
        return None
    return name


def _component(part: object) -> str:
    text = part if isinstance(part, str) else repr(part)
    cleaned = "".join(c if c.isprintable() and c not in "/\\" else "_" for c in text)
    return ".".join(piece or "_" for piece in cleaned.split("."))


def capture(key: str, tree: Any, names: EntryNames) -> CapturedState:
    """Take a state tree apart; NotSerializableError names the first bad value's path."""
    captured = CapturedState(key, None)
    captured.module_metadata = _module_metadata(key, tree)
    captured.skeleton = _walk(tree, (), captured, names)
    return captured


def _module_metadata(key: str, tree: Any) -> Any:
    """nn.Module state dicts carry per-module versions that load_state_dict reads."""
    metadata = getattr(tree, "_metadata", None)
    if metadata is None:
        return None
    return _walk(dict(metadata), ("_metadata",), CapturedState(key, None), EntryNames(set()))


# The walk visits every node of every state at every save, inside the training
# pause: the node types state_dict() returns are recognised by exact type first
# (one identity test each), and only other values go through the isinstance
# chain of _walk_other, which defines what is accepted.
_PLAIN_EXACT = frozenset(PLAIN_TYPES)
_MAPPINGS_EXACT = (dict, OrderedDict)


def _walk(node: Any, path: Path, out: CapturedState, names: EntryNames) -> Any:
    cls = type(node)
    if cls is torch.Tensor:
        _add_tensor(node, path, out, names)
        return None
    if cls in _PLAIN_EXACT:
        return node
    if cls is dict or cls is OrderedDict:
        return _walk_mapping(node, path, out, names)
    if cls is list:
        return _walk_items(node, path, out, names)
    if cls is tuple:  # the RNG states: python's is a tuple of 625 ints
        return tuple(_walk_items(node, path, out, names))
    return _walk_other(node, path, out, names)


def _walk_items(node: list[Any] | tuple[Any, ...], path: Path, out: CapturedState,
                names: EntryNames) -> list[Any]:
    return [v if type(v) in _PLAIN_EXACT else _walk(v, (*path, i), out, names)
            for i, v in enumerate(node)]


def _walk_mapping(node: Mapping[Any, Any], path: Path, out: CapturedState, names: EntryNames
                  ) -> dict[Any, Any]:
    skeleton: dict[Any, Any] = {}
    for key, value in node.items():
        if type(key) is not str:
            _check_key(key, path, out.key)
        cls = type(value)
        if cls is torch.Tensor:  # the common leaf, handled without a call to _walk
            _add_tensor(value, (*path, key), out, names)
            skeleton[key] = None
        elif cls in _PLAIN_EXACT:
            skeleton[key] = value
        else:
            skeleton[key] = _walk(value, (*path, key), out, names)
    return skeleton


def _walk_other(node: Any, path: Path, out: CapturedState, names: EntryNames) -> Any:  # noqa: PLR0911
    if isinstance(node, torch.Tensor):
        _add_tensor(node, path, out, names)
        return None
    if isinstance(node, np.ndarray):
        _add_array(node, path, out, names)
        return None
    if isinstance(node, PLAIN_TYPES):
        return node
    if isinstance(node, bytearray):
        return bytes(node)
    if isinstance(node, (np.bool_, np.integer, np.floating)):
        return node.item()
    if isinstance(node, Mapping):
        return _walk_mapping(node, path, out, names)
    if isinstance(node, list):
        return _walk_items(node, path, out, names)
    if isinstance(node, tuple):
        return tuple(_walk_items(node, path, out, names))
    raise NotSerializableError(path_text(out.key, path), type(node).__name__, _HINT)


def _check_key(key: Any, path: Path, root: str) -> Any:
    if isinstance(key, _KEY_TYPES) or (
            isinstance(key, tuple) and all(isinstance(k, _KEY_TYPES) for k in key)):
        return key
    raise NotSerializableError(f"{path_text(root, path)}<key {key!r}>", type(key).__name__,
                               "dict keys must be str, int, float, bool, None, bytes or"
                               " tuples of those")


def _add_tensor(tensor: torch.Tensor, path: Path, out: CapturedState, names: EntryNames
                ) -> None:
    dtype = STORED_NAMES.get(tensor.dtype)
    if dtype is None or tensor.layout != torch.strided or tensor.is_meta:
        problem = check_storable(tensor)
        assert problem is not None  # check_storable refuses what the test above refuses
        raise NotSerializableError(path_text(out.key, path), type(tensor).__name__, problem)
    # tensor.shape is a torch.Size, a tuple: kept as it is, not copied into another one
    out.records.append(TensorRecord(path, names.claim(out.key, path), "torch", dtype,
                                    tensor.shape))
    out.values.append(tensor)


def _add_array(array: np.ndarray, path: Path, out: CapturedState, names: EntryNames) -> None:
    from chunkstore.format.dtypes import dtype_name

    try:
        name = dtype_name(array.dtype)
    except Exception as exc:  # UnsupportedDtypeError, or numpy's own for object arrays
        raise NotSerializableError(path_text(out.key, path), f"ndarray of {array.dtype}",
                                   str(exc)) from None
    out.records.append(TensorRecord(path, names.claim(out.key, path), "numpy", name,
                                    tuple(array.shape)))
    out.values.append(array)


# --- restoring ------------------------------------------------------------------------------

_MISSING = object()


def lookup(tree: Any, path: Path) -> Any:
    """The value at ``path`` in a live state tree, or a sentinel when there is none."""
    node = tree
    for part in path:
        try:
            node = node[part]
        except (KeyError, IndexError, TypeError):
            return _MISSING
    return node


def is_missing(value: Any) -> bool:
    return value is _MISSING


def rebuild(skeleton: Any, loaded: dict[Path, Any], module_metadata: Any = None) -> Any:
    """The state tree again: the skeleton with every recorded path filled from ``loaded``."""
    tree = _rebuild(skeleton, (), loaded)
    if module_metadata is not None and isinstance(tree, dict):
        tree = OrderedDict(tree)
        tree._metadata = module_metadata  # type: ignore[attr-defined]
    return tree


def _rebuild(node: Any, path: Path, loaded: dict[Path, Any]) -> Any:
    if path in loaded:
        return loaded[path]
    if isinstance(node, dict):
        return {k: _rebuild(v, (*path, k), loaded) for k, v in node.items()}
    if isinstance(node, list):
        return [_rebuild(v, (*path, i), loaded) for i, v in enumerate(node)]
    if isinstance(node, tuple):
        return tuple(_rebuild(v, (*path, i), loaded) for i, v in enumerate(node))
    return node
