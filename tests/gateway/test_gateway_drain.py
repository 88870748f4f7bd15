"""A gateway that drains (SIGTERM, /admin/drain) with calls in flight to an external pool: it
sends no new ones out (503 + Retry-After, as its own admission answers), counts the ones in
flight in what a drain waits for (`baton_inflight_requests`, /status), and exits once they end."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable

import httpx
import pytest

from tests.cluster.conftest import ServerHandle
from tests.gateway.conftest import EXT, pool
from tests.gateway.test_gateway import complete, count, text

pytestmark = pytest.mark.timeout(120)


def test_a_draining_gateway_lets_calls_to_its_pools_finish_and_sends_no_new_ones(
    upstreams: list[ServerHandle], make_gateway: Callable[..., ServerHandle]
) -> None:
    gw = make_gateway([pool("ext", [upstreams[0].url])])
    running = gw.running

    async def sigterm() -> tuple[bool, bool]:
        running.http.handle_exit(signal.SIGTERM, None)
        await asyncio.sleep(0)  # the drain task's first step: draining set, then it waits or exits
        return running.frontend.draining, running.http.should_exit

    body = {"model": EXT, "prompt": text(60, 10), "max_tokens": 300, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", gw.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # the upstream is streaming
        assert running.frontend.num_inflight == 1 and count(gw.url, "baton_inflight_requests") == 1
        assert asyncio.run_coroutine_threadsafe(sigterm(), gw.loop).result(10) == (True, False)  # it waits
        refused = complete(gw.url, text(61, 10))
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1", refused.text
        assert httpx.get(gw.url + "/status").json()["gateway"]["inflight"] == 1
        rest = list(lines)
    assert [line for line in rest if line][-1] == "data: [DONE]"  # the call in flight finished whole
    gw.thread.join(30)  # and then the gateway shut down, as its drain does
    assert not gw.thread.is_alive()
