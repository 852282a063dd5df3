"""Start real pdserve processes on free loopback ports for tests.

``launch_server(*args)`` runs ``python -m pdserve serve --host 127.0.0.1 --port <free> *args`` as a subprocess, waits
until ``GET /health`` answers 200 (or fails fast with the log tail if the process exits or the timeout passes), and on
exit stops it: SIGTERM, then SIGKILL after ``stop_timeout``. ``launch_process`` does the same for any command that
serves a health URL (the router, ``pdserve up``...). Output goes to a temp log file (never a pipe that could fill up).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from pdserve.up import free_port  # noqa: F401  (re-exported: the tests' one way to pick a port)

DEFAULT_START_TIMEOUT = 300.0  # loading the model on a busy 2-core CI box can take a while


@dataclass
class ServerHandle:
    proc: subprocess.Popen
    host: str
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def logs(self, tail: int | None = None) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return text if tail is None else text[-tail:]

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM, wait up to ``timeout`` s, then SIGKILL; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def _flag_value(args: Sequence[str], flag: str) -> str | None:
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


@contextlib.contextmanager
def launch_process(cmd: Sequence[str], port: int, *, host: str = "127.0.0.1", health_path: str = "/health",
                   env: dict[str, str] | None = None, timeout: float = DEFAULT_START_TIMEOUT,
                   stop_timeout: float = 30.0) -> Iterator[ServerHandle]:
    """Run ``cmd`` and yield a handle once ``http://host:port{health_path}`` answers 200."""
    log = tempfile.NamedTemporaryFile(prefix="pdserve-test-", suffix=".log", delete=False)
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, env=full_env)
    handle = ServerHandle(proc, host, port, Path(log.name))
    done = False
    try:
        _wait_healthy(handle, health_path, timeout)
        yield handle
        done = True
    finally:
        handle.terminate(stop_timeout)
        log.close()
        if done:   # a block that raised keeps the server's log in the temp dir, for whoever reads the failure
            os.unlink(log.name)


def _wait_healthy(handle: ServerHandle, health_path: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2.0) as client:
        while True:
            if handle.proc.poll() is not None:
                raise RuntimeError(f"server exited with {handle.proc.returncode} before becoming healthy:\n"
                                   f"{handle.logs(tail=4000)}")
            try:
                if client.get(handle.url + health_path).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{handle.url}{health_path} not healthy after {timeout:.0f}s:\n{handle.logs(tail=4000)}")
            time.sleep(0.3)


@contextlib.contextmanager
def launch_server(*args: str, env: dict[str, str] | None = None, timeout: float = DEFAULT_START_TIMEOUT,
                  stop_timeout: float = 30.0) -> Iterator[ServerHandle]:
    """``pdserve serve *args`` on 127.0.0.1 and a free port (unless ``--host``/``--port`` are in ``args``)."""
    args = list(args)
    host = _flag_value(args, "--host") or "127.0.0.1"
    port_arg = _flag_value(args, "--port")
    port = int(port_arg) if port_arg else free_port(host)
    extra = ([] if _flag_value(args, "--host") else ["--host", host]) + ([] if port_arg else ["--port", str(port)])
    cmd = [sys.executable, "-m", "pdserve", "serve", *extra, *args]
    with launch_process(cmd, port, host=host, env=env, timeout=timeout, stop_timeout=stop_timeout) as handle:
        yield handle
