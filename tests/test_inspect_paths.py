"""The paths ``log``, ``report`` and ``verify`` take through a store of many versions
(issue 49): ``log`` lists the newest versions by a seek, a limit by default; a
manifest walk decodes each distinct tensor entry once."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import chunkstore
from chunkstore.cli import cli
from chunkstore.cli.inspection import LOG_LIMIT
from chunkstore.errors import CorruptNodeError
from chunkstore.format import manifest
from chunkstore.format.digest import Digest


@pytest.fixture(scope="module")
def many(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store of LOG_LIMIT + 5 versions: runs a (steps 0..) and b (one version)."""
    path = tmp_path_factory.mktemp("many") / "store"
    with chunkstore.open(path, create=True) as store:
        for step in range(LOG_LIMIT + 4):
            with store.new_version("a", step) as version:
                version.put("w", np.full(16, step, dtype=np.float32))
                version.put("fixed", np.zeros(16, dtype=np.float32))
        with store.new_version("b", 7) as version:
            version.put("w", np.ones(4, dtype=np.float32))
    return path


def run(*args: str) -> str:
    done = CliRunner().invoke(cli, list(args))
    assert done.exit_code == 0, done.output
    return done.output


def test_log_lists_the_newest_by_default_and_says_how_many_more(many: Path) -> None:
    doc = json.loads(run("log", str(many), "--json"))
    assert doc["total"] == LOG_LIMIT + 5
    assert len(doc["versions"]) == LOG_LIMIT
    assert [(v["run"], v["step"]) for v in doc["versions"][:3]] == [
        ("b", 7), ("a", LOG_LIMIT + 3), ("a", LOG_LIMIT + 2)]
    text = run("log", str(many)).splitlines()
    assert len(text) == 1 + LOG_LIMIT + 1
    assert text[-1].startswith("... 5 older versions not listed")


def test_log_all_and_limit(many: Path) -> None:
    every = json.loads(run("log", str(many), "--all", "--json"))["versions"]
    assert len(every) == LOG_LIMIT + 5
    assert [(v["run"], v["step"]) for v in every[-2:]] == [("a", 1), ("a", 0)]
    with chunkstore.open(many) as store:
        assert [v["id"] for v in every] == [v.id for v in reversed(store.versions())]
    two = json.loads(run("log", str(many), "--run", "a", "--limit", "2", "--json"))
    assert [v["step"] for v in two["versions"]] == [LOG_LIMIT + 3, LOG_LIMIT + 2]
    assert two["total"] == LOG_LIMIT + 4
    text = run("log", str(many), "--run", "b").splitlines()
    assert len(text) == 2  # all of them: no last line
    refused = CliRunner().invoke(cli, ["log", str(many), "-n", "3", "--all"])
    assert refused.exit_code == 2 and "give one or the other" in refused.output


def test_a_walk_decodes_each_distinct_entry_once(many: Path) -> None:
    with chunkstore.open(many) as store:
        first, second = store.versions()[:2]
        a = store.open_version(first.id).entries()
        b = store.open_version(second.id).entries()
    assert a["fixed"] is b["fixed"]  # the same text: one decode, shared
    assert a["w"] != b["w"]


def test_an_entry_that_fails_its_checks_fails_every_time() -> None:
    entry = {"tensor": {"dtype": "float32", "shape": [4], "shards": [{
        "chunk_bytes": 64, "chunks": [], "offsets": [0], "sizes": [4]}]}}
    node = json.dumps({"entries": {"t": entry}, "format_version": manifest.NODE_FORMAT_VERSION,
                       "kind": "tree"}, sort_keys=True, separators=(",", ":")).encode()
    for _ in range(2):  # never remembered as decoded
        with pytest.raises(CorruptNodeError, match="needs 1 chunk keys"):
            manifest.decode_tree(Digest.of(node), node)


def test_the_decoded_entries_stay_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    memo = manifest._DecodedEntries()
    monkeypatch.setattr(memo, "MAX_CHARS", 2000)
    for i in range(40):
        obj = {"dtype": "float32", "shape": [16], "shards": [{
            "chunk_bytes": 64, "chunks": [Digest.of(str(i).encode()).hex], "offsets": [0],
            "sizes": [16]}]}
        assert memo.decode(obj) is memo.decode(obj)
    assert sum(len(text) for text in memo._entries) <= 2000
