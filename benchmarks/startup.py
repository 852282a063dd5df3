"""Warm start-up of `pdserve serve`: seconds from launch to its first `/v1/models` answer, at the defaults (every CPU
fast path on) vs every CPU fast path switched off (the environment variables below), alternated; the engine-speed
issue allows the fast paths +20%. Warm: the kernels are built and the model converted before the first timed start
(a first start on an empty cache also compiles the kernels: ``--cold`` times those builds, into an empty cache dir).

    python benchmarks/startup.py --rounds 6
    python benchmarks/startup.py --cold
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

from llamacpp import free_port, running

FAST_PATHS_OFF = {"PDSERVE_CPU_PACKED_GEMM": "0", "PDSERVE_CPU_DECODE_ATTENTION": "torch",
                  "PDSERVE_CPU_PREFILL_ATTENTION": "torch", "PDSERVE_CPU_FUSED_ELEMENTWISE": "0",
                  "PDSERVE_CPU_AMX_LINEAR": "0", "PDSERVE_CPU_AMX_LOSSLESS": "0", "PDSERVE_CPU_LAYER_STACK": "0",
                  "PDSERVE_CPU_GREEDY_HEAD": "0", "PDSERVE_CPU_SMALL_ROWS_GEMM": "0", "PDSERVE_CPU_GGUF_CODES": "0"}


def start_once(env: dict[str, str], timeout: float) -> float:
    """Seconds from launching `pdserve serve` to its first `/v1/models` answer; the server is stopped after."""
    port = free_port()
    t0 = time.perf_counter()
    with running([sys.executable, "-m", "pdserve", "serve", "--port", str(port)], "/v1/models", port, timeout,
                 env={**os.environ, **env}, poll=0.05):
        return time.perf_counter() - t0


KERNELS = ("amx_linear", "fused_cpu", "paged_decode_cpu", "paged_prefill_cpu", "layer_stack_cpu", "greedy_head_cpu",
           "linear_f32_cpu", "fused_f32_cpu", "paged_prefill_f32_cpu", "small_rows_linear",
           "layer_stack_f32_cpu")
BUILD = """
import importlib, sys, time
for name in sys.argv[1:]:
    t = time.perf_counter()
    reason = importlib.import_module("pdserve.kernels." + name).load_extension()
    print(f"{name}: {time.perf_counter() - t:.1f} s" + (f" (not usable: {reason})" if reason else ""), flush=True)
"""


def cold_builds() -> None:
    """Builds every CPU kernel a bf16 or float32 server loads into an empty cache dir, one process, and prints each
    one's time (a kernel that another needs is built by the first that asks; one this CPU cannot run says why)."""
    with tempfile.TemporaryDirectory() as cache:
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", BUILD, *KERNELS], env={**os.environ, "PDSERVE_CACHE_DIR": cache},
                       check=True)
        print(f"all kernels built on an empty cache in {time.perf_counter() - t0:.1f} s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=6, help="starts of each configuration, alternated")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one start may take")
    p.add_argument("--cold", action="store_true", help="only time the kernels' first builds (an empty cache)")
    args = p.parse_args()
    if args.cold:
        cold_builds()
        return
    configs = {"fast paths on (defaults)": {}, "fast paths off": FAST_PATHS_OFF}
    for env in configs.values():   # untimed: builds what a first start builds
        start_once(env, args.timeout)
    times: dict[str, list[float]] = {name: [] for name in configs}
    for r in range(args.rounds):
        for name, env in configs.items():
            times[name].append(start_once(env, args.timeout))
            print(f"round {r + 1}: {name}: {times[name][-1]:.2f} s", flush=True)
    on, off = (statistics.median(t) for t in times.values())
    print(f"median of {args.rounds}: on {on:.2f} s, off {off:.2f} s: the fast paths add {100 * (on / off - 1):+.0f}%")


if __name__ == "__main__":
    main()
