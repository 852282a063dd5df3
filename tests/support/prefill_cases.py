"""Paged prefill-attention cases for the CPU kernels' tests (tests/kernels/test_paged_prefill_cpu.py, bf16;
tests/kernels/test_paged_prefill_f32_cpu.py, float32): a cache layer, its block tables and rows, and a float64
reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

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


def errors_vs_sdpa(q, kv, tables, info, out, scale=0.125):
    """Per chunk, (the max error of ``out`` vs float64, that of torch's SDPA on the same inputs and dtype)."""
    ref = reference(q, kv, tables, info, scale)
    pairs = []
    for s, (r0, q_len, n) in enumerate(info.tolist()):
        blocks = tables[s, :-(-n // BS)]
        k, v = (kv[blocks, i].flatten(0, 1)[:n].transpose(0, 1) for i in (0, 1))
        visible = torch.arange(n)[None, :] <= torch.arange(n - q_len, n)[:, None]
        sdpa = F.scaled_dot_product_attention(q[r0:r0 + q_len].transpose(0, 1), k, v, attn_mask=visible, scale=scale,
                                              enable_gqa=True).transpose(0, 1)
        pairs.append((float((out[r0:r0 + q_len].double() - ref[r0]).abs().max()),
                      float((sdpa.double() - ref[r0]).abs().max())))
    return pairs


def assert_bad_tables_and_rows_rejected(run, q, kv, tables, info):
    """``run(q, kv, tables, info)`` raises on a block id past the cache, a seq_len past the table or below q_len, and
    query rows outside q (``info``: two chunks, the second 5 rows over 40 slots)."""
    bad = tables.clone()
    bad[1, 2] = kv.shape[0]
    with pytest.raises(RuntimeError, match="block id out of range"):
        run(q, kv, bad, info)
    for row, match in (([0, 20, tables.shape[1] * BS + 1], "seq_len"), ([0, 20, 19], "seq_len"),
                       ([q.shape[0] - 3, 5, 40], "query rows"), ([0, 0, 5], "query rows")):
        with pytest.raises(RuntimeError, match=match):
            run(q, kv, tables, torch.tensor([row, info[1].tolist()]))
