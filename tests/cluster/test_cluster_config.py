"""cluster.yaml: the example parses into the ServerConfig it says, unknown keys and bad values
are refused with the key's path, and `baton serve --config` reports them in one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cluster.cluster_config import load_cluster_config, parse_cluster_file, to_server_config
from engine.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "cluster.yaml"

pytestmark = pytest.mark.timeout(60)


def test_the_example_parses_to_the_defaults_it_documents() -> None:
    cfg = load_cluster_config(EXAMPLE)
    assert cfg.disagg is not None and cfg.disagg.num_prefill == 1 and cfg.disagg.num_decode == 1
    assert cfg.disagg.ray_address is None and cfg.disagg.membership.backend == "ray"
    assert cfg.engine.model == "baton-tiny" and cfg.engine.max_model_len == 2048
    assert cfg.http.host == "127.0.0.1" and cfg.grpc_port == 50051
    d = cfg.disagg
    assert d is not None and (d.preserve_kv, d.retain_share, d.retain_s, d.drain_hand_off) == (True, 0.25, 30.0, True)


def test_an_empty_file_is_baton_up() -> None:
    cfg = to_server_config(parse_cluster_file(""))
    assert cfg.disagg is None and cfg.prefill_workers == 0 and cfg.http.port == 8000


def test_every_section_reaches_its_config() -> None:
    f = parse_cluster_file("""
cluster: prod-a
model: {path: /models/x, served_name: x, dtype: bfloat16}
ray: {address: "10.0.0.1:6379"}
workers:
  prefill: {count: 3, threads: 2, num_gpus: 1, resources: {baton_prefill: 1}}
  decode: {count: 5, threads: 4, num_gpus: 1, resources: {baton_decode: 1}}
kv_cache: {page_size: 32, device_pages: 4096, host_pages: 100, disk_pages: 1000, disk_dir: /cache}
scheduler: {max_num_seqs: 128, max_batched_tokens: 4096, max_prefill_chunk: 1024, async_scheduling: off}
transfer: {transport: grpc, deadline_s: 5, pages_per_chunk: 16}
placement: {policy: round_robin, local_prefill_tokens: 0}
membership: {backend: etcd, lease_ttl_s: 3, etcd: {host: etcd.baton, port: 2380}}
api: {host: 0.0.0.0, port: 9000, grpc_port: 0, api_keys_file: /keys}
admission: {max_waiting_requests: 10}
recovery: {preserve_kv: false, retain_share: 0.1, retain_s: 5, drain_hand_off: false, write_back_pages: 8}
""")
    cfg = to_server_config(f)
    d = cfg.disagg
    assert d is not None
    assert (d.num_prefill, d.num_decode, d.num_threads, d.decode_threads) == (3, 5, 2, 4)
    assert d.prefill_resources.options() == {"num_cpus": 0.0, "num_gpus": 1.0, "resources": {"baton_prefill": 1.0}}
    assert d.decode_resources.options()["resources"] == {"baton_decode": 1.0}
    assert d.ray_address == "10.0.0.1:6379" and d.transport == "grpc" and d.placement == "round_robin"
    assert d.membership.backend == "etcd" and d.membership.cluster == "prod-a"
    assert (d.preserve_kv, d.retain_share, d.retain_s, d.drain_hand_off) == (False, 0.1, 5.0, False)
    assert (d.membership.etcd_host, d.membership.etcd_port, d.membership.lease_ttl_s) == ("etcd.baton", 2380, 3)
    e = cfg.engine
    assert (e.page_size, e.num_pages, e.max_num_seqs, e.max_prefill_chunk) == (32, 4096, 128, 1024)
    assert (e.tiers.disk_pages, e.tiers.write_back_pages) == (1000, 8)
    assert e.async_scheduling is False  # YAML's off
    on = to_server_config(parse_cluster_file("scheduler: {async_scheduling: true}")).engine
    assert on.async_scheduling is True
    assert to_server_config(parse_cluster_file("scheduler: {async_scheduling: auto}")).engine.async_scheduling is None
    assert e.scheduler_policy == "least-uncached"  # the default
    assert to_server_config(parse_cluster_file("scheduler: {policy: fcfs}")).engine.scheduler_policy == "fcfs"
    with pytest.raises(ConfigError, match="scheduler.policy: Input should be 'least-uncached' or 'fcfs'"):
        parse_cluster_file("scheduler: {policy: sjf}")
    assert (e.tiers.host_pages, e.tiers.disk_pages, e.tiers.disk_dir) == (100, 1000, "/cache")
    assert cfg.grpc_port is None and cfg.http.port == 9000 and str(cfg.api_keys_file) == "/keys"
    assert cfg.admission.max_waiting_requests == 10 and cfg.served_model_name == "x"


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("workers: {prefil: {count: 1}}", "workers.prefil: unknown key"),
        ("bogus: 1", "bogus: unknown key"),
        ("api: {port: 70000}", "api.port"),
        ("api: {port: '8000'}", "api.port"),  # a string is not a port: no silent coercion
        ("transfer: {transport: rdma}", "transfer.transport"),
        ("scheduler: {async_scheduling: maybe}", "scheduler.async_scheduling"),
        ("scheduler: {async_scheduling: 1}", "scheduler.async_scheduling"),
        ("kv_cache: {disk_pages: 10}", "kv_cache.disk_dir"),
        ("api: {tls_cert: /c}", "api.tls_cert"),
        ("cluster: 'a b'", "cluster"),
        ("- just\n- a list", "top level must be a mapping"),
        ("model: {path: [unclosed", "not valid YAML"),
        ("workers: {prefill: {count: 1}, decode: {count: 0}}", "workers.decode.count"),
        ("recovery: {retain_share: 0.9}", "recovery.retain_share"),  # copies may not crowd out prompts
        ("recovery: {preserve_kv: 'yes'}", "recovery.preserve_kv"),
        ("recovery: {write_back_pages: 8}", "recovery.write_back_pages"),  # no disk tier to write to
    ],
)
def test_bad_files_name_the_key(text: str, where: str) -> None:
    with pytest.raises(ConfigError, match=r"(?s).*" + __import__("re").escape(where)):
        to_server_config(parse_cluster_file(text))


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(ConfigError) as info:
        parse_cluster_file("api: {port: -1, hots: x}\nworkers: {decode: {count: x}}")
    text = str(info.value)
    assert "api.port" in text and "api.hots: unknown key" in text and "workers.decode.count" in text


def _baton(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cluster.cli", *args], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)  # fmt: skip


def test_serve_reports_a_bad_file_in_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "cluster.yaml"
    bad.write_text("ray: {address: 'h:1'}\nworkers: {prefill: {count: 1, gpus: 1}}\n")
    proc = _baton("serve", "--config", str(bad))
    assert proc.returncode == 2
    assert "workers.prefill.gpus: unknown key" in proc.stderr and "Traceback" not in proc.stderr


def test_serve_needs_a_ray_address_in_the_file(tmp_path: Path) -> None:
    proc = _baton("serve", "--config", str(EXAMPLE))
    assert proc.returncode == 2 and "ray.address" in proc.stderr


def test_flags_beside_config_are_refused() -> None:
    proc = _baton("up", "--config", str(EXAMPLE), "--port", "9001")
    assert proc.returncode == 2 and "--port: not allowed with --config" in proc.stderr


def test_the_planner_section() -> None:
    cfg = to_server_config(parse_cluster_file(
        "workers: {prefill: {count: 1}}\nscheduler: {max_num_seqs: 32}\n"
        "planner: {enabled: true, period_s: 2, ttft_slo_s: 1.5, min_prefill: 1, max_prefill: 3, max_total: 6}"))
    assert cfg.planner is not None and cfg.planner_period_s == 2.0
    assert cfg.planner.ttft_slo_s == 1.5 and cfg.planner.decode_max_running == 32
    assert cfg.planner.limits.max_prefill == 3 and cfg.planner.limits.max_total == 6
    assert to_server_config(parse_cluster_file("workers: {prefill: {count: 1}}")).planner is None
    with pytest.raises(ConfigError, match="planner.enabled"):
        to_server_config(parse_cluster_file("planner: {enabled: true}"))  # colocated: nothing to resize


def test_several_served_names_from_the_flag_and_the_file() -> None:
    from cluster.cli import _build_parser, _server_config
    from cluster.server import served_names

    args = _build_parser().parse_args(["up", "--served-model-name", "tiny", "tiny-chat", "--port", "9001"])
    cfg = _server_config(args, None)
    assert served_names(cfg) == ("tiny", "tiny-chat") and cfg.http.port == 9001
    assert served_names(_server_config(_build_parser().parse_args(["up"]), None)) == ("baton-tiny",)
    from_file = to_server_config(parse_cluster_file("model: {served_name: [a, b]}"))
    assert served_names(from_file) == ("a", "b")
    with pytest.raises(ConfigError, match="model.served_name"):
        parse_cluster_file("model: {served_name: [a, 1]}")
