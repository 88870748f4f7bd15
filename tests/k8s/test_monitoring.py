"""Monitoring: every PromQL expression (Grafana dashboard, alert and recording rules) names only
metrics docs/metrics.md documents (or Prometheus's own `up`, or a recording rule of the same
PrometheusRule); the alerts and panels the operators asked for exist; SLO alerts are
multiwindow, multi-burn-rate; nothing aggregates two baton clusters together (every rule keeps
`namespace` and `job`, the dashboard shows one cluster and every per-node panel honours
`$node`); dead targets are `up == 0` per job; every alert has a runbook line in k8s/README.md;
the PodMonitor scrapes the gateway with a read-only token, and Ray and etcd, under the jobs the
alerts name."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import pytest

from cluster.membership.etcd_member import METRICS_PORT
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
README = K8S / "README.md"
RUNBOOK_SECTION = "## Alerts and runbooks"
REQUIRED_ALERTS = {
    "BatonPrefixCacheHitRateCollapse",
    "BatonKVTransferFailures",
    "BatonKVPairUnroutable",
    "BatonQueueGrowing",
    "BatonWorkerDown",
    "BatonKVReservedPagesNotReturning",
    "BatonKVPagesHeldAtIdle",
}
# the gaps of issue 23 (finding 7): each needs an alert on the families that show it
REQUIRED_COVERAGE = {
    "error rate": {"baton_requests_total"},
    "TTFT SLO": {"baton_ttft_seconds_bucket"},
    "ITL SLO": {"baton_itl_seconds_bucket"},
    "gateway queue": {"baton_queue_waiting_requests"},
    "KV pages": {"baton_kv_pages_used", "baton_kv_pages"},
    "refused for want of room": {"baton_placements_saturated_total"},
    "worker restarts": {"baton_worker_restarts_total"},
    "worker stalls": {"baton_worker_stalls_total"},
    "no engine stepping": {"baton_inflight_requests", "baton_itl_seconds_count"},
    "event-loop lag": {"baton_event_loop_lag_seconds_bucket"},
}
# SLIs as recording rules (baton:<sli>:ratio_rate<window>) and the page/ticket pairs of windows
# with their burn rates (the SRE workbook's table)
SLIS = ("request_errors", "ttft_slow", "itl_slow")
PAGE = (("1h", "5m", "14.4"), ("6h", "30m", "6"))
TICKET = (("1d", "2h", "3"), ("3d", "6h", ""))
SCRAPE_JOBS = {"baton-gateway", "baton-ray", "baton-etcd"}
SCOPE = ("namespace", "job")  # what tells one baton cluster from another
AGGREGATIONS = ("sum", "avg", "min", "max", "count", "group", "stddev", "stdvar", "topk", "bottomk", "quantile",
                "count_values")  # fmt: skip
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


def _alerts(objects: list[Obj]) -> dict[str, Obj]:
    return {r["alert"]: r for r in _rules(objects) if "alert" in r}


def _records(objects: list[Obj]) -> dict[str, str]:
    return {r["record"]: r["expr"] for r in _rules(objects) if "record" in r}


def _rule_exprs(monitoring: list[Obj]) -> list[tuple[str, str]]:
    return [(f"alert {r['alert']}" if "alert" in r else f"record {r['record']}", r["expr"]) for r in _rules(monitoring)]


def _all_exprs(monitoring: list[Obj], dashboard: Obj) -> list[tuple[str, str]]:
    return _rule_exprs(monitoring) + [(f"panel {title}", expr) for title, expr in dashboard_exprs(dashboard)]


def _families(expr: str, records: dict[str, str]) -> set[str]:
    """The exported families an expression reads, through the recording rules it names."""
    out: set[str] = set()
    for name in promql_metrics(expr):
        out |= _families(records[name], records) if name in records else {name}
    return out


def test_every_promql_metric_is_documented(monitoring: list[Obj], dashboard: Obj) -> None:
    documented = documented_metrics()
    assert len(documented) >= 10, f"{METRICS_DOC}: found only {sorted(documented)} in its tables"
    records = _records(monitoring)
    unknown = [(where, name) for where, expr in _all_exprs(monitoring, dashboard)
               for name in sorted(promql_metrics(expr))
               if base_metric(name, documented) not in documented | set(records) | {"up"}]  # fmt: skip
    assert not unknown, "metrics not in docs/metrics.md:\n" + "\n".join(
        f"{w}: {n}" for w, n in unknown
    )


def test_every_expression_names_a_baton_metric(monitoring: list[Obj], dashboard: Obj) -> None:
    """Holds without docs/metrics.md: no expression is a typo that selects nothing at all.
    Recording rules are `baton:<what>:<operation>` and defined here; `up` is scoped to a job."""
    records = _records(monitoring)
    assert all(name.startswith("baton:") and name.count(":") == 2 for name in records), sorted(records)
    for where, expr in _all_exprs(monitoring, dashboard):
        names = promql_metrics(expr)
        assert names and all(n.startswith("baton_") or n in records or n == "up" for n in names), (
            f"{where}: {sorted(names)}"
        )
        assert "up" not in names or re.search(r'\bup\{job="baton-[a-z]+"\}', expr), f"{where}: up of any job"


def test_the_rules_parse_as_promql_would_tokenise_them(monitoring: list[Obj]) -> None:
    """Balanced brackets and quotes, and no Grafana variables in rules (Prometheus knows none)."""
    for where, expr in _rule_exprs(monitoring):
        bare = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
        assert bare.count('"') % 2 == 0 and "'" not in bare, where
        for left, right in ("()", "[]", "{}"):
            assert bare.count(left) == bare.count(right), f"{where}: {left}{right}"
        assert "$" not in bare, f"{where}: a template variable"


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
    rules = _alerts(monitoring)
    assert REQUIRED_ALERTS <= set(rules)
    assert len(rules) == len([r for r in _rules(monitoring) if "alert" in r]), "an alert name twice"
    for name, rule in rules.items():
        assert rule["labels"]["severity"] in ("critical", "warning", "info"), name
        assert rule["annotations"]["summary"], name


def test_alerts_cover_the_monitoring_gaps(monitoring: list[Obj]) -> None:
    records = _records(monitoring)
    read = [_families(r["expr"], records) for r in _alerts(monitoring).values()]
    missing = [gap for gap, families in REQUIRED_COVERAGE.items() if not any(families <= r for r in read)]
    assert not missing, f"no alert on: {missing}"


@pytest.mark.parametrize("sli", SLIS)
def test_slo_alerts_are_multiwindow_burn_rates(monitoring: list[Obj], sli: str) -> None:
    """A page (critical) when 1h and 5m both burn 14.4x the budget, or 6h and 30m 6x; a ticket
    (warning) when 1d and 2h burn 3x, or 3d and 6h 1x. Each window's SLI is a recording rule
    over exactly that range."""
    records = _records(monitoring)
    windows = {w for pairs in (PAGE, TICKET) for long, short, _ in pairs for w in (long, short)}
    for w in windows:
        expr = records.get(f"baton:{sli}:ratio_rate{w}")
        assert expr is not None, f"no recording rule for {sli} over {w}"
        ranges = set(re.findall(r"\[([^\]]+)\]", expr))
        assert ranges == {w}, f"baton:{sli}:ratio_rate{w} reads {ranges}"
    shapes = {"critical": PAGE, "warning": TICKET}
    for severity, pairs in shapes.items():
        alerts = [r for r in _alerts(monitoring).values()
                  if r["labels"]["severity"] == severity and f"baton:{sli}:" in r["expr"]]  # fmt: skip
        assert len(alerts) == 1, f"{sli}: one {severity} burn-rate alert, found {len(alerts)}"
        expr = " ".join(alerts[0]["expr"].split())
        budgets = set(re.findall(rf"baton:{sli}:ratio_rate\w+ > \((?:[\d.]+ \* )?([\d.]+)\)|"
                                 rf"baton:{sli}:ratio_rate\w+ > ([\d.]+)", expr))  # fmt: skip
        assert len({b for pair in budgets for b in pair if b}) == 1, f"{sli}: one budget, found {budgets}"
        for long, short, factor in pairs:
            rate = rf"\({factor} \* [\d.]+\)" if factor else r"[\d.]+"
            pattern = (rf"\(baton:{sli}:ratio_rate{long} > {rate} and "
                       rf"baton:{sli}:ratio_rate{short} > {rate}\)")  # fmt: skip
            assert re.search(pattern, expr), f"{sli} {severity}: {long}/{short} at {factor or 1}x in {expr}"


def _clauses(expr: str) -> list[tuple[str, list[str]]]:
    """(keyword, labels) of every `by (...)` and `on (...)` clause, and ("sum", []) for an
    aggregation with no `by` (it drops every label, namespace and job included)."""
    out = [(m.group(1), [x.strip() for x in m.group(2).split(",") if x.strip()])
           for m in re.finditer(r"\b(by|on|without|ignoring)\s*\(([^)]*)\)", expr)]  # fmt: skip
    for m in re.finditer(rf"\b({'|'.join(AGGREGATIONS)})\s*(\(|by\b|without\b)", expr):
        after = expr[m.end() - 1 :]
        if m.group(2) == "(" and not re.match(r"\((?:[^()]|\([^()]*\))*\)\s*(by|without)\b", after):
            out.append((m.group(1), []))
    return out


def test_no_rule_mixes_two_baton_clusters(monitoring: list[Obj]) -> None:
    """Every aggregation keeps namespace and job (`by (namespace, job, ...)`), and every join
    matches on them: two baton clusters in one Prometheus stay apart. A rule that joins
    different jobs (gateway missing while Ray is scraped) matches on namespace alone."""
    problems = []
    for where, expr in _rule_exprs(monitoring):
        jobs = set(re.findall(r'\bjob="([^"]+)"', expr))
        scope = ("namespace",) if len(jobs) > 1 else SCOPE
        for keyword, labels in _clauses(expr):
            if keyword in ("without", "ignoring"):
                problems.append(f"{where}: {keyword}(...) (say what is kept)")
            elif not set(scope) <= set(labels):
                problems.append(f"{where}: {keyword} ({', '.join(labels)}) drops {set(scope) - set(labels)}")
    assert not problems, "\n".join(problems)


def test_the_scoping_check_can_fail() -> None:
    assert _clauses("sum(rate(baton_a_total[5m]))") == [("sum", [])]
    assert _clauses("x and on() y") == [("on", [])]
    assert _clauses("sum by (node) (baton_b)") == [("by", ["node"])]
    assert _clauses("sum(baton_c) by (namespace, job)") == [("by", ["namespace", "job"])]
    assert _clauses("histogram_quantile(0.99, sum by (namespace, job, le) (rate(baton_d_bucket[5m])))") == [
        ("by", ["namespace", "job", "le"])
    ]


def test_dead_targets_are_up_equals_zero_per_job(monitoring: list[Obj]) -> None:
    """Not absent(...): it returns one label-less series for every cluster in the Prometheus
    together, and never fires while any one cluster still exports the metric."""
    problems = [where for where, expr in _rule_exprs(monitoring) if re.search(r"\babsent(_over_time)?\s*\(", expr)]
    assert not problems, f"absent() in {problems}"
    down = {m.group(1) for r in _alerts(monitoring).values()
            for m in re.finditer(r'\bup\{job="([^"]+)"\}\s*==\s*0', r["expr"])}  # fmt: skip
    assert down == SCRAPE_JOBS, f"up == 0 alerts for {sorted(down)}"


def _runbook() -> dict[str, list[str]]:
    """Alert name -> the cells of its row in k8s/README.md's runbook table:
    | `Name` | severity | what it means | what to look at | what to do |"""
    text = README.read_text()
    assert RUNBOOK_SECTION in text, f"k8s/README.md has no {RUNBOOK_SECTION!r} section"
    section = text.split(RUNBOOK_SECTION, 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        m = re.fullmatch(r"`(Baton\w+)`", cells[0]) if line.startswith("|") else None
        if m:
            rows[m.group(1)] = cells[1:]
    return rows


def test_every_alert_has_a_runbook_line(monitoring: list[Obj]) -> None:
    rows, alerts = _runbook(), _alerts(monitoring)
    assert sorted(set(alerts) - set(rows)) == [], "alerts without a runbook line in k8s/README.md"
    assert sorted(set(rows) - set(alerts)) == [], "runbook lines for alerts that do not exist"
    for name, cells in rows.items():
        assert len(cells) == 4 and all(cells), f"{name}: severity, meaning, where to look, what to do"
        assert cells[0] == alerts[name]["labels"]["severity"], f"{name}: the runbook says {cells[0]}"


def test_runbooks_point_at_panels_that_exist(dashboard: Obj) -> None:
    titles = {title for title, _ in dashboard_exprs(dashboard)}
    named = {(name, t) for name, cells in _runbook().items() for t in re.findall(r'"([^"]+)"', cells[2])}
    assert len(named) > 20
    assert sorted((n, t) for n, t in named if t not in titles) == []


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


def _node_families() -> set[str]:
    """Families whose labels (docs/metrics.md's third column) include `node`."""
    out = set()
    for line in METRICS_DOC.read_text().splitlines():
        m = re.match(r"\| `(baton_\w+)` \| \w+ \|\s*([\w, ]*?)\s*\|", line)
        if m and "node" in {x.strip() for x in m.group(2).split(",")}:
            out.add(m.group(1))
    return out


def selectors(expr: str) -> list[tuple[str, str]]:
    """(metric, its matchers between the braces, "" without) for every selector of `expr`."""
    names = promql_metrics(expr)
    return [(m.group(1), m.group(2) or "")
            for m in re.finditer(r'(?<![\w:$"])([a-zA-Z_:][\w:]*)\s*(?:\{((?:[^{}"]|"(?:[^"\\]|\\.)*")*)\})?', expr)
            if m.group(1) in names]  # fmt: skip


def test_the_selector_reader() -> None:
    expr = 'sum by (node) (rate(baton_a_total{node=~"$node", x="}"}[5m])) / on (node) baton_b + baton_a_total{y="1"}'
    assert selectors(expr) == [("baton_a_total", 'node=~"$node", x="}"'), ("baton_b", ""), ("baton_a_total", 'y="1"')]


def test_dashboard_shows_one_cluster(dashboard: Obj) -> None:
    """Variables pick one namespace and one job (node names repeat from cluster to cluster), and
    every selector of every panel and variable is scoped to them."""
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert list(variables)[:4] == ["datasource", "namespace", "job", "node"]
    for name in ("namespace", "job"):
        assert not variables[name]["multi"] and not variables[name]["includeAll"], f"${name}: one value"
    scope = ('namespace="$namespace"', 'job="$job"')
    unscoped = [(where, name) for where, expr in dashboard_exprs(dashboard) if where != "variable namespace"
                for name, matchers in selectors(expr) if not all(s in matchers for s in scope)
                and not (where == "variable job" and scope[0] in matchers)]  # fmt: skip
    assert not unscoped, f"selectors without {scope}: {unscoped}"


def test_every_per_node_panel_honours_node(dashboard: Obj) -> None:
    """A family with a node label is filtered by $node wherever a panel reads it."""
    documented, per_node = documented_metrics(), _node_families()
    assert {"baton_node_up", "baton_kv_reserved_pages", "baton_kv_pinned_pages"} <= per_node
    ignoring = sorted({where for where, expr in dashboard_exprs(dashboard) if not where.startswith("variable ")
                       for name, matchers in selectors(expr)
                       if base_metric(name, documented) in per_node and 'node=~"$node"' not in matchers})  # fmt: skip
    assert not ignoring, f"panels that ignore $node: {ignoring}"


def test_dashboard_configmap_is_labelled_for_the_grafana_sidecar(monitoring: list[Obj]) -> None:
    cm = [c for c in of_kind(monitoring, "ConfigMap") if "baton.json" in c.get("data", {})]
    assert len(cm) == 1
    assert cm[0]["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm[0]["data"]["baton.json"] == DASHBOARD.read_text()


def _jobs(pm: Obj) -> dict[str, Obj]:
    """The PodMonitor's endpoints by the job label its relabelings give them."""
    out = {}
    for e in pm["spec"]["podMetricsEndpoints"]:
        jobs = [r["replacement"] for r in e.get("relabelings", [])
                if r.get("targetLabel") == "job" and r.get("action", "replace") == "replace"]  # fmt: skip
        assert len(jobs) == 1, f"endpoint {e.get('port')}: set its job"
        out[jobs[0]] = e
    return out


def test_podmonitor_scrapes_ray_and_etcd_under_the_jobs_the_alerts_name(builds: dict[str, list[Obj]]) -> None:
    objects = builds["overlays/gpu"]
    pm = one(objects, "PodMonitor")
    jobs = _jobs(pm)
    assert set(jobs) == SCRAPE_JOBS
    for group in ("head", "prefill", "decode", "baton-etcd"):
        labels = template(objects, group).labels
        assert all(labels.get(k) == v for k, v in pm["spec"]["selector"]["matchLabels"].items()), group
    ray_head = template(objects, "head").container("ray-head")
    assert {"name": "metrics", "containerPort": 8080} in ray_head["ports"]
    assert jobs["baton-ray"]["port"] == "metrics"  # KubeRay names the workers' 8080 the same
    etcd = template(objects, "baton-etcd").container("etcd")
    port = {p["name"]: p["containerPort"] for p in etcd["ports"]}[jobs["baton-etcd"]["port"]]
    assert port == METRICS_PORT, f"etcd serves no metrics on {port}"  # its config: tests/k8s/test_etcd.py


def test_podmonitor_scrapes_the_gateway(builds: dict[str, list[Obj]]) -> None:
    objects = builds["overlays/gpu"]
    pm = one(objects, "PodMonitor")
    head = template(objects, "head")
    assert all(head.labels.get(k) == v for k, v in pm["spec"]["selector"]["matchLabels"].items())
    endpoint = _jobs(pm)["baton-gateway"]
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
