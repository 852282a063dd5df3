"""`pdserve up`: a router, one prefill and one decode runtime on this machine, supervised.

The supervisor prepares the model once (so the pods do not convert it three times in parallel), starts each child in
its own process group with logs under ``--log-dir``, waits for every ``/health`` with progress, prints the OpenAI base
URL, restarts a child that dies (the router keeps serving what it can meanwhile), and on Ctrl-C / SIGTERM stops every
child (SIGTERM, then SIGKILL after a grace period) so no process or port is left behind.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import random
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.runtime import envs

LOCAL_CONNECTORS = ("nixl", "disk", "redis")
# The modules each connector imports (the same names, in the same order, as kv_connectors/*_connector.py) and the
# distribution that provides them; the disk connector needs nothing beyond the core dependencies.
CONNECTOR_MODULES = {"nixl": (("nixl._api", "nixl_cu12._api"), "nixl-cu12"), "redis": (("redis",), "redis")}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="start a router + prefill + decode runtime locally on the default model",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model dir, .gguf file or hub id (default: SmolLM2-135M-Instruct)")
    p.add_argument("--host", default="127.0.0.1", help="address the router listens on (pods always use 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="router port: the OpenAI base URL is http://HOST:PORT/v1")
    p.add_argument("--kv-connector", choices=LOCAL_CONNECTORS, default="nixl",
                   help="how decode pulls the prompt KV from prefill (default nixl: UCX over loopback)")
    p.add_argument("--kv-connector-config", default=None, help="connector JSON; sensible local defaults otherwise")
    p.add_argument("--monolithic", action="store_true", help="one combined (role both) runtime behind the router")
    p.add_argument("--policy", default="precise-prefix", help="router policy (see `pdserve router --help`)")
    p.add_argument("--pd-threshold", type=int, default=0,
                   help="uncached prompt tokens above which the router disaggregates (default 0: always)")
    p.add_argument("--dtype", default="auto", help="runtime dtype: auto|float32|bfloat16|float16")
    p.add_argument("--kv-cache-memory", default=None, help="KV cache budget per runtime, e.g. 1GiB")
    p.add_argument("--api-key", default=None, help="require this key on the router")
    p.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="export OpenTelemetry traces of the router and both pods to this OTLP collector")
    p.add_argument("--log-dir", default=None, help="where the children's logs go (default: a new temp dir)")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for every child's /health")
    p.add_argument("--max-restarts", type=int, default=5, help="restarts per child before `up` gives up")
    p.set_defaults(func=run)


def _requirement(dist: str) -> str:
    """pdserve's own requirement for ``dist`` (e.g. ``nixl-cu12>=0.5``), so the advice never drifts from pyproject."""
    try:
        reqs = importlib.metadata.requires("pdserve") or []
    except importlib.metadata.PackageNotFoundError:
        reqs = []
    for req in reqs:
        spec = req.split(";")[0].strip()
        name = re.match(r"[A-Za-z0-9._-]+", spec)
        if name and re.sub(r"[._-]+", "-", name.group(0)).lower() == dist:
            return spec
    return dist


def missing_connector_package(kind: str) -> str | None:
    """None if ``kind``'s Python package imports, else a one-line error naming the exact pip command to install it."""
    if kind not in CONNECTOR_MODULES:
        return None
    modules, dist = CONNECTOR_MODULES[kind]
    error: Exception | None = None
    for name in modules:
        try:
            importlib.import_module(name)
            return None
        except ImportError as e:  # also a broken native library (ImportError from the extension module)
            error = error or e
    return (f"--kv-connector {kind} needs the Python package {dist} ({error}); install it with: "
            f"{sys.executable} -m pip install '{_requirement(dist)}'  (or pick another --kv-connector)")


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
PICK_RANGE = (15_000, 28_000)   # see free_port


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago, below the kernel's ephemeral range where it can.

    A child binds its port seconds after the port is picked (after loading the model), and outgoing connections take
    their local ports from the ephemeral range, so a port the OS picked there (bind to port 0) can be in use by then:
    the router once failed to start with "address already in use" ~10 s after its port was picked. Below the range
    only another listener can take it. The picks stay within 15000-27999, clear of the fixed ports that tools here
    listen on (the kubelet's 10250, the controller manager's 10257, the scheduler's 10259, vllm-router's metrics on
    29000, Kubernetes NodePorts from 30000). Falls back to the OS's pick when none of those is free."""
    try:
        low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768   # Linux's default
    high = min(low, PICK_RANGE[1])
    for _ in range(64 if high > PICK_RANGE[0] + 100 else 0):
        port = random.randrange(PICK_RANGE[0], high)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class Child:
    """One supervised process: its command line, where it answers /health, and its log."""

    name: str
    argv: list[str]
    port: int
    log_path: Path
    proc: subprocess.Popen | None = None
    restarts: int = 0
    env: dict[str, str] = field(default_factory=dict)

    def start(self) -> None:
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env={**os.environ, **self.env}, start_new_session=True,
                                     preexec_fn=_die_with_parent)
        log.close()

    def healthy(self) -> bool:
        """200 on /health; for the router also every pod routable (its /health says how many are)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                body = json.loads(r.read() or b"{}") if self.name == "router" else {}
                return r.status == 200 and body.get("routable", 0) >= body.get("endpoints", 0)
        except (OSError, ValueError):
            return False

    def stop(self, grace: float) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        except ProcessLookupError:
            pass

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def _die_with_parent() -> None:
    """Linux: the child gets SIGTERM if `pdserve up` itself is killed, so no orphan survives a SIGKILL of the parent."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def connector_config(kind: str, workdir: Path, side_port: int) -> dict:
    """Local defaults: disk under the run's work dir, redis on the default local port, NIXL's side channel on loopback."""
    if kind == "disk":
        return {"path": str(workdir / "kv")}
    if kind == "redis":
        return {"url": "redis://127.0.0.1:6379/0"}
    return {"host": "127.0.0.1", "port": side_port}


def build_children(args: argparse.Namespace, workdir: Path, model_path: str) -> list[Child]:
    exe = [sys.executable, "-m", "pdserve"]
    common = ["--model", model_path, "--host", "127.0.0.1", "--dtype", args.dtype]
    if args.kv_cache_memory:
        common += ["--kv-cache-memory", args.kv_cache_memory]
    tracing = ["--otlp-traces-endpoint", args.otlp_traces_endpoint] if args.otlp_traces_endpoint else []
    common += tracing
    logs = Path(args.log_dir) if args.log_dir else workdir
    logs.mkdir(parents=True, exist_ok=True)
    # The KV side channel's shared secret travels in the environment, never on a command line.
    pod_env = {"PDSERVE_KV_TOKEN": envs.kv_transfer_token() or secrets.token_hex(16)}
    # With --api-key the pods require it too (they listen on loopback, but any local user could reach them), and the
    # router presents it upstream.
    router_env = {"PDSERVE_UPSTREAM_API_KEY": args.api_key} if args.api_key else {}
    if args.api_key:
        pod_env["PDSERVE_API_KEY"] = args.api_key

    event_sources: list[str] = []

    def pod(name: str, role: str, extra: list[str]) -> Child:
        # Each pod publishes its KV events so the router's prefix index is exact.
        port, pub, replay = free_port(), free_port(), free_port()
        event_sources.append(f"http://127.0.0.1:{port}=tcp://127.0.0.1:{pub},tcp://127.0.0.1:{replay}")
        events = ["--kv-events-port", str(pub), "--kv-events-replay-port", str(replay)]
        return Child(name, [*exe, "serve", *common, "--port", str(port), "--role", role, *events, *extra], port,
                     logs / f"{name}.log", env=pod_env)

    if args.monolithic:
        pods = [pod("runtime", "both", [])]
        router_targets = ["--worker", f"http://127.0.0.1:{pods[0].port}"]
    else:
        kv = json.loads(args.kv_connector_config) if args.kv_connector_config else \
            connector_config(args.kv_connector, workdir, free_port())
        kv_args = ["--kv-connector", args.kv_connector, "--kv-connector-config", json.dumps(kv)]
        pods = [pod("prefill", "prefill", kv_args), pod("decode", "decode", kv_args)]
        router_targets = ["--prefill", f"http://127.0.0.1:{pods[0].port}",
                          "--decode", f"http://127.0.0.1:{pods[1].port}",
                          "--pd-threshold", str(args.pd_threshold)]
    router = Child("router", [*exe, "router", "--host", args.host, "--port", str(args.port), "--policy", args.policy,
                              "--tokenizer", model_path, *router_targets,
                              *(a for src in event_sources for a in ("--kv-events-source", src)),
                              *(["--api-key", args.api_key] if args.api_key else []), *tracing], args.port,
                   logs / "router.log",
                   env={"PDSERVE_KV_TOKEN": pod_env["PDSERVE_KV_TOKEN"], **router_env})  # signs handoffs
    return [*pods, router]


def wait_healthy(children: list[Child], timeout: float) -> None:
    start = time.monotonic()
    pending = list(children)
    while pending:
        for c in list(pending):
            if c.proc is not None and c.proc.poll() is not None:
                raise RuntimeError(f"{c.name} exited with code {c.proc.returncode} during start-up:\n{c.tail()}")
            if c.healthy():
                pending.remove(c)
                print(f"  {c.name:8s} ready on port {c.port} ({time.monotonic() - start:.0f}s)", flush=True)
        if pending and time.monotonic() - start > timeout:
            raise RuntimeError(f"not healthy after {timeout:.0f}s: {', '.join(c.name for c in pending)}")
        if pending:
            waiting = ", ".join(c.name for c in pending)
            print(f"  waiting for {waiting} (loading the model)... {time.monotonic() - start:.0f}s", end="\r",
                  flush=True)
            time.sleep(1.0)


def supervise(children: list[Child], max_restarts: int, stop: list[bool]) -> int:
    """Restart children that die until `stop` is set; returns the exit code for `up`."""
    while not stop[0]:
        for c in children:
            if c.proc is not None and c.proc.poll() is not None and not stop[0]:
                if c.restarts >= max_restarts:
                    print(f"{c.name} died {c.restarts + 1} times; giving up. Last log lines:\n{c.tail()}", flush=True)
                    return 1
                c.restarts += 1
                print(f"{c.name} exited with code {c.proc.returncode}; restarting ({c.restarts}/{max_restarts})",
                      flush=True)
                c.start()
        time.sleep(0.5)
    return 0


def run(args: argparse.Namespace) -> int:
    # Before anything starts: a missing connector package would otherwise surface as a decode pod crash loop.
    missing = None if args.monolithic else missing_connector_package(args.kv_connector)
    if missing:
        print(f"error: {missing}", file=sys.stderr, flush=True)
        return 2
    from pdserve.runtime.model_loader import resolve_model_path

    stop = [False]

    def on_signal(signum, frame):  # noqa: ARG001
        stop[0] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    workdir = Path(tempfile.mkdtemp(prefix="pdserve-up-"))
    print("preparing the model (the first run converts the default GGUF to safetensors)...", flush=True)
    model_path = str(resolve_model_path(args.model))
    children = build_children(args, workdir, model_path)
    print(f"starting {', '.join(c.name for c in children)}; logs in {children[0].log_path.parent}", flush=True)
    code = 0
    try:
        pods, router = children[:-1], children[-1]  # pods first: the router starts with every pod healthy
        for c in pods:
            c.start()
        wait_healthy(pods, args.startup_timeout)
        router.start()
        wait_healthy([router], args.startup_timeout)
        base = f"http://{args.host}:{args.port}/v1"
        auth = f" -H 'Authorization: Bearer {args.api_key}'" if args.api_key else ""
        print(f"\npdserve is up. OpenAI base URL: {base}\n"
              f"  curl {base}/chat/completions -H 'Content-Type: application/json'{auth} \\\n"
              f"    -d '{{\"model\": \"{Path(model_path).name}\", \"messages\": "
              f"[{{\"role\": \"user\", \"content\": \"Hello!\"}}]}}'\n"
              "Press Ctrl-C to stop.", flush=True)
        code = supervise(children, args.max_restarts, stop)
    except RuntimeError as e:
        print(f"\nerror: {e}", file=sys.stderr, flush=True)
        code = 1
    finally:
        print("\nstopping...", flush=True)
        for c in reversed(children):
            c.stop(grace=15.0)
        print("stopped.", flush=True)
    return code
