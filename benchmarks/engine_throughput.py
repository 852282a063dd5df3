"""pdserve engine vs llama.cpp and Hugging Face transformers, side by side in one run.

Compare mode (default, the issue-10 benchmark): a seeded workload of N requests (prompts of 30-650 random token ids,
outputs of 16-192 tokens, EOS ignored) sent over HTTP by 32 concurrent clients to `pdserve serve` at its defaults and to
llama.cpp's `llama-server` (built from the llama.cpp tree vendored in llama-cpp-python's sdist, a bf16 GGUF converted
from the same safetensors, 2 threads, 32 slots, continuous batching; see benchmarks/llamacpp.py), then run offline by
transformers static batching (batches of 32, left-padded). Prints output tok/s of the three and both ratios. Rounds
alternate the systems (A, B, C, A, B, C, ...) and the best round of each counts (the machine is shared).
``--decode`` adds decode-only steady-state tok/s at 1, 8, 32 and 64 running sequences on both servers: N clients run
N short prompts to M1 and then to M2 output tokens; N * (M2 - M1) / (T2 - T1) cancels prefill and request overheads.

Offline mode (``--mode offline``): the in-process `LLM` engine vs transformers, no HTTP.
Threads mode (``--mode threads``): the compare workload from 32 concurrent clients in process, through the server's
``AsyncEngine`` without HTTP, with the engine built on the main thread (as `pdserve serve` did before
runtime/engine_thread.py) vs on the thread that steps it (as it does now), and the engine stepped directly by one
thread with no ``AsyncEngine`` (the same clients' pacing), alternated ``--rounds`` times.
TTFT mode (``--mode ttft-prefix``): 32 requests sharing a 1,000-token prefix (plus a short unique suffix), submitted one
after another, time to first token with and without prefix caching (the first request cannot hit the cache: it is in
the mean, and the mean after it is printed too); ``--rounds N`` alternates the two engines N times.

    python benchmarks/engine_throughput.py --rounds 2 --decode
    python benchmarks/engine_throughput.py --mode ttft-prefix
    python benchmarks/engine_throughput.py --mode threads --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

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


async def drive(base: str, model: str, reqs, concurrency: int) -> float:
    """Send ``reqs`` ((prompt ids, max_tokens)) to ``base``/v1/completions from ``concurrency`` clients; -> seconds.
    Checks that every request produced exactly its max_tokens."""
    import httpx

    queue: asyncio.Queue = asyncio.Queue()
    for r in reqs:
        queue.put_nowait(r)

    async def client(http: httpx.AsyncClient) -> None:
        while not queue.empty():
            prompt, n = queue.get_nowait()
            body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0.0, "ignore_eos": True}
            resp = await http.post(f"{base}/v1/completions", json=body)
            resp.raise_for_status()
            got = resp.json()["usage"]["completion_tokens"]
            if got != n:
                raise RuntimeError(f"asked for {n} tokens, got {got}")

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits) as http:
        t = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
        return time.perf_counter() - t


def decode_rate(base: str, model: str, n: int, vocab: int, seed: int, short: int, long: int) -> float:
    """Decode-only tok/s with ``n`` running sequences: (n * (long - short)) / (T(long) - T(short)), fresh prompts."""
    rng = random.Random(seed)
    times = []
    for m in (short, long):
        reqs = [([rng.randrange(100, vocab - 100) for _ in range(32)], m) for _ in range(n)]
        times.append(asyncio.run(drive(base, model, reqs, n)))
    return n * (long - short) / max(times[1] - times[0], 1e-9)


def pdserve_cmd(port: int, model: str | None) -> list[str]:
    """`pdserve serve` at its defaults (bound to loopback on a free port)."""
    return [str(Path(sys.executable).with_name("pdserve")), "serve", "--host", "127.0.0.1", "--port", str(port),
            *(["--model", model] if model else [])]


def compare(args) -> None:
    from transformers import AutoModelForCausalLM

    import llamacpp
    from pdserve.runtime.model_loader import resolve_model_path

    model_dir = resolve_model_path(args.model, None)
    vocab = json_config(model_dir)["vocab_size"]
    reqs = workload(args, vocab)
    useful = sum(o for _, o in reqs)
    print(f"workload: {len(reqs)} requests, prompt tokens {sum(len(p) for p, _ in reqs)}, output tokens {useful}, "
          f"{args.concurrency} concurrent clients; machine: {torch.get_num_threads()} torch threads available")
    tree = gguf = None
    if not args.skip_llamacpp:
        tree = llamacpp.build()
        gguf = llamacpp.convert(model_dir, tree, "bf16")
        print(f"llama.cpp: {tree / 'bin' / 'llama-server'} (llama-cpp-python {llamacpp.VERSION}), {gguf.name}")
    logs = Path(tempfile.mkdtemp(prefix="pdserve-bench-"))
    best: dict[str, float] = {}

    def record(name: str, dt: float) -> None:
        print(f"  {name:13s} {dt:8.1f} s  {useful / dt:8.1f} output tok/s", flush=True)
        best[name] = min(best.get(name, float("inf")), dt)

    decode: dict[str, dict[int, float]] = {"pdserve": {}, "llama.cpp": {}}
    for rnd in range(args.rounds):
        print(f"round {rnd + 1}/{args.rounds}:", flush=True)
        port = llamacpp.free_port()
        with (contextlib.nullcontext() if args.skip_pdserve else
              llamacpp.running(pdserve_cmd(port, args.model), "/health", port, log=logs / "pdserve.log")) as base:
            if base is not None:
                name = httpx_get(base + "/v1/models")["data"][0]["id"]
                asyncio.run(drive(base, name, workload_warmup(vocab), 4))
                record("pdserve", asyncio.run(drive(base, name, reqs, args.concurrency)))
                if args.decode and rnd == 0:
                    for n in args.decode_seqs:
                        decode["pdserve"][n] = decode_rate(base, name, n, vocab, args.seed + n, *args.decode_tokens)
        if tree is not None:
            port = llamacpp.free_port()
            cmd = llamacpp.server_cmd(tree, gguf, port, args.llamacpp_threads, args.llamacpp_slots,
                                      args.max_prompt + args.max_output + 16)
            with llamacpp.running(cmd, "/health", port, log=logs / "llama-server.log") as base:
                asyncio.run(drive(base, "x", workload_warmup(vocab), 4))
                record("llama.cpp", asyncio.run(drive(base, "x", reqs, args.concurrency)))
            if args.decode and rnd == 0:
                slots = max(args.decode_seqs)
                cmd = llamacpp.server_cmd(tree, gguf, port, args.llamacpp_threads, slots, 32 + args.decode_tokens[1] + 16)
                with llamacpp.running(cmd, "/health", port, log=logs / "llama-server-decode.log") as base:
                    for n in args.decode_seqs:
                        decode["llama.cpp"][n] = decode_rate(base, "x", n, vocab, args.seed + n, *args.decode_tokens)
        if not args.skip_hf:
            model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=hf_dtype(args)).eval()
            record("transformers", run_hf(model, reqs, args.batch_size, pad_id=0))
            del model
    print(f"best of {args.rounds} round(s), output tok/s (logs in {logs}):")
    for name, dt in best.items():
        print(f"  {name:13s} {useful / dt:8.1f}")
    if "llama.cpp" in best and "pdserve" in best:
        print(f"ratio pdserve / llama.cpp:    {best['llama.cpp'] / best['pdserve']:.2f}x")
    if "transformers" in best and "pdserve" in best:
        print(f"ratio pdserve / transformers: {best['transformers'] / best['pdserve']:.2f}x "
              f"(transformers {str(hf_dtype(args)).removeprefix('torch.')}, static batches of {args.batch_size})")
    if args.decode:
        print(f"decode-only steady state, output tok/s (tokens {args.decode_tokens[0]}->{args.decode_tokens[1]}):")
        for n in args.decode_seqs:
            a, b = decode["pdserve"].get(n), decode["llama.cpp"].get(n)
            line = f"  {n:3d} running:" + (f" pdserve {a:8.1f}" if a else "") + (f"   llama.cpp {b:8.1f}" if b else "")
            if a and b:
                line += f"   ratio {a / b:.2f}x"
            print(line)


def workload_warmup(vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(12345)
    return [([rng.randrange(100, vocab - 100) for _ in range(64)], 4) for _ in range(4)]


def httpx_get(url: str) -> dict:
    import httpx

    resp = httpx.get(url, timeout=30)
    resp.raise_for_status()
    return resp.json()


def json_config(model_dir: Path) -> dict:
    import json

    return json.loads((model_dir / "config.json").read_text())


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
    model_path, dtype = llm.engine.model_path, llm.engine.dtype
    llm.shutdown()
    del llm
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype).eval()
    hf_dt = run_hf(model, reqs, args.batch_size, pad_id=0)
    print(f"transformers: {hf_dt:8.1f} s  {useful / hf_dt:8.1f} output tok/s  (static batches of {args.batch_size})")
    print(f"ratio pdserve / transformers: {hf_dt / dt:.2f}x")


def hf_dtype(args) -> torch.dtype:
    """transformers' dtype in compare mode: ``--hf-dtype``, auto = the serving engine's own pick on this CPU."""
    from pdserve.runtime.model_loader import resolve_dtype

    if args.hf_dtype != "auto":
        return getattr(torch, args.hf_dtype)
    return resolve_dtype("auto", torch.float32, torch.device("cpu"))


def ttft_prefix(args) -> None:
    from pdserve.runtime import LLM, SamplingParams

    rng = random.Random(args.seed)
    rounds: list[dict[bool, list[float]]] = []
    for r in range(args.rounds):
        results = {}
        for caching in (False, True):
            llm = LLM(args.model, dtype=args.dtype, max_model_len=args.prefix_len + 64, enable_prefix_caching=caching,
                      max_num_batched_tokens=max(2048, args.prefix_len + 64))
            engine = llm.engine
            vocab = engine.hf_config.vocab_size
            rng.seed(args.seed)
            prefix = [rng.randrange(100, vocab - 100) for _ in range(args.prefix_len)]
            warm_up = [rng.randrange(100, vocab - 100) for _ in range(32)]
            llm.generate([warm_up], SamplingParams(max_tokens=1))
            ttfts = []
            for i in range(args.num_prefix_requests):
                prompt = prefix + [rng.randrange(100, vocab - 100) for _ in range(24)]
                t = time.perf_counter()
                engine.add_request(f"t{i}", prompt, SamplingParams(temperature=0.0, max_tokens=1))
                while not any(o.request_id == f"t{i}" for o in engine.step()):
                    pass
                ttfts.append(time.perf_counter() - t)
            results[caching] = ttfts
            stats = engine.get_stats()
            print(f"round {r + 1}, prefix caching {'on ' if caching else 'off'}: mean TTFT "
                  f"{statistics.mean(ttfts) * 1000:8.1f} ms, median {statistics.median(ttfts) * 1000:8.1f} ms, "
                  f"first {ttfts[0] * 1000:8.1f} ms, after the first {statistics.mean(ttfts[1:]) * 1000:8.1f} ms, "
                  f"prefix-cache hit tokens {stats.prefix_cache_hits} (copied from a cached block's leading tokens: "
                  f"{stats.prefix_cache_partial_hits})")
            llm.shutdown()
        rounds.append(results)
        off, on = results[False], results[True]
        print(f"round {r + 1} TTFT ratio (off / on): mean {statistics.mean(off) / statistics.mean(on):.2f}x, "
              f"median {statistics.median(off) / statistics.median(on):.2f}x")
    if len(rounds) > 1:   # the machine is shared: the best round of each side, as in compare mode
        off, on = (min((res[c] for res in rounds), key=statistics.mean) for c in (False, True))
        print(f"best of {len(rounds)} rounds, TTFT ratio (off / on): "
              f"mean {statistics.mean(off) / statistics.mean(on):.2f}x, "
              f"median {statistics.median(off) / statistics.median(on):.2f}x")


def threads(args) -> None:
    """Each round runs the three variants, each in a fresh process (a thread that ran OpenMP work keeps its team)."""
    import subprocess

    if args.built_on:
        dt = threads_direct(args) if args.built_on == "direct" else threads_run(args, args.built_on == "loop")
        print(f"SECONDS {dt:.3f}")
        return
    best: dict[str, float] = {}
    for rnd in range(args.rounds):
        for where in ("main", "loop", "direct"):
            cmd = [sys.executable, __file__, "--mode", "threads", "--built-on", where, "--dtype", args.dtype,
                   "--concurrency", str(args.concurrency), "--num-requests", str(args.num_requests),
                   "--seed", str(args.seed), *(["--model", args.model] if args.model else [])]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            dt = float(out.split("SECONDS ")[-1])
            what = "stepped directly, no AsyncEngine" if where == "direct" else f"engine built on the {where} thread"
            print(f"round {rnd + 1}, {what}: {dt:6.1f} s", flush=True)
            best[where] = min(best.get(where, float("inf")), dt)
    print(f"best of {args.rounds} round(s): built on the main thread {best['main']:.1f} s, on the loop thread "
          f"{best['loop']:.1f} s: {best['main'] / best['loop']:.2f}x; stepped directly {best['direct']:.1f} s "
          f"(AsyncEngine on the loop thread / direct: {best['loop'] / best['direct']:.2f}x)")


def threads_direct(args) -> float:
    """The same workload and concurrency, the engine stepped by this thread with no AsyncEngine; seconds."""
    from pdserve.runtime.config import EngineConfig
    from pdserve.runtime.engine import LLMEngine
    from pdserve.runtime.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig.from_options(model=args.model, dtype=args.dtype))
    queue = list(enumerate(workload(args, engine.hf_config.vocab_size)))
    warm = (list(range(100, 164)), 4)
    engine.add_request("warm-up", warm[0], SamplingParams(temperature=0.0, max_tokens=warm[1], ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    t = time.perf_counter()
    inflight = 0
    try:
        while queue or inflight:
            while queue and inflight < args.concurrency:   # a client sends its next request when one finishes
                i, (prompt, n) = queue.pop(0)
                engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
                inflight += 1
            inflight -= sum(out.finished for out in engine.step())
        return time.perf_counter() - t
    finally:
        engine.shutdown()


def threads_run(args, on_loop_thread: bool) -> float:
    """The workload through ``AsyncEngine`` in this process; seconds."""
    from pdserve.runtime.async_engine import AsyncEngine
    from pdserve.runtime.config import EngineConfig
    from pdserve.runtime.engine import LLMEngine
    from pdserve.runtime.engine_thread import EngineThread
    from pdserve.runtime.sampling_params import SamplingParams

    config = EngineConfig.from_options(model=args.model, dtype=args.dtype)
    thread = EngineThread() if on_loop_thread else None
    engine = thread.call(LLMEngine, config) if thread else LLMEngine(config)
    reqs = workload(args, engine.hf_config.vocab_size)

    async def run_one(ae, rid: str, prompt: list[int], n: int) -> None:
        stream = await ae.add(rid, prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        while not (out := await stream.next()).finished:
            pass
        ae.release(stream)
        if len(out.outputs[0].token_ids) != n:
            raise RuntimeError(f"asked for {n} tokens, got {len(out.outputs[0].token_ids)}")

    async def drive_in_process() -> float:
        ae = AsyncEngine(engine, thread=thread)
        ae.start()
        queue = list(enumerate(reqs))

        async def client() -> None:
            while queue:
                i, (prompt, n) = queue.pop(0)
                await run_one(ae, f"r{i}", prompt, n)

        try:
            await run_one(ae, "warm-up", list(range(100, 164)), 4)
            t = time.perf_counter()
            await asyncio.gather(*(client() for _ in range(args.concurrency)))
            return time.perf_counter() - t
        finally:
            ae.stop()

    try:
        return asyncio.run(drive_in_process())
    finally:
        engine.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["compare", "offline", "ttft-prefix", "threads"], default="compare")
    p.add_argument("--model", default=None, help="model (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"],
                   help="offline / ttft-prefix modes: the engine's dtype")
    p.add_argument("--hf-dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="transformers' dtype (auto: what `pdserve serve --dtype auto` picks on this CPU: bfloat16 "
                        "with AVX512-BF16 or AMX, else float32, where torch's bf16 is emulated and far slower)")
    p.add_argument("--num-requests", type=int, default=96)
    p.add_argument("--min-prompt", type=int, default=30)
    p.add_argument("--max-prompt", type=int, default=650)
    p.add_argument("--min-output", type=int, default=16)
    p.add_argument("--max-output", type=int, default=192)
    p.add_argument("--concurrency", type=int, default=32, help="compare mode: concurrent HTTP clients")
    p.add_argument("--rounds", type=int, default=1,
                   help="compare and ttft-prefix modes: alternating rounds; the best of each counts")
    p.add_argument("--llamacpp-threads", type=int, default=2)
    p.add_argument("--llamacpp-slots", type=int, default=32)
    p.add_argument("--skip-llamacpp", action="store_true")
    p.add_argument("--skip-pdserve", action="store_true", help="compare mode: run the baselines only")
    p.add_argument("--decode", action="store_true", help="compare mode: also decode-only tok/s per concurrency")
    p.add_argument("--decode-seqs", type=lambda t: [int(x) for x in t.split(",")], default=[1, 8, 32, 64])
    p.add_argument("--decode-tokens", type=lambda t: [int(x) for x in t.split(",")], default=[16, 80],
                   help="M1,M2: output lengths of the two decode runs")
    p.add_argument("--batch-size", type=int, default=32, help="transformers static batch size")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--prefix-len", type=int, default=1000)
    p.add_argument("--num-prefix-requests", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads for this process")
    p.add_argument("--skip-hf", action="store_true", help="run pdserve only")
    p.add_argument("--built-on", choices=["main", "loop", "direct"], default=None, help=argparse.SUPPRESS)   # threads mode
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    {"compare": compare, "offline": throughput, "ttft-prefix": ttft_prefix, "threads": threads}[args.mode](args)


if __name__ == "__main__":
    main()
