"""docs/metrics.md's table is what baton exports: every family a running gateway serves on
/metrics (colocated, and disaggregated on Ray) is in the table, and every row is served by
one of them, with the labels it says (the Ray half: test_ray_serving.py, on its cluster)."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.cluster.conftest import ServerHandle

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
RAY_ONLY_FROM = "baton_kv_transfers_total"  # the table's rows from here on: Ray deployments only
GATEWAY_FROM = "baton_pool_requests_total"  # and from here on: gateways with external pools only

pytestmark = pytest.mark.timeout(120)


def catalog() -> dict[str, tuple[str, set[str]]]:
    """name (as scraped, counters with _total) -> (type, labels), in table order."""
    rows: dict[str, tuple[str, set[str]]] = {}
    for line in DOC.read_text().splitlines():
        m = re.match(r"\| `(baton_\w+)` \| (\w+) \|\s*([\w, ]*?)\s*\|", line)
        if m:
            labels = {x.strip() for x in m.group(3).split(",") if x.strip()}
            rows[m.group(1)] = (m.group(2), labels)
    assert len(rows) > 20, "the table in docs/metrics.md was not found"
    return rows


def section(rows: dict[str, tuple[str, set[str]]], first: str | None, stop: str | None) -> dict[str, tuple[str, set[str]]]:
    """The table's rows from `first` (None: the top) up to `stop` (None: the end)."""
    names = list(rows)
    lo = names.index(first) if first else 0
    hi = names.index(stop) if stop else len(names)
    return {n: rows[n] for n in names[lo:hi]}


def exported(url: str) -> dict[str, tuple[str, set[str]]]:
    text = httpx.get(url + "/metrics", timeout=10).text
    out: dict[str, tuple[str, set[str]]] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("baton_"):
            continue
        name = family.name + ("_total" if family.type == "counter" else "")
        labels: set[str] = set()
        for sample in family.samples:
            labels |= set(sample.labels) - {"le"}
        out[name] = (family.type, labels)
    return out


def _traffic(url: str) -> None:
    body = {"model": "baton-tiny", "prompt": "Tell me about the weather. " * 8, "max_tokens": 2}
    for _ in range(2):
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200


def check_exports(url: str, expected: dict[str, tuple[str, set[str]]]) -> None:
    _traffic(url)
    got = exported(url)
    assert sorted(set(got) - set(catalog())) == [], "exported but not documented in docs/metrics.md"
    missing = sorted(set(expected) - set(got))
    assert missing == [], "documented but not exported"
    for name, (kind, labels) in expected.items():
        assert got[name][0] == kind, (name, got[name][0], kind)
        if got[name][1]:  # a family with no samples yet has no labels to compare
            assert got[name][1] == labels, (name, got[name][1], labels)


def test_the_colocated_gateway_exports_the_table(server: ServerHandle) -> None:
    check_exports(server.url, section(catalog(), None, RAY_ONLY_FROM))

