"""Tree nodes with inlined subtrees (node format 4): a save writes a few manifest
nodes, not one per branch of the names, and every reader sees the same entries."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import chunkstore
from chunkstore.errors import CorruptNodeError, DuplicateStepError, InvalidSettingError
from chunkstore.format.digest import PLAIN_IDS, Digest
from chunkstore.format.manifest import (
    NODE_FORMAT_VERSION,
    PackLocation,
    Shard,
    TensorEntry,
    canonical_json,
    decode_tree,
    tensor_text,
)
from chunkstore.handle.handle import MAX_NODE_TARGET
from chunkstore.handle.tree import NodeCache, flatten, load_tree
from chunkstore.index.lmdbindex import CHUNK as CHUNK_KIND
from chunkstore.index.lmdbindex import NODE
from chunkstore.maintenance.mark import MarkSet, mark_tree
from chunkstore.objects.kinds import NODES
from chunkstore.protocol.moved import list_moved

CHUNK = Digest.of(b"x").hex
TENSOR = {"dtype": "uint8", "shape": [1], "shards": [
    {"offsets": [0], "sizes": [1], "chunk_bytes": 1, "chunks": [CHUNK]}]}


class _Nodes:
    """A tree's node objects by digest, as the object layer of a plain store gives them."""

    node_ids = PLAIN_IDS

    def __init__(self, nodes: dict[Digest, bytes]) -> None:
        self._nodes = nodes

    def get(self, kind: object, digest: Digest) -> bytes:
        return self._nodes[digest]


def _node(entries: dict[str, Any], version: int = NODE_FORMAT_VERSION) -> tuple[Digest, bytes]:
    body = {"format_version": version, "kind": "tree", "entries": entries}
    data = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return Digest.of(data), data


def _index(more: list[Digest]) -> tuple[Digest, bytes]:
    body = {"format_version": NODE_FORMAT_VERSION, "kind": "tree", "entries": {},
            "more": [d.hex for d in more]}
    data = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return Digest.of(data), data


def _model(layers: int = 12) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    arrays = {}
    for i in range(layers):
        for part in ("attn.q", "attn.k", "mlp.fc", "norm"):
            arrays[f"model.layers.{i}.{part}.weight"] = rng.standard_normal(32).astype(np.float32)
        arrays[f"optimizer.state.{i}.step"] = np.array(float(i), dtype=np.float32)
    arrays["model.head.weight"] = rng.standard_normal(64).astype(np.float32)
    return arrays


def _tree_nodes(store: chunkstore.Store, root: Digest) -> dict[Digest, Any]:
    nodes, todo = {}, [root]
    while todo:
        digest = todo.pop()
        if digest not in nodes:
            nodes[digest] = load_tree(store.objects, digest, NodeCache())
            todo.extend(nodes[digest].children())
    return nodes


def _save(path: Path, arrays: dict[str, np.ndarray], step: int, node_size: int | None
          ) -> tuple[chunkstore.VersionInfo, dict[Digest, Any]]:
    with chunkstore.open(path, compression="none", node_size=node_size, create=True) as store:
        with store.new_version("r", step) as version:
            for name, array in arrays.items():
                version.put(name, array)
            version.put_data("trainer", {"epoch": 1})
        nodes = _tree_nodes(store, version.info.root)
        reader = store.open_version(version.info.id)
        assert sorted(reader.names()) == sorted([*arrays, "trainer"])
        for name, array in arrays.items():
            np.testing.assert_array_equal(reader.get(name), array)
        return version.info, nodes


def test_a_model_is_one_node_by_default_and_one_per_branch_at_node_size_0(tmp_path: Path
                                                                          ) -> None:
    arrays = _model()
    _, inlined = _save(tmp_path / "a", arrays, 1, None)
    _, branchy = _save(tmp_path / "b", arrays, 1, 0)
    assert len(inlined) == 1
    root = next(iter(inlined.values()))
    assert "model.layers.3.attn.q.weight" in root.leaves
    # One node per branch: root, model, layers; per layer its own, attn, attn.q, attn.k,
    # mlp, mlp.fc and norm; head; optimizer, state and one per step.
    assert len(branchy) == 3 + 12 * 7 + 1 + 2 + 12


def test_node_size_bounds_the_nodes_and_unchanged_runs_are_shared(tmp_path: Path) -> None:
    arrays = _model()
    first, nodes = _save(tmp_path, arrays, 1, 1500)
    with chunkstore.open(tmp_path, create=True) as store:
        sizes = {d: len(store.backend.get(NODES.key(d))) for d in nodes}
    total = sum(sizes.values())
    # A node holds at most node_size of entries (one more when a single entry is
    # larger), or lists the nodes that continue a level too large for one.
    for digest, node in nodes.items():
        if node.more:
            assert not node.leaves and sizes[digest] <= 100 + 70 * len(node.more)
        else:
            assert sizes[digest] <= 1500 + 400
    assert any(node.more for node in nodes.values())
    assert any("." in name for node in nodes.values() for name in node.leaves)
    assert len(nodes) <= total // 1000 + 4
    changed = dict(arrays)
    changed["model.layers.7.mlp.fc.weight"] = arrays["model.layers.7.mlp.fc.weight"] + 1
    second, later = _save(tmp_path, changed, 2, 1500)
    shared = set(nodes) & set(later)
    assert first.root != second.root and len(later) - len(shared) <= 3, "only the changed"\
        " run of entries and the nodes above it are new"


def test_a_level_of_thousands_of_names_is_a_few_nodes(tmp_path: Path) -> None:
    arrays = {f"table.{i}": np.full(2, i, dtype=np.int32) for i in range(3000)}
    with chunkstore.open(tmp_path, compression="none", create=True) as store:
        with store.new_version("r", 1) as version:
            for name, array in arrays.items():
                version.put(name, array)
        nodes = _tree_nodes(store, version.info.root)
        sizes = [len(store.backend.get(NODES.key(d))) for d in nodes]
        # About 3000 entries of ~300 bytes: runs of 32 to 64 KiB, not a node per name.
        assert len(nodes) <= sum(sizes) // (32 * 1024) + 3
        assert max(sizes) <= store.node_size + 1024
        reader = store.open_version(version.info.id)
        assert len(reader.names()) == 3000
        np.testing.assert_array_equal(reader.get("table.2999"), arrays["table.2999"])
        assert store.verify().ok


def test_saves_under_either_layout_read_the_same(tmp_path: Path) -> None:
    arrays = _model(3)
    info_a, _ = _save(tmp_path, arrays, 1, 0)
    info_b, _ = _save(tmp_path, arrays, 2, None)
    with chunkstore.open(tmp_path, create=True) as store:
        a, b = store.open_version(info_a.id), store.open_version(info_b.id)
        assert a.entries() == b.entries()
        assert store.verify().ok


@pytest.mark.parametrize("size", [-1, MAX_NODE_TARGET + 1, 1.5, "64k"])
def test_a_bad_node_size_is_refused(tmp_path: Path, size: object) -> None:
    with pytest.raises(InvalidSettingError, match="node size"):
        chunkstore.open(tmp_path, node_size=size, create=True)  # type: ignore[arg-type]
    assert not (tmp_path / "chunkstore.json").exists()


def test_dotted_names_decode_from_format_4_and_flatten_to_full_names() -> None:
    child = _node({"b": {"tensor": TENSOR}})
    root = _node({"a.x.y": {"tensor": TENSOR}, "a.x": {"tree": child[0].hex},
                  "c": {"tensor": TENSOR}})
    node = decode_tree(*root)
    assert set(node.leaves) == {"a.x.y", "c"} and set(node.subtrees) == {"a.x"}

    flat = flatten(_Nodes(dict([root, child])), root[0], NodeCache())  # type: ignore[arg-type]
    assert sorted(flat.leaves) == ["a.x.b", "a.x.y", "c"]


def test_a_dotted_name_in_an_older_node_format_is_corrupt() -> None:
    with pytest.raises(CorruptNodeError, match="component contains"):
        decode_tree(*_node({"a.b": {"tensor": TENSOR}}, version=3))


@pytest.mark.parametrize("name", ["a..b", ".a", "a.", "a/b", "a.\x01"])
def test_a_malformed_dotted_name_is_corrupt(name: str) -> None:
    with pytest.raises(CorruptNodeError, match="entry"):
        decode_tree(*_node({name: {"tensor": TENSOR}}))


def test_continuation_nodes_hold_entries_under_the_same_prefix() -> None:
    first = _node({"a": {"tensor": TENSOR}, "b.c": {"tensor": TENSOR}})
    second = _node({"d": {"tensor": TENSOR}})
    index = _index([first[0], second[0]])
    parent = _node({"x": {"tree": index[0].hex}})
    objects = dict([first, second, index, parent])

    flat = flatten(_Nodes(objects), parent[0], NodeCache())  # type: ignore[arg-type]
    assert sorted(flat.leaves) == ["x.a", "x.b.c", "x.d"]
    assert decode_tree(*index).children() == [first[0], second[0]]


@pytest.mark.parametrize(("more", "version"), [([], 4), ([CHUNK], 3), (["zz"], 4), ("x", 4)])
def test_a_malformed_continuation_list_is_corrupt(more: object, version: int) -> None:
    body = {"format_version": version, "kind": "tree", "entries": {}, "more": more}
    data = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    with pytest.raises(CorruptNodeError):
        decode_tree(Digest.of(data), data)


@pytest.mark.parametrize("second_entries", [
    {"a": {"tensor": TENSOR}},  # the same leaf in two continuation nodes
    {"s": {"tree": CHUNK}},  # the same subtree name twice
])
def test_a_name_in_two_continuation_nodes_is_corrupt(second_entries: dict[str, Any]) -> None:
    child, other = _node({"z": {"tensor": TENSOR}}), _node({"y": {"tensor": TENSOR}})
    first = _node({"a": {"tensor": TENSOR}, "s": {"tree": child[0].hex}})
    second = _node({k: {"tree": other[0].hex} if "tree" in v else v
                    for k, v in second_entries.items()})
    index = _index([first[0], second[0]])
    objects = dict([child, other, first, second, index])

    with pytest.raises(CorruptNodeError, match="appears twice"):
        flatten(_Nodes(objects), index[0], NodeCache())  # type: ignore[arg-type]


def test_an_inlined_name_that_repeats_a_subtree_leaf_is_corrupt() -> None:
    child = _node({"b": {"tensor": TENSOR}})
    root = _node({"a.b": {"tensor": TENSOR}, "a": {"tree": child[0].hex}})

    with pytest.raises(CorruptNodeError, match="appears twice"):
        flatten(_Nodes(dict([root, child])), root[0], NodeCache())  # type: ignore[arg-type]


def test_gc_and_index_rebuild_keep_every_node_of_a_split_tree(tmp_path: Path) -> None:
    """GC's mark and the rebuilt index follow continuations and inlined subtrees: a
    version whose tree is split survives GC at grace 0, before and after a rebuild."""
    arrays = _model()
    with chunkstore.open(tmp_path, compression="none", node_size=700, create=True) as store:
        with store.new_version("r", 1) as version:
            for name, array in arrays.items():
                version.put(name, array)
        kept = version.info
        nodes = _tree_nodes(store, kept.root)
        assert any(node.more for node in nodes.values())
        assert any(node.subtrees for node in nodes.values())
        with store.new_version("r", 2) as version:
            version.put("other", np.arange(10, dtype=np.int64))
        store.delete(version.info.id)
        assert store.gc(grace=0).nodes_deleted > 0
        store.rebuild_index()
        store.gc(grace=0)
        for digest in nodes:
            assert store.backend.exists(NODES.key(digest))
        reader = store.open_version(kept.id)
        for name, array in arrays.items():
            np.testing.assert_array_equal(reader.get(name), array)
        assert store.verify().ok
        # GC's mark (what protects the objects of versions the index does not count
        # yet, committed during a GC or removed within the grace period) reaches
        # every node and chunk of the split tree.
        marks = MarkSet(str(tmp_path))
        try:
            mark_tree(store, kept.root, marks)
            marks.resolve(list_moved(store.objects), lambda _: True)  # members: to their packs
            assert all((NODE, digest) in marks for digest in nodes)
            assert all((CHUNK_KIND, digest) in marks for digest in flatten(
                store.objects, kept.root, NodeCache()).chunk_digests())
        finally:
            marks.close()


def test_the_same_step_saved_again_under_another_layout_is_the_same_version(tmp_path: Path
                                                                            ) -> None:
    arrays = _model(2)
    first, _ = _save(tmp_path, arrays, 1, 0)
    again, _ = _save(tmp_path, arrays, 1, None)  # other nodes, the same entries
    assert again.id == first.id
    changed = dict(arrays)
    changed["model.head.weight"] = arrays["model.head.weight"] * 2
    with pytest.raises(DuplicateStepError):
        _save(tmp_path, changed, 1, None)


def test_adding_an_entry_to_a_split_level_rewrites_about_one_run(tmp_path: Path) -> None:
    arrays = {f"table.{i:04d}": np.full(2, i, dtype=np.int32) for i in range(0, 3000, 2)}
    with chunkstore.open(tmp_path, compression="none", node_size=16 * 1024, create=True) as store:
        roots = []
        for step, extra in enumerate(([], ["table.1001"]), start=1):
            with store.new_version("r", step) as version:
                for name, array in arrays.items():
                    version.put(name, array)
                for name in extra:
                    version.put(name, np.zeros(2, dtype=np.int32))
            roots.append(version.info.root)
        before, after = _tree_nodes(store, roots[0]), _tree_nodes(store, roots[1])
    assert len(before) > 10
    # The new entry's run and the node listing the runs (a cut in between may make two).
    assert len(set(after) - set(before)) <= 3


def test_tensor_text_is_the_canonical_json_of_the_entry() -> None:
    rng = np.random.default_rng(7)

    def digest() -> Digest:
        return Digest(rng.bytes(32))

    for _ in range(300):
        shards = []
        for _ in range(int(rng.integers(1, 4))):
            n = int(rng.integers(0, 5))
            chunks = tuple(digest() for _ in range(n))
            bases = tuple(tuple(digest() for _ in range(int(rng.integers(0, 3))))
                          for _ in range(n)) if rng.random() < 0.5 else ()
            packs = tuple(None if rng.random() < 0.3 else PackLocation(
                digest(), int(rng.integers(0, 2**40)), int(rng.integers(24, 2**30)))
                for _ in range(n)) if rng.random() < 0.5 else ()
            rank = int(rng.integers(0, 4))
            shards.append(Shard(tuple(int(x) for x in rng.integers(0, 2**62, rank)),
                                tuple(int(x) for x in rng.integers(0, 2**62, rank)),
                                int(rng.integers(1, 2**28)), chunks, bases, packs))
        entry = TensorEntry(str(rng.choice(["float32", "bfloat16", "int8", "é\"x"])),
                            tuple(int(x) for x in rng.integers(0, 2**40, len(shards[0].sizes))),
                            tuple(shards))
        assert tensor_text(entry) == canonical_json(entry.to_json())
