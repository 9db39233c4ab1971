"""The models and optimizers the benchmark workloads train (CPU, float32 unless said).

- ``GPT``: a pre-norm decoder-only transformer with separate q/k/v/o
  projections (so LoRA can wrap them), untied embedding and head.
- ``LoRALinear``: a frozen linear layer plus a trained rank-r update B @ A.
- ``DLRM``: bottom MLP for dense features, sum-pooled sparse embedding bags,
  pairwise dot-product interaction, top MLP (as in Naumov et al. 2019).
- ``RowWiseAdagrad``: one accumulator per embedding row, sparse gradients,
  the optimizer production recommenders pair with such tables.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, rank: int, alpha: float = 16.0) -> None:
        super().__init__()
        self.base = base
        base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + F.linear(F.linear(x, self.lora_a), self.lora_b) * self.scale


class Attention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, seq, self.heads, width // self.heads).transpose(1, 2)

        y = F.scaled_dot_product_attention(split(self.q(x)), split(self.k(x)),
                                           split(self.v(x)), is_causal=True)
        return self.o(y.transpose(1, 2).reshape(batch, seq, width))


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = Attention(width, heads)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, width: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def add_lora(self, rank: int) -> None:
        """Freeze everything, then wrap every attention projection with a rank-r adapter."""
        self.requires_grad_(False)
        for block in self.blocks:
            attn: Any = block.attn
            for name in ("q", "k", "v", "o"):
                setattr(attn, name, LoRALinear(getattr(attn, name), rank))


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy on a (batch, seq + 1) block of tokens."""
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                           tokens[:, 1:].reshape(-1))


def mlp(sizes: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(itertools.pairwise(sizes)):
        layers.append(nn.Linear(n_in, n_out))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    def __init__(self, tables: int, rows: int, dim: int, dense_features: int = 13) -> None:
        super().__init__()
        self.bottom = mlp([dense_features, 256, 128, dim])
        self.embeddings = nn.ModuleList(
            nn.EmbeddingBag(rows, dim, mode="sum", sparse=True) for _ in range(tables))
        for table in self.embeddings:
            nn.init.normal_(table.weight, std=1 / math.sqrt(rows))
        pairs = (tables + 1) * tables // 2
        self.top = mlp([dim + pairs, 256, 64, 1])

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``ids``: (tables, batch, pooling) row indices."""
        x = self.bottom(dense)
        features = torch.stack([x] + [t(i) for t, i in zip(self.embeddings, ids, strict=True)],
                               dim=1)
        dots = features @ features.transpose(1, 2)
        upper = torch.triu_indices(features.shape[1], features.shape[1], offset=1)
        return self.top(torch.cat([x, dots[:, upper[0], upper[1]]], dim=1)).squeeze(1)


class RowWiseAdagrad(torch.optim.Optimizer):
    """Adagrad with one accumulator per row (the mean squared gradient of the row)."""

    def __init__(self, params: Any, lr: float = 0.05, eps: float = 1e-8) -> None:
        super().__init__(params, {"lr": lr, "eps": eps})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad.coalesce()
                rows, values = grad.indices()[0], grad.values()
                state = self.state[param]
                if not state:
                    state["sum"] = torch.zeros(param.shape[0])
                state["sum"].index_add_(0, rows, values.square().mean(dim=1))
                scale = state["sum"][rows].sqrt_().add_(group["eps"])
                param.index_add_(0, rows, values / scale[:, None], alpha=-group["lr"])
