"""Per-save metrics and keep_best: the Checkpointer keeps the best versions by a metric
each save records, beside the newest ones, and the CLI's prune reads the same metrics."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import chunkstore
from chunkstore.cli import cli
from chunkstore.errors import InvalidInputError, InvalidSettingError
from torch_bridge import Checkpointer

LOSSES = {1: 0.9, 2: 0.3, 3: 0.5, 4: 0.2, 5: 0.8, 6: 0.7, 7: 0.6}


def model(step: int) -> torch.nn.Module:
    torch.manual_seed(step)
    return torch.nn.Linear(8, 4)


def test_keep_best_keeps_the_best_and_the_newest(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    with Checkpointer(root, run="r", keep_last=1, keep_best=("val_loss", 2)) as ckpt:
        for step, loss in LOSSES.items():
            info = ckpt.save(step, metrics={"val_loss": loss, "epoch": step // 3},
                             model=model(step))
            assert info is not None and info.meta["metrics"]["val_loss"] == loss
        kept = sorted(v.step for v in ckpt.store.versions("r"))
    # best two (steps 4 and 2) and the newest two (the newest and one to fall back to)
    assert kept == [2, 4, 6, 7]
    with chunkstore.open(root) as store:
        best = {v.step: v.meta["metrics"]["val_loss"] for v in store.versions("r")}
    assert best == {s: LOSSES[s] for s in kept}
    # The CLI ranks by the same metrics: highest epoch, one of them.
    result = CliRunner().invoke(cli, ["prune", str(root), "--keep-best", "epoch:1:max",
                                      "--dry-run", "--json"])
    assert result.exit_code == 0, result.output
    pruned = json.loads(result.output)
    # epoch = step // 3: the best by epoch is step 7 (of 6 and 7 at epoch 2), kept with the
    # one before it (6); 2 and 4 would go
    assert sorted(v["step"] for v in pruned["removed"]) == [2, 4], pruned


def test_async_saves_record_metrics_and_max_ranks_highest(tmp_path: Path) -> None:
    with Checkpointer(tmp_path / "c", run="r", async_save=True,
                      keep_best=("accuracy", 1, "max")) as ckpt:
        for step, accuracy in ((1, 0.5), (2, 0.9), (3, 0.6), (4, 0.7)):
            ckpt.save(step, metrics={"accuracy": accuracy}, model=model(step))
        ckpt.wait()
        assert sorted(v.step for v in ckpt.store.versions("r")) == [2, 3, 4]


@pytest.mark.parametrize("metrics", [{}, [("a", 1.0)], {"a": "high"}, {"a": math.nan},
                                     {"a": True}, {"": 1.0}])
def test_bad_metrics_are_refused_before_anything_is_written(tmp_path: Path,
                                                            metrics: object) -> None:
    with Checkpointer(tmp_path / "c", run="r") as ckpt:
        with pytest.raises(InvalidInputError, match="metric"):
            ckpt.save(1, metrics=metrics, model=model(1))  # type: ignore[arg-type]
    assert not (tmp_path / "c").exists()


def test_bad_keep_best_and_a_save_without_the_metric(tmp_path: Path) -> None:
    with pytest.raises(InvalidSettingError, match="keep_best"):
        Checkpointer(tmp_path / "c", run="r", keep_best=("val_loss", 0))
    with Checkpointer(tmp_path / "c", run="r", keep_best=("val_loss", 1)) as ckpt, \
            pytest.warns(RuntimeWarning, match="cannot rank"):
        ckpt.save(1, metrics={"train_loss": 1.0}, model=model(1))
