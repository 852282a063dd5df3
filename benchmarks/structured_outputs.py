"""Structured-output throughput: a batch of JSON-schema requests vs the same batch unconstrained, in one run.

Both batches use the same prompts, greedy sampling and ``ignore_eos`` with a fixed ``max_tokens``, so both generate the
same number of tokens: the ratio of their tok/s is the cost of compiling (cached after the first request), filling the
bitmasks, masking the logits and advancing the matchers. Goal (issue 11): constrained >= 0.8x unconstrained.

    python benchmarks/structured_outputs.py [--batch 32] [--max-tokens 64] [--device cuda]
"""

from __future__ import annotations

import argparse
import time

from pdserve.runtime.llm import LLM
from pdserve.runtime.sampling_params import SamplingParams
from pdserve.runtime.structured_output.params import StructuredOutputsParams

PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "email": {"type": "string"},
    "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}}}},
    "required": ["name", "age", "email", "tags", "address"]}
# 50 people at least: no output can complete (and stop) before max_tokens, so both batches stay full to the end
SCHEMA = {"type": "object", "properties": {"people": {"type": "array", "items": PERSON, "minItems": 50}},
          "required": ["people"]}


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, int]:
    eng, t0 = llm.engine, time.perf_counter()
    for i, p in enumerate(prompts):
        eng.add_request(f"r{time.monotonic_ns()}-{i}", p, params)
    done, tokens = 0, 0
    while done < len(prompts):
        for out in eng.step():
            if out.finished:
                done += 1
                tokens += len(out.outputs[0].token_ids)
    return time.perf_counter() - t0, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--device", default=None)
    ap.add_argument("--backend", default="auto")
    args = ap.parse_args()
    llm = LLM(device=args.device, max_num_seqs=args.batch, structured_outputs_backend=args.backend)
    prompts = [llm.engine.apply_chat_template([{"role": "user", "content": f"Describe person number {i} as JSON."}])
               for i in range(args.batch)]
    free = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    so = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True,
                        structured_outputs=StructuredOutputsParams(json=SCHEMA))
    run(llm, prompts[:2], free)   # warm-up: first-step allocations, the backend's tokenizer tables
    run(llm, prompts[:2], so)
    results = {}
    for name, params in (("unconstrained", free), ("json_schema", so)):
        secs, tokens = run(llm, prompts, params)
        results[name] = tokens / secs
        print(f"{name:>14}: {tokens} tokens in {secs:.2f}s = {tokens / secs:.1f} tok/s")
    print(f"ratio json_schema / unconstrained = {results['json_schema'] / results['unconstrained']:.2f} "
          f"(batch {args.batch}, device {llm.engine.device})")
    llm.shutdown()


if __name__ == "__main__":
    main()
