"""The training pause of a save: async (staging copy) vs sync vs a plain memcpy of the state.

The state is a model plus its Adam moments (what a Checkpointer saves).
Between saves every tensor changes (an optimizer step), so each save writes
new data.  Figures are medians over ``--repeat`` saves after a warm-up save
(the first async save also allocates the staging buffers; reported apart).
Usage::

    python benchmarks/bench_pause.py --mib 256 --repeat 5 --out benchmarks/results/pause.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from torch_bridge import Checkpointer


def build(mib: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Square layers holding about mib/3 MiB of parameters (Adam adds twice that)."""
    width = 2048
    layers = max(1, round(mib * (1 << 20) / 3 / (width * width * 4)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    step(model, optimizer)
    return model, optimizer


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad(set_to_none=True)
    model(torch.randn(4, 2048)).square().mean().backward()
    optimizer.step()


def state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer
                  ) -> list[torch.Tensor]:
    tensors = list(model.state_dict().values())
    for state in optimizer.state_dict()["state"].values():
        tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    return tensors


def median_of(fn: Callable[[], object], repeat: int, before: Callable[[], object]) -> float:
    times = []
    for _ in range(repeat):
        before()
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def run(mib: int, repeat: int, root: Path) -> dict[str, Any]:
    model, optimizer = build(mib)
    tensors = state_tensors(model, optimizer)
    state_bytes = sum(t.nbytes for t in tensors)
    buffers = [torch.empty_like(t) for t in tensors]

    def memcpy() -> None:
        for buffer, tensor in zip(buffers, tensors, strict=True):
            buffer.copy_(tensor)

    memcpy()  # fault the buffers in, as the staging buffers are after the first save
    results: dict[str, Any] = {"state_bytes": state_bytes,
                               "memcpy_s": median_of(memcpy, repeat, lambda: None)}
    train = lambda: step(model, optimizer)  # noqa: E731

    with Checkpointer(root / "async", run="bench", async_save=True) as ckpt:
        started = time.perf_counter()
        ckpt.save(0, model=model, optimizer=optimizer)
        results["async_first_pause_s"] = time.perf_counter() - started
        ckpt.wait()
        counter = iter(range(1, 10_000))

        def async_save() -> None:
            ckpt.save(next(counter), model=model, optimizer=optimizer)

        def settle() -> None:
            ckpt.wait()  # nothing in flight: the pause is the copy alone
            train()

        results["async_pause_s"] = median_of(async_save, repeat, settle)
        started = time.perf_counter()
        ckpt.wait()
        results["async_background_tail_s"] = time.perf_counter() - started

    with Checkpointer(root / "sync", run="bench") as ckpt:
        counter = iter(range(10_000))
        results["sync_save_s"] = median_of(
            lambda: ckpt.save(next(counter), model=model, optimizer=optimizer), repeat, train)
    results["async_pause_over_memcpy"] = results["async_pause_s"] / results["memcpy_s"]
    results["sync_save_over_memcpy"] = results["sync_save_s"] / results["memcpy_s"]
    results["memcpy_gb_per_s"] = state_bytes / results["memcpy_s"] / 1e9
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="state size in MiB")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dir", help="where to put the stores (default: a temp dir)")
    parser.add_argument("--out", default="benchmarks/results/pause.json")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-pause-", dir=args.dir) as tmp:
        results = run(args.mib, args.repeat, Path(tmp))
    results.update({"mib": args.mib, "repeat": args.repeat, "torch": torch.__version__,
                    "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "machine": platform.machine()})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
