"""The Triton kernel compiled by the real Triton compiler (TTIR -> PTX -> cubin, ptxas included) for sm_80 and sm_90,
for the launch shapes the engine uses. No GPU is needed to compile; this catches what the interpreter cannot (dot
shape/dtype rules, constexpr typing, shared-memory budget). Runs in a subprocess: the test process uses the interpreter.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import torch, triton
    from triton.backends.compiler import GPUTarget
    from pdserve.kernels.triton_paged import _kernel, kernel_constants

    ints = ["stride_qt", "stride_qh", "stride_qd", "stride_kb", "stride_ks", "stride_kh", "stride_kd", "stride_vb",
            "stride_vs", "stride_vh", "stride_vd", "stride_ot", "stride_oh", "stride_od", "stride_bt"]
    # (dtype, heads, kv heads, head dim, max query len): SmolLM2 decode/prefill, Llama-3-8B decode, float32 prefill
    # (dtype, heads, kv heads, head dim, max query len, key splits): SmolLM2 decode/prefill, Llama-3-8B decode (plain
    # and split), float32 prefill
    for dtype, tt, H, Hkv, D, q_len, splits in [
            (torch.bfloat16, "bf16", 9, 3, 64, 1, 1), (torch.bfloat16, "bf16", 9, 3, 64, 512, 1),
            (torch.float16, "fp16", 32, 8, 128, 1, 1), (torch.float16, "fp16", 32, 8, 128, 1, 8),
            (torch.float32, "fp32", 9, 3, 64, 300, 1)]:
        consts = kernel_constants(H, Hkv, D, 16, q_len, dtype, "cuda", num_splits=splits)
        partial = "*fp32" if splits > 1 else "*" + tt
        sig = {"Q": "*" + tt, "K": "*" + tt, "V": "*" + tt, "Out": "*" + tt, "PartialAcc": partial,
               "PartialML": partial, "BlockTables": "*i32", "SeqLens": "*i32", "QueryStartLoc": "*i32",
               "qk_scale": "fp32", **{n: "i32" for n in ints}, "num_heads": "i32", **{k: "constexpr" for k in consts}}
        src = triton.compiler.ASTSource(fn=_kernel, signature=sig, constexprs=consts)
        for arch in (80, 90):
            compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32))
            assert compiled.metadata.shared <= 160 * 1024, (tt, arch, compiled.metadata.shared)
            assert (tt == "fp32") or "mma" in compiled.asm["ptx"], "16-bit dots should use tensor cores"
            print(tt, H, Hkv, D, q_len, splits, arch, "shared", compiled.metadata.shared)
""")


@pytest.mark.slow
def test_kernel_compiles_for_ampere_and_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("shared") == 10
