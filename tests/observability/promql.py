"""The PromQL the chart ships (every dashboard target, template variable and rule), and the small text transforms the
tests need to evaluate it: Grafana variables filled in, alert thresholds turned into ``bool`` comparisons (so a rule
that is not firing still returns its series), and the metric names an expression reads."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "pdserve"
DASHBOARDS = sorted((CHART / "dashboards").glob("*.json"))
RULES = CHART / "files" / "prometheus-rules.yaml"
GRAFANA_VARS = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "5m", "$namespace": ".*", "$isvc": ".*"}

# Words of PromQL that are not metric names (functions, aggregations, keywords).
KEYWORDS = {"sum", "min", "max", "avg", "count", "stddev", "stdvar", "topk", "bottomk", "quantile", "count_values",
            "group", "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool",
            "offset", "rate", "irate", "increase", "delta", "idelta", "deriv", "histogram_quantile", "vector",
            "scalar", "clamp_min", "clamp_max", "abs", "absent", "label_replace", "time", "avg_over_time",
            "max_over_time", "min_over_time", "sum_over_time", "count_over_time", "inf", "nan", "humanize"}


@dataclass(frozen=True)
class Expr:
    where: str      # "overview.json: panel 3 'Time to first token' A", "rule PdserveHighErrorRate", ...
    expr: str       # as shipped
    kind: str       # "panel" | "record" | "alert"


def dashboard_exprs() -> list[Expr]:
    out = []
    for path in DASHBOARDS:
        d = json.loads(path.read_text())
        for p in d["panels"]:
            for t in p["targets"]:
                out.append(Expr(f"{path.name}: panel {p['id']} {p['title']!r} {t['refId']}", t["expr"], "panel"))
    return out


def template_queries() -> list[tuple[str, str, str]]:
    """(dashboard, metric, label) of every ``label_values(metric{...}, label)`` variable."""
    out = []
    for path in DASHBOARDS:
        for v in json.loads(path.read_text())["templating"]["list"]:
            m = re.fullmatch(r"label_values\(([a-zA-Z_:][\w:]*)(\{[^}]*\})?, *(\w+)\)", v.get("query") or "")
            if v["type"] == "query":
                assert m, f"{path.name}: variable {v['name']} has an unexpected query {v.get('query')!r}"
                out.append((path.name, m.group(1), m.group(3)))
    return out


def rule_exprs() -> list[Expr]:
    out = []
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for r in group["rules"]:
            if "record" in r:
                out.append(Expr(f"record {r['record']}", r["expr"], "record"))
            else:
                out.append(Expr(f"alert {r['alert']}", r["expr"], "alert"))
    return out


def fill(expr: str) -> str:
    for k in sorted(GRAFANA_VARS, key=len, reverse=True):
        expr = expr.replace(k, GRAFANA_VARS[k])
    return expr


def _top_level(expr: str) -> list[tuple[int, str]]:
    """(index, char) of the characters outside (), {}, [] and quotes."""
    out, depth, quote = [], 0, None
    for i, c in enumerate(expr):
        if quote:
            quote = None if c == quote and expr[i - 1] != "\\" else quote
        elif c in "\"'`":
            quote = c
        elif c in "({[":
            depth += 1
        elif c in ")}]":
            depth -= 1
        elif depth == 0:
            out.append((i, c))
    return out


def alert_probes(expr: str) -> list[str]:
    """The expressions to evaluate for an alert: each operand of a top-level ``and``/``unless``, with its top-level
    comparison made ``bool`` (it then returns every series it compares, firing or not)."""
    top = "".join(c if (i, c) in set(_top_level(expr)) else "#" for i, c in enumerate(expr))
    cuts = [m.start() for m in re.finditer(r"\s(and|unless)\s", top)]
    parts, start = [], 0
    for cut in cuts:
        parts.append(expr[start:cut])
        start = cut + len(re.match(r"\s(and|unless)\s", top[cut:]).group(0))
    parts.append(expr[start:])
    probes = []
    for part in parts:
        top = [(i, c) for i, c in _top_level(part)]
        ops = [i for j, (i, c) in enumerate(top)
               if c in "<>" or (c in "=!" and j + 1 < len(top) and top[j + 1][1] == "=")]
        assert ops, f"alert operand without a top-level comparison: {part!r}"
        i = ops[-1]
        end = i + (2 if part[i + 1:i + 2] == "=" else 1)
        probes.append(part if part[end:].lstrip().startswith("bool") else f"{part[:end]} bool{part[end:]}")
    return probes


def metric_names(expr: str) -> set[str]:
    """Metric names an expression reads: identifiers outside label matchers, ranges, strings and label lists."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    s = re.sub(r"\{[^}]*\}", " ", s)
    s = re.sub(r"\[[^\]]*\]", " ", s)
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    names = set(re.findall(r"(?<![\w:.])([a-zA-Z_:][\w:]*)", s))
    return {n for n in names if n.lower() not in KEYWORDS and not re.fullmatch(r"\d.*", n)}
