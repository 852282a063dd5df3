"""The float32 CPU layer stack (kernels/layer_stack_f32_cpu.py): the same engine, the same requests, once on the
modules and once with the stack; every token and every logprob equal bit for bit, with the linears on each of their
float32 paths (GGUF codes, small rows, plain ``F.linear``), over decode steps of 1 to 9 running sequences it served
and mixed steps it left to the modules; the small-rows and codes counters count the same products either way; bad
arguments to its op are errors."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import layer_stack_cpu, layer_stack_f32_cpu
from pdserve.kernels.gguf_codes_linear import CodesLinear
from pdserve.kernels.small_rows_linear import SmallRowsLinear

BUILD = layer_stack_f32_cpu.load_extension()
pytestmark = pytest.mark.skipif(BUILD is not None, reason=f"the stack or a kernel it calls is not built here: {BUILD}")

PATHS = {"codes": {}, "small rows": {"PDSERVE_CPU_GGUF_CODES": "0"},
         "plain": {"PDSERVE_CPU_GGUF_CODES": "0", "PDSERVE_CPU_SMALL_ROWS_GEMM": "0"}}


def _run(monkeypatch, stack: str, env: dict[str, str]):
    """Requests arriving over the steps of one float32 engine -> (their token ids and logprobs, the row counts of
    the steps the stack served, the engine's steps, the first qkv linear's type, products counted on the codes and
    small-rows paths)."""
    from pdserve.runtime import LLM

    monkeypatch.setenv("PDSERVE_CPU_LAYER_STACK", stack)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    rows = []
    real = layer_stack_cpu.LayerStack.__call__

    def spied(self, h, cos, sin, kv_cache, meta):
        out = real(self, h, cos, sin, kv_cache, meta)
        if out is not None:
            rows.append(h.shape[0])
        return out

    with pytest.MonkeyPatch.context() as mp:   # undone after the run: the next run spies on the real call
        mp.setattr(layer_stack_cpu.LayerStack, "__call__", spied)
        return _requests(LLM(dtype="float32", max_model_len=512, num_gpu_blocks=64), rows)


def _requests(llm, rows: list[int]):
    from pdserve.runtime import SamplingParams

    try:
        engine, done = llm.engine, {}
        params = SamplingParams(temperature=0.0, max_tokens=10, logprobs=5, ignore_eos=True)
        arrivals = {0: [("a", [11, 12, 13, 14, 15])],
                    4: [("b", list(range(300, 309))), ("c", list(range(500, 514)))],
                    8: [(f"m{i}", list(range(700 + 20 * i, 712 + 20 * i))) for i in range(6)]}
        counted = CodesLinear.served, SmallRowsLinear.served
        step = 0
        while step <= max(arrivals) or engine.has_unfinished_requests():
            for rid, prompt in arrivals.get(step, []):
                engine.add_request(rid, prompt, params)
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = (o.outputs[0].token_ids, o.outputs[0].logprobs)
            step += 1
        kind = type(engine.runner.model.layers[0].self_attn.qkv_proj)
        return done, rows, step, kind, (CodesLinear.served - counted[0], SmallRowsLinear.served - counted[1])
    finally:
        llm.shutdown()


@pytest.mark.parametrize("path", list(PATHS))
def test_the_stack_equals_the_modules_bit_for_bit(monkeypatch, path):
    modules, off_rows, _, kind, off_counts = _run(monkeypatch, "0", PATHS[path])
    stacked, rows, steps, _, on_counts = _run(monkeypatch, "1", PATHS[path])
    assert kind is {"codes": CodesLinear, "small rows": SmallRowsLinear, "plain": torch.nn.Linear}[path]
    assert off_rows == [] and sorted(stacked) == sorted(modules) and len(stacked) == 9
    for rid, (tokens, logprobs) in modules.items():
        assert stacked[rid][0] == tokens and len(tokens) == 10, rid
        assert stacked[rid][1] == logprobs, rid          # every logprob of every position: the same floats
    assert {1, 3, 9} <= set(rows)                        # decode steps of 1, 3 and 9 running sequences
    assert len(rows) < steps                             # the steps with a prompt ran the modules
    assert on_counts == off_counts                       # the same products on the same paths
    assert (on_counts[0] > 0) == (path == "codes") and (on_counts[1] > 0) == (path != "plain")


def test_bad_arguments_are_errors():
    op = torch.ops.pdserve_layer_stack_f32_cpu.forward
    h, cs = torch.zeros(2, 64), torch.zeros(2, 1, 64)
    cache = torch.zeros(4, 1, 2, 16, 1, 64)
    weights = [torch.ones(64), torch.zeros(192, 64), torch.zeros(64, 64), torch.ones(64), torch.zeros(256, 64),
               torch.zeros(64, 128)]
    forms, dims, idx = [0] * 16, [1, 1, 64, 1, 128, 4], torch.tensor([0, 1, 16, 17])
    tables, lens = torch.zeros(2, 1, dtype=torch.long), torch.ones(2, dtype=torch.long)
    args = dict(h=h, cos=cs, sin=cs, kv_cache=cache, weights=weights, forms=forms, codes=[], dims=dims, eps=1e-5,
                scale=0.125, kv_idx=idx, tables=tables, lens=lens)
    assert op(**args).shape == (2, 64)
    for change, match in (({"weights": weights[:5]}, "weights"), ({"forms": [2] + [0] * 15}, "codes"),
                          ({"kv_cache": cache.bfloat16()}, "kv_cache"), ({"kv_idx": torch.tensor([0, 1, 16, 999])},
                                                                        "outside"),
                          ({"h": h.bfloat16()}, "float32")):
        with pytest.raises(RuntimeError, match=match):
            op(**{**args, **change})
