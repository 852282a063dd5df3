"""Where one decode step's time goes, at a given number of running sequences (torch.profiler, annotated ranges).

The engine is the one `pdserve serve` runs (defaults, `--dtype auto`); the script wraps its parts in
``record_function`` ranges (scheduling, metadata, GEMMs, attention, norms, LM head, sampling, scheduler update,
postprocessing + detokenization) and prints each range's mean ms per step and share of the step. "rope/elementwise"
is the forward minus its GEMMs, attention and norms: RoPE, residual adds, SwiGLU, embedding and eager dispatch.
A bf16 CPU step of up to 32 tokens runs its decoder layers in one C++ call (kernels/layer_stack_cpu.py), one range
("layer stack"); ``--modules`` switches the stack off, to split those layers into the ranges above.

    python benchmarks/profile_step.py --seqs 1,32
"""

from __future__ import annotations

import argparse
import functools
import os
import random

import torch
from torch.profiler import ProfilerActivity, profile, record_function

RANGES = ["step", "schedule", "metadata", "forward", "layer stack", "gemm", "attention", "norm", "lm_head", "sampling",
          "update", "postprocess"]


def wrap(obj, attr: str, name: str) -> None:
    fn = getattr(obj, attr)

    @functools.wraps(fn)
    def inner(*a, **k):
        with record_function(name):
            return fn(*a, **k)
    setattr(obj, attr, inner)


class _Sampler:
    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, *a, **k):
        with record_function("sampling"):
            return self.inner(*a, **k)


def instrument(engine) -> None:
    runner, model = engine.runner, engine.runner.model
    wrap(engine, "step", "step")
    wrap(engine.scheduler, "schedule", "schedule")
    wrap(engine.scheduler, "update_from_output", "update")
    wrap(engine.outputs, "process", "postprocess")
    wrap(runner, "update_states", "metadata")   # persistent-batch diffs
    wrap(runner, "build_metadata", "metadata")
    wrap(model, "forward", "forward")
    wrap(model, "compute_logits", "lm_head")
    runner.sampler = _Sampler(runner.sampler)
    seen = set()
    for layer in model.layers:
        for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            wrap(lin, "forward", "gemm")
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            wrap(norm, "forward", "norm")
        if id(layer.self_attn.backend) not in seen:
            seen.add(id(layer.self_attn.backend))
            wrap(layer.self_attn.backend, "forward", "attention")
    wrap(model.norm, "forward", "norm")
    wrap(model, "layer_stack", "layer stack")


def run(n: int, args) -> dict[str, float]:
    from pdserve.runtime import LLM, SamplingParams

    llm = LLM(args.model, max_model_len=2048)
    engine = llm.engine
    rng = random.Random(n)
    vocab = engine.hf_config.vocab_size
    for i in range(n):
        engine.add_request(f"r{i}", [rng.randrange(100, vocab - 100) for _ in range(args.prompt)],
                           SamplingParams(temperature=0.0, max_tokens=1024, ignore_eos=True))
    while any(r.num_output_tokens == 0 for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(3):
        engine.step()
    instrument(engine)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            engine.step()
    totals = dict.fromkeys(RANGES, 0.0)
    totals.update({e.key: e.cpu_time_total / 1000 / args.steps for e in prof.key_averages() if e.key in RANGES})
    llm.shutdown()
    print(f"{n} running sequences, dtype {engine.dtype}, torch threads {torch.get_num_threads()}: "
          f"{totals['step']:.1f} ms/step, {n * 1000 / totals['step']:.1f} tok/s")
    return totals


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--seqs", type=lambda t: [int(x) for x in t.split(",")], default=[1, 32])
    p.add_argument("--prompt", type=int, default=256, help="prompt tokens per sequence (context of the decodes)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: the engine's)")
    p.add_argument("--modules", action="store_true", help="run the layers' modules (PDSERVE_CPU_LAYER_STACK=0)")
    args = p.parse_args()
    if args.modules:
        os.environ["PDSERVE_CPU_LAYER_STACK"] = "0"
    if args.threads:
        torch.set_num_threads(args.threads)
    results = {n: run(n, args) for n in args.seqs}
    rows = [("decoder layers in one C++ call (layer stack)", lambda t: t["layer stack"]),
            ("GEMMs (qkv, o, gate_up, down)", lambda t: t["gemm"]),
            ("attention (KV write + paged attention)", lambda t: t["attention"]),
            ("RMSNorm", lambda t: t["norm"]),
            ("rope/elementwise/eager dispatch", lambda t: t["forward"] - t["layer stack"] - t["gemm"] - t["attention"]
             - t["norm"]),
            ("LM head (GEMM over vocab)", lambda t: t["lm_head"]),
            ("sampling", lambda t: t["sampling"]),
            ("scheduling + metadata", lambda t: t["schedule"] + t["metadata"]),
            ("scheduler update + postprocess/detokenize", lambda t: t["update"] + t["postprocess"]),
            ("other (engine glue)", lambda t: t["step"] - t["forward"] - t["lm_head"] - t["sampling"]
             - t["schedule"] - t["metadata"] - t["update"] - t["postprocess"])]
    head = " | ".join(f"{n} seqs: ms/step (%)" for n in results)
    print(f"| part | {head} |\n|---|{'---|' * len(results)}")
    for label, f in rows:
        cells = " | ".join(f"{f(t):.2f} ({100 * f(t) / t['step']:.0f}%)" for t in results.values())
        print(f"| {label} | {cells} |")
    print("| whole step | " + " | ".join(f"{t['step']:.2f}" for t in results.values()) + " |")


if __name__ == "__main__":
    main()
