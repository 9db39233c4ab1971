"""Torch tensors as numpy arrays chunkstore can store, and back, without copies.

A tensor is stored as its raw bytes under chunkstore's dtype name.  Dtypes
numpy lacks (bfloat16, the float8 family) travel as a same-size integer view
with the dtype name as an override, so the stored entry says ``bfloat16``.
"""

from __future__ import annotations

import numpy as np
import torch

from chunkstore.errors import UnsupportedDtypeError

# torch dtype -> (chunkstore dtype name, integer dtype to view through or None)
_BY_TORCH: dict[torch.dtype, tuple[str, torch.dtype | None]] = {
    torch.bool: ("bool", None),
    torch.uint8: ("uint8", None),
    torch.int8: ("int8", None),
    torch.int16: ("int16", None),
    torch.int32: ("int32", None),
    torch.int64: ("int64", None),
    torch.float16: ("float16", None),
    torch.float32: ("float32", None),
    torch.float64: ("float64", None),
    torch.complex64: ("complex64", None),
    torch.complex128: ("complex128", None),
    torch.bfloat16: ("bfloat16", torch.int16),
    torch.float8_e4m3fn: ("float8_e4m3fn", torch.uint8),
    torch.float8_e5m2: ("float8_e5m2", torch.uint8),
    torch.float8_e4m3fnuz: ("float8_e4m3fnuz", torch.uint8),
    torch.float8_e5m2fnuz: ("float8_e5m2fnuz", torch.uint8),
}
for _name in ("uint16", "uint32", "uint64"):
    if hasattr(torch, _name):
        _BY_TORCH[getattr(torch, _name)] = (_name, None)
_BY_NAME = {name: dtype for dtype, (name, _) in _BY_TORCH.items()}
#: torch dtype -> chunkstore dtype name, for every dtype stored (one lookup per tensor).
STORED_NAMES: dict[torch.dtype, str] = {dtype: name for dtype, (name, _) in _BY_TORCH.items()}


def stored_name(dtype: torch.dtype) -> str:
    """chunkstore's dtype name for a torch dtype; UnsupportedDtypeError if it has none."""
    try:
        return _BY_TORCH[dtype][0]
    except KeyError:
        raise UnsupportedDtypeError(str(dtype).removeprefix("torch."),
                                    f"torch dtypes stored: {', '.join(sorted(_BY_NAME))}"
                                    ) from None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype stored under chunkstore's dtype ``name``."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise UnsupportedDtypeError(name, "torch has no dtype of that name") from None


def check_storable(tensor: torch.Tensor) -> str | None:
    """Why ``tensor`` cannot be stored as plain bytes, or None when it can."""
    if tensor.layout != torch.strided:
        return f"layout {tensor.layout} (only dense tensors are stored; call .to_dense())"
    if tensor.is_meta:  # not device.type: building a device object costs more than a copy
        return "it is on the meta device (it has no data)"
    if tensor.dtype not in _BY_TORCH:
        return f"dtype {tensor.dtype} has no stable byte format here"
    return None


def as_array(tensor: torch.Tensor) -> tuple[np.ndarray, str | None]:
    """A numpy view of a CPU, C-contiguous tensor plus the dtype override to store it under."""
    name, view_as = _BY_TORCH[tensor.dtype]
    if view_as is not None:
        return tensor.detach().view(view_as).numpy(), name
    return tensor.detach().numpy(), None


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor itself when it is a plain CPU C-contiguous tensor, else a CPU copy."""
    tensor = tensor.detach()
    if tensor.is_conj():
        tensor = tensor.resolve_conj()
    if tensor.is_neg():
        tensor = tensor.resolve_neg()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    return tensor.contiguous()


def readable_in_place(tensor: torch.Tensor) -> bool:
    """Whether chunk data can be read straight into the tensor's memory."""
    return (tensor.device.type == "cpu" and tensor.is_contiguous() and not tensor.is_conj()
            and not tensor.is_neg() and tensor.layout == torch.strided)
