"""Torch reference attention backend ("torch"): the CPU default and the oracle the Triton/flash kernels are tested against.

Decode tokens (one new token per sequence) run the paged C++ kernel (kernels/paged_decode_cpu.py) on CPU where it is
built and not switched off, reading K/V blocks in place; elsewhere they are batched into a few GEMM pairs over padded
gathers of their contexts, bucketed by length so that padding stays small. Prefill chunks over a bf16 cache run the
paged AMX prefill kernel (kernels/paged_prefill_cpu.py) on CPU where it is built, all of a step's chunks in one call;
elsewhere one SDPA call per sequence with a causal mask offset by the cached context length. The plan is made once per
step and shared by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pdserve.kernels.base import (AttentionBackend, AttentionMetadata, kv_token_rows, kv_write_rows, register_backend,
                                  write_kv_rows)
from pdserve.kernels import paged_prefill_cpu
from pdserve.kernels.paged_decode_cpu import enabled, paged_decode


def block_rows(kv_layer: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """The layer's cache as contiguous rows, one (key or value) block per row -> (rows (R, bs * Hkv * D), block_step,
    kv_step): block b's keys are row ``b * block_step``, its values row ``b * block_step + kv_step``.

    Why: ``index_select`` over dim 0 of a contiguous 2-D tensor copies whole rows (memcpy), several times faster than
    advanced indexing of the strided layer view. Each block's (bs, Hkv, D) must be contiguous, as the layout guarantees.
    """
    num_blocks, _, block_size, num_kv_heads, head_dim = kv_layer.shape
    row = block_size * num_kv_heads * head_dim
    s0, s1 = kv_layer.stride(0), kv_layer.stride(1)
    if kv_layer[0, 0].is_contiguous() and s0 % row == 0 and s1 % row == 0:
        block_step, kv_step = s0 // row, s1 // row
        num_rows = (num_blocks - 1) * block_step + kv_step + 1
        return kv_layer.as_strided((num_rows, row), (row, 1), kv_layer.storage_offset()), block_step, kv_step
    rows = kv_layer.reshape(num_blocks * 2, row)   # any other strides: a copy, still correct
    return rows, 2, 1


def gather_blocks(kv_layer: torch.Tensor, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the blocks ``tables`` (..., nb) names, back to back -> 2 x (..., nb * bs, Hkv, D), contiguous."""
    rows, block_step, kv_step = block_rows(kv_layer)
    idx = tables.long() * block_step
    kv = rows.index_select(0, torch.stack((idx, idx + kv_step)).flatten())     # (2 * prod(tables.shape), row)
    kv = kv.view(2, *tables.shape[:-1], tables.shape[-1] * kv_layer.shape[2], *kv_layer.shape[3:])
    return kv[0], kv[1]


def gather_context(kv_layer: torch.Tensor, block_table: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the first ``num_tokens`` cache slots named by one sequence's ``block_table`` -> 2 x (L, Hkv, D)."""
    num_blocks = -(-num_tokens // kv_layer.shape[2])
    k, v = gather_blocks(kv_layer, block_table[:num_blocks])   # 2 x (nb * bs, Hkv, D)
    return k[:num_tokens], v[:num_tokens]


def context_slots(meta: AttentionMetadata, block_size: int, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block id, offset) of every context token, sequences back to back -> 2 x (total,), ``total = sum(seq_lens)``.

    Vectorized (no host sync): what a varlen kernel over a contiguous copy of the contexts needs (the flash backend).
    """
    seq_lens = meta.seq_lens.long()
    starts = torch.cumsum(seq_lens, 0) - seq_lens                                     # (S,)
    seq_of = torch.repeat_interleave(torch.arange(len(seq_lens), device=seq_lens.device), seq_lens, output_size=total)
    pos = torch.arange(total, device=seq_lens.device) - starts[seq_of]                # (total,) position in its sequence
    blocks = meta.block_tables.long()[seq_of, pos // block_size]
    return blocks, pos % block_size


@dataclass
class DecodeGroup:
    """Decode sequences of similar length, attended in one padded pair of block-diagonal GEMMs."""

    rows: torch.Tensor    # (B,) their token rows in the batch
    tables: torch.Tensor  # (B, nb) int64 block ids, nb covering the longest
    pad: torch.Tensor     # (B, 1, nb * block_size) bool: slot >= seq_len (padding), built once for every layer
    _rows: tuple[int, int, torch.Tensor] | None = None   # (block_step, kv_step, row ids): the same for every layer

    def gather(self, kv_layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`gather_blocks` of ``tables``, with the row ids computed once per step -> 2 x (B, L, Hkv, D)."""
        rows, block_step, kv_step = block_rows(kv_layer)
        if self._rows is None or self._rows[:2] != (block_step, kv_step):
            idx = self.tables * block_step
            self._rows = (block_step, kv_step, torch.stack((idx, idx + kv_step)).flatten())
        kv = rows.index_select(0, self._rows[2])                            # (2 * B * nb, row)
        kv = kv.view(2, self.tables.shape[0], -1, *kv_layer.shape[3:])      # (2, B, nb * bs, Hkv, D)
        return kv[0], kv[1]


@dataclass
class StepPlan:
    """What every layer of one step repeats: derived once from the metadata (host lists, no device syncs)."""

    decode_groups: list[DecodeGroup]
    prefills: list[tuple[int, int, int, int]]  # (seq, first row, q_len, seq_len) of sequences with > 1 new token
    kv_rows: torch.Tensor | None = None        # (2T,) cache rows of the new tokens' K then V (base.kv_write_rows)
    paged: tuple[torch.Tensor | None, torch.Tensor, torch.Tensor] | None = None  # all decodes' (rows, tables, lens):
    # the kernel; rows None when every row of the step is a decode, in order (no row gather or scatter)
    paged_prefill: tuple[torch.Tensor, torch.Tensor] | None = None  # all prefills' (tables, (row, q_len, seq_len)) rows
    masks: dict[int, torch.Tensor] | None = field(default_factory=dict)  # seq -> its chunk's causal mask, built once


def plan_step(meta: AttentionMetadata, block_size: int, device: torch.device, max_padding: float = 1.25,
              paged: bool = False, paged_prefill: bool = False) -> StepPlan:
    """Split decodes into length buckets so that padded slots stay within ``max_padding`` x the real context; with
    ``paged``, all decodes in one set for the paged kernel instead (no padding, no buckets); with ``paged_prefill``,
    all prefill chunks in one set for the paged prefill kernel."""
    starts = _cumsum(meta.query_lens_cpu)
    prefills = [(s, starts[s], n, meta.seq_lens_cpu[s]) for s, n in enumerate(meta.query_lens_cpu) if n > 1]
    plan = _plan_decodes(meta, block_size, device, max_padding, paged, starts, prefills)
    if paged_prefill and prefills:
        nb = -(-max(p[3] for p in prefills) // block_size)
        idx = torch.tensor([p[0] for p in prefills], device=device)
        plan.paged_prefill = (meta.block_tables[idx, :nb].long().contiguous(),
                              torch.tensor([p[1:] for p in prefills], device=device, dtype=torch.long))
        plan.prefills = []
    return plan


def _plan_decodes(meta: AttentionMetadata, block_size: int, device: torch.device, max_padding: float, paged: bool,
                  starts: list[int], prefills: list[tuple[int, int, int, int]]) -> StepPlan:
    if paged:
        seqs = [s for s, n in enumerate(meta.query_lens_cpu) if n == 1]
        if not seqs:
            return StepPlan([], prefills)
        nb = -(-max(meta.seq_lens_cpu[s] for s in seqs) // block_size)
        idx = torch.tensor(seqs, device=device)
        every = len(seqs) == len(meta.query_lens_cpu)   # then starts[s] == s: the rows are q's, in order
        return StepPlan([], prefills, paged=(
            None if every else torch.tensor([starts[s] for s in seqs], device=device),
            meta.block_tables[idx, :nb].long().contiguous(),
            torch.tensor([meta.seq_lens_cpu[s] for s in seqs], device=device, dtype=torch.long)))
    decodes = sorted((meta.seq_lens_cpu[s], s) for s, n in enumerate(meta.query_lens_cpu) if n == 1)[::-1]
    groups: list[list[tuple[int, int]]] = []
    for seq_len, s in decodes:  # longest first: a group's first member sets its padded length
        g = groups[-1] if groups else None
        if g is None or (len(g) + 1) * g[0][0] > max_padding * (sum(n for n, _ in g) + seq_len):
            groups.append([(seq_len, s)])
        else:
            g.append((seq_len, s))
    decode_groups = []
    for g in groups:
        seqs, lens = [s for _, s in g], [n for n, _ in g]
        nb = -(-lens[0] // block_size)
        idx = torch.tensor(seqs, device=device)
        lens_t = torch.tensor(lens, device=device)
        pad = torch.arange(nb * block_size, device=device)[None, :] >= lens_t[:, None]         # (B, L)
        decode_groups.append(DecodeGroup(
            rows=torch.tensor([starts[s] for s in seqs], device=device),
            tables=meta.block_tables[idx, :nb].long(), pad=pad[:, None, :]))
    return StepPlan(decode_groups, prefills)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pad: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token per sequence over its padded context: q (B, H, D), k/v (B, L, Hkv, D), pad (B, 1, L) bool
    (True = a padding slot past the sequence's end) -> (B, H, D).

    Why not SDPA or a per-KV-head batched GEMM: with one query per head their kernels multiply tiny (G, D) x (D, L)
    tiles per (sequence, head) and run ~10x below the GEMM rate (measured: G = 3, D = 64, L = 256, bf16). Here the
    queries form a block-diagonal (H, Hkv * D) matrix, so both products are one well-shaped GEMM per sequence over K and
    V in their gathered layout, (L, Hkv * D), with no copies or transposes of K/V; the zero blocks cost Hkv x the small
    FLOPs. Scores come out (B, H, L), so the softmax runs over the contiguous last dim (a strided softmax over L cost
    as much as both GEMMs).
    """
    b, num_heads, head_dim = q.shape
    seq, num_kv_heads = k.shape[1], k.shape[2]
    group = num_heads // num_kv_heads
    q_bd = q.new_zeros(b, num_kv_heads, group, num_kv_heads, head_dim)   # (B, H, Hkv, D): head h in block h // G
    q_bd.diagonal(dim1=1, dim2=3).copy_(q.view(b, num_kv_heads, group, head_dim).permute(0, 2, 3, 1))  # (B, G, D, Hkv)
    s = torch.bmm(q_bd.view(b, num_heads, -1), k.view(b, seq, -1).transpose(1, 2))    # (B, H, L)
    s = s.float().mul_(scale).masked_fill_(pad, float("-inf"))
    p = s.softmax(-1).to(q.dtype)                                                      # (B, H, L)
    o = torch.bmm(p, v.view(b, seq, -1))                                               # (B, H, Hkv * D)
    o = o.view(b, num_kv_heads, group, num_kv_heads, head_dim).diagonal(dim1=1, dim2=3)  # (B, G, D, Hkv): own V
    return o.permute(0, 3, 1, 2).reshape(b, num_heads, head_dim)


def paged_attention_ref(
    q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None, plan: StepPlan | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its cached context (KV already written). -> (T, H, D).

    ``new_kv``: this step's (k, v), used directly for sequences whose whole context is new (a first full prefill),
    saving a gather; values are identical to the cache's when the cache dtype equals the compute dtype.
    ``plan``: :func:`plan_step` of ``meta``, computed once per step by the caller (else here).
    """
    group = q.shape[1] // kv_layer.shape[3]
    plan = plan or plan_step(meta, kv_layer.shape[2], q.device)
    if plan.paged is not None and plan.paged[0] is None:   # a decode-only step
        return paged_decode(q, kv_layer, plan.paged[1], plan.paged[2], scale)
    out = torch.empty_like(q)
    if plan.paged_prefill is not None:
        paged_prefill_cpu.paged_prefill(q, out, kv_layer, *plan.paged_prefill, scale)
    if plan.paged is not None:
        rows, tables, lens = plan.paged
        out.index_copy_(0, rows, paged_decode(q.index_select(0, rows), kv_layer, tables, lens, scale))
    for dg in plan.decode_groups:
        k, v = dg.gather(kv_layer)                                          # 2 x (B, L, Hkv, D)
        k, v = k.to(q.dtype), v.to(q.dtype)
        out.index_copy_(0, dg.rows, decode_attention(q.index_select(0, dg.rows), k, v, dg.pad, scale))  # row copies
    for s, lo, q_len, seq_len in plan.prefills:
        if new_kv is not None and seq_len == q_len and new_kv[0].dtype == kv_layer.dtype:
            k, v = new_kv[0][lo:lo + q_len], new_kv[1][lo:lo + q_len]
        else:
            k, v = gather_context(kv_layer, meta.block_tables[s], seq_len)
        qs = q[lo:lo + q_len].transpose(0, 1)                    # (H, q_len, D)
        ks = k.to(q.dtype).transpose(0, 1)                       # (Hkv, L, D)
        vs = v.to(q.dtype).transpose(0, 1)                       # (Hkv, L, D)
        if seq_len == q_len:
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=group > 1)
        else:
            mask = plan.masks.get(s) if plan.masks is not None else None
            if mask is None:
                mask = _offset_causal_mask(q_len, seq_len, q.device)
                if plan.masks is not None:
                    plan.masks[s] = mask
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=group > 1)
        out[lo:lo + q_len] = o.transpose(0, 1)                   # (q_len, H, D)
    return out


def _offset_causal_mask(q_len: int, seq_len: int, device: torch.device) -> torch.Tensor:
    """(q_len, seq_len) bool: query i sits at position seq_len - q_len + i and sees keys 0..that position."""
    q_pos = torch.arange(seq_len - q_len, seq_len, device=device)
    return torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None]


def _cumsum(lens: list[int]) -> list[int]:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


@register_backend("torch")
class TorchAttentionBackend(AttentionBackend):
    """Reference backend: one ``index_copy_`` of the new K/V per layer, then :func:`paged_attention_ref`. Any device.

    The step plan is cached by the identity of the metadata object: callers build a fresh ``AttentionMetadata`` per
    step (as the model runner does) rather than mutating one in place.
    """

    name = "torch"

    def __init__(self) -> None:
        self._plan: tuple[AttentionMetadata, StepPlan] | None = None  # every layer of a step shares one plan

    def step_plan(self, meta: AttentionMetadata, kv_layer: torch.Tensor, dtype: torch.dtype) -> StepPlan:
        """The plan every layer of ``meta``'s step follows, for queries of ``dtype`` (made by the first layer)."""
        if self._plan is None or self._plan[0] is not meta:
            plan = plan_step(meta, kv_layer.shape[2], kv_layer.device, paged=enabled(kv_layer.device, kv_layer.dtype),
                             paged_prefill=dtype == kv_layer.dtype and paged_prefill_cpu.enabled(
                                 kv_layer.device, kv_layer.dtype, kv_layer.shape[-1]))
            plan.kv_rows = kv_write_rows(kv_layer, meta.slot_mapping)   # the same rows in every layer's view
            self._plan = (meta, plan)
        return self._plan[1]

    def forward(self, q, k, v, kv_layer, meta, scale):
        plan, rows = self.step_plan(meta, kv_layer, q.dtype), kv_token_rows(kv_layer)
        if rows is None:
            self.write_kv(k, v, kv_layer, meta.slot_mapping)
        else:
            write_kv_rows(k, v, rows, plan.kv_rows)
        return paged_attention_ref(q, kv_layer, meta, scale, new_kv=(k, v), plan=plan)
