"""The Grafana dashboard over the gateway's and the replicas' Prometheus metrics.

One source: `dashboard()` builds the JSON; `modelship deploy render` writes it
(`grafana-dashboard.json`, and a ConfigMap labelled for Grafana's dashboard sidecar in
`monitoring.yaml`), and the Helm chart ships the same JSON (`files/grafana-dashboard.json`,
kept equal to this by a test). Every metric a panel queries is checked against live
`/metrics` scrapes in the tests, so a renamed series breaks a test, not a dashboard.

Rows: traffic and errors, latency (gateway TTFT and duration by release and variant,
replica TTFT and inter-token latency by variant), throughput and cost, engine (queue, KV
cache, prefix-cache hit rate), fleet (replicas, breakers, canary, drift). The engines'
load (queues, KV cache, prefix hits, tokens) is read from the gateway, which sums it over
the replicas (`modelship_gateway_replica_*`; `max by` over gateways, each of which sees
the whole fleet), so it shows where Prometheus reaches only the gateway (`modelship up`).
The replicas' histograms (TTFT, inter-token latency, queue time) and preemptions are read
from the replicas under the `engine` variable's prefix: `modelship:` for our engine,
`vllm:` for vLLM's (the names are the same).
"""

from __future__ import annotations

import json
import re
from typing import Any

Json = dict[str, Any]

UID = "modelship-serving"
CONFIGMAP_LABEL = {"grafana_dashboard": "1"}  # kube-prometheus-stack's sidecar looks for it
_GRID_WIDTH = 24
_PANEL_WIDTH, _PANEL_HEIGHT = 12, 8


def _quantiles(metric: str, by: str, qs: tuple[float, ...] = (0.5, 0.95, 0.99)) -> list[Json]:
    rate = f"sum by (le, {by}) (rate({metric}_bucket[$__rate_interval]))"
    legend = " ".join("{{" + label.strip() + "}}" for label in by.split(","))
    return [
        {"expr": f"histogram_quantile({q}, {rate})", "legendFormat": f"p{round(q * 100)} {legend}"}
        for q in qs
    ]


def _target(expr: str, legend: str) -> Json:
    return {"expr": expr, "legendFormat": legend}


# (row title, [(panel title, unit, targets)])
_ROWS: list[tuple[str, list[tuple[str, str, list[Json]]]]] = [
    ("Traffic and errors", [
        ("Requests by status", "reqps", [_target(
            "sum by (status) (rate(modelship_gateway_requests_total[$__rate_interval]))",
            "{{status}}")]),
        ("Error share (5xx)", "percentunit", [_target(
            'sum(rate(modelship_gateway_requests_total{status=~"5.."}[$__rate_interval])) / '
            "sum(rate(modelship_gateway_requests_total[$__rate_interval]))", "5xx")]),
        ("Refused before routing", "reqps", [_target(
            "sum by (reason) (rate(modelship_gateway_rejections_total[$__rate_interval]))",
            "{{reason}}")]),
        ("Tier decisions (brown-out, rules)", "reqps", [_target(
            "sum by (tier, reason) (rate(modelship_gateway_tier_decisions_total"
            "[$__rate_interval]))", "{{tier}} {{reason}}")]),
        ("Retries and upstream failures", "ops", [
            _target("sum by (kind) (rate(modelship_gateway_retries_total[$__rate_interval]))",
                    "retry {{kind}}"),
            _target("sum by (kind) (rate(modelship_gateway_upstream_failures_total"
                    "[$__rate_interval]))", "failure {{kind}}"),
        ]),
    ]),
    ("Latency", [
        ("Gateway TTFT by release and variant", "s",
         _quantiles("modelship_gateway_time_to_first_token_seconds", "release, variant")),
        ("Gateway request duration by release and variant", "s",
         _quantiles("modelship_gateway_request_duration_seconds", "release, variant", (0.5, 0.95))),
        ("Replica TTFT by variant", "s",
         _quantiles("${engine}time_to_first_token_seconds", "variant")),
        ("Replica inter-token latency by variant", "s",
         _quantiles("${engine}inter_token_latency_seconds", "variant")),
    ]),
    ("Throughput and cost", [
        ("Output tokens/s by variant", "short", [_target(
            'sum by (variant) (rate(modelship_gateway_tokens_total{kind="output"}'
            "[$__rate_interval]))", "{{variant}}")]),
        ("Replica tokens/s (prompt, generated)", "short", [
            _target("max by (variant) (rate(modelship_gateway_replica_prompt_tokens_total"
                    "[$__rate_interval]))", "prompt {{variant}}"),
            _target("max by (variant) (rate(modelship_gateway_replica_generation_tokens_total"
                    "[$__rate_interval]))", "generated {{variant}}"),
        ]),
        ("Cost per hour by tenant", "currencyUSD", [_target(
            "sum by (tenant) (rate(modelship_gateway_cost_total[$__rate_interval])) * 3600",
            "{{tenant}}")]),
        ("Cost per hour by variant", "currencyUSD", [_target(
            "sum by (variant) (rate(modelship_gateway_cost_total[$__rate_interval])) * 3600",
            "{{variant}}")]),
    ]),
    ("Engine", [
        ("Queue: gateway (by priority) and replicas", "short", [
            _target("sum by (priority) (modelship_gateway_queue_length)", "gateway {{priority}}"),
            _target("max by (variant) (modelship_gateway_replica_num_requests_waiting)",
                    "waiting {{variant}}"),
            _target("max by (variant) (modelship_gateway_replica_num_requests_running)",
                    "running {{variant}}"),
        ]),
        ("KV cache usage", "percentunit", [_target(
            "max by (variant) (modelship_gateway_replica_kv_cache_usage_perc)", "{{variant}}")]),
        ("Prefix-cache hit rate (tokens)", "percentunit", [_target(
            "max by (variant) (rate(modelship_gateway_replica_prefix_cache_hits_total"
            "[$__rate_interval])) / max by (variant) (rate("
            "modelship_gateway_replica_prefix_cache_queries_total[$__rate_interval]))",
            "{{variant}}")]),
        ("Preemptions and queue time", "short", [
            _target("sum by (variant) (rate(${engine}num_preemptions_total[$__rate_interval]))",
                    "preemptions/s {{variant}}"),
            *_quantiles("${engine}request_queue_time_seconds", "variant", (0.95,)),
        ]),
    ]),
    ("Fleet", [
        ("Replicas by track and state", "short", [
            _target("sum by (track, state) (modelship_gateway_replicas)", "{{track}} {{state}}"),
            _target("sum by (track) (modelship_gateway_replicas_desired)", "desired {{track}}"),
        ]),
        ("Circuit breakers open", "short", [_target(
            'sum by (release) (modelship_gateway_breaker_state{state="open"})',
            "open {{release}}")]),
        ("Canary weight and rollbacks", "short", [
            _target("max(modelship_gateway_canary_weight)", "weight %"),
            _target("sum by (release) (increase(modelship_gateway_canary_rollbacks_total[1h]))",
                    "rollbacks/h {{release}}"),
        ]),
        ("Quality drift: golden agreement", "percentunit", [
            _target("min by (release, variant) (modelship_gateway_drift_agreement)",
                    "{{release}} {{variant}}"),
            _target("max by (release) (modelship_gateway_drift_alert)", "alert {{release}}"),
        ]),
    ]),
]  # fmt: skip


def dashboard() -> Json:
    """The dashboard JSON (Grafana 10+, a Prometheus data source chosen by variable)."""
    panels: list[Json] = []
    y = 0
    panel_id = 1
    for row_title, row_panels in _ROWS:
        grid = {"h": 1, "w": _GRID_WIDTH, "x": 0, "y": y}
        panels.append(
            {"id": panel_id, "type": "row", "title": row_title, "collapsed": False,
             "gridPos": grid, "panels": []}
        )  # fmt: skip
        panel_id += 1
        y += 1
        for i, (title, unit, targets) in enumerate(row_panels):
            x = (i % 2) * _PANEL_WIDTH
            if i and i % 2 == 0:
                y += _PANEL_HEIGHT
            panels.append(
                {
                    "id": panel_id,
                    "type": "timeseries",
                    "title": title,
                    "datasource": {"type": "prometheus", "uid": "${datasource}"},
                    "gridPos": {"h": _PANEL_HEIGHT, "w": _PANEL_WIDTH, "x": x, "y": y},
                    "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                    "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
                    "targets": [
                        {**target, "refId": chr(ord("A") + n)} for n, target in enumerate(targets)
                    ],
                }
            )
            panel_id += 1
        y += _PANEL_HEIGHT
    return {
        "uid": UID,
        "title": "modelship serving",
        "tags": ["modelship", "llm"],
        "timezone": "utc",
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "type": "datasource",
                    "query": "prometheus",
                    "label": "Prometheus",
                },
                {  # the replicas' metric prefix: our engine's, or vLLM's (same names)
                    "name": "engine",
                    "type": "custom",
                    "query": "modelship:,vllm:",
                    "current": {"text": "modelship:", "value": "modelship:"},
                    "label": "engine metrics",
                },
            ]
        },
        "panels": panels,
    }


def dashboard_json() -> str:
    """The dashboard as the file `deploy render` writes and the Helm chart ships."""
    return json.dumps(dashboard(), indent=2, sort_keys=True) + "\n"


def dashboard_configmap(name: str, namespace: str, labels: dict[str, str]) -> Json:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": f"{name}-grafana-dashboard",
            "namespace": namespace,
            "labels": {**labels, **CONFIGMAP_LABEL},
        },
        "data": {"modelship-serving.json": dashboard_json()},
    }


_METRIC = re.compile(r"\bmodelship(?:_gateway_|:)[a-z_]+")


def queried_metrics(dash: Json) -> set[str]:
    """Every series name a panel's queries read (as exposed: `_bucket`, `_total`...)."""
    names = set()
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            names.update(_METRIC.findall(target["expr"].replace("${engine}", "modelship:")))
    return names


if __name__ == "__main__":  # refresh the chart's copy after changing a panel
    from pathlib import Path

    chart = Path(__file__).parents[3] / "deploy" / "helm" / "modelship" / "files"
    (chart / "grafana-dashboard.json").write_text(dashboard_json())
