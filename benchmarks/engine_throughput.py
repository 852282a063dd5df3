"""pdserve engine vs Hugging Face transformers, side by side in one process.

Throughput mode (default): a seeded workload of N requests (prompts of 32-1,024 random tokens, outputs of 16-256
tokens, EOS ignored) run by pdserve's continuous batching and by transformers static batching (batches of 32 in arrival
order, left-padded, each batch generating until its longest request is done). Prints output tokens/s for both and the
ratio (useful tokens only: a padded row's extra tokens do not count).

TTFT mode (``--mode ttft-prefix``): 32 requests sharing a 1,000-token prefix (plus a short unique suffix), submitted one
after another, time to first token with and without prefix caching.

    python benchmarks/engine_throughput.py --num-requests 64 --max-prompt 512 --max-output 64
    python benchmarks/engine_throughput.py --mode ttft-prefix
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch


def workload(args, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    out = []
    for _ in range(args.num_requests):
        n = rng.randint(args.min_prompt, args.max_prompt)
        out.append(([rng.randrange(100, vocab - 100) for _ in range(n)], rng.randint(args.min_output, args.max_output)))
    return out


def run_pdserve(llm, reqs) -> float:
    from pdserve.runtime import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for _, o in reqs]
    t = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params)
    dt = time.perf_counter() - t
    assert [len(o.outputs[0].token_ids) for o in outs] == [o for _, o in reqs]
    return dt


def run_hf(model, reqs, batch_size: int, pad_id: int) -> float:
    t = time.perf_counter()
    for i in range(0, len(reqs), batch_size):
        batch = reqs[i:i + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p, _ in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
        new = max(o for _, o in batch)
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           pad_token_id=pad_id)
    return time.perf_counter() - t


def throughput(args) -> None:
    from transformers import AutoModelForCausalLM

    from pdserve.runtime import LLM

    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_prompt + args.max_output + 16,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    reqs = workload(args, llm.engine.hf_config.vocab_size)
    useful = sum(o for _, o in reqs)
    print(f"workload: {len(reqs)} requests, prompt tokens {sum(len(p) for p, _ in reqs)}, output tokens {useful}, "
          f"dtype {args.dtype}, torch threads {torch.get_num_threads()}")
    dt = run_pdserve(llm, reqs)
    stats = llm.get_stats()
    print(f"pdserve:      {dt:8.1f} s  {useful / dt:8.1f} output tok/s  (preemptions {stats.num_preemptions})")
    if args.skip_hf:
        return
    model_path = llm.engine.model_path
    llm.shutdown()
    del llm
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=getattr(torch, args.dtype)).eval()
    hf_dt = run_hf(model, reqs, args.batch_size, pad_id=0)
    print(f"transformers: {hf_dt:8.1f} s  {useful / hf_dt:8.1f} output tok/s  (static batches of {args.batch_size})")
    print(f"ratio pdserve / transformers: {hf_dt / dt:.2f}x")


def ttft_prefix(args) -> None:
    from pdserve.runtime import LLM, SamplingParams

    rng = random.Random(args.seed)
    results = {}
    for caching in (False, True):
        llm = LLM(args.model, dtype=args.dtype, max_model_len=args.prefix_len + 64, enable_prefix_caching=caching,
                  max_num_batched_tokens=max(2048, args.prefix_len + 64))
        engine = llm.engine
        vocab = engine.hf_config.vocab_size
        rng.seed(args.seed)
        prefix = [rng.randrange(100, vocab - 100) for _ in range(args.prefix_len)]
        llm.generate([[rng.randrange(100, vocab - 100) for _ in range(32)]], SamplingParams(max_tokens=1))  # warm-up
        ttfts = []
        for i in range(args.num_prefix_requests):
            prompt = prefix + [rng.randrange(100, vocab - 100) for _ in range(24)]
            t = time.perf_counter()
            engine.add_request(f"t{i}", prompt, SamplingParams(temperature=0.0, max_tokens=1))
            while not any(o.request_id == f"t{i}" for o in engine.step()):
                pass
            ttfts.append(time.perf_counter() - t)
        results[caching] = ttfts
        hits = engine.get_stats().prefix_cache_hits
        print(f"prefix caching {'on ' if caching else 'off'}: mean TTFT {statistics.mean(ttfts) * 1000:8.1f} ms, "
              f"median {statistics.median(ttfts) * 1000:8.1f} ms, first {ttfts[0] * 1000:8.1f} ms, "
              f"prefix-cache hit tokens {hits}")
        llm.shutdown()
    print(f"TTFT ratio (off / on, mean): {statistics.mean(results[False]) / statistics.mean(results[True]):.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["throughput", "ttft-prefix"], default="throughput")
    p.add_argument("--model", default=None, help="model (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--min-prompt", type=int, default=32)
    p.add_argument("--max-prompt", type=int, default=1024)
    p.add_argument("--min-output", type=int, default=16)
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=32, help="transformers static batch size")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--prefix-len", type=int, default=1000)
    p.add_argument("--num-prefix-requests", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads for this process")
    p.add_argument("--skip-hf", action="store_true", help="run pdserve only")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    throughput(args) if args.mode == "throughput" else ttft_prefix(args)


if __name__ == "__main__":
    main()
