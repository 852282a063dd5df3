"""Torch reference attention backend ("torch"): the CPU default and the oracle the Triton/flash kernels are tested against.

Decode tokens (one new token per sequence) are batched into one SDPA call over a padded gather of their contexts;
prefill chunks run one SDPA call per sequence with a causal mask offset by the cached context length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.kernels.base import AttentionBackend, AttentionMetadata, register_backend


def gather_context(kv_layer: torch.Tensor, block_table: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the first ``num_tokens`` cache slots named by one sequence's ``block_table`` -> 2 x (L, Hkv, D)."""
    block_size = kv_layer.shape[2]
    num_blocks = -(-num_tokens // block_size)
    table = block_table[:num_blocks].long()
    k = kv_layer[:, 0][table].flatten(0, 1)[:num_tokens]        # (nb, bs, Hkv, D) -> (L, Hkv, D)
    v = kv_layer[:, 1][table].flatten(0, 1)[:num_tokens]        # (L, Hkv, D)
    return k, v


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


def paged_attention_ref(
    q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its cached context (KV already written). -> (T, H, D).

    ``new_kv``: this step's (k, v), used directly for sequences whose whole context is new (a first full prefill),
    saving a gather; values are identical to the cache's when the cache dtype equals the compute dtype.
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = kv_layer.shape[3]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    starts = _cumsum(meta.query_lens_cpu)  # host copy: no device sync
    decode_seqs = [s for s, n in enumerate(meta.query_lens_cpu) if n == 1]
    if decode_seqs:
        rows = [starts[s] for s in decode_seqs]
        out[rows] = _decode_batch(q[rows], kv_layer, meta, decode_seqs, scale, group)
    for s, q_len in enumerate(meta.query_lens_cpu):
        if q_len == 1 or q_len == 0:
            continue
        lo, seq_len = starts[s], meta.seq_lens_cpu[s]
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
            # query i sits at position seq_len - q_len + i and sees keys 0..that position
            q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
            mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]   # (q_len, L)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=group > 1)
        out[lo:lo + q_len] = o.transpose(0, 1)                   # (q_len, H, D)
    return out


def _decode_batch(
    q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, seqs: list[int], scale: float, group: int,
) -> torch.Tensor:
    """One query per sequence: gather every context padded to the longest, mask the padding. q (B, H, D) -> (B, H, D)."""
    block_size, num_kv_heads, head_dim = kv_layer.shape[2], kv_layer.shape[3], kv_layer.shape[4]
    lens = [meta.seq_lens_cpu[s] for s in seqs]
    max_len = max(lens)
    num_blocks = -(-max_len // block_size)
    idx = torch.tensor(seqs, device=meta.block_tables.device)
    tables = meta.block_tables[idx, :num_blocks].long()                      # (B, nb)
    k = kv_layer[:, 0][tables].flatten(1, 2).to(q.dtype)                     # (B, nb, bs, Hkv, D) -> (B, L, Hkv, D)
    v = kv_layer[:, 1][tables].flatten(1, 2).to(q.dtype)                     # (B, L, Hkv, D)
    b = len(seqs)
    qg = q.view(b, num_kv_heads, group, head_dim)                            # (B, Hkv, G, D): the group acts as query rows
    lens_t = torch.tensor(lens, device=q.device)
    mask = torch.arange(num_blocks * block_size, device=q.device)[None, :] < lens_t[:, None]  # (B, L)
    o = F.scaled_dot_product_attention(
        qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None, None, :], scale=scale,
    )                                                                        # (B, Hkv, G, D)
    return o.reshape(b, num_kv_heads * group, head_dim)                      # (B, H, D)


def _cumsum(lens: list[int]) -> list[int]:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


@register_backend("torch")
class TorchAttentionBackend(AttentionBackend):
    """Reference backend: ``write_kv`` scatter, then :func:`paged_attention_ref`. Runs on any device."""

    name = "torch"

    def forward(self, q, k, v, kv_layer, meta, scale):
        self.write_kv(k, v, kv_layer, meta.slot_mapping)
        return paged_attention_ref(q, kv_layer, meta, scale, new_kv=(k, v))
