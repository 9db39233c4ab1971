"""Safe encoding of plain (non-tensor) state: tagged JSON, never pickle.

Loading runs no code: the decoder builds only None, bool, int, float, str,
bytes, list, tuple and dict.  Values JSON cannot express directly are tagged
with a one-key object whose key starts with ``$``:

- ``{"$float": "nan" | "inf" | "-inf"}``
- ``{"$tuple": [...]}``, ``{"$bytes": "<base64>"}``
- ``{"$dict": [[key, value], ...]}`` for dicts whose keys are not all strings
  or that use a key starting with ``$`` (torch optimizer state is keyed by int)
"""

from __future__ import annotations

import base64
import json
import math
from typing import Any

import numpy as np

from chunkstore.errors import NotSerializableError

MAX_DEPTH = 200


def encode(value: object) -> bytes:
    """Encode ``value`` canonically (sorted keys, no spaces); raises NotSerializableError."""
    tree = _to_json(value, "$", 0)
    return json.dumps(tree, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def decode(data: bytes) -> Any:
    """Decode bytes made by :func:`encode`; ``ValueError`` on malformed input."""
    return _from_json(json.loads(data))


def to_tree(value: object) -> object:
    """The tagged-JSON tree of ``value`` (what :func:`encode` serialises)."""
    return _to_json(value, "$", 0)


def from_tree(tree: object) -> Any:
    """Rebuild a value from a tagged-JSON tree; ``ValueError`` on a malformed one."""
    return _from_json(tree)


def _float(value: float) -> object:
    if math.isfinite(value):
        return value
    return {"$float": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}


def _scalar(value: object, path: str) -> object:
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return _float(float(value))
    raise NotSerializableError(
        path, type(value).__name__,
        "plain data holds None, bool, int, float, str, bytes, list, tuple and dict;"
        " store arrays with put()",
    )


def _to_json(value: object, path: str, depth: int) -> object:  # noqa: PLR0911
    if depth > MAX_DEPTH:
        raise NotSerializableError(path, type(value).__name__, f"nested deeper than {MAX_DEPTH}")
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return _float(float(value))
    if isinstance(value, (bytes, bytearray)):
        return {"$bytes": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, tuple):
        return {"$tuple": [_to_json(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_to_json(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value)]
    if isinstance(value, dict):
        return _dict_to_json(value, path, depth)
    return _scalar(value, path)


def _dict_to_json(value: dict[Any, Any], path: str, depth: int) -> object:
    plain = all(isinstance(k, str) and not k.startswith("$") for k in value)
    if plain:
        return {k: _to_json(v, f"{path}.{k}", depth + 1) for k, v in value.items()}
    pairs = []
    for k, v in value.items():
        key = _to_json(k, f"{path}<key {k!r}>", depth + 1)
        if isinstance(key, (list, dict)) and not _is_hashable_tag(key):
            raise NotSerializableError(f"{path}<key {k!r}>", type(k).__name__,
                                       "dict keys must be hashable")
        pairs.append([key, _to_json(v, f"{path}[{k!r}]", depth + 1)])
    return {"$dict": pairs}


def _is_hashable_tag(key: object) -> bool:
    hashable_tags = {"$tuple", "$bytes", "$float"}
    return isinstance(key, dict) and len(key) == 1 and next(iter(key)) in hashable_tags


def _from_json(node: Any) -> Any:
    if isinstance(node, list):
        return [_from_json(v) for v in node]
    if not isinstance(node, dict):
        return node
    if len(node) == 1:
        (tag, body), = node.items()
        if tag.startswith("$"):
            return _untag(tag, body)
    return {k: _from_json(v) for k, v in node.items()}


def _untag(tag: str, body: Any) -> Any:
    if tag == "$float" and body in ("nan", "inf", "-inf"):
        return float(body)
    if tag == "$tuple" and isinstance(body, list):
        return tuple(_from_json(v) for v in body)
    if tag == "$bytes" and isinstance(body, str):
        return base64.b64decode(body.encode("ascii"), validate=True)
    if tag == "$dict" and isinstance(body, list):
        try:
            return {_freeze(_from_json(k)): _from_json(v) for k, v in body}
        except TypeError as exc:  # an unhashable key, or a pair that is not a pair
            raise ValueError(f"malformed $dict: {exc}") from exc
    raise ValueError(f"unknown or malformed tag {tag!r}")


def _freeze(key: Any) -> Any:
    if isinstance(key, list):
        return tuple(_freeze(k) for k in key)
    return key
