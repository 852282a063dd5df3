"""Multi-LoRA throughput: a mixed workload over several adapters vs the same workload on the base model, same engine.

One engine with ``--max-loras`` slots and N random PEFT-format adapters (rank ``--rank`` on all seven projections,
written directly as ``adapter_config.json`` + ``adapter_model.safetensors``). The seeded workload (random prompts and
output lengths, EOS ignored) runs alternately with every request on the base model and with requests spread round-robin
over the adapters (all adapters and no base request in one batch); prints output tokens/s of both and the ratio.

    OMP_NUM_THREADS=1 python benchmarks/lora.py --num-requests 32 --adapters 4 --rank 16 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

PROJ = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
        "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def write_adapter(out: Path, shapes, num_layers: int, rank: int, seed: int) -> Path:
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(num_layers):
        for proj, (fan_in, fan_out) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{PROJ[proj]}.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) / fan_in ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.02
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                         "target_modules": list(PROJ), "bias": "none"}))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--min-prompt", type=int, default=32)
    ap.add_argument("--max-prompt", type=int, default=256)
    ap.add_argument("--min-output", type=int, default=16)
    ap.add_argument("--max-output", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from pdserve.runtime import LLM, SamplingParams
    from pdserve.runtime.lora_adapter import ProjShapes

    llm = LLM(dtype=args.dtype, enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank,
              max_cpu_loras=args.adapters, enable_prefix_caching=False)
    shapes = ProjShapes.from_model(llm.engine.model)
    tmp = Path(tempfile.mkdtemp(prefix="pdserve-lora-bench-"))
    names = [f"bench-{i}" for i in range(args.adapters)]
    for i, name in enumerate(names):
        llm.engine.add_lora(name, str(write_adapter(tmp / name, shapes.shapes, shapes.num_layers, args.rank, i)))

    rng = random.Random(args.seed)
    vocab = llm.engine.limits.vocab_size
    reqs = [([rng.randrange(100, vocab - 100) for _ in range(rng.randint(args.min_prompt, args.max_prompt))],
             rng.randint(args.min_output, args.max_output)) for _ in range(args.num_requests)]
    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for _, o in reqs]
    total = sum(o for _, o in reqs)

    def run(loras) -> float:
        t = time.perf_counter()
        outs = llm.generate([p for p, _ in reqs], params, lora_name=loras)
        dt = time.perf_counter() - t
        assert sum(len(o.outputs[0].token_ids) for o in outs) == total
        return dt

    base, mixed = [], []
    mixed_loras = [names[i % len(names)] for i in range(len(reqs))]
    for _ in range(args.rounds):   # alternate, so that machine-load drift hits both sides alike
        base.append(total / run([None] * len(reqs)))
        mixed.append(total / run(mixed_loras))
    b, m = max(base), max(mixed)
    print(f"{args.num_requests} requests, {total} output tokens, {args.adapters} adapters of rank {args.rank} "
          f"(all 7 projections), dtype {llm.engine.dtype}")
    print(f"base only : {b:8.1f} tok/s  (rounds: {', '.join(f'{x:.1f}' for x in base)})")
    print(f"mixed LoRA: {m:8.1f} tok/s  (rounds: {', '.join(f'{x:.1f}' for x in mixed)}); mixed steps: "
          f"{llm.engine.lora.num_mixed_steps}")
    print(f"ratio mixed / base: {m / b:.2f}  (goal >= 0.7)")
    llm.shutdown()


if __name__ == "__main__":
    main()
