"""Speculative decoding vs none, side by side in one process (two engines on the same model, runs alternated).

- Copy-heavy, batch 1: chat prompts asking the model to repeat a paragraph word for word (answers that quote their
  prompt). Inter-token latency = (last token time - first token time) / (tokens - 1), per request, mean over prompts.
- Mixed, batch 32: 32 requests at once (the copy prompts, open questions, random-token prompts), greedy, EOS ignored;
  output tokens/s.

Outputs of the two engines are asserted identical (greedy). Prints ITL and throughput for both and the ratios.

    python benchmarks/spec_decode.py --rounds 2 --max-tokens 64
    python benchmarks/spec_decode.py --spec '{"method": "draft_model", "num_speculative_tokens": 3, "draft_num_layers": 10}'
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

PARAGRAPHS = [
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined movable "
    "metal type, oil-based ink and a screw press adapted from wine making.",
    "A hash table stores key-value pairs in an array of buckets. A hash function maps each key to a bucket index; "
    "collisions are resolved by chaining or open addressing.",
    "Photosynthesis converts light energy into chemical energy. In the chloroplasts of plant cells, chlorophyll "
    "absorbs mostly blue and red light, splitting water molecules and releasing oxygen.",
    "The Silk Road was not a single road but a network of caravan routes linking China with Central Asia, Persia, "
    "Arabia and the Mediterranean.",
]
QUESTIONS = ["Write a short poem about the sea.", "Why is the sky blue?", "Give three tips for learning to cook.",
             "Describe a day in the life of a cat."]


def copy_prompts(llm) -> list[list[int]]:
    return [llm.engine.apply_chat_template([{"role": "user", "content": f"Repeat this text word for word:\n\n{p}"}],
                                           True) for p in PARAGRAPHS]


def itl_batch1(llm, prompts, max_tokens: int) -> tuple[float, list[list[int]]]:
    from pdserve.runtime import SamplingParams

    engine, itls, outs = llm.engine, [], []
    for i, p in enumerate(prompts):
        rid = f"itl-{time.monotonic_ns()}-{i}"
        engine.add_request(rid, p, SamplingParams(temperature=0.0, max_tokens=max_tokens))
        times, n, last = [], 0, None
        while engine.has_unfinished_requests():
            for out in engine.step():
                got = len(out.outputs[0].token_ids)
                now = time.perf_counter()
                times += [now] * (got - n)   # tokens accepted together arrive together
                n, last = got, out
        outs.append(last.outputs[0].token_ids)
        if len(times) > 1:
            itls.append((times[-1] - times[0]) / (len(times) - 1))
    return statistics.mean(itls), outs


def mixed_batch(llm, prompts, max_tokens: int) -> tuple[float, list[list[int]]]:
    from pdserve.runtime import SamplingParams

    t = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    dt = time.perf_counter() - t
    toks = [o.outputs[0].token_ids for o in outs]
    return sum(map(len, toks)) / dt, toks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", default='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, '
                                      '"prompt_lookup_max": 4}')
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2, help="alternated rounds; the best time of each side counts")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--skip-mixed", action="store_true")
    args = ap.parse_args()

    from pdserve.runtime import LLM

    opts = dict(dtype=args.dtype, max_model_len=2048, num_gpu_blocks=2048, max_num_seqs=max(64, args.batch))
    plain, spec = LLM(**opts), LLM(speculative_config=json.loads(args.spec), **opts)
    copies = copy_prompts(plain)
    rng = random.Random(0)
    mixed = (copies + [plain.engine.apply_chat_template([{"role": "user", "content": q}], True) for q in QUESTIONS]
             + [[rng.randrange(100, 49000) for _ in range(rng.randint(32, 256))] for _ in range(args.batch)])
    mixed = mixed[:args.batch]
    best = {"itl": {}, "tput": {}}
    for _ in range(args.rounds):
        for name, llm in (("plain", plain), ("spec", spec)):
            itl, outs = itl_batch1(llm, copies, args.max_tokens)
            best["itl"].setdefault(name, []).append((itl, outs))
            if not args.skip_mixed:
                tput, mouts = mixed_batch(llm, mixed, args.max_tokens)
                best["tput"].setdefault(name, []).append((tput, mouts))
    itl = {k: min(v)[0] for k, v in best["itl"].items()}
    assert best["itl"]["plain"][0][1] == best["itl"]["spec"][0][1], "greedy outputs differ"
    sd = spec.get_stats().spec_decode
    print(f"spec config: {args.spec}")
    print(f"copy-heavy batch 1, {len(copies)} prompts, {args.max_tokens} tokens: ITL plain {itl['plain'] * 1e3:.1f} ms, "
          f"spec {itl['spec'] * 1e3:.1f} ms -> {itl['plain'] / itl['spec']:.2f}x lower")
    if not args.skip_mixed:
        tput = {k: max(v)[0] for k, v in best["tput"].items()}
        assert best["tput"]["plain"][0][1] == best["tput"]["spec"][0][1], "greedy outputs differ"
        print(f"mixed batch {len(mixed)}, {args.max_tokens} tokens: plain {tput['plain']:.1f} tok/s, spec "
              f"{tput['spec']:.1f} tok/s -> {tput['spec'] / tput['plain']:.2f}x")
    print(f"acceptance: {sd.num_accepted_tokens}/{sd.num_draft_tokens} draft tokens over {sd.num_drafts} drafts, "
          f"per position {sd.num_accepted_tokens_per_pos}")


if __name__ == "__main__":
    main()
