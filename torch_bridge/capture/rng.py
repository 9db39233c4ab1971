"""Every random number generator a training step may draw from, captured and restored.

Python's ``random``, numpy's legacy global generator, torch's CPU generator and,
where CUDA is available, every CUDA device's generator.  Generators owned by
user objects (a DataLoader's ``generator``, a ``np.random.Generator``) are not
global: capture them through a Stateful of their own.
"""

from __future__ import annotations

import random
import warnings
from typing import Any

import numpy as np
import torch

from torch_bridge.errors import RngMismatchWarning


def capture_rng() -> dict[str, Any]:
    """The global RNG states as a state tree (tensors and plain data)."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": None,
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Set the global RNGs from :func:`capture_rng`'s tree (after a load)."""
    random.setstate(_as_tuple(state["python"]))
    np.random.set_state(_as_tuple(state["numpy"]))
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is None:
        return
    if not torch.cuda.is_available() or torch.cuda.device_count() != len(cuda):
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        warnings.warn(RngMismatchWarning(
            f"the checkpoint holds RNG states of {len(cuda)} CUDA devices, this process sees"
            f" {have}; CUDA random streams are not restored"), stacklevel=3)
        return
    torch.cuda.set_rng_state_all(list(cuda))


def _as_tuple(value: Any) -> tuple[Any, ...]:
    return tuple(_as_tuple(v) if isinstance(v, list) else v for v in value)
