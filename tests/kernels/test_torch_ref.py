"""The torch reference backend vs attention computed naively on dense, unpaged K/V (a loop over tokens)."""

from __future__ import annotations

import math

import torch

from pdserve.kernels.base import AttentionBackend
from pdserve.kernels.torch_ref import TorchAttentionBackend, context_slots
from tests.kernels.paged_batch import PagedBatchBuilder


def _naive(q, k_all, v_all, q_pos, scale):
    """One query token (H, D) at position q_pos over dense keys (L, Hkv, D): softmax by hand, GQA by head index."""
    H, group = q.shape[0], q.shape[0] // k_all.shape[1]
    out = torch.empty_like(q)
    for h in range(H):
        keys, vals = k_all[: q_pos + 1, h // group], v_all[: q_pos + 1, h // group]   # (q_pos+1, D)
        w = [math.exp(float(q[h] @ key) * scale) for key in keys]
        out[h] = sum(wi * val for wi, val in zip(w, vals)) / sum(w)
    return out


def test_mixed_batch_matches_naive_attention():
    H, Hkv, D, bs = 6, 2, 8, 16
    gen = torch.Generator().manual_seed(0)
    builder = PagedBatchBuilder(num_blocks=12, block_size=bs, seed=3)
    kv = torch.randn(12, 2, bs, Hkv, D, generator=gen)
    dense = {s: (torch.empty(0, Hkv, D), torch.empty(0, Hkv, D)) for s in range(3)}
    for step in [{0: 18, 1: 5}, {1: 1, 0: 4, 2: 16}, {0: 1, 1: 1, 2: 1}]:
        meta, positions = builder.step(step)
        T = sum(step.values())
        q, k, v = (torch.randn(T, h, D, generator=gen) for h in (H, Hkv, Hkv))
        got = TorchAttentionBackend().forward(q, k, v, kv, meta, 0.3)
        row = 0
        for s, n in step.items():
            dense[s] = (torch.cat([dense[s][0], k[row:row + n]]), torch.cat([dense[s][1], v[row:row + n]]))
            for i in range(n):
                want = _naive(q[row + i], *dense[s], int(positions[row + i]), 0.3)
                torch.testing.assert_close(got[row + i], want, atol=1e-5, rtol=1e-5)
            row += n


def test_write_kv_lands_at_slots():
    kv = torch.zeros(4, 2, 16, 1, 2)
    k, v = torch.ones(2, 1, 2), torch.full((2, 1, 2), 2.0)
    AttentionBackend.write_kv(k, v, kv, torch.tensor([3 * 16 + 5, 1 * 16 + 15]))
    assert kv[3, 0, 5].sum() == 2 and kv[1, 1, 15].sum() == 4 and kv.sum() == 12


def test_context_slots_walk_each_block_table():
    builder = PagedBatchBuilder(num_blocks=10, block_size=4, seed=1)
    meta, _ = builder.step({0: 6, 1: 9})
    blocks, offsets = context_slots(meta, 4, 15)
    want = [(builder.tables[s][p // 4], p % 4) for s, n in ((0, 6), (1, 9)) for p in range(n)]
    assert list(zip(blocks.tolist(), offsets.tolist())) == want


def test_decodes_are_bucketed_by_length():
    from pdserve.kernels.torch_ref import plan_step

    builder = PagedBatchBuilder(num_blocks=40, block_size=16)
    lens = {0: 20, 1: 100, 2: 17, 3: 90, 4: 18}
    builder.step({s: n - 1 for s, n in lens.items()})
    meta, _ = builder.step({s: 1 for s in lens} | {5: 7})  # five decodes and a prefill
    plan = plan_step(meta, 16, torch.device("cpu"))
    assert [g.rows.tolist() for g in plan.decode_groups] == [[1, 3], [0, 4, 2]]  # longest first
    assert [g.tables.shape[1] for g in plan.decode_groups] == [7, 2]  # 100 -> 7 blocks, 20 -> 2 blocks
    assert plan.prefills == [(5, 5, 7, 7)]


def test_gather_blocks_reads_one_layer_of_a_block_major_cache():
    from pdserve.kernels.torch_ref import gather_blocks

    cache = torch.randn(5, 3, 2, 4, 2, 8)   # (num_blocks, num_layers, 2, block_size, Hkv, D): layer views are strided
    tables = torch.tensor([[4, 0], [2, 3]])
    for kv_layer in (cache[:, 1], cache[:, 2].clone()):
        k, v = gather_blocks(kv_layer, tables)
        assert k.shape == (2, 8, 2, 8)
        torch.testing.assert_close(k, kv_layer[:, 0][tables].flatten(1, 2), rtol=0, atol=0)
        torch.testing.assert_close(v, kv_layer[:, 1][tables].flatten(1, 2), rtol=0, atol=0)


def test_decode_attention_matches_sdpa_over_padded_contexts():
    from pdserve.kernels.torch_ref import decode_attention

    gen = torch.Generator().manual_seed(5)
    B, H, Hkv, L, D = 3, 6, 2, 20, 8
    q, k, v = torch.randn(B, H, D, generator=gen), torch.randn(B, L, Hkv, D, generator=gen), torch.randn(B, L, Hkv, D, generator=gen)
    mask = (torch.arange(L)[None, :] < torch.tensor([20, 7, 13])[:, None])[:, None, None, :]   # (B, 1, 1, L)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.view(B, Hkv, H // Hkv, D), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=0.3)
    pad = ~mask.view(B, 1, L)                                                                   # True = padding
    torch.testing.assert_close(decode_attention(q, k, v, pad, 0.3), want.reshape(B, H, D), atol=1e-5, rtol=1e-5)


def _decode_reference(q, k, v, lens, scale):
    """Per sequence and head, in float64, over only the real slots: the answer ``decode_attention`` must give."""
    B, H, D = q.shape
    group = H // k.shape[2]
    out = torch.empty(B, H, D, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            keys, vals = k[b, : lens[b], h // group].double(), v[b, : lens[b], h // group].double()
            out[b, h] = torch.softmax(keys @ q[b, h].double() * scale, 0) @ vals
    return out


def test_decode_attention_groups_queries_by_kv_head_and_masks_padding():
    from pdserve.kernels.torch_ref import decode_attention

    gen = torch.Generator().manual_seed(5)
    for H, Hkv in ((9, 3), (4, 4), (8, 1)):          # GQA (the default model's 9/3), MHA, MQA
        B, L, D = 5, 40, 16
        q, k, v = torch.randn(B, H, D, generator=gen), torch.randn(B, L, Hkv, D, generator=gen), \
            torch.randn(B, L, Hkv, D, generator=gen)
        lens = [40, 33, 1, 17, 39]
        pad = (torch.arange(L)[None, :] >= torch.tensor(lens)[:, None])[:, None, :]   # (B, 1, L)
        k[1, 33:] = 1e4                                # padding must not leak into a shorter sequence's softmax
        want = _decode_reference(q, k, v, lens, 0.25)
        torch.testing.assert_close(decode_attention(q, k, v, pad, 0.25).double(), want, atol=1e-5, rtol=1e-5)
        got16 = decode_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), pad, 0.25)
        assert got16.dtype == torch.bfloat16
        torch.testing.assert_close(got16.double(), want, atol=3e-2, rtol=3e-2)


def test_one_copy_kv_write_equals_indexed_assignment_on_a_strided_layer():
    from pdserve.kernels.base import kv_token_rows, kv_write_rows, write_kv_rows

    gen = torch.Generator().manual_seed(2)
    cache = torch.randn(6, 3, 2, 4, 2, 8, generator=gen)  # (blocks, layers, 2, bs, Hkv, D): a layer view is strided
    slots = torch.tensor([5 * 4 + 3, 0, 2 * 4 + 1, 4 * 4 + 2])
    k, v = torch.randn(4, 2, 8, generator=gen), torch.randn(4, 2, 8, generator=gen)
    want = cache.clone()
    want[:, 1][slots // 4, 0, slots % 4] = k
    want[:, 1][slots // 4, 1, slots % 4] = v
    got = cache.clone()
    write_kv_rows(k, v, kv_token_rows(got[:, 1]), kv_write_rows(got[:, 1], slots))
    assert torch.equal(got, want)                        # the other layers and slots untouched
    got = cache.clone()
    AttentionBackend.write_kv(k, v, got[:, 1], slots)
    assert torch.equal(got, want)
    odd = cache[:, 1].transpose(3, 4)                    # strides with no row view: the indexed fallback
    assert kv_token_rows(odd) is None
    AttentionBackend.write_kv(k.transpose(1, 2), v.transpose(1, 2), odd, slots)
    assert torch.equal(cache, want)
