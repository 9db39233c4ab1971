"""The Checkpointer under torch.distributed: real gloo ranks, real stores, real SIGKILL.

The ranks are ``torch.multiprocessing`` forkserver processes on 127.0.0.1 running
jobs of :mod:`tests.ranks_child`; each writes its findings to a file the test
reads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from click.testing import CliRunner
from safetensors.torch import load_file

import chunkstore
from chunkstore.cli import cli
from tests.gloo_ranks import Ranks, all_ok, assert_only_the_first_save_published
from tests.ranks_child import ROWS, RUN, run_rank
from torch_bridge import Checkpointer, export_safetensors
from torch_bridge.errors import WorldSizeMismatchError

WORLD = 2


def _ranks(job: str, url: str, out: Path, extra: dict[str, Any] | None = None) -> Ranks:
    return Ranks("tests.ranks_child", run_rank, job, url, out, extra, WORLD)


@pytest.fixture
def store_url(tmp_path: Path) -> str:
    url = str(tmp_path / "store")
    chunkstore.open(url, chunk_size=4096, create=True).close()
    return url


def test_kill_and_resume_at_world_size_2_is_bit_exact(store_url: str, tmp_path: Path
                                                      ) -> None:
    plan = {"steps": 16, "save_every": 4}
    reference_url = str(tmp_path / "reference")
    chunkstore.open(reference_url, chunk_size=4096, create=True).close()
    # The uninterrupted run and the run to kill run side by side (two process groups).
    uninterrupted = _ranks("train", reference_url, tmp_path / "reference-run", plan)
    killed = _ranks("train", store_url, tmp_path / "killed", {**plan, "hang_after": 10})
    killed.wait_for("ready")  # step 8 is saved; steps 9 and 10 are not
    assert killed.kill() == [-9, -9], "the ranks were not SIGKILLed"
    expected = [r["fingerprint"] for r in all_ok(uninterrupted.join())]
    with chunkstore.open(store_url, create=True) as store:
        saved = [v.step for v in store.versions(RUN)]
        assert saved[:2] == [4, 8], saved
        result = store.verify()
        assert result.ok, result.problems
    # show names the rank that wrote each shard: the table's row blocks, one per rank.
    shown = CliRunner().invoke(cli, ["show", store_url, f"{RUN}@8", "--json"],
                               catch_exceptions=False)
    assert shown.exit_code == 0, shown.output
    doc = json.loads(shown.output)
    assert [r["rank"] for r in doc["ranks"]] == [0, 1]
    table = next(e for e in doc["entries"] if e["name"].startswith("table."))
    assert [s["rank"] for s in table["shards"]] == [0, 1]

    resumed = all_ok(_ranks("train", store_url, tmp_path / "resumed",
                            {**plan, "resume": True}).join())
    assert {r["start"] for r in resumed} == {saved[-1]}, "the ranks resumed different steps"
    for rank, report in enumerate(resumed):
        differ = [k for k, v in report["fingerprint"].items() if v != expected[rank][k]]
        assert not differ, f"rank {rank} differs from the uninterrupted run in {differ}"


def test_ranks_at_different_steps_are_refused_and_nothing_is_published(
        store_url: str, tmp_path: Path) -> None:
    reports = _ranks("mismatched_steps", store_url, tmp_path / "steps").join()
    for report in reports:
        assert report is not None and not report["ok"]
        assert report["type"] == "RanksDisagreeError", report["error"]
        assert "ranks [1] disagree with rank 0 on the step" in report["error"]
        assert "rank 0: 2" in report["error"] and "rank 1: 3" in report["error"]
    with chunkstore.open(store_url, create=True) as store:
        assert store.versions() == []
        assert not list(store.backend.list("sessions/"))


def test_a_rank_killed_mid_save_publishes_nothing(store_url: str, tmp_path: Path) -> None:
    out = tmp_path / "kill"
    reports = _ranks("killed_mid_save", store_url, out).join()
    assert (out / "rank1.staged").exists(), "rank 1 did not get to store its chunks"
    assert reports[1] is None, "rank 1 was not SIGKILLed"
    assert reports[0] is not None and not reports[0]["ok"], "rank 0's save did not fail"
    with chunkstore.open(store_url, create=True) as store:
        assert_only_the_first_save_published(store, RUN)


def test_restore_picks_the_same_version_on_every_rank(store_url: str, tmp_path: Path
                                                      ) -> None:
    reports = all_ok(_ranks("damaged_newest", store_url, tmp_path / "damaged").join())
    assert [r["restored"] for r in reports] == [1, 1], "every rank must fall back to step 1"
    assert not any(r["equals_step_2"] for r in reports)
    # Without a process group: the weights export whole; a restore is refused (per-rank
    # state restores rank for rank).
    export_safetensors(store_url, f"{RUN}@1", tmp_path / "w.safetensors", prefix="table.")
    table = load_file(tmp_path / "w.safetensors")["w"]
    assert table.shape == (ROWS * WORLD, 256) and bool(table.abs().sum() > 0)
    with Checkpointer(store_url, run=RUN) as ckpt, pytest.raises(
            WorldSizeMismatchError, match="saved by 2 rank"):
        ckpt.restore(table={})


def test_async_save_under_a_process_group_in_one_process(tmp_path: Path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}",
                            rank=0, world_size=1)
    try:
        with Checkpointer(str(tmp_path / "store"), run="one", async_save=True) as ckpt:
            weights = torch.ones(3)
            assert ckpt.save(1, state={"w": weights}) is None
            weights += 1  # training goes on: the save holds the values at save time
            info = ckpt.wait()
            assert info is not None and info.step == 1
            loaded: dict[str, Any] = {"w": torch.zeros(3)}
            assert ckpt.restore(state=loaded) == 1
            assert torch.equal(loaded["w"], torch.ones(3))
    finally:
        dist.destroy_process_group()


def test_async_saves_on_two_ranks_hold_what_sync_saves_hold(tmp_path: Path) -> None:
    """Each rank's state is copied in the pause and saved in the background on the
    checkpoint's own process group: every version equals the synchronous run's."""
    plan = {"steps": 12, "save_every": 4}
    urls = {name: str(tmp_path / name) for name in ("sync", "async")}
    for url in urls.values():
        chunkstore.open(url, chunk_size=4096, create=True).close()
    sync_run = _ranks("train", urls["sync"], tmp_path / "sync-run", plan)
    async_run = _ranks("train", urls["async"], tmp_path / "async-run", {**plan, "async": True})
    sync_prints = [r["fingerprint"] for r in all_ok(sync_run.join())]
    async_prints = [r["fingerprint"] for r in all_ok(async_run.join())]
    assert async_prints == sync_prints
    with chunkstore.open(urls["sync"]) as plain, chunkstore.open(urls["async"]) as background:
        assert [v.step for v in background.versions(RUN)] == [4, 8, 12]
        for step in (4, 8, 12):
            expected = plain.open_version(f"{RUN}@{step}")
            got = background.open_version(f"{RUN}@{step}")
            assert got.names() == expected.names()
            for name in expected.names():
                if name.startswith("_"):
                    continue
                assert got.get(name).tobytes() == expected.get(name).tobytes(), (step, name)


def test_a_fresh_node_s_ranks_resume_from_the_mirror(tmp_path: Path) -> None:
    """Two ranks save to a local tier mirrored to another store; a job restarted on a
    fresh node (an empty local tier) resumes every rank from the mirror, bit-exact."""
    mirror = str(tmp_path / "mirror")
    plan = {"steps": 12, "save_every": 4}
    reference_url = str(tmp_path / "reference")
    first_url, fresh_url = str(tmp_path / "first"), str(tmp_path / "fresh")
    for url in (reference_url, first_url):
        chunkstore.open(url, chunk_size=4096, create=True).close()
    reference = _ranks("train", reference_url, tmp_path / "reference-run", plan)
    first = _ranks("train", first_url, tmp_path / "first-run",
                   {"steps": 8, "save_every": 4, "mirror": mirror})
    expected = [r["fingerprint"] for r in all_ok(reference.join())]
    all_ok(first.join())  # closing waits for the mirror
    with chunkstore.open(mirror) as store:
        assert [v.step for v in store.versions(RUN)] == [4, 8]
    resumed = all_ok(_ranks("train", fresh_url, tmp_path / "resumed",
                            {**plan, "resume": True, "mirror": mirror}).join())
    assert [(r["start"], r["tier"]) for r in resumed] == [(8, "mirror")] * WORLD
    assert [r["fingerprint"] for r in resumed] == expected


@pytest.mark.parametrize("background", [False, True])
def test_a_failure_on_one_rank_raises_on_every_rank(store_url: str, tmp_path: Path,
                                                    background: bool) -> None:
    reports = _ranks("bad_metric_on_one_rank", store_url, tmp_path / "bad",
                     {"async": background}).join()
    assert [r["type"] for r in reports] == ["RanksFailedError", "InvalidInputError"], reports
    assert "rank 1" in reports[0]["error"] and "finite" in reports[1]["error"]
    with chunkstore.open(store_url) as store:
        assert store.versions() == []
