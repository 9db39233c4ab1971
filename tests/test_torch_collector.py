"""Saves and restores run with the cyclic garbage collector paused and make no cycles."""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import chunkstore  # noqa: E402
import torch_bridge  # noqa: E402
from torch_bridge import Checkpointer, load, save  # noqa: E402

nn = torch.nn


def _training_state() -> dict[str, Any]:
    """A model of a few hundred tensors and its optimizer after one step."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(150)])
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 8)).sum().backward()
    optimizer.step()
    return {"model": model, "optimizer": optimizer}


class _Probe:
    """A stateful object that notes whether the collector runs when it is saved and
    when it is loaded (both happen inside the save or the restore)."""

    def __init__(self) -> None:
        self.collector_on: list[bool] = []

    def state_dict(self) -> dict[str, Any]:
        self.collector_on.append(gc.isenabled())
        return {"n": 1}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.collector_on.append(gc.isenabled())


def test_saves_and_restores_run_with_the_collector_paused_and_resume_it(
        tmp_path: Path) -> None:
    """The collector is off from capture to publish and from read to apply, and on
    again once each call returns."""
    enabled = gc.isenabled()
    gc.enable()
    try:
        state = {**_training_state(), "probe": _Probe()}
        with chunkstore.open(tmp_path / "s", create=True) as store:
            save(store, state, run="r", step=1)
            assert gc.isenabled()
            load(store, "r@1", state)
            assert gc.isenabled()
            for async_save in (False, True):
                with Checkpointer(store, run=f"c{async_save}",
                                  async_save=async_save) as checkpointer:
                    checkpointer.save(1, **state)
                    checkpointer.wait()
                    assert gc.isenabled()
                    checkpointer.restore(**state)
                    assert gc.isenabled()
        calls = state["probe"].collector_on
        assert len(calls) >= 6
        assert not any(calls)
    finally:
        if not enabled:
            gc.disable()


def test_a_collector_the_caller_turned_off_stays_off(tmp_path: Path) -> None:
    enabled = gc.isenabled()
    gc.disable()
    try:
        with chunkstore.open(tmp_path / "s", create=True) as store:
            save(store, _training_state(), run="r", step=1)
        assert not gc.isenabled()
    finally:
        if enabled:
            gc.enable()


@pytest.mark.parametrize("async_save", [False, True])
def test_saves_and_restores_leave_nothing_for_the_cyclic_collector(
        tmp_path: Path, async_save: bool) -> None:
    """What a save or a restore made is freed by reference counting when it returns,
    so pausing the collector for it leaves no garbage behind.  (torch's own
    ``Optimizer.load_state_dict`` leaves one: a closure that calls itself.)"""
    state = _training_state()
    enabled = gc.isenabled()
    debug = gc.get_debug()
    with chunkstore.open(tmp_path / "s", create=True) as store, \
            Checkpointer(store, run="c", async_save=async_save) as checkpointer:
        checkpointer.save(1, **state)  # first use: lazy imports and caches
        checkpointer.wait()
        checkpointer.restore(**state)
        save(store, state, run="r", step=1)
        load(store, "r@1", state)
        gc.collect()
        gc.disable()
        gc.set_debug(gc.DEBUG_SAVEALL)  # the garbage found is kept in gc.garbage
        try:
            for step in (2, 3):
                checkpointer.save(step, **state)
                checkpointer.wait()
            checkpointer.restore(**state)
            save(store, state, run="r", step=2)
            load(store, "r@2", state)
            gc.collect()
            ours = [o for o in gc.garbage if _from_this_project(o)]
            assert ours == []
        finally:
            gc.garbage.clear()
            gc.set_debug(debug)
            if enabled:
                gc.enable()


#: Where the project's own code lies (a clone is often named ``chunkstore`` too, and its
#: ``.venv/.../torch`` is not ours).
PACKAGE_DIRS = tuple(os.path.join(os.path.dirname(os.path.realpath(package.__file__)), "")
                     for package in (chunkstore, torch_bridge))


def _from_this_project(thing: object) -> bool:
    module = getattr(thing, "__module__", None) or type(thing).__module__ or ""
    code = getattr(thing, "f_code", None) or getattr(thing, "__code__", None)
    filename = os.path.realpath(code.co_filename) if code is not None else ""
    return module.split(".")[0] in ("chunkstore", "torch_bridge") or \
        filename.startswith(PACKAGE_DIRS)


def test_the_filter_knows_the_project_from_a_clone_named_like_it() -> None:
    """In a clone named ``chunkstore`` torch's own closures live under
    ``.../chunkstore/.venv/...``: not ours (the test counted them as ours)."""
    clone = os.path.dirname(PACKAGE_DIRS[0].rstrip(os.sep))
    torch_file = os.path.join(clone, ".venv", "lib", "python3.11", "site-packages", "torch",
                              "chunkstore", "nn.py")

    def function_in(filename: str) -> Any:
        def function() -> None: ...
        function.__code__ = function.__code__.replace(co_filename=filename)
        function.__module__ = "elsewhere"
        return function

    assert _from_this_project(function_in(os.path.join(PACKAGE_DIRS[0], "store.py")))
    assert not _from_this_project(function_in(torch_file))
