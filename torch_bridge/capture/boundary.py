"""Is the training state at an optimizer-step boundary?  Gradients tell.

A global optimizer step hook records, for every parameter an optimizer
updated, which gradient tensor (and which in-place version of it) the step
consumed.  A save that finds a non-zero gradient the last step did not
consume is between backward() and step() (or mid-accumulation): restoring it
would not replay the update, so the save warns.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.weak import WeakIdKeyDictionary

_consumed: WeakIdKeyDictionary = WeakIdKeyDictionary()
_hook: list[Any] = []  # the registration handle, once installed


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for group in optimizer.param_groups:
        for param in group["params"]:
            grad = param.grad
            if grad is not None:
                _consumed[param] = (id(grad), grad._version)


def install() -> None:
    """Register the step hook once per process (before the first step it should see)."""
    if not _hook:
        _hook.append(register_optimizer_step_post_hook(_after_step))


def _parameters(objects: Iterable[Any]) -> Iterator[tuple[str, torch.Tensor]]:
    for key, obj in objects:
        if isinstance(obj, torch.nn.Module):
            for name, param in obj.named_parameters():
                yield f"{key}.{name}", param
        elif isinstance(obj, torch.optim.Optimizer):
            for g, group in enumerate(obj.param_groups):
                for i, param in enumerate(group["params"]):
                    yield f"{key} group {g} parameter {i}", param


def unapplied_gradients(objects: Iterable[tuple[str, Any]]) -> list[str]:
    """Names of parameters holding non-zero gradients no optimizer step has consumed.

    A parameter that an optimizer updated before the hook was installed (it
    has optimizer state but no record) cannot be judged and is not reported.
    A parameter both a model and an optimizer hold is judged (and named) once:
    this runs in every save's pause.
    """
    objects = list(objects)
    stepped: set[int] | None = None  # parameters with optimizer state, found when needed
    seen: set[int] = set()
    found = []
    for name, param in _parameters(objects):
        grad = param.grad
        if grad is None or id(param) in seen:
            continue
        seen.add(id(param))
        record = _consumed.get(param)  # type: ignore[no-untyped-call]
        if record == (id(grad), grad._version):
            continue
        if record is None:
            if stepped is None:
                stepped = _stepped(objects)
            if id(param) in stepped:
                continue
        if bool(grad.detach().ne(0).any()):
            found.append(name)
    return found


def _stepped(objects: list[tuple[str, Any]]) -> set[int]:
    return {id(p) for _, obj in objects if isinstance(obj, torch.optim.Optimizer)
            for p, state in obj.state.items() if state}
