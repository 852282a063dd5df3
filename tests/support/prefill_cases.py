"""Paged prefill-attention cases for the CPU kernels' tests (tests/kernels/test_paged_prefill_cpu.py, bf16;
tests/kernels/test_paged_prefill_f32_cpu.py, float32): a cache layer, its block tables and rows, and a float64
reference."""

from __future__ import annotations

import torch

BS = 16


def case(heads, kv_heads, chunks, seed=0, head_dim=64, dtype=torch.bfloat16):
    """A ``dtype`` block-major cache layer with NaN in every slot no sequence uses, and for each (q_len, seq_len)
    chunk its block table, its query rows (one unused row between sequences) and an ``info`` row (first row, q_len,
    seq_len)."""
    gen = torch.Generator().manual_seed(seed)
    nb = max(-(-n // BS) for _, n in chunks) + 1
    num_blocks = len(chunks) * nb + 8
    cache = torch.full((num_blocks, 3, 2, BS, kv_heads, head_dim), float("nan"), dtype=dtype)
    tables = torch.randperm(num_blocks, generator=gen)[:len(chunks) * nb].view(len(chunks), nb).contiguous()
    info, row = [], 0
    for s, (q_len, n) in enumerate(chunks):
        for i in range(-(-n // BS)):
            used = min(BS, n - i * BS)
            cache[tables[s, i], 1, :, :used] = torch.randn(2, used, kv_heads, head_dim, generator=gen).to(dtype)
        info.append([row, q_len, n])
        row += q_len + 1
    q = torch.randn(row, heads, head_dim, generator=gen).to(dtype)
    return q, cache[:, 1], tables, torch.tensor(info)


def reference(q, kv, tables, info, scale):
    """float64 causal attention of each chunk's rows -> {first row: (q_len, H, D)}."""
    group = q.shape[1] // kv.shape[3]
    out = {}
    for s, (r0, q_len, n) in enumerate(info.tolist()):
        blocks = tables[s, :-(-n // BS)]
        k = kv[blocks, 0].flatten(0, 1)[:n].double().repeat_interleave(group, 1)   # (n, H, D)
        v = kv[blocks, 1].flatten(0, 1)[:n].double().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,lhd->hql", q[r0:r0 + q_len].double(), k) * scale
        visible = torch.arange(n)[None, :] <= torch.arange(n - q_len, n)[:, None]
        p = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[r0] = torch.einsum("hql,lhd->qhd", p, v)
    return out
