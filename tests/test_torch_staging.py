"""Staging buffers of async saves: the batch copy of a save that repeats the previous one's
layout, and every change that must leave it for the per-tensor path."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch_bridge import Checkpointer  # noqa: E402
from torch_bridge.capture import staging  # noqa: E402
from torch_bridge.capture.staging import StagingBuffers  # noqa: E402

ENTRIES = ["s.a", "s.b", "s.c", "s.rng"]


def _values(seed: int) -> list[Any]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 5, generator=gen), torch.randn(7, generator=gen),
            torch.randint(0, 100, (3,), generator=gen, dtype=torch.int64),
            np.arange(6, dtype=np.uint32) + seed]


def _expected(value: Any) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value.copy()
    return value.detach().resolve_conj().resolve_neg().contiguous().numpy().copy()


def _check(arrays: list[tuple[np.ndarray, str | None]], values: list[Any]) -> None:
    assert len(arrays) == len(values)
    for (array, _), value in zip(arrays, values, strict=True):
        expected = _expected(value)
        assert array.dtype == expected.dtype and array.shape == expected.shape
        assert array.tobytes() == expected.tobytes()


def test_a_repeated_layout_is_copied_in_one_batch_into_the_same_buffers() -> None:
    buffers = StagingBuffers()
    first = buffers.stage(ENTRIES, _values(0))
    assert buffers._batch is not None
    second_values = _values(1)
    second = buffers.stage(ENTRIES, second_values)
    _check(second, second_values)
    for (a, _), (b, _) in zip(first, second, strict=True):
        assert a is b  # the same buffers, no allocation after the first save


def test_sources_that_require_grad_leave_the_buffers_out_of_autograd() -> None:
    buffers = StagingBuffers()
    values = [v.requires_grad_() if isinstance(v, torch.Tensor) and v.is_floating_point()
              else v for v in _values(0)]
    buffers.stage(ENTRIES, values)
    buffers.stage(ENTRIES, values)
    assert all(not b.requires_grad for b in buffers._batch.buffers)  # type: ignore[union-attr]


CHANGES: dict[str, Callable[[list[Any]], list[Any]]] = {
    "shape": lambda v: [torch.randn(5, 4), *v[1:]],
    "dtype": lambda v: [v[0].double(), *v[1:]],
    "int dtype": lambda v: [v[0], v[1], v[2].int(), v[3]],
    "numpy dtype": lambda v: [*v[:3], v[3].astype(np.int64)],
    "numpy shape": lambda v: [*v[:3], np.arange(7, dtype=np.uint32)],
    "tensor to numpy": lambda v: [v[0].numpy().copy(), *v[1:]],
    "numpy to tensor": lambda v: [*v[:3], torch.from_numpy(v[3].astype(np.int64))],
    "non-contiguous": lambda v: [torch.randn(5, 4).t(), *v[1:]],
    "strided view": lambda v: [v[0], torch.randn(14)[::2], *v[2:]],
    "negative view": lambda v: [v[0], torch.randn(7, dtype=torch.complex64).conj().imag,
                                *v[2:]],
    "zero-dim": lambda v: [v[0], v[1], torch.tensor(3, dtype=torch.int64), v[3]],
    "parameter": lambda v: [torch.nn.Parameter(v[0] + 1), *v[1:]],
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_every_change_between_saves_is_staged_bit_exact(change: str) -> None:
    buffers = StagingBuffers()
    first = _values(0)
    _check(buffers.stage(ENTRIES, first), first)
    changed = CHANGES[change](_values(1))
    _check(buffers.stage(ENTRIES, changed), changed)
    again = CHANGES[change](_values(2))  # the changed layout repeated: the batch again
    _check(buffers.stage(ENTRIES, again), again)
    _check(buffers.stage(ENTRIES, first), first)  # and back


def test_conjugate_views_are_staged_resolved() -> None:
    entries = ["s.z", "s.w"]
    z = torch.randn(3, 4, dtype=torch.complex64)
    buffers = StagingBuffers()
    for values in ([z, z.clone()], [z.conj(), z], [z.conj(), z.conj()], [z, z.conj()]):
        _check(buffers.stage(entries, values), values)


def test_renamed_entries_get_their_own_buffers() -> None:
    buffers = StagingBuffers()
    values = _values(0)
    first = buffers.stage(ENTRIES, values)
    renamed = ["s.b", "s.a", "s.c", "s.rng"]
    swapped = [values[1], values[0], *values[2:]]
    second = buffers.stage(renamed, swapped)
    _check(second, swapped)
    assert second[0][0] is not first[0][0]


def test_fewer_or_more_values_than_entries_are_refused() -> None:
    buffers = StagingBuffers()
    values = _values(0)
    buffers.stage(ENTRIES, values)
    with pytest.raises(ValueError):
        buffers.stage(ENTRIES, values[:3])
    with pytest.raises(ValueError):
        buffers.stage(ENTRIES[:3], values)


def test_a_refused_batch_copy_falls_back_to_one_copy_per_tensor(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(buffers: list[Any], sources: list[Any]) -> None:
        raise RuntimeError("refused (injected)")

    buffers = StagingBuffers()
    buffers.stage(ENTRIES, _values(0))
    monkeypatch.setattr(staging, "_foreach_copy", refuse)
    values = _values(1)
    _check(buffers.stage(ENTRIES, values), values)
    monkeypatch.setattr(staging, "_foreach_copy", None)
    values = _values(2)
    _check(buffers.stage(ENTRIES, values), values)


def test_a_state_of_numpy_arrays_alone_is_staged_again() -> None:
    buffers = StagingBuffers()
    for seed in range(3):
        values = [np.full(3, seed, np.float32), np.arange(4) * seed]
        _check(buffers.stage(["s.x", "s.y"], values), values)


# --- through the Checkpointer -------------------------------------------------------------

def _state(step: int) -> dict[str, Any]:
    """A state whose tensors change every step and, at some steps, change shape, dtype or
    become views the staging copy must resolve."""
    gen = torch.Generator().manual_seed(step)
    weight = torch.randn(6, 4, generator=gen)
    state: dict[str, Any] = {
        "weight": weight.t() if step % 3 == 1 else weight,  # non-contiguous at some steps
        "bias": torch.randn(4 + (step >= 4), generator=gen),  # grows at step 4
        "steps": torch.tensor(step, dtype=torch.int64 if step < 5 else torch.int32),
        "z": torch.randn(3, dtype=torch.complex64, generator=gen),
        "table": np.arange(5, dtype=np.float64) * step,
        "lr": 0.1 * step,
    }
    if step % 2:
        state["z"] = state["z"].conj()
    return state


def _snapshot(state: dict[str, Any]) -> dict[str, Any]:
    return {k: (_expected(v) if isinstance(v, (torch.Tensor, np.ndarray)) else v)
            for k, v in state.items()}


def test_async_saves_restore_each_step_bit_exact_through_changes(tmp_path: Path) -> None:
    saved = {}
    with Checkpointer(tmp_path / "s", run="r", async_save=True) as ckpt:
        for step in range(8):
            live = _state(step)
            ckpt.save(step, thing=live)
            saved[step] = _snapshot(live)
            for value in live.values():  # training goes on mutating the originals
                if isinstance(value, torch.Tensor) and not value.is_conj():
                    value.add_(1) if value.is_floating_point() else value.fill_(-7)
                elif isinstance(value, np.ndarray):
                    np.add(value, 1000, out=value)
        ckpt.wait()
        for step, expected in saved.items():
            target: dict[str, Any] = {}
            assert ckpt.restore(step, rng=False, thing=target) == step
            assert target.keys() == expected.keys()
            for key, value in expected.items():
                got = target[key]
                if isinstance(value, np.ndarray):
                    got = got if isinstance(got, np.ndarray) else _expected(got)
                    assert got.dtype == value.dtype and got.shape == value.shape, key
                    assert got.tobytes() == value.tobytes(), (step, key)
                else:
                    assert got == value, (step, key)


class _NoDevice(np.ndarray):
    """An array as numpy before 2.0 makes one: reading ``device`` is an AttributeError."""

    @property
    def device(self) -> object:
        raise AttributeError("'numpy.ndarray' object has no attribute 'device'")


def test_numpy_arrays_without_a_device_attribute_are_staged() -> None:
    """numpy 1.x arrays have no ``device``; every save holds numpy's RNG state, so an
    async save must stage them without asking (it raised AttributeError on numpy 1.x)."""
    staging = StagingBuffers()
    for step in range(3):
        array = (np.arange(12, dtype=np.int64) + step).view(_NoDevice)
        tensor = torch.full((3,), float(step))
        arrays = staging.stage(["a", "t"], [array, tensor])
        assert np.array_equal(arrays[0][0], np.arange(12) + step)
        assert np.array_equal(arrays[1][0], np.full(3, float(step), dtype=np.float32))
