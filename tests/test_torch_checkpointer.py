"""Checkpointer: async capture, background errors, fallback, mismatches, retention, meta."""

from __future__ import annotations

import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import chunkstore  # noqa: E402
from chunkstore.backends.wrappers import ForwardingBackend  # noqa: E402
from chunkstore.errors import (  # noqa: E402
    IntegrityError,
    InvalidInputError,
    NotSerializableError,
    SelectorError,
)
from chunkstore.format.manifest import TensorEntry  # noqa: E402
from chunkstore.objects.kinds import CHUNKS  # noqa: E402
from torch_bridge import (  # noqa: E402
    AsyncSaveError,
    Checkpointer,
    NotAtUpdateBoundaryWarning,
    RestoreFallbackWarning,
    StateMismatchError,
    StateNotFoundError,
    load,
    save,
)
from torch_bridge.tools.training import DelayedBackend  # noqa: E402

nn = torch.nn
SMALL_CHUNK = 64 * 1024


def _model(seed: int = 0, width: int = 32) -> Any:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, 4))


def _equal_state(a: Any, b: Any) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _train_step(model: Any, optimizer: Any) -> None:
    optimizer.zero_grad()
    model(torch.randn(8, 16)).pow(2).mean().backward()
    optimizer.step()


def _ckpt(path: Path, **kwargs: Any) -> Checkpointer:
    return Checkpointer(path, run="r", chunk_size=SMALL_CHUNK, **kwargs)


class FailingBackend(ForwardingBackend):
    def put_if_absent(self, key: str, data: bytes | memoryview) -> bool:
        raise OSError("disk full (injected)")


class HeldWrites(ForwardingBackend):
    """Every object write waits until ``go`` is set (10 s at most, then fails)."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.go = threading.Event()

    def put_if_absent(self, key: str, data: bytes | memoryview) -> bool:
        assert self.go.wait(10), "an object write was in the save's pause"
        return super().put_if_absent(key, data)


def test_async_save_stores_the_values_at_save_time(tmp_path: Path) -> None:
    """save() returns while no object may be written yet (the write is not in the
    pause: judged by an event, not a clock), and what is stored is the state at save
    time, though training changes it while the write runs."""
    model = _model(width=256)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with _ckpt(tmp_path / "s", async_save=True) as ckpt:
        held = HeldWrites(ckpt.store.backend)
        ckpt.store.backend = held
        assert ckpt.save(1, model=model) is None  # returns with every write held
        with torch.no_grad():  # training goes on while the write runs
            for p in model.parameters():
                p.add_(1.0)
        held.go.set()
        info = ckpt.wait()
        assert info is not None and info.step == 1
        fresh = _model(seed=1, width=256)
        assert ckpt.restore(model=fresh) == 1
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in expected.items())


def test_an_async_save_makes_three_index_write_transactions(tmp_path: Path) -> None:
    """The async path's save commits what a plain save does to the index (each write
    transaction a commit and a sync, counted by LMDB's own transaction id): its
    session with its first claims, the last pack with the nodes, the count-in
    (tests/test_save_transactions.py)."""
    model = _model()
    optimizer = torch.optim.Adam(model.parameters())
    with _ckpt(tmp_path / "s", async_save=True) as ckpt:
        made = []
        for step in range(4):
            _train_step(model, optimizer)
            before = int(ckpt.store.index.env.info()["last_txnid"])
            ckpt.save(step, model=model, optimizer=optimizer)
            ckpt.wait()
            made.append(int(ckpt.store.index.env.info()["last_txnid"]) - before)
    assert max(made[1:]) <= 3, made  # the first one makes the run's


def test_at_most_one_save_is_in_flight(tmp_path: Path) -> None:
    model = _model()
    with _ckpt(tmp_path / "s", async_save=True) as ckpt:
        ckpt.store.backend = DelayedBackend(ckpt.store.backend, 0.05)
        ckpt.save(1, model=model)
        started = time.perf_counter()
        ckpt.save(2, model=model)  # waits for save 1 to be published
        assert time.perf_counter() - started >= 0.05
        assert ckpt.all_steps() == [1]
    with _ckpt(tmp_path / "s") as ckpt:
        assert ckpt.all_steps() == [1, 2]


def test_a_background_error_surfaces_on_the_next_call(tmp_path: Path) -> None:
    model = _model()
    ckpt = _ckpt(tmp_path / "s", async_save=True)
    healthy = ckpt.store.backend
    ckpt.store.backend = FailingBackend(healthy)
    ckpt.save(1, model=model)  # returns: the failure happens in the background
    with pytest.raises(AsyncSaveError, match=r"r@1 failed.*disk full"):
        ckpt.save(2, model=model)
    ckpt.store.backend = healthy
    ckpt.save(3, model=model)
    ckpt.wait()
    ckpt.store.backend = FailingBackend(healthy)
    ckpt.save(4, model=model)
    with pytest.raises(AsyncSaveError, match="r@4"):
        ckpt.wait()
    ckpt.store.backend = healthy
    ckpt.close()
    with _ckpt(tmp_path / "s") as again:
        assert again.all_steps() == [3]


def _corrupt_newest_unique_chunk(store_path: Path) -> None:
    with chunkstore.open(store_path, create=False) as store:
        newest, previous = store.versions("r")[-1], store.versions("r")[-2]

        def chunks(version_id: str) -> set[Any]:
            reader = store.open_version(version_id)
            return {d for e in reader.entries().values() if hasattr(e, "chunk_digests")
                    for d in e.chunk_digests()}

        unique = sorted(chunks(newest.id) - chunks(previous.id), key=lambda d: d.hex)
    target = store_path / CHUNKS.key(unique[0])
    data = bytearray(target.read_bytes())
    data[-1] ^= 0xFF
    target.write_bytes(bytes(data))


def test_restore_falls_back_when_the_newest_version_is_corrupt(tmp_path: Path) -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with _ckpt(tmp_path / "s") as ckpt:
        _train_step(model, optimizer)
        ckpt.save(1, model=model)
        expected = _model(seed=5)
        expected.load_state_dict(model.state_dict())
        _train_step(model, optimizer)
        ckpt.save(2, model=model)
    _corrupt_newest_unique_chunk(tmp_path / "s")
    fresh = _model(seed=9)
    with _ckpt(tmp_path / "s") as ckpt:
        with pytest.warns(RestoreFallbackWarning,
                          match=r"step 2\).*corrupt.*restored step 1.*chunkstore repair"):
            assert ckpt.restore(model=fresh) == 1
        assert _equal_state(fresh, expected)
        with pytest.raises(IntegrityError):
            ckpt.restore(2, model=fresh)  # an explicit step does not fall back


def test_keep_last_one_still_keeps_a_version_to_fall_back_to(tmp_path: Path) -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with _ckpt(tmp_path / "s", keep_last=1) as ckpt:
        for step in (1, 2, 3):
            _train_step(model, optimizer)
            ckpt.save(step, model=model)
            if step == 2:
                expected = _model(seed=5)
                expected.load_state_dict(model.state_dict())
        assert ckpt.all_steps() == [2, 3]
    _corrupt_newest_unique_chunk(tmp_path / "s")
    fresh = _model(seed=9)
    with _ckpt(tmp_path / "s") as ckpt, pytest.warns(RestoreFallbackWarning):
        assert ckpt.restore(model=fresh) == 2
    assert _equal_state(fresh, expected)


def test_restore_without_versions_returns_none(tmp_path: Path) -> None:
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    chunkstore.open(tmp_path / "s", create=True, chunk_size=SMALL_CHUNK).close()  # no version
    with _ckpt(tmp_path / "s") as ckpt:
        assert ckpt.restore(model=model) is None
        assert ckpt.latest_step() is None and ckpt.all_steps() == []
        with pytest.raises(SelectorError, match="no version at step 3"):
            ckpt.restore(3, model=model)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


@pytest.mark.parametrize("change", ["shape", "dtype"])
def test_a_mismatched_model_gets_a_clear_error_and_is_untouched(tmp_path: Path,
                                                                 change: str) -> None:
    with _ckpt(tmp_path / "s") as ckpt:
        ckpt.save(1, model=_model())
        other = _model(seed=3, width=48) if change == "shape" else _model(seed=3).double()
        before = {k: v.clone() for k, v in other.state_dict().items()}
        expected = r"model\['0.weight'\] is float32\[32, 16\] in the checkpoint but " + (
            r"float32\[48, 16\]" if change == "shape" else r"float64\[32, 16\]")
        with pytest.raises(StateMismatchError, match=expected):
            ckpt.restore(model=other)
    assert all(torch.equal(other.state_dict()[k], v) for k, v in before.items())


def test_restore_loads_parameters_in_place(tmp_path: Path) -> None:
    model = _model()
    with _ckpt(tmp_path / "s") as ckpt:
        ckpt.save(1, model=model)
        target = _model(seed=4)
        pointers = [p.data_ptr() for p in target.parameters()]
        ckpt.restore(model=target)
    assert [p.data_ptr() for p in target.parameters()] == pointers
    assert _equal_state(target, model)


def test_unknown_state_key_on_restore(tmp_path: Path) -> None:
    with _ckpt(tmp_path / "s") as ckpt:
        ckpt.save(1, model=_model())
        with pytest.raises(StateNotFoundError, match="no state optimizer"):
            ckpt.restore(model=_model(), optimizer=torch.optim.SGD(_model().parameters(), 0.1))


class Opaque:
    def __init__(self, value: Any) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"ok": 1, "nested": {"fn": self.value}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["nested"]["fn"]


@pytest.mark.parametrize("async_save", [False, True])
def test_unencodable_state_fails_at_save_naming_its_path(tmp_path: Path,
                                                          async_save: bool) -> None:
    with _ckpt(tmp_path / "s", async_save=async_save) as ckpt:
        with pytest.raises(NotSerializableError, match=r"thing\['nested'\]\['fn'\].*function"):
            ckpt.save(1, thing=Opaque(lambda: 0))
        with pytest.raises(InvalidInputError, match="reserved"):
            ckpt.save(1, rng=Opaque(1))
        ckpt.wait()
        assert ckpt.all_steps() == []


def test_plain_state_round_trips_exactly(tmp_path: Path) -> None:
    value = {"t": (1, 2.5, float("nan")), 3: [b"x", None, True], "big": 2**70}
    thing = Opaque(value)
    with _ckpt(tmp_path / "s") as ckpt:
        ckpt.save(1, thing=thing)
        restored = Opaque(None)
        ckpt.restore(thing=restored)
    assert repr(restored.value) == repr(value)


def test_saving_between_backward_and_step_warns(tmp_path: Path) -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with _ckpt(tmp_path / "s") as ckpt:
        _train_step(model, optimizer)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ckpt.save(1, model=model, optimizer=optimizer)  # after step(): a boundary
        model(torch.randn(8, 16)).sum().backward()
        with pytest.warns(NotAtUpdateBoundaryWarning, match="not resume exactly"):
            ckpt.save(2, model=model, optimizer=optimizer)


def test_retention_keeps_the_last_every_kth_and_tagged(tmp_path: Path) -> None:
    model = _model()
    with _ckpt(tmp_path / "s", keep_last=2, keep_every=4) as ckpt:
        for step in range(1, 3):
            ckpt.save(step, model=model)
        ckpt.store.tag("r@1", "first")
        for step in range(3, 10):
            ckpt.save(step, model=model)
        assert ckpt.all_steps() == [1, 4, 8, 9]
    with pytest.raises(InvalidInputError, match="keep_last"):
        _ckpt(tmp_path / "t", keep_last=0)


def test_provenance_and_user_meta_are_recorded(tmp_path: Path) -> None:
    with _ckpt(tmp_path / "s", meta={"dataset": "toy-v2"}) as ckpt:
        info = ckpt.save(1, model=_model())
    assert info is not None
    meta = info.meta
    assert meta["dataset"] == "toy-v2"
    assert meta["torch"] == torch.__version__ and meta["world_size"] == 1
    assert {"python", "numpy", "chunkstore", "host"} <= meta.keys()
    assert "code_rev" in meta and isinstance(meta["code_dirty"], bool)  # the tests run in git


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "float16", "int64", "bool"])
def test_every_dtype_round_trips(tmp_path: Path, dtype: str) -> None:
    source = (torch.randn(33, 7) * 3).to(getattr(torch, dtype))
    state = {"w": source, "scalar": torch.tensor(5)}
    with _ckpt(tmp_path / "s") as ckpt:
        info = ckpt.save(1, weights=state)
        assert info is not None
        entry = ckpt.store.open_version(info.id).entry("weights.w")
        assert entry.dtype == dtype  # type: ignore[union-attr]
        target = {"w": torch.zeros_like(source), "scalar": torch.tensor(0)}
        ckpt.restore(weights=target)
    assert target["w"].view(torch.uint8).equal(source.view(torch.uint8))
    assert target["scalar"].item() == 5


def test_functional_save_and_load(tmp_path: Path) -> None:
    model = _model()
    store_path = tmp_path / "s"
    info = save(store_path, {"model": model.state_dict(), "epoch": 3}, run="manual", step=7)
    assert info.step == 7
    target = _model(seed=2)
    live = {"model": target.state_dict(), "epoch": None}
    loaded = load(store_path, "manual@7", live)
    assert loaded["epoch"] == 3 and live["epoch"] == 3
    assert _equal_state(target, model)  # state_dict tensors alias the parameters


def test_versions_are_ordered_by_step_not_by_a_clock_that_went_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run resumed on a machine whose clock is an hour behind must not lose saves."""
    model = _model()
    with _ckpt(tmp_path / "s", keep_last=2) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, model=model)
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() - 3600)
    with _ckpt(tmp_path / "s", keep_last=2) as ckpt:
        assert ckpt.restore(model=model) == 3
        for step in (4, 5, 6):
            ckpt.save(step, model=model)
        assert ckpt.all_steps() == [5, 6]
        assert ckpt.latest_step() == 6
        assert ckpt.restore(model=model) == 6


def test_unencodable_meta_fails_when_the_checkpointer_is_made(tmp_path: Path) -> None:
    with pytest.raises(NotSerializableError):
        _ckpt(tmp_path / "s", meta={"data_dir": tmp_path})


def test_restore_falls_back_past_versions_whose_delta_base_is_gone(tmp_path: Path) -> None:
    """Async saves of a sparse update write deltas; when the base that step 2
    wrote and step 3 builds on is lost, restore falls back past both to step 1."""
    torch.manual_seed(0)
    model = nn.Embedding(2000, 32)  # 256 KB: four 64 KiB chunks
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    states = []
    chunkstore.open(tmp_path / "s", chunk_size=SMALL_CHUNK, delta_depth=2, create=True).close()
    with _ckpt(tmp_path / "s", async_save=True) as ckpt:
        for step in (1, 2, 3):
            optimizer.zero_grad()
            model(torch.tensor([step, 40 + step])).sum().backward()  # rows in chunk 0
            optimizer.step()
            ckpt.save(step, model=model)
            states.append({k: v.clone() for k, v in model.state_dict().items()})
        ckpt.wait()
    with chunkstore.open(tmp_path / "s", create=False) as store:
        v2, v3 = (store.open_version(f"r@{s}").entry("model.weight") for s in (2, 3))
        assert isinstance(v2, TensorEntry)
        assert isinstance(v3, TensorEntry)
        chain, (at, *_) = v3.shards[0].chain(0), v3.shards[0].chain_locations(0)
        assert chain[0] == v2.shards[0].chunks[0], "step 3 must be a delta on step 2"
        # The object holding the base: step 2's pack (packed deltas), or the base itself.
        (tmp_path / "s" / CHUNKS.key(chain[0] if at is None else at.pack)).unlink()
    fresh = nn.Embedding(2000, 32)
    with _ckpt(tmp_path / "s") as ckpt:
        with pytest.warns(RestoreFallbackWarning, match=r"restored step 1"):
            assert ckpt.restore(model=fresh) == 1
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in states[0].items())


def test_arrays_and_lists_are_restored_in_place_and_plain_values_are_refused(
        tmp_path: Path) -> None:
    """restore(ema=array, history=list) fills the caller's array and list (they stayed
    as they were: the loaded values went to a copy of the targets); an array of another
    shape or dtype is a StateMismatchError, as a tensor's is; an int target, which
    cannot be filled in place, is refused before anything is read."""
    import numpy as np

    from chunkstore.errors import InvalidInputError
    from torch_bridge.errors import StateMismatchError

    with Checkpointer(tmp_path / "s", run="r") as ckpt:
        ckpt.save(7, ema=np.arange(4, dtype=np.float64), history=[1, 2, 3],
                  trainer={"global_step": 7})
        ema, history, trainer = np.zeros(4), [], {"global_step": 0}
        assert ckpt.restore(ema=ema, history=history, trainer=trainer, rng=False) == 7
        assert ema.tolist() == [0.0, 1.0, 2.0, 3.0]
        assert history == [1, 2, 3] and trainer == {"global_step": 7}
        with pytest.raises(StateMismatchError):
            ckpt.restore(ema=np.zeros((7, 7), dtype=np.int8), rng=False)
        with pytest.raises(InvalidInputError, match="in place"):
            ckpt.restore(trainer=0, rng=False)


@pytest.mark.parametrize("section", [
    [1, 2], {"format": 1}, {"format": 1, "states": {"model": [1]}},
    {"format": 1, "states": {"model": {"skeleton": {}}}},
    {"format": 1, "states": {"model": {"skeleton": {}, "tensors": [[["weight"], "w"]]}}},
    {"format": 1, "states": {"model": {"skeleton": {}, "tensors": [
        [["weight"], 5, "torch", "float32", [2, 3]]]}}},
    {"format": 1, "states": {"model": {"skeleton": {}, "tensors": [
        [[["x"]], "model.weight", "torch", "float32", [2, 3]]]}}},
    {"format": 1, "ranks": 5},
], ids=["not a dict", "no states", "section a list", "no tensors", "short record",
        "entry an int", "path unhashable", "ranks an int"])
def test_a_malformed_torch_bridge_section_is_a_corrupt_checkpoint_and_restore_falls_back(
        tmp_path: Path, section: object) -> None:
    """A version whose _torch_bridge section no writer makes (a crafted or damaged
    store) is a CorruptCheckpointError (it was AttributeError, KeyError, TypeError...):
    restore warns and falls back to the version before, and export refuses it typed."""
    import numpy as np

    import chunkstore
    from torch_bridge import CorruptCheckpointError, RestoreFallbackWarning, export_safetensors

    model = torch.nn.Linear(3, 2)
    with Checkpointer(tmp_path / "s", run="tb") as ckpt:
        ckpt.save(1, model=model)
    with chunkstore.open(tmp_path / "s", create=True) as store:
        with store.new_version(run="tb", step=2) as version:
            version.put("model.weight", np.zeros((2, 3), np.float32))
            version.put_data("_torch_bridge", section)
    target = torch.nn.Linear(3, 2)
    with Checkpointer(tmp_path / "s", run="tb") as ckpt, \
            pytest.warns(RestoreFallbackWarning):
        assert ckpt.restore(model=target, rng=False) == 1
    assert torch.equal(target.weight, model.weight)
    with pytest.raises(CorruptCheckpointError):
        export_safetensors(tmp_path / "s", "tb@2", tmp_path / "out.safetensors")


def test_a_restore_that_does_not_fit_touches_nothing(tmp_path: Path) -> None:
    """load_state_dict refuses a module whose state names other entries, or an optimizer
    whose parameter groups differ, only after the tensors were read in place into the
    live model: both are found before anything is read (StateMismatchError), and the
    live tensors stay as they were."""
    from torch_bridge.errors import StateMismatchError

    def model(seed: int, extra: bool) -> torch.nn.Module:
        torch.manual_seed(seed)
        made = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        if extra:
            made.register_buffer("extra", torch.zeros(1))
        return made

    source = model(0, extra=True)
    optimizer = torch.optim.Adam(source.parameters(), lr=1e-3)
    source(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    with Checkpointer(tmp_path / "s", run="r") as ckpt:
        ckpt.save(1, model=source, optimizer=optimizer)
        lacking = model(1, extra=False)  # the checkpoint has a buffer it lacks
        regrouped = model(2, extra=True)  # fits; its optimizer's groups do not
        other = torch.optim.Adam([{"params": [regrouped[0].weight]}, {"params": [
            p for name, p in regrouped.named_parameters() if name != "0.weight"]}])
        for target in ({"model": lacking}, {"model": regrouped, "optimizer": other}):
            live = target["model"]
            before = {k: v.clone() for k, v in live.state_dict().items()}
            with pytest.raises(StateMismatchError):
                ckpt.restore(rng=False, **target)
            assert all(torch.equal(before[k], v) for k, v in live.state_dict().items())


def test_a_module_that_renames_its_keys_on_load_is_still_restored(tmp_path: Path) -> None:
    """The key check before reading applies only where load_state_dict surely refuses
    other keys: a module whose load pre-hook renames old keys (the usual way to read
    checkpoints of an earlier layout) restores as it did."""
    class Renamed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.new = torch.nn.Linear(2, 2)

            def rename(state: dict[str, Any], prefix: str, *args: Any) -> None:
                for name in [k for k in state if k.startswith(prefix + "old.")]:
                    state[prefix + "new." + name[len(prefix + "old."):]] = state.pop(name)
            self._register_load_state_dict_pre_hook(rename)

    class Old(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.old = torch.nn.Linear(2, 2)

    saved = Old()
    with Checkpointer(tmp_path / "s", run="r") as ckpt:
        ckpt.save(1, model=saved)
        target = Renamed()
        assert ckpt.restore(model=target, rng=False) == 1
    assert torch.equal(target.new.weight, saved.old.weight)


@pytest.mark.parametrize("saved, target", [
    ("array", "tensor"), ("tensor", "array"), ("dict", "list"), ("list", "dict")])
def test_a_target_of_another_kind_than_the_saved_state_is_refused(
        tmp_path: Path, saved: str, target: str) -> None:
    """An array saved and a tensor given (or a dict and a list...): the loaded state had
    nowhere to go and the restore returned the step; now a StateMismatchError before
    anything is read.  A read-only array is refused as a target."""
    import numpy as np

    from chunkstore.errors import InvalidInputError
    from torch_bridge.errors import StateMismatchError

    values = {"array": np.arange(3.0), "tensor": torch.arange(3.0), "dict": {"a": 1},
              "list": [1, 2]}
    empty = {"array": np.zeros(3), "tensor": torch.zeros(3), "dict": {}, "list": []}
    with Checkpointer(tmp_path / "s", run="r") as ckpt:
        ckpt.save(1, x=values[saved])
        with pytest.raises(StateMismatchError):
            ckpt.restore(x=empty[target], rng=False)
        frozen = np.zeros(3)
        frozen.flags.writeable = False
        with pytest.raises(InvalidInputError, match="read-only"):
            ckpt.restore(x=frozen, rng=False)


def test_a_step_or_meta_of_the_wrong_type_is_a_typed_error(tmp_path: Path) -> None:
    """restore(step='20') said "no version at step 20; steps: [20]"; meta=[1] failed
    inside the provenance merge."""
    model = _model()
    with pytest.raises(InvalidInputError, match="meta must be a dict"):
        Checkpointer(tmp_path / "s", run="r", meta=[1])  # type: ignore[arg-type]
    with Checkpointer(tmp_path / "s", run="r") as ckpt:
        ckpt.save(20, model=model)
        with pytest.raises(InvalidInputError, match="step must be an integer"):
            ckpt.restore(step="20", model=model)  # type: ignore[arg-type]
        assert ckpt.restore(step=torch.tensor(20).numpy()[()], model=model) == 20


def test_every_error_a_user_can_meet_is_exported_from_the_package() -> None:
    """``from torch_bridge import NotACheckpointError`` failed (it was not exported)."""
    import torch_bridge
    from torch_bridge import errors

    public = {name for name, obj in vars(errors).items()
              if isinstance(obj, type) and issubclass(obj, Warning | Exception)
              and obj.__module__ == errors.__name__ and not name.startswith("_")}
    assert public <= set(torch_bridge.__all__), public - set(torch_bridge.__all__)
    for name in torch_bridge.__all__:
        assert getattr(torch_bridge, name) is not None


def test_a_restore_of_a_run_the_store_lacks_names_the_runs_it_has(tmp_path: Path) -> None:
    """run='mien' for 'mine' restored nothing without a word: training started over.
    It still returns None (a first start looks the same), with a warning naming the
    runs there are; a store with no run at all stays quiet."""
    from torch_bridge import RunNotFoundWarning

    model = _model()
    with Checkpointer(tmp_path / "s", run="mine") as ckpt:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert ckpt.restore(model=model, missing_ok=True) is None  # a first start
        ckpt.save(1, model=model)
    with Checkpointer(tmp_path / "s", run="mien") as typo:
        with pytest.warns(RunNotFoundWarning, match="run 'mien' has no version .* 'mine'"):
            assert typo.restore(model=model) is None


def test_a_closed_checkpointer_says_it_is_closed(tmp_path: Path) -> None:
    """all_steps() after the with block raised LMDB's "operate on closed object"."""
    model = _model()
    with Checkpointer(tmp_path / "s", run="r") as ckpt:
        ckpt.save(1, model=model)
        assert ckpt.all_steps() == [1] and ckpt.latest_step() == 1
    for call in (ckpt.all_steps, ckpt.latest_step, lambda: ckpt.restore(model=model),
                 lambda: ckpt.save(2, model=model)):
        with pytest.raises(InvalidInputError, match="this Checkpointer is closed"):
            call()


@pytest.mark.parametrize("where", ["path_or_url", "mirror"])
def test_a_location_that_is_no_path_url_or_store_is_a_typed_error(tmp_path: Path,
                                                                   where: str) -> None:
    """Checkpointer(mirror=123) raised TypeError from deep inside; nothing is created."""
    arguments: dict[str, object] = {"path_or_url": tmp_path / "s", "mirror": None}
    arguments[where] = 123
    with pytest.raises(InvalidInputError, match=f"{where} must be a path"):
        Checkpointer(arguments.pop("path_or_url"), run="r", **arguments)  # type: ignore[arg-type]
    assert not (tmp_path / "s").exists()
