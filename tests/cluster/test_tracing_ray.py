"""Traces of `baton up --prefill 1 --decode 1` on a real local Ray, to a real OTLP collector: the
gateway's RayFront writes baton.placement, baton.prefill, baton.transfer and baton.decode under
each call's baton.request (a disaggregated prompt, and a short one its decode worker prefills)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from cluster.disagg_config import DisaggConfig
from cluster.ops.tracing import TracingConfig
from cluster.server import ServerConfig
from engine.engine_config import EngineConfig
from tests.cluster.conftest import ServerHandle, start_server
from tests.cluster.otlp import Got, Receiver, children

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.timeout(120)

MODEL = "baton-tiny"
LONG = "def fibonacci(n):\n    " * 20  # ~180 tokens: disaggregated
SHORT = "import os"  # a few tokens: prefilled on the decode side
TRACES = {LONG: "11111111111111111111111111111111", SHORT: "22222222222222222222222222222222"}
PARENT = "3333333333333333"


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    r = Receiver().start()
    yield r
    r.stop()


@pytest.fixture(scope="module")
def pd(receiver: Receiver, ray_cluster: Any, tiny_engine_config: EngineConfig) -> Iterator[ServerHandle]:
    cfg = ServerConfig(engine=tiny_engine_config, grpc_port=None, served_model_name=MODEL, prefill_workers=1,
                       disagg=DisaggConfig(num_prefill=1, num_decode=1),
                       tracing=TracingConfig(receiver.endpoint, service_name="baton-ray"))  # fmt: skip
    handle = start_server(cfg, None)
    yield handle
    handle.stop()


def test_ray_gateway_spans(pd: ServerHandle, receiver: Receiver) -> None:
    with pd.client() as http:
        for prompt, trace_id in TRACES.items():
            r = http.post("/v1/completions", headers={"traceparent": f"00-{trace_id}-{PARENT}-01"},
                          json={"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0,
                                "ignore_eos": True})  # fmt: skip
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6

    def root(spans: list[Got], trace_id: str) -> list[Got]:
        return [s for s in spans if s.name == "baton.request" and s.trace_id == trace_id]

    spans = receiver.wait_for(pd.running.frontend.tracing, lambda s: all(root(s, t) for t in TRACES.values()))
    [moved_root], [local_root] = (root(spans, t) for t in TRACES.values())
    assert moved_root.parent_id == PARENT and moved_root.attributes["baton.output_tokens"] == 6
    req_id = moved_root.attributes["baton.req_id"]

    moved = children(spans, moved_root)
    assert sorted(moved) == ["baton.decode", "baton.placement", "baton.prefill", "baton.transfer"]
    assert all(s.attributes["baton.req_id"] == req_id and not s.is_error for kids in moved.values() for s in kids)
    [placement] = moved["baton.placement"]
    p = placement.attributes
    assert (p["baton.kind"], p["baton.decode_worker"], p["baton.prefill_worker"]) == (
        "disaggregated", "decode-0", "prefill-0")
    assert p["baton.hit_pages"] >= 0 and p["baton.locality_given_up"] >= 0
    [prefill] = moved["baton.prefill"]
    assert (prefill.attributes["baton.worker"], prefill.attributes["baton.local"]) == ("prefill-0", False)
    assert prefill.attributes["baton.epoch"] >= 1 and placement.end_ns <= prefill.start_ns
    [transfer] = moved["baton.transfer"]
    t = transfer.attributes
    assert t["baton.transport"] in ("shm", "grpc") and t["baton.outcome"] == "ok"
    assert t["baton.pages"] > 0 and t["baton.bytes"] > 0 and t["baton.seconds"] > 0
    [decode] = moved["baton.decode"]
    assert decode.attributes["baton.worker"] == "decode-0" and decode.events == ("first_token",)
    assert decode.attributes["baton.output_tokens"] == 6
    assert prefill.end_ns <= decode.start_ns <= transfer.start_ns  # the first token went out before the pages

    local = children(spans, local_root)
    assert sorted(local) == ["baton.decode", "baton.placement", "baton.prefill"]
    assert local["baton.prefill"][0].attributes["baton.worker"] == "decode-0"
    assert local["baton.prefill"][0].attributes["baton.local"] is True
    assert local["baton.decode"][0].attributes["baton.output_tokens"] == 6
    assert {s.service for s in spans} == {"baton-ray"}
