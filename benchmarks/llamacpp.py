"""llama.cpp as a benchmark baseline: build `llama-server`, convert the same safetensors to a bf16 GGUF, run it.

The server is built by scripts/build-llama-server.sh from the llama.cpp tree vendored in the PyPI sdist of
llama-cpp-python (native CPU flags, server target only) and cached under ``<pdserve cache>/llama.cpp/<version>/``
together with that tree's ``convert_hf_to_gguf.py`` and ``gguf-py``; the GGUF is cached next to it per model directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx


REPO = Path(__file__).resolve().parents[1]
VERSION = os.environ.get("LLAMA_CPP_PYTHON_VERSION", "0.3.36")


def build(version: str = VERSION) -> Path:
    """The cache directory holding bin/llama-server, convert_hf_to_gguf.py and gguf-py (built on first use)."""
    if importlib.util.find_spec("sentencepiece") is None:   # said before the build, not after it (minutes)
        raise SystemExit("the llama.cpp baseline's GGUF converter needs sentencepiece: pip install -e '.[bench]'")
    env = {**os.environ, "PYTHON": sys.executable}
    out = subprocess.run(["bash", str(REPO / "scripts" / "build-llama-server.sh"), version], env=env, check=True,
                         stdout=subprocess.PIPE, text=True, timeout=3 * 3600)
    return Path(out.stdout.strip().splitlines()[-1])


def convert(model_dir: Path, tree: Path, outtype: str = "bf16") -> Path:
    """``model_dir`` (HF safetensors) -> a GGUF of ``outtype`` made by the vendored converter, cached by content."""
    st = model_dir / "model.safetensors"
    key = hashlib.sha256(f"{model_dir.resolve()}:{st.stat().st_size}:{st.stat().st_mtime_ns}".encode()).hexdigest()[:12]
    out = tree / "gguf" / f"{model_dir.name}-{key}-{outtype}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree / "gguf-py"), str(tree)])}
    subprocess.run([sys.executable, str(tree / "convert_hf_to_gguf.py"), str(model_dir), "--outtype", outtype,
                    "--outfile", str(tmp)], env=env, check=True, timeout=1800, stdout=subprocess.DEVNULL)
    tmp.rename(out)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float, poll: float = 0.5) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before becoming ready")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        time.sleep(poll)
    raise TimeoutError(f"{url} not ready after {timeout} s")


@contextlib.contextmanager
def running(cmd: list[str], health: str, port: int, timeout: float = 600, log: Path | None = None,
            env: dict[str, str] | None = None, poll: float = 0.5) -> Iterator[str]:
    """Start a server command (with environment ``env``, else ours), wait for ``health`` to answer 200 (asking every
    ``poll`` s), yield its base URL, stop it (SIGTERM, then kill)."""
    sink = open(log, "wb") if log else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base + health, proc, timeout, poll)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        if log:
            sink.close()


def server_cmd(tree: Path, gguf: Path, port: int, threads: int, slots: int, ctx_per_slot: int) -> list[str]:
    """llama-server with ``slots`` parallel sequences (continuous batching), ``threads`` threads, no prompt cache
    reuse across requests beyond what its slots keep."""
    return [str(tree / "bin" / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "-t", str(threads), "-tb", str(threads), "-np", str(slots), "-c", str(slots * ctx_per_slot), "-cb",
            "-b", "2048", "-ub", "512", "--no-webui"]
