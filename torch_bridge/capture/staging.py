"""Host staging buffers for async saves, reused from one save to the next.

The training pause of an async save is one copy of every tensor into these
buffers (pinned memory when the source is on CUDA, so device-to-host copies
run at full speed and without an extra bounce); the background thread then
hashes, compresses and writes from them while training mutates the originals.
A buffer is reused while its entry keeps shape and dtype, so after the first
save the copy touches no newly allocated memory.

A training loop saves the same state every time, and the pause of a state of
many small tensors is mostly per-tensor Python work.  So a save whose entries
and values (type, dtype, shape, device) are exactly those of the previous
save, all on the CPU, copies every tensor in one ``torch._foreach_copy_``:
one call that runs ``copy_`` per pair in C++, with the same semantics as the
per-tensor path (``copy_`` resolves conjugate and negative views and reads any
strides).  Every other save (the first, a changed shape or dtype, a tensor on
a GPU) takes the per-tensor path, which also allocates the buffers.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from torch_bridge.capture.tensors import as_array

Array = tuple[np.ndarray, str | None]
Value = torch.Tensor | np.ndarray
# Private, but what torch's own optimizers copy lists of tensors with; checked for at
# import so a torch without it copies one by one.
_foreach_copy = getattr(torch, "_foreach_copy_", None)


def _layout(values: list[Value]) -> list[tuple[Any, ...]]:
    """What a batch copy relies on, per value: nothing but these may differ between saves
    (a copy_ into a buffer of another shape or dtype would broadcast or cast silently)."""
    # numpy arrays have no ``device`` before numpy 2.0 (and need none: they are on the host)
    return [(type(v), v.dtype, v.shape, v.device if isinstance(v, torch.Tensor) else None)
            for v in values]


class _Batch:
    """The previous save, when every value was a CPU tensor or a numpy array: what to
    compare the next save with, and where each of its values goes."""

    def __init__(self, entries: list[str], layout: list[tuple[Any, ...]],
                 targets: list[torch.Tensor | np.ndarray], arrays: list[Array]) -> None:
        self.entries = entries
        self.layout = layout
        self.tensors: list[int] = []  # positions of the tensors among the values
        self.buffers: list[torch.Tensor] = []  # and their buffers
        self.numpy: list[tuple[int, np.ndarray]] = []  # numpy arrays and their buffers
        for i, target in enumerate(targets):
            if isinstance(target, torch.Tensor):
                self.tensors.append(i)
                self.buffers.append(target)
            else:
                self.numpy.append((i, target))
        self.arrays = arrays

    def copy(self, values: list[Value]) -> list[Array]:
        sources: list[Any] = [values[i] for i in self.tensors]  # tensors, as the layout says
        _copy_all(self.buffers, sources)
        for i, array in self.numpy:
            np.copyto(array, values[i])
        return list(self.arrays)


def _copy_all(buffers: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """One torch._foreach_copy_ where torch has it and takes the lists, else copy_ per pair."""
    if _foreach_copy is not None and sources:  # it refuses empty lists
        try:
            _foreach_copy(buffers, sources)
            return
        except RuntimeError:  # a private API: where it refuses, the pairs one by one
            pass
    for buffer, source in zip(buffers, sources, strict=True):
        buffer.copy_(source)


class StagingBuffers:
    """Entry name -> host buffer; only one save may use them at a time."""

    def __init__(self) -> None:
        # A tensor's buffer with its numpy view, made once: the pause of a save of a
        # state of many small tensors is mostly per-tensor work, so a reused buffer
        # costs one copy_ and nothing else.
        self._tensors: dict[str, tuple[torch.Tensor, Array]] = {}
        self._arrays: dict[str, np.ndarray] = {}
        self._batch: _Batch | None = None
        self.bytes = 0

    def stage(self, entries: list[str], values: list[Value]) -> list[Array]:
        """Copy ``values`` into the buffers; returns the arrays to store (views of buffers)."""
        layout = _layout(values)
        batch = self._batch
        with torch.no_grad():  # copies into buffers, never recorded by autograd
            if batch is not None and entries == batch.entries and layout == batch.layout:
                return batch.copy(values)
            return self._stage_each(entries, values, layout)

    def _stage_each(self, entries: list[str], values: list[Value],
                    layout: list[tuple[Any, ...]]) -> list[Array]:
        arrays: list[Array] = []
        targets: list[torch.Tensor | np.ndarray] = []
        devices: set[torch.device] = set()
        tensors: dict[str, tuple[torch.Tensor, Array]] = {}
        numpy_arrays: dict[str, np.ndarray] = {}
        for entry, value in zip(entries, values, strict=True):
            if isinstance(value, np.ndarray):
                buffer = self._arrays.get(entry)
                if (buffer is None or buffer.shape != value.shape
                        or buffer.dtype != value.dtype):
                    buffer = np.empty(value.shape, value.dtype)
                np.copyto(buffer, value)
                numpy_arrays[entry] = buffer
                arrays.append((buffer, None))
                targets.append(buffer)
                continue
            slot = self._slot(entry, value)
            source = value
            if source.is_conj():
                source = source.resolve_conj()
            if source.is_neg():
                source = source.resolve_neg()
            cuda = source.device.type == "cuda"
            if cuda:
                devices.add(source.device)
            slot[0].copy_(source, non_blocking=cuda)
            tensors[entry] = slot
            arrays.append(slot[1])
            targets.append(slot[0])
        for device in devices:  # every GPU the state lives on, not only the current one
            torch.cuda.synchronize(device)  # non-blocking copies land before the writer reads
        self._tensors, self._arrays = tensors, numpy_arrays  # drop buffers no longer used
        self.bytes = sum(t.nbytes for t, _ in tensors.values()) + sum(
            a.nbytes for a in numpy_arrays.values())
        on_cpu = all(type(v) is np.ndarray or (type(v) is torch.Tensor and v.device.type == "cpu")
                     for v in values)
        self._batch = _Batch(list(entries), layout, targets, list(arrays)) if on_cpu else None
        return arrays

    def _slot(self, entry: str, value: torch.Tensor) -> tuple[torch.Tensor, Array]:
        slot = self._tensors.get(entry)
        if slot is not None and slot[0].shape == value.shape and slot[0].dtype == value.dtype:
            return slot
        pin = value.device.type == "cuda" and torch.cuda.is_available()
        buffer = torch.empty(tuple(value.shape), dtype=value.dtype, pin_memory=pin)
        return buffer, as_array(buffer)
