"""torch_bridge: PyTorch training state in and out of a chunkstore store.

A thin adapter: capture state (tensors and plain data) -> chunkstore.

>>> from torch_bridge import Checkpointer
>>> with Checkpointer("ckpts/", run="exp1", keep_last=3, async_save=True) as ckpt:
...     step = ckpt.restore(model=model, optimizer=opt, missing_ok=True) or 0
...     ckpt.save(step, model=model, optimizer=opt)

Names are imported lazily, so ``import torch_bridge.tools.cli`` (and through it the
``chunkstore`` command) loads torch only when a command needs it.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Checkpointer": "torch_bridge.checkpointer",
    "ResumableSampler": "torch_bridge.capture.sampler",
    "save": "torch_bridge.functional",
    "load": "torch_bridge.functional",
    "export_safetensors": "torch_bridge.tools.export",
    "export_artifact": "torch_bridge.tools.artifact",
    "AsyncSaveError": "torch_bridge.errors",
    "AsyncSaveUnderProcessGroupError": "torch_bridge.errors",
    "CorruptCheckpointError": "torch_bridge.errors",
    "NotACheckpointError": "torch_bridge.errors",
    "RanksDisagreeError": "torch_bridge.errors",
    "RanksFailedError": "torch_bridge.errors",
    "WorldSizeMismatchError": "torch_bridge.errors",
    "StateMismatchError": "torch_bridge.errors",
    "StateNotFoundError": "torch_bridge.errors",
    "NotAtUpdateBoundaryWarning": "torch_bridge.errors",
    "RestoreFallbackWarning": "torch_bridge.errors",
    "RngMismatchWarning": "torch_bridge.errors",
    "RunNotFoundWarning": "torch_bridge.errors",
    "PartialRestoreWarning": "torch_bridge.errors",
    "MetaDeviceError": "torch_bridge.errors",
    "PickleRefusedError": "torch_bridge.errors",
}

__all__ = [
    "AsyncSaveError",
    "AsyncSaveUnderProcessGroupError",
    "Checkpointer",
    "CorruptCheckpointError",
    "MetaDeviceError",
    "NotACheckpointError",
    "NotAtUpdateBoundaryWarning",
    "PartialRestoreWarning",
    "PickleRefusedError",
    "RanksDisagreeError",
    "RanksFailedError",
    "RestoreFallbackWarning",
    "ResumableSampler",
    "RngMismatchWarning",
    "RunNotFoundWarning",
    "StateMismatchError",
    "StateNotFoundError",
    "WorldSizeMismatchError",
    "export_artifact",
    "export_safetensors",
    "load",
    "save",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'torch_bridge' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return list(__all__)
