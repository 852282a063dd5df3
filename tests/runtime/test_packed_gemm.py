"""bf16 dense linears on CPU run oneDNN's packed kernel (kernels/packed_linear.py): bit-equal to ``F.linear`` per
layer from 2 rows on (at 1 row ``F.linear`` takes a GEMV path that rounds a few outputs differently), and the
engine's greedy output with it equals the ``F.linear`` engine's (the issue's bar: the same top-1 token on >= 99% of
positions; bit-equality makes it 100% here). float32 is never packed (exact transformers parity)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels.packed_linear import PackedLinear, pack_linears, packing_supported

CPU = torch.device("cpu")
needs_packing = pytest.mark.skipif(packing_supported(CPU, torch.bfloat16) is not None,
                                   reason=f"no oneDNN packed linear: {packing_supported(CPU, torch.bfloat16)}")


@needs_packing
@pytest.mark.parametrize("rows", [1, 3, 8, 33])
def test_packed_linear_is_bit_equal_to_f_linear(rows):
    gen = torch.Generator().manual_seed(rows)
    w, b = torch.randn(96, 64, generator=gen).bfloat16(), torch.randn(96, generator=gen).bfloat16()
    x = torch.randn(rows, 64, generator=gen).bfloat16()
    check = torch.equal if rows > 1 else (lambda a, b: torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-2))
    for bias in (None, b):
        assert check(PackedLinear(w, bias)(x), F.linear(x, w, bias))
    x3 = torch.randn(2, rows, 128, generator=gen).bfloat16()[..., ::2]   # 3-D and strided input: same math
    torch.testing.assert_close(PackedLinear(w, b)(x3), F.linear(x3, w, b), rtol=1e-2, atol=2e-2)


@pytest.fixture(autouse=True)
def onednn(monkeypatch):
    """These tests are about oneDNN's kernel: bf16 on an AMX CPU would pack for pdserve's own (tests/kernels/
    test_amx_linear.py)."""
    monkeypatch.setenv("PDSERVE_CPU_AMX_LINEAR", "0")


@needs_packing
def test_pack_linears_replaces_dense_linears_and_ties_the_head():
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(50, 16)
            self.proj = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16, bias=False))
            self.lm_head = None

    model = Tiny().bfloat16()
    x = torch.randn(4, 16).bfloat16()
    want, logits = model.proj(x), F.linear(x, model.embed_tokens.weight)
    assert pack_linears(model, CPU, torch.bfloat16) == 3
    assert all(isinstance(m, PackedLinear) for m in (*model.proj, model.lm_head))
    assert torch.equal(model.proj(x), want) and torch.equal(model.lm_head(x), logits)
    from pdserve.runtime.quantization import weight_bytes   # the packed weights still count: + the head's copy
    assert weight_bytes(model) == 2 * (50 * 16 + 32 * 16 + 32 + 16 * 32 + 50 * 16)
    f32 = Tiny()
    assert pack_linears(f32, CPU, torch.float32) == 0 and type(f32.proj[0]) is nn.Linear and f32.lm_head is None


def test_a_cpu_onednn_cannot_pack_for_keeps_f_linear(monkeypatch):
    """Where oneDNN refuses to pack (bf16 on a CPU without AVX-512 BW/VL/DQ or AVX-NE-CONVERT, e.g. AMD Zen 2/3) or
    packs differently, the linears stay ``nn.Linear`` and the tied head stays tied: start-up never fails on it."""
    from pdserve.kernels import packed_linear

    monkeypatch.setattr(packed_linear, "_self_check", lambda dtype, kind=PackedLinear: False)
    assert "fails or differs" in packing_supported(CPU, torch.bfloat16)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16)).bfloat16()
    assert pack_linears(model, CPU, torch.bfloat16) == 0 and all(type(m) is nn.Linear for m in model)


@pytest.fixture(scope="module")
def greedy_runs():
    """Greedy tokens of 8 prompts from a bf16 engine with F.linear, then one with packed GEMMs (same weights)."""
    from pdserve.runtime import LLM, SamplingParams

    mp = pytest.MonkeyPatch()
    runs = {}
    prompts = ["The capital of France is", "def fibonacci(n):\n", "1, 2, 3, 5, 8, 13,", "Once upon a time,",
               "Q: Why is the sky blue?\nA:", "Translate to French: good morning", "The three primary colors are",
               "import numpy as np\n"]
    mp.setenv("PDSERVE_CPU_AMX_LINEAR", "0")
    try:
        for packed in ("0", "1"):
            mp.setenv("PDSERVE_CPU_PACKED_GEMM", packed)
            llm = LLM(dtype="bfloat16", max_model_len=512, num_gpu_blocks=64)
            try:
                outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
                layer = llm.engine.model.layers[0]
                runs[packed] = ([o.outputs[0].token_ids for o in outs],
                                type(layer.mlp.gate_up_proj), type(llm.engine.model.lm_head))
            finally:
                llm.shutdown()
    finally:
        mp.undo()
    return runs


@needs_packing
def test_bf16_engine_packs_its_gemms_and_keeps_its_greedy_output(greedy_runs):
    eager, packed = greedy_runs["0"], greedy_runs["1"]
    assert eager[1] is nn.Linear and eager[2] is type(None)
    assert packed[1] is PackedLinear and packed[2] is PackedLinear   # the engine really runs the packed kernel
    same = sum(a == b for x, y in zip(eager[0], packed[0]) for a, b in zip(x, y))
    total = sum(len(x) for x in eager[0])
    assert total == 8 * 24 and same / total >= 0.99, f"{same}/{total} positions agree"
