"""What the commands say: refusals that protect data, sizes that explain themselves,
a plan that admits when no interval helps, and the small words (plurals, tags)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner, Result

import chunkstore
from chunkstore.cli import cli
from tests.conftest import SMALL_CHUNK, tree_snapshot


def run(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def save(store_path: Path, run_name: str, steps: list[int],
         meta_for: dict[int, dict[str, object]] | None = None) -> None:
    rng = np.random.default_rng(len(steps))
    with chunkstore.open(store_path, chunk_size=SMALL_CHUNK, create=True) as store:
        for step in steps:
            meta = (meta_for or {}).get(step, {})
            with store.new_version(run_name, step, meta=meta) as v:
                v.put("model.w", rng.standard_normal(1000).astype(np.float32))


# --- prune --keep-best with a metric nobody records -----------------------------------------


def test_keep_best_with_a_metric_no_version_records_is_refused(store_path: Path) -> None:
    save(store_path, "r", list(range(1, 8)), {s: {"metrics": {"loss": 1 / s}, "lr": 0.1}
                                               for s in range(1, 8)})
    before = tree_snapshot(store_path)
    for extra in (["--dry-run"], []):
        result = run("prune", str(store_path), "--keep-best", "val_loss:2", *extra)
        assert result.exit_code == 2
        assert result.stdout == ""
        assert result.stderr.startswith("chunkstore: error: ")
        assert len(result.stderr.splitlines()) == 1
        assert "'val_loss'" in result.stderr
        assert "loss, lr" in result.stderr  # the metrics that do exist
    assert tree_snapshot(store_path) == before


def test_keep_best_refused_for_one_run_removes_nothing_from_the_others(store_path: Path) -> None:
    save(store_path, "a", [1, 2, 3, 4], {s: {"loss": 1 / s} for s in range(1, 5)})
    save(store_path, "b", [1, 2, 3, 4])
    before = tree_snapshot(store_path)
    result = run("prune", str(store_path), "--keep-best", "loss:1", "--min-previous", "0")
    assert result.exit_code == 2
    assert "run 'b'" in result.stderr
    assert tree_snapshot(store_path) == before


def test_keep_best_warns_when_only_some_versions_record_the_metric(store_path: Path) -> None:
    save(store_path, "r", [1, 2, 3, 4, 5], {1: {"loss": 0.5}, 2: {"loss": 0.4}})
    result = run("prune", str(store_path), "--keep-best", "loss:1", "--dry-run", "--json")
    assert result.exit_code == 0
    warning = "only 2 of the 5 versions of run 'r' record the metric 'loss'"
    assert warning in result.stderr
    doc = json.loads(result.stdout)
    assert any(warning in w for w in doc["warnings"])
    kept_steps = {v["step"] for v in json.loads(run("log", str(store_path), "--json").stdout)
                  ["versions"]} - {v["step"] for v in doc["removed"]}
    assert kept_steps == {2, 4, 5}  # best loss, and the newest with its predecessor


def test_prune_without_a_policy_names_the_options(store_path: Path) -> None:
    save(store_path, "r", [1, 2])
    result = run("prune", str(store_path))
    assert result.exit_code == 2
    assert "--keep-last" in result.stderr and "keep_last" not in result.stderr


# --- sizes: log, show and report agree and say what they count ------------------------------


def test_log_show_and_report_show_the_same_three_sizes(store_path: Path) -> None:
    with chunkstore.open(store_path, create=True) as store, store.new_version("r", 1) as v:
        v.put_data("trainer", {"epoch": 1})  # a tiny state: its nodes outweigh its data
    info = json.loads(run("log", str(store_path), "--json").stdout)["versions"][0]
    assert info["new_stored_bytes"] > info["logical_bytes"]  # the case that confused users
    sizes = [f"{info['logical_bytes']} B", f"{info['new_bytes']} B",
             f"{info['new_stored_bytes']} B"]
    header, row = run("log", str(store_path)).stdout.splitlines()
    assert header.split()[3:7] == ["LOGICAL", "NEW", "NEW", "STORED"]
    assert all(size in row for size in sizes)
    shown = run("show", str(store_path), "r@1").stdout
    for name, size in zip(("logical", "new", "new stored"), sizes, strict=True):
        line = next(x for x in shown.splitlines() if x.startswith(name + " "))
        assert size in line
    assert "manifest nodes" in next(x for x in shown.splitlines() if x.startswith("new stored"))
    report = run("report", str(store_path)).stdout
    assert "NEW STORED" in report and all(size in report for size in sizes)


@pytest.mark.parametrize("command", ["log", "show", "report"])
def test_the_help_says_what_each_size_counts(command: str) -> None:
    text = " ".join(run(command, "--help").stdout.split())
    assert "LOGICAL the checkpoint as saved" in text
    assert "NEW tensor chunks no earlier version had, before compression" in text
    assert "logical_bytes, new_bytes and new_stored_bytes" in text
    assert "plus the manifest nodes it wrote" in text
    assert text.index("Sizes of a version") < text.index("Exit codes")


# --- plan -----------------------------------------------------------------------------------


def test_plan_says_when_no_interval_makes_sense() -> None:
    text = run("plan", "--save-seconds", "100000", "--mtbf", "1")
    assert text.exit_code == 0
    assert "no save interval makes sense" in text.stdout
    assert "save every" not in text.stdout
    doc = json.loads(run("plan", "--save-seconds", "100000", "--mtbf", "1", "--json").stdout)
    assert doc["sensible"] is False
    assert doc["interval_seconds"] is None and doc["interval_steps"] is None
    assert "no save interval makes sense" in doc["warning"]


@pytest.mark.parametrize(("save_s", "mtbf_h", "sensible"), [
    (2, 6, True), (600, 1, True), (3000, 1, False), (7200, 1, False),
])
def test_plan_is_sensible_only_below_full_overhead(save_s: float, mtbf_h: float,
                                                   sensible: bool) -> None:
    doc = json.loads(run("plan", "--save-seconds", str(save_s), "--mtbf", str(mtbf_h),
                         "--json").stdout)
    assert doc["sensible"] is sensible
    assert (doc["warning"] is None) is sensible
    assert (doc["expected_overhead"] < 1) is sensible


# --- the small words ------------------------------------------------------------------------


def test_one_version_is_not_versions(store_path: Path) -> None:
    save(store_path, "r", [1])
    verified = run("verify", str(store_path)).stdout
    assert verified.startswith("1 version, ") and "1 versions" not in verified
    pruned = run("prune", str(store_path), "--keep-last", "1").stdout
    assert "1 version kept" in pruned


def test_verify_quick_does_not_claim_zero_bytes(store_path: Path) -> None:
    save(store_path, "r", [1, 2])
    quick = run("verify", str(store_path), "--quick").stdout
    assert "chunks present: ok" in quick
    assert "0 B" not in quick
    assert "KiB) read and hash-checked" not in quick
    assert "hash-checked (" in run("verify", str(store_path)).stdout


def test_tag_list_is_aligned_and_moving_a_tag_says_from_where(store_path: Path) -> None:
    save(store_path, "r", [1, 2, 3])
    run("tag", str(store_path), "r@1", "best")
    run("tag", str(store_path), "r@2", "a-much-longer-tag-name")
    moved = run("tag", str(store_path), "r@3", "best")
    assert moved.exit_code == 0
    assert "moved tag best from " in moved.stdout
    assert "(r@1) to " in moved.stdout and moved.stdout.rstrip().endswith("(r@3)")
    again = json.loads(run("tag", str(store_path), "r@2", "best", "--json").stdout)
    assert again["moved_from"]["step"] == 3
    same = run("tag", str(store_path), "r@2", "best")
    assert "already names" in same.stdout
    lines = run("tag", str(store_path)).stdout.splitlines()
    assert lines[0].split() == ["TAG", "ID", "RUN@STEP", "CREATED"]
    starts = {line.index(part) for line, part in
              zip(lines, ["ID", *(line.split()[1] for line in lines[1:])], strict=True)}
    assert len(starts) == 1  # the id column starts at one offset on every line


def test_the_index_group_help_has_an_example() -> None:
    text = run("index", "--help").stdout
    assert "Example" in text and "chunkstore index rebuild ckpts/" in text
