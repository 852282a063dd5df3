"""The bf16 CPU layer stack (kernels/layer_stack_cpu.py): the same engine, the same requests, once on the modules and
once with the stack; every token and every logprob equal bit for bit, over steps the stack served of every kind
(prefill only, decode only, decodes beside a new prompt, a chunk after a cached prefix) and steps it must leave to the
modules (more than 32 tokens), with the linears' weights coded (the default) or in plain tiles; bad arguments to its op
are errors."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import layer_stack_cpu
from pdserve.kernels.torch_ref import TorchAttentionBackend

BUILD = layer_stack_cpu.load_extension()
needs_stack = pytest.mark.skipif(BUILD is not None, reason=f"the stack or a kernel it calls is not built here: {BUILD}")

LONG = [(37 * i) % 9000 + 200 for i in range(100)]   # token ids; 100 tokens: a prefill the modules run (> 32 rows)


def _run(monkeypatch, stack: str, lossless: str) -> tuple[dict, int, list[tuple[bool, bool, bool]], int]:
    """Requests arriving over the steps of one bf16 engine -> (their token ids, logprobs and cached tokens, steps the
    stack served, per served step: (decodes, prefill chunks, a chunk after a cached prefix), the engine's steps)."""
    from pdserve.runtime import LLM, SamplingParams

    monkeypatch.setenv("PDSERVE_CPU_LAYER_STACK", stack)
    monkeypatch.setenv("PDSERVE_CPU_AMX_LOSSLESS", lossless)
    kinds = []
    real = layer_stack_cpu.LayerStack.__call__

    def spied(self, h, cos, sin, kv_cache, meta):
        out = real(self, h, cos, sin, kv_cache, meta)
        if out is not None:
            plan = self.model.layers[0].self_attn.backend.step_plan(meta, kv_cache[:, 0], h.dtype)
            info = plan.paged_prefill[1].tolist() if plan.paged_prefill is not None else []
            kinds.append((plan.paged is not None, bool(info), any(n > q for _, q, n in info)))
        return out

    monkeypatch.setattr(layer_stack_cpu.LayerStack, "__call__", spied)
    llm = LLM(dtype="bfloat16", max_model_len=512, num_gpu_blocks=64, enable_prefix_caching=True)
    try:
        engine, done = llm.engine, {}
        params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=5, ignore_eos=True)
        arrivals = {0: [("a", [11, 12, 13, 14, 15]), ("b", list(range(300, 309))), ("c", list(range(500, 514)))],
                    3: [("d", [7, 8, 9, 10, 11, 12])],               # 6 new tokens beside 3 decodes
                    5: [("long", LONG)],                              # > 32 rows: the modules
                    8: [("cached", LONG[:96] + list(range(900, 910)))]}   # 10 new tokens after 96 cached
        step = 0
        while step in arrivals or step < max(arrivals) or engine.has_unfinished_requests():
            for rid, prompt in arrivals.get(step, []):
                engine.add_request(rid, prompt, params)
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = (o.outputs[0].token_ids, o.outputs[0].logprobs, o.num_cached_tokens)
            step += 1
        qkv = engine.runner.model.layers[0].self_attn.qkv_proj
        assert (qkv.codes is not None) == (lossless == "1") and (qkv.packed is None) == (lossless == "1")
        return done, engine.runner.model.layer_stack.steps, kinds, step
    finally:
        llm.shutdown()


@needs_stack
@pytest.mark.parametrize("lossless", ["1", "0"])
def test_the_stack_equals_the_modules_bit_for_bit_on_every_kind_of_step(monkeypatch, lossless):
    modules, off_steps, _, _ = _run(monkeypatch, "0", lossless)
    stacked, on_steps, kinds, steps = _run(monkeypatch, "1", lossless)
    assert off_steps == 0
    assert sorted(stacked) == ["a", "b", "c", "cached", "d", "long"]
    assert stacked["cached"][2] == 96 and modules["cached"][2] == 96
    for rid, (tokens, logprobs, _) in modules.items():
        assert stacked[rid][0] == tokens and len(tokens) == 12, rid
        assert stacked[rid][1] == logprobs, rid          # every logprob of every position: the same floats
    assert (False, True, False) in kinds                 # the first step: three new prompts, no decodes
    assert (True, False, False) in kinds                 # decode only
    assert (True, True, False) in kinds                  # a new prompt beside decodes
    assert any(k[2] for k in kinds)                      # the chunk after the cached prefix
    assert on_steps == len(kinds) and on_steps < steps   # the long prompt's step ran the modules


@needs_stack
def test_bad_arguments_are_errors_not_crashes():
    h = torch.zeros(2, 576, dtype=torch.bfloat16)
    cos = sin = torch.zeros(2, 1, 64, dtype=torch.bfloat16)
    cache = torch.zeros(4, 1, 2, 16, 3, 64, dtype=torch.bfloat16)
    idx = torch.zeros(4, dtype=torch.long)
    op = torch.ops.pdserve_layer_stack_cpu.forward
    with pytest.raises(RuntimeError, match="weights: 6 per layer"):
        op(h, cos, sin, cache, [], [], [9, 3, 64, 960, 576, 3072, 576], 1e-5, 0.125, idx, None, None, None, None, None)
    weights = [torch.zeros(1)] * 6
    with pytest.raises(RuntimeError, match="metas: none or 4"):   # coded linears: all four of a layer's metas
        op(h, cos, sin, cache, weights, [torch.zeros(1)] * 3, [9, 3, 64, 960, 576, 3072, 576], 1e-5, 0.125, idx, None,
           None, None, None, None)
    with pytest.raises(RuntimeError, match="decodes need tables and lens"):
        op(h, cos, sin, cache, weights, [], [9, 3, 64, 960, 576, 3072, 576], 1e-5, 0.125, idx, None, None, None, None,
           None)
    tables, lens = torch.zeros(2, 1, dtype=torch.long), torch.ones(2, dtype=torch.long)
    with pytest.raises(RuntimeError, match="a row outside the cache"):   # never a write outside the cache
        op(h, cos, sin, cache, weights, [], [9, 3, 64, 960, 576, 3072, 576], 1e-5, 0.125, torch.tensor([0, 1, 2, 128]),
           None, tables, lens, None, None)
    with pytest.raises(RuntimeError, match="kv_cache: bf16"):
        op(h, cos, sin, cache.float(), weights, [], [9, 3, 64, 960, 576, 3072, 576], 1e-5, 0.125, idx, None, tables,
           lens,
           None, None)


def test_the_backend_plans_a_step_once_for_every_layer():
    from pdserve.kernels.base import AttentionMetadata

    backend = TorchAttentionBackend()
    meta = AttentionMetadata(torch.tensor([0]), torch.tensor([0, 1], dtype=torch.int32),
                             torch.tensor([1], dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32), 1, 1, [1], [1])
    kv = torch.zeros(2, 3, 2, 16, 3, 64)
    plan = backend.step_plan(meta, kv[:, 0], torch.float32)
    assert backend.step_plan(meta, kv[:, 1], torch.float32) is plan
    assert plan.kv_rows.tolist() == [0, 16]   # slot 0's K row, then its V row one (16-slot) K half further
