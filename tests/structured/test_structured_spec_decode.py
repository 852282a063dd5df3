"""Structured outputs beside speculative decoding: a grammar-constrained request gets no drafts (its bitmask covers
one position per step) while a free request in the same steps speculates; both outputs equal the engine without
speculation, and the JSON validates."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pdserve.runtime.llm import LLM
from pdserve.runtime.sampling_params import SamplingParams
from pdserve.runtime.structured_output.params import StructuredOutputsParams as SO

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}
FREE = "Shopping list: apples, bananas, carrots, dates, eggs. Shopping list again: apples, bananas,"


def _run(llm):
    ids = llm.engine.apply_chat_template([{"role": "user", "content": "Describe a person as JSON."}])
    params = [SamplingParams(max_tokens=40, temperature=0, structured_outputs=SO(json=SCHEMA)),
              SamplingParams(max_tokens=16, temperature=0)]
    return [o.outputs[0] for o in llm.generate([ids, llm.tokenizer.encode(FREE)], params)]


def test_grammar_request_never_speculates_free_one_does():
    plain = LLM(dtype="float32", max_model_len=512, num_gpu_blocks=128)
    want = _run(plain)
    plain.shutdown()
    spec = LLM(dtype="float32", max_model_len=512, num_gpu_blocks=128, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    got = _run(spec)
    sd = spec.get_stats().spec_decode
    spec.shutdown()
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    jsonschema.validate(json.loads(got[0].text), SCHEMA)
    assert sd.num_accepted_tokens > 0                       # the free request speculated
