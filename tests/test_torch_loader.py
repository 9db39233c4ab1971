"""torchdata's StatefulDataLoader as any Stateful: saved with 2 workers, resumed in a
fresh process at exactly the next batch.  Its state dict is plain data and one
tensor (the shuffling generator's state), so it needs no pickle."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
stateful_dataloader = pytest.importorskip("torchdata.stateful_dataloader")

from chunkstore.errors import NotSerializableError  # noqa: E402
from torch_bridge import Checkpointer  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = 40
TAKEN = 3  # batches taken before the save

RESUME = """
import json, sys, warnings
warnings.filterwarnings("ignore", "'set_vital' is deprecated")
from tests.test_torch_loader import loader
from torch_bridge import Checkpointer
data = loader()
with Checkpointer(sys.argv[1], run="loader") as ckpt:
    step = ckpt.restore(loader=data)
print(json.dumps({"step": step, "batches": [b.tolist() for b in data]}))
"""


def loader(workers: int = 2) -> Any:
    """A shuffling loader with workers, its order drawn from its own generator."""
    return stateful_dataloader.StatefulDataLoader(
        list(range(EXAMPLES)), batch_size=4, shuffle=True, num_workers=workers,
        generator=torch.Generator().manual_seed(5))


def test_a_stateful_data_loader_resumes_at_the_next_batch_in_a_fresh_process(
        tmp_path: Path) -> None:
    uninterrupted = [batch.tolist() for batch in loader()]
    data = loader()
    taken = []
    for batch in data:
        taken.append(batch.tolist())
        if len(taken) == TAKEN:
            break
    assert taken == uninterrupted[:TAKEN]
    store = str(tmp_path / "store")
    with Checkpointer(store, run="loader") as ckpt:
        ckpt.save(TAKEN, loader=data)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", RESUME, store], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    resumed = json.loads(done.stdout.splitlines()[-1])
    assert resumed["step"] == TAKEN
    assert resumed["batches"] == uninterrupted[TAKEN:], "the loader did not resume exactly"


class _SetState(torch.utils.data.Dataset[int]):
    """A dataset with state the safe encoding cannot hold (a set)."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> int:
        return index

    def state_dict(self) -> dict[str, Any]:
        return {"seen": {1, 2}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def test_loader_state_the_safe_encoding_cannot_hold_fails_the_save_naming_it(
        tmp_path: Path) -> None:
    data = stateful_dataloader.StatefulDataLoader(_SetState(), batch_size=2)
    next(iter(data))
    with Checkpointer(str(tmp_path / "store"), run="loader") as ckpt:
        with pytest.raises(NotSerializableError, match=r"loader\[.*'seen'\]"):
            ckpt.save(1, loader=data)
        assert ckpt.all_steps() == []
