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


def test_a_forked_child_never_uses_its_parent_s_index(tmp_path: Path) -> None:
    """LMDB forbids using an environment after fork(): a child process's handle on the
    store its parent has open never shares the parent's index.  (LMDB's binding keeps
    refusing a second open of those files in the child, so the child gets a typed
    error; it would have before the index was shared, too.)"""
    import multiprocessing

    from chunkstore.errors import BackendError

    root = tmp_path / "store"
    parent = chunkstore.open(root, create=True)
    save(parent, 1)

    def child(parent_index_id: int) -> None:
        try:
            store = chunkstore.open(root)
        except BackendError:
            raise SystemExit(0) from None  # refused, typed
        raise SystemExit(3 if id(store.index) == parent_index_id else 0)

    process = multiprocessing.get_context("fork").Process(target=child,
                                                          args=(id(parent.index),))
    process.start()
    process.join(60)
    assert process.exitcode == 0
    save(parent, 2)  # the parent's index is untouched by the child
    assert sorted(v.step for v in parent.versions()) == [1, 2]
    parent.close()
