"""A router (a gateway with no workers of its own) runs no engine, so its process never loads
torch: it starts in about a second and holds a fraction of a worker's memory. A real
`baton up --config` in a child process, routing to two baton servers (this process's, as the
pool's endpoints); the child's own memory map says what it loaded."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import yaml

from bench.server_proc import BatonProcess, free_port
from tests.cluster.conftest import ServerHandle
from tests.gateway.conftest import EXT

pytestmark = pytest.mark.timeout(120)

READY_WITHIN_S = 60.0  # a bound on the wait, not a figure: the child imports no torch


def test_a_router_process_serves_its_pools_without_loading_torch(upstreams: list[ServerHandle], tmp_path: Path) -> None:
    port = free_port()
    config = tmp_path / "router.yaml"
    config.write_text(yaml.safe_dump({
        "api": {"host": "127.0.0.1", "port": port, "grpc_port": 0},
        "pools": {
            "baton": {"kind": "baton", "enabled": False},
            "ext": {"kind": "openai-compatible", "endpoints": [u.url for u in upstreams], "models": [EXT]},
        },
        "routing": {"route_key": "user"},
    }))  # fmt: skip
    with BatonProcess([], tmp_path / "router.log", port, config=config) as router:
        router.wait_ready(READY_WITHIN_S)
        url = router.url
        body = {"model": EXT, "prompt": "one two three", "max_tokens": 4, "user": "u1"}
        answer = httpx.post(url + "/v1/completions", json=body, timeout=60, trust_env=False)
        assert answer.status_code == 200 and answer.headers["x-baton-pool"] == "ext", answer.text
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60,
                          trust_env=False) as streamed:  # fmt: skip
            events = [line for line in streamed.iter_lines() if line.startswith("data: ")]
        assert len(events) >= 2 and events[-1] == "data: [DONE]"
        assert httpx.post(url + "/tokenize", json={"model": EXT, "prompt": "hi"}, trust_env=False).status_code == 200
        assert "baton_pool_requests_total" in httpx.get(url + "/metrics", trust_env=False).text
        # after start-up, routing, both answers' paths, a pool's tokenizer and a scrape: the
        # process mapped no torch library (nothing imported it; an import maps libtorch_cpu)
        maps = Path(f"/proc/{router.pid}/maps").read_text()
        assert "libtorch" not in maps and "libc10" not in maps
    assert router.returncode == 0, router.log_tail(50)
