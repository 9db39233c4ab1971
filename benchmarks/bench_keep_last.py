"""Bytes on disk of a long job with ``keep_last=3``, against a torch.save keep-3 rotation.

Issue 47: before the collection that follows retention (746f9c8,
``chunkstore/maintenance/autocollect.py``) a job with ``keep_last=3`` saving every
5 steps held 95.8x amplification after 600 steps.  Two CPU jobs, each trained step
by step with one save per step (``--saves``, default 1000):

- ``dense``: an MLP stack (Linear + LayerNorm + GELU), every parameter trained by
  AdamW, so every tensor of the state changes at every save;
- ``frozen``: a large frozen base (an embedding table and linear layers) under a
  small trained head, AdamW on the head only.

Each step the job saves its state dict (model + optimizer) twice: through
``Checkpointer(path, run=..., keep_last=3, async_save=False)`` (defaults otherwise:
compression, delta chains, packs, the background collection with no grace) and
through ``torch.save`` into ``step-N.pt``, after which every file but the newest 3
is deleted.  After each save it records:

- the store's bytes on disk, **every file under the store directory, the LMDB
  index and its space reserve included**, right after ``save()`` returns (its
  collection may still be running) and once the collection is idle
  (``ckpt._collector.wait_idle()``); "on disk" is the blocks allocated
  (``st_blocks``, what ``du`` counts), apparent sizes are recorded beside them;
- the store's chunk and node objects, and the bytes the kept versions need: the
  chunks (packs followed through their moved records, delta bases included) and
  nodes the newest 3 versions reach, each object once; the keep_last + 1 figure
  is the union of that set before the save and after it (the 3 versions kept
  before the save and the one it wrote: what the store must hold while a save is
  being written);
- torch.save's 4 files before the oldest is deleted, and its 3 files after.

The next step starts once the collection is idle, so each collection follows one
save.  Steady state: the saves after the first ``--warmup`` (default a tenth).
Usage::

    python -m benchmarks.bench_keep_last --saves 1000 \\
        --out benchmarks/results/keep_last.json --plot benchmarks/results/keep_last.png
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import matplotlib
import torch
from torch import nn

matplotlib.use("Agg")  # no display: plots are files

import matplotlib.pyplot as plt

from chunkstore.handle.tree import flatten
from chunkstore.objects.kinds import CHUNKS, NODES
from chunkstore.protocol.moved import read_moved
from chunkstore.store import Store
from torch_bridge import Checkpointer

KEEP_LAST = 3
MB = 1e6
#: A training step: one batch, forward, backward, optimizer step.
Step = Callable[[], None]


def dense_job(width: int, depth: int) -> tuple[nn.Module, torch.optim.Optimizer, Step]:
    """An MLP stack, every parameter trained by AdamW."""
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.LayerNorm(width), nn.GELU()]
    model = nn.Sequential(*layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> None:
        model(torch.randn(32, width)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt, step


def frozen_job(width: int, rows: int, depth: int
               ) -> tuple[nn.Module, torch.optim.Optimizer, Step]:
    """A frozen embedding table and linear layers under a small head that AdamW trains."""
    base = nn.ModuleDict({"embed": nn.Embedding(rows, width),
                          "layers": nn.Sequential(*[nn.Linear(width, width)
                                                    for _ in range(depth)])})
    base.requires_grad_(False)
    model = nn.ModuleDict({"base": base, "head": nn.Sequential(
        nn.Linear(width, width // 2), nn.GELU(), nn.Linear(width // 2, 16))})
    opt = torch.optim.AdamW(model["head"].parameters(), lr=1e-3)

    def step() -> None:
        with torch.no_grad():
            features = base["layers"](base["embed"](torch.randint(rows, (32,))))
        model["head"](features).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt, step


def disk_usage(root: Path) -> dict[str, list[int]]:
    """[apparent bytes, allocated bytes, files] of every top-level entry under ``root``;
    a file deleted while it is walked (a collection running) counts as gone."""
    usage: dict[str, list[int]] = {}
    for folder, _, files in os.walk(root):
        top = Path(folder).relative_to(root).parts
        for name in files:
            try:
                info = os.lstat(os.path.join(folder, name))
            except FileNotFoundError:
                continue
            row = usage.setdefault(top[0] if top else name, [0, 0, 0])
            row[0] += info.st_size
            row[1] += info.st_blocks * 512
            row[2] += 1
    return usage


def total(usage: dict[str, list[int]], column: int, only: tuple[str, ...] = ()) -> int:
    return sum(row[column] for name, row in usage.items() if not only or name in only)


def kept_objects(store: Store, run: str) -> dict[tuple[str, str], int]:
    """The chunk and node objects the run's kept versions reach, each once, by size."""
    objects: dict[tuple[str, str], int] = {}
    for info in store.versions(run):
        flat = flatten(store.objects, info.root, store.node_cache)
        for listed in flat.chunk_digests():
            digest = listed
            while not store.objects.exists(CHUNKS, digest):  # repacked: where it went
                moved = read_moved(store.objects, digest)
                assert moved is not None, f"{listed.short()} is missing"
                digest = moved.to
            objects[("c", digest.hex)] = store.objects.stat(CHUNKS, digest).size
        for digest in flat.tree_nodes | flat.data_nodes():
            objects[("n", digest.hex)] = store.objects.stat(NODES, digest).size
    return objects


def state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    tensors = list(model.state_dict().values())
    tensors += [t for s in opt.state_dict()["state"].values() for t in s.values()
                if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def rotate(folder: Path, step: int, state: dict[str, Any]) -> tuple[int, int, float]:
    """torch.save of step ``step``, then every file but the newest 3 deleted: the
    allocated bytes of the files before the deletion and after, and the save's time."""
    started = time.perf_counter()
    torch.save(state, folder / f"step-{step:06d}.pt")
    seconds = time.perf_counter() - started
    before = total(disk_usage(folder), 1)
    for old in sorted(folder.glob("step-*.pt"))[:-KEEP_LAST]:
        old.unlink()
    return before, total(disk_usage(folder), 1), seconds


@contextlib.contextmanager
def checkpointer(path: Path, run: str) -> Iterator[Checkpointer]:
    with Checkpointer(path, run=run, keep_last=KEEP_LAST, async_save=False) as ckpt:
        yield ckpt


def save_both(ckpt: Checkpointer, paths: tuple[Path, Path], step: int, model: nn.Module,
              opt: torch.optim.Optimizer) -> tuple[dict[str, float], dict[Any, int]]:
    """One save each way (``paths``: the store, the rotation's folder) and what it left
    on disk; the objects the kept versions need."""
    store_path, rotation = paths
    started = time.perf_counter()
    ckpt.save(step, model=model, optimizer=opt)
    saved = time.perf_counter()
    after_save = total(disk_usage(store_path), 1)
    collector = ckpt._collector
    assert collector is None or collector.wait_idle(120), "the collection never went idle"
    idle_s = time.perf_counter() - saved
    usage = disk_usage(store_path)
    kept = kept_objects(ckpt.store, ckpt.run)
    before, after, torch_s = rotate(
        rotation, step, {"model": model.state_dict(), "optimizer": opt.state_dict()})
    return {"chunkstore_after_save": after_save,
            "chunkstore_idle": total(usage, 1),
            "chunkstore_idle_apparent": total(usage, 0),
            "chunkstore_objects": total(usage, 0, ("chunks", "nodes")),
            "chunkstore_index": total(usage, 1, ("index",)),
            "chunkstore_journal": total(usage, 1, ("gc",)),
            "chunkstore_files": total(usage, 2),
            "kept_need": sum(kept.values()),
            "torch_save_before_delete": before, "torch_save_rotation": after,
            "chunkstore_save_s": saved - started, "collect_wait_s": idle_s,
            "torch_save_s": torch_s}, kept


def run_job(name: str, job: tuple[nn.Module, torch.optim.Optimizer, Step], work: Path,
            saves: int) -> dict[str, Any]:
    """``saves`` training steps, each saved both ways; the series, save by save."""
    model, opt, train = job
    store_path, rotation = work / name / "store", work / name / "torch_save"
    rotation.mkdir(parents=True)
    series: dict[str, list[float]] = {}
    previous: dict[Any, int] = {}
    with checkpointer(store_path, name) as ckpt:
        for step in range(1, saves + 1):
            train()
            row, kept = save_both(ckpt, (store_path, rotation), step, model, opt)
            row["kept_plus_one_need"] = sum((previous | kept).values())
            for key, value in row.items():
                series.setdefault(key, []).append(value)
            previous = kept
        versions = [v.step for v in ckpt.store.versions(name)]
        verified = ckpt.store.verify().ok
        runs = 0 if ckpt._collector is None else ckpt._collector.runs
    return {"state_bytes": state_bytes(model, opt), "series": series,
            "final_store_usage": {k: dict(zip(("apparent", "allocated", "files"), v,
                                              strict=True))
                                  for k, v in sorted(disk_usage(store_path).items())},
            "final_index_files": {f.name: f.stat().st_blocks * 512
                                  for f in sorted((store_path / "index").iterdir())},
            "kept_versions": versions, "verify_ok": verified, "collections": runs}


def summarize(job: dict[str, Any], warmup: int) -> dict[str, Any]:
    """Steady-state figures: the saves after the first ``warmup``."""
    s = {key: values[warmup:] for key, values in job["series"].items()}
    idle, rotation = s["chunkstore_idle"], s["torch_save_rotation"]
    over_need = [a / b for a, b in zip(idle, s["kept_plus_one_need"], strict=True)]
    objects_over_need = [a / b for a, b in zip(s["chunkstore_objects"],
                                               s["kept_plus_one_need"], strict=True)]
    return {
        "state_bytes": job["state_bytes"], "steady_state_saves": len(idle),
        "chunkstore_idle_mean": statistics.fmean(idle), "chunkstore_idle_max": max(idle),
        "chunkstore_after_save_mean": statistics.fmean(s["chunkstore_after_save"]),
        "chunkstore_after_save_max": max(s["chunkstore_after_save"]),
        "torch_save_rotation_mean": statistics.fmean(rotation),
        "torch_save_rotation_max": max(rotation),
        "torch_save_before_delete_max": max(s["torch_save_before_delete"]),
        "ratio_mean": statistics.fmean(idle) / statistics.fmean(rotation),
        "ratio_max": max(idle) / max(rotation),
        "kept_need_mean": statistics.fmean(s["kept_need"]),
        "kept_plus_one_need_mean": statistics.fmean(s["kept_plus_one_need"]),
        "disk_over_kept_plus_one_max": max(over_need),
        "objects_over_kept_plus_one_max": max(objects_over_need),
        "amplification_max": max(idle) / job["state_bytes"],
        "chunkstore_idle_last": idle[-1], "torch_save_rotation_last": rotation[-1],
        "chunkstore_objects_max": max(s["chunkstore_objects"]),
        "chunkstore_index_last": s["chunkstore_index"][-1],
        "chunkstore_journal_last": s["chunkstore_journal"][-1],
        "chunkstore_idle_growth_per_save": statistics.linear_regression(
            range(len(idle)), idle).slope,
        "chunkstore_objects_growth_per_save": statistics.linear_regression(
            range(len(idle)), s["chunkstore_objects"]).slope,
        "chunkstore_save_s_median": statistics.median(s["chunkstore_save_s"]),
        "collect_wait_s_median": statistics.median(s["collect_wait_s"]),
        "torch_save_s_median": statistics.median(s["torch_save_s"]),
    }


def plot(jobs: dict[str, dict[str, Any]], out: Path) -> None:
    """Bytes on disk against save number, one panel per job."""
    fig, axes = plt.subplots(1, len(jobs), figsize=(6 * len(jobs), 4), squeeze=False)
    lines = (("torch_save_rotation", "torch.save, keep 3 files", "tab:red", "-"),
             ("chunkstore_after_save", "chunkstore keep_last=3, right after save()",
              "tab:cyan", "-"),
             ("chunkstore_idle", "chunkstore keep_last=3, collection idle", "tab:blue", "-"),
             ("chunkstore_objects", "chunkstore's chunks + nodes (collection idle)",
              "tab:green", ":"),
             ("kept_plus_one_need", "objects keep_last + 1 versions need", "black", "--"))
    for ax, (name, job) in zip(axes.flat, jobs.items(), strict=True):
        for key, label, color, style in lines:
            values = job["series"][key]
            ax.plot(range(1, len(values) + 1), [v / MB for v in values], color=color,
                    linestyle=style, linewidth=1, label=label)
        ax.set_title(f"{name} ({job['state_bytes'] / MB:.1f} MB of state per save)")
        ax.set_xlabel("save")
        ax.set_ylabel("MB on disk")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def downsample(job: dict[str, Any], every: int) -> dict[str, Any]:
    """The series at every ``every``-th save (the first and the last kept)."""
    length = len(job["series"]["chunkstore_idle"])
    picked = sorted({*range(0, length, every), length - 1})
    series = {key: [values[i] for i in picked] for key, values in job["series"].items()}
    return {**{k: v for k, v in job.items() if k != "summary"},
            "series": {"save": [i + 1 for i in picked], **series}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--saves", type=int, default=1000)
    parser.add_argument("--warmup", type=int, help="saves left out of the steady state"
                        " (default: a tenth)")
    parser.add_argument("--every", type=int, default=5, help="the JSON keeps every Nth save")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    warmup = args.saves // 10 if args.warmup is None else args.warmup
    torch.manual_seed(0)
    jobs: dict[str, dict[str, Any]] = {}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for name, job in (("dense", dense_job(width=256, depth=6)),
                          ("frozen", frozen_job(width=256, rows=4096, depth=4))):
            jobs[name] = run_job(name, job, Path(tmp), args.saves)
            jobs[name]["summary"] = summarize(jobs[name], warmup)
            print(name, json.dumps(jobs[name]["summary"], indent=1))
    command = "python -m benchmarks.bench_keep_last" + "".join(
        f" --{k} {v}" for k, v in (("saves", args.saves), ("out", args.out),
                                   ("plot", args.plot)) if v is not None)
    doc = {"machine": platform.machine(), "cpus": os.cpu_count(), "command": command,
           "seconds": round(time.perf_counter() - started, 1), "saves": args.saves,
           "keep_last": KEEP_LAST, "warmup": warmup, "bytes_on_disk": "allocated blocks",
           "summary": {name: job["summary"] for name, job in jobs.items()},
           "jobs": {name: downsample(job, args.every) for name, job in jobs.items()}}
    if args.plot:
        plot(jobs, args.plot)
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
