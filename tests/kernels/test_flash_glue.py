"""The flash backend's glue (cu_seqlens, context gather for small blocks, block_table for 256-token blocks) on CPU,
against a stand-in ``flash_attn`` module: flash-attn needs a GPU, which this machine lacks, so its documented
``flash_attn_varlen_func`` semantics are re-implemented here in torch (bottom-right causal alignment, GQA, paging)."""

from __future__ import annotations

import importlib
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels import base
from pdserve.kernels.torch_ref import paged_attention_ref
from tests.kernels.paged_batch import PagedBatchBuilder


def _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None, causal=False,
            block_table=None):
    out = torch.empty_like(q)
    for i in range(len(cu_seqlens_q) - 1):
        q0, q1 = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        k0, k1 = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
        assert q1 - q0 <= max_seqlen_q and k1 - k0 <= max_seqlen_k
        if block_table is None:
            ki, vi = k[k0:k1], v[k0:k1]
        else:  # paged: k/v are (num_blocks, page_size, Hkv, D)
            n = k1 - k0
            ki = k[block_table[i].long()].flatten(0, 1)[:n]
            vi = v[block_table[i].long()].flatten(0, 1)[:n]
        Lq, Lk = q1 - q0, k1 - k0
        mask = torch.arange(Lk)[None, :] <= torch.arange(Lq)[:, None] + (Lk - Lq)  # bottom-right aligned
        o = F.scaled_dot_product_attention(q[q0:q1].transpose(0, 1), ki.transpose(0, 1), vi.transpose(0, 1),
                                           attn_mask=mask if causal else None, scale=softmax_scale, enable_gqa=True)
        out[q0:q1] = o.transpose(0, 1)
    return out


@pytest.fixture
def flash_backend(monkeypatch):
    fake = types.ModuleType("flash_attn")
    fake.flash_attn_varlen_func = _varlen
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))
    monkeypatch.delitem(sys.modules, "pdserve.kernels.flash", raising=False)
    module = importlib.import_module("pdserve.kernels.flash")
    yield module.FlashAttentionBackend()
    sys.modules.pop("pdserve.kernels.flash", None)


@pytest.mark.parametrize("block_size", [16, 256])
def test_flash_glue_matches_reference(flash_backend, block_size):
    H, Hkv, D = 6, 2, 16
    builder = PagedBatchBuilder(num_blocks=64, block_size=block_size, seed=9)
    kv = torch.randn(64, 2, block_size, Hkv, D)
    for step in [{0: 40, 1: 7}, {1: 1, 0: 21, 2: 30}, {0: 1, 1: 1, 2: 1}]:
        meta, _ = builder.step(step)
        T = sum(step.values())
        q, k, v = (torch.randn(T, h, D) for h in (H, Hkv, Hkv))
        got = flash_backend.forward(q, k, v, kv, meta, 0.3)
        torch.testing.assert_close(got, paged_attention_ref(q, kv, meta, 0.3), atol=1e-5, rtol=1e-5)
