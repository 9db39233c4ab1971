"""The benchmark suite's quick mode runs end to end and its figures make sense.

A smoke test so the suite never rots: it trains the six workloads at toy
size, replays them into every system and checks the results' schema and the
storage amplification each system must show by construction.  The quick mode
runs in one process (a few seconds of it importing torch), on a memory-backed
file system where there is one: the smoke test checks what is stored, not how
fast the disk stores it.  That process starts in the background with the test
session (tests/quick_suite.py), and this module's tests run last.
"""

from __future__ import annotations

import itertools
import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from chunkstore.objects.crypto import SEGMENT_OVERHEAD
from tests.quick_suite import QuickSuiteRun

REPO = Path(__file__).resolve().parent.parent
WORKLOADS = {"dense", "frozen", "lora", "sparse-embedding", "sweep", "mixed-precision"}
SYSTEM_PREFIXES = ("torch.save", "safetensors", "dcp", "chunkstore")
KEYS = {"workload": str, "system": str, "versions": int, "logical_bytes": int,
        "physical_bytes": int, "amplification": float, "save_s": float, "pause_s": float,
        "restore_s": float, "peak_rss_bytes": int}
pytestmark = [pytest.mark.slow, pytest.mark.slow_job, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def quick_suite_results(quick_suite_run: QuickSuiteRun | None) -> Path:
    """The results folder of ``benchmarks.suite --quick``, once it has ended well."""
    assert quick_suite_run is not None  # started: this fixture is among the selected tests'
    return quick_suite_run.results()


@pytest.fixture(scope="module")
def records(quick_suite_results: Path) -> list[dict[str, Any]]:
    loaded: list[dict[str, Any]] = json.loads((quick_suite_results / "latest.json").read_text())
    return loaded


def _record(records: list[dict[str, Any]], workload: str, system: str) -> dict[str, Any]:
    (found,) = [r for r in records if r["workload"] == workload and r["system"] == system]
    return found


def test_schema(records: list[dict[str, Any]]) -> None:
    assert isinstance(records, list)
    assert {r["workload"] for r in records} == WORKLOADS
    systems = {r["system"] for r in records}
    assert all(s.startswith(SYSTEM_PREFIXES) for s in systems)
    assert {"torch.save", "safetensors", "dcp", "chunkstore-none", "chunkstore-auto",
            "chunkstore-auto-enc"} <= systems
    assert len(records) == len(WORKLOADS) * len(systems)  # every workload x system, once
    for record in records:
        for key, kind in KEYS.items():
            assert isinstance(record[key], kind), (key, record[key])
        for key in ("save_s", "pause_s", "restore_s", "peak_rss_bytes", "logical_bytes"):
            assert record[key] > 0, (key, record)
        assert record["amplification"] == pytest.approx(
            record["physical_bytes"] / record["logical_bytes"])
        assert record["restore_verified"], record
        assert len(record["cumulative_bytes"]) == record["versions"] >= 5


def test_amplification_is_sane(records: list[dict[str, Any]]) -> None:
    for workload in WORKLOADS:
        for system in ("torch.save", "safetensors"):
            r = _record(records, workload, system)
            # a full copy per version, plus a little framing
            assert r["versions"] <= r["amplification"] <= 1.4 * r["versions"], r
    for workload in ("frozen", "lora", "sweep"):
        torch_save = _record(records, workload, "torch.save")["amplification"]
        for system in ("chunkstore-none", "chunkstore-auto"):
            r = _record(records, workload, system)
            assert r["amplification"] < 0.75 * torch_save, r
        assert _record(records, workload, "chunkstore-none")["amplification"] > 1
    lora = _record(records, "lora", "chunkstore-none")["amplification"]
    assert lora < _record(records, "frozen", "chunkstore-none")["amplification"]
    for workload in ("dense", "mixed-precision"):  # everything changes: dedup alone saves nothing
        r = _record(records, workload, "chunkstore-none")
        assert r["amplification"] >= 0.95 * r["versions"], r
    # Encryption adds 28 bytes per 64 KiB segment of each object and, each pack member being
    # sealed on its own (store version 13), 64 per member (its own last segment, its entry
    # in its pack's index): 0.06-0.35% of stored bytes in the full suite, up to 2.5% in
    # these tiny states (lora's members average under 3 KB here).
    for workload in WORKLOADS:
        plain = _record(records, workload, "chunkstore-auto")["cumulative_bytes"]
        sealed = _record(records, workload, "chunkstore-auto-enc")
        for before, after, objects in zip(plain, sealed["cumulative_bytes"],
                                          sealed["cumulative_objects"], strict=True):
            segments = SEGMENT_OVERHEAD * (objects + after // (64 << 10))
            assert before < after <= before + segments + before // 40, (
                workload, plain, sealed["cumulative_bytes"])


def test_reports_and_plots(quick_suite_results: Path) -> None:
    results = quick_suite_results
    markdown = (results / "latest.md").read_text()
    assert "| workload |" in markdown
    for workload in WORKLOADS:
        assert f"| {workload} |" in markdown
    run = json.loads((results / "run.json").read_text())
    assert run["mode"] == "quick" and set(run["workloads"]) == WORKLOADS
    for name in ("stored_bytes.png", "throughput.png"):
        assert (results / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for name in ("core.json", "pause.json"):
        assert json.loads((results / name).read_text())


def test_the_sharded_dcp_benchmark_reports_per_rank(quick_suite_results: Path) -> None:
    """bench_dcp at smoke size: DCP's FileSystemWriter and ChunkStoreWriter at world
    sizes 1 and 2, bytes in total and per rank, times, and the ratios to the targets."""
    report = json.loads((quick_suite_results / "dcp.json").read_text())
    assert report["versions"] == 3 and report["worlds"] == [1, 2]
    assert {(r["system"], r["world"]) for r in report["results"]} == {
        (system, world) for system in ("dcp-filesystem", "chunkstore") for world in (1, 2)}
    for r in report["results"]:
        assert len(r["per_rank_bytes"]) == r["world"] and all(r["per_rank_bytes"]), r
        assert sum(r["per_rank_bytes"]) + r["metadata_bytes"] == r["stored_bytes"], r
        assert r["metadata_bytes"] > 0 and len(r["saves_s"]) == 2, r
        for key in ("save_s_median", "async_pause_s", "load_s"):
            assert r[key] > 0, (key, r)
        # load_s: the median of the timed loads, each its slowest rank's time
        assert len(r["load_s_all"]) == report["loads"] == 2
        assert r["load_s"] == statistics.median(r["load_s_all"])
    for world in ("1", "2"):
        ratios = report["chunkstore_over_dcp"][world]
        # the frozen base is stored once: well under DCP's three full copies
        assert ratios["stored"] < 0.5 and ratios["meets_target"]["stored"], ratios
        assert ratios["save_time"] > 0 and set(ratios["meets_target"]) == set(report["targets"])


def test_the_restore_references_hold_chunkstore_to_its_targets(
        quick_suite_results: Path, records: list[dict[str, Any]]) -> None:
    """The checked read and the copy+hash floor restore every workload (bit for bit, in
    the run beside the systems), stay out of latest.json and its storage and save
    tables, and restore_floors.json and latest.md give each target's ratio per workload."""
    floors = json.loads((quick_suite_results / "restore_floors.json").read_text())
    references = floors["references"]
    assert {(r["workload"], r["system"]) for r in references} == {
        (w, name) for w in WORKLOADS for name in ("checked-read", "copy-hash-floor")}
    for r in references:
        assert r["restore_verified"] and r["restore_s"] > 0 and r["restore_cpu_s"] > 0, r
    times = {(r["workload"], r["system"]): r["restore_s"] for r in [*records, *references]}
    assert [t["at_most"] for t in floors["targets"]] == [1.0, 1.2]
    assert set(floors["workloads"]) == WORKLOADS
    for workload, rows in floors["workloads"].items():
        for target in floors["targets"]:
            row = rows[f"{target['system']}/{target['reference']}"]
            assert row["ratio"] == pytest.approx(times[workload, target["system"]]
                                                 / times[workload, target["reference"]])
            assert row["meets_target"] == (row["ratio"] <= target["at_most"])
    markdown = (quick_suite_results / "latest.md").read_text()
    section = markdown.split("## Restore against its floors", 1)[1].split("\n## ", 1)[0]
    assert all(f"| {workload} |" in section for workload in WORKLOADS)
    assert "Targets: chunkstore-auto's restore at most 1.0x checked-read's: " in section
    before = markdown.split("## Restore against its floors", 1)[0]
    assert "checked-read" not in before and "copy-hash-floor" not in before


def test_the_restore_table_names_every_miss_with_its_figure(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(REPO))
    from benchmarks import summarize

    def record(workload: str, system: str, seconds: float) -> dict[str, Any]:
        return {"workload": workload, "system": system, "restore_s": seconds,
                "restore_cpu_s": seconds, "reference": system in ("checked-read",
                                                                  "copy-hash-floor"),
                "how": "by hand"}

    found = [record(w, s, t) for w, times in (("dense", (0.011, 0.010, 0.012, 0.010)),
                                             ("lora", (0.009, 0.010, 0.013, 0.010)))
             for s, t in zip(("chunkstore-auto", "checked-read", "chunkstore-none",
                              "copy-hash-floor"), times, strict=True)]
    doc = summarize.restore_floors(found, "c")
    lines = summarize.restore_floor_table(doc)
    assert "| dense | 11.0 ms (CPU 11) | 10.0 ms (CPU 10) | 1.10x (over) | 12.0 ms (CPU 12)" \
           " | 10.0 ms (CPU 10) | 1.20x |" in lines
    assert lines[-1] == ("Targets: chunkstore-auto's restore at most 1.0x checked-read's:"
                         " missed on dense (1.10x); chunkstore-none's restore at most 1.2x"
                         " copy-hash-floor's: missed on lora (1.30x).")


@pytest.mark.parametrize("name", ["checked-read", "copy-hash-floor"])
def test_a_restore_reference_checks_every_byte(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """A reference restores a state whose tensors cross its pieces and steps (1,100 tiny
    tensors in one step: more than one preadv's vectors) bit for bit, and a byte flipped
    in its file is a ChecksumMismatch, not a restore."""
    monkeypatch.syspath_prepend(str(REPO))
    import torch

    from benchmarks.systems import ChecksumMismatch, open_reference
    from benchmarks.trace import TraceVersion, empty_like_tree, flatten

    generator = torch.Generator().manual_seed(0)
    state = {"model": {"big": torch.randn(1_100_000, generator=generator),
                       "half": torch.randn(3000, generator=generator).to(torch.bfloat16)},
             "optimizer": {f"s{i}": torch.tensor([float(i)]) for i in range(1100)}}
    version = TraceVersion(0, "r", 0, 0, 0)
    reference = open_reference(name, tmp_path)
    try:
        reference.save(version, state)
        target = reference.restore(version, empty_like_tree(state))
        assert all(torch.equal(flatten(target)[key], tensor)
                   for key, tensor in flatten(state).items())
        path = reference.path(version)
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 1  # inside the big tensor's bytes, in either file
        path.write_bytes(bytes(data))
        with pytest.raises(ChecksumMismatch):
            reference.restore(version, empty_like_tree(state))
    finally:
        reference.close()


def test_workers_taking_turns_measure_every_system(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The full mode's workers (one process per system, timed steps in turns) return
    every system's record, a worker has exited before the next one's turn (its exit
    once ran beside every chunkstore system's last async pause, which took 100-490 ms
    instead of 7-20), and a worker that fails stops the run with its error."""
    monkeypatch.syspath_prepend(str(REPO))
    from benchmarks import suite
    from benchmarks.workloads import QUICK

    done_and_exited = []
    read_until_ready = suite._Worker.until_ready

    def until_ready(worker: Any) -> bool:
        wants_a_turn = read_until_ready(worker)
        if not wants_a_turn:
            done_and_exited.append((worker.system, worker.process.poll() is not None))
        return wants_a_turn

    monkeypatch.setattr(suite._Worker, "until_ready", until_ready)
    trace = tmp_path / "trace"
    suite.record_trace("lora", QUICK, trace)
    records = suite.run_systems(trace, tmp_path / "work", ["torch.save", "chunkstore-auto"],
                                repeat=1, in_process=False)
    assert [r["system"] for r in records] == ["torch.save", "chunkstore-auto"]
    assert sorted(done_and_exited) == [("chunkstore-auto", True), ("torch.save", True)]
    for record in records:
        assert len(record["save_times_s"]) == record["versions"]
        assert record["restore_verified"]
    spans = sorted((start, end, record["system"]) for record in records
                   for start, end in record["save_spans"])
    assert all(end <= following[0] for (_, end, _), following in itertools.pairwise(spans))
    runs = [len(list(same)) for _, same in itertools.groupby(s for _, _, s in spans)]
    assert max(runs) <= 2  # in turns, round-robin from a different system each round
    with pytest.raises(RuntimeError, match="KeyError: 'no-such-system'"):
        suite.run_systems(trace, tmp_path / "work2", ["torch.save", "no-such-system"],
                          repeat=1, in_process=False)


def test_the_collector_benchmark_compares_both_ways(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(REPO))
    import torch

    from benchmarks import bench_collector

    states = [{"model": {"w": torch.full((64, 64), float(i))}} for i in range(3)]
    result = bench_collector.compare("tiny", states, rounds=1, work=tmp_path)
    assert set(result) == {"paused", "running"}
    for way in result.values():
        assert way["saves"] == 2
        assert way["save_total_s"] > 0 and way["restore_total_s"] > 0


def test_the_small_saves_benchmark_compares_three_ways(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(REPO))
    import torch

    from benchmarks import bench_small_saves

    states = [{"model": {f"b{j}": torch.full((16,), float(i + j)) for j in range(40)}}
              for i in range(3)]
    result = bench_small_saves.compare("tiny", states, rounds=1, work=tmp_path)
    assert set(result) == {"safetensors", "shared", "caller-alone"}
    for way in result.values():
        assert way["saves"] == 2 and way["save_median_s"] > 0
    assert result["safetensors"]["vs_safetensors"] == 1.0


def test_the_delta_saves_benchmark_compares_three_ways(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(REPO))
    import torch

    from benchmarks import bench_delta_saves

    generator = torch.Generator().manual_seed(0)
    table = torch.randn(2048, 64, generator=generator)  # over 128 KiB: not packed
    states = []
    for _ in range(4):
        states.append({"model": {"emb": table.clone()}})
        table[torch.randint(0, 2048, (8,), generator=generator)] += 0.5
    result = bench_delta_saves.compare("tiny", states, work=tmp_path)
    assert set(result) == {"auto", "chains", "chains-read-back"}
    for way in result.values():
        assert way["saves"] == 3 and way["save_median_s"] > 0 and way["stored_bytes"] > 0
    assert result["auto"]["vs_auto"] == 1.0
    # The same deltas whether bases come from copies or from the store.
    assert result["chains"]["stored_bytes"] == result["chains-read-back"]["stored_bytes"]
    assert result["chains"]["stored_bytes"] < result["auto"]["stored_bytes"]


@pytest.mark.parametrize("config", ["auto", "auto-d0"])
def test_chunkstore_physical_bytes_are_what_stats_counts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, config: str) -> None:
    """The suite reads a store's bytes off its directory; they are store.stats()'s
    physical bytes (chunk and node objects, packs, deltas and garbage included)."""
    monkeypatch.syspath_prepend(str(REPO))
    import torch

    from benchmarks.systems import Chunkstore
    from benchmarks.trace import TraceVersion

    system = Chunkstore(tmp_path / "s", config)
    try:
        table = torch.arange(300_000, dtype=torch.float32)
        for step in range(3):
            table[step::7] += 1
            small = {f"b{i}": torch.full((50,), float(step + i)) for i in range(30)}
            system.save(TraceVersion(step, "r", step, 0, 0), {"model": {"t": table, **small}})
        system.store.delete("r@1")  # garbage, counted until GC deletes it
        assert system.physical_bytes() == system.store.stats().physical_bytes > 0
    finally:
        system.close()


@pytest.fixture
def bench_memory(monkeypatch: pytest.MonkeyPatch) -> Any:
    """benchmarks.bench_memory, where this process's peak RSS can be reset (else skip)."""
    monkeypatch.syspath_prepend(str(REPO))
    from benchmarks import bench_memory

    try:
        bench_memory.reset_peak()
    except OSError as exc:  # not Linux, or not allowed
        pytest.skip(f"/proc/self/clear_refs: {exc}")
    return bench_memory


def test_the_memory_benchmark_counts_the_base_copies_apart(
        tmp_path: Path, bench_memory: Any) -> None:
    # 512 KiB tensors: larger than what a store with delta chains packs whole
    kept = bench_memory.measure(32, bench_memory.WAYS["default"], 3, tmp_path)
    off = bench_memory.measure(32, 0, 3, tmp_path)
    assert kept["state_bytes"] == off["state_bytes"] == 32 << 20
    for result in (kept, off):
        assert [r["save"] for r in result["saves"]] == [0, 1, 2]
        for row in result["saves"]:
            assert row["seconds"] > 0
            assert row["working_bytes"] == row["peak_over_baseline_bytes"] - row["copies_bytes"]
    # A first save copies nothing; the run's later saves on the handle copy what changed
    # (every chunk), and a budget of 0 copies nothing at all.
    assert kept["saves"][0]["copies_bytes"] == 0
    assert kept["saves"][2]["copies_bytes"] >= 32 << 20
    assert all(row["copies_bytes"] == 0 for row in off["saves"])


def test_the_memory_table_measures_every_operation_and_names_each_miss(
        tmp_path: Path, bench_memory: Any) -> None:
    from benchmarks import bench_memory_table, summarize

    row: dict[str, Any] = {"system": "chunkstore-auto", "mib": 12}
    for operation in bench_memory_table.OPERATIONS:
        row[operation] = bench_memory_table.measure(operation, "chunkstore-auto", 12, 3, tmp_path)
    state = row["state_bytes"] = row["sync"]["state_bytes"]
    assert state == (12 << 20) + 4  # one layer: its weight, two moments and a step
    sync, asynchronous, live, fresh = (row[k] for k in ("sync", "async", "live", "fresh"))
    assert [s["working_bytes"] for s in sync["saves"]] == [
        s["peak_bytes"] - s["copies_bytes"] for s in sync["saves"]]
    assert sync["copies_bytes"] >= 4 << 20  # the second save kept the chunks it wrote
    assert asynchronous["staging_bytes"] == state
    assert asynchronous["working_bytes"] == (asynchronous["peak_bytes"] - state
                                             - asynchronous["copies_bytes"])
    # the live state was made anew (other values): only a restore that read makes it match
    assert live["verified"] and fresh["verified"]
    assert live["extra_bytes"] == live["peak_bytes"]
    assert fresh["extra_bytes"] == fresh["peak_bytes"] - state
    assert bench_memory_table.measure("async", "torch.save", 12, 3, tmp_path) is None

    doc = {"command": "c", "saves": 3, "rows": [row],
           "targets": {"restore_share": 1 / 8, "working_bytes": 256 << 20}}
    live["extra_bytes"] = state // 8 + (1 << 20)  # one MiB over its target
    lines = summarize.memory_table(doc)
    assert any(line.startswith("- chunkstore-auto at 12.0 MiB, restore into live tensors: 2.5"
                               " MiB against 1.5 MiB, 1.0 MiB over (sampled peaks: anonymous")
               for line in lines)
    assert sum(line.startswith("- ") for line in lines) == sum(
        got > bound for got, bound in (
            (live["extra_bytes"], state / 8), (fresh["extra_bytes"], state / 8),
            (sync["working_bytes"], 256 << 20), (asynchronous["working_bytes"], 256 << 20)))
