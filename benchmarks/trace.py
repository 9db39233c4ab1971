"""A recorded training run: the exact states a workload saved, replayable by every system.

Training once and replaying the recorded states lets every system save the
same bytes, each in a fresh process whose peak memory is its own.  A trace
directory holds ``trace.json`` (the versions in order) and, per version, a
skeleton (the state tree with tensors replaced by ``{"$tensor": i}``) and one
binary file with the tensors' raw bytes in skeleton order.

Replay reads each version straight into the tensors of the previous one, as
a training loop updates its parameters in place: memory stays at one state.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
import torch

TRACE_FILE = "trace.json"


def _encode(tree: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(tree, torch.Tensor):
        tensors.append(tree)
        return {"$tensor": len(tensors) - 1}
    if isinstance(tree, dict):
        return {"$dict": [[key, _encode(value, tensors)] for key, value in tree.items()]}
    if isinstance(tree, tuple):
        return {"$tuple": [_encode(value, tensors) for value in tree]}
    if isinstance(tree, list):
        return [_encode(value, tensors) for value in tree]
    if tree is None or isinstance(tree, bool | int | float | str):
        return tree
    raise TypeError(f"a trace cannot hold {type(tree).__name__} values")


def _decode(node: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(node, list):
        return [_decode(value, tensors) for value in node]
    if not isinstance(node, dict):
        return node
    if "$tensor" in node:
        return tensors[node["$tensor"]]
    if "$tuple" in node:
        return tuple(_decode(value, tensors) for value in node["$tuple"])
    return {key: _decode(value, tensors) for key, value in node["$dict"]}


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous tensor (any dtype, bf16 included), without a copy."""
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())


def flatten(tree: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a state tree by its dotted path (``optimizer.state.0.exp_avg``)."""
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    items: Any = (tree.items() if isinstance(tree, dict)
                  else enumerate(tree) if isinstance(tree, list | tuple) else ())
    out: dict[str, torch.Tensor] = {}
    for key, value in items:
        out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


@dataclass(frozen=True)
class TraceVersion:
    index: int
    run: str
    step: int
    logical_bytes: int
    new_tensor_bytes: int  # bytes of tensors whose content no earlier version held


class TraceWriter:
    """Records the versions of one workload into a directory."""

    def __init__(self, root: Path, workload: str) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.workload = workload
        self.versions: list[TraceVersion] = []
        self._seen: set[bytes] = set()

    def add(self, run: str, step: int, state: dict[str, Any]) -> TraceVersion:
        tensors: list[torch.Tensor] = []
        skeleton = _encode(state, tensors)
        index = len(self.versions)
        logical = new = 0
        with open(self.root / f"{index:04d}.bin", "wb") as out:
            for tensor in tensors:
                data = tensor_bytes(tensor.contiguous())
                out.write(data)
                digest = blake3.blake3(data).digest()
                logical += data.nbytes
                if digest not in self._seen:
                    self._seen.add(digest)
                    new += data.nbytes
        specs = [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in tensors]
        (self.root / f"{index:04d}.json").write_text(
            json.dumps({"skeleton": skeleton, "tensors": specs}))
        version = TraceVersion(index, run, step, logical, new)
        self.versions.append(version)
        return version

    def finish(self, meta: dict[str, Any]) -> None:
        doc = {"workload": self.workload, "meta": meta,
               "versions": [v.__dict__ for v in self.versions]}
        (self.root / TRACE_FILE).write_text(json.dumps(doc, indent=1))


class TraceReader:
    """Replays a trace; every ``load`` reuses the tensors of the previous one."""

    def __init__(self, root: Path) -> None:
        self.root = root
        doc = json.loads((root / TRACE_FILE).read_text())
        self.workload: str = doc["workload"]
        self.meta: dict[str, Any] = doc["meta"]
        self.versions = [TraceVersion(**v) for v in doc["versions"]]
        self._pool: list[torch.Tensor] = []

    def load(self, index: int) -> dict[str, Any]:
        doc = json.loads((self.root / f"{index:04d}.json").read_text())
        tensors = []
        with open(self.root / f"{index:04d}.bin", "rb") as data:
            for i, (dtype_name, shape) in enumerate(doc["tensors"]):
                dtype = getattr(torch, dtype_name)
                if i < len(self._pool) and self._pool[i].dtype == dtype \
                        and list(self._pool[i].shape) == shape:
                    tensor = self._pool[i]
                else:
                    tensor = torch.empty(shape, dtype=dtype)
                data.readinto(tensor_bytes(tensor))
                tensors.append(tensor)
        self._pool = tensors
        state: dict[str, Any] = _decode(doc["skeleton"], tensors)
        return state

    def __iter__(self) -> Iterator[tuple[TraceVersion, dict[str, Any]]]:
        for version in self.versions:
            yield version, self.load(version.index)


def empty_like_tree(tree: Any) -> Any:
    """The same tree with fresh, uninitialised tensors: a target to restore into."""
    if isinstance(tree, torch.Tensor):
        return torch.empty_like(tree)
    if isinstance(tree, dict):
        return {key: empty_like_tree(value) for key, value in tree.items()}
    if isinstance(tree, tuple | list):
        return type(tree)(empty_like_tree(value) for value in tree)
    return tree
