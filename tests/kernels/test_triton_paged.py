"""The Triton paged-attention kernel vs the torch reference, in Triton's CPU interpreter (small shapes: it is slow).

Covers block sizes, odd lengths, several sequences, prefill chunks over cached context mixed with decodes in one batch,
and GQA ratios (including a non-power-of-two group, as in SmolLM2's 9 query / 3 kv heads).
"""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.torch_ref import TorchAttentionBackend, paged_attention_ref
from pdserve.kernels.triton_paged import TritonAttentionBackend, paged_attention
from tests.kernels.paged_batch import PagedBatchBuilder

CASES = {
    # name: (block_size, num_heads, num_kv_heads, head_dim, steps: list of {seq: new tokens})
    "prefill-mha": (16, 2, 2, 16, [{0: 21}]),
    "multi-prefill-gqa2": (16, 4, 2, 32, [{0: 5, 1: 17, 2: 33}]),
    "chunks-and-decodes-gqa3": (16, 3, 1, 16, [{0: 19, 1: 3}, {0: 1, 1: 14, 2: 1}]),
    "decode-batch-gqa4": (16, 8, 2, 16, [{0: 17, 1: 32, 2: 1}, {0: 1, 1: 1, 2: 1}]),
    "block32-head-dim-24": (32, 2, 1, 24, [{0: 40, 1: 7}, {1: 30, 0: 1}]),
    "block8": (8, 4, 4, 16, [{0: 11}, {0: 9, 1: 2}]),
}


def _run(case: str, dtype=torch.float32):
    block_size, H, Hkv, D, steps = CASES[case]
    gen = torch.Generator().manual_seed(len(case))
    builder = PagedBatchBuilder(num_blocks=16, block_size=block_size, seed=7)
    kv_ref = torch.randn(16, 2, block_size, Hkv, D, generator=gen).to(dtype)  # garbage in unused slots must not leak
    kv_tri = kv_ref.clone()
    for step in steps:
        meta, _ = builder.step(step)
        T = sum(step.values())
        q, k, v = (torch.randn(T, h, D, generator=gen).to(dtype) for h in (H, Hkv, Hkv))
        ref = TorchAttentionBackend().forward(q, k, v, kv_ref, meta, D ** -0.5)
        got = TritonAttentionBackend().forward(q, k, v, kv_tri, meta, D ** -0.5)
        yield got, ref
    assert torch.equal(kv_tri, kv_ref)


@pytest.mark.parametrize("case", list(CASES))
def test_triton_matches_reference(case):
    for got, ref in _run(case):
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_16bit_matches_reference(dtype):
    for got, ref in _run("chunks-and-decodes-gqa3", dtype):
        torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_block_n_tiling_independent_of_block_size():
    block_size, H, Hkv, D, steps = CASES["multi-prefill-gqa2"]
    builder = PagedBatchBuilder(num_blocks=16, block_size=block_size)
    meta, _ = builder.step(steps[0])
    kv = torch.randn(16, 2, block_size, Hkv, D)
    q = torch.randn(sum(steps[0].values()), H, D)
    ref = paged_attention_ref(q, kv, meta, 0.2)
    for block_n in (16, 32):
        torch.testing.assert_close(paged_attention(q, kv, meta, 0.2, block_n=block_n), ref, atol=2e-5, rtol=1e-4)


def test_launcher_rejects_bad_shapes():
    builder = PagedBatchBuilder(num_blocks=4, block_size=16)
    meta, _ = builder.step({0: 3})
    kv = torch.zeros(4, 2, 16, 3, 16)
    with pytest.raises(AssertionError):
        paged_attention(torch.zeros(3, 4, 16), kv, meta, 1.0)  # 4 query heads over 3 kv heads
    with pytest.raises(AssertionError):
        paged_attention(torch.zeros(5, 3, 16), kv, meta, 1.0)  # 5 tokens, metadata says 3


@pytest.mark.parametrize("case", ["decode-batch-gqa4", "chunks-and-decodes-gqa3"])
def test_split_keys_match_reference(case):
    """Flash-decoding style key splits (chosen on GPUs for small decode batches), forced here, incl. empty splits."""
    block_size, H, Hkv, D, steps = CASES[case]
    builder = PagedBatchBuilder(num_blocks=16, block_size=block_size, seed=7)
    kv = torch.randn(16, 2, block_size, Hkv, D)
    for step in steps:
        meta, _ = builder.step(step)
        q = torch.randn(sum(step.values()), H, D)
        ref = paged_attention_ref(q, kv, meta, 0.25)
        for splits in (2, 5):
            torch.testing.assert_close(paged_attention(q, kv, meta, 0.25, num_splits=splits), ref, atol=2e-5, rtol=1e-4)
