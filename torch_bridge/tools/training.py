"""A small, fully deterministic training job: the subject of the demo and the resume tests.

A frozen backbone (most of the bytes, as in fine-tuning) under a trained head
with dropout; Adam, a StepLR schedule, a GradScaler; a DataLoader shuffled by
a :class:`~torch_bridge.ResumableSampler`.  Everything random is seeded, the
loader has its own ``generator`` (without one, creating an iterator draws
from the global torch RNG, so a run resumed mid-epoch would diverge), and
saves happen after ``optimizer.step()``, at an update boundary.

With ``frozen_backbone=False`` every weight trains: the dense case, where no
chunk of one save repeats in the next.

Run as ``python -m torch_bridge.tools.training STORE --config JSON`` it trains with
an async save every ``save_every`` steps and prints one line per event, which the
demo and the tests read to SIGKILL it at a chosen moment: ``step S`` after each
optimizer step, ``saving S`` before the save of step S is called, ``saved S`` when
that call returns (its background write has begun), ``published`` when a save's
commit record is written (saves publish one at a time, in order), ``done`` at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import chunkstore
from chunkstore.backends.wrappers import ForwardingBackend
from chunkstore.cli.common import STORAGE_OPTIONS_ENV_VAR, storage_options_for
from chunkstore.objects.kinds import VERSIONS
from torch_bridge.capture.sampler import ResumableSampler
from torch_bridge.checkpointer import Checkpointer

STATE_PIECES = ("model", "optimizer", "scheduler", "data", "rng")


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 24
    save_every: int = 1
    seed: int = 1234
    features: int = 64  # the frozen backbone is features x features
    hidden: int = 32
    classes: int = 5
    examples: int = 80
    batch_size: int = 8
    dropout: float = 0.3
    chunk_size: int = 64 * 1024
    frozen_backbone: bool = True  # False: every weight trains (the dense case)


class History:
    """Per-step losses and consumed example ids; saved with the state, so a
    resumed run carries the killed run's history on."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.ids: list[list[int]] = []

    def state_dict(self) -> dict[str, Any]:
        return {"losses": list(self.losses), "ids": [list(i) for i in self.ids]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.losses, self.ids = list(state["losses"]), [list(i) for i in state["ids"]]


@dataclass
class Job:
    config: TrainConfig
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    sampler: ResumableSampler
    loader: DataLoader[Any]
    history: History = field(default_factory=History)
    step: int = 0

    def stateful(self, without: frozenset[str] = frozenset()) -> dict[str, Any]:
        """The objects to save/restore; ``without`` drops pieces (to prove they matter)."""
        pieces: dict[str, dict[str, Any]] = {
            "model": {"model": self.model}, "optimizer": {"optimizer": self.optimizer},
            "scheduler": {"scheduler": self.scheduler, "scaler": self.scaler},
            "data": {"sampler": self.sampler}}
        state: dict[str, Any] = {"history": self.history}
        for name, objects in pieces.items():
            if name not in without:
                state.update(objects)
        return state


def build(config: TrainConfig) -> Job:
    torch.manual_seed(config.seed)
    data = torch.Generator().manual_seed(config.seed + 1)
    inputs = torch.randn(config.examples, config.features, generator=data)
    labels = torch.randint(0, config.classes, (config.examples,), generator=data)
    dataset = TensorDataset(inputs, labels, torch.arange(config.examples))
    backbone = nn.Linear(config.features, config.features)
    backbone.requires_grad_(not config.frozen_backbone)
    model = nn.Sequential(backbone, nn.Tanh(), nn.Linear(config.features, config.hidden),
                          nn.ReLU(), nn.Dropout(config.dropout),
                          nn.Linear(config.hidden, config.classes))
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(trainable, lr=3e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.7)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    sampler = ResumableSampler(dataset, seed=config.seed)
    loader = DataLoader(dataset, batch_size=config.batch_size, sampler=sampler,
                        generator=torch.Generator().manual_seed(config.seed + 2))
    return Job(config, model, optimizer, scheduler, scaler, sampler, loader)


def _batches(job: Job) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    while True:
        yield from job.loader  # a new iterator per epoch; the sampler knows where it is


def train(job: Job, until: int, ckpt: Checkpointer | None = None,
          on_event: Callable[[str, int], None] = lambda event, step: None) -> None:
    """Train from ``job.step`` to ``until``, saving every ``save_every`` steps to ``ckpt``;
    ``on_event`` hears ``("step", S)`` after each step and ``("saving", S)`` and
    ``("saved", S)`` around each save call."""
    job.model.train()
    batches = _batches(job)
    while job.step < until:
        inputs, labels, ids = next(batches)
        job.optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(job.model(inputs), labels)
        job.scaler.scale(loss).backward()  # type: ignore[no-untyped-call]
        job.scaler.step(job.optimizer)
        job.scaler.update()
        job.scheduler.step()
        job.step += 1
        job.history.losses.append(float(loss.item()))
        job.history.ids.append([int(i) for i in ids])
        on_event("step", job.step)
        if ckpt is not None and job.step % job.config.save_every == 0:
            on_event("saving", job.step)
            ckpt.save(job.step, **job.stateful())
            on_event("saved", job.step)


def resume(job: Job, ckpt: Checkpointer, step: int | None = None,
           without: frozenset[str] = frozenset()) -> int | None:
    """Restore ``job`` from ``ckpt`` (all pieces but ``without``); returns the step (None
    on a first start: no store or no version yet, unless ``step`` asks for one)."""
    restored = ckpt.restore(step, rng="rng" not in without, missing_ok=step is None,
                            **job.stateful(without))
    job.step = restored or 0
    return restored


@contextlib.contextmanager
def deterministic() -> Iterator[None]:
    """One intra-op thread and deterministic kernels, so every run computes the same bits."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def snapshot(job: Job) -> dict[str, Any]:
    """What two runs must agree on, bit for bit."""
    tensors = {f"model.{k}": v.detach().clone() for k, v in job.model.state_dict().items()}
    for pid, state in job.optimizer.state_dict()["state"].items():
        for name, value in state.items():
            tensors[f"optimizer.{pid}.{name}"] = torch.as_tensor(value).clone()
    return {"tensors": tensors, "losses": list(job.history.losses),
            "ids": [list(i) for i in job.history.ids], "step": job.step,
            "lr": job.scheduler.get_last_lr(), "scale": job.scaler.get_scale()}


def differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Where two snapshots differ (bitwise for tensors); empty when identical."""
    found = []
    for name in sorted(set(a["tensors"]) | set(b["tensors"])):
        x, y = a["tensors"].get(name), b["tensors"].get(name)
        if x is None or y is None or x.shape != y.shape or x.dtype != y.dtype or (
                x.numpy().tobytes() != y.numpy().tobytes()):
            found.append(f"tensor {name}")
    for key in ("losses", "ids", "step", "lr", "scale"):
        if repr(a[key]) != repr(b[key]):
            found.append(key)
    return found


class DelayedBackend(ForwardingBackend):
    """Slow storage: every object write waits ``delay`` seconds first."""

    def __init__(self, inner: Any, delay: float) -> None:
        super().__init__(inner)
        self.delay = delay

    def put_if_absent(self, key: str, data: bytes | memoryview) -> bool:
        time.sleep(self.delay)
        return super().put_if_absent(key, data)


class PublishReporter(ForwardingBackend):
    """Calls ``on_published()`` right after each commit record (``versions/``) is
    written: the moment a save is published."""

    def __init__(self, inner: Any, on_published: Callable[[], None]) -> None:
        super().__init__(inner)
        self.on_published = on_published

    def put(self, key: str, data: bytes | memoryview) -> None:
        super().put(key, data)
        self._written(key)

    def put_if_absent(self, key: str, data: bytes | memoryview) -> bool:
        created = super().put_if_absent(key, data)
        self._written(key)
        return created

    def _written(self, key: str) -> None:
        if key.startswith(VERSIONS.prefix):
            self.on_published()


def _line_printer() -> Callable[[str], None]:
    """Print whole lines, flushed, from any thread (``published`` comes from the save's
    background thread; one line must never split another)."""
    lock = threading.Lock()

    def emit(line: str) -> None:
        with lock:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()

    return emit


def storage_options_environment(options: dict[str, Any] | None) -> dict[str, str]:
    """The environment that hands :func:`main` in a subprocess these storage options."""
    return {} if not options else {STORAGE_OPTIONS_ENV_VAR: json.dumps(options)}


@contextlib.contextmanager
def _checkpointer(store: str, run: str, config: TrainConfig) -> Iterator[Checkpointer]:
    """The job's Checkpointer; a URL store opened with $CHUNKSTORE_STORAGE_OPTIONS."""
    options = storage_options_for(store)
    if options is None:
        with Checkpointer(store, run=run, async_save=True, chunk_size=config.chunk_size
                          ) as ckpt:
            yield ckpt
        return
    with chunkstore.open(store, create=True, chunk_size=config.chunk_size,
                         storage_options=options) as opened, \
            Checkpointer(opened, run=run, async_save=True) as ckpt:
        yield ckpt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_bridge.tools.training")
    parser.add_argument("store")
    parser.add_argument("--run", default="demo")
    parser.add_argument("--config", default="{}", help="TrainConfig fields as JSON")
    parser.add_argument("--save-delay", type=float, default=0.0,
                        help="seconds each storage write waits (simulates slow storage)")
    args = parser.parse_args(argv)
    config = TrainConfig(**json.loads(args.config))
    emit = _line_printer()
    with deterministic(), _checkpointer(args.store, args.run, config) as ckpt:
        backend = ckpt.store.backend
        if args.save_delay:
            backend = DelayedBackend(backend, args.save_delay)
        ckpt.store.backend = PublishReporter(backend, lambda: emit("published"))
        job = build(config)
        resume(job, ckpt)
        train(job, config.steps, ckpt, lambda event, step: emit(f"{event} {step}"))
    emit("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
