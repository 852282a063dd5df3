"""`pdserve up` checks the chosen KV connector's Python package before it starts anything.

A missing package used to surface only as a decode pod crash loop (`KV connector 'nixl' is unavailable`) after the
model had been prepared and every child started. Here `up` runs as a real subprocess with the package made
unimportable by a `sitecustomize` shim on PYTHONPATH (a meta-path finder that refuses the named top-level modules,
exactly what Python does when the wheel is absent), and must exit non-zero at once with one line naming the pip
command, having prepared no model, created no log dir and bound no port.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve import up
from tests.support.server import free_port

ROOT = Path(__file__).resolve().parents[2]

BLOCKER = '''
import os, sys

_BLOCKED = set(os.environ["PDSERVE_TEST_BLOCK_MODULES"].split(","))


class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in _BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _Block())
'''


def _run_up(tmp_path: Path, blocked: str, *args: str) -> tuple[subprocess.CompletedProcess, Path, Path, int]:
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(BLOCKER)
    cache, logs, port = tmp_path / "cache", tmp_path / "logs", free_port()
    cache.mkdir()
    env = {**os.environ, "PYTHONPATH": str(shim), "PDSERVE_TEST_BLOCK_MODULES": blocked,
           "PDSERVE_CACHE_DIR": str(cache), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "pdserve", "up", "--port", str(port), "--log-dir", str(logs), *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:  # today's main: it went on to start the stack; stop all of it
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=30)
        pytest.fail(f"`pdserve up` did not stop before starting anything:\n{out}\n{err}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), cache, logs, port


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.parametrize(("connector", "blocked", "requirement"), [
    ("nixl", "nixl,nixl_cu12", "nixl-cu12>=0.5"),
    ("redis", "redis", "redis>=5.3"),
])
def test_up_names_the_missing_connector_package_before_starting_anything(tmp_path, connector, blocked, requirement):
    done, cache, logs, port = _run_up(tmp_path, blocked, "--kv-connector", connector)
    probe = subprocess.run([sys.executable, "-c", f"import {blocked.split(',')[-1]}"], capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(tmp_path / "shim"),
                                "PDSERVE_TEST_BLOCK_MODULES": blocked})
    assert probe.returncode != 0 and "No module named" in probe.stderr, "the shim must make the package unimportable"

    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert f"--kv-connector {connector} needs the Python package" in lines[0]
    assert f"{sys.executable} -m pip install '{requirement}'" in lines[0]
    # Nothing happened: no model prepared, no child started (no log dir, nothing listening), no start-up output.
    assert "preparing the model" not in done.stdout and "starting" not in done.stdout, done.stdout
    assert not logs.exists() and not any(cache.iterdir())
    assert not _listening(port)


def test_preflight_passes_when_the_package_imports_and_for_the_disk_connector():
    # The test venv has the nixl extra and redis; the disk connector needs no extra package.
    assert up.missing_connector_package("nixl") is None
    assert up.missing_connector_package("redis") is None
    assert up.missing_connector_package("disk") is None
