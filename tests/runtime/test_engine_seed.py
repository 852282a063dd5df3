"""``--seed`` is real: the engine's generator makes unseeded sampling reproducible across engines (runs) whatever
else used torch's global RNG meanwhile, and a different seed samples differently (real default model). The engine
config refuses ``trust_remote_code`` clearly."""

from __future__ import annotations

import pytest
import torch

from pdserve.runtime import LLM, SamplingParams
from pdserve.runtime.config import EngineConfig

pytestmark = pytest.mark.slow

PROMPTS = ["Once upon a time", "The weather today is"]
SP = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)   # no per-request seed


def sample(seed: int) -> list[list[int]]:
    llm = LLM(dtype="float32", max_model_len=128, num_gpu_blocks=32, seed=seed)
    try:
        torch.manual_seed(torch.seed() % 2**31)   # whatever the global RNG holds must not matter
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SP)]
    finally:
        llm.shutdown()


def test_engine_seed_makes_unseeded_sampling_reproducible():
    first = sample(1234)
    assert sample(1234) == first
    assert sample(4321) != first


def test_trust_remote_code_is_refused():
    with pytest.raises(ValueError, match="trust_remote_code"):
        EngineConfig.from_options(trust_remote_code=True)
    assert EngineConfig.from_options(trust_remote_code=False).model.trust_remote_code is False
