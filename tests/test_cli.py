"""The command line: each command's output, JSON, exit codes and refusals, on real stores."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner, Result

import chunkstore
from chunkstore.cli import cli, format_size, parse_size
from chunkstore.objects.kinds import CHUNKS
from chunkstore.progress import TerminalProgress
from tests.conftest import SMALL_CHUNK, tree_snapshot


def run(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


@pytest.fixture
def filled(store_path: Path) -> Path:
    """A store with three versions of run r (steps 1-3); step 3 changes one tensor."""
    return _fill(store_path, None)


@pytest.fixture
def filled_objects(store_path: Path) -> Path:
    """``filled`` without delta chains: every chunk of the larger tensors is an object
    of its own, for the tests that count or damage chunk objects on disk."""
    return _fill(store_path, 0)


def _fill(store_path: Path, delta_depth: int | None) -> Path:
    rng = np.random.default_rng(1)
    base = rng.standard_normal(50_000).astype(np.float32)
    head = rng.standard_normal(20_000).astype(np.float32)
    with chunkstore.open(store_path, chunk_size=SMALL_CHUNK, delta_depth=delta_depth,
                         create=True) as store:
        for step in (1, 2, 3):
            if step == 3:
                head = head + 1
            with store.new_version("r", step, meta={"lr": 0.1}) as v:
                v.put("model.base", base)
                v.put("model.head", head)
                v.put_data("trainer", {"step": step})
    return store_path


def test_init_creates_and_refuses_an_existing_store(tmp_path: Path) -> None:
    path = str(tmp_path / "s")
    result = run("init", path, "--chunk-size", "1MiB", "--compression", "zstd")
    assert result.exit_code == 0, result.output
    with chunkstore.open(path, create=False) as store:
        assert store.chunk_size == 1 << 20
        assert store.config.compression == "zstd"
    before = tree_snapshot(Path(path))
    again = run("init", path)
    assert again.exit_code == 2
    assert "already a chunkstore store" in again.output
    assert tree_snapshot(Path(path)) == before


def test_init_rejects_a_bad_chunk_size(tmp_path: Path) -> None:
    result = run("init", str(tmp_path / "s"), "--chunk-size", "12 parsecs")
    assert result.exit_code == 2
    assert "not a size" in result.output
    assert not (tmp_path / "s").exists()


def test_log_lists_newest_first_and_as_json(filled: Path) -> None:
    text = run("log", str(filled))
    assert text.exit_code == 0
    lines = text.output.splitlines()
    assert [line.split()[1] for line in lines[1:]] == ["r@3", "r@2", "r@1"]
    doc = json.loads(run("log", str(filled), "--json", "-n", "2").output)
    assert [v["step"] for v in doc["versions"]] == [3, 2]
    assert doc["versions"][0]["meta"] == {"lr": 0.1}


def test_show_lists_entries(filled: Path) -> None:
    doc = json.loads(run("show", str(filled), "r@2", "--json").output)
    assert doc["version"]["step"] == 2
    by_name = {e["name"]: e for e in doc["entries"]}
    assert by_name["model.base"]["shape"] == [50_000]
    assert by_name["model.base"]["bytes"] == 200_000
    assert by_name["model.base"]["chunks"] == 4  # 200 000 bytes in 64 KiB chunks
    assert by_name["trainer"]["kind"] == "data"
    assert "model.head" in run("show", str(filled), "latest").output


def test_show_counts_what_a_restore_decodes_through_delta_chains(store_path: Path) -> None:
    """The first version reads its own chunks; a later one, stored as deltas, reads
    the bases its chains list too."""
    rng = np.random.default_rng(7)
    weights = rng.standard_normal(256 * 1024).astype(np.float32)  # 16 chunks of 64 KiB
    with chunkstore.open(store_path, chunk_size=SMALL_CHUNK, create=True) as store:
        for step in (1, 2, 3):
            with store.new_version("r", step) as v:
                v.put("w", weights)
            weights = weights + rng.standard_normal(weights.size).astype(np.float32) * 1e-3
    first, last = (json.loads(run("show", str(store_path), f"r@{step}", "--json").output)
                   ["restore_reads"] for step in (1, 3))
    assert (first["chunks"], first["links"], first["longest_chain"]) == (16, 0, 0)
    assert last["chunks"] == 16 and last["links"] >= 16 and last["longest_chain"] >= 1
    assert last["stored_bytes"] > first["stored_bytes"] > 0
    assert first["unsized"] == last["unsized"] == 0
    line = next(x for x in run("show", str(store_path), "r@3").output.splitlines()
                if x.startswith("restore reads"))
    assert f"({last['links']}; up to {last['longest_chain']} for one chunk)" in line
    assert "no delta chains" in run("show", str(store_path), "r@1").output


def test_diff_counts_changed_chunks_without_reading_data(filled: Path) -> None:
    doc = json.loads(run("diff", str(filled), "r@2", "r@3", "--json").output)
    assert doc["counts"] == {"added": 0, "removed": 0, "changed": 2, "same": 1}
    changed = {e["name"]: e for e in doc["entries"]}
    assert changed["model.head"]["changed_chunks"] == 2  # 80 000 bytes: two chunks
    assert changed["model.head"]["changed_bytes"] == 80_000
    assert "model.base" not in changed
    same = json.loads(run("diff", str(filled), "r@1", "r@2", "--json").output)
    assert same["counts"]["changed"] == 1  # only the trainer's step
    assert same["changed_bytes"] < 100


def test_report_json_matches_the_store(filled_objects: Path) -> None:
    doc = json.loads(run("report", str(filled_objects), "--json").output)
    totals = doc["totals"]
    assert totals["versions"] == 3
    assert 280_000 < totals["latest_logical_bytes"] < 280_100  # two tensors and a small dict
    chunk_files = [p for p in (filled_objects / "chunks").rglob("*") if p.is_file()]
    assert totals["chunks"] == len(chunk_files)
    assert totals["physical_bytes"] >= sum(p.stat().st_size for p in chunk_files)
    assert totals["amplification"] < 2  # three versions, one full copy plus the change
    assert "amplification" in run("report", str(filled_objects)).output


def test_verify_clean_then_exit_1_on_a_corrupt_chunk(filled_objects: Path) -> None:
    assert run("verify", str(filled_objects)).exit_code == 0
    with chunkstore.open(filled_objects, create=False) as store:
        entry = store.open_version("r@1").entry("model.base")
        digest = entry.shards[0].chunks[0]
    path = filled_objects / CHUNKS.key(digest)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    result = run("verify", str(filled_objects), "--json")
    assert result.exit_code == 1
    doc = json.loads(result.output)
    assert not doc["ok"]
    assert {p["kind"] for p in doc["problems"]} == {"corrupt-chunk"}
    quick = run("verify", str(filled_objects), "--quick")
    assert quick.exit_code == 0  # --quick only checks presence


def test_tag_list_and_delete(filled: Path) -> None:
    assert run("tag", str(filled), "r@2", "best").exit_code == 0
    doc = json.loads(run("tag", str(filled), "--json").output)
    assert doc["tags"]["best"]["step"] == 2
    assert run("show", str(filled), "best", "--json").exit_code == 0
    bad = run("tag", str(filled), "r@2", "../x")
    assert bad.exit_code == 2
    assert run("tag", str(filled), "-d", "best").exit_code == 0
    missing = run("tag", str(filled), "-d", "best")
    assert missing.exit_code == 2
    assert "no tag named" in missing.output


def test_rm_dry_run_changes_nothing_and_tagged_versions_are_refused(filled: Path) -> None:
    before = tree_snapshot(filled)
    dry = run("rm", str(filled), "r@1", "r@2", "--dry-run", "--json")
    assert dry.exit_code == 0
    assert [v["step"] for v in json.loads(dry.output)["removed"]] == [1, 2]
    assert tree_snapshot(filled) == before
    run("tag", str(filled), "r@2", "keep")
    before = tree_snapshot(filled)
    refused = run("rm", str(filled), "r@1", "r@2")
    assert refused.exit_code == 2
    assert "tagged keep" in refused.output
    assert tree_snapshot(filled) == before  # r@1 was not removed either
    one_bad = run("rm", str(filled), "r@1", "r@99")
    assert one_bad.exit_code == 2
    assert tree_snapshot(filled) == before
    assert run("rm", str(filled), "r@1").exit_code == 0
    steps = [v["step"] for v in json.loads(run("log", str(filled), "--json").output)["versions"]]
    assert steps == [3, 2]
    assert run("verify", str(filled)).exit_code == 0


def test_index_rebuild_restores_a_lost_index(filled: Path) -> None:
    import shutil

    shutil.rmtree(filled / "index")
    result = run("index", "rebuild", str(filled), "--json")
    assert result.exit_code == 0
    body = json.loads(result.output)
    assert body["versions"] == 3 and 0 < body["packs"] <= body["chunks"]
    # Packs are named: "30 chunks" read as a contradiction of verify's 424 chunks.
    text = run("index", "rebuild", str(filled)).output
    assert f"{body['chunks']} chunk objects" in text and "of small chunks among them" in text
    assert run("verify", str(filled)).exit_code == 0
    assert len(json.loads(run("log", str(filled), "--json").output)["versions"]) == 3


@pytest.mark.parametrize(("args", "code", "words"), [
    (["log", "{missing}"], 2, "no store at"),
    (["show", "{store}", "nope"], 2, "version selector 'nope'"),
    (["show", "{store}", "r@77"], 2, "r@77"),
    (["diff", "{store}", "r@1", "ab"], 2, "version selector 'ab'"),
    (["verify", "{store}", "--frobnicate"], 2, "No such option"),
])
def test_errors_are_one_line_on_stderr_with_an_exit_code(
    filled: Path, tmp_path: Path, args: list[str], code: int, words: str
) -> None:
    """Run the installed console script in a real subprocess: stdout stays clean."""
    argv = [a.format(store=filled, missing=tmp_path / "missing") for a in args]
    proc = subprocess.run([sys.executable, "-m", "chunkstore", *argv],
                          check=False, capture_output=True, text=True, timeout=60)
    assert proc.returncode == code
    assert proc.stdout == ""
    assert words in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert proc.stderr.startswith("chunkstore: error: ")


def test_every_command_has_help() -> None:
    for command in ("init", "log", "show", "diff", "report", "verify", "tag", "rm", "gc",
                    "prune", "demo", "export", "plan"):
        result = run(command, "--help")
        assert result.exit_code == 0
        assert "Exit codes" in result.output
    assert "rebuild" in run("index", "--help").output


@pytest.mark.parametrize(("text", "value"), [
    ("65536", 65536), ("64K", 65536), ("64KiB", 65536), ("4MiB", 4 << 20), ("1MB", 10**6),
    ("1.5KiB", 1536),
])
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text) == value


def test_format_size() -> None:
    assert format_size(512) == "512 B"
    assert format_size(1536) == "1.5 KiB"
    assert format_size(4 << 20) == "4.0 MiB"


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_draws_on_a_terminal_and_stays_silent_when_piped() -> None:
    piped = io.StringIO()
    quiet = TerminalProgress(piped)
    quiet.start(3, "saving")
    quiet.advance(3)
    quiet.finish()
    assert piped.getvalue() == ""
    tty = _Tty()
    bar = TerminalProgress(tty)
    bar.start(4, "saving")
    bar.advance(4)
    bar.finish()
    last = tty.getvalue().rsplit("\r", 1)[-1]
    assert "saving" in last and "[" + "#" * 24 + "]" in last and "4/4" in last
    assert last.endswith("\n")


def test_an_interrupted_bar_gives_the_terminal_its_line_back() -> None:
    tty = _Tty()
    with pytest.raises(KeyboardInterrupt), TerminalProgress(tty) as bar:
        bar.start(10, "verify: chunks")
        bar.advance(3)
        raise KeyboardInterrupt
    assert tty.getvalue().endswith("\n")
    assert "3/10" in tty.getvalue().rsplit("\r", 1)[-1]


def test_a_bar_of_unknown_length_counts_up() -> None:
    tty = _Tty()
    bar = TerminalProgress(tty)
    bar.start(0, "gc: sweep")
    bar.advance(5)
    bar.finish()
    assert tty.getvalue().endswith("\n")
    assert "5" in tty.getvalue().rsplit("\r", 1)[-1]


def test_prune_then_gc_frees_the_space_of_removed_versions(filled_objects: Path) -> None:
    filled = filled_objects
    assert run("prune", str(filled)).exit_code == 2  # no policy: refuse
    dry = json.loads(run("prune", str(filled), "--keep-last", "1", "--dry-run", "--json").output)
    assert [v["step"] for v in dry["removed"]] == [1]  # 3 kept by keep_last, 2 as its predecessor
    assert len(json.loads(run("log", str(filled), "--json").output)["versions"]) == 3
    pruned = run("prune", str(filled), "--keep-last", "1", "--min-previous", "0")
    assert pruned.exit_code == 0
    assert "removed" in pruned.output
    steps = [v["step"] for v in json.loads(run("log", str(filled), "--json").output)["versions"]]
    assert steps == [3]
    report = json.loads(run("report", str(filled), "--json").output)["totals"]
    assert report["reclaimable_bytes"] > 0 and report["reclaimable_now_bytes"] == 0
    before = tree_snapshot(filled)
    dry_gc = json.loads(run("gc", str(filled), "--grace", "0", "--dry-run", "--json").output)
    assert tree_snapshot(filled) == before
    real = json.loads(run("gc", str(filled), "--grace", "0", "--json").output)
    assert real["bytes_freed"] == dry_gc["bytes_freed"] > 0
    assert real["chunks_deleted"] == 2  # the two chunks of model.head at steps 1-2
    assert run("verify", str(filled)).exit_code == 0
    kept = json.loads(run("gc", str(filled), "--json").output)
    assert kept["chunks_deleted"] == 0


def test_gc_and_prune_refuse_bad_options(filled: Path) -> None:
    assert run("gc", str(filled), "--grace", "soon").exit_code == 2
    assert run("prune", str(filled), "--keep-best", "loss").exit_code == 2
    assert run("prune", str(filled), "--keep-within", "yesterday").exit_code == 2


def test_tag_set_and_delete_speak_json_when_asked(filled: Path) -> None:
    set_doc = json.loads(run("tag", str(filled), "r@2", "best", "--json").output)
    assert set_doc["tagged"] == "best" and set_doc["version"]["step"] == 2
    assert json.loads(run("tag", str(filled), "-d", "best", "--json").output) == {
        "removed": "best"}
