"""Batched multi-LoRA: one forward pass serves the base model and several adapters at once (punica-style).

Every adapter resident on the device owns a *slot*; its A/B matrices sit in stacked per-layer tensors
(``A: (slots, shards, R, in)``, ``B[shard]: (slots, out_shard, R)``, zero-padded to the largest rank ``R``). For one
step the runner builds a :class:`LoRABatch` once: the active slots and, per slot, the indices of its tokens (tokens of
the base model belong to no slot). Each wrapped projection then computes

    y = base(x);  y[tokens of slot s] += (x[tokens] @ A_s.T) @ B_s.T * scaling_s        for every active slot s

as two batched GEMMs over all active slots at once (segment GEMM through ``bmm`` on a padded token gather), never a
pass per adapter and never a copy of A per token. Fused projections (q/k/v, gate/up) carry one A/B per shard: the
shrink is one GEMM over all shards, the expand one GEMM per shard (B is block-diagonal, so no wasted FLOPs).

The base projection is whatever the model holds (``nn.Linear`` or a quantized linear of kernels/linear_base.py): the
wrapper adds the delta to its output, so every linear method gains LoRA with no change.

The batch reaches the projections through :class:`LoRAContext`, a context manager the runner enters around the
forward; it refuses nesting, and outside it the wrappers are the base projection exactly.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class LoRABatch:
    """One step's token -> adapter grouping, on the model's device."""

    slots: torch.Tensor        # (n,) int64: the active slots
    gather: torch.Tensor       # (n, Tmax) int64: token indices of each slot's tokens, padded with T (a zero row)
    valid: torch.Tensor        # (k,) int64: positions in gather.flatten() that are real tokens
    tokens: torch.Tensor       # (k,) int64: gather.flatten()[valid]
    rank: int                  # the largest rank among active slots (A/B are sliced to it)

    @classmethod
    def build(cls, token_slots: torch.Tensor, ranks: dict[int, int], device: torch.device) -> "LoRABatch | None":
        """From the (T,) CPU slot id of every token (-1 = base model); None when no token uses an adapter."""
        active = sorted(int(s) for s in torch.unique(token_slots).tolist() if s >= 0)
        if not active:
            return None
        groups = [torch.nonzero(token_slots == s).flatten() for s in active]
        tmax = max(len(g) for g in groups)
        gather = torch.full((len(active), tmax), len(token_slots), dtype=torch.int64)   # (n, Tmax), pad -> row T
        for i, g in enumerate(groups):
            gather[i, : len(g)] = g
        flat = gather.flatten()
        valid = torch.nonzero(flat < len(token_slots)).flatten()
        return cls(torch.tensor(active, device=device), gather.to(device), valid.to(device), flat[valid].to(device),
                   max(ranks[s] for s in active))


class LoRAContext:
    """Holds the current step's :class:`LoRABatch` for the wrappers of one model (no global state)."""

    def __init__(self) -> None:
        self.batch: LoRABatch | None = None
        self._active = False

    @contextmanager
    def use(self, batch: LoRABatch | None):
        if self._active:
            raise RuntimeError("LoRA batch context entered twice (nested forward passes are not supported)")
        self._active, self.batch = True, batch
        try:
            yield
        finally:
            self._active, self.batch = False, None


class LoRALinear(nn.Module):
    """``base(x) + LoRA delta`` for the tokens of each active slot. ``shard_sizes`` are the output widths of the fused
    shards (``[q, kv, kv]``, ``[inter, inter]`` or ``[out]``)."""

    def __init__(self, base: nn.Module, ctx: LoRAContext, in_features: int, shard_sizes: list[int], max_loras: int,
                 max_rank: int, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.base, self.ctx, self.shard_sizes = base, ctx, list(shard_sizes)
        s = len(shard_sizes)
        self.register_buffer("lora_a", torch.zeros(max_loras, s, max_rank, in_features, device=device, dtype=dtype),
                             persistent=False)                                       # (slots, S, R, in)
        self.lora_b = [torch.zeros(max_loras, n, max_rank, device=device, dtype=dtype) for n in shard_sizes]
        self.register_buffer("scaling", torch.zeros(max_loras, s, device=device, dtype=dtype), persistent=False)

    def set_slot(self, slot: int, shard: int, a: torch.Tensor | None, b: torch.Tensor | None, scaling: float) -> None:
        """Write one shard of an adapter into ``slot`` (None: the adapter does not target this shard: zeros)."""
        self.lora_a[slot, shard].zero_()
        self.lora_b[shard][slot].zero_()
        self.scaling[slot, shard] = 0.0 if a is None else scaling
        if a is not None:
            r = a.shape[0]
            self.lora_a[slot, shard, :r].copy_(a)
            self.lora_b[shard][slot, :, :r].copy_(b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)                                                              # (T, out)
        batch = self.ctx.batch
        if batch is None:
            return y
        n, r, s = batch.slots.shape[0], batch.rank, len(self.shard_sizes)
        xp = torch.cat((x, x.new_zeros(1, x.shape[1])))                               # (T + 1, in): row T = padding
        xg = xp[batch.gather]                                                          # (n, Tmax, in)
        a = self.lora_a.index_select(0, batch.slots)[:, :, :r]                         # (n, S, r, in)
        h = torch.bmm(xg, a.reshape(n, s * r, -1).transpose(1, 2))                    # (n, Tmax, S*r) shrink
        scale = self.scaling.index_select(0, batch.slots)                              # (n, S)
        parts = []
        for i in range(s):                                                             # expand, one GEMM per shard
            b = self.lora_b[i].index_select(0, batch.slots)[:, :, :r]                  # (n, out_i, r)
            parts.append(torch.bmm(h[:, :, i * r:(i + 1) * r], b.transpose(1, 2)) * scale[:, i, None, None])
        delta = torch.cat(parts, dim=-1) if s > 1 else parts[0]                        # (n, Tmax, out)
        return y.index_add(0, batch.tokens, delta.reshape(-1, y.shape[1]).index_select(0, batch.valid))
