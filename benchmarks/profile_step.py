"""Where one engine step's time goes (torch.profiler, annotated ranges): a decode step at a given number of running
sequences, or (``--cached-prefix N``) the one step of a request whose first N tokens hit the prefix cache.

The engine is the one `pdserve serve` runs (defaults, `--dtype auto`); the script wraps its parts in
``record_function`` ranges (scheduling, metadata, GEMMs, attention, norms, LM head, sampling, scheduler update,
postprocessing + detokenization) and prints each part's mean ms per step and share of the step. A bf16 CPU step of up
to 32 tokens, and a float32 decode step, runs its decoder layers in one C++ call (kernels/layer_stack_cpu.py,
kernels/layer_stack_f32_cpu.py); the ops that call makes are split into the same parts by name (the linears, the
paged attention kernels, RMSNorm; the rest of the call: RoPE, SiLU * up, the KV write). "rope/elementwise" is the forward minus its GEMMs, attention and norms: RoPE, residual adds,
SwiGLU, the KV write, the embedding and dispatch. The LM head is the greedy head's screen (kernels/greedy_head_cpu.py)
on steps it serves. ``--modules`` switches the stack off. The profiler adds a few microseconds to every op it records,
so the shares of the many small ops (norms, elementwise, views) read high next to an unprofiled step.

    python benchmarks/profile_step.py --seqs 1,32
    python benchmarks/profile_step.py --cached-prefix 1000   # the `engine_throughput.py --mode ttft-prefix` request
"""

from __future__ import annotations

import argparse
import functools
import os
import random

import torch
from torch.profiler import ProfilerActivity, profile, record_function

RANGES = ["intake", "step", "schedule", "metadata", "forward", "layer stack", "gemm", "attention", "norm", "lm_head",
          "sampling", "update", "postprocess"]
STACK_OPS = {   # the ops the layer stack calls, by the part they belong to (anything else it does: rope/elementwise)
    "pdserve_amx_linear::linear": "gemm", "pdserve_paged_cpu::decode": "attention",
    "pdserve_prefill_cpu::prefill": "attention", "pdserve_fused_cpu::rms_norm": "norm",
    "pdserve_qf32::mm": "gemm", "aten::mm": "gemm", "aten::linear": "gemm", "pdserve_small_rows_f32_cpu::linear": "gemm",
    "pdserve_fused_f32_cpu::rms_norm": "norm"}
STACKS = ("pdserve_layer_stack_cpu::forward", "pdserve_layer_stack_f32_cpu::forward")   # the bf16 and float32 ops


def wrap(obj, attr: str, name: str) -> None:
    fn = getattr(obj, attr)

    @functools.wraps(fn)
    def inner(*a, **k):
        with record_function(name):
            return fn(*a, **k)
    setattr(obj, attr, inner)


class _Ranged:
    """``inner`` (a callable object), each call in the range ``name``; its attributes are the inner object's."""

    def __init__(self, inner, name: str) -> None:
        self.inner, self.name = inner, name

    def __getattr__(self, attr):
        return getattr(self.inner, attr)

    def __call__(self, *a, **k):
        with record_function(self.name):
            return self.inner(*a, **k)


def instrument(engine) -> None:
    runner, model = engine.runner, engine.runner.model
    wrap(engine, "add_request", "intake")
    wrap(engine, "step", "step")
    wrap(engine.scheduler, "schedule", "schedule")
    wrap(engine.scheduler, "update_from_output", "update")
    wrap(engine.outputs, "process", "postprocess")
    wrap(runner, "update_states", "metadata")   # persistent-batch diffs
    wrap(runner, "build_metadata", "metadata")
    wrap(model, "forward", "forward")
    wrap(model, "compute_logits", "lm_head")
    runner.sampler = _Ranged(runner.sampler, "sampling")
    if runner.greedy_head is not None:
        runner.greedy_head = _Ranged(runner.greedy_head, "lm_head")
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


def stack_parts(prof) -> dict[str, float]:
    """ms (all steps) of the layer stack's ops by part, from the ops its C++ call made (its direct children)."""
    parts = dict.fromkeys(("gemm", "attention", "norm"), 0.0)
    for e in prof.events():
        parent = e.cpu_parent
        if parent is not None and parent.name in STACKS and e.name in STACK_OPS:
            parts[STACK_OPS[e.name]] += e.cpu_time_total / 1000
    return parts


def run(n: int, args) -> dict[str, float]:
    """The profile of ``args.steps`` decode steps at ``n`` running sequences or, with ``args.cached_prefix``, of as
    many one-step requests over a cached prefix: mean ms per step of each range, and of the stack's parts."""
    from pdserve.runtime import LLM, SamplingParams

    prefix = args.cached_prefix
    llm = LLM(args.model, max_model_len=max(2048, prefix + 64))   # prefix caching: on by default
    engine = llm.engine
    rng = random.Random(n)
    vocab = engine.hf_config.vocab_size
    shared = [rng.randrange(100, vocab - 100) for _ in range(prefix)]

    def cached_request(i: int) -> None:   # the prefix (a hit after the first) + 24 new tokens, one token out
        engine.add_request(f"c{i}", shared + [rng.randrange(100, vocab - 100) for _ in range(24)],
                           SamplingParams(temperature=0.0, max_tokens=1))
        while not any(o.request_id == f"c{i}" for o in engine.step()):
            pass

    if prefix:
        for i in range(3):
            cached_request(i)
    else:
        for i in range(n):
            engine.add_request(f"r{i}", [rng.randrange(100, vocab - 100) for _ in range(args.prompt)],
                               SamplingParams(temperature=0.0, max_tokens=1024, ignore_eos=True))
        while any(r.num_output_tokens == 0 for r in engine.scheduler.running) or engine.scheduler.waiting:
            engine.step()
        for _ in range(3):
            engine.step()
    instrument(engine)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(args.steps):
            if prefix:
                cached_request(3 + i)
            else:
                engine.step()
    totals = dict.fromkeys(RANGES, 0.0)
    totals.update({e.key: e.cpu_time_total / 1000 / args.steps for e in prof.key_averages() if e.key in RANGES})
    totals.update({f"stack {k}": v / args.steps for k, v in stack_parts(prof).items()})
    llm.shutdown()
    what = f"a request over a cached {prefix}-token prefix" if prefix else f"{n} running sequences"
    print(f"{what}, dtype {engine.dtype}, torch threads {torch.get_num_threads()}: {totals['step']:.1f} ms/step"
          + ("" if prefix else f", {n * 1000 / totals['step']:.1f} tok/s"))
    return totals


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--seqs", type=lambda t: [int(x) for x in t.split(",")], default=[1, 32])
    p.add_argument("--prompt", type=int, default=256, help="prompt tokens per sequence (context of the decodes)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: the engine's)")
    p.add_argument("--modules", action="store_true", help="run the layers' modules (PDSERVE_CPU_LAYER_STACK=0)")
    p.add_argument("--cached-prefix", type=int, default=0, metavar="N",
                   help="profile requests of N cached prompt tokens + 24 new, one step each (ignores --seqs)")
    args = p.parse_args()
    if args.modules:
        os.environ["PDSERVE_CPU_LAYER_STACK"] = "0"
    if args.threads:
        torch.set_num_threads(args.threads)
    results = {f"cached {args.cached_prefix}": run(1, args)} if args.cached_prefix else {
        f"{n} seqs": run(n, args) for n in args.seqs}

    def part(t: dict[str, float], name: str) -> float:   # the part in the modules' ranges and in the layer stack
        return t[name] + t[f"stack {name}"]

    def whole(t: dict[str, float]) -> float:   # the step, and the request's intake before it (cached-prefix mode)
        return t["step"] + t["intake"]

    rows = [("GEMMs (qkv, o, gate_up, down)", lambda t: part(t, "gemm")),
            ("attention (paged attention kernels)", lambda t: part(t, "attention")),
            ("RMSNorm", lambda t: part(t, "norm")),
            ("rope/elementwise/KV write/dispatch", lambda t: t["forward"] - part(t, "gemm") - part(t, "attention")
             - part(t, "norm")),
            ("LM head (GEMM over vocab, or the greedy head's screen)", lambda t: t["lm_head"]),
            ("sampling", lambda t: t["sampling"]),
            ("scheduling + metadata", lambda t: t["schedule"] + t["metadata"]),
            ("scheduler update + postprocess/detokenize", lambda t: t["update"] + t["postprocess"]),
            ("other (engine glue)", lambda t: t["step"] - t["forward"] - t["lm_head"] - t["sampling"]
             - t["schedule"] - t["metadata"] - t["update"] - t["postprocess"]),
            ("request intake (`add_request`: validation, prefix block hashes)", lambda t: t["intake"])]
    head = " | ".join(f"{n}: ms/step (%)" for n in results)
    print(f"| part | {head} |\n|---|{'---|' * len(results)}")
    for label, f in rows:
        cells = " | ".join(f"{f(t):.2f} ({100 * f(t) / whole(t):.0f}%)" for t in results.values())
        print(f"| {label} | {cells} |")
    print("| whole step (and intake) | " + " | ".join(f"{whole(t):.2f}" for t in results.values()) + " |")
    print("| of which in the layer stack's one C++ call | "
          + " | ".join(f"{t['layer stack']:.2f}" for t in results.values()) + " |")


if __name__ == "__main__":
    main()
