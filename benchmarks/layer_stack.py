"""The bf16 CPU layer stack (kernels/layer_stack_cpu.py) against the per-module forward, alternated in one engine.

Times, with ``PDSERVE_CPU_LAYER_STACK`` on and off in turn (the switch is read every step): a decode step at 1, 8 and
32 running sequences (prompts of 20 tokens), and the ``engine_throughput.py --mode ttft-prefix`` request (24 new tokens
over a cached 1,000-token prefix: 32 rows, a 992-token cached prefix). Prints each side's best round and the ratio.

    python benchmarks/layer_stack.py --rounds 3
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections.abc import Callable
from typing import Any


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=40, help="decode steps timed per measurement")
    args = p.parse_args()
    alternate(args, "stack", lambda llm, on: os.environ.__setitem__("PDSERVE_CPU_LAYER_STACK", "1" if on else "0"),
              (1, 8, 32), lambda llm: llm.engine.runner.model.layer_stack.steps, ("modules", "stack"))


def alternate(args, what: str, switch: Callable[[Any, bool], None], sizes: tuple[int, ...],
              served: Callable[[Any], int], names: tuple[str, str]) -> None:
    """Times ``what`` off and on in turn (``switch(llm, on)``) in one engine: the cached-prefix request and a decode
    step at each of ``sizes`` running sequences; prints each round, then each side's best and the ratio."""
    from pdserve.runtime import LLM, SamplingParams

    llm = LLM(args.model, max_model_len=1064, enable_prefix_caching=True, max_num_batched_tokens=2048)
    engine = llm.engine
    rng = random.Random(0)
    vocab = engine.hf_config.vocab_size
    prefix = [rng.randrange(100, vocab - 100) for _ in range(1000)]
    ids = iter(range(10**9))

    def cached_request() -> float:
        rid = f"c{next(ids)}"
        t = time.perf_counter()
        engine.add_request(rid, prefix + [rng.randrange(100, vocab - 100) for _ in range(24)],
                           SamplingParams(temperature=0.0, max_tokens=1))
        while not any(o.request_id == rid for o in engine.step()):
            pass
        return time.perf_counter() - t

    def decode_step(n: int) -> float:
        for _ in range(n):
            engine.add_request(f"d{next(ids)}", [rng.randrange(100, vocab - 100) for _ in range(20)],
                               SamplingParams(temperature=0.0, max_tokens=args.steps + 8, ignore_eos=True))
        for _ in range(4):   # the prompts' prefill and the first decodes
            engine.step()
        t = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        dt = (time.perf_counter() - t) / args.steps
        while engine.has_unfinished_requests():
            engine.step()
        return dt

    cached_request()
    best: dict[str, dict[str, float]] = {"on": {}, "off": {}}
    for r in range(args.rounds):
        for side in (("off", "on") if r % 2 == 0 else ("on", "off")):
            switch(llm, side == "on")
            got = {"cached-prefix request": statistics.median(cached_request() for _ in range(10)),
                   **{f"decode step, {n} seqs": decode_step(n) for n in sizes}}
            for k, v in got.items():
                best[side][k] = min(best[side].get(k, float("inf")), v)
            print(f"round {r + 1}, {what} {side:3s}: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in got.items()),
                  flush=True)
    count = served(llm)
    llm.shutdown()
    print(f"best of {args.rounds} rounds ({what}: {count} served):")
    for k in best["on"]:
        print(f"  {k}: {names[0]} {best['off'][k] * 1e3:.2f} ms, {names[1]} {best['on'][k] * 1e3:.2f} ms: "
              f"{best['off'][k] / best['on'][k]:.2f}x")


if __name__ == "__main__":
    main()
