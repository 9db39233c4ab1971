"""Where the demo kills its training subprocess, and what the kill hit.

1. A kill point is drawn from a seed (``os.urandom`` unless one is given; the demo
   prints it, so that a run can be drawn again) in the second half of training, at
   one of three moments, each as likely:

   - ``after step S``: as soon as the child reports step S done, whatever is in flight
     then (with the demo's save every 2 steps, whose writes take longer than 2 steps
     of training, usually a save);
   - ``during the save of step S``: 0-5 ms after ``save(S)`` returned, while its
     background write runs;
   - ``once the save of step S is published``: as soon as its commit record is written.

2. The parent reads the child's lines (``step``, ``saving``, ``saved``, ``published``:
   :mod:`torch_bridge.tools.training`) and sends SIGKILL when the point is reached.

3. What the kill hit is read afterwards, never assumed: the seed fixes the point, but
   where a SIGKILL lands against a background write is timing.  The child's pipe keeps
   every line it flushed before it died, so the parent reads on to the end; the store
   says which version is the newest published.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from torch_bridge.tools import training

AFTER_STEP = "after step"
DURING_SAVE = "during save"
AFTER_PUBLISH = "after publish"
MOMENTS = (AFTER_STEP, DURING_SAVE, AFTER_PUBLISH)
#: The child line each moment waits for.
_TRIGGER = {AFTER_STEP: "step", DURING_SAVE: "saved", AFTER_PUBLISH: "published"}
#: A kill during a save waits up to this long after ``save()`` returned.
DURING_SAVE_MAX_DELAY = 0.005


@dataclass(frozen=True)
class KillPoint:
    """When the parent sends SIGKILL: at ``moment`` of ``step`` (plus ``delay`` s)."""

    step: int
    moment: str
    delay: float = 0.0

    def describe(self) -> str:
        if self.moment == AFTER_STEP:
            return f"right after step {self.step}"
        if self.moment == DURING_SAVE:
            return (f"{self.delay * 1000:.1f} ms after save({self.step}) returned, while its"
                    " background write runs")
        return f"as soon as the save of step {self.step} is published"


def new_seed() -> int:
    """A fresh seed from ``os.urandom``."""
    return int.from_bytes(os.urandom(4), "big")


def choose_kill_point(seed: int, config: training.TrainConfig) -> KillPoint:
    """The kill point ``seed`` draws in the second half of ``config``'s training: any step
    after the halfway one and before the last (a save point, before the last save, for
    the two moments tied to a save), so that there is always training left to resume."""
    rng = random.Random(seed)
    moment = rng.choice(MOMENTS)
    first, last = config.steps // 2 + 1, config.steps - 1
    if moment == AFTER_STEP:
        return KillPoint(rng.randint(first, last), moment)
    every = config.save_every
    low, high = -(-first // every), last // every
    if low > high:
        raise ValueError(f"no save between steps {first} and {last}: {config}")
    step = every * rng.randint(low, high)
    delay = rng.uniform(0.0, DURING_SAVE_MAX_DELAY) if moment == DURING_SAVE else 0.0
    return KillPoint(step, moment, round(delay, 4))


@dataclass
class ChildLog:
    """What the training subprocess reported before it died, line by line."""

    last_step: int = 0
    #: The newest save called, and the newest whose call returned (its write begun).
    last_called: int | None = None
    last_returned: int | None = None
    #: Saves the child reported published, in order.
    published: list[int] = field(default_factory=list)
    _unpublished: deque[int] = field(default_factory=deque)

    def read(self, line: str) -> tuple[str, int | None]:
        """Take one line in; the event and its step (a publication's step: saves publish
        one at a time and in order, so it is the oldest save called and unpublished)."""
        event, _, text = line.strip().partition(" ")
        step = int(text) if text.isdigit() else None
        if event == "step" and step is not None:
            self.last_step = step
        elif event == "saving" and step is not None:
            self.last_called = step
            self._unpublished.append(step)
        elif event == "saved" and step is not None:
            self.last_returned = step
        elif event == "published" and self._unpublished:
            step = self._unpublished.popleft()
            self.published.append(step)
        return event, step


def run_child(store: str, config: training.TrainConfig, kill: KillPoint,
              save_delay: float = 0.0, storage_options: dict[str, Any] | None = None
              ) -> ChildLog:
    """Train in a subprocess and SIGKILL it at ``kill``; what it reported until it died.
    ``storage_options`` reach it as ``CHUNKSTORE_STORAGE_OPTIONS``."""
    command = [sys.executable, "-m", "torch_bridge.tools.training", store, "--run", "demo",
               "--config", json.dumps(dataclasses.asdict(config)),
               "--save-delay", str(save_delay)]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONUNBUFFERED": "1",
                                  **training.storage_options_environment(storage_options)})
    assert child.stdout is not None
    log, killed = ChildLog(), False
    with child.stdout:
        for line in child.stdout:  # after the kill too: the lines it flushed before dying
            event, step = log.read(line)
            if not killed and event == _TRIGGER[kill.moment] and step is not None \
                    and step >= kill.step:
                time.sleep(kill.delay)
                child.send_signal(signal.SIGKILL)
                killed = True
    child.wait()
    if not killed:
        raise RuntimeError(f"the training subprocess ended (exit {child.returncode}) before"
                           f" its kill point, {kill.describe()}")
    return log


@dataclass(frozen=True)
class KillOutcome:
    """What a kill hit: the last step done, the newest version published, and the save
    cut off (``in_flight``: its write had begun; ``in_call``: its call had not returned)."""

    after_step: int
    published: int | None
    in_flight: int | None = None
    in_call: int | None = None

    @classmethod
    def of(cls, log: ChildLog, published: int | None) -> KillOutcome:
        """From the child's lines and the newest version the store holds."""
        newest = -1 if published is None else published
        if log.last_returned is not None and log.last_returned > newest:
            return cls(log.last_step, published, in_flight=log.last_returned)
        if log.last_called is not None and log.last_called > newest:
            return cls(log.last_step, published, in_call=log.last_called)
        return cls(log.last_step, published)

    @property
    def case(self) -> str:
        """``"save in flight"``, ``"inside a save call"`` or ``"between saves"``."""
        if self.in_flight is not None:
            return "save in flight"
        return "inside a save call" if self.in_call is not None else "between saves"

    def describe(self) -> str:
        where = f"SIGKILLed after step {self.after_step}"
        if self.in_flight is not None:
            return (f"{where}, while the save of step {self.in_flight} was in flight:"
                    f" save({self.in_flight}) had returned and its background write never"
                    " published it")
        if self.in_call is not None:
            return (f"{where}, during the call save({self.in_call}) (it had not reported"
                    f" returning): step {self.in_call} was never published")
        return (f"{where}, between saves: the save of step {self.published} was published"
                " and the next not yet called")
