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
from collections import OrderedDict
from typing import Any

import numpy as np

from chunkstore.errors import NotSerializableError

MAX_DEPTH = 200
#: Integers have at most this many decimal digits (Python's default limit on
#: int/str conversion, so every reader can parse what a writer wrote).
MAX_INT_DIGITS = 4300
#: Ints strictly between -_SMALL and _SMALL have far fewer than MAX_INT_DIGITS digits.
_SMALL = 1 << 64
HASHABLE_TAGS = frozenset({"$tuple", "$bytes", "$float"})


def encode(value: object) -> bytes:
    """Encode ``value`` (no spaces, ASCII only); raises NotSerializableError.

    Keys stay in the dict's order, so a dict reads back as it was built: a loop that
    walks one (data-mixture weights drawn with the RNG) resumes exactly.  Equal dicts
    built in another order encode differently; a state saved again in the same order
    encodes the same, which is all sharing between versions needs.
    """
    tree = to_tree(value)
    return json.dumps(tree, separators=(",", ":"), allow_nan=False).encode()


def decode(data: bytes) -> Any:
    """Decode bytes made by :func:`encode`; ``ValueError`` on malformed input."""
    return from_tree(load_json(data))


def to_tree(value: object) -> object:
    """The tagged-JSON tree of ``value`` (what :func:`encode` serialises).

    Tried first without tracking where each value sits (a save encodes a
    state's skeleton, thousands of nodes, every time); anything unusual, or
    wrong, is encoded again by the full walk, which gives the same tree or the
    error naming the value's path.
    """
    try:
        return _fast_tree(value, 0)
    except (_Unusual, RecursionError):
        return _to_json(value, "$", 0)


def from_tree(tree: object) -> Any:
    """Rebuild a value from a tagged-JSON tree; ``ValueError`` on a malformed one.

    Iterative, so a hostile tree cannot exhaust the Python stack; it refuses
    what :func:`encode` never writes (nesting beyond ``MAX_DEPTH``, unknown
    tags, ``$`` keys outside a tag, non-finite numbers, duplicate keys).  A
    tree nested at most ``FAST_DEPTH`` deep with nothing to refuse is decoded
    by a recursive walk first (a restore decodes a state's skeleton, thousands
    of nodes, every time); anything else by the iterative one, which gives the
    same value or the error.
    """
    try:
        return _fast_value(tree, 0)
    except _Unusual:
        return _from_tree_iteratively(tree)


def _from_tree_iteratively(tree: object) -> Any:
    first = _open(tree, 0)
    if not isinstance(first, _Frame):
        return first
    stack = [first]
    while True:
        frame = stack[-1]
        if frame.todo:
            item = _open(frame.todo.pop(), frame.depth + 1)
            if isinstance(item, _Frame):
                stack.append(item)
            else:
                frame.done.append(item)
            continue
        value = frame.close()
        stack.pop()
        if not stack:
            return value
        stack[-1].done.append(value)


#: How deep :func:`_fast_value` recurses before it leaves a tree to the iterative decoder.
FAST_DEPTH = 64


def _fast_value(node: Any, depth: int) -> Any:
    """:func:`from_tree` for trees with nothing to refuse, recursively; raises
    ``_Unusual`` for anything it does not decode exactly as the iterative walk."""
    # Most nodes of a state's skeleton are names and sizes: an ASCII str, an int of
    # 64 bits at most, taken as they are; any other str or int is checked in full.
    if (type(node) is str and node.isascii()) or (type(node) is int and -_SMALL < node < _SMALL):
        return node
    if type(node) is list:
        if depth >= FAST_DEPTH:
            raise _Unusual
        return [_fast_value(v, depth + 1) for v in node]
    if type(node) is dict:
        if depth >= FAST_DEPTH:
            raise _Unusual
        return _fast_object(node, depth)
    if type(node) is str or type(node) is int:
        return _plain_str_or_int(node)
    if node is None or type(node) is bool or (type(node) is float and math.isfinite(node)):
        return node
    raise _Unusual


def _fast_object(node: dict[Any, Any], depth: int) -> Any:
    if len(node) == 1:
        ((tag, body),) = node.items()
        if type(tag) is str and tag.startswith("$"):
            return _fast_tag(tag, body, depth)
    for key in node:
        if type(key) is not str or key.startswith("$") or not (key.isascii()
                                                               or is_unicode(key)):
            raise _Unusual
    return {k: _fast_value(v, depth + 1) for k, v in node.items()}


def _fast_tag(tag: str, body: Any, depth: int) -> Any:
    if tag == "$tuple" and type(body) is list:
        return tuple(_fast_value(v, depth + 1) for v in body)
    if tag == "$dict" and type(body) is list:
        keys, values = [], []
        for pair in body:
            if not (type(pair) is list and len(pair) == 2 and _is_key(pair[0])):
                raise _Unusual
            keys.append(_fast_value(pair[0], depth + 1))
            values.append(_fast_value(pair[1], depth + 1))
        try:
            return _pairs_to_dict(keys, values)
        except ValueError:
            raise _Unusual from None
    if tag == "$float" and type(body) is str and body in ("nan", "inf", "-inf"):
        return float(body)
    if tag == "$bytes" and type(body) is str:
        try:
            return base64.b64decode(body.encode("ascii"), validate=True)
        except ValueError:  # binascii.Error and UnicodeEncodeError are ValueErrors
            raise _Unusual from None
    raise _Unusual


def _float(value: float) -> object:
    if math.isfinite(value):
        return value
    return {"$float": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}


#: Where a value sits, for error messages only: "$", or (parent, key, style).  Built
#: as tuples while encoding and written out only when an error names it.
Path = str | tuple[Any, object, int]
_ITEM, _ATTR, _KEY, _VALUE = range(4)  # [i], .k, <key 'k'>, ['k']


def _path_text(path: Path) -> str:
    parts = []
    while isinstance(path, tuple):
        path, key, style = path
        parts.append(f"[{key}]" if style == _ITEM else f".{key}" if style == _ATTR
                     else f"<key {_repr(key)}>" if style == _KEY else f"[{_repr(key)}]")
    return path + "".join(reversed(parts))


def _repr(key: object) -> str:
    """``repr(key)``, or a description where Python refuses to print it (an int of
    more than 4,300 digits, alone or inside a tuple)."""
    try:
        return repr(key)
    except ValueError:
        return f"<a {type(key).__name__} too large to print>"


def _scalar(value: object, path: Path) -> object:
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return _float(float(value))
    raise NotSerializableError(
        _path_text(path), type(value).__name__,
        "plain data holds None, bool, int, float, str, bytes, list, tuple and dict;"
        " store arrays with put()",
    )


def _to_json(value: object, path: Path, depth: int) -> object:  # noqa: PLR0911
    if depth > MAX_DEPTH:
        raise NotSerializableError(_path_text(path), type(value).__name__,
                                   f"nested deeper than {MAX_DEPTH}")
    kind = type(value)
    if kind is str:  # the common cases first, by exact type
        return _check_str(value, path)  # type: ignore[arg-type]
    if kind is int:
        return _check_int(value, path)  # type: ignore[arg-type]
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        return _check_str(value, path)
    if isinstance(value, int):
        return _check_int(int(value), path)
    if isinstance(value, float):
        return _float(float(value))
    if isinstance(value, (bytes, bytearray)):
        return {"$bytes": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, tuple):
        return {"$tuple": [_to_json(v, (path, i, _ITEM), depth + 1)
                           for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_to_json(v, (path, i, _ITEM), depth + 1) for i, v in enumerate(value)]
    if isinstance(value, dict):
        return _dict_to_json(value, path, depth)
    return _scalar(value, path)


class _Unusual(Exception):
    """A value :func:`_fast_tree` leaves to the full walk."""


def _fast_tree(value: object, depth: int) -> object:
    """:func:`_to_json` for values of the exact built-in types, without paths; raises
    ``_Unusual`` for anything else (subclasses, numpy scalars, values to refuse)."""
    if (type(value) is str and value.isascii()) or (type(value) is int
                                                    and -_SMALL < value < _SMALL):
        return value  # as in _fast_value
    if type(value) is list:
        if depth >= MAX_DEPTH:
            raise _Unusual
        return [_fast_tree(v, depth + 1) for v in value]
    if type(value) is dict or type(value) is OrderedDict:  # state dicts are OrderedDicts
        if depth >= MAX_DEPTH:
            raise _Unusual
        return _fast_dict(value, depth)
    if type(value) is tuple:
        if depth >= MAX_DEPTH:
            raise _Unusual
        return {"$tuple": [_fast_tree(v, depth + 1) for v in value]}
    return _fast_scalar(value)


def _plain_str_or_int(value: str | int) -> str | int:
    """A str or int as it is where plain data holds it (no lone surrogate, at most
    ``MAX_INT_DIGITS`` digits); ``_Unusual`` otherwise, for the full walks to refuse."""
    if (value.isascii() or is_unicode(value)) if isinstance(value, str) else int_fits(value):
        return value
    raise _Unusual


def _fast_scalar(value: object) -> object:
    if type(value) is str or type(value) is int:
        return _plain_str_or_int(value)
    if value is None or type(value) is bool:
        return value
    if type(value) is float:
        return _float(value)
    if type(value) is bytes:
        return {"$bytes": base64.b64encode(value).decode("ascii")}
    raise _Unusual


def _fast_dict(value: dict[Any, Any], depth: int) -> object:
    if all(type(k) is str and not k.startswith("$") and (k.isascii() or is_unicode(k))
           for k in value):
        return {k: _fast_tree(v, depth + 1) for k, v in value.items()}
    pairs = []
    for k, v in value.items():
        key = _fast_tree(k, depth + 1)
        if isinstance(key, (list, dict)) and not _is_hashable_tag(key):
            raise _Unusual
        pairs.append([key, _fast_tree(v, depth + 1)])
    return {"$dict": pairs}


def _dict_to_json(value: dict[Any, Any], path: Path, depth: int) -> object:
    plain = all(type(k) is str and not k.startswith("$") for k in value)
    if plain:
        return {_check_str(k, path): _to_json(v, (path, k, _ATTR), depth + 1)
                for k, v in value.items()}
    pairs = []
    for k, v in value.items():
        key = _to_json(k, (path, k, _KEY), depth + 1)
        if isinstance(key, (list, dict)) and not _is_hashable_tag(key):
            raise NotSerializableError(f"{_path_text(path)}<key {k!r}>", type(k).__name__,
                                       "dict keys must be hashable")
        pairs.append([key, _to_json(v, (path, k, _VALUE), depth + 1)])
    return {"$dict": pairs}


def _is_hashable_tag(key: object) -> bool:
    return isinstance(key, dict) and len(key) == 1 and next(iter(key)) in HASHABLE_TAGS


def int_fits(value: int) -> bool:
    """True when ``value`` has at most ``MAX_INT_DIGITS`` decimal digits."""
    bits = abs(value).bit_length()
    if bits <= 14_000:  # 14,000 bits are fewer than 4,215 digits
        return True
    if bits > 14_300:  # more than 4,300 digits
        return False
    return bool(abs(value) < 10**MAX_INT_DIGITS)


def _check_int(value: int, path: Path) -> int:
    if not int_fits(value):
        raise NotSerializableError(_path_text(path), "int",
                                   f"more than {MAX_INT_DIGITS} decimal digits")
    return value


def _check_str(value: str, path: Path) -> str:
    if not value.isascii() and not is_unicode(value):
        raise NotSerializableError(_path_text(path), "str",
                                   "not valid Unicode (a lone surrogate)")
    return value


def is_unicode(text: str) -> bool:
    """False for a str holding a lone surrogate (it has no UTF-8 encoding)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# --- bounded JSON parsing --------------------------------------------------------------------

def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise ValueError("an object has a key twice")
    return obj


def load_json(data: bytes | memoryview) -> Any:
    """Parse JSON bytes: ``ValueError`` for invalid UTF-8 or JSON, ``NaN``/``Infinity``,
    an object with a key twice, or nesting too deep for the parser.

    The C parser guards its own recursion (a ``RecursionError`` long before the
    stack is at risk); callers bound the depth they accept on the parsed value,
    iteratively (:func:`from_tree`) or by its fixed structure (nodes, records).
    """
    try:
        return json.loads(bytes(data).decode("utf-8"), parse_constant=_refuse_constant,
                          object_pairs_hook=_unique_pairs)
    except RecursionError as exc:
        raise ValueError("nested too deeply") from exc


# --- decoding, iteratively --------------------------------------------------------------------


class _Frame:
    """A container being decoded: the JSON children left to do, the values done."""

    __slots__ = ("depth", "done", "keys", "kind", "todo")

    def __init__(self, kind: str, todo: list[Any], depth: int, keys: list[str] | None = None
                 ) -> None:
        self.kind = kind
        self.todo = todo[::-1]  # popped from the end: children in order
        self.done: list[Any] = []
        self.depth = depth
        self.keys = keys

    def close(self) -> Any:
        if self.kind == "list":
            return self.done
        if self.kind == "tuple":
            return tuple(self.done)
        if self.kind == "dict":
            assert self.keys is not None
            return dict(zip(self.keys, self.done, strict=True))
        return _pairs_to_dict(self.done[0::2], self.done[1::2])


def _pairs_to_dict(keys: list[Any], values: list[Any]) -> dict[Any, Any]:
    try:
        result = dict(zip(keys, values, strict=True))
    except TypeError as exc:  # a key that decodes to something unhashable
        raise ValueError(f"malformed $dict: {exc}") from exc
    if len(result) != len(keys):
        raise ValueError("malformed $dict: a key appears twice")
    return result


def _open(node: Any, depth: int) -> Any:
    """Decode a scalar, or return the :class:`_Frame` of a container to fill."""
    if depth > MAX_DEPTH:
        raise ValueError(f"nested deeper than {MAX_DEPTH}")
    if node is None or isinstance(node, bool):
        return node
    if isinstance(node, str):
        if not is_unicode(node):
            raise ValueError("a string holds a lone surrogate")
        return node
    if isinstance(node, int):
        if not int_fits(node):
            raise ValueError(f"an integer has more than {MAX_INT_DIGITS} digits")
        return node
    if isinstance(node, float):
        if not math.isfinite(node):
            raise ValueError("a number is out of range (non-finite)")
        return node
    if isinstance(node, list):
        return _Frame("list", node, depth)
    if isinstance(node, dict):
        return _open_dict(node, depth)
    raise ValueError(f"{type(node).__name__} is not plain data")


def _open_dict(node: dict[Any, Any], depth: int) -> Any:
    if len(node) == 1:
        ((tag, body),) = node.items()
        if isinstance(tag, str) and tag.startswith("$"):
            return _open_tag(tag, body, depth)
    for key in node:
        if not isinstance(key, str) or key.startswith("$") or not is_unicode(key):
            raise ValueError(f"object key {key!r} is not a plain key (tags have one key)")
    return _Frame("dict", list(node.values()), depth, list(node))


def _open_tag(tag: str, body: Any, depth: int) -> Any:
    if tag == "$float" and isinstance(body, str) and body in ("nan", "inf", "-inf"):
        return float(body)
    if tag == "$bytes" and isinstance(body, str):
        return base64.b64decode(body.encode("ascii"), validate=True)
    if tag == "$tuple" and isinstance(body, list):
        return _Frame("tuple", body, depth)
    if tag == "$dict" and isinstance(body, list):
        flat: list[Any] = []
        for pair in body:
            if not (isinstance(pair, list) and len(pair) == 2 and _is_key(pair[0])):
                raise ValueError("malformed $dict: a pair is not [hashable key, value]")
            flat.extend(pair)
        return _Frame("$dict", flat, depth)
    raise ValueError(f"unknown or malformed tag {tag!r}")


def _is_key(node: Any) -> bool:
    return not isinstance(node, (list, dict)) or _is_hashable_tag(node)


