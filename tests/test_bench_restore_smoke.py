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


def test_bench_resume_target_follows_the_chains_the_newest_version_reads(tmp_path: Path
                                                                          ) -> None:
    import numpy as np

    import chunkstore
    from benchmarks import bench_resume
    rng = np.random.default_rng(0)
    weights = rng.standard_normal(1 << 18).astype(np.float32)
    seen = []
    with chunkstore.open(tmp_path / "s", create=True) as store:
        for step in range(3):
            with store.new_version(run="r", step=step) as version:
                version.put("w", weights)
            seen.append(bench_resume.chains(tmp_path / "s"))
            weights = weights + np.float32(1e-4) * rng.standard_normal(weights.shape,
                                                                      dtype=np.float32)
    assert seen == [{"chunks": 1, "delta_chunks": 0, "links": 0},
                    {"chunks": 1, "delta_chunks": 1, "links": 1},
                    {"chunks": 1, "delta_chunks": 1, "links": 2}]
    plain = bench_resume.target(seen[0], 0.9)
    assert (plain["has_chains"], plain["at_most"], plain["met"]) == (False, 0.8, False)
    for chained in (bench_resume.target(seen[1], 0.9), bench_resume.target(seen[2], 0.9)):
        assert (chained["has_chains"], chained["at_most"], chained["met"]) == (True, 1.0, True)
