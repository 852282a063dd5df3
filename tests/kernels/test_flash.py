"""flash-attn backend vs the torch reference on the GPU (both the gather path and the native paged path)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.kernels.paged_batch import PagedBatchBuilder

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None),
    reason="needs CUDA + flash-attn",
)


@pytest.mark.parametrize("block_size", [16, 256])
def test_flash_matches_reference(block_size):
    from pdserve.kernels.flash import FlashAttentionBackend
    from pdserve.kernels.torch_ref import TorchAttentionBackend

    H, Hkv, D = 8, 2, 64
    num_blocks = 4096 // block_size + 8
    builder = PagedBatchBuilder(num_blocks=num_blocks, block_size=block_size, seed=2)
    kv_ref = torch.randn(num_blocks, 2, block_size, Hkv, D, device="cuda", dtype=torch.bfloat16)
    kv_fa = kv_ref.clone()
    for step in [{0: 300, 1: 17}, {1: 1, 0: 45, 2: 260}, {0: 1, 1: 1, 2: 1}]:
        meta, _ = builder.step(step, device="cuda")
        T = sum(step.values())
        q, k, v = (torch.randn(T, h, D, device="cuda", dtype=torch.bfloat16) for h in (H, Hkv, Hkv))
        ref = TorchAttentionBackend().forward(q, k, v, kv_ref, meta, D ** -0.5)
        got = FlashAttentionBackend().forward(q, k, v, kv_fa, meta, D ** -0.5)
        torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)
