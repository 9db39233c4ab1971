"""Host staging buffers for async saves, reused from one save to the next.

The training pause of an async save is one copy of every tensor into these
buffers (pinned memory when the source is on CUDA, so device-to-host copies
run at full speed and without an extra bounce); the background thread then
hashes, compresses and writes from them while training mutates the originals.
A buffer is reused while its entry keeps shape and dtype, so after the first
save the copy touches no newly allocated memory.
"""

from __future__ import annotations

import numpy as np
import torch

from torch_bridge.tensors import as_array


class StagingBuffers:
    """Entry name -> host buffer; only one save may use them at a time."""

    def __init__(self) -> None:
        # A tensor's buffer with its numpy view, made once: the pause of a save of a
        # state of many small tensors is mostly per-tensor work, so a reused buffer
        # costs one copy_ and nothing else.
        self._tensors: dict[str, tuple[torch.Tensor, tuple[np.ndarray, str | None]]] = {}
        self._arrays: dict[str, np.ndarray] = {}
        self.bytes = 0

    def stage(self, entries: list[str], values: list[torch.Tensor | np.ndarray]
              ) -> list[tuple[np.ndarray, str | None]]:
        """Copy ``values`` into the buffers; returns the arrays to store (views of buffers)."""
        arrays: list[tuple[np.ndarray, str | None]] = []
        devices: set[torch.device] = set()
        tensors: dict[str, tuple[torch.Tensor, tuple[np.ndarray, str | None]]] = {}
        numpy_arrays: dict[str, np.ndarray] = {}
        with torch.no_grad():  # copies into buffers, never recorded by autograd
            for entry, value in zip(entries, values, strict=True):
                if isinstance(value, np.ndarray):
                    buffer = self._arrays.get(entry)
                    if (buffer is None or buffer.shape != value.shape
                            or buffer.dtype != value.dtype):
                        buffer = np.empty(value.shape, value.dtype)
                    np.copyto(buffer, value)
                    numpy_arrays[entry] = buffer
                    arrays.append((buffer, None))
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
        for device in devices:  # every GPU the state lives on, not only the current one
            torch.cuda.synchronize(device)  # non-blocking copies land before the writer reads
        self._tensors, self._arrays = tensors, numpy_arrays  # drop buffers no longer used
        self.bytes = sum(t.nbytes for t, _ in tensors.values()) + sum(
            a.nbytes for a in numpy_arrays.values())
        return arrays

    def _slot(self, entry: str, value: torch.Tensor
              ) -> tuple[torch.Tensor, tuple[np.ndarray, str | None]]:
        slot = self._tensors.get(entry)
        if slot is not None and slot[0].shape == value.shape and slot[0].dtype == value.dtype:
            return slot
        pin = value.device.type == "cuda" and torch.cuda.is_available()
        buffer = torch.empty(tuple(value.shape), dtype=value.dtype, pin_memory=pin)
        return buffer, as_array(buffer)
