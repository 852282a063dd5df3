"""Quantized weights on CPU, default model, one process: resident weight bytes and decode tokens/s per configuration.

Configurations: float32 (today's default: the Q4_1 GGUF dequantized), bf16 (the dense bf16 engine), int4 (the shipped
Q4_1 blocks kept quantized, bf16 compute on torch's int4 kernel), int8 (per-channel, quantized at load, bf16 compute),
int4-f32 / int8-f32 (the Q4_1 blocks / int8 quantized at load, float32 compute on the fused ``f32_cpu`` kernel),
int4-f32-dequant (opt-in, slow: float32 on the exact dequantize-then-GEMM method, ``PDSERVE_LINEAR_METHOD=dequant``).
Decode tok/s at batch B = ``B * D / (t(1 + D tokens) - t(1 token))`` on B random 16-token prompts, EOS ignored,
prefix caching off, so that the prefill is subtracted out. All configurations stay loaded and are measured round-robin for ``--rounds`` rounds (median
reported), so that load drift on a shared machine hits them alike; ratios are against bf16 and float32 of the SAME run.
Time is this process's CPU time by default (``--clock wall`` for elapsed time): with one thread it is the compute
itself, which time spent waiting for a core of a shared machine would otherwise swamp.

    OMP_NUM_THREADS=1 python benchmarks/quantization.py --decode-tokens 16 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

CONFIGS = {"float32": dict(quantization="none", dtype="float32"), "bf16": dict(quantization="none", dtype="bfloat16"),
           "int4": dict(quantization="int4"), "int8": dict(quantization="int8"),
           "int4-f32": dict(quantization="int4", dtype="float32"), "int8-f32": dict(quantization="int8", dtype="float32")}
OPT_IN = {"int4-f32-dequant": dict(quantization="int4", dtype="float32")}  # same weights, PDSERVE_LINEAR_METHOD=dequant


def load(name: str):
    from pdserve.runtime import LLM

    os.environ.pop("PDSERVE_LINEAR_METHOD", None)
    if name.endswith("-dequant"):
        os.environ["PDSERVE_LINEAR_METHOD"] = "dequant"  # read while the weights load
    try:
        return LLM(device="cpu", max_model_len=512, max_num_seqs=64, enable_prefix_caching=False, num_gpu_blocks=512,
                   **{**CONFIGS, **OPT_IN}[name])
    finally:
        os.environ.pop("PDSERVE_LINEAR_METHOD", None)


def decode_tps(llm, batch: int, decode_tokens: int, rng: random.Random, clock) -> float:
    from pdserve.runtime import SamplingParams

    def run(n: int) -> float:
        prompts = [[rng.randrange(100, 40000) for _ in range(16)] for _ in range(batch)]
        t = clock()
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        return clock() - t

    run(2)  # warm-up
    return batch * decode_tokens / max(run(1 + decode_tokens) - run(1), 1e-9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"of {', '.join([*CONFIGS, *OPT_IN])}")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu",
                    help="cpu: this process's CPU time (with OMP_NUM_THREADS=1, the compute itself; waiting for a core "
                         "on a shared machine does not count); wall: elapsed time")
    args = ap.parse_args()
    from pdserve.runtime.quantization import weight_bytes

    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    rng = random.Random(0)
    names, batches = args.configs.split(","), [int(b) for b in args.batches.split(",")]
    llms = {name: load(name) for name in names}
    samples: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for b in batches:
            for name in names:
                samples.setdefault((name, b), []).append(decode_tps(llms[name], b, args.decode_tokens, rng, clock))
    results: dict[str, dict] = {}
    for name, llm in llms.items():
        row = {"dtype": str(llm.engine.dtype).removeprefix("torch."), "weight_MiB": weight_bytes(llm.engine.model) / 2**20}
        row.update({f"decode_tps_b{b}": statistics.median(samples[(name, b)]) for b in batches})
        llm.shutdown()
        results[name] = row
        print(name, json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    base32, base16 = results.get("float32"), results.get("bf16")
    for name, row in results.items():
        parts = []
        if base32:
            parts.append(f"weights {base32['weight_MiB'] / row['weight_MiB']:.2f}x smaller than float32")
        if base16:
            parts += [f"b{k.rpartition('b')[2]} decode {row[k] / base16[k]:.2f}x bf16" for k in row if k.startswith("decode")]
        print(f"{name}: " + ", ".join(parts))


if __name__ == "__main__":
    main()
