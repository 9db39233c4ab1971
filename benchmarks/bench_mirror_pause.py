"""The training pause of an async save with a mirror, against none (issue 46, item 7).

Four ways, each a fresh ``Checkpointer(async_save=True)`` saving one model in turn:
``none`` (no mirror), ``up`` (a mirror in another directory, copying as it goes),
``refused`` (an ``s3://`` mirror whose endpoint is a port with nothing listening) and
``blackholed`` (an ``s3://`` mirror whose endpoint accepts connections and never
answers).  Before each save the "training" changes every weight, and after it waits
``--gap`` seconds, longer than a save's background write, so the pause measured is the
``save()`` call itself: the copy into the staging buffers, plus whatever the mirror
makes the training thread wait for.  The four Checkpointers are open at once and
save in turn, step by step, the first way rotating, in this one process (a mirror
copying, as ``up``'s does, takes a core from every way alike); the figure is each
way's median pause (the first save of each Checkpointer, which allocates the buffers,
left out) and its ratio to ``none``.  Target: every way within 1.2x of ``none``.  Usage::

    python -m benchmarks.bench_mirror_pause --out benchmarks/results/mirror_pause.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import socket
import statistics
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from torch_bridge import Checkpointer

WAYS = ("none", "up", "refused", "blackholed")


@contextlib.contextmanager
def endpoints() -> Iterator[dict[str, str]]:
    """A refused port and a blackholed one (the kernel completes connections from the
    listen backlog; nothing ever answers)."""
    refused = socket.socket()
    refused.bind(("127.0.0.1", 0))
    refused_port = refused.getsockname()[1]
    refused.close()
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(1024)
    try:
        yield {"refused": f"http://127.0.0.1:{refused_port}",
               "blackholed": f"http://127.0.0.1:{hole.getsockname()[1]}"}
    finally:
        hole.close()


def checkpointer(way: str, work: Path, urls: dict[str, str]) -> Checkpointer:
    local = work / way / "local"
    if way == "none":
        return Checkpointer(local, run="r", async_save=True)
    if way == "up":
        return Checkpointer(local, run="r", async_save=True, mirror=work / way / "mirror")
    return Checkpointer(local, run="r", async_save=True, mirror="s3://bucket/ckpts",
                        mirror_options={"client_kwargs": {"endpoint_url": urls[way]}})


def pauses(work: Path, urls: dict[str, str], model: torch.nn.Module, saves: int,
           gap: float) -> dict[str, list[float]]:
    """Each way's pauses, save by save: at each step every way saves once, the first
    way rotating, so a slow spell of the machine falls on every way alike."""
    ckpts = {way: checkpointer(way, work, urls) for way in WAYS}
    measured: dict[str, list[float]] = {way: [] for way in WAYS}
    try:
        for step in range(saves):
            turn = step % len(WAYS)
            for way in WAYS[turn:] + WAYS[:turn]:
                with torch.no_grad():
                    for parameter in model.parameters():
                        parameter.add_(0.001)
                started = time.perf_counter()
                ckpts[way].save(step, model=model)
                if step:  # the first save allocates the staging buffers
                    measured[way].append(time.perf_counter() - started)
                time.sleep(gap)
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # an unreachable mirror leaves versions
            for ckpt in ckpts.values():
                ckpt.close(timeout=1)
    return measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=64, help="state size in MiB")
    parser.add_argument("--saves", type=int, default=11)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--gap", type=float, default=0.5, help="seconds after each save")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/mirror_pause.json"))
    args = parser.parse_args()
    for name, value in {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                        "AWS_DEFAULT_REGION": "us-east-1",
                        "AWS_EC2_METADATA_DISABLED": "true"}.items():
        os.environ.setdefault(name, value)
    side = int((args.mb * 2**20 / 4) ** 0.5)
    model = torch.nn.Linear(side, side, bias=False)
    results: dict[str, list[float]] = {way: [] for way in WAYS}
    logging.getLogger("chunkstore.maintenance.mirror").setLevel(logging.ERROR)
    with endpoints() as urls, tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeat):
            found = pauses(Path(tmp) / f"run{repeat}", urls, model, args.saves, args.gap)
            for way, measured in found.items():
                results[way] += measured
    base = statistics.median(results["none"])
    report: dict[str, Any] = {
        "state_bytes": side * side * 4, "saves_per_way": args.saves - 1,
        "repeats": args.repeat, "gap_s": args.gap,
        "ways": {way: {"pause_median_s": statistics.median(p), "pause_max_s": max(p),
                       "ratio_to_none": statistics.median(p) / base, "pauses_s": p}
                 for way, p in results.items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for way, row in report["ways"].items():
        print(f"{way:11s} median {row['pause_median_s'] * 1e3:7.1f} ms  max"
              f" {row['pause_max_s'] * 1e3:7.1f} ms  {row['ratio_to_none']:.2f}x none")


if __name__ == "__main__":
    main()
