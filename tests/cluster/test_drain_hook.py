"""The gateway container's preStop (k8s/base/hooks/drain.py) against a real gateway: it posts
/admin/drain with the operator key, the gateway stops admitting, and the hook returns only once
the request that was in flight has finished -- held on the engine's step thread until the test
lets it go, so "in flight" is a state, not a race. tests/k8s/test_hooks.py runs the same script
against a stand-in for its edge cases (deadline, no gateway, wait-for-exit)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from cluster.edge.http_api import HttpConfig
from engine.async_engine import AsyncEngine
from tests.cluster.conftest import ServerHandle
from tests.faults.conftest import wait_for
from tests.k8s.test_hooks import DRAIN


def _lines(proc: subprocess.Popen[str]) -> tuple[list[str], threading.Thread]:
    """`proc`'s stderr lines as they come, and the thread reading them (it ends at EOF)."""
    said: list[str] = []

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            said.append(line.rstrip("\n"))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return said, reader

pytestmark = pytest.mark.timeout(120)

OPS_KEY, TENANT_KEY = "o" * 32, "t" * 32


def test_the_prestop_hook_drains_a_real_gateway(make_server: Callable[..., ServerHandle], tmp_path: Path) -> None:
    keys, token = tmp_path / "keys", tmp_path / "token"
    keys.write_text(f"{TENANT_KEY} alpha\n{OPS_KEY} ops role=operator\n")
    token.write_text(OPS_KEY + "\n")
    handle = make_server(api_keys_file=keys, http=HttpConfig(enable_admin=True))
    front = handle.running.front
    assert isinstance(front, AsyncEngine)
    tenant = {"Authorization": f"Bearer {TENANT_KEY}"}
    body = {"model": "baton-tiny", "prompt": "def drain():", "max_tokens": 8, "temperature": 0, "ignore_eos": True}

    release = threading.Event()
    held = asyncio.run_coroutine_threadsafe(front.call(lambda engine: release.wait(60)), handle.loop)
    replies: list[httpx.Response] = []
    client = threading.Thread(target=lambda: replies.append(
        httpx.post(handle.url + "/v1/completions", json=body, headers=tenant, timeout=60)))  # fmt: skip
    hook: subprocess.Popen[str] | None = None
    try:
        client.start()
        wait_for(lambda: handle.running.frontend.admission.num_inflight == 1, "the request is in flight")
        hook = subprocess.Popen([sys.executable, str(DRAIN), "--url", handle.url, "--token-file", str(token),
                                 "--interval", "0.05", "--timeout", "5", "--deadline", "60"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
        said, reader = _lines(hook)
        wait_for(lambda: httpx.get(handle.url + "/ready", timeout=10).status_code == 503, "the gateway drains")
        refused = httpx.post(handle.url + "/v1/completions", json=body, headers=tenant, timeout=30)
        assert refused.status_code == 503 and "Retry-After" in refused.headers
        # The hook read the request in flight and waits for it (a /metrics read answers within
        # the node read's bound while the step thread is held): held until it says so.
        wait_for(lambda: "drain: 1 request(s) in flight; waiting" in said, "the hook sees the request in flight")
        assert hook.poll() is None and "drain: no request in flight" not in said
        assert not replies
    finally:
        release.set()
        held.result(60)
    client.join(60)
    assert [r.status_code for r in replies] == [200]
    assert replies[0].json()["usage"]["completion_tokens"] == 8  # the in-flight request finished whole
    assert hook is not None
    assert hook.wait(timeout=60) == 0, said
    reader.join(10)  # every line it wrote is in
    assert said[-1] == "drain: no request in flight"  # and only once the request had finished
    assert handle.running.frontend.admission.num_inflight == 0
