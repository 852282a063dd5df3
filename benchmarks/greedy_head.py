"""The greedy LM head (kernels/greedy_head_cpu.py) against the full head and argmax, alternated in one engine.

Times, with the runner's greedy head on and off in turn: the ``engine_throughput.py --mode ttft-prefix`` request (24
new tokens over a cached 1,000-token prefix: one sampled row) and a decode step at 1, 8 and 16 running sequences
(every step screened; above 16 rows the runner computes every logit). Prints each side's best round and the ratio.
The tokens are the same either way (tests/kernels/test_greedy_head_cpu.py).

    python benchmarks/greedy_head.py --rounds 4
"""

from __future__ import annotations

import argparse

from layer_stack import alternate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=40, help="decode steps timed per measurement")
    args = p.parse_args()
    heads: dict = {}

    def switch(llm, on: bool) -> None:
        runner = llm.engine.runner
        heads.setdefault("screen", runner.greedy_head)
        if heads["screen"] is None:
            raise SystemExit("no greedy head here (needs a bf16 AMX LM head and AMX-INT8)")
        runner.greedy_head = heads["screen"] if on else None

    alternate(args, "greedy head", switch, (1, 8, 16), lambda llm: heads["screen"].screened, ("full head", "screen"))


if __name__ == "__main__":
    main()
