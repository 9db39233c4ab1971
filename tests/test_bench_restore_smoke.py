"""Smoke tests of the restore benchmarks' drivers at tiny sizes."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import bench_core, bench_restore


def test_bench_core_times_safetensors_in_the_same_rounds(tmp_path: Path) -> None:
    out = tmp_path / "core.json"
    bench_core.main(["--gib", "0.004", "--repeat", "1", "--out", str(out),
                     "--workdir", str(tmp_path)])
    result = json.loads(out.read_text())
    for key in ("torch", "safetensors", "chunkstore-none", "chunkstore-auto"):
        assert result[key]["load_gbps" if key in ("torch", "safetensors")
                           else "restore_gbps"] > 0
    assert result["chunkstore-auto"]["restore_time_vs_safetensors"] > 0


def test_bench_restore_ratios_are_of_medians() -> None:
    ours = {"wall": {"median": 1.0}, "cpu": {"median": 2.0, "min": 1.0}}
    theirs = {"wall": {"median": 2.0}, "cpu": {"median": 4.0, "min": 4.0}}
    assert bench_restore._ratios(ours, theirs) == {"wall": 0.5, "cpu": 0.5, "cpu_min": 0.25}
    assert bench_restore._ratios(ours, {"wall": {"median": 4.0}}) == {"wall": 0.25}
