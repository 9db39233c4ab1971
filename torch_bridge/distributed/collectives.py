"""Plain data between the ranks of a process group, never pickled.

``torch.distributed``'s ``*_object`` collectives pickle what they send and
unpickle what they receive.  The Checkpointer's protocol (:mod:`torch_bridge.distributed.ranks`)
exchanges plans, chunk lists and verdicts instead as chunkstore's safe plain-data
encoding (:mod:`chunkstore.format.plaindata`) in ``uint8`` tensors: a rank runs no code
another rank sent.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from chunkstore.format import plaindata


def process_group_active() -> bool:
    """Whether this process is a rank of an initialised default process group."""
    return dist.is_available() and dist.is_initialized()


def rank_and_world() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def _device(group: Any = None) -> torch.device:
    """Where the backend exchanges tensors: NCCL only moves CUDA tensors."""
    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_bytes(data: bytes, group: Any = None) -> list[bytes]:
    """Every rank's ``data``, in rank order, on every rank (of ``group``; None: the
    default group).

    A collective: every rank of the group must call it, in the same order as
    every other collective of the group.
    """
    world = dist.get_world_size(group)
    device = _device(group)
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lengths = [torch.zeros_like(length) for _ in range(world)]
    dist.all_gather(lengths, length, group=group)
    sizes = [int(n.item()) for n in lengths]
    longest = max(*sizes, 1)
    mine = torch.zeros(longest, dtype=torch.uint8)
    if data:
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    gathered = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(gathered, mine.to(device), group=group)
    return [buffer[:size].cpu().numpy().tobytes()
            for buffer, size in zip(gathered, sizes, strict=True)]


def all_gather_plain(value: object, group: Any = None) -> list[Any]:
    """Every rank's ``value`` (plain data, encoded by :mod:`chunkstore.format.plaindata`), in
    rank order, on every rank; a collective, like :func:`all_gather_bytes`."""
    return [plaindata.decode(data) for data in all_gather_bytes(plaindata.encode(value), group)]
