"""The command line of Ray-disaggregated serving: `baton up --prefill P --decode D` builds a Ray
deployment (`--no-ray` keeps the in-process one), and `baton serve --ray-address` attaches to a
running `ray start` cluster with token auth, serving the colocated engine's greedy text."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from cluster.cli import _build_parser, _server_config
from engine.errors import BatonError
from tests.cluster.conftest import ServerHandle, free_port
from tests.cluster.test_ray_serving import LONG, MODEL
from tests.etcd_server import EtcdServer

ROOT = Path(__file__).resolve().parents[2]


def _config(*argv: str):  # type: ignore[no-untyped-def]
    args = _build_parser().parse_args(list(argv))
    return _server_config(args, ray_address=getattr(args, "ray_address", None))


def test_up_flags_pick_the_deployment() -> None:
    assert _config("up").disagg is None  # colocated
    ray = _config("up", "--prefill", "2", "--decode", "2", "--local-prefill-tokens", "64",
                  "--transfer-deadline", "5", "--kv-transport", "grpc").disagg
    assert ray is not None and (ray.num_prefill, ray.num_decode) == (2, 2) and ray.transport == "grpc"
    assert ray.local_prefill_tokens == 64 and ray.transfer_deadline_s == 5.0 and ray.ray_address is None
    in_process = _config("up", "--prefill", "1", "--no-ray")
    assert in_process.disagg is None and in_process.prefill_workers == 1
    with pytest.raises(BatonError, match="--no-ray"):
        _config("up", "--prefill", "2", "--no-ray")
    served = _config("serve", "--ray-address", "127.0.0.1:6379")
    assert served.disagg is not None and served.disagg.ray_address == "127.0.0.1:6379"


def test_async_scheduling_flag_reaches_the_engine_config() -> None:
    assert _config("up").engine.async_scheduling is None  # auto: on with CUDA graphs
    assert _config("up", "--async-scheduling", "on").engine.async_scheduling is True
    assert _config("up", "--async-scheduling", "off").engine.async_scheduling is False
    with pytest.raises(SystemExit):
        _config("up", "--async-scheduling", "maybe")


def test_pin_cores_and_chunking_flags() -> None:
    ray = _config("up", "--prefill", "1", "--decode", "1", "--pin-cores")
    assert ray.disagg is not None and ray.disagg.pin_cores and ray.disagg.num_threads == 1
    colocated = _config("up", "--pin-cores", "--max-prefill-chunk", "8192", "--max-batched-tokens", "8192")
    assert colocated.pin_cores and colocated.engine.num_threads == 1  # a pinned engine: one thread
    assert (colocated.engine.max_prefill_chunk, colocated.engine.max_num_batched_tokens) == (8192, 8192)
    default = _config("up")
    assert not default.pin_cores and default.engine.num_threads is None
    assert (default.engine.max_prefill_chunk, default.engine.max_num_batched_tokens) == (512, 2048)
    assert _config("up", "--pin-cores", "--threads", "2").engine.num_threads == 2


@pytest.fixture
def ray_head() -> Iterator[tuple[str, dict[str, str]]]:
    """A `ray start --head` cluster on loopback with its own auth token (stopped by its PID)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(RAY_AUTH_TOKEN=secrets.token_hex(32), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
               RAY_USAGE_STATS_ENABLED="0", PYTHONPATH=str(ROOT))
    port = free_port()
    temp = tempfile.mkdtemp(prefix="rayh", dir="/tmp")  # short: Ray's socket paths live under it
    head = subprocess.Popen(
        [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
         f"--port={port}", "--dashboard-host=127.0.0.1", "--include-dashboard=false", "--disable-usage-stats",
         "--num-cpus=2", f"--temp-dir={temp}"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        _wait_port(port, 60)
        yield f"127.0.0.1:{port}", env
    finally:
        head.send_signal(signal.SIGTERM)
        try:
            head.wait(30)
        except subprocess.TimeoutExpired:
            head.kill()
        shutil.rmtree(temp, ignore_errors=True)


def _wait_port(port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on {port}")


def test_serve_attaches_to_a_running_ray_cluster_and_etcd(
    ray_head: tuple[str, dict[str, str]], etcd: EtcdServer, tiny_model_dir: Path, server: ServerHandle, tmp_path: Path
) -> None:
    """`baton serve --config cluster.yaml` on a `ray start` cluster with etcd membership: the
    workers hold leases under /{cluster}/workers/ while it serves, and revoke them at the end."""
    address, env = ray_head
    http_port = free_port()
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text(f"""
cluster: attach-test
model: {{path: "{tiny_model_dir}", served_name: {MODEL}, dtype: float32, max_model_len: 512}}
ray: {{address: "{address}"}}
workers: {{prefill: {{count: 1}}, decode: {{count: 1}}}}
kv_cache: {{device_pages: 256}}
membership: {{backend: etcd, lease_ttl_s: 3, etcd: {{host: 127.0.0.1, port: {etcd.port}}}}}
api: {{port: {http_port}, grpc_port: 0}}
""")
    proc = subprocess.Popen([sys.executable, "-m", "cluster.cli", "serve", "--config", str(cfg)],
                            env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        url = f"http://127.0.0.1:{http_port}"
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        want = openai.OpenAI(base_url=server.url + "/v1", api_key="x").completions.create(
            model=MODEL, prompt=LONG, max_tokens=10, temperature=0
        )
        got = openai.OpenAI(base_url=url + "/v1", api_key="x", timeout=60).completions.create(
            model=MODEL, prompt=LONG, max_tokens=10, temperature=0
        )
        assert got.choices[0].text == want.choices[0].text
        assert 'baton_placements_total{route="disaggregated"} 1.0' in httpx.get(url + "/metrics").text
        assert _etcd_workers(etcd, "attach-test") == ["decode-0", "prefill-0"]
        nodes = {n["name"]: n for n in httpx.get(url + "/status", timeout=10).json()["nodes"]}
        assert {n["health"] for n in nodes.values()} == {"ok"} and nodes["prefill-0"]["epoch"] > 0
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    errors = proc.stderr.read() if proc.stderr else ""
    assert code in (0, 130) and "Traceback" not in errors, errors  # 130: stopped by Ctrl-C
    assert _etcd_workers(etcd, "attach-test") == []  # the leases went with the workers


def _etcd_workers(etcd: EtcdServer, cluster: str) -> list[str]:
    import asyncio

    import aetcd  # type: ignore[import-untyped]

    async def read() -> list[str]:
        async with aetcd.Client("127.0.0.1", etcd.port) as client:
            prefix = f"/{cluster}/workers/".encode()
            kvs = await client.get_prefix(prefix)
            return sorted(kv.key.decode()[len(prefix):] for kv in kvs)

    return asyncio.run(read())
