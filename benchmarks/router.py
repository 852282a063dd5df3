"""pdserve router vs the Rust ``vllm-router``, side by side in one run.

(a) Overhead (``--part a``): both routers in front of the same fast fake OpenAI backend on loopback (two processes of
    ``tests/router/fake_pod.py``). Added latency = latency through the router minus latency straight to the backend
    (p50 and p99 of sequential keep-alive requests, the three paths interleaved); max requests/s from a closed-loop
    aiohttp load generator in its own process. pdserve runs ``round-robin`` (vs vllm-router ``round_robin``) and
    ``precise-prefix`` (chat template + tokenize + block hashes on every request; vs vllm-router ``cache_aware``).
    Goals: p50 added <= 1 ms, p99 added <= 5 ms, max rps >= 0.5x vllm-router's.

(b) Prefix routing (``--part b``): a shared-prefix multi-tenant workload (each tenant a long system prompt, many short
    questions, tenants interleaved at random, a few requests in flight) over ``--pods`` real ``pdserve serve`` pods on
    the default model, with KV caches sized so that not every tenant fits on every pod. For each of pdserve
    ``precise-prefix`` (fed by the pods' KV events), pdserve ``round-robin`` and vllm-router ``cache_aware`` (fresh
    tenant prefixes per policy so no run profits from another's cache): prefix-cache hit rate (from the pods'
    ``vllm:prefix_cache_hits/queries``) and p50/p90 TTFT of streamed requests.

    python benchmarks/router.py --part a --requests 2000 --duration 5
    python benchmarks/router.py --part b --tenants 6 --per-tenant 6

Recorded on the 2-core shared dev box (other jobs running; numbers vary run to run):
(a) --requests 1000 --duration 3 --repeats 3: pdserve round-robin added p50 0.24 ms / p99 1.5 ms, 2192 rps (0.84x
    vllm-router's 2601), 145 vs 96 CPU us/request; precise-prefix added p50 0.42 ms / p99 0.76 ms, 2161 rps (1.09x
    cache_aware's 1981). All three goals met.
(b) --tenants 8 (48 requests per policy, 3 pods, 48 KV blocks each): hit rate precise-prefix 0.664-0.694,
    cache_aware 0.700-0.706, round-robin 0.363; p90 TTFT within noise of cache_aware, ~1.0-1.15x better than
    round-robin. An in-process trace of the same workload showed every tenant pinned to one pod and per-pod hit rates
    of 0.718 (the workload's ceiling); the run order (cold pods first) moves the end-to-end numbers by a few points.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import multiprocessing as mp
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
VLLM_ROUTER = shutil.which("vllm-router") or str(Path(PY).parent / "vllm-router")
PIDS: dict[str, int] = {}  # url -> pid of the process serving it (for CPU accounting)
BODY = json.dumps({"model": "fake", "messages": [{"role": "user", "content": "Say hello in one word."}],
                   "max_tokens": 8}).encode()


# -- processes -----------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen, timeout: float, path: str = "/health") -> None:
    u = urlsplit(url)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{' '.join(map(str, proc.args))[:200]} exited with {proc.returncode}")
        try:
            c = http.client.HTTPConnection(u.hostname, u.port, timeout=2)
            c.request("GET", path)
            if c.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url}{path} not ready after {timeout}s")


@contextlib.contextmanager
def spawn(cmd: list[str], port: int, timeout: float = 120, env: dict | None = None):
    log = tempfile.NamedTemporaryFile(prefix="bench-router-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url, proc, timeout)
        PIDS[url] = proc.pid
        yield url
    except BaseException:
        print(Path(log.name).read_text()[-3000:], file=sys.stderr)
        raise
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def pdserve_router(backends: list[str], policy: str, extra: list[str] = ()):
    port = free_port()
    cmd = [PY, "-m", "pdserve", "router", "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
           "--log-level", "error", *[a for b in backends for a in ("--worker", b)], *extra]
    return spawn(cmd, port)


def vllm_router(backends: list[str], policy: str):
    port = free_port()
    cmd = [VLLM_ROUTER, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *backends, "--policy", policy,
           "--log-level", "error", "--prometheus-port", str(free_port())]
    return spawn(cmd, port)


# -- (a) latency and throughput ------------------------------------------------------------------------------------
def latencies(urls: list[str], n: int, path: str = "/v1/chat/completions") -> list[list[float]]:
    """``n`` sequential requests per url over keep-alive connections, interleaved; seconds per request."""
    conns = [http.client.HTTPConnection(urlsplit(u).hostname, urlsplit(u).port, timeout=30) for u in urls]
    out: list[list[float]] = [[] for _ in urls]
    headers = {"Content-Type": "application/json"}
    for i in range(n + 50):
        for j in (range(len(urls)) if i % 2 else reversed(range(len(urls)))):
            t = time.perf_counter()
            conns[j].request("POST", path, BODY, headers)
            r = conns[j].getresponse()
            r.read()
            dt = time.perf_counter() - t
            if r.status != 200:
                raise RuntimeError(f"{urls[j]}: HTTP {r.status}")
            if i >= 50:  # warm-up
                out[j].append(dt)
    return out


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def _load_worker(url: str, concurrency: int, duration: float, q) -> None:
    import aiohttp

    async def main() -> None:
        done = errors = 0
        stop = time.perf_counter() + duration
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn) as s:
            async def one() -> None:
                nonlocal done, errors
                while time.perf_counter() < stop:
                    async with s.post(url + "/v1/chat/completions", data=BODY,
                                      headers={"Content-Type": "application/json"}) as r:
                        await r.read()
                        if r.status == 200:
                            done += 1
                        else:
                            errors += 1
            t = time.perf_counter()
            await asyncio.gather(*(one() for _ in range(concurrency)))
            q.put((done, errors, time.perf_counter() - t))

    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    asyncio.run(main())


def cpu_seconds(pid: int) -> float:
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def max_rps(url: str, concurrency: int, duration: float) -> tuple[float, int, float]:
    """(requests/s, errors, CPU microseconds the serving process spent per request)."""
    q = mp.get_context("spawn").Queue()
    p = mp.get_context("spawn").Process(target=_load_worker, args=(url, concurrency, duration, q))
    p.start()
    cpu0 = cpu_seconds(PIDS[url])
    done, errors, dt = q.get(timeout=duration + 60)
    cpu = cpu_seconds(PIDS[url]) - cpu0
    p.join(10)
    return done / dt, errors, cpu / max(1, done) * 1e6


def part_a(args) -> None:
    print("== (a) router overhead against a fast fake backend (loopback) ==")
    fake = str(ROOT / "tests" / "router" / "fake_pod.py")
    with contextlib.ExitStack() as st:
        backends = []
        for i in range(2):
            port = free_port()
            backends.append(st.enter_context(spawn([PY, fake, "--port", str(port), "--name", f"b{i}"], port)))
        pairs = [("round-robin", "round_robin")]
        if args.prefix_policies:
            pairs.append(("precise-prefix", "cache_aware"))
        rows = []
        for ours, theirs in pairs:
            pd_url = st.enter_context(pdserve_router(backends, ours))
            vr_url = st.enter_context(vllm_router(backends, theirs))
            direct, pd, vr = latencies([backends[0], pd_url, vr_url], args.requests)
            base50, base99 = pct(direct, 50), pct(direct, 99)
            # max rps: alternate the two routers ``repeats`` times and keep each one's median (the host is shared)
            runs: dict[str, list] = {pd_url: [], vr_url: []}
            for _ in range(args.repeats):
                for u in (pd_url, vr_url):
                    runs[u].append(max_rps(u, args.concurrency, args.duration))
            (rps_pd, err_pd, cpu_pd), (rps_vr, err_vr, cpu_vr) = (sorted(runs[u])[len(runs[u]) // 2]
                                                                  for u in (pd_url, vr_url))
            rows.append((f"pdserve {ours}", (pct(pd, 50) - base50) * 1e3, (pct(pd, 99) - base99) * 1e3, rps_pd, err_pd,
                         cpu_pd))
            rows.append((f"vllm-router {theirs}", (pct(vr, 50) - base50) * 1e3, (pct(vr, 99) - base99) * 1e3, rps_vr,
                         err_vr, cpu_vr))
            print(f"direct to backend: p50 {base50 * 1e3:.3f} ms, p99 {base99 * 1e3:.3f} ms "
                  f"({args.requests} sequential requests per path)")
        rps_direct = max_rps(backends[0], args.concurrency, args.duration)[0]
        print(f"{'router':28s} {'added p50 ms':>12s} {'added p99 ms':>12s} {'max rps':>8s} {'errors':>6s} "
              f"{'router CPU us/req':>17s}")
        for name, a50, a99, rps, err, cpu in rows:
            print(f"{name:28s} {a50:12.3f} {a99:12.3f} {rps:8.0f} {err:6d} {cpu:17.0f}")
        print(f"{'(one backend, no router)':28s} {'':12s} {'':12s} {rps_direct:8.0f}")
        for i in range(0, len(rows), 2):
            p, v = rows[i], rows[i + 1]
            print(f"ratio {p[0]} / {v[0]}: max rps {p[3] / v[3]:.2f}x, CPU per request {p[5] / v[5]:.2f}x; "
                  f"added p50 {p[1]:.3f} vs {v[1]:.3f} ms, p99 {p[2]:.3f} vs {v[2]:.3f} ms; goals: "
                  f"p50<=1ms {'MET' if p[1] <= 1 else 'MISSED'}, p99<=5ms {'MET' if p[2] <= 5 else 'MISSED'}, "
                  f"rps>=0.5x {'MET' if p[3] >= 0.5 * v[3] else 'MISSED'}")


# -- (b) prefix routing over real pods -----------------------------------------------------------------------------
WORDS = ("tea dragon river lantern mountain harbor copper meadow violin orchard comet glacier ember falcon "
         "willow marble canyon thunder saffron compass").split()


def workload(args, salt: str) -> list[tuple[int, list[dict]]]:
    rng = random.Random(args.seed)
    reqs = []
    for t in range(args.tenants):
        words = [WORDS[(t * 7 + i * 3) % len(WORDS)] for i in range(args.system_words)]
        system = f"[{salt} tenant {t}] You are assistant #{t}. Context: " + " ".join(words)
        for k in range(args.per_tenant):
            q = f"Question {k}: what does {rng.choice(WORDS)} mean to a {rng.choice(WORDS)}?"
            reqs.append((t, [{"role": "system", "content": system}, {"role": "user", "content": q}]))
    rng.shuffle(reqs)
    return reqs


def scrape(url: str, name: str) -> float:
    u = urlsplit(url)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    return sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines() if l.startswith(name + "{"))


async def run_workload(url: str, reqs, concurrency: int, max_tokens: int) -> list[float]:
    import aiohttp

    ttfts: list[float] = []
    queue = list(reqs)

    async def worker(s) -> None:
        while queue:
            _, msgs = queue.pop(0)
            body = {"messages": msgs, "max_tokens": max_tokens, "temperature": 0, "stream": True}
            t = time.perf_counter()
            async with s.post(url + "/v1/chat/completions", json=body) as r:
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
                first = None
                async for line in r.content:
                    # the first chunk with generated text (a leading role-only chunk does not count)
                    if first is None and line.startswith(b"data: {"):
                        choices = json.loads(line[6:]).get("choices") or [{}]
                        if (choices[0].get("delta") or {}).get("content") or choices[0].get("text"):
                            first = time.perf_counter() - t
                if first is None:
                    raise RuntimeError("stream ended without generated text")
                ttfts.append(first)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        await asyncio.gather(*(worker(s) for _ in range(concurrency)))
    return ttfts


def part_b(args) -> None:
    print(f"== (b) shared-prefix multi-tenant workload over {args.pods} real pdserve pods ==")
    with contextlib.ExitStack() as st:
        pods, sources = [], []
        procs = []
        for i in range(args.pods):
            port, ev, rp = free_port(), free_port(), free_port()
            cmd = [PY, "-m", "pdserve", "serve", "--host", "127.0.0.1", "--port", str(port), "--num-gpu-blocks",
                   str(args.num_gpu_blocks), "--max-model-len", "512", "--kv-events-port", str(ev),
                   "--kv-events-replay-port", str(rp)]
            procs.append((cmd, port))
            url = f"http://127.0.0.1:{port}"
            pods.append(url)
            sources += ["--kv-events-source", f"{url}=tcp://127.0.0.1:{ev},tcp://127.0.0.1:{rp}"]
        # start all pods at once (model loading dominates), then wait for each
        cms = [spawn(cmd, port, timeout=600) for cmd, port in procs]
        gens = [cm.__enter__ for cm in cms]
        import threading
        errs: list[BaseException] = []

        def enter(f):
            try:
                f()
            except BaseException as e:  # noqa: BLE001
                errs.append(e)

        threads = [threading.Thread(target=enter, args=(g,)) for g in gens]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for cm in cms:
            st.push(cm.__exit__)
        if errs:
            raise errs[0]
        runs = [("pdserve precise-prefix", lambda: pdserve_router(pods, "precise-prefix", sources)),
                ("pdserve round-robin", lambda: pdserve_router(pods, "round-robin")),
                ("vllm-router cache_aware", lambda: vllm_router(pods, "cache_aware"))]
        if args.order == "reverse":
            runs.reverse()
        results = []
        for run_index, (name, make) in enumerate(runs):
            # same-length salts: every policy gets prompts of identical token counts (same block alignment)
            reqs = workload(args, salt=f"run{run_index}")
            with make() as url:
                # warm-up request outside the measurement (connection setup, first-request paths)
                asyncio.run(run_workload(url, [(0, [{"role": "user", "content": f"hi {name}"}])], 1, 1))
                q0 = sum(scrape(p, "vllm:prefix_cache_queries_total") for p in pods)
                h0 = sum(scrape(p, "vllm:prefix_cache_hits_total") for p in pods)
                t = time.perf_counter()
                ttfts = asyncio.run(run_workload(url, reqs, args.concurrency, args.max_tokens))
                wall = time.perf_counter() - t
                q1 = sum(scrape(p, "vllm:prefix_cache_queries_total") for p in pods)
                h1 = sum(scrape(p, "vllm:prefix_cache_hits_total") for p in pods)
            hit = (h1 - h0) / max(1.0, q1 - q0)
            results.append((name, hit, pct(ttfts, 50), pct(ttfts, 90), len(reqs) / wall))
            print(f"  {name}: hit rate {hit:.3f}, TTFT p50 {pct(ttfts, 50):.3f}s p90 {pct(ttfts, 90):.3f}s, "
                  f"{len(reqs) / wall:.2f} req/s", flush=True)
        print(f"{'policy':28s} {'hit rate':>8s} {'TTFT p50 s':>10s} {'TTFT p90 s':>10s} {'req/s':>7s}")
        for name, hit, p50, p90, rps in results:
            print(f"{name:28s} {hit:8.3f} {p50:10.3f} {p90:10.3f} {rps:7.2f}")
        ours = results[[r[0] for r in results].index("pdserve precise-prefix")]
        for other in results:
            if other is not ours:
                print(f"ratio precise-prefix vs {other[0]}: hit rate {ours[1] / max(other[1], 1e-9):.2f}x, "
                      f"p90 TTFT {other[3] / ours[3]:.2f}x lower")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("a", "b", "both"), default="both")
    ap.add_argument("--requests", type=int, default=2000, help="(a) sequential requests per path for latency")
    ap.add_argument("--concurrency", type=int, default=32, help="(a) load generator connections")
    ap.add_argument("--duration", type=float, default=5.0, help="(a) seconds per max-rps measurement")
    ap.add_argument("--repeats", type=int, default=3, help="(a) max-rps runs per router (median kept)")
    ap.add_argument("--no-prefix-policies", dest="prefix_policies", action="store_false",
                    help="(a) skip precise-prefix vs cache_aware")
    ap.add_argument("--pods", type=int, default=3, help="(b) real pdserve pods")
    ap.add_argument("--tenants", type=int, default=6, help="(b) tenants (distinct system prompts)")
    ap.add_argument("--per-tenant", type=int, default=6, help="(b) requests per tenant")
    ap.add_argument("--system-words", type=int, default=120, help="(b) words per tenant system prompt")
    ap.add_argument("--num-gpu-blocks", type=int, default=48, help="(b) KV blocks per pod (small: caches compete)")
    ap.add_argument("--max-tokens", type=int, default=4, help="(b) tokens generated per request")
    ap.add_argument("--b-concurrency", dest="b_concurrency", type=int, default=3, help="(b) requests in flight")
    ap.add_argument("--order", choices=("forward", "reverse"), default="forward")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.part in ("a", "both"):
        part_a(args)
    if args.part in ("b", "both"):
        args.concurrency = args.b_concurrency
        part_b(args)


if __name__ == "__main__":
    main()
