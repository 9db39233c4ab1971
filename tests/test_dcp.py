"""torch.distributed.checkpoint through chunkstore: real stores, real gloo ranks, real SIGKILL.

The ranks are ``torch.multiprocessing`` spawn processes on 127.0.0.1 running
jobs of :mod:`tests.dcp_child`; each writes its findings to a file the test
reads.  Loads in this process use no process group (one process loading what
many ranks saved).
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

import chunkstore
from chunkstore.errors import (
    InvalidInputError,
    NotAStoreError,
    SelectorError,
    StagedChunkMissingError,
)
from chunkstore.format.manifest import TensorEntry
from tests.dcp_child import RUN, full_state, run_rank
from tests.gloo_ranks import Ranks, all_ok, assert_only_the_first_save_published
from tests.s3server import ENDPOINT_ENV_VAR, create_bucket, remove_bucket, storage_options
from torch_bridge import export_safetensors
from torch_bridge.dcp import ChunkStoreReader, ChunkStoreWriter
from torch_bridge.errors import NotACheckpointError

pytestmark = pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled:UserWarning")

CHUNK = 4096


def _spawn(job: str, world: int, url: str, out: Path, extra: dict[str, Any] | None = None
           ) -> tuple[list[dict[str, Any] | None], list[int | None]]:
    """Run ``job`` on ``world`` gloo ranks; each rank's report (None if it wrote none)
    and exit code."""
    ranks = Ranks("tests.dcp_child", run_rank, job, url, out, extra, world)
    return ranks.join(), ranks.exit_codes()


_all_ok = all_ok


def _load_here(store: chunkstore.Store | str, selector: str, step: int) -> None:
    """Load without a process group into plain tensors; bit-exact against the step's state."""
    expected = full_state(step)
    target: dict[str, Any] = {k: torch.full_like(v, 3.0) if isinstance(v, torch.Tensor) else None
                              for k, v in expected.items()}
    target["extra"] = {"lr": 0.0, "name": ""}
    dcp.load(target, storage_reader=ChunkStoreReader(store, selector))
    for name, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert target[name].dtype == value.dtype
            assert torch.equal(target[name].view(torch.uint8), value.view(torch.uint8)), name
        else:
            assert target[name] == value, name


@pytest.fixture
def store_url(tmp_path: Path) -> str:
    url = str(tmp_path / "store")
    chunkstore.open(url, chunk_size=CHUNK, create=True).close()
    return url


def test_save_twice_at_world_size_4_then_load_at_4_2_and_1(store_url: str, tmp_path: Path
                                                           ) -> None:
    reports = _all_ok(_spawn("save_twice_then_load", 4, store_url, tmp_path / "w4")[0])
    first, second = reports[0]["infos"]
    assert all(r["infos"] == [None, None] for r in reports[1:]), "only rank 0 publishes"
    # momentum is zeros: its 16 chunks on 4 ranks are one chunk (dedup across ranks)
    assert first["logical_bytes"] - first["new_bytes"] >= 15 * CHUNK
    # step 2 changed rank 0's box of w (16 KiB) and the small values: the rest dedups
    assert second["new_bytes"] < 16 * 1024 + 2 * CHUNK < first["new_bytes"] / 3
    with chunkstore.open(store_url, create=True) as store:
        version = store.open_version(f"{RUN}@2")
        w, bias = version.entry("w"), version.entry("bias")
        assert isinstance(w, TensorEntry) and isinstance(bias, TensorEntry)
        assert [s.offsets for s in w.shards] == [(0, 0), (16, 0), (32, 0), (48, 0)]
        assert len(bias.shards) == 1, "a replicated tensor is written once"
        assert np.array_equal(version.get("w"), full_state(2)["w"].numpy())
        result = store.verify()
        assert result.ok, result.problems
        export_safetensors(store, f"{RUN}@2", tmp_path / "w.safetensors", prefix="")
    exported = load_file(tmp_path / "w.safetensors")
    for name in ("w", "emb", "momentum", "bias"):  # assembled from the ranks' shards
        assert torch.equal(exported[name], full_state(2)[name]), name
    _all_ok(_spawn("load_latest", 2, store_url, tmp_path / "w2", {"step": 2})[0])
    _load_here(store_url, f"{RUN}@latest", 2)
    _load_here(store_url, f"{RUN}@1", 1)


def test_ranks_with_indexes_of_their_own_as_on_separate_machines(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    chunkstore.open(url, chunk_size=CHUNK, index_dir=str(tmp_path / "setup"), create=True).close()
    indexes = tmp_path / "indexes"
    reports = _all_ok(_spawn("save_twice_then_load", 2, url, tmp_path / "w2",
                             {"index_root": str(indexes)})[0])
    first, second = reports[0]["infos"]
    assert second["new_bytes"] < first["new_bytes"] / 3, "rank 1's index must dedup too"
    with chunkstore.open(url, index_dir=str(indexes / "rank1"), create=True) as store:
        store.gc(grace=0)  # a GC on a machine that did not publish the versions
    for index in (indexes / "rank0", indexes / "rank1", tmp_path / "fresh"):
        with chunkstore.open(url, index_dir=str(index), create=True) as store:
            result = store.verify()
            assert result.ok, (index.name, result.problems)
            if index.name == "fresh":
                _load_here(store, f"{RUN}@1", 1)
                _load_here(store, f"{RUN}@2", 2)


def test_a_rank_killed_mid_save_publishes_nothing(store_url: str, tmp_path: Path) -> None:
    out = tmp_path / "kill"
    reports, codes = _spawn("killed_mid_save", 2, store_url, out)
    assert (out / "rank1.wrote").exists(), "rank 1 did not get to write its chunks"
    assert codes[1] == -9 and reports[1] is None, "rank 1 was not SIGKILLed"
    assert reports[0] is not None and not reports[0]["ok"], "rank 0's save did not fail"
    with chunkstore.open(store_url, create=True) as store:
        assert_only_the_first_save_published(store, RUN)
        _load_here(store, f"{RUN}@latest", 1)


def test_ranks_saving_different_steps_are_refused(store_url: str, tmp_path: Path) -> None:
    reports, _ = _spawn("mismatched_steps", 2, store_url, tmp_path / "steps")
    for report in reports:
        assert report is not None and not report["ok"]
        assert "ranks [1] save" in report["error"], report["error"]
        assert "every rank must save the same run and step" in report["error"]
    with chunkstore.open(store_url, create=True) as store:
        assert store.versions() == []
        assert not list(store.backend.list("sessions/"))


def test_save_and_load_without_a_process_group_and_async(store_url: str) -> None:
    writer = ChunkStoreWriter(store_url, run="solo", step=1, meta={"note": "one process"})
    dcp.save(full_state(1), storage_writer=writer)
    assert writer.info is not None and writer.info.meta == {"note": "one process"}
    again = ChunkStoreWriter(store_url, run="solo", step=2)
    dcp.async_save(full_state(2), storage_writer=again).result(timeout=60)
    assert again.info is not None
    assert again.info.new_bytes < writer.info.new_bytes / 4, "unchanged tensors must dedup"
    _load_here(store_url, "solo@1", 1)
    _load_here(store_url, "solo@latest", 2)
    with chunkstore.open(store_url, create=True) as store:
        result = store.verify()
        assert result.ok, result.problems


def test_a_save_given_the_store_makes_six_index_write_transactions(store_url: str) -> None:
    """DCP's save of one process through the open store (each index write transaction a
    commit and a sync, counted by LMDB's transaction id): the rank's writer claims its
    small chunks, then its pack, and drops its claims; the publisher claims every chunk
    it adopts in one transaction, then the last pack with the nodes, then counts the
    version in (tests/test_save_transactions.py)."""
    with chunkstore.open(store_url) as store:
        made = []
        for step in range(4):
            state = {f"t{i}": torch.full((256,), float(i + (i == step))) for i in range(20)}
            before = int(store.index.env.info()["last_txnid"])
            dcp.save(state, storage_writer=ChunkStoreWriter(store, run="r", step=step))
            made.append(int(store.index.env.info()["last_txnid"]) - before)
    assert max(made[1:]) <= 6, made  # the first one makes the run's


def test_saves_by_path_leave_nothing_open_behind_them(store_url: str) -> None:
    """A writer given the store's path opens it for its save and closes it after: more
    saves in one process leave no more file descriptors (an open store holds its index's
    and lock's) or threads than two did (what is left open, each later save pays for)."""
    def held() -> tuple[int, int]:
        return len(os.listdir("/proc/self/fd")), threading.active_count()

    def save(step: int) -> None:
        state = {f"t{i}": torch.full((256,), float(i + (i == step % 20))) for i in range(20)}
        dcp.save(state, storage_writer=ChunkStoreWriter(store_url, run="r", step=step))
    for step in range(2):
        save(step)
    after_two = held()
    for step in range(2, 8):
        save(step)
    assert held() == after_two


def test_an_async_save_keeps_conjugate_and_negative_views(store_url: str) -> None:
    """dcp.async_save stages the state first: torch's default stager copies with set_,
    which drops a conjugate or negative view's bit; the writer stages as torch's own
    FileSystemWriter does, and the saved values are the views' values."""
    c = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    state = {"c": c.conj(), "n": torch._neg_view(torch.tensor([1.0, 2.0]))}
    writer = ChunkStoreWriter(store_url, run="views", step=1)
    dcp.async_save(state, storage_writer=writer).result(timeout=60)
    target = {"c": torch.zeros(2, dtype=torch.complex64), "n": torch.zeros(2)}
    dcp.load(target, storage_reader=ChunkStoreReader(store_url, "views@1"))
    assert torch.equal(target["c"], c.conj().resolve_conj())
    assert target["n"].tolist() == [-1.0, -2.0]


def test_a_load_into_views_goes_through_host_copies_a_few_at_a_time(
        store_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensors the store cannot fill in place (here conjugate and negative views) are
    read into host copies, copied over after the read; a rank gathers at most
    HOST_COPY_BYTES of them (here: one box) before it reads."""
    from torch_bridge.dcp import reader as dcp_reader

    c = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    state = {"c": c, "n": torch.tensor([1.0, 2.0]), "w": torch.arange(3.0)}
    dcp.save(state, storage_writer=ChunkStoreWriter(store_url, run="into", step=1))
    monkeypatch.setattr(dcp_reader, "HOST_COPY_BYTES", 1)
    target = {"c": torch.zeros(2, dtype=torch.complex64).conj(),
              "n": torch._neg_view(torch.zeros(2)), "w": torch.zeros(3)}
    dcp.load(target, storage_reader=ChunkStoreReader(store_url, "into@1"))
    assert torch.equal(target["c"].resolve_conj(), c)
    assert target["n"].resolve_neg().tolist() == [1.0, 2.0]
    assert target["w"].tolist() == [0.0, 1.0, 2.0]


class _GcBeforeFinish(ChunkStoreWriter):
    """Runs a full GC (grace 0) in the window where the ranks' chunks are orphans."""

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        store = self._handle.store
        assert store is not None
        self.gc_result = store.gc(grace=0, session_wait=0.5)
        super().finish(metadata, results)


def test_a_gc_between_the_ranks_writes_and_the_commit_deletes_nothing_it_needs(
        store_url: str) -> None:
    dcp.save(full_state(1), storage_writer=ChunkStoreWriter(store_url, run="g", step=1))
    with chunkstore.open(store_url, create=True) as store:
        store.delete("g@1")  # its chunks are unreferenced: a grace-0 GC's candidates
        writer = _GcBeforeFinish(store, run="g", step=2)
        dcp.save(full_state(1), storage_writer=writer)  # the same bytes: dedup on them
        assert writer.info is not None
        assert writer.gc_result.chunks_deleted + writer.gc_result.orphans_deleted == 0
        result = store.verify()
        assert result.ok, result.problems
        _load_here(store, "g@2", 1)


class _GcFencesBeforeTheRankWrites(ChunkStoreWriter):
    """Starts a GC (grace 0) once the coordinator's session exists, and lets the rank
    write only once the GC's journal entry is stored: the GC then waits for the
    coordinator's session, and the rank must not wait for the GC."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        store = self._handle.store
        assert store is not None

        def collect() -> None:
            self.gc_result = store.gc(grace=0, session_wait=20)

        self.gc = threading.Thread(target=collect)
        self.gc.start()
        deadline = time.monotonic() + 20
        while not any(k.split("/")[-1][:1].isdigit() for k in store.backend.list("gc/")):
            assert time.monotonic() < deadline, "the GC stored no journal entry"
            time.sleep(0.01)
        started = time.monotonic()
        written = super().write_data(plan, planner)
        self.write_s = time.monotonic() - started
        return written


def test_a_gc_fenced_after_the_coordinators_session_neither_stalls_nor_breaks_the_save(
        store_url: str) -> None:
    dcp.save(full_state(1), storage_writer=ChunkStoreWriter(store_url, run="g", step=1))
    with chunkstore.open(store_url, create=True) as store:
        store.delete("g@1")  # its chunks are unreferenced: the GC's candidates
        writer = _GcFencesBeforeTheRankWrites(store, run="g", step=2)
        dcp.save(full_state(1), storage_writer=writer)  # the same bytes: dedup on them
        writer.gc.join(60)
        assert writer.write_s < 10, "the rank waited for a GC that waits for the save"
        assert writer.info is not None and writer.gc_result.chunks_deleted == 0
        result = store.verify()
        assert result.ok, result.problems
        _load_here(store, "g@2", 1)


def test_bad_input_gets_typed_errors(store_url: str, tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError):
        ChunkStoreWriter(store_url, run="../x", step=1)
    with pytest.raises(InvalidInputError):
        ChunkStoreWriter(store_url, run="r", step=-1)
    with pytest.raises(NotAStoreError):
        ChunkStoreReader(tmp_path / "nowhere", "r@latest")
    with chunkstore.open(store_url, create=True) as store:
        with store.new_version("plain", 1) as version:
            version.put("w", np.zeros(4, np.float32))
        with pytest.raises(SelectorError):
            ChunkStoreReader(store, "plain@7")
        with pytest.raises(NotACheckpointError):
            ChunkStoreReader(store, "plain@1")
        with pytest.raises(InvalidInputError, match="use_collectives"):
            dcp.save({"w": torch.zeros(2)}, use_collectives=False,
                     storage_writer=ChunkStoreWriter(store, run="r", step=1))


def test_a_reader_holds_the_store_from_its_lookup_to_the_end_of_a_load(
        store_url: str) -> None:
    """The store the reader opened to resolve its selector serves the load's read
    (one open per load), and is closed after it; a second load by the same reader
    opens it again and reads the same version."""
    dcp.save(full_state(1), storage_writer=ChunkStoreWriter(store_url, run="h", step=1))
    reader = ChunkStoreReader(store_url, "h@latest")
    assert reader._handle.store is not None
    dcp.save(full_state(2), storage_writer=ChunkStoreWriter(store_url, run="h", step=2))
    for _ in range(2):
        target = {k: torch.zeros_like(v) for k, v in full_state(1).items()
                  if isinstance(v, torch.Tensor)}
        dcp.load(target, storage_reader=reader)
        assert reader._handle.store is None
        for name, value in target.items():
            assert torch.equal(value, full_state(1)[name]), name  # h@1: resolved at first


def test_ranks_that_resolved_different_versions_are_refused(store_url: str) -> None:
    """What the coordinator's global step sees when a save was published between two
    ranks' lookups of ``latest``."""
    for step in (1, 2):
        dcp.save(full_state(step), storage_writer=ChunkStoreWriter(store_url, run="v",
                                                                    step=step))
    first, second = ChunkStoreReader(store_url, "v@1"), ChunkStoreReader(store_url, "v@2")
    plans = [first.prepare_local_plan(LoadPlan([])), second.prepare_local_plan(LoadPlan([]))]
    assert first.prepare_global_plan(plans[:1]) == plans[:1]
    with pytest.raises(InvalidInputError, match="different versions"):
        first.prepare_global_plan(plans)


def test_a_chunk_missing_at_finish_fails_the_save_and_publishes_nothing(
        store_url: str) -> None:
    class _LosesAChunk(ChunkStoreWriter):
        def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
            store = self._handle.store
            assert store is not None
            shard = results[0][0].storage_data["shard"]
            # The chunk's object: its pack where the store packs larger tensors' chunks.
            digest = shard["packs"][0][0] if shard.get("packs") else shard["chunks"][0]
            os.unlink(Path(store_url, "chunks", digest[:2], digest))
            super().finish(metadata, results)

    with chunkstore.open(store_url, create=True) as store:
        with pytest.raises(CheckpointException) as raised:
            dcp.save({"w": torch.arange(4096.0)}, storage_writer=_LosesAChunk(
                store, run="m", step=1))
        (error, _), = raised.value.failures.values()  # DCP wraps each rank's error
        assert isinstance(error, StagedChunkMissingError)
        assert "nothing was published" in str(error)
        assert store.versions() == []
        assert not list(store.backend.list("sessions/")), "the save's session must end"


@pytest.mark.s3
@pytest.mark.skipif(ENDPOINT_ENV_VAR not in os.environ,
                    reason=f"{ENDPOINT_ENV_VAR} names no S3 server")
def test_the_same_save_against_s3(tmp_path: Path) -> None:
    endpoint = os.environ[ENDPOINT_ENV_VAR]
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        os.environ.setdefault(name, "testing")
    bucket = create_bucket(endpoint)
    url = f"s3://{bucket}/dcp-{uuid.uuid4().hex[:8]}"
    options = {"storage_options": storage_options(endpoint)}
    try:
        chunkstore.open(url, chunk_size=CHUNK, index_dir=str(tmp_path / "setup"),
                        **options, create=True).close()
        reports = _all_ok(_spawn("save_twice_then_load", 2, url, tmp_path / "s3",
                                 {"options": options, "index_root": str(tmp_path / "idx")})[0])
        first, second = reports[0]["infos"]
        assert second["new_bytes"] < first["new_bytes"] / 2
        with chunkstore.open(url, index_dir=str(tmp_path / "check"), **options,
                             create=True) as store:
            result = store.verify()
            assert result.ok, result.problems
            _load_here(store, f"{RUN}@latest", 2)
    finally:
        remove_bucket(endpoint, bucket)
