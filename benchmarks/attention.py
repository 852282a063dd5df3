"""Paged attention benchmark: pdserve's Triton kernel vs torch SDPA on the same shapes (and flash-attn when present).

On CUDA: times decode and prefill shapes in bf16, prints each kernel's time, the Triton/SDPA speed ratio and the
Triton kernel's achieved memory bandwidth (K/V context + Q + output bytes / time) as a fraction of the GPU's peak
(the nominal peak for known GPUs, and the bandwidth of a plain device copy measured here).
SDPA reads contiguous, unpadded K/V (the best case for it); the Triton kernel reads the paged cache through a
shuffled block table, as the engine does.

On CPU (no GPU): a smoke run of tiny shapes in Triton's interpreter, checked against the torch reference; its timings
say nothing about GPU performance.

    python benchmarks/attention.py [--dtype bfloat16] [--block-size 16]
"""

from __future__ import annotations

import argparse
import os
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import torch.nn.functional as F  # noqa: E402

from pdserve.kernels import available_backends  # noqa: E402
from pdserve.kernels.base import AttentionMetadata  # noqa: E402
from pdserve.kernels.torch_ref import paged_attention_ref  # noqa: E402
from pdserve.kernels.triton_paged import paged_attention  # noqa: E402

# Nominal HBM bandwidth, bytes/s, by a substring of torch.cuda.get_device_name().
PEAK_BW = {"H200": 4.8e12, "H100 PCIe": 2.0e12, "H100": 3.35e12, "A100-SXM4-80GB": 2.039e12, "A100 80GB PCIe": 1.935e12,
           "A100": 1.555e12, "L40S": 0.864e12, "L4": 0.3e12, "A10G": 0.6e12, "RTX 4090": 1.008e12}


def make_batch(q_lens: list[int], seq_lens: list[int], block_size: int, num_kv_heads: int, head_dim: int,
               dtype: torch.dtype, device: str, seed: int = 0):
    """A filled paged cache (one layer) with shuffled block ids, plus the metadata of one step over it."""
    gen = torch.Generator().manual_seed(seed)
    nb_per = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(nb_per) + 1
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    tables, width = [], max(nb_per)
    for n in nb_per:
        tables.append([ids.pop() for _ in range(n)] + [0] * (width - n))
    kv = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    slots = [tables[s][p // block_size] * block_size + p % block_size
             for s, (q, L) in enumerate(zip(q_lens, seq_lens)) for p in range(L - q, L)]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=device), query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device), max_query_len=max(q_lens),
        max_seq_len=max(seq_lens), query_lens_cpu=list(q_lens), seq_lens_cpu=list(seq_lens),
    )
    return kv, meta


def bench(fn, device: str, iters: int = 5) -> float:
    """Median seconds per call."""
    if device == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") / 1e3
    fn()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def copy_bandwidth() -> float:
    x = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    return 2 * x.numel() / bench(lambda: x.clone(), "cuda")  # read + write


def run_case(name, batch, seq_len, q_len, H, Hkv, D, block_size, dtype, device, peak):
    q_lens, seq_lens = [q_len] * batch, [seq_len] * batch
    kv, meta = make_batch(q_lens, seq_lens, block_size, Hkv, D, dtype, device)
    T = sum(q_lens)
    q = torch.randn(T, H, D, device=device, dtype=dtype)
    scale = D ** -0.5
    out = torch.empty_like(q)
    t_triton = bench(lambda: paged_attention(q, kv, meta, scale, out=out), device)
    ref = paged_attention_ref(q, kv, meta, scale)
    err = (out.float() - ref.float()).abs().max().item()
    # SDPA baseline on contiguous K/V of the same sizes (bottom-right causal alignment via an explicit mask)
    qb = q.view(batch, q_len, H, D).transpose(1, 2)                               # (B, H, q_len, D)
    kb = torch.randn(batch, Hkv, seq_len, D, device=device, dtype=dtype)          # (B, Hkv, L, D)
    vb = torch.randn_like(kb)
    if q_len == 1:
        sdpa = lambda: F.scaled_dot_product_attention(qb, kb, vb, enable_gqa=True, scale=scale)  # noqa: E731
    elif q_len == seq_len:
        sdpa = lambda: F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True, scale=scale)  # noqa: E731
    else:
        pos = torch.arange(seq_len - q_len, seq_len, device=device)
        mask = torch.arange(seq_len, device=device)[None, :] <= pos[:, None]
        sdpa = lambda: F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, enable_gqa=True, scale=scale)  # noqa: E731
    t_sdpa = bench(sdpa, device)
    extra = ""
    if device == "cuda" and "flash" in available_backends() and dtype != torch.float32:
        from pdserve.kernels.flash import FlashAttentionBackend

        fa = FlashAttentionBackend()
        k_new, v_new = (torch.randn(T, Hkv, D, device=device, dtype=dtype) for _ in range(2))
        t_fa = bench(lambda: fa.forward(q, k_new, v_new, kv, meta, scale), device)
        extra = f"  flash {t_fa * 1e6:8.1f} us"
    elt = torch.finfo(dtype).bits // 8
    moved = (sum(seq_lens) * Hkv * D * 2 + 2 * T * H * D) * elt
    bw = moved / t_triton
    frac = "  ".join(f"{bw / p:5.1%} of {label}" for label, p in peak.items())
    print(f"{name:<34} triton {t_triton * 1e6:9.1f} us  sdpa {t_sdpa * 1e6:9.1f} us  triton/sdpa speed "
          f"{t_sdpa / t_triton:5.2f}x{extra}  {bw / 1e9:8.1f} GB/s  {frac}  max|err| {err:.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dtype = getattr(torch, args.dtype)
    if cuda:
        gpu = torch.cuda.get_device_name()
        peak = {"measured copy": copy_bandwidth()}
        nominal = next((bw for key, bw in PEAK_BW.items() if key in gpu), None)
        if nominal:
            peak["nominal"] = nominal
        print(f"{gpu}: copy {peak['measured copy'] / 1e9:.0f} GB/s, nominal "
              f"{nominal / 1e9 if nominal else float('nan'):.0f} GB/s; {args.dtype}, block size {args.block_size}")
        H, Hkv, D = 32, 8, 128  # Llama-3-8B attention
        cases = [("decode B=64 L=1024", 64, 1024, 1), ("decode B=256 L=512", 256, 512, 1),
                 ("decode B=16 L=4096", 16, 4096, 1), ("decode B=2 L=16384 (key splits)", 2, 16384, 1),
                 ("prefill B=4 L=1024", 4, 1024, 1024),
                 ("chunk 512 over 2048 B=4", 4, 2048, 512)]
    else:
        print("no GPU: Triton interpreter smoke run on tiny shapes (timings are not GPU numbers)")
        peak, H, Hkv, D = {}, 6, 2, 16
        cases = [("decode B=4 L=40", 4, 40, 1), ("chunk 8 over 24 B=2", 2, 24, 8)]
    for name, batch, seq_len, q_len in cases:
        run_case(name, batch, seq_len, q_len, H, Hkv, D, args.block_size, dtype, device, peak)


if __name__ == "__main__":
    main()
