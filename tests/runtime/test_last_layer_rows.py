"""The last decoder layer runs its output projection and MLP only on the rows a step samples (runtime/models/llama.py,
``keep``; runtime/model_runner.py passes the sampled rows): on the real default model, the kept rows' hidden states
are the full pass's within float32 rounding with the same greedy token, every row's K/V is still cached bit for bit,
the last layer's linears see only the kept rows while the others see all, and the engine really prunes a prompt's
rows (and none with LoRA on, whose adapters map every row). Exact greedy parity with transformers runs through the
unchanged engine parity tests (tests/runtime/test_engine_vs_hf.py)."""

from __future__ import annotations

import pytest
import torch

from pdserve.runtime.config import ModelConfig
from pdserve.runtime.model_loader import load_model
from tests.kernels.paged_batch import PagedBatchBuilder

BLOCK = 16


@pytest.fixture(scope="module")
def model():
    return load_model(ModelConfig(max_model_len=512, dtype="float32"), torch.device("cpu"), "torch").model


def _rows_seen(model) -> tuple[dict[str, list[int]], list]:
    """{linear: rows of each call} for the first and the last layer's o_proj and down_proj, and the hook handles."""
    seen: dict[str, list[int]] = {}
    handles = []
    for name, layer in (("first", model.layers[0]), ("last", model.layers[-1])):
        for part, lin in (("o", layer.self_attn.o_proj), ("down", layer.mlp.down_proj)):
            key = f"{name} {part}"
            seen[key] = []
            handles.append(lin.register_forward_pre_hook(lambda m, a, key=key: seen[key].append(a[0].shape[0])))
    return seen, handles


def test_kept_rows_match_the_full_pass_and_every_row_is_cached(model):
    gen = torch.Generator().manual_seed(0)
    step = {0: 150, 1: 40, 2: 1}   # two prompts' chunks and a one-token row
    ids = torch.randint(100, 40000, (sum(step.values()),), generator=gen)
    keep = torch.tensor([149, 150 + 39, 190])          # each row's last position
    outs, caches = [], []
    for k in (None, keep):
        meta, positions = PagedBatchBuilder(num_blocks=32, block_size=BLOCK, seed=5).step(step)
        kv = torch.zeros(32, model.num_layers, 2, BLOCK, model.num_kv_heads, model.head_dim)
        seen, handles = _rows_seen(model)
        try:
            with torch.inference_mode():
                outs.append(model(ids, positions, kv, meta, k))
        finally:
            for h in handles:
                h.remove()
        caches.append(kv)
        rows = len(ids) if k is None else len(k)
        assert seen == {"first o": [len(ids)], "first down": [len(ids)], "last o": [rows], "last down": [rows]}
    full, kept = outs
    assert full.shape == (len(ids), 576) and kept.shape == (3, 576)
    assert torch.equal(caches[0], caches[1])           # every row's K and V, every layer
    torch.testing.assert_close(kept, full[keep], rtol=1e-5, atol=1e-5)
    assert torch.equal(model.compute_logits(kept).argmax(-1), model.compute_logits(full[keep]).argmax(-1))
    meta, positions = PagedBatchBuilder(num_blocks=32, block_size=BLOCK, seed=5).step(step)
    kv = torch.zeros_like(caches[0])
    with torch.inference_mode():                        # a step that samples nothing: no row past attention
        assert model(ids, positions, kv, meta, keep[:0]).shape == (0, 576)
    assert torch.equal(kv, caches[0])


@pytest.mark.parametrize("lora", [False, True])
def test_the_engine_prunes_a_prompts_rows(monkeypatch, lora):
    from pdserve.runtime import LLM, SamplingParams

    monkeypatch.setenv("PDSERVE_CPU_LAYER_STACK", "0")   # the decode steps through the modules too (hooks see them)
    llm = LLM(dtype="float32", max_model_len=512, num_gpu_blocks=64, enable_lora=lora, max_lora_rank=8)
    try:
        seen, handles = _rows_seen(llm.engine.runner.model)
        prompts = [list(range(1000, 1200)), list(range(2000, 2030))]
        outs = llm.generate(prompts,
                            SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
        for h in handles:
            h.remove()
    finally:
        llm.shutdown()
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 3]
    # all 230 prompt rows and the 4 decodes pass the first layer; the last sees the 2 + 4 sampled rows only (all of
    # them with LoRA on)
    assert sum(seen["first down"]) == 234
    assert sum(seen["last down"]) == sum(seen["last o"]) == (234 if lora else 6)
