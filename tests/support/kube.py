"""What both test clusters share (tests/operator/kubeenv.py: control plane + kwok; tests/cluster/node.py: a real
node): the PKI, admin kubeconfigs, and a mixin with the process bookkeeping and the kubectl/get/wait helpers."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any, ClassVar

import httpx


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_pki(d: Path, ca_name: str, san: str) -> None:
    """ca.{crt,key}; apiserver.{crt,key} for the ``subjectAltName`` entries ``san``; sa.{key,pub} for tokens."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
             "-subj", f"/CN={ca_name}", cwd=d)
    (d / "san.cnf").write_text(f"subjectAltName={san}\nextendedKeyUsage=serverAuth\n")
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "apiserver.key", "-out", "apiserver.csr",
             "-subj", "/CN=kube-apiserver", cwd=d)
    _openssl("x509", "-req", "-in", "apiserver.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "apiserver.crt", "-days", "2", "-extfile", "san.cnf", cwd=d)
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=d)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=d)


def write_kubeconfig(path: Path, server: str, ca: Path, token: str, namespace: str = "default") -> Path:
    cfg = {"apiVersion": "v1", "kind": "Config", "current-context": "test",
           "clusters": [{"name": "test", "cluster": {"server": server, "certificate-authority-data":
                                                     base64.b64encode(ca.read_bytes()).decode()}}],
           "users": [{"name": "u", "user": {"token": token}}],
           "contexts": [{"name": "test", "context": {"cluster": "test", "user": "u", "namespace": namespace}}]}
    path.write_text(json.dumps(cfg))
    return path


class ClusterProcesses:
    """Mixin for a dataclass with ``workdir``, ``bins``, ``kubeconfig``, ``procs`` (name -> Popen) and ``http`` (an
    admin client of the API server): spawning logged processes, their log tails, kubectl, GETs and polling."""

    workdir: Path
    bins: Path
    kubeconfig: Path
    procs: dict[str, subprocess.Popen]
    http: httpx.Client | None
    POLL_INTERVAL: ClassVar[float] = 0.3

    def _spawn_env(self) -> dict[str, str]:
        # Debian's etcd 3.4 has no watch-list support; client-go reads KUBE_FEATURE_* in binaries that take no
        # --feature-gates (kwok, kubelet's clients)
        return {**os.environ, "KUBE_FEATURE_WatchListClient": "false"}

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.workdir / f"{name}.log", "wb")
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                            env=self._spawn_env())

    def _check_procs(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited ({proc.returncode}):\n{self.log_tail(name)}")

    def log_tail(self, name: str, lines: int = 40) -> str:
        path = self.workdir / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def kubectl(self, *args: str, input: str | None = None, check: bool = True, kubeconfig: Path | None = None,
                timeout: float = 120) -> subprocess.CompletedProcess:
        out = subprocess.run([str(self.bins / "kubectl"), "--kubeconfig", str(kubeconfig or self.kubeconfig), *args],
                             input=input, capture_output=True, text=True, timeout=timeout)
        if check and out.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({out.returncode}):\n{out.stderr}")
        return out

    def get(self, path: str) -> dict[str, Any] | None:
        r = self.http.get(path)
        if r.status_code == 404:
            return None
        r.raise_for_status()
        return r.json()

    def wait_for(self, fn, timeout: float = 90, what: str = "condition", interval: float | None = None,
                 check_procs: bool = True):
        """Poll ``fn`` until it returns a truthy value (returned); a crashed cluster process fails fast."""
        deadline, last = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            if check_procs:
                self._check_procs()
            try:
                last = fn()
            except (httpx.HTTPError, AssertionError, KeyError, TypeError, IndexError) as e:
                last = e
            else:
                if last:
                    return last
            time.sleep(self.POLL_INTERVAL if interval is None else interval)
        raise TimeoutError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")

    def _wait(self, ok, timeout: float, what: str) -> None:
        self.wait_for(ok, timeout, what)
