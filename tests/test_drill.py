"""Restore drills (``chunkstore drill``): the restore in a fresh process with its phases,
the fault scenarios on a scratch copy and their named outcomes, the drill record and
``report``'s line on it, ``--then``, ``--json``, and bad input that changes nothing."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import chunkstore
from chunkstore.cli import cli
from chunkstore.cli.recovery import EXIT_TARGET_FAILED
from chunkstore.errors import InvalidInputError, InvalidSettingError, NoStoreError, SelectorError
from chunkstore.format.drills import PHASES, DrillRecord
from chunkstore.maintenance.drill import READY_LINE, DrillResult, drill
from chunkstore.maintenance.drillrestore import stored_objects
from chunkstore.maintenance.report import stats as store_stats
from chunkstore.objects.kinds import CHUNKS, DRILLS
from chunkstore.read.reader import VersionReader
from tests.conftest import SMALL_CHUNK


def _save(path: Path, steps: tuple[int, ...], run: str = "exp") -> None:
    rng = np.random.default_rng(len(steps))
    with chunkstore.open(path, create=True, chunk_size=SMALL_CHUNK) as store:
        for step in steps:
            with store.new_version(run, step) as v:
                v.put("w", rng.standard_normal(100_000).astype(np.float32))
                v.put("b", np.arange(50 * step, dtype=np.int64))
                v.put_data("trainer", {"step": step, "lr": 0.1})


@pytest.fixture(scope="module")
def store_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("drill") / "store"
    _save(path, (1, 2, 3))
    return path


@pytest.fixture(scope="module")
def scenario_drill(store_path: Path) -> DrillResult:
    with chunkstore.open(store_path) as store:
        return drill(store, scenarios=("missing-chunk", "truncated-object",
                                       "incompatible-version"),
                     materialize="numpy", opener=chunkstore.open)


def _files(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*")
                  if "index" not in p.relative_to(path).parts)


def test_each_scenario_produces_its_named_outcome(scenario_drill: DrillResult) -> None:
    record = scenario_drill.record
    assert record.ok and record.restored and (record.run, record.step) == ("exp", 3)
    outcomes = {s.name: s for s in record.scenarios}
    assert {n: (s.ok, s.outcome) for n, s in outcomes.items()} == {
        "missing-chunk": (True, "fell-back"), "truncated-object": (True, "fell-back"),
        "incompatible-version": (True, "fell-back")}
    assert "refused with MissingChunkError; restored" in outcomes["missing-chunk"].detail
    assert "exp@2" in outcomes["missing-chunk"].detail
    assert "refused with CorruptChunkError" in outcomes["truncated-object"].detail
    assert "refused with FormatVersionError; restored" in outcomes["incompatible-version"].detail
    assert "exp@3" in outcomes["incompatible-version"].detail
    assert all(0 < s.seconds < 30 for s in record.scenarios)


def test_with_nothing_to_fall_back_to_the_restore_fails_with_the_named_error(
        tmp_path: Path) -> None:
    _save(tmp_path / "one", (7,))
    with chunkstore.open(tmp_path / "one") as store:
        result = drill(store, scenarios=("missing-chunk",), materialize="numpy",
                       opener=chunkstore.open, record=False)
        assert not list(store.objects.ids(DRILLS))  # record=False stores nothing
    (scenario,) = result.record.scenarios
    assert (scenario.ok, scenario.outcome) == (True, "failed-typed")
    assert "MissingChunkError" in scenario.detail and result.drill_id is None


def test_the_breakdown_has_every_phase_with_plausible_numbers(
        scenario_drill: DrillResult, store_path: Path) -> None:
    record = scenario_drill.record
    assert set(record.phases) == set(PHASES) and record.phases["first_update"] is None
    timed = [t for t in (record.phases[p] for p in PHASES[:-1]) if t is not None]
    assert len(timed) == len(PHASES) - 1 and all(0 <= t < 30 for t in timed)
    assert (record.phases["startup"] or 0) > 0.05  # an interpreter starts and imports chunkstore
    assert sum(timed) <= record.recovery_seconds + 0.01
    stored = sum(p.stat().st_size for p in (store_path / "chunks").rglob("*") if p.is_file())
    assert 0 < record.bytes_downloaded <= stored  # one version's objects, read once
    restore = scenario_drill.restore
    assert restore["entries"] == 3 and restore["logical_bytes"] >= 400_000
    assert record.materialized_as == "numpy" and record.fell_back_from == ()


def test_the_record_is_stored_and_report_shows_it(scenario_drill: DrillResult,
                                                  store_path: Path) -> None:
    with chunkstore.open(store_path) as store:
        assert scenario_drill.drill_id in set(store.objects.ids(DRILLS))
        stored = DrillRecord.decode(store.objects.get(DRILLS, scenario_drill.drill_id or ""))
        assert stored == DrillRecord.decode(scenario_drill.record.encode())
        assert stored.version == scenario_drill.record.version
    outcome = CliRunner().invoke(cli, ["report", str(store_path)])
    assert outcome.exit_code == 0, outcome.output
    text = outcome.output.split("last successful drill, per run:")[1]
    assert "exp" in text and (scenario_drill.record.version or "")[:12] in text
    assert "ago" in text and "missing-chunk" in text
    doc = json.loads(CliRunner().invoke(cli, ["report", str(store_path), "--json"]).output)
    (summary,) = doc["drills"]
    assert summary["run"] == "exp" and summary["drill_id"] == scenario_drill.drill_id
    assert summary["recovery_seconds"] == pytest.approx(scenario_drill.record.recovery_seconds,
                                                        abs=1e-3)


def test_then_times_the_command_until_it_is_ready(store_path: Path, tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    seen = tmp_path / "seen.json"
    script.write_text(
        "import json, os, sys, time\n"
        f"json.dump({{k: v for k, v in os.environ.items() if k.startswith('CHUNKSTORE_DRILL')}},"
        f" open({str(seen)!r}, 'w'))\n"
        "time.sleep(0.2)\n"
        f"print({READY_LINE!r}, flush=True)\n"
        "time.sleep(60)\n")  # stopped by the drill once ready
    with chunkstore.open(store_path) as store:
        result = drill(store, "exp@2", then=f"{sys.executable} {script}", materialize="numpy",
                       opener=chunkstore.open, record=False)
        failing = drill(store, then="exit 3", materialize="numpy", opener=chunkstore.open,
                        record=False)
    first = result.record.phases["first_update"]
    assert result.ok and first is not None and 0.2 <= first < 20
    assert result.record.recovery_seconds >= first and result.then_detail == f"printed {READY_LINE}"
    env = json.loads(seen.read_text())
    assert env["CHUNKSTORE_DRILL_VERSION"] == result.record.version
    assert (env["CHUNKSTORE_DRILL_RUN"], env["CHUNKSTORE_DRILL_STEP"]) == ("exp", "2")
    assert env["CHUNKSTORE_DRILL_STORE"] == str(store_path)
    assert not failing.ok and failing.record.restored and "exited 3" in str(failing.then_detail)


def test_json_output_of_the_command(store_path: Path) -> None:
    outcome = CliRunner().invoke(cli, ["drill", str(store_path), "exp@1", "--json",
                                       "--materialize", "numpy", "--no-record"])
    assert outcome.exit_code == 0, outcome.output
    doc = json.loads(outcome.output)
    assert doc["ok"] and doc["step"] == 1 and doc["drill_id"] is None
    assert set(doc["phases"]) == set(PHASES) and doc["bytes_downloaded"] > 0
    assert doc["restore"]["attempts"] == [] and doc["format_version"] == 1
    text = CliRunner().invoke(cli, ["drill", str(store_path), "--materialize", "numpy",
                                    "--no-record"]).output
    assert "restored" in text and "download" in text and "GB/s" in text


def test_bad_input_is_a_typed_error_that_changes_nothing(store_path: Path,
                                                         tmp_path: Path) -> None:
    before = _files(store_path)
    missing = tmp_path / "nothing-here"
    for args in (["drill", str(missing)], ["drill", str(store_path), "exp@99"],
                 ["drill", str(store_path), "--scenario", "flood"]):
        outcome = CliRunner().invoke(cli, args)
        assert outcome.exit_code == 2, (args, outcome.output)
    assert not missing.exists() and _files(store_path) == before
    with pytest.raises(NoStoreError):
        chunkstore.open(missing)
    with chunkstore.open(store_path) as store:
        with pytest.raises(SelectorError):
            drill(store, "nope", opener=chunkstore.open)
        with pytest.raises(InvalidInputError, match="unknown drill scenario"):
            drill(store, scenarios=("flood",), opener=chunkstore.open)
    assert _files(store_path) == before


@pytest.mark.skipif(os.environ.get("CHUNKSTORE_SKIP_TORCH") == "1", reason="torch skipped")
def test_torch_tensors_when_torch_bridge_is_importable(store_path: Path) -> None:
    pytest.importorskip("torch")
    with chunkstore.open(store_path) as store:
        result = drill(store, "exp@3", materialize="torch", opener=chunkstore.open,
                       record=False)
    assert result.ok and result.record.materialized_as == "torch"


# --- a target that fails is a failed drill, whatever the fallback restored ------------------


def _truncate_newest_pack(path: Path) -> None:
    """Cut in half a stored object only the newest version (exp@3) reads (its pack)."""
    with chunkstore.open(path) as store:
        newest = stored_objects(store, VersionReader(store, store.resolve("exp@3")))
        older = stored_objects(store, VersionReader(store, store.resolve("exp@2")))
        victim = min(newest - older, key=lambda d: d.raw)
        data = store.objects.get(CHUNKS, victim)
        store.objects.put(CHUNKS, victim, data[:len(data) // 2])


def test_a_refused_target_fails_the_drill_even_when_the_fallback_restores(
        tmp_path: Path) -> None:
    """Issue 46 item 9: the newest version's pack truncated; the restore falls back to
    exp@2, and the drill says it failed (exit 5, naming the repair), records it as
    failed with what the fallback restored and how long it took, and report agrees
    with verify instead of listing it as the last successful drill."""
    path = tmp_path / "store"
    _save(path, (1, 2, 3))
    _truncate_newest_pack(path)
    runner = CliRunner()
    outcome = runner.invoke(cli, ["drill", str(path), "--materialize", "numpy"])
    assert outcome.exit_code == EXIT_TARGET_FAILED == 5, outcome.output
    assert "FAILED: the target exp@3" in outcome.output
    assert "CorruptChunkError" in outcome.output and "fell back to" in outcome.output
    assert f"chunkstore repair {path} --from OTHER exp@3" in outcome.output
    assert runner.invoke(cli, ["verify", str(path)]).exit_code == 1
    with chunkstore.open(path) as store:
        (drill_id,) = store.objects.ids(DRILLS)
        record = DrillRecord.decode(store.objects.get(DRILLS, drill_id))
        target, fallback = store.resolve("exp@3"), store.resolve("exp@2")
    assert not record.ok and record.restored and record.target_failed
    assert (record.target, record.target_run, record.target_step) == (target.id, "exp", 3)
    assert (record.version, record.step) == (fallback.id, 2)
    assert record.error == "CorruptChunkError" and target.id in record.fell_back_from
    assert 0 < record.recovery_seconds < 60
    report = runner.invoke(cli, ["report", str(path)])
    assert report.exit_code == 0, report.output
    assert "last successful drill, per run" not in report.output
    failed = report.output.split("FAILED drills")[1]
    assert "exp@3" in failed and "CorruptChunkError" in failed and "exp@2 in" in failed
    doc = json.loads(runner.invoke(cli, ["report", str(path), "--json"]).output)
    assert doc["drills"] == []
    (summary,) = doc["failed_drills"]
    assert (summary["drill_id"], summary["target"], summary["target_failed"]) == (
        drill_id, target.id, True)
    assert (summary["restored"], summary["restored_step"]) == (fallback.id, 2)
    assert summary["recovery_seconds"] == pytest.approx(record.recovery_seconds, abs=1e-3)
    as_json = runner.invoke(cli, ["drill", str(path), "--materialize", "numpy", "--json",
                                  "--no-record"])
    assert as_json.exit_code == 5, as_json.output
    drilled = json.loads(as_json.output)
    assert not drilled["ok"] and drilled["target"] == target.id
    assert drilled["version"] == fallback.id and drilled["repair"].endswith(
        "--from OTHER exp@3")


def test_a_success_after_failures_clears_them_from_report(tmp_path: Path) -> None:
    """report shows a run's failures since its last successful drill, not before it."""
    path = tmp_path / "store"
    _save(path, (1, 2, 3))
    with chunkstore.open(path) as store:
        failing = drill(store, then="exit 3", materialize="numpy", opener=chunkstore.open,
                        clock=lambda: 1000.0)
        passing = drill(store, materialize="numpy", opener=chunkstore.open,
                        clock=lambda: 2000.0)
        late = drill(store, then="exit 4", materialize="numpy", opener=chunkstore.open,
                     clock=lambda: 3000.0)
        stats = store_stats(store)
    assert not failing.ok and passing.ok and not late.ok
    assert not late.record.target_failed and late.repair is None
    (ok,) = stats.drills
    (failed,) = stats.failed_drills
    assert ok.drill_id == passing.drill_id
    assert (failed.drill_id, failed.failures) == (late.drill_id, 1)
    assert failed.reason == "--then command not ready"


# --- bad input: typed errors that change nothing --------------------------------------------


@pytest.mark.parametrize(("option", "value"), [
    ("timeout", -5), ("timeout", 0), ("timeout", "x"), ("timeout", float("nan")),
    ("timeout", float("inf")), ("then_timeout", -1), ("then_timeout", "soon")])
def test_bad_timeouts_are_typed_errors_that_change_nothing(
        store_path: Path, option: str, value: object) -> None:
    before = _files(store_path)
    with chunkstore.open(store_path) as store:
        drills = set(store.objects.ids(DRILLS))
        with pytest.raises(InvalidSettingError, match="timeout"):
            drill(store, then="true", materialize="numpy", opener=chunkstore.open,
                  **{option: value})  # type: ignore[arg-type]
        assert set(store.objects.ids(DRILLS)) == drills
    assert _files(store_path) == before


def test_a_bad_then_timeout_on_the_command_line_exits_2(store_path: Path) -> None:
    before = _files(store_path)
    outcome = CliRunner().invoke(cli, ["drill", str(store_path), "--then", "true",
                                       "--then-timeout", "0"])
    assert outcome.exit_code == 2, outcome.output
    assert _files(store_path) == before


_DEEP = b"[" * 100_000 + b"]" * 100_000


@pytest.mark.parametrize(("name", "mutate"), [
    ("step Infinity", lambda text: text.replace(b'"step":3', b'"step":Infinity')),
    ("step 1e999", lambda text: text.replace(b'"step":3', b'"step":1e999')),
    ("step 1.5", lambda text: text.replace(b'"step":3', b'"step":1.5')),
    ("time NaN", lambda text: text.replace(b'"time":', b'"time":NaN,"x":')),
    ("nested 100,000 deep", lambda text: text.replace(b'"error":null', b'"error":' + _DEEP)),
    ("phases nested", lambda text: text.replace(b'"phases":{', b'"phases":{"x":' + _DEEP
                                                + b',')),
    ("too large", lambda text: text.replace(b'"error":null',
                                            b'"error":"' + b"x" * (2 << 20) + b'"')),
    ("not JSON", lambda text: text[:10]),
])
def test_a_crafted_drill_record_is_skipped_with_a_warning(
        tmp_path: Path, name: str, mutate: Callable[[bytes], bytes]) -> None:
    path = tmp_path / "store"
    _save(path, (1, 2, 3))
    with chunkstore.open(path) as store:
        good = drill(store, materialize="numpy", opener=chunkstore.open)
        crafted = mutate(good.record.encode())
        assert crafted != good.record.encode(), name
        with pytest.raises(ValueError, match=r"."):
            DrillRecord.decode(crafted)
        store.objects.put(DRILLS, "29990101T000000Z-00000000", crafted)
    for args in (["report", str(path)], ["report", str(path), "--json"]):
        outcome = CliRunner().invoke(cli, args)
        assert outcome.exit_code == 0, (name, outcome.output, outcome.exception)
        assert "warning: drill record drills/29990101T000000Z-00000000 skipped" in (
            outcome.stderr)
    doc = json.loads(CliRunner().invoke(cli, ["report", str(path), "--json"]).stdout)
    assert [d["drill_id"] for d in doc["drills"]] == [good.drill_id]
    (warning,) = doc["drill_warnings"]
    assert "29990101T000000Z-00000000" in warning
