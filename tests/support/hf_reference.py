"""Transformers greedy references for the engine parity tests: the parity prompt set, one ``generate`` helper, and
the two agreement measures (free-running and teacher-forced) the non-exact paths are held to.

The float32, bf16 and quantized parity tests take their prompts and transformers reference from here, the speculative
decoding tests their prompts, so that "the engine parity prompts" and "transformers greedy" mean one thing.
"""

from __future__ import annotations

from pathlib import Path

import torch

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


def parity_prompts(tokenizer) -> list[list[int]]:
    """The engine parity prompt set: 20 prompts, raw and chat, 1 to ~1,500 tokens."""
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


def short_parity_prompts(tokenizer, n: int = 8, max_len: int = 48) -> list[list[int]]:
    """The first ``n`` parity prompts of at most ``max_len`` tokens (the cheap subset for slower paths)."""
    ids = [p for p in parity_prompts(tokenizer) if len(p) <= max_len][:n]
    assert len(ids) == n, f"only {len(ids)} parity prompts of <= {max_len} tokens"
    return ids


def hf_greedy(model_dir: Path | str, prompts: list[list[int]], max_new_tokens: int, *,
              dtype: torch.dtype = torch.float32, eos_token_id: int | None = None,
              ignore_eos: bool = False) -> list[list[int]]:
    """Transformers' greedy continuation of each prompt, one ``generate`` call per prompt (no padding effects).

    Stops at ``eos_token_id`` (default: the model's generation config's first EOS), or, with ``ignore_eos``,
    generates exactly ``max_new_tokens``."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    if ignore_eos:
        stop = dict(min_new_tokens=max_new_tokens, pad_token_id=0)
    else:
        eos = hf.generation_config.eos_token_id if eos_token_id is None else eos_token_id
        eos = eos[0] if isinstance(eos, list) else eos
        stop = dict(eos_token_id=eos, pad_token_id=eos)
    refs = []
    with torch.inference_mode():
        for ids in prompts:
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=max_new_tokens, do_sample=False, **stop)
            refs.append(out[0, len(ids):].tolist())
    del hf
    return refs


def free_running_agreement(ours: list[list[int]], refs: list[list[int]]) -> float:
    """Fraction of positions (over the longer of each pair) where two greedy continuations hold the same token."""
    same = total = 0
    for a, b in zip(ours, refs, strict=True):
        n = max(len(a), len(b))
        same += sum(1 for i in range(min(len(a), len(b))) if a[i] == b[i])
        total += n
    return same / total


def teacher_forced_agreement(llm, prompts: list[list[int]], refs: list[list[int]]) -> float:
    """Fraction of the reference's greedy tokens the engine picks when fed the reference's own prefix."""
    from pdserve.runtime import SamplingParams

    reqs = [(list(p) + ref[:i], ref[i]) for p, ref in zip(prompts, refs, strict=True) for i in range(len(ref))]
    outs = llm.generate([r for r, _ in reqs], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    return sum(o.outputs[0].token_ids[0] == want for o, (_, want) in zip(outs, reqs)) / len(reqs)
