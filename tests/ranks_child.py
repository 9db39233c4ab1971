"""One rank of the multi-rank Checkpointer tests: a real gloo process group on 127.0.0.1.

:func:`run_rank` is the target of ``torch.multiprocessing``; it runs one job of
:data:`JOBS` and writes what it found to ``<out>/rank<r>.json`` (an exception
is reported there too, so the parent sees every rank's story).

The training job is small and fully deterministic: a replicated MLP with
dropout whose gradients are averaged over the ranks (what DDP does), Adam, a
table sharded over the ranks as a DTensor and moved by each rank's own RNG
draws, and a :class:`~torch_bridge.ResumableSampler` per rank (each rank sees
its own order of the data).  Everything a resumed rank must get back: the
parameters, the optimizer, its RNGs (torch, numpy, python) and its data
position.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import chunkstore
from chunkstore.format.chunkobj import HEADER
from chunkstore.format.manifest import TensorEntry
from tests.gloo_ranks import run_job
from torch_bridge import Checkpointer, ResumableSampler
from torch_bridge.distributed import ranks

RUN = "ranks"
EXAMPLES = 48
BATCH = 4
ROWS = 8  # table rows per rank: 8 x 256 float32 = 8 KiB, two 4 KiB chunks per box


class Trainer:
    """One rank's training state and loop."""

    def __init__(self, rank: int, world: int) -> None:
        torch.manual_seed(0)  # the same initial model on every rank (replicated)
        self.model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.2), nn.Linear(16, 1))
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=0.01)
        mesh = init_device_mesh("cpu", (world,))
        self.table = {"w": DTensor.from_local(torch.zeros(ROWS, 256), mesh, [Shard(0)],
                                              run_check=False)}
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(EXAMPLES, 8, generator=g)
        self.y = torch.randn(EXAMPLES, 1, generator=g)
        self.sampler = ResumableSampler(range(EXAMPLES), seed=rank)
        self.world = world
        self._batches: Iterator[int] | None = None
        torch.manual_seed(100 + rank)  # each rank's own random streams
        random.seed(200 + rank)
        np.random.seed(300 + rank)

    def state(self) -> dict[str, Any]:
        return {"model": self.model, "optimizer": self.optimizer, "table": self.table,
                "sampler": self.sampler}

    def _indices(self) -> list[int]:
        out = []
        while len(out) < BATCH:
            if self._batches is None:
                self._batches = iter(self.sampler)
            try:
                out.append(next(self._batches))
            except StopIteration:
                self._batches = None  # the next epoch
        return out

    def step(self) -> None:
        index = self._indices()
        x = self.x[index] + 0.01 * torch.randn(BATCH, 8)
        loss = ((self.model(x) - self.y[index]) ** 2).mean()
        self.optimizer.zero_grad()
        loss.backward()
        for param in self.model.parameters():
            assert param.grad is not None
            dist.all_reduce(param.grad)
            param.grad /= self.world
        self.optimizer.step()
        with torch.no_grad():
            noise = torch.randn(ROWS, 256) * 0.1 + random.random() + float(np.random.rand())
            self.table["w"].to_local().add_(noise)

    def restored(self) -> None:
        self._batches = None  # a new iterator continues at the sampler's offset

    def fingerprint(self) -> dict[str, str]:
        """A digest of each part of this rank's state, bit for bit."""
        parts: dict[str, Any] = {
            "model": [t.numpy().tobytes() for t in self.model.state_dict().values()],
            "optimizer": _tree_bytes(self.optimizer.state_dict()),
            "table": self.table["w"].to_local().numpy().tobytes(),
            "sampler": json.dumps(self.sampler.state_dict(), sort_keys=True).encode(),
            "torch_rng": torch.get_rng_state().numpy().tobytes(),
            "numpy_rng": [v.tobytes() if isinstance(v, np.ndarray) else v
                          for v in np.random.get_state()],
            "python_rng": repr(random.getstate()).encode(),
        }
        return {name: hashlib.sha256(repr(value).encode()).hexdigest()
                for name, value in parts.items()}


def _tree_bytes(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.numpy().tobytes()
    if isinstance(tree, dict):
        return sorted((repr(k), _tree_bytes(v)) for k, v in tree.items())
    if isinstance(tree, (list, tuple)):
        return [_tree_bytes(v) for v in tree]
    return repr(tree)


def train(rank: int, world: int, url: str, extra: dict[str, Any]) -> dict[str, Any]:
    """Train to ``steps``, saving every ``save_every``; resume from the store first when
    ``resume``.  With ``hang_after``, write ``rank<r>.ready`` once that step is saved,
    train on slowly and then wait to be SIGKILLed."""
    trainer = Trainer(rank, world)
    out = Path(os.environ["RANKS_TEST_OUT"])
    with Checkpointer(url, run=RUN, async_save=bool(extra.get("async")),
                      mirror=extra.get("mirror")) as ckpt:
        start = 0
        tier = None
        if extra.get("resume"):
            start = ckpt.restore(**trainer.state()) or 0
            tier = ckpt.last_restore.tier if ckpt.last_restore is not None else None
            trainer.restored()
        for step in range(start, extra["steps"]):
            trainer.step()
            if (step + 1) % extra["save_every"] == 0:
                ckpt.save(step + 1, **trainer.state())
            if extra.get("hang_after") is not None and step + 1 >= extra["hang_after"]:
                (out / f"rank{rank}.ready").touch()
                time.sleep(0.05)  # training on, slowly: the kill lands mid-training
    if extra.get("hang_after") is not None:
        time.sleep(120)
    return {"start": start, "tier": tier, "fingerprint": trainer.fingerprint()}


def bad_metric_on_one_rank(rank: int, world: int, url: str, extra: dict[str, Any]
                           ) -> dict[str, Any]:
    """Rank 1's loss is NaN: every rank raises (none waits for the other), nothing saved."""
    trainer = Trainer(rank, world)
    with Checkpointer(url, run=RUN, async_save=bool(extra.get("async"))) as ckpt:
        ckpt.save(1, metrics={"loss": float("nan") if rank == 1 else 0.5}, **trainer.state())
    return {}


def mismatched_steps(rank: int, world: int, url: str, extra: dict[str, Any]) -> dict[str, Any]:
    """Rank 1 saves step 3 while rank 0 saves step 2: refused everywhere."""
    trainer = Trainer(rank, world)
    with Checkpointer(url, run=RUN) as ckpt:
        ckpt.save(3 if rank == 1 else 2, **trainer.state())
    return {}


def damaged_newest(rank: int, world: int, url: str, extra: dict[str, Any]) -> dict[str, Any]:
    """Save steps 1 and 2; rank 0 breaks a chunk of rank 1's table box of step 2; then
    every rank restores into a fresh trainer and reports the step it got."""
    trainer = Trainer(rank, world)
    with Checkpointer(url, run=RUN) as ckpt:
        for step in (1, 2):
            trainer.step()
            ckpt.save(step, **trainer.state())
        wanted = trainer.fingerprint()
        dist.barrier()
        if rank == 0:
            _break_box(ckpt.store, f"{RUN}@2", "table.w", rank=1)
        dist.barrier()
        fresh = Trainer(rank, world)
        restored = ckpt.restore(**fresh.state())
        got = fresh.fingerprint()
    return {"restored": restored, "equals_step_2": got == wanted}


def _break_box(store: chunkstore.Store, selector: str, name: str, rank: int) -> None:
    """Flip a byte in the first chunk of ``rank``'s box (rows ROWS*rank...) of entry
    ``name`` in the version ``selector`` names: the last byte of its object, or of its
    member object inside a pack."""
    entry = store.open_version(selector).entry(name)
    assert isinstance(entry, TensorEntry)
    shard = next(s for s in entry.shards if s.offsets[0] == ROWS * rank)
    location = shard.location(0)
    digest = (shard.chunks[0] if location is None else location.pack).hex
    path = Path(store.url, "chunks", digest[:2], digest)
    data = bytearray(path.read_bytes())
    end = len(data) if location is None else HEADER.size + location.offset + location.length
    data[end - 1] ^= 0xFF
    path.chmod(0o644)
    path.write_bytes(bytes(data))


def killed_mid_save(rank: int, world: int, url: str, extra: dict[str, Any]
                    ) -> dict[str, Any]:
    """Save step 1; then step 2, with rank 1 SIGKILLed once its chunks are durable,
    before it reports them to rank 0."""
    trainer = Trainer(rank, world)
    with Checkpointer(url, run=RUN) as ckpt:
        ckpt.save(1, **trainer.state())
        trainer.step()
        if rank == 1:
            stage = ranks.stage_boxes

            def stage_then_die(*args: Any, **kwargs: Any) -> Any:
                staged = stage(*args, **kwargs)
                Path(os.environ["RANKS_TEST_OUT"], "rank1.staged").touch()
                os.kill(os.getpid(), signal.SIGKILL)
                return staged

            ranks.stage_boxes = stage_then_die  # type: ignore[assignment]
        ckpt.save(2, **trainer.state())
    return {}


JOBS: dict[str, Callable[[int, int, str, dict[str, Any]], dict[str, Any]]] = {
    "train": train,
    "mismatched_steps": mismatched_steps,
    "damaged_newest": damaged_newest,
    "killed_mid_save": killed_mid_save,
    "bad_metric_on_one_rank": bad_metric_on_one_rank,
}


def run_rank(rank: int, world: int, port: int, url: str, job: str, out: str,
             extra: dict[str, Any]) -> None:
    os.environ["RANKS_TEST_OUT"] = out
    run_job(JOBS, rank, world, port, url, job, out, extra)
