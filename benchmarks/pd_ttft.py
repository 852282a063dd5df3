"""P/D TTFT through the real stack: router -> prefill pod -> KV connector -> decode pod vs one monolithic pod.

Processes are started as a user gets them from ``pdserve up`` (``pdserve.up.build_children``: the same command
lines, KV secret in the environment, connector config, KV event wiring): per connector a ``pdserve router`` in P/D mode
in front of one prefill and one decode ``pdserve serve``; beside them one monolithic ``pdserve serve`` (role both),
asked directly, with no router in front, as the issue's baseline ("vs a monolithic pod"). Redis is a real
``redis-server``.

TTFT = time from sending a streaming ``/v1/completions`` request (official ``openai`` client) to the first chunk that
carries a choice. Prompts are exact token-id lists of ``--lengths`` tokens, fresh random ids per run (no prefix-cache
hit anywhere), ``max_tokens=2``. P/D and monolithic runs alternate (order flipped each repeat) so both sample the shared
host's load alike; each cell reports the median over ``--repeat`` runs after one untimed warm-up per stack and length
(``--long``: no warm-up, one run).

Where the P/D time goes, from the processes' own Prometheus counters (sum deltas around each request):
  prefill   - the prefill pod's own TTFT (arrival -> its one token: the prompt's compute)
  pre-leg   - the router's upstream duration of the prefill request (adds the pod's HTTP answer and handoff params)
  decode    - the decode pod's TTFT (arrival -> first token: KV load, the last prompt token, first step)
  hops      - the rest: client <-> router, router -> decode request, stream relay
  handoff   - P/D TTFT - prefill: everything disaggregation adds on top of computing the prompt once

    python benchmarks/pd_ttft.py [--connectors nixl,redis,disk] [--lengths 512,2048] [--repeat 2]
                                 [--dtype auto] [--long 8192]   # --long: one extra length, measured once, nixl only
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))   # tests.support.redis, for a real redis-server

from openai import OpenAI  # noqa: E402

from pdserve import up  # noqa: E402
from pdserve.runtime.model_loader import resolve_model_path  # noqa: E402

MAX_TOKENS = 2
MAX_LEN = 8192   # the default model's max_position_embeddings (the pods' default --max-model-len)


def _args(kind: str, monolithic: bool, dtype: str, log_dir: Path, kv_config: dict | None,
          otlp: str | None = None) -> argparse.Namespace:
    return argparse.Namespace(model=None, host="127.0.0.1", port=up.free_port(), kv_connector=kind,
                              kv_connector_config=json.dumps(kv_config) if kv_config else None,
                              monolithic=monolithic, policy="precise-prefix", pd_threshold=0, dtype=dtype,
                              kv_cache_memory="1GiB", api_key=None, otlp_traces_endpoint=otlp, log_dir=str(log_dir))


@contextlib.contextmanager
def stack(children: list[up.Child]):
    """Start ``children`` (pods first, as `up` does) and stop them after."""
    try:
        pods = [c for c in children if c.name != "router"]
        for c in pods:
            c.start()
        up.wait_healthy(pods, 900)
        for c in children:
            if c.name == "router":
                c.start()
                up.wait_healthy([c], 300)
        yield children
    finally:
        for c in reversed(children):
            c.stop(grace=15.0)


def _metric_sum(port: int, name: str, label: str = "") -> float:
    """Sum of a histogram's ``_sum`` series on a process's /metrics (optionally only series containing ``label``)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    pat = re.compile(rf"^{re.escape(name)}_sum(\{{[^}}]*\}})? ([0-9.eE+-]+)$", re.M)
    return sum(float(v) for labels, v in pat.findall(text) if label in (labels or ""))


class Probe:
    """Counter sums around one request: which part of the process chain took how long."""

    def __init__(self, probes: dict[str, tuple[int, str, str]]):
        self.probes, self.before = probes, {}

    def __enter__(self):
        self.before = {k: _metric_sum(*p) for k, p in self.probes.items()}
        return self

    def __exit__(self, *exc):
        time.sleep(0.05)   # the pods record the request's metrics just after its last chunk
        self.delta = {k: _metric_sum(*p) - self.before[k] for k, p in self.probes.items()}


def ttft(port: int, n: int, headers: dict | None = None) -> tuple[float, float]:
    """(wall-clock send time, TTFT in seconds) of one fresh ``n``-token prompt."""
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=1800, max_retries=0,
                    default_headers=headers)
    # fresh ids: no prefix-cache hit; SmolLM2's context is 8,192 tokens, so "8,192" is 8,190 + MAX_TOKENS
    prompt = [random.randrange(100, 40000) for _ in range(min(n, MAX_LEN - MAX_TOKENS))]
    model = client.models.list().data[0].id
    wall, t0 = time.time(), time.perf_counter()
    first = None
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True)
    for chunk in stream:
        if first is None and chunk.choices:
            first = time.perf_counter() - t0
    assert first is not None, "no chunk with a choice"
    return wall, first


def timeline(rx, trace_id: str, t0: float, total: float) -> dict[str, float]:
    """The P/D request's path in wall-clock segments (ms), from the router's and pods' OTLP spans of one trace."""
    names = {"router", "prefill", "decode", "kv_transfer"}
    spans = {s.name: s for s in rx.wait_for(lambda sp: names <= {x.name for x in sp if x.trace_id == trace_id}, 60)
             if s.trace_id == trace_id}
    r, p, d, kv = (spans[k] for k in ("router", "prefill", "decode", "kv_transfer"))
    p_first = p.start_ns / 1e9 + p.attributes["gen_ai.latency.time_to_first_token"]
    d_first = d.start_ns / 1e9 + d.attributes["gen_ai.latency.time_to_first_token"]
    marks = [("client->router", t0), ("router->prefill", r.start_ns / 1e9), ("prefill compute", p.start_ns / 1e9),
             ("prefill finish", p_first), ("->decode", p.end_ns / 1e9), ("decode queue", d.start_ns / 1e9),
             ("kv load", kv.start_ns / 1e9), ("last token", kv.end_ns / 1e9), ("stream relay", d_first),
             ("end", t0 + total)]
    segs = {name: (marks[i + 1][1] - t) * 1e3 for i, (name, t) in enumerate(marks[:-1])}
    # for scale: the decode pod's next step (its second token), a plain decode step at this context
    return {**segs, "(decode step)": d.attributes.get("pdserve.latency.inter_token_mean", 0) * 1e3}


TTFT = "vllm:time_to_first_token_seconds"
UPSTREAM = "pdserve_router_upstream_duration_seconds"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--connectors", default="nixl,redis,disk")
    ap.add_argument("--lengths", default="512,2048")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--long", type=int, default=0, help="one more length, measured once with the first connector")
    ap.add_argument("--dtype", default="auto", help="pods' --dtype (auto: bf16 on CPUs with AVX512-BF16)")
    ap.add_argument("--trace", action="store_true",
                    help="also export the P/D stack's OTLP traces to a receiver here and print each P/D request's "
                         "timeline (router, prefill compute/finish, decode queue, KV load, last token, relay)")
    args = ap.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    resolve_model_path(None)   # converted once, before the pods start (as `up` does)
    work = Path(tempfile.mkdtemp(prefix="pdserve-pdttft-"))
    rows = []
    from tests.support.redis import redis_server

    rx = None
    if args.trace:
        from tests.observability.otlp_receiver import OTLPReceiver
        rx = OTLPReceiver().__enter__()

    mono_children = up.build_children(_args("nixl", True, args.dtype, work / "mono", None), work / "mono",
                                      str(resolve_model_path(None)))
    with redis_server() as redis, stack([c for c in mono_children if c.name != "router"]) as (mono,):
        for ci, kind in enumerate(args.connectors.split(",")):
            cfg = {"url": redis.url} if kind == "redis" else None
            children = up.build_children(_args(kind, False, args.dtype, work / kind, cfg, rx and rx.url), work / kind,
                                         str(resolve_model_path(None)))
            with stack(children) as (pre, dec, router):
                probe = {"prefill": (pre.port, TTFT, ""), "pre_leg": (router.port, UPSTREAM, 'role="prefill"'),
                         "decode": (dec.port, TTFT, "")}
                ttft(router.port, 64), ttft(mono.port, 64)   # warm-up: connections, handshakes, first-call paths
                todo = [(n, args.repeat) for n in lengths] + ([(args.long, 1)] if args.long and ci == 0 else [])
                for n, reps in todo:
                    if reps > 1:   # untimed, per length: a process's first prompt of a new size pays one-time costs
                        ttft(router.port, n), ttft(mono.port, n)
                    t_mono, t_pd, parts = [], [], []
                    for i in range(reps):
                        order = ("mono", "pd") if i % 2 == 0 else ("pd", "mono")
                        for side in order:
                            if side == "mono":
                                t_mono.append(ttft(mono.port, n)[1])
                                continue
                            trace_id = f"{random.getrandbits(128):032x}"
                            hdr = {"traceparent": f"00-{trace_id}-{random.getrandbits(64):016x}-01"} if rx else None
                            with Probe(probe) as p:
                                t_wall, t = ttft(router.port, n, hdr)
                            t_pd.append(t)
                            if rx:
                                segs = timeline(rx, trace_id, t_wall, t)
                                print(f"    timeline ms: { {k: round(v) for k, v in segs.items()} }", flush=True)
                            parts.append({**p.delta, "total": t})
                        print(f"  {kind} {n}: mono {t_mono[-1] * 1e3:.0f} ms, P/D {t_pd[-1] * 1e3:.0f} ms "
                              f"{ {k: round(v * 1e3) for k, v in parts[-1].items()} }", flush=True)
                    med = {k: statistics.median(p[k] for p in parts) for k in parts[0]}
                    rows.append((kind, n, reps, statistics.median(t_mono), statistics.median(t_pd), med))
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    print(f"\nTTFT through router -> prefill -> connector -> decode vs a monolithic pod, dtype {args.dtype}, "
          f"median of the runs; load average {' '.join(load)}")
    print(f"{'connector':9} {'tokens':>6} {'runs':>4} | {'mono ms':>8} {'P/D ms':>8} {'P/D/mono':>8} | "
          f"{'prefill':>7} {'pre-leg':>7} {'decode':>7} {'hops':>6} | {'handoff ms':>10} {'share':>5}")
    for kind, n, reps, m, pd, d in rows:
        handoff = d["total"] - d["prefill"]
        hops = d["total"] - d["pre_leg"] - d["decode"]
        print(f"{kind:9} {n:6d} {reps:4d} | {m * 1e3:8.0f} {pd * 1e3:8.0f} {pd / m:8.2f} | {d['prefill'] * 1e3:7.0f} "
              f"{d['pre_leg'] * 1e3:7.0f} {d['decode'] * 1e3:7.0f} {hops * 1e3:6.0f} | {handoff * 1e3:10.0f} "
              f"{handoff / d['total']:5.2f}")
    print("share = handoff / P/D TTFT; the breakdown columns are medians of each part (they need not add up exactly)")


if __name__ == "__main__":
    main()
