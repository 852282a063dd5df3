"""Probe: what a float32-output int4 kernel would give issue 14's free-running parity criterion. NOT a pdserve kernel.

torch's CPU int4/int8 kernels are vectorized for bfloat16 only and return bfloat16 (runtime/quantization.py explains
why that keeps free-running greedy agreement with transformers far below 95%). This script compiles a ~40-line
AVX-512 int4 GEMM that takes float32 activations, float32 scales and zeros and returns float32 (a group's codes
dequantized in registers, ``sum_g s * (x_g . q_g) + z * sum(x_g)``; one thread), then measures:

* per layer, on the default model's Q4_1 weights: error against a float64 product with the dequantized weights, and
  CPU time against a dense float32 GEMM and torch's bf16 int4 kernel, at batch 1 and 32;
* end to end (``--e2e``): the float32 engine with every quantized linear on the probe kernel (the Q8_0 LM head as two
  nibble matmuls), greedy free-running agreement with transformers float32 over the first 32 tokens of the 8 short
  parity prompts, and decode tok/s at batch 1 and 32 next to the bf16 int4 engine and the dense float32 engine.

It needs gcc and an AVX-512 CPU, and patches the model loader's linear factory: a measurement, not a serving path
(serving it would need a build step instead of gcc at run time, threads, a non-AVX-512 fallback, and a way to pick it
next to the exact ``dequant`` method).

    OMP_NUM_THREADS=1 python benchmarks/quantization_f32_probe.py --e2e
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>
#define MB 8
/* y (M, N) = x (M, K) @ w.T, w[n,k] = scale[n,k/32] * q[n,k] + zero[n,k/32]; codes (N, K/2): byte j of a 32-group
   holds code j (low nibble) and code j + 16 (high nibble). K <= 16384. */
void q4f32_mm(const float* restrict x, const uint8_t* restrict codes, const float* restrict scale,
              const float* restrict zero, float* restrict y, int M, int N, int K) {
    const int ng = K / 32;
    float xs[MB * 512];
    const __m128i mask = _mm_set1_epi8(15);
    for (int m0 = 0; m0 < M; m0 += MB) {
        const int mb = M - m0 < MB ? M - m0 : MB;
        for (int m = 0; m < mb; m++)
            for (int g = 0; g < ng; g++)
                xs[m * ng + g] = _mm512_reduce_add_ps(_mm512_add_ps(
                    _mm512_loadu_ps(x + (long)(m0 + m) * K + g * 32), _mm512_loadu_ps(x + (long)(m0 + m) * K + g * 32 + 16)));
        for (int n = 0; n < N; n++) {
            const uint8_t* c = codes + (long)n * (K / 2);
            const float *s = scale + (long)n * ng, *z = zero + (long)n * ng;
            __m512 acc[MB];
            float zacc[MB];
            for (int m = 0; m < mb; m++) { acc[m] = _mm512_setzero_ps(); zacc[m] = 0.f; }
            for (int g = 0; g < ng; g++) {
                __m128i b = _mm_loadu_si128((const __m128i*)(c + g * 16));
                __m512 qlo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, mask)));
                __m512 qhi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), mask)));
                __m512 sv = _mm512_set1_ps(s[g]);
                for (int m = 0; m < mb; m++) {
                    const float* xm = x + (long)(m0 + m) * K + g * 32;
                    __m512 t = _mm512_fmadd_ps(qhi, _mm512_loadu_ps(xm + 16), _mm512_mul_ps(qlo, _mm512_loadu_ps(xm)));
                    acc[m] = _mm512_fmadd_ps(t, sv, acc[m]);
                    zacc[m] += z[g] * xs[m * ng + g];
                }
            }
            for (int m = 0; m < mb; m++) y[(long)(m0 + m) * N + n] = _mm512_reduce_add_ps(acc[m]) + zacc[m];
        }
    }
}
"""


def build(workdir: Path) -> ctypes.CDLL:
    (workdir / "q4f32.c").write_text(SOURCE)
    subprocess.run(["gcc", "-O3", "-march=native", "-shared", "-fPIC", "-o", str(workdir / "q4f32.so"),
                    str(workdir / "q4f32.c")], check=True, timeout=120)
    return ctypes.CDLL(str(workdir / "q4f32.so"))


class ProbeLinear(torch.nn.Module):
    """A :class:`QuantizedWeight` (group size a multiple of 32) on the probe kernel; 8-bit codes as two nibble parts."""

    lib: ctypes.CDLL

    def __init__(self, w, bias):
        super().__init__()
        self.out_features, self.in_features = w.shape
        rep = w.group_size // 32
        scale = w.scale.float().repeat_interleave(rep, 1)
        zero = torch.zeros_like(scale) if w.zero is None else w.zero.float().repeat_interleave(rep, 1)
        q = w.q.to(torch.int16)
        if w.bits == 4:  # signed codes in [-8, 7] -> unsigned, the offset moved into the zero
            off = 0 if w.q.dtype == torch.uint8 else 8
            self.parts = [(q + off, scale, zero - off * scale)]
        else:  # q = 16 h + l: (h + 8) * 16 s - 128 s and l * s
            self.parts = [((q >> 4) + 8, 16 * scale, zero - 128 * scale), (q & 15, scale, torch.zeros_like(scale))]
        self.parts = [(self._pack(u.to(torch.uint8)), s.contiguous(), z.contiguous()) for u, s, z in self.parts]
        self.bias = None if bias is None else bias.float()

    @staticmethod
    def _pack(u: torch.Tensor) -> torch.Tensor:  # (N, K) codes -> (N, K/2): byte j of a group = u[j] | u[j+16] << 4
        n, k = u.shape
        g = u.view(n, k // 32, 2, 16)
        return (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(n, k // 2).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).float().contiguous()
        y = torch.zeros(x2.shape[0], self.out_features)
        part = torch.empty_like(y)
        ptr = lambda t: ctypes.c_void_p(t.data_ptr())  # noqa: E731
        for codes, s, z in self.parts:
            self.lib.q4f32_mm(ptr(x2), ptr(codes), ptr(s), ptr(z), ptr(part), x2.shape[0], self.out_features,
                              self.in_features)
            y += part
        if self.bias is not None:
            y += self.bias
        return y.view(*lead, self.out_features)


def cpu_us(fn, n: int = 30) -> float:
    fn()
    t = time.process_time()
    for _ in range(n):
        fn()
    return (time.process_time() - t) / n * 1e6


def per_layer() -> None:
    from pdserve.kernels.linear_base import QuantizedWeight
    from pdserve.kernels.linear_int4_cpu import Int4Linear
    from pdserve.runtime.gguf_weights import iter_gguf_weights
    from pdserve.runtime.model_loader import _default_gguf_path

    seen = set()
    for name, w in iter_gguf_weights(_default_gguf_path(), 9, 3):
        if not isinstance(w, QuantizedWeight) or w.bits != 4 or w.shape in seen:
            continue
        seen.add(w.shape)
        dense, probe = w.dequantize(), ProbeLinear(w, None)
        fast = Int4Linear(w, None, torch.device("cpu"), torch.bfloat16)
        for m in (1, 32):
            x = torch.randn(m, w.shape[1])
            ref = x.double() @ dense.double().T
            err = lambda y: float((y.double() - ref).abs().max() / ref.abs().max())  # noqa: E731
            print(f"{name} {tuple(w.shape)} batch {m}: max error / max |y|: probe {err(probe(x)):.1e}, "
                  f"torch int4 bf16 {err(fast(x)):.1e}; CPU us: probe {cpu_us(lambda: probe(x)):.0f}, "
                  f"dense float32 {cpu_us(lambda: torch.nn.functional.linear(x, dense)):.0f}, "
                  f"torch int4 bf16 {cpu_us(lambda: fast(x)):.0f}", flush=True)


def end_to_end(decode_tokens: int) -> None:
    import random

    import pdserve.runtime.models.llama as llama
    from pdserve.runtime import LLM, SamplingParams
    from pdserve.runtime.model_loader import load_tokenizer, resolve_model_path
    from quantization import decode_tps  # benchmarks/quantization.py
    from tests.support.hf_reference import free_running_agreement, hf_greedy, short_parity_prompts

    model_dir = resolve_model_path(None)
    prompts = short_parity_prompts(load_tokenizer(model_dir))
    refs = hf_greedy(model_dir, prompts, 32)
    factory = llama.quantized_linear
    for name, options in (("probe float32 int4", dict(quantization="int4", dtype="float32")),
                          ("torch int4 bf16", dict(quantization="int4")), ("dense float32", dict(dtype="float32"))):
        llama.quantized_linear = (lambda w, b, *_: ProbeLinear(w, b)) if name.startswith("probe") else factory
        try:
            llm = LLM(device="cpu", max_model_len=512, max_num_seqs=64, enable_prefix_caching=False,
                      num_gpu_blocks=512, **options)
        finally:
            llama.quantized_linear = factory
        outs = llm.generate([list(p) for p in prompts], SamplingParams(max_tokens=32, temperature=0.0))
        free = free_running_agreement([list(o.outputs[0].token_ids) for o in outs], refs)
        rng = random.Random(0)
        tps = {b: decode_tps(llm, b, decode_tokens, rng, time.process_time) for b in (1, 32)}
        llm.shutdown()
        print(f"{name}: free-running agreement with transformers float32 {free:.3f}; decode tok/s (CPU time) "
              f"batch 1 {tps[1]:.1f}, batch 32 {tps[32]:.1f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--e2e", action="store_true", help="also run the engine on the probe kernel (parity, tok/s)")
    ap.add_argument("--decode-tokens", type=int, default=16)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for tests.support
    with tempfile.TemporaryDirectory() as tmp:
        ProbeLinear.lib = build(Path(tmp))
        per_layer()
        if args.e2e:
            end_to_end(args.decode_tokens)


if __name__ == "__main__":
    main()
