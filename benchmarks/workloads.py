"""The six training workloads, each recorded as the states it saves every k steps.

Each workload trains for real on the CPU (seeded, synthetic data) and hands
``record(run, step, state)`` the state a training loop would checkpoint:
``{"model": model.state_dict(), "optimizer": optimizer.state_dict(), ...}``.
It returns a description (parameter counts, trainable fraction, rows touched).
The pretrained base of the fine-tunes is a seeded initialisation: what
matters to storage is which bytes change between saves, not their values.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from benchmarks.models import DLRM, GPT, RowWiseAdagrad, lm_loss

Record = Callable[[str, int, dict[str, Any]], None]
WORKLOADS = ("dense", "frozen", "lora", "sparse-embedding", "sweep", "mixed-precision")


@dataclass(frozen=True)
class Scale:
    versions: int  # saves per run (N)
    save_every: int  # optimizer steps between saves (k) for the transformer workloads
    vocab: int
    width: int
    layers: int
    heads: int
    seq: int
    batch: int
    trained_blocks: int  # top blocks the frozen-base fine-tune trains
    tables: int
    rows: int
    dim: int
    sparse_batch: int
    pooling: int
    sparse_save_every: int
    sweep_runs: int = 4
    lora_rank: int = 8
    zipf_exponent: float = 1.05


FULL = Scale(versions=10, save_every=2, vocab=2048, width=256, layers=12, heads=4, seq=64,
             batch=8, trained_blocks=2, tables=8, rows=125_000, dim=64, sparse_batch=2048,
             pooling=2, sparse_save_every=10)
# A smoke test: tiny states (a save of them is mostly per-tensor work, so few layers), five
# versions, two sweep runs.  Three blocks, one trained, keep the frozen base large enough
# that chunkstore must store well under torch.save's N copies.
QUICK = Scale(versions=5, save_every=1, vocab=128, width=64, layers=3, heads=2, seq=8,
              batch=2, trained_blocks=1, tables=4, rows=4096, dim=16, sparse_batch=64,
              pooling=2, sparse_save_every=2, sweep_runs=2)


def _params(model: nn.Module, trainable: bool | None = None) -> int:
    return sum(p.numel() for p in model.parameters()
               if trainable is None or p.requires_grad == trainable)


def _gpt(scale: Scale, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(scale.vocab, scale.width, scale.layers, scale.heads, scale.seq)


def _train_lm(scale: Scale, model: nn.Module, optimizer: torch.optim.Optimizer, run: str,
              record: Record, seed: int, extra: Callable[[], dict[str, Any]] | None = None
              ) -> None:
    """Train on seeded random tokens, recording the state every ``save_every`` steps."""
    data = torch.Generator().manual_seed(seed)
    for step in range(1, scale.versions * scale.save_every + 1):
        tokens = torch.randint(0, scale.vocab, (scale.batch, scale.seq + 1), generator=data)
        optimizer.zero_grad(set_to_none=True)
        lm_loss(model, tokens).backward()
        optimizer.step()
        if step % scale.save_every == 0:
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            record(run, step, {**state, **(extra() if extra else {})})


def _describe(model: nn.Module) -> dict[str, Any]:
    total, trained = _params(model), _params(model, trainable=True)
    return {"params": total, "trainable_params": trained,
            "trainable_fraction": round(trained / total, 4)}


def dense(scale: Scale, record: Record) -> dict[str, Any]:
    model = _gpt(scale)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    _train_lm(scale, model, optimizer, "dense", record, seed=1)
    return {**_describe(model), "optimizer": "AdamW"}


def _frozen_base(scale: Scale, model: GPT) -> list[nn.Parameter]:
    model.requires_grad_(False)
    trained = [*model.blocks[-scale.trained_blocks:], model.ln_f, model.head]
    for module in trained:
        module.requires_grad_(True)
    return [p for p in model.parameters() if p.requires_grad]


def frozen(scale: Scale, record: Record) -> dict[str, Any]:
    model = _gpt(scale)
    optimizer = torch.optim.AdamW(_frozen_base(scale, model), lr=3e-4)
    _train_lm(scale, model, optimizer, "frozen", record, seed=2)
    return {**_describe(model), "optimizer": "AdamW",
            "trained": f"top {scale.trained_blocks} blocks, final norm and head"}


def lora(scale: Scale, record: Record) -> dict[str, Any]:
    model = _gpt(scale)
    model.add_lora(scale.lora_rank)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    _train_lm(scale, model, optimizer, "lora", record, seed=3)
    return {**_describe(model), "optimizer": "AdamW",
            "trained": f"rank-{scale.lora_rank} adapters on q, k, v, o"}


def sweep(scale: Scale, record: Record) -> dict[str, Any]:
    """Frozen-base fine-tunes of one base, one run per learning rate, into one store."""
    base = _gpt(scale)
    learning_rates = [1e-4, 3e-4, 1e-3, 3e-3][:scale.sweep_runs]
    for i, lr in enumerate(learning_rates):
        model = copy.deepcopy(base)
        optimizer = torch.optim.AdamW(_frozen_base(scale, model), lr=lr)
        _train_lm(scale, model, optimizer, f"sweep-lr{lr:g}", record, seed=10 + i)
    return {**_describe(model), "optimizer": "AdamW", "runs": len(learning_rates),
            "learning_rates": learning_rates}


def mixed_precision(scale: Scale, record: Record) -> dict[str, Any]:
    """bf16 model; AdamW steps fp32 master weights, copied back into the bf16 parameters."""
    model = _gpt(scale).to(torch.bfloat16)
    names = [name for name, _ in model.named_parameters()]
    live = [p for _, p in model.named_parameters()]
    master = [p.detach().float().clone().requires_grad_(True) for p in live]
    optimizer = torch.optim.AdamW(master, lr=3e-4)

    class MasterStep:  # the optimizer interface _train_lm drives
        def zero_grad(self, set_to_none: bool = True) -> None:
            model.zero_grad(set_to_none=set_to_none)

        def step(self) -> None:
            for weight, param in zip(master, live, strict=True):
                weight.grad = None if param.grad is None else param.grad.float()
            optimizer.step()
            with torch.no_grad():
                for weight, param in zip(master, live, strict=True):
                    param.copy_(weight)

        def state_dict(self) -> dict[str, Any]:
            return optimizer.state_dict()

    def master_state() -> dict[str, Any]:
        return {"master": {name: w.detach() for name, w in zip(names, master, strict=True)}}

    _train_lm(scale, model, MasterStep(), "mixed", record, seed=4,  # type: ignore[arg-type]
              extra=master_state)
    return {**_describe(model), "optimizer": "AdamW on fp32 master weights",
            "dtypes": "bf16 parameters, fp32 master weights and moments"}


class ZipfIds:
    """Row ids with Zipf-distributed popularity, hot rows scattered by a fixed hash."""

    def __init__(self, rows: int, exponent: float, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        weights = 1.0 / np.arange(1, rows + 1) ** exponent
        self.cdf = np.cumsum(weights) / weights.sum()
        self.permutation = self.rng.permutation(rows)

    def draw(self, shape: tuple[int, ...]) -> np.ndarray:
        ranks = np.searchsorted(self.cdf, self.rng.random(shape))
        return self.permutation[np.minimum(ranks, len(self.cdf) - 1)]


def sparse_embedding(scale: Scale, record: Record) -> dict[str, Any]:
    torch.manual_seed(5)
    model = DLRM(scale.tables, scale.rows, scale.dim)
    sparse_opt = RowWiseAdagrad(model.embeddings.parameters(), lr=0.05)
    dense_params = [*model.bottom.parameters(), *model.top.parameters()]
    dense_opt = torch.optim.Adam(dense_params, lr=1e-3)
    ids = [ZipfIds(scale.rows, scale.zipf_exponent, seed=100 + t) for t in range(scale.tables)]
    data = torch.Generator().manual_seed(6)
    touched = [set[int]() for _ in range(scale.tables)]
    fractions, touched_rows = [], []
    for step in range(1, scale.versions * scale.sparse_save_every + 1):
        batch = np.stack([t.draw((scale.sparse_batch, scale.pooling)) for t in ids])
        for seen, rows in zip(touched, batch, strict=True):
            seen.update(rows.ravel().tolist())
        dense_x = torch.randn(scale.sparse_batch, 13, generator=data)
        labels = (torch.rand(scale.sparse_batch, generator=data) < 0.25).float()
        sparse_opt.zero_grad(set_to_none=True)
        dense_opt.zero_grad(set_to_none=True)
        logits = model(dense_x, torch.from_numpy(batch))
        nn.functional.binary_cross_entropy_with_logits(logits, labels).backward()
        sparse_opt.step()
        dense_opt.step()
        if step % scale.sparse_save_every == 0:
            fractions.append(sum(map(len, touched)) / (scale.tables * scale.rows))
            touched_rows.append(sum(map(len, touched)))
            touched = [set() for _ in range(scale.tables)]
            record("sparse", step, {"model": model.state_dict(),
                                    "sparse_opt": sparse_opt.state_dict(),
                                    "dense_opt": dense_opt.state_dict()})
    table_bytes = scale.tables * scale.rows * scale.dim * 4
    return {**_describe(model), "optimizer": "row-wise Adagrad (tables), Adam (MLPs)",
            "tables": scale.tables, "rows": scale.rows, "dim": scale.dim,
            "table_bytes": table_bytes, "lookups_per_step": scale.sparse_batch * scale.pooling,
            "rows_touched_per_save_median": float(np.median(fractions)),
            # What changed in the tables since the previous save: each touched row's
            # weights and its Adagrad accumulator (the MLPs, all changed, are extra).
            "touched_row_bytes_per_save_median":
                float(np.median(touched_rows[1:] or touched_rows)) * (scale.dim * 4 + 4)}


TRAIN: dict[str, Callable[[Scale, Record], dict[str, Any]]] = {
    "dense": dense, "frozen": frozen, "lora": lora, "sparse-embedding": sparse_embedding,
    "sweep": sweep, "mixed-precision": mixed_precision,
}
