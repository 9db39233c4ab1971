"""Handles on one store in one process share its index (LMDB allows one environment
per file per process): a Checkpointer beside ``chunkstore.open`` of its store, or two
handles, each closing once, the last one closing the index."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

import chunkstore
from torch_bridge import Checkpointer


def save(store: chunkstore.Store, step: int) -> str:
    with store.new_version(run="r", step=step) as version:
        version.put("w", np.full(1000, step, dtype=np.float32))
    return version.info.id


def test_two_handles_on_one_store_in_one_process(tmp_path: Path) -> None:
    root = tmp_path / "store"
    first = chunkstore.open(root, create=True)
    second = chunkstore.open(root)
    assert second.index is first.index
    a = save(first, 1)
    b = save(second, 2)
    assert {v.id for v in first.versions()} == {v.id for v in second.versions()} == {a, b}
    first.close()
    first.close()  # twice: still one opener less, not two
    assert second.open_version(a).get("w")[0] == 1
    save(second, 3)
    second.close()
    with chunkstore.open(root) as again:  # the last close closed it; it opens afresh
        assert sorted(v.step for v in again.versions()) == [1, 2, 3]


def test_a_checkpointer_and_a_handle_on_its_store(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    model = torch.nn.Linear(4, 3)
    with Checkpointer(root, run="exp") as ckpt:
        ckpt.save(1, model=model)
        with chunkstore.open(root) as store:  # to inspect it while training runs
            (info,) = store.versions()
            assert info.run == "exp" and info.step == 1
        ckpt.save(2, model=model)  # the handle's close left the Checkpointer's index open
        with Checkpointer(root, run="ema") as ema:  # a second one, for an EMA model
            ema.save(2, model=model)
        assert ckpt.latest_step() == 2
    with chunkstore.open(root) as store:
        assert sorted((v.run, v.step) for v in store.versions()) == [
            ("ema", 2), ("exp", 1), ("exp", 2)]
