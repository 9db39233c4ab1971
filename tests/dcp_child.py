"""One rank of the DCP tests: a real gloo process group on 127.0.0.1, real DTensors.

:func:`run_rank` is the target of ``torch.multiprocessing`` spawn; it runs one
job of :data:`JOBS` and writes what it found to ``<out>/rank<r>.json`` (an
exception is reported there too, so the parent sees every rank's story).
The state is deterministic (:func:`full_state`), so each rank can check what
it loaded against the full tensors of the step.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.futures import Future

from tests.gloo_ranks import run_job
from torch_bridge.dcp import ChunkStoreReader, ChunkStoreWriter

RUN = "dcp"
SHARDED = ("w", "emb", "momentum")


def full_state(step: int) -> dict[str, Any]:
    """Every tensor in full, and the non-tensor values, saved at ``step``.

    ``w`` changes in its first 16 rows at step 2 (rank 0's box at world size 4:
    the other boxes deduplicate); ``momentum`` is zeros, so its boxes are the
    same bytes on every rank (deduplicated across ranks); ``bias`` is
    replicated (the same on every rank: DCP's planner has one rank write it).
    """
    g = torch.Generator().manual_seed(1234)
    w = torch.randn(64, 256, generator=g)
    if step >= 2:
        w[:16] += 1.0
    return {
        "w": w,
        "emb": torch.randn(128, 64, generator=g).to(torch.bfloat16),
        "momentum": torch.zeros(64, 256),
        "bias": torch.randn(256, generator=g),
        "step": step,
        "extra": {"lr": 0.01 * step, "name": f"step-{step}"},
    }


def sharded_state(full: dict[str, Any], world: int, fill: float | None = None) -> dict[str, Any]:
    """``full`` with the SHARDED tensors as DTensors sharded on dim 0 over ``world`` ranks
    (each holds its rows; zeros or ``fill`` instead of the data when loading into it)."""
    mesh = init_device_mesh("cpu", (world,))
    rank = dist.get_rank()
    state = dict(full)
    for name in SHARDED:
        tensor = full[name]
        rows = tensor.shape[0] // world
        local = tensor[rank * rows:(rank + 1) * rows].clone()
        if fill is not None:
            local.fill_(fill)
        state[name] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
    if fill is not None:
        state["bias"] = torch.full_like(full["bias"], fill)
        state["step"] = -1
        state["extra"] = {"lr": -1.0, "name": ""}
    return state


def check_loaded(loaded: dict[str, Any], step: int) -> list[str]:
    """What differs from :func:`full_state` (bit for bit), as readable problems."""
    expected = full_state(step)
    problems = []
    for name in (*SHARDED, "bias"):
        value = loaded[name]
        if isinstance(value, DTensor):
            world, rank = dist.get_world_size(), dist.get_rank()
            rows = expected[name].shape[0] // world
            want = expected[name][rank * rows:(rank + 1) * rows]
            value = value.to_local()
        else:
            want = expected[name]
        if value.dtype != want.dtype or not torch.equal(value.view(torch.uint8),
                                                         want.view(torch.uint8)):
            problems.append(f"{name} differs from step {step}")
    for key in ("step", "extra"):
        if loaded[key] != expected[key]:
            problems.append(f"{key}: {loaded[key]!r} != {expected[key]!r}")
    return problems


def _load(url: str, selector: str, step: int, world: int, options: dict[str, Any]
          ) -> list[str]:
    target = sharded_state(full_state(step), world, fill=7.0)
    dcp.load(target, storage_reader=ChunkStoreReader(url, selector, **options))
    return check_loaded(target, step)


def save_twice_then_load(rank: int, world: int, url: str, extra: dict[str, Any]
                         ) -> dict[str, Any]:
    """Save steps 1 (dcp.save) and 2 (dcp.async_save), then load the latest at this world size."""
    infos = []
    options = dict(extra.get("options", {}))
    if "index_root" in extra:  # an index of its own, as on a machine of its own
        options["index_dir"] = str(Path(extra["index_root"], f"rank{rank}"))
    started = time.monotonic()
    for step in (1, 2):
        writer = ChunkStoreWriter(url, run=RUN, step=step, **options)
        state = sharded_state(full_state(step), world)
        if step == 1:
            dcp.save(state, storage_writer=writer)
        else:
            dcp.async_save(state, storage_writer=writer).result(timeout=60)
        infos.append(None if writer.info is None else writer.info.to_json())
        infos[-1] = infos[-1] and {**infos[-1], "seconds": time.monotonic() - started}
    started = time.monotonic()
    problems = _load(url, f"{RUN}@latest", 2, world, options)
    return {"infos": infos, "problems": problems, "load_s": time.monotonic() - started}


def load_latest(rank: int, world: int, url: str, extra: dict[str, Any]) -> dict[str, Any]:
    """Load ``RUN@latest`` (step ``extra["step"]``) at this world size."""
    return {"problems": _load(url, f"{RUN}@latest", extra["step"], world,
                              extra.get("options", {}))}


class _DiesAfterWriting(ChunkStoreWriter):
    """A writer whose rank 1 is SIGKILLed once its chunks are stored, before it reports."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        written = super().write_data(plan, planner)
        if dist.get_rank() == 1:
            Path(os.environ["DCP_TEST_OUT"], "rank1.wrote").touch()
            os.kill(os.getpid(), signal.SIGKILL)
        return written


def killed_mid_save(rank: int, world: int, url: str, extra: dict[str, Any]) -> dict[str, Any]:
    """Save step 1, then step 2 with rank 1 killed after writing its chunks."""
    dcp.save(sharded_state(full_state(1), world), storage_writer=ChunkStoreWriter(
        url, run=RUN, step=1))
    dist.barrier()
    writer = _DiesAfterWriting(url, run=RUN, step=2)
    dcp.save(sharded_state(full_state(2), world), storage_writer=writer)
    return {"published": writer.info is not None}


def mismatched_steps(rank: int, world: int, url: str, extra: dict[str, Any]) -> dict[str, Any]:
    """Rank 1 saves step 3 while the others save step 2: the save must fail everywhere."""
    writer = ChunkStoreWriter(url, run=RUN, step=3 if rank == 1 else 2)
    dcp.save(sharded_state(full_state(2), world), storage_writer=writer)
    return {"published": writer.info is not None}


JOBS: dict[str, Callable[[int, int, str, dict[str, Any]], dict[str, Any]]] = {
    "save_twice_then_load": save_twice_then_load,
    "load_latest": load_latest,
    "killed_mid_save": killed_mid_save,
    "mismatched_steps": mismatched_steps,
}


def run_rank(rank: int, world: int, port: int, url: str, job: str, out: str,
             extra: dict[str, Any]) -> None:
    os.environ["DCP_TEST_OUT"] = out
    run_job(JOBS, rank, world, port, url, job, out, extra)
