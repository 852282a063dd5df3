"""Triton paged attention ("triton"): one kernel for prefill chunks over cached context and for decode, with GQA.

Each program owns one sequence, one kv head and a tile of BLOCK_Q of that sequence's new tokens. The tile's rows are
(token, query head of the group) pairs, so the group's query heads share every K/V load (decode with GQA fills a tile
from a single token). Keys are walked BLOCK_N at a time through the block table (any block size), with an online
softmax in float32 and the causal bound ``key_pos <= query_pos`` where ``query_pos = seq_len - q_len + i``.
Decode steps too small to fill the GPU split each context's keys across programs (flash-decoding); the per-split
(max, sum, acc) partials are merged with a few torch ops.

On CUDA the kernel is compiled. On CPU it runs only in Triton's interpreter (slow; tests), which needs
``TRITON_INTERPRET=1`` before triton is first imported: ``triton.jit`` and Triton's own library functions choose
compiled or interpreted at decoration time.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pdserve.kernels.base import AttentionBackend, AttentionMetadata, register_backend


def _paged_attention_kernel(
    Q, K, V, Out,                     # Q/Out: (T, H, D); K/V: (num_blocks, block_size, Hkv, D) views of one layer's cache
    PartialAcc, PartialML,            # NUM_SPLITS > 1: (T, H, NUM_SPLITS, D) and (T, H, NUM_SPLITS, 2) float32 partials
    BlockTables, SeqLens, QueryStartLoc,  # (S, max_blocks) int32, (S,) int32, (S+1,) int32
    qk_scale,                         # softmax scale * log2(e): the kernel works in base 2
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    stride_bt,
    num_heads,
    GROUP: tl.constexpr,              # query heads per kv head
    GROUP_PAD: tl.constexpr,          # GROUP rounded up to a power of two
    BLOCK_Q: tl.constexpr,            # new tokens per program; BLOCK_M = BLOCK_Q * GROUP_PAD rows
    BLOCK_N: tl.constexpr,            # keys per inner iteration
    BLOCK_SIZE: tl.constexpr,         # tokens per cache block
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,       # HEAD_DIM rounded up to a power of two
    DOT_PRECISION: tl.constexpr,      # "ieee" for float32 models (no tf32), "tf32" otherwise (ignored for 16-bit inputs)
    DOT_F32: tl.constexpr,            # upcast dot operands: Triton 3.9's CPU interpreter computes bf16 tl.dot wrongly
    NUM_SPLITS: tl.constexpr,         # > 1: split the keys across programs (flash-decoding), partials merged after
):
    seq = tl.program_id(0)
    q_block = tl.program_id(1)
    kv_head = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS
    q_start = tl.load(QueryStartLoc + seq)
    q_len = tl.load(QueryStartLoc + seq + 1) - q_start
    if q_block * BLOCK_Q < q_len:
        seq_len = tl.load(SeqLens + seq)
        ctx_len = seq_len - q_len                                   # tokens cached before this step

        rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
        q_idx = q_block * BLOCK_Q + rows // GROUP_PAD               # new-token index within the sequence
        g = rows % GROUP_PAD
        head = kv_head * GROUP + g
        row_ok = (q_idx < q_len) & (g < GROUP)
        d = tl.arange(0, HEAD_DIM_PAD)
        d_ok = d < HEAD_DIM
        q_ptrs = Q + (q_start + q_idx)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :] * stride_qd
        q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)   # (BLOCK_M, HEAD_DIM_PAD)
        if DOT_F32:
            q = q.to(tl.float32)
        q_pos = ctx_len + q_idx                                     # (BLOCK_M,) absolute positions

        m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
        acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM_PAD], tl.float32)
        # keys past the tile's last query are never visible; this program takes split `split` of the rest
        kv_end = tl.minimum(seq_len, ctx_len + (q_block + 1) * BLOCK_Q)
        split_len = tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), BLOCK_N) * BLOCK_N
        kv_lo = split * split_len
        kv_hi = tl.minimum(kv_end, kv_lo + split_len)
        for start in range(kv_lo, kv_hi, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            n_ok = n < kv_hi
            block = tl.load(BlockTables + seq * stride_bt + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
            slot = n % BLOCK_SIZE
            k_ptrs = K + block[None, :] * stride_kb + slot[None, :] * stride_ks + kv_head * stride_kh + d[:, None] * stride_kd
            k = tl.load(k_ptrs, mask=n_ok[None, :] & d_ok[:, None], other=0.0)         # (HEAD_DIM_PAD, BLOCK_N)
            if DOT_F32:
                k = k.to(tl.float32)
            s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale                 # (BLOCK_M, BLOCK_N)
            visible = (n[None, :] <= q_pos[:, None]) & n_ok[None, :]
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # a row that has seen no visible key yet (possible past split 0) keeps m = -inf: avoid inf - inf
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_use[:, None])
            alpha = tl.exp2(m_i - m_use)
            l_i = l_i * alpha + tl.sum(p, 1)
            v_ptrs = V + block[:, None] * stride_vb + slot[:, None] * stride_vs + kv_head * stride_vh + d[None, :] * stride_vd
            v = tl.load(v_ptrs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)         # (BLOCK_N, HEAD_DIM_PAD)
            if DOT_F32:
                v = v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new
        if NUM_SPLITS == 1:
            acc = acc / l_i[:, None]
            o_ptrs = Out + (q_start + q_idx)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :] * stride_od
            tl.store(o_ptrs, acc.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        else:
            part = ((q_start + q_idx).to(tl.int64) * num_heads + head) * NUM_SPLITS + split     # (BLOCK_M,)
            tl.store(PartialAcc + part[:, None] * HEAD_DIM + d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])
            tl.store(PartialML + part * 2, m_i, mask=row_ok)
            tl.store(PartialML + part * 2 + 1, l_i, mask=row_ok)


_kernel = triton.jit(_paged_attention_kernel)


def _check_runnable(device: torch.device) -> None:
    from triton.runtime.interpreter import InterpretedFunction

    if device.type == "cpu" and not isinstance(_kernel, InterpretedFunction):
        raise RuntimeError("the Triton kernel runs on CPU only in Triton's interpreter: set TRITON_INTERPRET=1 before "
                           "triton is first imported (or use the 'torch' backend on CPU)")


def kernel_constants(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, max_query_len: int,
                     dtype: torch.dtype, device_type: str, block_n: int | None = None, block_m: int = 64,
                     num_splits: int = 1) -> dict:
    """The kernel's compile-time constants for one launch shape (also used to compile it ahead of time in tests)."""
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_q = max(1, min(triton.next_power_of_2(max_query_len), block_m // group_pad))
    # tl.dot needs >= 16 rows: decode tiles are padded with masked rows (decode is memory bound; they are nearly free)
    block_q = max(block_q, 16 // group_pad)
    return dict(
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_N=block_n or (16 if device_type == "cpu" else 64),
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
        DOT_F32=device_type == "cpu" and dtype == torch.bfloat16,
        NUM_SPLITS=num_splits,
    )


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def choose_num_splits(device: torch.device, num_programs: int, max_query_len: int, max_seq_len: int) -> int:
    """Split the keys only for decode steps too small to fill the GPU (few sequences x kv heads, long contexts)."""
    if device.type != "cuda" or max_query_len != 1:
        return 1
    target = 2 * _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    if num_programs >= target:
        return 1
    return max(1, min(16, triton.cdiv(target, num_programs), max_seq_len // 512))


def paged_attention(
    q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float,
    out: torch.Tensor | None = None, block_n: int | None = None, block_m: int = 64, num_splits: int | None = None,
) -> torch.Tensor:
    """Causal attention of every new query over its sequence's cached context (KV already written). -> (T, H, D).

    ``num_splits``: key splits per (sequence, kv head); None chooses (1 except small decode batches on a GPU).
    """
    assert q.dim() == 3 and kv_layer.dim() == 5 and kv_layer.shape[1] == 2, (q.shape, kv_layer.shape)
    T, H, D = q.shape
    num_blocks, _, block_size, Hkv, Dk = kv_layer.shape
    assert Dk == D and H % Hkv == 0, f"q heads {H} x {D} vs kv heads {Hkv} x {Dk}"
    S = meta.num_seqs
    assert meta.block_tables.dim() == 2 and meta.block_tables.shape[0] == S and meta.block_tables.dtype == torch.int32
    assert meta.seq_lens.shape == (S,) and meta.query_start_loc.shape == (S + 1,)
    assert meta.seq_lens.dtype == meta.query_start_loc.dtype == torch.int32
    assert sum(meta.query_lens_cpu) == T, "query_lens_cpu must add up to the number of new tokens"
    assert q.device == kv_layer.device == meta.block_tables.device
    out = torch.empty_like(q) if out is None else out
    assert out.shape == q.shape
    if T == 0:
        return out
    consts = kernel_constants(H, Hkv, D, block_size, meta.max_query_len, q.dtype, q.device.type, block_n, block_m)
    q_blocks = triton.cdiv(meta.max_query_len, consts["BLOCK_Q"])
    if num_splits is None:
        num_splits = choose_num_splits(q.device, S * q_blocks * Hkv, meta.max_query_len, meta.max_seq_len)
    consts["NUM_SPLITS"] = num_splits
    if num_splits > 1:
        partial_acc = torch.empty(T, H, num_splits, D, dtype=torch.float32, device=q.device)
        partial_ml = torch.empty(T, H, num_splits, 2, dtype=torch.float32, device=q.device)
    else:
        partial_acc = partial_ml = out  # never touched: the kernel writes Out directly
    k, v = kv_layer[:, 0], kv_layer[:, 1]                 # (num_blocks, block_size, Hkv, D) strided views
    _check_runnable(q.device)
    _kernel[(S, q_blocks, Hkv * num_splits)](
        q, k, v, out, partial_acc, partial_ml, meta.block_tables, meta.seq_lens, meta.query_start_loc,
        scale * 1.4426950408889634,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2), k.stride(3),
        v.stride(0), v.stride(1), v.stride(2), v.stride(3),
        out.stride(0), out.stride(1), out.stride(2),
        meta.block_tables.stride(0), H,
        **consts,
    )
    if num_splits > 1:
        m, l = partial_ml.unbind(-1)                                   # 2 x (T, H, splits), log2 domain
        w = torch.exp2(m - m.amax(-1, keepdim=True))                   # empty splits (m = -inf) weigh 0
        merged = (partial_acc * w[..., None]).sum(2) / (l * w).sum(-1)[..., None]   # (T, H, D)
        out.copy_(merged)
    return out


@register_backend("triton")
class TritonAttentionBackend(AttentionBackend):
    """``write_kv`` scatter (one indexed copy each for K and V), then the Triton kernel."""

    name = "triton"

    def forward(self, q, k, v, kv_layer, meta, scale):
        self.write_kv(k, v, kv_layer, meta.slot_mapping)
        return paged_attention(q, kv_layer, meta, scale)
