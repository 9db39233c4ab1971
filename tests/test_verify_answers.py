"""``chunkstore verify``'s answer on a damaged store (issue 48 item 3): each version
once by RUN@STEP (readable, or damaged with the entries a read cannot return), each
damaged object once with its kind, key and the versions and entries that need it, no
line that contradicts the verdict, and the command that repairs it; a reader that
stops early does not turn problems found into exit 0."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner, Result

import chunkstore
from chunkstore.cli import cli
from chunkstore.codecs import PACK
from chunkstore.format.chunkobj import HEADER, parse_header
from chunkstore.format.digest import Digest
from chunkstore.format.manifest import TensorEntry
from chunkstore.handle.tree import flatten
from chunkstore.objects.kinds import CHUNKS, MOVED, NODES, VERSIONS

CHUNK = 4096
REPO = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "chunkstore"]
STEPS = (1, 2, 3, 4)


def state(step: int) -> dict[str, np.ndarray]:
    """A tensor of several chunks that changes a little each step (deltas), a frozen
    one of three chunks, a small frozen one and a small changing one (packed)."""
    big = np.random.default_rng(0).standard_normal(6 * CHUNK // 4).astype(np.float32)
    big[: step * 50] += np.float32(step)
    return {"model.big": big,
            "model.frozen": np.random.default_rng(1).standard_normal(3 * CHUNK // 4)
            .astype(np.float32),
            "model.small": np.arange(48, dtype=np.float32),
            "model.bias": np.arange(40, dtype=np.float32) * step}


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, list[str]]:
    """Steps 1-4 of run ``r``, each with its plain data ``trainer``."""
    path = tmp_path / "store"
    with chunkstore.open(path, create=True, chunk_size=CHUNK, delta_depth=3) as store:
        store.pack_delta_chunks = False  # deltas as objects of their own
        ids = []
        for step in STEPS:
            with store.new_version(run="r", step=step) as version:
                for name, array in state(step).items():
                    version.put(name, array)
                version.put_data("trainer", {"step": step})
            ids.append(version.info.id)
    return path, ids


def objects_of(store: chunkstore.Store, version: str) -> dict[str, Digest]:
    """One object of each kind the version needs, keyed by what it is."""
    record = store.read_record(version)
    flat = flatten(store.objects, record.root, store.node_cache)
    found: dict[str, Digest] = {"tree-node": record.root,
                                "data-node": sorted(flat.data_nodes())[0]}
    for leaf in flat.leaves.values():
        if not isinstance(leaf, TensorEntry):
            continue
        for shard in leaf.shards:
            for i, digest in enumerate(shard.chunks):
                location = shard.location(i)
                if location is not None:
                    found.setdefault("pack", location.pack)
                elif shard.chain(i):
                    found.setdefault("delta", digest)
                    found.setdefault("base", shard.chain(i)[0])
    for digest in sorted(flat.chunk_digests()):
        head = parse_header(digest, store.objects.get_range(CHUNKS, digest, 0, HEADER.size + 32))
        if head.base is None and head.codec_id != PACK.id and digest != found.get("base"):
            found.setdefault("chunk", digest)
    assert set(found) == {"tree-node", "data-node", "pack", "delta", "base", "chunk"}, found
    return found


def damage(path: Path, key: str, how: str) -> None:
    file = path / key
    if how == "delete":
        file.unlink()
        return
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x04
    file.chmod(0o644)
    file.write_bytes(bytes(data))


def verify(path: Path, *args: str) -> Result:
    return CliRunner().invoke(cli, ["verify", str(path), *args], catch_exceptions=False)


def verify_json(path: Path, *args: str) -> dict[str, Any]:
    result = verify(path, "--json", *args)
    assert result.exit_code == 1, result.output
    doc: dict[str, Any] = json.loads(result.stdout)
    return doc


def lines_naming(text: str, word: str) -> list[str]:
    return [line for line in text.splitlines() if word in line]


# --- a truncated pack -----------------------------------------------------------------------


def truncated_first_pack(path: Path, ids: list[str]) -> Digest:
    """Cut step 1's pack (which every version reads ``model.small`` from) short."""
    with chunkstore.open(path) as store:
        entry = store.open_version(ids[0]).entry("model.small")
        assert isinstance(entry, TensorEntry)
        location = entry.shards[0].location(0)
        assert location is not None
    file = path / CHUNKS.key(location.pack)
    file.chmod(0o644)
    file.write_bytes(file.read_bytes()[:40])
    return location.pack


def test_a_truncated_pack_is_one_object_and_each_version_one_line(
        saved: tuple[Path, list[str]]) -> None:
    """It listed a corrupt-chunk line per member and version, by version id, then said
    every version reads back whole."""
    path, ids = saved
    pack = truncated_first_pack(path, ids)
    result = verify(path)
    assert result.exit_code == 1
    text = result.output
    assert "reads back whole" not in text and "corrupt-chunk" not in text
    head = text.splitlines()[0]
    assert head.startswith("4 versions, ") and "4 of 4 versions damaged, 1 damaged object" in head
    for step, version in zip(STEPS, ids, strict=True):
        (line,) = lines_naming(text, f"  r@{step} ")
        assert version[:12] in line and "damaged:" in line and "model.small" in line, line
    step1 = lines_naming(text, "  r@1 ")[0]
    assert "model.bias" in step1  # step 1's own small tensor lies in that pack too
    (named,) = lines_naming(text, pack.hex[:12])  # the pack once: its header note folded in
    assert named.strip().startswith(f"pack {CHUNKS.key(pack)}: corrupt: ")
    assert "truncated" in named
    (needed,) = lines_naming(text, "needed by")
    assert "needed by 4 versions: r@1, r@2, r@3, r@4; entries model.bias, model.small" in needed
    assert f"`chunkstore repair {path} --from OTHER`" in text.splitlines()[-1]


def test_the_json_adds_versions_and_objects_and_keeps_the_problems(
        saved: tuple[Path, list[str]]) -> None:
    path, ids = saved
    pack = truncated_first_pack(path, ids)
    doc = verify_json(path)
    assert doc["ok"] is False and doc["versions_checked"] == 4
    assert [(v["label"], v["id"], v["damaged"]) for v in doc["versions"]] == [
        (f"r@{step}", version, True) for step, version in zip(STEPS, ids, strict=True)]
    assert doc["versions"][0]["damaged_entries"] == ["model.bias", "model.small"]
    assert doc["versions"][0]["entries"] == 5
    (obj,) = doc["objects"]
    assert (obj["kind"], obj["key"], obj["state"]) == ("pack", CHUNKS.key(pack), "corrupt")
    assert obj["versions"] == ["r@1", "r@2", "r@3", "r@4"] and obj["version_ids"] == ids
    assert obj["entries"]["r@2"] == ["model.small"] and obj["chunks"] == 2
    assert obj["notes"] and "truncated" in obj["notes"][0]
    # the raw findings stay, one per version and entry, with where they are
    assert {p["kind"] for p in doc["problems"]} == {"corrupt-chunk"}
    for problem in doc["problems"]:
        assert {"kind", "message", "version", "digest"} <= set(problem)
        assert (problem["run"], problem["object_kind"], problem["object_key"]) == (
            "r", "pack", CHUNKS.key(pack))
        assert problem["step"] in STEPS and problem["tensor"] in ("model.small", "model.bias")
    assert len(doc["problems"]) == 5  # small in 4 versions, bias in step 1


# --- every kind of object -------------------------------------------------------------------


@pytest.mark.parametrize(("what", "kind", "how"), [
    *((what, kind, how) for what, kind in (
        ("tree-node", "node"), ("data-node", "node"), ("chunk", "chunk"), ("delta", "chunk"),
        ("base", "chunk"), ("pack", "pack")) for how in ("delete", "flip")),
    ("record", "record", "flip")])  # a missing commit record is a removed version
def test_each_damaged_object_is_named_once_with_its_kind_and_key(
        saved: tuple[Path, list[str]], what: str, kind: str, how: str) -> None:
    path, ids = saved
    with chunkstore.open(path) as store:
        found = objects_of(store, ids[1])
    if what == "record":
        key = VERSIONS.key(ids[1])
    else:
        key = (NODES if what.endswith("node") else CHUNKS).key(found[what])
    damage(path, key, how)
    doc = verify_json(path)
    (obj,) = doc["objects"]
    assert (obj["kind"], obj["key"]) == (kind, key)
    assert obj["state"] == ("missing" if how == "delete" else "corrupt")
    assert "r@2" in obj["versions"]
    damaged = {v["label"] for v in doc["versions"] if v["damaged"]}
    assert damaged == set(obj["versions"])
    text = verify(path).output
    assert len(lines_naming(text, key)) == 1, text
    assert f"{kind} {key}: " in text


def test_one_missing_object_many_versions_need_is_named_once(
        saved: tuple[Path, list[str]]) -> None:
    """It repeated a missing object once per version (and per length read)."""
    path, ids = saved
    with chunkstore.open(path) as store:
        frozen = store.open_version(ids[0]).entry("model.frozen")
    assert isinstance(frozen, TensorEntry)
    key = CHUNKS.key(frozen.shards[0].chunks[0])
    damage(path, key, "delete")
    text = verify(path).output
    (line,) = lines_naming(text, key)
    assert line.strip() == f"chunk {key}: missing"
    assert "needed by 4 versions: r@1, r@2, r@3, r@4; entries model.frozen" in text
    for step in STEPS:
        (version,) = lines_naming(text, f"  r@{step} ")
        assert "damaged: 1 of 5 entries cannot be read: model.frozen" in version


def test_a_readable_version_says_so_beside_the_damaged_ones(
        saved: tuple[Path, list[str]]) -> None:
    path, ids = saved
    with chunkstore.open(path) as store:
        node = objects_of(store, ids[3])["data-node"]
    damage(path, NODES.key(node), "flip")
    text = verify(path).output
    assert lines_naming(text, "  r@1 ")[0].endswith("readable")
    (step4,) = lines_naming(text, "  r@4 ")
    assert step4.endswith("damaged: 1 of 5 entries cannot be read: trainer")


def test_a_moved_record_that_cannot_be_parsed_is_named_as_one(tmp_path: Path) -> None:
    """Step 1's pack repacked (step 1 removed, most of its members garbage), then its
    moved record damaged: step 2 reads members through it."""
    path = tmp_path / "store"
    changes = {1: 10, 2: 6, 3: 9}  # step -> how many of the tensors (the first) change

    def value(i: int, step: int) -> np.ndarray:
        last = max(s for s, count in changes.items() if s <= step and i < count)
        return np.random.default_rng(100 * i + last).standard_normal(256).astype(np.float32)

    with chunkstore.open(path, create=True, chunk_size=64 * 1024) as store:
        ids = []
        for step in changes:
            with store.new_version("r", step) as version:
                for i in range(10):
                    version.put(f"t{i}", value(i, step))
            ids.append(version.info.id)
        entry = store.open_version(ids[0]).entry("t0")
        assert isinstance(entry, TensorEntry)
        location = entry.shards[0].location(0)
        assert location is not None
        first = location.pack
        store.delete(ids[0])
        assert store.gc(grace=0).packs_repacked == 1
    (path / MOVED.key(first)).write_bytes(b"not json")
    doc = verify_json(path)
    (obj,) = doc["objects"]
    assert (obj["kind"], obj["key"], obj["state"]) == ("moved record", MOVED.key(first),
                                                       "corrupt")
    assert obj["versions"] == ["r@2", "r@3"]  # both read t9 of step 1 through it
    text = verify(path).output
    assert len(lines_naming(text, MOVED.key(first))) == 1
    assert "chunkstore repair" in text


# --- a reader that stops early --------------------------------------------------------------


def closed_pipe(*args: str) -> tuple[int, str]:
    """Run the CLI with its stdout closed before it writes (``| head`` gone at once)."""
    proc = subprocess.Popen([*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=REPO)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    with proc:
        stderr = proc.stderr.read()
        return proc.wait(timeout=120), stderr


def test_verify_piped_to_head_still_exits_1_on_a_damaged_store(
        saved: tuple[Path, list[str]]) -> None:
    """`chunkstore verify STORE | head` exited 0 on a damaged store; listing commands
    still exit 0 when their reader leaves."""
    path, ids = saved
    truncated_first_pack(path, ids)
    assert closed_pipe("verify", str(path)) == (1, "")
    assert closed_pipe("verify", str(path), "--json") == (1, "")
    assert closed_pipe("log", str(path)) == (0, "")
