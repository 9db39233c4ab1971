"""The architecture as rules a test keeps (docs/architecture.md): every module sits in a
layer of the import contract, only the object layer calls a backend, and a transform
of stored bytes placed in the object layer reaches every object a store writes."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tomllib

import chunkstore
from chunkstore.backends import Backend
from chunkstore.format.chunkobj import MAGIC as CHUNK_MAGIC
from chunkstore.format.digest import Digest
from chunkstore.objects.kinds import (
    ALL_KINDS,
    CONFIG_KEY,
    DigestKind,
    IdT,
    Kind,
    MarkerKind,
)
from chunkstore.objects.objectstore import ObjectStore

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("chunkstore", "torch_bridge")
#: Where a Backend may be called: the backends themselves and the object layer.
BACKEND_CALLERS = ("chunkstore/backends/", "chunkstore/objects/")
BACKEND_METHODS = frozenset(name for name in dir(Backend) if not name.startswith("_")) - {"url"}


def _modules(package: str) -> Iterator[tuple[str, Path]]:
    for path in sorted((REPO / package).rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        yield ".".join(parts), path


def _layers(container: str) -> set[str]:
    """Every name the layers contract of ``container`` places (``a : b`` and ``a | b``
    are siblings)."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    for contract in config["tool"]["importlinter"]["contracts"]:
        if contract.get("type") == "layers" and contract.get("containers") == [container]:
            assert not contract.get("ignore_imports"), "no hand-written waivers"
            return {name.strip() for layer in contract["layers"]
                    for name in layer.replace("|", ":").split(":")}
    raise AssertionError(f"no layers contract for {container}")


@pytest.mark.parametrize("package", PACKAGES)
def test_every_module_sits_in_a_layer(package: str) -> None:
    layers = _layers(package)
    outside = sorted(name for name, _ in _modules(package)
                     if name != package and name.split(".")[1] not in layers)
    assert outside == [], f"modules in no layer of the import contract: {outside}"


def _backend_calls(path: Path, root: Path = REPO) -> Iterator[str]:
    """Calls of a Backend method on something named like a backend."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in BACKEND_METHODS):
            continue
        receiver = node.func.value
        name = receiver.attr if isinstance(receiver, ast.Attribute) else \
            receiver.id if isinstance(receiver, ast.Name) else ""
        if "backend" in name.lower():
            yield f"{path.relative_to(root)}:{node.lineno}: {name}.{node.func.attr}()"


def test_only_the_object_layer_calls_a_backend() -> None:
    calls = [call for package in PACKAGES for _, path in _modules(package)
             if not str(path.relative_to(REPO)).startswith(BACKEND_CALLERS)
             for call in _backend_calls(path)]
    assert calls == [], "a backend called outside chunkstore/objects:\n" + "\n".join(calls)


def test_the_backend_check_sees_a_call(tmp_path: Path) -> None:
    """The rule above can fail: a module calling a backend is found."""
    module = tmp_path / "m.py"
    module.write_text("def f(store):\n    return store.backend.get('chunks/x')\n")
    assert list(_backend_calls(module, tmp_path)) == ["m.py:2: backend.get()"]


def test_every_kind_has_a_key_space_of_its_own() -> None:
    """No kind's keys can be taken for another's (or for the config), and a listed key
    gives back the id it was made from."""
    prefixes = [kind.prefix for kind in ALL_KINDS]
    assert len(set(prefixes)) == len(prefixes)
    assert not [(a, b) for a in prefixes for b in prefixes if a != b and a.startswith(b)]
    assert not any(CONFIG_KEY.startswith(prefix) for prefix in prefixes)
    digest = Digest.of(b"an object")
    for kind in ALL_KINDS:
        object_id = digest if isinstance(kind, DigestKind) else digest.hex
        if isinstance(kind, MarkerKind):  # <20-digit ns time>-<version id>
            object_id = f"{1764950000123456789:020d}-{digest.hex}"
        assert kind.id_of(kind.key(object_id)) == object_id  # type: ignore[arg-type]


# --- a transform of every object's bytes is a change to the object layer alone ----------

MASK = 0xA5


def _masked(data: bytes | memoryview) -> bytes:
    return (np.frombuffer(data, dtype=np.uint8) ^ MASK).tobytes()


class MaskingObjects(ObjectStore):
    """Every object stored with each byte XORed (a stand-in for encryption)."""

    def _stored(self, kind: Kind[IdT], key: str, data: bytes | memoryview) -> bytes | memoryview:
        return _masked(data)

    def _loaded(self, kind: Kind[IdT], key: str, data: bytes) -> bytes:
        return _masked(data)

    def _loaded_range(self, kind: Kind[IdT], key: str, start: int, data: bytes) -> bytes:
        return _masked(data)

    def _loaded_into(self, kind: Kind[IdT], key: str, start: int, buffer: memoryview) -> None:
        view = np.frombuffer(buffer, dtype=np.uint8)
        view ^= MASK


def _stored_plainly(path: Path) -> tuple[set[str], list[Path]]:
    """The kinds of object stored under ``path``, and the objects that hold a plain
    encoding (JSON, or a chunk object's magic), the config aside."""
    stored = [p for p in path.rglob("*") if p.is_file() and "index" not in p.parts
              and p.name != "chunkstore.json"]
    plain = [p for p in stored if p.read_bytes().startswith((b"{", CHUNK_MAGIC))
             or b"format_version" in p.read_bytes()]
    return {p.relative_to(path).parts[0] for p in stored}, plain


def test_a_transform_in_the_object_layer_reaches_every_object(tmp_path: Path) -> None:
    """Saves (packed and standalone chunks, deltas, nodes, commit records, tags,
    sessions), reads, verify, removal and GC (journal, tombstones) all go through the
    object layer: with every byte masked there, the store works end to end, and no
    object on disk but the config holds its plain encoding."""
    path = tmp_path / "s"
    rng = np.random.default_rng(0)
    big = rng.standard_normal(600_000).astype(np.float32)  # several chunks, deltas later
    small = {f"layer{i}.bias": rng.standard_normal(64).astype(np.float32) for i in range(20)}
    with chunkstore.open(path, chunk_size=1 << 20, pack_size=64 * 1024, create=True) as store:
        store.objects = MaskingObjects(store.backend)
        for step in range(1, 5):
            big[:: 97 * step] += 1.0
            with store.new_version(run="r", step=step) as version:
                version.put("w", big)
                for name, array in small.items():
                    version.put(name, array + step)
                version.put_data("trainer", {"step": step})
        store.tag("r@4", "best")
        store.delete("r@1")
        kinds, plain = _stored_plainly(path)
        assert {"chunks", "nodes", "versions", "tags", "removed"} <= kinds
        assert plain == []
        assert store.gc(grace=0).chunks_deleted > 0
        assert store.verify().ok
        reader = store.open_version("best")
        np.testing.assert_array_equal(reader.get("w"), big)
        np.testing.assert_array_equal(reader.get("layer3.bias"), small["layer3.bias"] + 4)
        assert reader.get_data("trainer") == {"step": 4}
    kinds, plain = _stored_plainly(path)
    assert "gc" in kinds
    assert plain == [], f"objects stored past the object layer: {plain}"
    # The same store through the plain object layer reads nothing it can trust.
    with chunkstore.open(path, index_dir=str(tmp_path / "other-index"), create=True) as store:
        assert store.versions() == []
