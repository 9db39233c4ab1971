"""benchmarks/bench_scale.py runs and writes what it promises, at a toy size (its speed
figures come from the full run, not from here): the levels built by real saves, each
mode's median and requests per save recorded under the label, beside other labels."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import s3fs

import chunkstore
from benchmarks import bench_scale, scale_removal


def test_the_scale_benchmark_records_each_level_and_mode_under_its_label(
        tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    out.write_text(json.dumps({"runs": {"before": {"kept": True}}}))
    bench_scale.main(["--label", "after", "--levels", "21", "24", "--saves", "4", "--count", "2",
                      "--block", "2", "--modes", "store", "dcp", "--no-removal",
                      "--stores", str(tmp_path / "stores"), "--out", str(out)])
    found = json.loads(out.read_text())
    assert found["runs"]["before"] == {"kept": True}
    run = found["runs"]["after"]["local"]
    assert set(run["levels"]) == {"21", "24"} and set(run["ratio_highest_to_lowest"]) == {
        "store", "dcp"}
    for level in ("21", "24"):
        for mode in ("store", "dcp"):
            result = run["levels"][level][mode]
            assert result["saves"] == 4 and result["median_ms"] > 0
            assert result["median_cpu_ms"] > 0 and len(result["block_medians_ms"]) == 2
            assert result["requests_per_save"]["put"] >= 2  # a pack or node, the record
    # Each block's ratio of the levels' medians (both levels' saves of a block side by side)
    for mode in ("store", "dcp"):
        blocks = run["block_ratios"][mode]
        assert len(blocks["blocks"]) == 2
        assert (blocks["min"], blocks["max"]) == (min(blocks["blocks"]), max(blocks["blocks"]))
        assert blocks["median"] == pytest.approx(sum(blocks["blocks"]) / 2, abs=1e-3)
        assert run["levels"]["24"][mode]["block_medians_ms"][0] / run["levels"]["21"][mode][
            "block_medians_ms"][0] == pytest.approx(blocks["blocks"][0], abs=1e-3)
        assert len(run["block_cpu_ratios"][mode]["blocks"]) == 2
    assert set(run["cpu_ratio_highest_to_lowest"]) == {"store", "dcp"}
    # Requests per save do not follow the history (they are counted, not timed), once
    # each of the 20 tensors has changed (each unchanged one is then in a pack of its own).
    assert run["levels"]["21"]["store"]["requests_per_save"] == \
        run["levels"]["24"]["store"]["requests_per_save"]
    with chunkstore.open(tmp_path / "stores" / "base-24") as store:
        assert [v.step for v in store.versions("r")] == list(range(24))


def test_the_removal_columns_record_prune_and_gcs_at_each_level(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--removal-only at a toy size: at each version level and object level an idle GC
    that deletes nothing, a prune (here of 20 versions, not 1,000) counted per version,
    and a GC after it that deletes what the pruned versions alone reached."""
    monkeypatch.setattr(scale_removal, "PRUNED", 20)
    monkeypatch.setattr(scale_removal, "OBJECT_LEVEL_RUN", 30)
    out = tmp_path / "scale.json"
    bench_scale.main(["--label", "removal", "--removal-only", "--levels", "40",
                      "--object-levels", "200", "--stores", str(tmp_path / "stores"),
                      "--out", str(out)])
    run = json.loads(out.read_text())["runs"]["removal"]
    assert "local" not in run  # the save columns were not asked for
    versions = run["removal"]["local"]["versions"]["40"]
    for found in (versions, run["removal"]["local"]["objects"]["200"]):
        timed = found["timed"]
        assert timed["idle_gc"]["deleted"] == 0
        assert timed["prune"]["removed"] == 20 and timed["prune"]["ms_per_version"] > 0
        assert timed["gc_after_prune"]["deleted"] > 0
        assert timed["gc_after_prune"]["tombstones_deleted"] == 20
    counted = versions["counted"]["prune"]
    # one bulk delete of the records, one of their signature objects (docs/format.md §14)
    assert counted["requests"]["delete_many"] == 2 and "delete" not in counted["requests"]
    assert counted["requests"]["put"] >= 20  # a tombstone each


def test_a_filled_moto_server_serves_the_store_as_an_upload_would(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """benchmarks/moto_filled.py at a toy size: the keys inserted straight into moto are
    counted by a listing over HTTP, the store verifies on them (each object read back
    whole through s3fs), and its page-walking listings equal moto's own, page by page,
    for the same files uploaded to a bucket of moto's own on the same server."""
    from benchmarks.moto_filled import filled_bucket
    from tests.s3server import _DUMMY_CREDENTIALS, create_bucket

    for name, value in _DUMMY_CREDENTIALS.items():  # a local moto server: never real keys
        monkeypatch.setenv(name, value)
    source = tmp_path / "store"
    with chunkstore.open(source, chunk_size=4096, compression="none", create=True) as store:
        for step in range(3):
            with store.new_version("r", step) as version:
                version.put("w", np.arange(2048 * (step + 1), dtype=np.uint64))
    files = bench_scale.store_files(source)
    with filled_bucket(source, sorted_listing=True) as (where, filled):
        assert filled["inserted"] == filled["listed"] == len(files)
        with where.open() as store:
            assert store.verify().ok and len(store.versions("r")) == 3
        fs = s3fs.S3FileSystem(**where.options)
        uploaded = create_bucket(where.options["client_kwargs"]["endpoint_url"])
        fs.put([str(path) for path in files],
               [f"{uploaded}/store/{path.relative_to(source).as_posix()}" for path in files])
        filled_name = where.url.removeprefix("s3://").split("/")[0]
        for query in ({"Prefix": "store/"}, {"Prefix": "store/", "Delimiter": "/"},
                      {"Prefix": "store/chunks/", "Delimiter": "/"},
                      {"Prefix": "store/c"}, {"Prefix": "store/", "StartAfter": "store/d"},
                      {"Prefix": "store/nodes/", "Delimiter": "/"}):
            assert _pages(fs, filled_name, query) == _pages(fs, uploaded, query), query
    assert filled["server_peak_rss_mib"] > 0


def _pages(fs: s3fs.S3FileSystem, bucket: str, query: dict[str, str]) -> list[list[str]]:
    """Every page of a listing 3 entries a page: the keys' names and folders."""
    pages, token = [], None
    while True:
        answer = fs.call_s3("list_objects_v2", Bucket=bucket, MaxKeys=3, **query,
                            **({"ContinuationToken": token} if token else {}))
        pages.append([item["Key"] for item in answer.get("Contents", [])]
                     + [item["Prefix"] for item in answer.get("CommonPrefixes", [])])
        if not answer["IsTruncated"]:
            return pages
        token = answer["NextContinuationToken"]
