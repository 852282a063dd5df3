"""The chart's dashboards, alert rules and PodMonitors, checked without a running stack: dashboards are generated (no
drift), valid JSON with unique panel ids; `promtool check rules` passes; `helm template` renders ConfigMaps,
PrometheusRule and PodMonitors only when switched on, with the exact files and the target labels the queries use.
(tests/observability/test_prometheus_live.py evaluates every expression against a running stack.)"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import yaml

from tests.observability import promql
from tests.operator.kubeenv import bin_dir

ON = ["--set", "dashboards.enabled=true", "--set", "prometheusRules.enabled=true",
      "--set", "serviceMonitors.enabled=true"]


@pytest.fixture(scope="module")
def helm() -> str:
    return str(bin_dir() / "helm")


def template(helm: str, *args: str) -> list[dict]:
    out = subprocess.run([helm, "template", "rel", str(promql.CHART), "--namespace", "ops", *args],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and not out.stderr.strip(), out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def test_dashboards_are_generated_valid_and_have_unique_ids():
    out = subprocess.run([sys.executable, str(promql.REPO / "scripts" / "gen_dashboards.py"), "--check"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert {p.name for p in promql.DASHBOARDS} == {"overview.json", "kv-cache.json", "pd-handoff.json", "router.json",
                                                  "operator.json"}
    uids = set()
    for path in promql.DASHBOARDS:
        d = json.loads(path.read_text())
        ids = [p["id"] for p in d["panels"]]
        assert len(ids) == len(set(ids)) and ids, path.name
        assert d["uid"] not in uids
        uids.add(d["uid"])
        for p in d["panels"]:
            assert p["targets"] and all(t["expr"].strip() for t in p["targets"]), (path.name, p["title"])
            refs = [t["refId"] for t in p["targets"]]
            assert len(refs) == len(set(refs))


def test_alert_rules_pass_promtool():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool missing: `make system-deps` installs Debian's prometheus")
    out = subprocess.run([promtool, "check", "rules", str(promql.RULES)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    alerts = {e.where.split()[1] for e in promql.rule_exprs() if e.kind == "alert"}
    # The list: error rate, TTFT SLO burn, KV load failures, circuit breakers open, pods not ready.
    assert {"PdserveHighErrorRate", "PdserveTTFTSLOBurn", "PdserveKVLoadFailures", "PdserveCircuitBreakerOpen",
            "PdservePodsNotReady"} <= alerts
    readme = (promql.CHART / "README.md").read_text().lower()
    assert all(f"### {a.lower()}" in readme for a in alerts), "every alert needs a runbook section"


def test_alert_probe_rewrites_thresholds():
    assert promql.alert_probes('sum(x{a!="b"}) > 0.05') == ['sum(x{a!="b"}) > bool 0.05']
    assert promql.alert_probes("a > 1 and b >= bool 2") == ["a > bool 1", "b >= bool 2"]
    assert promql.alert_probes("(a or b * 0) > 0") == ["(a or b * 0) > bool 0"]
    assert promql.metric_names('sum by (pod) (rate(x_total{le="1"}[1m]) * on (pod) group_left (c) y) / z:w') == \
        {"x_total", "y", "z:w"}


def test_default_values_render_no_monitoring_objects(helm):
    kinds = {d["kind"] for d in template(helm)}
    assert not kinds & {"PrometheusRule", "PodMonitor"}
    assert not any(d["kind"] == "ConfigMap" and "dashboard" in d["metadata"]["name"] for d in template(helm))


def test_monitoring_objects_render_when_enabled(helm):
    docs = template(helm, *ON, "--set", "prometheusRules.labels.release=kps")
    maps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
    for path in promql.DASHBOARDS:
        cm = maps[f"rel-pdserve-dashboard-{path.stem}"]
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1" and cm["metadata"]["namespace"] == "ops"
        assert json.loads(cm["data"][f"pdserve-{path.stem}.json"]) == json.loads(path.read_text())
    rule = next(d for d in docs if d["kind"] == "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "kps"
    assert rule["spec"] == yaml.safe_load(promql.RULES.read_text())
    monitors = {d["metadata"]["name"]: d for d in docs if d["kind"] == "PodMonitor"}
    assert set(monitors) == {"rel-pdserve-runtime", "rel-pdserve-router", "rel-pdserve-operator"}
    for kind in ("runtime", "router"):
        m = monitors[f"rel-pdserve-{kind}"]
        assert m["spec"]["namespaceSelector"] == {"any": True}
        assert m["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == kind
        ep = m["spec"]["podMetricsEndpoints"][0]
        assert ep["port"] == "http" and ep["path"] == "/metrics" and ep["honorLabels"] is (kind == "router")
        # The labels every dashboard and alert groups by (see scripts/gen_dashboards.py).
        assert {r["targetLabel"]: r["sourceLabels"] for r in ep["relabelings"]} == {
            "isvc": ["__meta_kubernetes_pod_label_app_kubernetes_io_instance"],
            "pool": ["__meta_kubernetes_pod_label_pdserve_dev_role"]}
    op = next(d for d in docs if d["kind"] == "Deployment")
    c = op["spec"]["template"]["spec"]["containers"][0]
    assert "--metrics=0.0.0.0:8082" in c["args"] and {"name": "metrics", "containerPort": 8082} in c["ports"]
    assert monitors["rel-pdserve-operator"]["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"


def test_pod_labels_match_the_podmonitor_selectors():
    from pdserve.operator import names

    for role in ("prefill", "decode", "both", "router"):
        labels = names.pod_labels("x", role)
        assert labels[names.COMPONENT_LABEL] == ("router" if role == "router" else "runtime")
        assert labels[names.NAME_LABEL] == "pdserve" and labels[names.ROLE_LABEL] == role
        assert labels[names.INSTANCE_LABEL] == "x"


def test_tracing_value_reaches_every_pod_through_the_operator(helm, monkeypatch):
    docs = template(helm, "--set", "tracing.otlpTracesEndpoint=http://otel.obs:4317", "--set", "tracing.protocol=grpc")
    c = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env == {"PDSERVE_POD_OTLP_TRACES_ENDPOINT": "http://otel.obs:4317",
                   "PDSERVE_POD_OTLP_TRACES_PROTOCOL": "grpc"}
    assert "env" not in next(d for d in template(helm) if d["kind"] == "Deployment")["spec"]["template"]["spec"][
        "containers"][0]

    from pdserve.operator import configmap

    plain = configmap.shared_env()
    assert not any(k.startswith("OTEL_") for k in plain)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert configmap.shared_env() == {**plain, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://otel.obs:4317",
                                      "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"}
    # A changed ConfigMap changes the pods' config-hash annotation, so turning tracing on rolls them.
    assert configmap.config_hash(plain) != configmap.config_hash(configmap.shared_env())
