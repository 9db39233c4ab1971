"""The demo: kill a training job mid-run, resume it, prove the result is bit-exact.

1. an uninterrupted reference run, in this process;
2. the same job in a subprocess with an async save every few steps, SIGKILLed
   mid-run (usually while a background save is in flight);
3. a resume from the newest verified version, trained to the end;
4. a bitwise comparison of parameters, optimizer state, per-step losses and
   consumed example ids, and the storage the saves took against torch.save.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

import chunkstore
from torch_bridge.capture.rng import capture_rng
from torch_bridge.checkpointer import Checkpointer
from torch_bridge.tools import training

DEMO_CONFIG = training.TrainConfig(steps=60, save_every=2, features=1024, hidden=64,
                                   classes=10, examples=256, batch_size=16,
                                   chunk_size=256 * 1024)
RUN = "demo"


@dataclass
class DemoResult:
    differences: list[str] = field(default_factory=list)
    killed_after: int = 0
    restored_step: int | None = None
    versions: int = 0
    logical_bytes: int = 0
    physical_bytes: int = 0
    torch_save_bytes: int = 0
    verify_ok: bool = False

    @property
    def matched(self) -> bool:
        return not self.differences and self.verify_ok and self.restored_step is not None


def run_child(store: str, config: training.TrainConfig, kill_after: int,
              save_delay: float = 0.0, storage_options: dict[str, Any] | None = None) -> int:
    """Train in a subprocess; SIGKILL it right after its save of ``kill_after`` returns.
    ``storage_options`` reach it as ``CHUNKSTORE_STORAGE_OPTIONS``."""
    command = [sys.executable, "-m", "torch_bridge.tools.training", store, "--run", RUN,
               "--config", json.dumps(dataclasses.asdict(config)),
               "--save-delay", str(save_delay)]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONUNBUFFERED": "1",
                                  **training.storage_options_environment(storage_options)})
    assert child.stdout is not None
    last = 0
    with child.stdout:
        for line in child.stdout:
            if line.startswith("saved "):
                last = int(line.split()[1])
                if last >= kill_after:
                    child.send_signal(signal.SIGKILL)
                    break
    child.wait()
    if last < kill_after:
        raise RuntimeError(f"the training subprocess ended (exit {child.returncode}) before"
                           f" step {kill_after}")
    return last


def torch_save_size(job: training.Job) -> int:
    """Bytes one torch.save of the same state would write."""
    buffer = io.BytesIO()
    state = {k: v.state_dict() for k, v in job.stateful().items()}
    torch.save({**state, "rng": capture_rng()}, buffer)
    return buffer.tell()


def run_demo(store: str, config: training.TrainConfig = DEMO_CONFIG,
             say: Callable[[str], None] = print,
             storage_options: dict[str, Any] | None = None) -> DemoResult:
    """The demo in store ``store`` (a new directory, or a URL opened with
    ``storage_options``, in this process and the training subprocess alike)."""
    result = DemoResult()
    with training.deterministic():
        started = time.monotonic()
        reference = training.build(config)
        training.train(reference, config.steps)
        expected = training.snapshot(reference)
        say(f"reference: {config.steps} steps uninterrupted"
            f" ({time.monotonic() - started:.1f} s)")
        kill_after = -(-config.steps // 2 // config.save_every) * config.save_every
        result.killed_after = run_child(store, config, kill_after,
                                        storage_options=storage_options)
        say(f"training subprocess: async save every {config.save_every} steps,"
            f" SIGKILLed right after save({result.killed_after}) returned")
        with chunkstore.open(store, create=False, storage_options=storage_options
                             ) as opened, Checkpointer(opened, run=RUN, async_save=True) as ckpt:
            job = training.build(config)
            result.restored_step = training.resume(job, ckpt)
            in_flight = ("(the save in flight when killed was never published)"
                         if result.restored_step != result.killed_after else "")
            say(f"resumed from step {result.restored_step} {in_flight}".rstrip())
            training.train(job, config.steps, ckpt)
        result.differences = training.differences(expected, training.snapshot(job))
        result.torch_save_bytes = torch_save_size(job)
    with chunkstore.open(store, create=False, storage_options=storage_options) as opened:
        stats = opened.stats()
        result.verify_ok = opened.verify().ok
    result.versions = len(stats.versions)
    result.logical_bytes = stats.latest_logical_bytes
    result.physical_bytes = stats.physical_bytes
    return result
