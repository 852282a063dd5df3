"""Runtime pods' /metrics for kwok pods: kwok has no kubelet, so for every runtime pod of one InferenceService a real
HTTP server on the pod's (loopback, see kubeenv.POD_CIDR) IP serves a real runtime ServerMetrics that the test feeds
with the load it sets per role. Used by the autoscaler tests and the live observability test."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

from pdserve.operator import names
from pdserve.runtime.metrics import CONTENT_TYPE, ServerMetrics


class FakePods:
    """For every runtime pod of one InferenceService: an HTTP server on <podIP>:8000 serving a real ServerMetrics,
    fed every 0.25 s with the load the test sets per role (the pod itself is kwok's: there is no kubelet)."""

    def __init__(self, cluster, namespace: str, instance: str) -> None:
        self.cluster, self.ns, self.instance = cluster, namespace, instance
        self.load = {"prefill": "idle", "decode": "idle"}
        # by pod IP (kwok may hand a deleted pod's IP to a new pod): server, and the pod now behind it
        self.servers: dict[str, tuple[ThreadingHTTPServer, dict]] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> FakePods:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(timeout=10)
        for server, _ in self.servers.values():
            server.shutdown()
            server.server_close()

    def _serve(self, ip: str, pod: dict) -> ThreadingHTTPServer:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                body = pod["metrics"].render() if self.path == "/metrics" else b""
                self.send_response(200 if body else 404)
                self.send_header("content-type", CONTENT_TYPE)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        server = ThreadingHTTPServer((ip, names.RUNTIME_PORT), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server

    def _run(self) -> None:
        while not self.stop.wait(0.25):
            try:
                pods = self.cluster.get(f"/api/v1/namespaces/{self.ns}/pods?labelSelector="
                                        f"{names.INSTANCE_LABEL}={self.instance},"
                                        f"{names.COMPONENT_LABEL}=runtime")["items"]
            except httpx.HTTPError:
                continue
            live = set()
            for p in pods:
                ip = (p.get("status") or {}).get("podIP")
                if not ip or p["metadata"].get("deletionTimestamp"):
                    continue
                live.add(ip)
                current = {"uid": p["metadata"]["uid"], "role": p["metadata"]["labels"][names.ROLE_LABEL]}
                if ip not in self.servers:
                    current["metrics"] = ServerMetrics("smol")
                    self.servers[ip] = (self._serve(ip, current), current)
                elif self.servers[ip][1]["uid"] != current["uid"]:  # a new pod at a recycled IP starts from zero
                    self.servers[ip][1].update(current, metrics=ServerMetrics("smol"))
            for ip, (_, pod) in self.servers.items():
                if ip not in live or self.load.get(pod["role"]) != "busy":
                    continue
                m = pod["metrics"]
                if pod["role"] == "prefill":
                    m.ttft.observe(3.0)  # p90 3s vs the 1s target
                else:
                    for _ in range(5):
                        m.itl.observe(0.2)  # p90 0.2s vs the 50ms target
                m.request_finished("stop")
