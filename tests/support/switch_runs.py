"""Greedy runs of the default model (float32) with an environment switch at each of its values."""

from __future__ import annotations

SWITCH_PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "1, 2, 3, 5, 8, 13,", "Once upon a time,"]


def switch_runs(monkeypatch, var: str, probe, values=("0", "1"), max_tokens: int = 16) -> dict:
    """One float32 engine per value of the environment variable ``var``, greedy over :data:`SWITCH_PROMPTS` (four
    running sequences) -> {value: (per-prompt tokens, ``probe(llm)`` right after the run, before shutdown)}."""
    from pdserve.runtime import LLM, SamplingParams

    runs = {}
    for value in values:
        monkeypatch.setenv(var, value)
        llm = LLM(dtype="float32", max_model_len=256, num_gpu_blocks=32)
        try:
            outs = llm.generate(SWITCH_PROMPTS, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
            runs[value] = ([o.outputs[0].token_ids for o in outs], probe(llm))
        finally:
            llm.shutdown()
    return runs
