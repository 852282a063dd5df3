"""flash-attn backend ("flash"): ``flash_attn_varlen_func`` over the paged cache, on CUDA with fp16/bf16.

Registered only when ``flash_attn`` imports (the optional ``gpu`` extra). Upstream flash-attn reads a paged cache
through ``block_table`` only when the block size is a multiple of 256; for smaller blocks (the default is 16) each
sequence's context is first gathered into one contiguous varlen buffer. flash-attn's causal mask is aligned to the
bottom-right when ``seqlen_q < seqlen_k``, which is exactly "new tokens sit at the end of their sequence's context".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from flash_attn import flash_attn_varlen_func  # an ImportError here leaves "flash" unregistered

from pdserve.kernels.base import AttentionBackend, AttentionMetadata, register_backend
from pdserve.kernels.torch_ref import context_slots

PAGED_BLOCK_MULTIPLE = 256  # flash-attn's constraint on page_block_size when block_table is passed


@register_backend("flash")
class FlashAttentionBackend(AttentionBackend):
    """CUDA, fp16/bf16 only (``select_backend`` refuses anything else)."""

    name = "flash"

    def forward(self, q, k, v, kv_layer, meta: AttentionMetadata, scale):
        self.write_kv(k, v, kv_layer, meta.slot_mapping)
        block_size = kv_layer.shape[2]
        cu_seqlens_k = F.pad(torch.cumsum(meta.seq_lens, 0, dtype=torch.int32), (1, 0))  # (S+1,)
        common = dict(cu_seqlens_q=meta.query_start_loc, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=meta.max_query_len,
                      max_seqlen_k=meta.max_seq_len, softmax_scale=scale, causal=True)
        if block_size % PAGED_BLOCK_MULTIPLE == 0:
            # (num_blocks, block_size, Hkv, D) strided views; flash-attn needs only the last dim contiguous
            return flash_attn_varlen_func(q, kv_layer[:, 0], kv_layer[:, 1], block_table=meta.block_tables, **common)
        blocks, offsets = context_slots(meta, block_size, sum(meta.seq_lens_cpu))
        k_ctx = kv_layer[blocks, 0, offsets]                                               # (total, Hkv, D)
        v_ctx = kv_layer[blocks, 1, offsets]                                               # (total, Hkv, D)
        return flash_attn_varlen_func(q, k_ctx, v_ctx, **common)
