"""Debian's Prometheus, started on loopback, scrapes a running `pdserve up` (router, prefill and decode on the default
model) and a running `pdserve operator` reconciling an InferenceService in a real API server; after real traffic
(P/D chat requests, a stream, a bad request) every PromQL expression of every dashboard panel, template variable,
recording rule and alert (threshold made ``bool``) returns data, and every metric name they read exists among the
scraped series. The scrape config gives targets the labels the chart's PodMonitors give them (namespace, pod, isvc,
pool), and loads the chart's rule file, so recording rules and alerts are evaluated by Prometheus itself."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import httpx
import pytest
import yaml

from tests.observability import promql
from tests.operator.conftest import RELEASE, chart_release, cluster  # noqa: F401 (fixtures)
from tests.operator.fakepods import FakePods
from tests.operator.kubeenv import write_kubeconfig
from tests.support.server import free_port, launch_process

pytestmark = [pytest.mark.slow, pytest.mark.k8s]

EXAMPLE = promql.REPO / "crds" / "examples" / "smollm2-pd.yaml"
AUTOSCALED = promql.REPO / "crds" / "examples" / "smollm2-autoscaled.yaml"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """`pdserve up` (NIXL P/D); yields {pool: url} for router, prefill and decode."""
    port = free_port()
    logs = tmp_path_factory.mktemp("up")
    cmd = [sys.executable, "-m", "pdserve", "up", "--port", str(port), "--dtype", "float32", "--log-dir", str(logs)]
    with launch_process(cmd, port, timeout=900, stop_timeout=60) as up:
        ports = dict(re.findall(r"(prefill|decode)\s+ready on port (\d+)", up.logs()))
        assert set(ports) == {"prefill", "decode"}, up.logs()
        yield {"router": up.url, **{k: f"http://127.0.0.1:{v}" for k, v in ports.items()}}


@pytest.fixture(scope="module")
def operator_metrics(cluster, chart_release, tmp_path_factory):  # noqa: F811
    """`pdserve operator --metrics` as the chart's ServiceAccount, reconciling the P/D example and the autoscaled
    example, whose kwok pods serve real runtime metrics under load (FakePods) so that the autoscaler scrapes them and
    scales both pools up; yields the url once it has decided."""
    token = cluster.kubectl("create", "token", RELEASE, "-n", chart_release, "--duration", "1h").stdout.strip()
    d = tmp_path_factory.mktemp("operator")
    kubeconfig = write_kubeconfig(d / "kubeconfig", cluster.server, cluster.workdir / "ca.crt", token)
    port = free_port()
    log = d / "operator.log"
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "operator", "--liveness", "none",
                             "--metrics", f"127.0.0.1:{port}", "--resync-seconds", "5",
                             "--autoscale-tick-seconds", "0.5"],
                            cwd=d, env={**os.environ, "KUBECONFIG": str(kubeconfig)}, stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        ns = cluster.create_namespace("obs-live")
        cluster.kubectl("apply", "-n", ns, "-f", str(EXAMPLE))
        url = f"http://127.0.0.1:{port}/metrics"

        def reconciled() -> bool:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                return 'pdserve_operator_pool_replicas{' in httpx.get(url, timeout=2).text
            except httpx.HTTPError:
                return False
        cluster.wait_for(reconciled, 120, "operator metrics with pool replicas")
        auto = yaml.safe_load(AUTOSCALED.read_text())
        # Short rounds so the autoscaler decides within the test (the example's are production-sized).
        auto["spec"]["autoscaling"].update(intervalSeconds=1, windowSeconds=3)
        for role in ("prefill", "decode"):
            auto["spec"]["autoscaling"][role]["maxReplicas"] = 2
        cluster.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(auto))
        with FakePods(cluster, ns, auto["metadata"]["name"]) as pods:
            pods.load.update(prefill="busy", decode="busy")  # slow TTFT and ITL: both pools scale up

            def decided() -> bool:
                assert proc.poll() is None, log.read_text()[-3000:]
                text = httpx.get(url, timeout=2).text
                return all(f"{m}{{" in text for m in ("pdserve_operator_autoscale_decisions_total",
                                                       "pdserve_operator_autoscale_ttft_p90_seconds",
                                                       "pdserve_operator_autoscale_itl_p90_seconds"))
            cluster.wait_for(decided, 120, "autoscaler decisions and inputs in the operator metrics")
            yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def prometheus(stack, operator_metrics, tmp_path_factory):
    exe = shutil.which("prometheus")
    if exe is None:
        pytest.skip("prometheus missing: `make system-deps` installs Debian's prometheus")
    d = tmp_path_factory.mktemp("prometheus")
    common = {"namespace": "obs-test", "isvc": "local"}

    def target(url: str, pool: str, pod: str) -> dict:
        return {"targets": [url.removeprefix("http://").split("/")[0]], "labels": {**common, "pool": pool, "pod": pod}}

    op_host = operator_metrics.removeprefix("http://").split("/")[0]
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(promql.RULES)],
        "scrape_configs": [
            {"job_name": "pods", "static_configs": [target(stack["prefill"], "prefill", "prefill-0"),
                                                    target(stack["decode"], "decode", "decode-0")]},
            # honor_labels as the chart's router and operator PodMonitors: their own `role`/`endpoint`/`namespace`
            # labels describe other objects.
            {"job_name": "router", "honor_labels": True,
             "static_configs": [target(stack["router"], "router", "router-0")]},
            {"job_name": "operator", "honor_labels": True,
             "static_configs": [{"targets": [op_host],
                                 "labels": {"namespace": "pdserve-system", "pod": "operator-0"}}]},
        ]}
    (d / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    cmd = [exe, f"--config.file={d / 'prometheus.yml'}", f"--storage.tsdb.path={d / 'data'}",
           f"--web.listen-address=127.0.0.1:{port}"]
    with launch_process(cmd, port, health_path="/-/ready", timeout=120) as prom:
        yield prom.url


def query(prom: str, expr: str) -> list[dict]:
    r = httpx.get(f"{prom}/api/v1/query", params={"query": expr}, timeout=30)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", (expr, body)
    return body["data"]["result"]


def traffic(stack: dict) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=stack["router"] + "/v1", api_key="unused", timeout=120, max_retries=0)
    model = client.models.list().data[0].id
    prompt = "Name three rivers of Europe and say one thing about each of them."
    for i in range(3):  # the same prompt: the second and third find it cached on the decode pod
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}], max_tokens=8,
                                       temperature=0)
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Count to ten."}],
                                            max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    client.completions.create(model=model, prompt="The capital of France is", max_tokens=4, temperature=0)
    bad = httpx.post(stack["router"] + "/v1/chat/completions", content=b"{not json", timeout=30)
    assert bad.status_code == 400


def test_every_dashboard_and_rule_expression_returns_data(stack, prometheus):
    traffic(stack)
    prom = prometheus
    exprs = promql.dashboard_exprs() + promql.rule_exprs()
    pd = [p for p in promql.dashboard_exprs() if "pd_decisions" in p.expr]
    assert pd, "the P/D dashboard reads the router's P/D decisions"

    # Wait until the post-traffic scrapes and a rule evaluation happened, then evaluate everything at once
    # (rate windows are 1m: all of it stays inside them).
    def scraped() -> bool:
        return bool(query(prom, 'pdserve_router_pd_decisions_total{decision="disaggregated"} > 0')) and \
            bool(query(prom, "pdserve:ttft_slo_bad_ratio:rate5m")) and \
            bool(query(prom, 'pdserve_router_requests_total{outcome="bad_request"} > 0'))
    deadline = time.monotonic() + 60
    while not scraped():
        assert time.monotonic() < deadline, "Prometheus never saw the traffic"
        time.sleep(1)
    time.sleep(3)

    names = set(httpx.get(f"{prom}/api/v1/label/__name__/values", timeout=30).json()["data"])
    empty, unknown = [], []
    for e in exprs:
        probes = promql.alert_probes(e.expr) if e.kind == "alert" else [promql.fill(e.expr)]
        for p in probes:
            if not query(prom, p):
                empty.append(f"{e.where}: {p}")
            unknown += [f"{e.where}: {n}" for n in promql.metric_names(p) if n not in names]
    for dash, metric, label in promql.template_queries():
        if not [r for r in query(prom, f"count by ({label}) ({metric})") if r["metric"].get(label)]:
            empty.append(f"{dash}: variable {label} from {metric}")
        if metric not in names:
            unknown.append(f"{dash}: variable metric {metric}")
    assert not unknown, "metric names that Prometheus never scraped (typos?):\n" + "\n".join(unknown)
    assert not empty, "expressions without data:\n" + "\n".join(empty)

    # The P/D request really went through prefill and the KV transfer: the handoff panels show non-zero values.
    assert float(query(prom, 'sum(pdserve_router_pd_decisions_total{decision="disaggregated"})')[0]["value"][1]) >= 3
    assert float(query(prom, "sum(pdserve:kv_connector_loads_total)")[0]["value"][1]) >= 1
    info = query(prom, "pdserve:kv_connector_info")
    assert {r["metric"]["connector"] for r in info} == {"nixl"}
    # The autoscaler really decided: the decisions panel counts scale-ups of the autoscaled example.
    up = query(prom, 'sum(pdserve_operator_autoscale_decisions_total{isvc="smollm2-auto",direction="up"})')
    assert up and float(up[0]["value"][1]) >= 1, up
