"""Monitoring: every PromQL expression (Grafana dashboard, alert rules) names only metrics
docs/metrics.md documents; the alerts and panels the operators asked for exist; the PodMonitor
scrapes the gateway's port with a token the build provides."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from tests.k8s.manifests import (
    K8S,
    METRICS_DOC,
    Obj,
    base_metric,
    build,
    dashboard_exprs,
    documented_metrics,
    of_kind,
    one,
    promql_metrics,
    template,
)

pytestmark = pytest.mark.timeout(120)

DASHBOARD = K8S / "monitoring" / "dashboards" / "baton.json"
REQUIRED_ALERTS = {
    "BatonPrefixCacheHitRateCollapse",
    "BatonKVTransferFailures",
    "BatonKVPairUnroutable",
    "BatonQueueGrowing",
    "BatonWorkerDown",
    "BatonKVReservedPagesNotReturning",
    "BatonKVPagesHeldAtIdle",
}
# what the dashboard must show, by the families that show it
REQUIRED_VIEWS = {
    "prefix-cache hit rate per node and tier": {
        "baton_node_prefix_hit_tokens_total",
        "baton_node_prefix_query_tokens_total",
    },
    "running and waiting per node": {"baton_node_requests"},
    "KV usage per tier": {"baton_node_kv_pages"},
    "transfer rates and failures": {
        "baton_kv_transfers_total",
        "baton_kv_transfer_bytes_total",
        "baton_kv_transfer_failures_total",
    },
    "unroutable KV pairs": {"baton_kv_pair_unroutable", "baton_kv_pair_failures_total"},
    "TTFT and ITL": {"baton_ttft_seconds_bucket", "baton_itl_seconds_bucket"},
    "requests by outcome": {"baton_requests_total"},
    "locality given up": {"baton_placement_locality_given_up_pages_total"},
}


@pytest.fixture(scope="module")
def monitoring() -> list[Obj]:
    return build("monitoring")


@pytest.fixture(scope="module")
def dashboard() -> Obj:
    loaded: Obj = json.loads(DASHBOARD.read_text())
    return loaded


def _rules(objects: list[Obj]) -> list[Obj]:
    return [r for g in one(objects, "PrometheusRule")["spec"]["groups"] for r in g["rules"]]


def _all_exprs(monitoring: list[Obj], dashboard: Obj) -> list[tuple[str, str]]:
    rules = [(f"alert {r['alert']}", r["expr"]) for r in _rules(monitoring)]
    return rules + [(f"panel {title}", expr) for title, expr in dashboard_exprs(dashboard)]


def test_every_promql_metric_is_documented(monitoring: list[Obj], dashboard: Obj) -> None:
    if not METRICS_DOC.exists():
        pytest.skip(
            f"{METRICS_DOC.relative_to(K8S.parent)} does not exist yet: the metric names cannot be checked"
        )
    documented = documented_metrics()
    assert len(documented) >= 10, f"{METRICS_DOC}: found only {sorted(documented)} in its tables"
    unknown = [(where, name) for where, expr in _all_exprs(monitoring, dashboard)
               for name in sorted(promql_metrics(expr)) if base_metric(name, documented) not in documented]  # fmt: skip
    assert not unknown, "metrics not in docs/metrics.md:\n" + "\n".join(
        f"{w}: {n}" for w, n in unknown
    )


def test_every_expression_names_a_baton_metric(monitoring: list[Obj], dashboard: Obj) -> None:
    """Holds without docs/metrics.md: no expression is a typo that selects nothing at all."""
    for where, expr in _all_exprs(monitoring, dashboard):
        names = promql_metrics(expr)
        assert names and all(n.startswith("baton_") for n in names), f"{where}: {sorted(names)}"


def test_the_metric_table_parser(tmp_path: Path) -> None:
    doc = tmp_path / "metrics.md"
    doc.write_text(
        "# Metrics\n\n| metric | type | what |\n|---|---|---|\n"
        "| `baton_requests_total{api,outcome}` | counter | requests |\n"
        "| `baton_ttft_seconds`, `baton_itl_seconds` | histogram | latency |\n"
        "| not a name | | `baton_in_a_later_column` |\n"
    )
    documented = documented_metrics(doc)
    assert documented == {"baton_requests_total", "baton_ttft_seconds", "baton_itl_seconds"}
    assert base_metric("baton_ttft_seconds_bucket", documented) == "baton_ttft_seconds"
    assert base_metric("baton_unknown_count", documented) == "baton_unknown_count"


def test_the_promql_lexer() -> None:
    expr = (
        'sum by (node, tier) (rate(baton_a_total{node=~"$node", x="y z"}[$__rate_interval]))\n'
        "  / on (node) group_left sum(rate(baton_b_total[5m] offset 1h)) > 1e3\n"
        "and on() (max_over_time(baton_c[15m:1m]) == 0) or absent(baton_d) unless histogram_quantile(0.99, baton_e_bucket)"
    )
    assert promql_metrics(expr) == {
        "baton_a_total",
        "baton_b_total",
        "baton_c",
        "baton_d",
        "baton_e_bucket",
    }


def test_required_alerts_exist_and_are_complete(monitoring: list[Obj]) -> None:
    rules = {r["alert"]: r for r in _rules(monitoring)}
    assert REQUIRED_ALERTS <= set(rules)
    for name, rule in rules.items():
        assert rule["labels"]["severity"] in ("critical", "warning", "info"), name
        assert rule["annotations"]["summary"], name


def test_dashboard_shows_every_required_view(dashboard: Obj) -> None:
    exprs = dashboard_exprs(dashboard)
    shown = set().union(*(promql_metrics(e) for _, e in exprs))
    for view, families in REQUIRED_VIEWS.items():
        assert families <= shown, f"the dashboard has no {view} panel"
    hit = [
        e for _, e in exprs if "baton_node_prefix_hit_tokens_total" in e and "by (node, tier)" in e
    ]
    assert hit, "hit rate by node and tier"
    for family in ("baton_ttft_seconds_bucket", "baton_itl_seconds_bucket"):
        quantiles = {
            q
            for _, e in exprs
            if family in e
            for q in ("0.5", "0.99")
            if f"histogram_quantile({q}," in e
        }
        assert quantiles == {"0.5", "0.99"}, f"{family}: p50 and p99"
    assert dashboard["uid"] and any(
        v["type"] == "datasource" for v in dashboard["templating"]["list"]
    )


def test_dashboard_configmap_is_labelled_for_the_grafana_sidecar(monitoring: list[Obj]) -> None:
    cm = [c for c in of_kind(monitoring, "ConfigMap") if "baton.json" in c.get("data", {})]
    assert len(cm) == 1
    assert cm[0]["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm[0]["data"]["baton.json"] == DASHBOARD.read_text()


def test_podmonitor_scrapes_the_gateway(builds: dict[str, list[Obj]]) -> None:
    objects = builds["overlays/gpu"]
    pm = one(objects, "PodMonitor")
    head = template(objects, "head")
    assert all(head.labels.get(k) == v for k, v in pm["spec"]["selector"]["matchLabels"].items())
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics"
    assert endpoint["port"] in {p["name"] for p in head.container("gateway")["ports"]}
    cred = endpoint["authorization"]["credentials"]
    assert cred["key"] in one(objects, "Secret", cred["name"])["data"]
    # ...with a key that can only read: an operator key here could drain production
    token = base64.b64decode(one(objects, "Secret", cred["name"])["data"][cred["key"]]).decode()
    keys_text = base64.b64decode(one(objects, "Secret", "baton-api-keys")["data"]["api_keys.txt"]).decode()
    role = next(dict(o.split("=", 1) for o in line.split()[2:] if "=" in o).get("role", "tenant")
                for line in keys_text.splitlines() if line.split()[:1] == [token])  # fmt: skip
    assert role == "metrics", f"the PodMonitor scrapes with a role={role} key"
    # ...and the NetworkPolicies let Prometheus in on that port
    rules = [r for np in of_kind(objects, "NetworkPolicy") for r in np["spec"].get("ingress", [])
             if any("namespaceSelector" in p for p in r.get("from", []))]  # fmt: skip
    assert any(p["port"] == 8000 for r in rules for p in r["ports"])
