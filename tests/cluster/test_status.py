"""GET /status, the baton_node_* families and `baton status` against a real colocated server:
the node's counters move with traffic, the table shows them, and a guarded gateway needs the key."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from cluster.ops.status_view import render_status
from tests.cluster.conftest import ServerHandle

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "The quick brown fox jumps over the lazy dog. " * 6  # several pages: a prefix to reuse

pytestmark = pytest.mark.timeout(120)


def _complete(server: ServerHandle, headers: dict[str, str] | None = None) -> None:
    with server.client() as client:
        r = client.post("/v1/completions", json={"model": "baton-tiny", "prompt": PROMPT, "max_tokens": 2},
                        headers=headers)  # fmt: skip
        assert r.status_code == 200, r.text


def test_status_reports_the_node_and_its_cache_hits(server: ServerHandle) -> None:
    with server.client() as client:
        before = client.get("/status").json()
    _complete(server)
    _complete(server)  # the second reuses the first's pages
    with server.client() as client:
        after = client.get("/status")
        metrics = client.get("/metrics").text
    assert after.headers["cache-control"] == "no-store"
    body = after.json()
    (node,) = body["nodes"]
    (old,) = before["nodes"]
    assert node["name"] == "engine-0" and node["role"] == "colocated" and node["health"] == "ok"
    device = node["cache"]["tiers"]["device"]
    assert device["pages_total"] == server.engine.pool.num_pages
    assert node["cache"]["query_tokens"] > old["cache"]["query_tokens"]
    assert device["hit_tokens"] > old["cache"]["tiers"]["device"]["hit_tokens"]
    assert body["gateway"]["requests"]["ok"] >= 2 and body["model"] == "baton-tiny"
    assert 'baton_node_prefix_hit_tokens_total{node="engine-0",role="colocated",tier="device"}' in metrics
    assert 'baton_node_up{node="engine-0",role="colocated"} 1.0' in metrics
    assert 'baton_node_kv_pages{node="engine-0",role="colocated",state="free",tier="device"}' in metrics
    # what the engine runs on: baton's compiled CPU kernels (a machine without a compiler shows torch)
    kernels = node["kernels"]
    assert (kernels["attention"], kernels["linear"], kernels["kv_dtype"]) == ("cpu", "panel", "float32")
    assert (f'baton_node_kernels_info{{attention="cpu",decode_step="{kernels["decode_step"]}",device="cpu",'
            f'isa="{kernels["isa"]}",kv_dtype="float32",linear="panel",node="engine-0",role="colocated"}} 1.0') in metrics


def test_baton_status_prints_the_table(server: ServerHandle) -> None:
    _complete(server)
    proc = subprocess.run([sys.executable, "-m", "cluster.cli", "status", "--url", server.url],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("baton-tiny  ready")
    assert lines[1].split()[:4] == ["NODE", "ROLE", "ADDRESS", "HEALTH"]
    row = lines[2].split()
    assert row[:4] == ["engine-0", "colocated", "-", "ok"] and row[7].endswith("%")  # one process: no address
    assert row[-2] == "cpu/panel" and row[-1] in ("avx512", "avx2", "avx", "sse2", "neon")  # KERNELS


def test_status_needs_the_key_when_keys_are_set(make_server: Any, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("s" * 24 + " ops role=operator\n")
    guarded = make_server(api_keys_file=keys)
    with guarded.client() as client:
        assert client.get("/status").status_code == 401
    cmd = [sys.executable, "-m", "cluster.cli", "status", "--url", guarded.url]
    env = {k: v for k, v in os.environ.items() if k != "BATON_API_KEY"}
    refused = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
    assert refused.returncode == 2 and "HTTP 401 (set BATON_API_KEY)" in refused.stderr
    ok = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT,
                        env={**env, "BATON_API_KEY": "s" * 24})  # fmt: skip
    assert ok.returncode == 0 and "engine-0" in ok.stdout


def test_unreachable_gateway_is_one_line() -> None:
    proc = subprocess.run([sys.executable, "-m", "cluster.cli", "status", "--url", "http://127.0.0.1:9",
                           "--timeout", "2"], capture_output=True, text=True, timeout=60, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 2 and "cannot reach the gateway" in proc.stderr and "Traceback" not in proc.stderr


def test_render_marks_down_nodes_and_lower_tiers() -> None:
    body = {"model": "m", "ready": True, "uptime_s": 3725, "gateway": {"requests": {"ok": 3}},
            "nodes": [{"name": "decode-0", "role": "decode", "health": "down", "epoch": 7, "host": "10.0.0.3",
                       "cache": {"query_tokens": 200, "hit_tokens": 50,
                                 "tiers": {"device": {"pages_used": 1, "pages_cached": 2, "pages_total": 8},
                                           "host": {"pages_cached": 5, "pages_total": 64}}}},
                      {"name": "prefill-0", "role": "prefill", "health": "ok", "host": "10.0.0.2",
                       "kernels": {"attention": "torch", "linear": "onednn", "decode_step": "per-layer", "isa": "",
                                   "kv_dtype": "float32"}}]}  # fmt: skip
    text = render_status(body)
    assert "up 1h02m" in text and "requests: ok 3" in text
    row = text.splitlines()[2].split()
    assert row == ["decode-0", "decode", "10.0.0.3", "down", "7", "0", "0", "25.0%", "1/2/8", "5/64", "-", "-"]
    assert text.splitlines()[3].split()[-1] == "torch/onednn"  # its kernels did not build: no ISA


def test_drain_refuses_new_work_and_finishes_inflight(make_server: Any) -> None:
    import threading

    import httpx

    from cluster.edge.http_api import HttpConfig

    assert make_server().client().post("/admin/drain").status_code == 404  # admin routes: off by default
    drained = make_server(http=HttpConfig(enable_admin=True))
    results: list[int] = []

    def long_request() -> None:
        body = {"model": "baton-tiny", "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True}
        results.append(httpx.post(drained.url + "/v1/completions", json=body, timeout=60).status_code)

    worker = threading.Thread(target=long_request)
    worker.start()
    with drained.client() as client:
        deadline = time.monotonic() + 10
        while client.get("/status").json()["gateway"]["inflight"] == 0:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.01)
        reply = client.post("/admin/drain")
        assert reply.status_code == 200 and reply.json() == {"draining": True, "inflight": 1}
        assert client.get("/ready").status_code == 503 and client.get("/live").status_code == 200
        refused = client.post("/v1/completions", json={"model": "baton-tiny", "prompt": "x", "max_tokens": 1})
        assert refused.status_code == 503 and "Retry-After" in refused.headers
    worker.join(60)
    assert results == [200]  # the in-flight request finished


def test_refused_requests_count_as_rejected(make_server: Any) -> None:
    fresh = make_server()
    with fresh.client() as client:
        bad = client.post("/v1/completions", json={"model": "baton-tiny", "prompt": "x", "temperature": -3})
        unknown = client.post("/v1/completions", json={"model": "nope", "prompt": "x", "max_tokens": 1})
        good = client.post("/v1/completions", json={"model": "baton-tiny", "prompt": "x", "max_tokens": 1})
        assert (bad.status_code, unknown.status_code, good.status_code) == (400, 404, 200)
        assert client.get("/status").json()["gateway"]["requests"] == {"rejected": 2, "ok": 1}
        text = client.get("/metrics").text
    assert 'baton_requests_total{api="http",outcome="rejected"} 2.0' in text


def test_sigterm_drains_the_gateway_then_exits_0(tiny_model_dir: Path, baton_cache_dir: Path) -> None:
    """SIGTERM to `baton up`: not-ready and new requests refused at once, the stream in flight
    completes with every token, then the process exits 0."""
    import json
    import signal
    import threading

    import httpx

    from tests.cluster.conftest import free_port

    port = free_port()
    env = {**os.environ, "BATON_CACHE_DIR": str(baton_cache_dir)}
    proc = subprocess.Popen([sys.executable, "-m", "cluster.cli", "up", "--model", str(tiny_model_dir), "--dtype",
                             "float32", "--max-model-len", "512", "--kv-pages", "128", "--port", str(port),
                             "--grpc-port", "0"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/ready", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        started, tokens = threading.Event(), []

        def stream() -> None:
            body = {"model": tiny_model_dir.name, "prompt": PROMPT, "max_tokens": 300, "ignore_eos": True,
                    "stream": True, "return_token_ids": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        started.set()
                        tokens.extend(json.loads(line[6:])["choices"][0].get("token_ids") or [])

        reader = threading.Thread(target=stream)
        reader.start()
        assert started.wait(30), "the stream never started"
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while httpx.get(url + "/ready", timeout=5).status_code != 503:
            assert time.monotonic() < deadline, "still ready after SIGTERM"
            time.sleep(0.05)
        late = httpx.post(url + "/v1/completions", json={"model": tiny_model_dir.name, "prompt": "x",
                                                          "max_tokens": 1}, timeout=10)  # fmt: skip
        assert late.status_code == 503
        reader.join(60)
        assert len(tokens) == 300, len(tokens)  # the stream in flight got every token
        code = proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    errors = proc.stderr.read() if proc.stderr else ""
    assert code == 0 and "Traceback" not in errors, errors
