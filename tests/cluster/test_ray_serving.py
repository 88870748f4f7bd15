"""`baton up --prefill 1 --decode 1` on a real local Ray: the gateway (HTTP + gRPC) in this
process, a PrefillActor and a DecodeActor behind it, pages through shm (the transport chosen
for one host; tests/cluster/test_ray_faults.py runs the gRPC one). Greedy outputs equal
the colocated server's through the official openai client and baton's gRPC client; short and
mostly cached prompts are prefilled on the decode side; a client that goes away frees its
pages; transfer metrics reach /metrics."""

from __future__ import annotations

import asyncio
import random
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from cluster.client import BatonClient, Sampling
from cluster.disagg_config import DisaggConfig
from cluster.fleet.front import RayFront
from cluster.fleet.worker_msgs import DecodeStats
from cluster.server import ServerConfig
from engine.engine_config import EngineConfig
from tests.cluster.conftest import ServerHandle, free_port, start_server

ray = pytest.importorskip("ray")

MODEL = "baton-tiny"
LONG = "def fibonacci(n):\n    " * 20  # ~180 tokens: disaggregated
OTHER = "class Request:\n    def __init__(self):\n        " * 10  # long, and apart from LONG
SHORT = "import os"  # a few tokens: prefilled on the decode side


@dataclass
class PD(ServerHandle):
    grpc_port: int = 0


@pytest.fixture(scope="module")
def pd(ray_cluster: Any, tiny_engine_config: EngineConfig) -> Iterator[PD]:
    grpc_port = free_port()
    # round_robin: every prompt the decode worker has not cached goes to the prefill actor. The
    # cost model (tests/cluster/test_ray_placement.py) weighs measured rates and link bandwidth,
    # so under a loaded CI host it may rightly keep a 180-token prompt local; the tests here are
    # about the actor path and need each route to be known in advance.
    cfg = ServerConfig(engine=tiny_engine_config, grpc_port=grpc_port, served_model_name=MODEL, prefill_workers=1,
                       disagg=DisaggConfig(num_prefill=1, num_decode=1, placement="round_robin"))
    handle = start_server(cfg, None)
    yield PD(handle.url, handle.running, handle.loop, handle.thread, grpc_port)
    handle.stop()


def front_of(handle: ServerHandle) -> RayFront:
    front = handle.running.front
    assert isinstance(front, RayFront)
    return front


def decode_stats(front: RayFront, index: int = 0) -> DecodeStats:
    stats: DecodeStats = ray.get(front.fleet.decodes[index].actor.stats.remote(), timeout=30)
    return stats


def wait_decode_idle(front: RayFront, timeout_s: float = 10.0) -> DecodeStats:
    """The decode worker's pages are all back (free or only cached) and nothing runs."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = decode_stats(front)
        idle = stats.num_running == 0 and stats.num_waiting == 0 and stats.num_reserved_pages == 0
        if (idle and stats.num_free_pages_at_idle == stats.num_pages) or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def metric(handle: ServerHandle, name: str, **labels: str) -> float:
    text = httpx.get(handle.url + "/metrics", timeout=10).text
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        m = re.fullmatch(rf"{name}(?:\{{(.*)\}})? (\S+)", line)
        if m and ",".join(sorted((m.group(1) or "").split(","))) == want:
            return float(m.group(2))
    return 0.0


def test_openai_and_grpc_through_ray_actors_match_one_engine(pd: PD, server: ServerHandle) -> None:
    colocated = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    disaggregated = openai.OpenAI(base_url=pd.url + "/v1", api_key="x", timeout=60)
    for prompt in (LONG, SHORT):
        want = colocated.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        got = disaggregated.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        assert got.choices[0].text == want.choices[0].text
        assert got.usage is not None and got.usage.completion_tokens == want.usage.completion_tokens  # type: ignore[union-attr]
        stream = disaggregated.completions.create(
            model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True
        )
        assert "".join(c.choices[0].text for c in stream if c.choices) == want.choices[0].text
    chat = dict(model=MODEL, messages=[{"role": "user", "content": OTHER}], max_tokens=6, temperature=0)
    want_chat = colocated.chat.completions.create(**chat)  # type: ignore[call-overload]
    assert disaggregated.chat.completions.create(**chat).choices[0].message.content == (  # type: ignore[call-overload]
        want_chat.choices[0].message.content
    )

    with BatonClient(f"127.0.0.1:{pd.grpc_port}", model=MODEL, timeout_s=60) as client:
        greedy = Sampling(max_tokens=10, temperature=0.0)
        done = client.complete(OTHER + "x", sampling=greedy)
        streamed = "".join(d.text for d in client.generate(OTHER + "x", sampling=greedy))
    want = colocated.completions.create(model=MODEL, prompt=OTHER + "x", max_tokens=10, temperature=0)
    assert done.text == streamed == want.choices[0].text

    # First sight of LONG, the chat and OTHER+"x" moved pages; SHORT, and the repeats of LONG
    # and OTHER+"x" (now cached on the decode side), were prefilled there.
    assert metric(pd, "baton_placements_total", route="disaggregated") == 3
    assert metric(pd, "baton_placements_total", route="local") == 4
    # One host: kvtransfer.select picked shm for the pair (headers over gRPC, pages in /dev/shm).
    assert metric(pd, "baton_kv_transfers_total", transport="shm", outcome="ok") == 3
    assert metric(pd, "baton_kv_transfer_bytes_total", transport="shm") > 0
    assert metric(pd, "baton_kv_transfer_seconds_count", transport="shm") == 3
    assert metric(pd, "baton_kv_transfers_total", transport="grpc", outcome="ok") == 0
    assert metric(pd, "baton_node_up", node="prefill-0", role="prefill") == 1.0
    # each actor reports what its engine runs on (engine.kernel_info), into /status and /metrics
    nodes = httpx.get(pd.url + "/status", timeout=10).json()["nodes"]
    assert {(n["role"], n["kernels"]["attention"], n["kernels"]["linear"]) for n in nodes} == {
        ("prefill", "cpu", "panel"), ("decode", "cpu", "panel")}
    assert "baton_node_kernels_info{" in httpx.get(pd.url + "/metrics", timeout=10).text
    assert metric(pd, "baton_kv_pages", tier="device") == decode_stats(front_of(pd)).num_pages
    stats = wait_decode_idle(front_of(pd))
    assert stats.num_free_pages_at_idle == stats.num_pages and stats.num_open_reservations == 0
    deadline = time.monotonic() + 5  # the gateway polls prefill stats every second
    while metric(pd, "baton_kv_pinned_pages", node="prefill-0") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metric(pd, "baton_kv_pinned_pages", node="prefill-0") == 0


def test_a_mostly_cached_prompt_is_prefilled_on_the_decode_side(pd: PD, server: ServerHandle) -> None:
    """Conditional disaggregation counts the uncached part: the decode worker cached LONG's pages
    when it served it, so the same prompt again (only a partial page uncached) stays there."""
    client = openai.OpenAI(base_url=pd.url + "/v1", api_key="x", timeout=60)
    prompt = LONG + "# again"
    remote_before = metric(pd, "baton_placements_total", route="disaggregated")
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    remote, local = (metric(pd, "baton_placements_total", route=r) for r in ("disaggregated", "local"))
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    assert metric(pd, "baton_placements_total", route="local") == local + 1
    assert metric(pd, "baton_placements_total", route="disaggregated") == remote
    assert again.choices[0].text == first.choices[0].text
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens >= 160  # served from decode's cache
    # Usage says where: the decode worker's own device pages the second time; the first time,
    # if it went to a prefill worker (as it does unless an earlier test left LONG's pages on
    # the decode worker), whatever that worker reused came from another worker's cache.
    details = again.usage.prompt_tokens_details.model_dump()
    assert details["cached_tokens_by_tier"]["device"] == details["cached_tokens"]
    assert details["cached_tokens_remote"] == 0
    assert first.usage is not None and first.usage.prompt_tokens_details is not None
    before = first.usage.prompt_tokens_details.model_dump()
    assert before["cached_tokens_remote"] == (before["cached_tokens"] if remote > remote_before else 0)
    want = openai.OpenAI(base_url=server.url + "/v1", api_key="x").completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0
    )
    assert again.choices[0].text == want.choices[0].text


def test_a_client_that_leaves_frees_the_decode_pages(pd: PD) -> None:
    front = front_of(pd)
    with httpx.Client(base_url=pd.url, timeout=60) as http:
        body = {"model": MODEL, "prompt": OTHER + "leave", "max_tokens": 400, "stream": True,
                "ignore_eos": True, "temperature": 0}
        with http.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            seen = [line for _, line in zip(range(6), lines, strict=False) if line.startswith("data:")]
            assert len(seen) >= 2
            assert decode_stats(front).num_running == 1  # it is decoding on the actor now
    stats = wait_decode_idle(front)  # the abort reached the actor
    assert stats.num_running == 0 and stats.num_free_pages_at_idle == stats.num_pages
    assert not front.fleet.decodes[0].num_active


def test_per_step_batches_carry_every_request(pd: PD) -> None:
    """One output message per decode step, not one per token per request."""
    front, decode = front_of(pd), front_of(pd).fleet.decodes[0]
    client = openai.OpenAI(base_url=pd.url + "/v1", api_key="x", timeout=60)
    batches, outputs = decode.num_batches, decode.num_outputs
    threads = [
        threading.Thread(target=client.completions.create,
                         kwargs=dict(model=MODEL, prompt=f"{i} " + SHORT, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}))
        for i in range(4)
    ]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert decode.num_outputs - outputs == 4 * 24
    assert decode.num_batches - batches < 4 * 24  # steps carried several requests' tokens
    assert wait_decode_idle(front).num_running == 0


def test_sixty_streams_cancelled_at_random_points_free_every_page(pd: PD) -> None:
    """Long prompts (pages moved) and short ones (prefilled on decode), each cut at a random
    point (before a byte, after the first token, mid-decode): no page stays held anywhere."""
    rng = random.Random(99)
    points = [rng.randint(0, 8) for _ in range(60)]

    async def one(client: httpx.AsyncClient, i: int, cut: int) -> int:
        prompt = [200 + i] * 8 + list(range(1000 + 100 * i, 1000 + 100 * i + (60 if i % 2 else 8)))
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 100, "stream": True, "ignore_eos": True,
                "temperature": 0}
        seen = 0
        async with client.stream("POST", "/v1/completions", json=body) as reply:
            assert reply.status_code == 200
            if cut == 0:
                return 0
            async for line in reply.aiter_lines():
                if line.startswith("data: "):
                    seen += 1
                    if seen >= cut:
                        break
        return seen

    async def main() -> list[int]:
        async with httpx.AsyncClient(base_url=pd.url, timeout=60, limits=httpx.Limits(max_connections=20)) as c:
            return await asyncio.gather(*(one(c, i, cut) for i, cut in enumerate(points)))

    assert asyncio.run(main()) == points
    front = front_of(pd)
    stats = wait_decode_idle(front)
    assert stats.num_running == stats.num_waiting == stats.num_reserved_pages == 0
    assert stats.num_open_reservations == 0 and stats.num_free_pages_at_idle == stats.num_pages
    prefill = ray.get(front.fleet.prefills[0].actor.stats.remote(), timeout=30)
    assert prefill.num_pinned_pages == 0 and prefill.num_inflight_transfers == 0
    assert prefill.num_transfers > 0  # some were cut mid-transfer, the rest moved
    assert not front.fleet.decodes[0].num_active


def test_the_ray_gateway_exports_the_metrics_table(pd: PD) -> None:
    """docs/metrics.md, all but the external pools' rows, against a disaggregated gateway
    (tests/cluster/test_metrics_catalog.py)."""
    from tests.cluster.test_metrics_catalog import GATEWAY_FROM, catalog, check_exports, section

    check_exports(pd.url, section(catalog(), None, GATEWAY_FROM))


def test_a_constrained_request_through_ray_actors_parses(pd: PD) -> None:
    """Issue 11 across disaggregation: the prefill actor samples the first token under the
    schema's mask and the decode actor continues the same grammar; the output validates.
    A schema that cannot compile is refused with a 400 before any actor is asked."""
    import json

    import jsonschema

    schema = {"type": "object", "properties": {"level": {"enum": ["low", "high"]}, "tags": {"type": "array",
              "maxItems": 2, "items": {"enum": ["a", "b", "c"]}}}, "required": ["level", "tags"],
              "additionalProperties": False}  # fmt: skip
    client = openai.OpenAI(base_url=pd.url + "/v1", api_key="x", timeout=60, max_retries=0)
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}}
    disaggregated = metric(pd, "baton_placements_total", route="disaggregated")
    for seed in (1, 2):  # the first is disaggregated; the second, its prompt cached on decode, local
        got = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": LONG}], response_format=fmt, max_tokens=160,
            temperature=1.0, seed=seed)  # a long prompt: a prefill actor computes it  # fmt: skip
        assert got.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(got.choices[0].message.content or ""), schema)
    assert metric(pd, "baton_placements_total", route="disaggregated") > disaggregated  # a prefill actor took one
    bad: Any = {"type": "json_schema", "json_schema": {"name": "t", "schema": {"$ref": "#/$defs/missing"}}}
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], response_format=bad,
                                       max_tokens=8)  # fmt: skip
