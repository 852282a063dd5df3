"""Generate the Grafana dashboards under charts/pdserve/dashboards/ (one source of truth: the panel lists below).

    python scripts/gen_dashboards.py          # rewrite the JSON files
    python scripts/gen_dashboards.py --check  # exit 1 if a file differs (tests/observability runs this)

Target labels every query relies on (set by the chart's PodMonitors, and by tests/observability's scrape config):
``namespace``, ``pod``, ``isvc`` (the InferenceService, from ``app.kubernetes.io/instance``) and ``pool`` (prefill |
decode | both | router, from ``pdserve.dev/role``). ``pool``, not ``role``: the router's own metrics carry a ``role``
label (the role of the pod they are about).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "charts" / "pdserve" / "dashboards"
S = 'namespace=~"$namespace",isvc=~"$isvc"'
R = "$__rate_interval"
QUANTILES = (0.5, 0.9, 0.99)
SERVER_ERRORS = "upstream_error|upstream_5xx|no_endpoint|timeout|rejected"
CONNECTOR = f"* on (namespace, pod) group_left (connector) pdserve:kv_connector_info{{{S}}}"


def q(expr: str, legend: str = "") -> dict:
    return {"expr": expr, "legendFormat": legend}


def quantiles(metric: str, by: str, sel: str = S, legend: str = "") -> list[dict]:
    return [q(f"histogram_quantile({p}, sum by (le, {by}) (rate({metric}_bucket{{{sel}}}[{R}])))",
              f"p{int(p * 100)} {legend or '{{' + by + '}}'}") for p in QUANTILES]


def per_connector(counter: str, by: str = "connector") -> str:
    return f"sum by ({by}) (rate({counter}{{{S}}}[{R}]) {CONNECTOR})"


OVERVIEW = ("pdserve-overview", "pdserve / Overview", [
    ("Router requests per second by outcome", "reqps",
     [q(f"sum by (outcome) (rate(pdserve_router_requests_total{{{S}}}[{R}]))", "{{outcome}}")]),
    ("Error ratio (router answers)", "percentunit",
     [q(f'sum(rate(pdserve_router_requests_total{{{S},outcome=~"{SERVER_ERRORS}"}}[{R}])) / '
        f"sum(rate(pdserve_router_requests_total{{{S}}}[{R}]))", "server errors"),
      q(f'sum(rate(pdserve_router_requests_total{{{S},outcome=~"bad_request|too_large|unauthorized|upstream_4xx"}}'
        f"[{R}])) / sum(rate(pdserve_router_requests_total{{{S}}}[{R}]))", "client errors")]),
    ("Finished requests per second by pool and reason", "reqps",
     [q(f"sum by (pool, finished_reason) (rate(vllm:request_success_total{{{S}}}[{R}]))",
        "{{pool}} {{finished_reason}}")]),
    ("Time to first token by pool", "s", quantiles("vllm:time_to_first_token_seconds", "pool")),
    ("Inter-token latency by pool", "s", quantiles("vllm:inter_token_latency_seconds", "pool")),
    ("End-to-end latency by pool", "s", quantiles("vllm:e2e_request_latency_seconds", "pool")),
    ("Token throughput by pool", "short",
     [q(f"sum by (pool) (rate(vllm:generation_tokens_total{{{S}}}[{R}]))", "generated {{pool}}"),
      q(f"sum by (pool) (rate(vllm:prompt_tokens_total{{{S}}}[{R}]))", "prompt computed {{pool}}")]),
    ("Requests running and waiting by pool", "short",
     [q(f"sum by (pool) (vllm:num_requests_running{{{S}}})", "running {{pool}}"),
      q(f"sum by (pool) (vllm:num_requests_waiting{{{S}}})", "waiting {{pool}}"),
      q(f"sum(pdserve_router_requests_in_flight{{{S}}})", "in flight at the router")]),
    ("Requests refused by the pods", "reqps",
     [q(f"sum by (pool, reason) (rate(pdserve:requests_rejected_total{{{S}}}[{R}]))", "{{pool}} {{reason}}"),
      q(f"sum by (pool) (rate(pdserve:requests_aborted_on_disconnect_total{{{S}}}[{R}]))",
        "{{pool}} client gone")]),
])

KV_CACHE = ("pdserve-kv-cache", "pdserve / KV cache and prefix hits", [
    ("KV cache usage by pod", "percentunit",
     [q(f"max by (pool, pod) (vllm:kv_cache_usage_perc{{{S}}})", "{{pool}} {{pod}}")]),
    ("Prefix cache hit ratio by pool (tokens)", "percentunit",
     [q(f"sum by (pool) (rate(vllm:prefix_cache_hits_total{{{S}}}[{R}])) / "
        f"sum by (pool) (rate(vllm:prefix_cache_queries_total{{{S}}}[{R}]))", "{{pool}}")]),
    ("Prefix hits on the chosen decode pod (router index)", "percentunit",
     [q(f"sum(rate(pdserve_router_prefix_hit_tokens_total{{{S}}}[{R}])) / "
        f"sum(rate(pdserve_router_prompt_tokens_total{{{S}}}[{R}]))", "hit ratio")]),
    ("Preemptions per second by pool", "short",
     [q(f"sum by (pool) (rate(vllm:num_preemptions_total{{{S}}}[{R}]))", "{{pool}}")]),
    ("Batch size by pool", "short", quantiles("pdserve:batch_size", "pool")),
    ("KV event batches per second", "short",
     [q(f"sum by (pool) (rate(pdserve:kv_event_batches_published_total{{{S}}}[{R}]))", "published {{pool}}"),
      q(f"sum by (source) (rate(pdserve_router_kv_event_batches_total{{{S}}}[{R}]))", "applied ({{source}})")]),
    ("Router prefix index size (block hashes)", "short",
     [q(f"sum by (pod) (pdserve_router_prefix_index_blocks{{{S}}})", "{{pod}}")]),
])

PD = ("pdserve-pd-handoff", "pdserve / Prefill-decode handoff", [
    ("P/D decisions per second", "reqps",
     [q(f"sum by (decision) (rate(pdserve_router_pd_decisions_total{{{S}}}[{R}]))", "{{decision}}")]),
    ("Prefill failures: what happened next", "reqps",
     [q(f"sum by (action) (rate(pdserve_router_pd_fallbacks_total{{{S}}}[{R}]))", "{{action}}")]),
    ("Prefill leg at the router (send to answer)", "s",
     quantiles("pdserve_router_upstream_duration_seconds", "role", f'{S},role="prefill"', "prefill")),
    ("KV transfer time, mean per load, by connector", "s",
     [q(f"{per_connector('pdserve:kv_connector_load_seconds_total')} / "
        f"{per_connector('pdserve:kv_connector_loads_total')}", "{{connector}}")]),
    ("KV bytes loaded per second by connector", "Bps",
     [q(per_connector("pdserve:kv_connector_bytes_loaded_total"), "{{connector}}")]),
    ("KV blocks loaded and failed per second by connector", "short",
     [q(per_connector("pdserve:kv_connector_blocks_loaded_total"), "loaded {{connector}}"),
      q(per_connector("pdserve:kv_connector_blocks_load_failed_total"), "failed {{connector}}")]),
    ("KV load failures by connector and kind", "short",
     [q(per_connector("pdserve:kv_connector_load_failures_total", "connector, kind"), "{{connector}} {{kind}}")]),
    ("Tokens recomputed after failed loads, by pool", "short",
     [q(f"sum by (pool) (rate(pdserve:recomputed_tokens_total{{{S}}}[{R}]))", "{{pool}}")]),
    ("NIXL leases held by prefill pods", "short",
     [q(f"sum by (pod) (pdserve:kv_connector_leases_active{{{S}}})", "{{pod}}")]),
])

ROUTER = ("pdserve-router", "pdserve / Router", [
    ("Routing decisions per second by pod", "reqps",
     [q(f"sum by (role, endpoint) (rate(pdserve_router_routing_decisions_total{{{S}}}[{R}]))",
        "{{role}} {{endpoint}}")]),
    ("Winning pod score by role", "short", quantiles("pdserve_router_winning_score", "role")),
    ("Upstream time to first byte by role", "s", quantiles("pdserve_router_upstream_first_byte_seconds", "role")),
    ("Retries per second by role", "short",
     [q(f"sum by (role) (rate(pdserve_router_retries_total{{{S}}}[{R}]))", "{{role}}")]),
    ("Upstream errors per second by role and kind", "short",
     [q(f"sum by (role, kind) (rate(pdserve_router_upstream_errors_total{{{S}}}[{R}]))", "{{role}} {{kind}}")]),
    ("Pods by state (router's view)", "short",
     [q(f"sum by (role, state) (pdserve_router_endpoints{{{S}}})", "{{role}} {{state}}")]),
    ("Open circuit breakers by role", "short",
     [q(f'sum by (role) (pdserve_router_endpoints{{{S},state=~"breaker_.*"}}) or '
        f"sum by (role) (pdserve_router_endpoints{{{S}}}) * 0", "{{role}}")]),
    ("Requests in flight by router pod", "short",
     [q(f"sum by (pod) (pdserve_router_requests_in_flight{{{S}}})", "{{pod}}")]),
    ("Prefix hit ratio since start by router pod", "percentunit",
     [q(f"max by (pod) (pdserve_router_prefix_hit_ratio{{{S}}})", "{{pod}}")]),
])

OS = 'namespace=~"$namespace",isvc=~"$isvc"'
OPERATOR = ("pdserve-operator", "pdserve / Operator", [
    ("Reconcile duration by kind", "s", quantiles("pdserve_operator_reconcile_duration_seconds", "kind", "")),
    ("Reconciles per second by kind and result", "short",
     [q(f"sum by (kind, result) (rate(pdserve_operator_reconciles_total[{R}]))", "{{kind}} {{result}}")]),
    ("Pool replicas: desired and ready", "short",
     [q(f"max by (namespace, isvc, role, state) (pdserve_operator_pool_replicas{{{OS}}})",
        "{{namespace}}/{{isvc}} {{role}} {{state}}")]),
    # The autoscaler (operator/autoscaler.py): what it decided, what it wants, and the pool inputs it decided on.
    ("Autoscaling decisions per second by pool and direction", "short",
     [q(f"sum by (namespace, isvc, role, direction) (rate(pdserve_operator_autoscale_decisions_total{{{OS}}}[{R}]))",
        "{{namespace}}/{{isvc}} {{role}} {{direction}}")]),
    ("Autoscaler: desired vs ready replicas", "short",
     [q(f"max by (namespace, isvc, role) (pdserve_operator_autoscale_desired_replicas{{{OS}}})",
        "{{namespace}}/{{isvc}} {{role}} desired"),
      q(f'max by (namespace, isvc, role) (pdserve_operator_pool_replicas{{{OS},state="ready"}}) '
        f"and on (namespace, isvc, role) pdserve_operator_autoscale_desired_replicas{{{OS}}}",
        "{{namespace}}/{{isvc}} {{role}} ready")]),
    ("Autoscaler input: TTFT and ITL p90 over the window", "s",
     [q(f"max by (namespace, isvc, role) (pdserve_operator_autoscale_ttft_p90_seconds{{{OS}}})",
        "{{namespace}}/{{isvc}} {{role}} TTFT p90"),
      q(f"max by (namespace, isvc, role) (pdserve_operator_autoscale_itl_p90_seconds{{{OS}}})",
        "{{namespace}}/{{isvc}} {{role}} ITL p90")]),
    ("Autoscaler input: uncached prompt tokens per second", "short",
     [q(f"max by (namespace, isvc, role) (pdserve_operator_autoscale_prompt_tokens_per_second{{{OS}}})",
        "{{namespace}}/{{isvc}} {{role}}")]),
    ("Autoscaler input: waiting requests per pod", "short",
     [q(f"max by (namespace, isvc, role) (pdserve_operator_autoscale_queue_depth{{{OS}}})",
        "{{namespace}}/{{isvc}} {{role}}")]),
    ("Autoscaler input: KV-cache usage per pod", "percentunit",
     [q(f"max by (namespace, isvc, role) (pdserve_operator_autoscale_kv_cache_usage{{{OS}}})",
        "{{namespace}}/{{isvc}} {{role}}")]),
])


def variables(source_metric: str) -> list[dict]:
    ds = {"type": "prometheus", "uid": "${datasource}"}

    def var(name: str, query: str) -> dict:
        return {"name": name, "label": name, "type": "query", "datasource": ds, "query": query,
                "definition": query, "refresh": 2, "includeAll": True, "multi": True, "allValue": ".*",
                "current": {"text": "All", "value": "$__all"}, "sort": 1}

    return [{"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
             "current": {}, "hide": 0},
            var("namespace", f"label_values({source_metric}, namespace)"),
            var("isvc", f'label_values({source_metric}{{namespace=~"$namespace"}}, isvc)')]


def dashboard(uid: str, title: str, panels: list, source_metric: str) -> dict:
    out = []
    for i, (ptitle, unit, targets) in enumerate(panels):
        out.append({
            "id": i + 1, "type": "timeseries", "title": ptitle,
            "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "fieldConfig": {"defaults": {"unit": unit, "custom": {"fillOpacity": 10}}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
            "targets": [{"refId": chr(ord("A") + j), "datasource": {"type": "prometheus", "uid": "${datasource}"},
                         **t} for j, t in enumerate(targets)]})
    return {"uid": uid, "title": title, "tags": ["pdserve"], "editable": True, "schemaVersion": 39,
            "time": {"from": "now-1h", "to": "now"}, "refresh": "30s", "timezone": "",
            "annotations": {"list": []}, "templating": {"list": variables(source_metric)}, "panels": out}


DASHBOARDS = {
    "overview.json": dashboard(*OVERVIEW, "vllm:num_requests_running"),
    "kv-cache.json": dashboard(*KV_CACHE, "vllm:num_requests_running"),
    "pd-handoff.json": dashboard(*PD, "vllm:num_requests_running"),
    "router.json": dashboard(*ROUTER, "pdserve_router_requests_in_flight"),
    "operator.json": dashboard(*OPERATOR, "pdserve_operator_pool_replicas"),
}


def render(d: dict) -> str:
    return json.dumps(d, indent=1, sort_keys=False) + "\n"


def main(argv: list[str]) -> int:
    stale = [name for name, d in DASHBOARDS.items()
             if not (OUT / name).is_file() or (OUT / name).read_text() != render(d)]
    if "--check" in argv:
        for name in stale:
            print(f"{OUT / name} is stale: run python scripts/gen_dashboards.py", file=sys.stderr)
        return 1 if stale else 0
    OUT.mkdir(parents=True, exist_ok=True)
    for name in stale:
        (OUT / name).write_text(render(DASHBOARDS[name]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
