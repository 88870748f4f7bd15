"""The names and types of baton's metrics follow Prometheus's conventions, as `promtool check
metrics` applies them (promtool is a Go binary that no registry here ships for CI, so the rules
are written out below): counters end `_total` and nothing else does; no family ends in a
suffix a histogram or summary adds (`_count`, `_sum`, `_bucket`); units are base units, spelt
out, as the last word (`_seconds`, `_bytes`); snake_case; a `baton_` prefix; HELP text on every
family; `le` and `quantile` only where they mean what Prometheus means.

What is linted is the text a real gateway returns on /metrics (baton-tiny, colocated), with the
Ray-side families registered on it the way cluster/server.py registers them for a Ray gateway;
and docs/metrics.md's table, which the dashboard and alerts are held to. The SLO alerts count
requests under a latency threshold through one histogram bucket: that bucket must exist.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import httpx
import pytest
import yaml

from cluster.fleet.transfer_metrics import TransferMetrics
from cluster.fleet.workers import DecodeHandle, PrefillHandle
from cluster.placement.pair_health import PairCollector, PairHealth, PairRoute
from cluster.server import ServerConfig
from engine.engine import Engine
from engine.engine_config import EngineConfig
from tests.cluster.conftest import ServerHandle, start_server
from tests.k8s.manifests import K8S, METRICS_DOC

pytestmark = pytest.mark.timeout(120)

PREFIX = "baton_"
BASE_UNITS = ("seconds", "bytes")  # the units baton measures; ratios and counts have none
NON_BASE_UNITS = {"milliseconds", "microseconds", "nanoseconds", "minutes", "hours", "days", "ms", "us", "ns",
                  "sec", "secs", "millis", "kilobytes", "megabytes", "gigabytes", "kb", "mb", "gb", "kib", "mib",
                  "gib", "bits"}  # fmt: skip
TYPE_WORDS = {"counter", "gauge", "histogram", "summary", "metric"}
SERIES_SUFFIXES = ("_count", "_sum", "_bucket")
_SNAKE = re.compile(r"^[a-z][a-z0-9]*(_[a-z0-9]+)*$")
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+\S+(?:\s+\S+)?$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass
class Family:
    name: str
    type: str = ""
    help: str = ""
    samples: list[tuple[str, dict[str, str]]] = field(default_factory=list)


def parse(text: str) -> tuple[dict[str, Family], list[str]]:
    """The families of a text exposition (0.0.4), and what could not be read as one."""
    families: dict[str, Family] = {}
    problems: list[str] = []
    for line in text.splitlines():
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            _, kind, name, *rest = line.split(" ", 3)
            family = families.setdefault(name, Family(name))
            if kind == "TYPE":
                if family.type:
                    problems.append(f"{name}: declared twice")
                family.type = rest[0] if rest else ""
            else:
                family.help = rest[0].strip() if rest else ""
        elif line and not line.startswith("#"):
            m = _SAMPLE.match(line)
            if m is None:
                problems.append(f"unreadable sample line {line!r}")
                continue
            name, labels = m.group(1), dict(_LABEL.findall(m.group(2) or ""))
            owner = _owner(families, name)
            if owner is None:
                problems.append(f"{name}: a sample of no declared family")
            else:
                owner.samples.append((name, labels))
    return families, problems


def _owner(families: dict[str, Family], sample: str) -> Family | None:
    for suffix in ("", *SERIES_SUFFIXES):
        family = families.get(sample[: -len(suffix)] if suffix else sample)
        if family is not None and (not suffix or family.type in ("histogram", "summary")):
            return family
    return None


def lint_name(name: str, kind: str) -> list[str]:
    """What promtool would say of a family `name` of type `kind` (counter, gauge, ...)."""
    problems = []
    if not _SNAKE.match(name):
        problems.append(f"{name}: not snake_case (lower case words joined by single underscores, no colons)")
    if not name.startswith(PREFIX):
        problems.append(f"{name}: no {PREFIX} prefix")
    if kind == "counter" and not name.endswith("_total"):
        problems.append(f'{name}: counter metrics should have "_total" suffix')
    if kind != "counter" and name.endswith("_total"):
        problems.append(f'{name}: non-counter metrics should not have "_total" suffix')
    for suffix in SERIES_SUFFIXES:
        if name.endswith(suffix):
            problems.append(f'{name}: a family should not end in "{suffix}" (histograms and summaries add it)')
    words = name.removesuffix("_total").split("_")
    problems += [f"{name}: use a base unit, not {w!r}" for w in words if w in NON_BASE_UNITS]
    problems += [f"{name}: the name includes the type word {w!r}" for w in words if w in TYPE_WORDS]
    for unit in BASE_UNITS:
        if unit in words[:-1]:
            problems.append(f"{name}: the unit {unit!r} should be the last word (before _total)")
    return problems


def lint(text: str) -> list[str]:
    """promtool check metrics' problems with a text exposition (empty: none)."""
    families, problems = parse(text)
    if not families:
        return ["no families at all"]
    for f in families.values():
        problems += lint_name(f.name, f.type)
        if f.type not in ("counter", "gauge", "histogram", "summary", "info", "stateset"):
            problems.append(f"{f.name}: type {f.type!r}")  # untyped: it was never declared
        if not f.help:
            problems.append(f"{f.name}: no help text")
        for sample, labels in f.samples:
            for label in labels:
                if not _SNAKE.match(label):
                    problems.append(f"{sample}: label {label!r} is not snake_case")
            if "le" in labels and not (f.type == "histogram" and sample.endswith("_bucket")):
                problems.append(f'{sample}: label "le" outside a histogram\'s buckets')
            if "quantile" in labels and f.type != "summary":
                problems.append(f'{sample}: label "quantile" outside a summary')
    return sorted(set(problems))


# --- the real exposition ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _NoWorkers:
    """The fleet a Ray gateway registers its per-worker collector with, before any joined."""

    prefills: Sequence[PrefillHandle] = ()
    decodes: Sequence[DecodeHandle] = ()
    num_member_events: dict[str, int] = field(default_factory=lambda: {"join": 1})


@pytest.fixture(scope="module")
def gateway(tiny_model_dir: object) -> Iterator[ServerHandle]:
    """A real colocated gateway (baton-tiny), with the families a Ray gateway adds registered
    on its registry as cluster/server.py registers them, after a request went through."""
    engine_cfg = EngineConfig(model=str(tiny_model_dir), dtype="float32", max_model_len=512, num_pages=64)
    handle = start_server(ServerConfig(engine=engine_cfg, grpc_port=None, served_model_name="baton-tiny"),
                          Engine(engine_cfg))  # fmt: skip
    try:
        registry = handle.running.frontend.metrics.registry
        transfers = TransferMetrics()
        transfers.register(registry, _NoWorkers())
        transfers.transfers.labels("grpc", "ok").inc()
        transfers.seconds.labels("grpc").observe(0.01)
        pairs = PairHealth()
        pairs.routed([PairRoute("prefill-0", "decode-0", "grpc", "10.0.0.1", "10.0.0.2")])
        registry.register(PairCollector(pairs))
        body = {"model": "baton-tiny", "prompt": "Tell me about the weather.", "max_tokens": 3, "stream": True}
        with handle.client() as client:
            assert client.post("/v1/completions", json=body).status_code == 200
        yield handle
    finally:
        handle.stop()


def _exposition(gateway: ServerHandle) -> str:
    text = httpx.get(gateway.url + "/metrics", timeout=10).text
    assert "baton_kv_pair_info{" in text and "baton_requests_total{" in text, "the fixture's families are missing"
    return text


def test_the_real_exposition_passes_the_lint(gateway: ServerHandle) -> None:
    text = _exposition(gateway)
    families, _ = parse(text)
    assert len(families) >= 40, sorted(families)  # the whole table: colocated and Ray-side families
    assert lint(text) == []


def test_the_pool_size_is_a_gauge_without_total(gateway: ServerHandle) -> None:
    families, _ = parse(_exposition(gateway))
    assert families["baton_kv_pages"].type == "gauge"
    assert "baton_kv_pages_total" not in families


def test_the_documented_table_passes_the_lint() -> None:
    rows = [re.match(r"\| `(baton_\w+)` \| (\w+) \|", line) for line in METRICS_DOC.read_text().splitlines()]
    table = {m.group(1): m.group(2) for m in rows if m}
    assert len(table) > 30
    problems = [p for name, kind in table.items() for p in lint_name(name, kind)]
    assert problems == []


def test_slo_thresholds_are_bucket_boundaries(gateway: ServerHandle) -> None:
    """A rule that counts `..._bucket{le="2.5"}` selects nothing if 2.5 is not a boundary (or
    is written "2.50"): each `le` the rules use is one the histogram exports, spelt the same."""
    text = _exposition(gateway)
    rule = yaml.safe_load((K8S / "monitoring" / "prometheusrule.yaml").read_text())
    used = {(m.group(1), m.group(2)) for g in rule["spec"]["groups"] for r in g["rules"]
            for m in re.finditer(r'(baton_\w+_bucket)\{[^}]*\ble="([^"]+)"', r["expr"])}  # fmt: skip
    assert {name for name, _ in used} >= {"baton_ttft_seconds_bucket", "baton_itl_seconds_bucket"}
    exported = {(m.group(1), m.group(2)) for m in re.finditer(r'^(baton_\w+_bucket)\{[^}]*\ble="([^"]+)"', text, re.M)}
    assert used <= exported, f"not a bucket boundary: {sorted(used - exported)}"


# --- the lint itself can fail -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("exposition", "problem"),
    [
        ("# HELP baton_kv_pages_total KV pages\n# TYPE baton_kv_pages_total gauge\nbaton_kv_pages_total 8\n",
         'non-counter metrics should not have "_total" suffix'),
        ("# HELP baton_requests Requests\n# TYPE baton_requests counter\nbaton_requests 1\n",
         'counter metrics should have "_total" suffix'),
        ("# HELP baton_wait_count Waits\n# TYPE baton_wait_count gauge\nbaton_wait_count 1\n",
         'should not end in "_count"'),
        ("# HELP baton_lag_ms Lag\n# TYPE baton_lag_ms gauge\nbaton_lag_ms 1\n", "use a base unit, not 'ms'"),
        ("# HELP baton_bytes_moved Moved\n# TYPE baton_bytes_moved gauge\nbaton_bytes_moved 1\n",
         "the unit 'bytes' should be the last word"),
        ("# HELP baton_queueLength Queue\n# TYPE baton_queueLength gauge\nbaton_queueLength 1\n", "not snake_case"),
        ("# HELP queue_length Queue\n# TYPE queue_length gauge\nqueue_length 1\n", "no baton_ prefix"),
        ("# TYPE baton_queue_length gauge\nbaton_queue_length 1\n", "no help text"),
        ("# HELP baton_up_gauge Up\n# TYPE baton_up_gauge gauge\nbaton_up_gauge 1\n", "the type word 'gauge'"),
        ('# HELP baton_up Up\n# TYPE baton_up gauge\nbaton_up{nodeName="a"} 1\n', "label 'nodeName' is not snake_case"),
        ('# HELP baton_up Up\n# TYPE baton_up gauge\nbaton_up{le="1"} 1\n', 'label "le" outside'),
        ("# HELP baton_up Up\n# TYPE baton_up gauge\nbaton_down 1\n", "a sample of no declared family"),
        ("", "no families at all"),
    ],
)
def test_the_lint_catches(exposition: str, problem: str) -> None:
    found = lint(exposition)
    assert any(problem in p for p in found), found


def test_the_lint_passes_a_clean_histogram() -> None:
    text = ("# HELP baton_ttft_seconds Time to first token\n# TYPE baton_ttft_seconds histogram\n"
            'baton_ttft_seconds_bucket{le="0.5"} 1\nbaton_ttft_seconds_bucket{le="+Inf"} 2\n'
            "baton_ttft_seconds_count 2\nbaton_ttft_seconds_sum 1.5\n"
            "# HELP baton_kv_transfer_bytes_total Bytes\n# TYPE baton_kv_transfer_bytes_total counter\n"
            'baton_kv_transfer_bytes_total{transport="grpc"} 10\n')  # fmt: skip
    assert lint(text) == []
