"""Teacher forcing for comparing two engine paths' greedy choices position by position (the CPU kernel tests)."""

from __future__ import annotations


class ForcedSampler:
    """Samples as the engine would, records that token, then returns the reference run's token instead, so that
    both runs see the same contexts (teacher forcing): a rounding difference early cannot cascade into later ones."""

    def __init__(self, inner, reference: dict[str, list[int]] | None) -> None:
        self.inner, self.reference, self.chosen = inner, reference, {}

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, logits, meta):
        from pdserve.runtime.sched_output import SampledToken

        out = []
        for rid, tok in zip(meta.req_ids, self.inner(logits, meta)):
            chosen = self.chosen.setdefault(rid, [])
            chosen.append(tok.token_id)
            out.append(tok if self.reference is None else SampledToken(self.reference[rid][len(chosen) - 1]))
        return out


PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "1, 2, 3, 5, 8, 13,", "Once upon a time,",
           "Q: Why is the sky blue?\nA:", "Translate to French: good morning", "The three primary colors are",
           "import numpy as np\n"]


# The per-module path, where a test counts calls of a kernel's Python wrapper: a bf16 step of up to 32 tokens otherwise
# runs its layers in one C++ call (kernels/layer_stack_cpu.py, equal to the modules bit for bit), which calls the same
# kernels but not their wrappers.
MODULES = {"PDSERVE_CPU_LAYER_STACK": "0"}


def forced_greedy_runs(variants, prompts: list[str], max_tokens: int, probe=lambda: None, **llm_kwargs) -> dict:
    """One engine per ``(name, env, extra LLM kwargs)`` variant, run greedy over ``prompts`` with the first variant's
    tokens forced on the later ones (each records its own top-1 choices).
    -> {name: (per-request chosen tokens, what ``probe()`` returned right after that run)}."""
    import pytest

    from pdserve.runtime import LLM, SamplingParams

    runs, reference = {}, None
    with pytest.MonkeyPatch.context() as mp:
        for name, env, extra in variants:
            for key, value in env.items():
                mp.setenv(key, value)
            llm = LLM(**{**llm_kwargs, **extra})
            try:
                engine = llm.engine
                engine.runner.sampler = sampler = ForcedSampler(engine.runner.sampler, reference)
                engine.runner.greedy_head = None   # every row through the sampler (the screen's own tests check it)
                for i, prompt in enumerate(prompts):
                    engine.add_request(f"p{i}", prompt,
                                       SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
                while engine.has_unfinished_requests():
                    engine.step()
                runs[name] = (sampler.chosen, probe())
                reference = reference or sampler.chosen
            finally:
                llm.shutdown()
    return runs


def drain(items: list) -> list:
    """``items``' contents, leaving it empty (a per-run probe of what a patched function recorded)."""
    out = list(items)
    items.clear()
    return out


def agreement(a: dict[str, list[int]], b: dict[str, list[int]]) -> tuple[int, int]:
    """(positions where both chose the same token, positions) over the requests of ``a``."""
    return sum(x == y for rid in a for x, y in zip(a[rid], b[rid])), sum(len(t) for t in a.values())
