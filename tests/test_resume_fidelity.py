"""What a resume gives back is what was saved: dict order, every saved state, real tensors."""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import chunkstore
from chunkstore.format import plaindata

DATA = Path(__file__).resolve().parent / "data"


def test_plain_data_keeps_the_order_a_dict_was_built_in(tmp_path: Path) -> None:
    """Plain data was canonical JSON with sorted keys: data-mixture weights came back in
    another order, and a loop drawing from them with the RNG picked differently."""
    weights = {"web": 0.5, "code": 0.3, "books": 0.15, "arxiv": 0.05}
    value = {"mixture": weights, "zeta": 1, "alpha": {3: "x", 1: "y"}, "$odd": [{"b": 1, "a": 2}]}
    assert list(plaindata.decode(plaindata.encode(value))) == list(value)
    with chunkstore.open(tmp_path / "s", create=True) as store:
        with store.new_version("r", 1) as v:
            v.put_data("loader", value)
        back = store.open_version("r@1").get_data("loader")
    assert back == value
    assert list(back) == ["mixture", "zeta", "alpha", "$odd"]
    assert list(back["mixture"]) == list(weights)
    assert list(back["alpha"]) == [3, 1] and list(back["$odd"][0]) == ["b", "a"]

    def draws(mixture: dict[str, float]) -> list[str]:
        rng = random.Random(7)
        return [rng.choices(list(mixture), weights=list(mixture.values()))[0]
                for _ in range(20)]

    assert draws(back["mixture"]) == draws(weights)


def _fixture(name: str, tmp_path: Path) -> Path:
    copy = tmp_path / name
    shutil.copytree(DATA / name, copy)
    return copy


def test_old_stores_read_back_sorted_and_the_new_fixture_in_order(tmp_path: Path) -> None:
    written = ["epoch", "lr", "name", "none", "flags", "betas", "blob", "nan", "inf", "ninf",
               "big", "neg"]
    with chunkstore.open(_fixture("store-v9", tmp_path)) as store:
        assert list(store.open_version("fmt@1").get_data("trainer")) == written
    with chunkstore.open(_fixture("store-v8", tmp_path)) as store:
        assert list(store.open_version("fmt@1").get_data("trainer")) == sorted(written)


def test_equal_dicts_in_another_order_are_other_bytes_the_same_order_the_same() -> None:
    assert plaindata.encode({"a": 1, "b": 2}) != plaindata.encode({"b": 2, "a": 1})
    assert plaindata.encode({"a": 1, "b": np.int64(2)}) == plaindata.encode({"a": 1, "b": 2})


torch = pytest.importorskip("torch")


class Mixture:
    """A loader state: its weights' order decides what the RNG picks."""

    def __init__(self, weights: dict[str, float]) -> None:
        self.weights = weights

    def state_dict(self) -> dict[str, Any]:
        return {"weights": self.weights}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.weights = state["weights"]


def test_a_checkpointer_restores_a_dict_in_its_order(tmp_path: Path) -> None:
    from torch_bridge import Checkpointer

    with Checkpointer(tmp_path / "s", run="r") as ckpt:
        ckpt.save(1, mixture=Mixture({"web": 0.6, "code": 0.3, "books": 0.1}))
        restored = Mixture({})
        assert ckpt.restore(mixture=restored) == 1
    assert list(restored.weights) == ["web", "code", "books"]


def _trainer(seed: int = 0) -> tuple[Any, Any, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    return model, opt, sched


def test_a_restore_that_leaves_saved_states_warns_naming_them(tmp_path: Path) -> None:
    """restore(model=m) of a version holding the optimizer and scheduler said nothing:
    the run resumed with a fresh optimizer."""
    import warnings

    from torch_bridge import Checkpointer, PartialRestoreWarning

    model, opt, sched = _trainer()
    with Checkpointer(tmp_path / "s", run="r") as ckpt:
        ckpt.save(1, model=model, optimizer=opt, scheduler=sched)
        fresh, fresh_opt, fresh_sched = _trainer(1)
        with pytest.warns(PartialRestoreWarning, match=r"r@1\) also holds state\(s\)"
                          r" 'optimizer', 'scheduler', which were not restored") as caught:
            assert ckpt.restore(model=fresh) == 1
        assert [w.message.states for w in caught  # type: ignore[union-attr]
                if isinstance(w.message, PartialRestoreWarning)] == [["optimizer", "scheduler"]]
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # everything asked for; rng=False leaves RNGs alone
            assert ckpt.restore(model=fresh, optimizer=fresh_opt, scheduler=fresh_sched) == 1
            assert ckpt.restore(model=fresh, optimizer=fresh_opt, scheduler=fresh_sched,
                                rng=False) == 1


def test_restoring_onto_a_module_on_the_meta_device_is_refused(tmp_path: Path) -> None:
    """A module built under torch.device("meta") took the restore without a word and
    kept no data at all."""
    from torch_bridge import Checkpointer, MetaDeviceError

    model, _, _ = _trainer()
    with Checkpointer(tmp_path / "s", run="r") as ckpt:
        ckpt.save(1, model=model)
        with torch.device("meta"):
            lazy = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(),
                                       torch.nn.Linear(4, 2))
        with pytest.raises(MetaDeviceError, match=r"model\['0\.weight'\].* are on the meta"
                           r" device.*to_empty") as raised:
            ckpt.restore(model=lazy)
        assert len(raised.value.paths) == 4
        lazy.to_empty(device="cpu")
        assert ckpt.restore(model=lazy) == 1
    assert all(torch.equal(a, b) for a, b in zip(lazy.state_dict().values(),
                                                  model.state_dict().values(), strict=True))
