"""Greedy float32 output of the engine equals Hugging Face transformers ``generate`` token for token.

Same weights (the default model's cached safetensors directory), 20 varied prompts (raw and chat, 1 to ~1,500 tokens),
64 new tokens, checked four ways: all submitted together; with chunked prefill forced to 64-token steps; with a pool
so small that requests are preempted (and recomputed); and a second run that hits the prefix cache.
"""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch
import transformers

from pdserve.runtime import LLM, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]  # HF generate is slow on 2 shared cores

MAX_NEW = 64
PARAGRAPHS = [
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined movable "
    "metal type, oil-based ink and a screw press adapted from wine making. Within fifty years, presses operated in "
    "more than two hundred European cities, and the cost of books fell so far that literacy spread beyond the clergy.",
    "Photosynthesis converts light energy into chemical energy. In the chloroplasts of plant cells, chlorophyll "
    "absorbs mostly blue and red light, splitting water molecules and releasing oxygen, while the Calvin cycle fixes "
    "carbon dioxide into three-carbon sugars that the plant later assembles into glucose, starch and cellulose.",
    "A hash table stores key-value pairs in an array of buckets. A hash function maps each key to a bucket index; "
    "collisions are resolved by chaining or open addressing. With a good hash function and a load factor kept below "
    "a constant, lookups, insertions and deletions take expected constant time.",
    "The Silk Road was not a single road but a network of caravan routes linking China with Central Asia, Persia, "
    "Arabia and the Mediterranean. Merchants traded silk, spices, glass and horses, and along with goods travelled "
    "religions, technologies such as papermaking, and, tragically, diseases like the plague.",
    "Mount Everest rises 8,849 metres above sea level on the border between Nepal and the Tibet Autonomous Region. "
    "Climbers face extreme cold, hurricane-force winds and air with a third of the oxygen at sea level; most "
    "expeditions use bottled oxygen and spend weeks acclimatising at base camp before a summit attempt.",
    "In economics, inflation is the rate at which the general level of prices rises. Central banks usually target a "
    "low, stable rate by adjusting interest rates: raising them cools borrowing and spending, while lowering them "
    "encourages investment. Hyperinflation, as in Weimar Germany, destroys savings within months.",
]


def _prompts(tokenizer) -> list[list[int]]:
    raw = [
        "The", "Hello, my name is", "The capital of France is", "def fibonacci(n):\n",
        "Once upon a time, in a small village by the sea,", "1, 2, 3, 5, 8, 13,",
        "Translate to French: I love reading books in the garden.", PARAGRAPHS[0],
        " ".join(PARAGRAPHS[:3]) + "\nSummary:", "Q: Why is the sky blue?\nA:",
        "\n\n".join(PARAGRAPHS * 4) + "\n\nIn conclusion,",                     # ~1,500 tokens
        "\n\n".join(PARAGRAPHS[2:] * 2) + "\nThe most important idea above is",
    ]
    chats = [
        [{"role": "user", "content": "What is 2+2?"}],
        [{"role": "user", "content": "Write a haiku about autumn."}],
        [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "Name three primes."}],
        [{"role": "user", "content": "Explain photosynthesis to a child."}],
        [{"role": "user", "content": PARAGRAPHS[3] + "\n\nWhat was traded on the Silk Road?"}],
        [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"},
         {"role": "user", "content": "Tell me a fun fact about octopuses."}],
        [{"role": "user", "content": "\n".join(PARAGRAPHS) + "\n\nWhich paragraph is about computer science?"}],
        [{"role": "user", "content": "List the planets of the solar system."}],
    ]
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in raw]
    ids += [list(tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False))
            for c in chats]
    return ids


@pytest.fixture(scope="module")
def engine_llm():
    llm = LLM(dtype="float32", max_model_len=2048, num_gpu_blocks=1024)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def prompts(engine_llm):
    ids = _prompts(engine_llm.tokenizer)
    assert len(ids) >= 20 and min(map(len, ids)) == 1 and 1300 <= max(map(len, ids)) <= 1700, sorted(map(len, ids))
    return ids


@pytest.fixture(scope="module")
def hf_reference(engine_llm, prompts):
    """HF greedy continuations, one generate call per prompt (no padding effects). Cached on disk under the pdserve
    cache dir, keyed by the weights file, the transformers/torch versions and the prompts, so that only the first run
    on a machine pays for HF generation."""
    from pdserve.runtime import envs

    model_path = engine_llm.engine.model_path
    eos = engine_llm.engine.eos_token_id
    weights = sorted(model_path.glob("*.safetensors"))
    key = hashlib.sha256(json.dumps([[str(w), w.stat().st_size, w.stat().st_mtime] for w in weights] + [
        transformers.__version__, torch.__version__, prompts, MAX_NEW, eos]).encode()).hexdigest()[:24]
    cache = envs.cache_dir() / "test-refs" / f"hf-greedy-{key}.json"
    if cache.is_file():
        return json.loads(cache.read_text())
    refs = _hf_generate(model_path, prompts, eos)
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(refs))
    tmp.replace(cache)
    return refs


def _hf_generate(model_path, prompts, eos) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
    refs = []
    with torch.inference_mode():
        for ids in prompts:
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos, pad_token_id=eos)
            refs.append(out[0, len(ids):].tolist())
    del hf
    return refs


def _check(outputs, prompts, refs) -> None:
    mismatches = []
    for i, (out, ids, ref) in enumerate(zip(outputs, prompts, refs)):
        got = out.outputs[0].token_ids
        assert out.prompt_token_ids == ids
        if got != ref:
            k = next((j for j, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
            mismatches.append(f"prompt {i} ({len(ids)} tokens): first difference at output token {k}")
    assert not mismatches, mismatches


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)


def test_batched_then_prefix_cached(engine_llm, prompts, hf_reference):
    engine = engine_llm.engine
    _check(engine_llm.generate(prompts, GREEDY), prompts, hf_reference)
    hits_before = engine.get_stats().prefix_cache_hits
    second = engine_llm.generate(prompts, GREEDY)
    assert engine.get_stats().prefix_cache_hits - hits_before > 1000
    assert sum(o.num_cached_tokens for o in second) > 1000
    _check(second, prompts, hf_reference)


def test_small_chunks(prompts, hf_reference):
    llm = LLM(dtype="float32", max_model_len=2048, num_gpu_blocks=1024, max_num_batched_tokens=64,
              enable_prefix_caching=False)
    _check(llm.generate(prompts, GREEDY), prompts, hf_reference)
    assert llm.get_stats().prefix_cache_hits == 0


def test_preemption(prompts, hf_reference):
    # 128 blocks x 16 = 2,048 token slots: the longest request fits alone, all 20 together do not.
    llm = LLM(dtype="float32", max_model_len=2048, num_gpu_blocks=128, max_num_batched_tokens=512)
    _check(llm.generate(prompts, GREEDY), prompts, hf_reference)
    assert llm.get_stats().num_preemptions > 0
