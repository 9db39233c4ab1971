"""The demo: kill a training job at a random moment, resume it, prove the result is bit-exact.

1. an uninterrupted reference run, in this process;
2. the same job in a subprocess with an async save every few steps, SIGKILLed at a
   kill point drawn from a seed in the second half of training, between saves or
   while a save is in flight (:mod:`torch_bridge.tools.kill` says how, and reads
   afterwards what the kill hit);
3. a resume from the newest verified version, trained to the end;
4. a bitwise comparison of parameters, optimizer state, per-step losses and
   consumed example ids;
5. what one checkpoint's state holds, and the storage the saves took against
   torch.save, for this job (most bytes in a frozen backbone, the best case) and for
   the same job with every weight training (the dense case, a few saves into a
   temporary store: no chunk of one save repeats in the next).
"""

from __future__ import annotations

import dataclasses
import io
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

import chunkstore
from chunkstore.cli import format_size
from torch_bridge.capture.rng import capture_rng
from torch_bridge.checkpointer import Checkpointer
from torch_bridge.tools import training
from torch_bridge.tools.kill import KillOutcome, KillPoint, choose_kill_point, new_seed, run_child

if TYPE_CHECKING:
    from chunkstore.maintenance.report import StoreStats

DEMO_CONFIG = training.TrainConfig(steps=60, save_every=2, features=1024, hidden=64,
                                   classes=10, examples=256, batch_size=16,
                                   chunk_size=256 * 1024)
#: Saves of the dense job: enough for its ratio to settle (every save is new data).
DENSE_SAVES = 8
RUN = "demo"

__all__ = ["DEMO_CONFIG", "DemoResult", "KillPoint", "StateBytes", "StorageFigure",
           "run_child", "run_demo"]


@dataclass(frozen=True)
class StateBytes:
    """What one checkpoint of the job holds, by the bytes torch.save writes."""

    frozen: int  # parameters that never train: the same bytes in every save
    trained: int  # parameters the optimizer updates
    moments: int  # the optimizer's state (Adam's two moments per trained parameter)
    total: int  # one torch.save of the whole state

    @property
    def rest(self) -> int:
        """Schedule, scaler, data position, history, RNG and torch.save's framing."""
        return self.total - self.frozen - self.trained - self.moments

    def describe(self) -> str:
        return (f"state per checkpoint: {format_size(self.total)} ="
                f" {format_size(self.frozen)} frozen backbone (the same in every save)"
                f" + {format_size(self.trained)} trained weights"
                f" + {format_size(self.moments)} Adam moments"
                f" + {format_size(self.rest)} the rest (schedule, data position, history,"
                " RNG)")


@dataclass(frozen=True)
class StorageFigure:
    """What ``versions`` saves took in a store against torch.save of the same states, and
    where the difference comes from: chunks stored once (``dedup``: logical bytes per
    unique byte) and compression with deltas (``compression``: unique bytes per stored)."""

    versions: int
    torch_save_bytes: int
    stored_bytes: int
    dedup: float
    compression: float

    @classmethod
    def of(cls, stats: StoreStats, torch_save_bytes: int) -> StorageFigure:
        return cls(len(stats.versions), torch_save_bytes, stats.physical_bytes,
                   round(stats.dedup_ratio, 3), round(stats.compression_ratio, 3))

    @property
    def ratio(self) -> float:
        return self.torch_save_bytes / self.stored_bytes if self.stored_bytes else 0.0

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "ratio": round(self.ratio, 3)}


@dataclass
class DemoResult:
    differences: list[str] = field(default_factory=list)
    seed: int = 0
    kill: KillPoint | None = None
    outcome: KillOutcome | None = None
    restored_step: int | None = None
    versions: int = 0
    logical_bytes: int = 0
    physical_bytes: int = 0
    torch_save_bytes: int = 0  # one torch.save of the final state
    verify_ok: bool = False
    state: StateBytes | None = None
    #: This job's saves (a frozen backbone), against torch.save of as many final states.
    frozen: StorageFigure | None = None
    #: The same job with every weight training, a few saves.
    dense: StorageFigure | None = None

    @property
    def matched(self) -> bool:
        return not self.differences and self.verify_ok and self.restored_step is not None

    def to_json(self) -> dict[str, Any]:
        return {
            "seed": self.seed, "matched": self.matched, "differences": self.differences,
            "verify_ok": self.verify_ok,
            "kill_point": None if self.kill is None else dataclasses.asdict(self.kill),
            "kill": None if self.outcome is None else {
                **dataclasses.asdict(self.outcome), "case": self.outcome.case,
                "described": self.outcome.describe()},
            "restored_step": self.restored_step,
            "state": None if self.state is None else {
                **dataclasses.asdict(self.state), "rest": self.state.rest},
            "frozen_base": None if self.frozen is None else self.frozen.to_json(),
            "dense": None if self.dense is None else self.dense.to_json(),
        }


def torch_save_size(job: training.Job) -> int:
    """Bytes one torch.save of the same state would write."""
    buffer = io.BytesIO()
    state = {k: v.state_dict() for k, v in job.stateful().items()}
    torch.save({**state, "rng": capture_rng()}, buffer)
    return buffer.tell()


def state_bytes(job: training.Job) -> StateBytes:
    """What ``job``'s checkpoint holds: frozen and trained parameters, optimizer state."""
    def size(tensor: torch.Tensor) -> int:
        return tensor.numel() * tensor.element_size()

    parameters = list(job.model.parameters())
    moments = [torch.as_tensor(value) for state in job.optimizer.state_dict()["state"].values()
               for value in state.values()]
    return StateBytes(frozen=sum(size(p) for p in parameters if not p.requires_grad),
                      trained=sum(size(p) for p in parameters if p.requires_grad),
                      moments=sum(size(m) for m in moments), total=torch_save_size(job))


def measure_dense(config: training.TrainConfig, saves: int = DENSE_SAVES) -> StorageFigure:
    """``saves`` saves of the job with every weight training, into a temporary store;
    torch.save's bytes are summed over the very states saved."""
    dense = dataclasses.replace(config, frozen_backbone=False, steps=saves * config.save_every)
    torch_bytes = 0
    with tempfile.TemporaryDirectory(prefix="chunkstore-demo-dense-") as tmp, \
            Checkpointer(os.path.join(tmp, "store"), run="dense", async_save=True,
                         chunk_size=config.chunk_size) as ckpt:
        job = training.build(dense)

        def count(event: str, step: int) -> None:
            nonlocal torch_bytes
            if event == "saved":
                torch_bytes += torch_save_size(job)

        training.train(job, dense.steps, ckpt, count)
        ckpt.wait()
        return StorageFigure.of(ckpt.store.stats(), torch_bytes)


def run_demo(store: str, config: training.TrainConfig = DEMO_CONFIG,
             say: Callable[[str], None] = print,
             storage_options: dict[str, Any] | None = None,
             seed: int | None = None) -> DemoResult:
    """The demo in store ``store`` (a new directory, or a URL opened with
    ``storage_options``, in this process and the training subprocess alike); the kill
    point is drawn from ``seed`` (a fresh one from ``os.urandom`` when None)."""
    result = DemoResult(seed=new_seed() if seed is None else seed)
    result.kill = choose_kill_point(result.seed, config)
    with training.deterministic():
        started = time.monotonic()
        reference = training.build(config)
        training.train(reference, config.steps)
        expected = training.snapshot(reference)
        say(f"reference: {config.steps} steps uninterrupted"
            f" ({time.monotonic() - started:.1f} s)")
        say(f"kill point: {result.kill.describe()} (seed {result.seed};"
            f" chunkstore demo --seed {result.seed} draws it again)")
        log = run_child(store, config, result.kill, storage_options=storage_options)
        with chunkstore.open(store, create=False, storage_options=storage_options
                             ) as opened, Checkpointer(opened, run=RUN, async_save=True) as ckpt:
            result.outcome = KillOutcome.of(log, ckpt.latest_step())
            say(f"training subprocess: async save every {config.save_every} steps,"
                f" {result.outcome.describe()}")
            job = training.build(config)
            result.restored_step = training.resume(job, ckpt)
            say(_resumed(result.restored_step, result.outcome))
            training.train(job, config.steps, ckpt)
        result.differences = training.differences(expected, training.snapshot(job))
        result.state = state_bytes(job)
        result.torch_save_bytes = result.state.total
        say(result.state.describe())
        result.dense = measure_dense(config)
    _measure_store(store, storage_options, result)
    return result


def _resumed(restored: int | None, outcome: KillOutcome) -> str:
    if restored is not None and restored == outcome.published:
        return f"resumed from step {restored}, the newest version published before the kill"
    return (f"resumed from step {restored}; the newest published, {outcome.published}, did not"
            " verify")


def _measure_store(store: str, storage_options: dict[str, Any] | None,
                   result: DemoResult) -> None:
    with chunkstore.open(store, create=False, storage_options=storage_options) as opened:
        stats = opened.stats()
        result.verify_ok = opened.verify().ok
    result.versions = len(stats.versions)
    result.logical_bytes = stats.latest_logical_bytes
    result.physical_bytes = stats.physical_bytes
    result.frozen = StorageFigure.of(stats, result.torch_save_bytes * result.versions)
