"""OpenTelemetry traces (cluster.ops.tracing) from a real baton server to a real OTLP/gRPC collector on
loopback: one baton.request root per call with its req_id, the engine side's spans under it,
the client's traceparent as the parent (and nothing more), error status on a refused call, no
API key and no prompt text in any span; off by default (no SDK object, no thread, no span)."""

from __future__ import annotations

import json
import logging
import re
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from batonpb.baton.v1 import generation_pb2 as pb
from batonpb.baton.v1 import generation_pb2_grpc as pb_grpc
from cluster.edge.http_api import TracedCalls
from cluster.ops import tracing
from cluster.ops.tracing import NO_TRACE, OFF, TracingConfig, configure
from engine.env import OTLP_ENDPOINT_ENV
from tests.cluster.conftest import ServerHandle, free_port
from tests.cluster.otlp import Got, Receiver, children

pytestmark = pytest.mark.timeout(120)

MODEL = "baton-tiny"
KEY = "sk-tracing-test-key-0123456789abcdef"
TENANT = "acme"
SECRET = "pudding"  # in every prompt; must never reach a span
PROMPT = f"the secret {SECRET} recipe begins with"
LONG = f"def {SECRET}(n):\n    return n\n" * 12  # ~100 tokens: the in-process PD moves its pages
CLIENT_TRACE, CLIENT_SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
GRPC_TRACE, GRPC_SPAN = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
HEX32 = re.compile(r"[0-9a-f]{32}")


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    r = Receiver().start()
    yield r
    r.stop()


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tracing") / "keys.txt"
    path.write_text(f"{KEY} {TENANT}\n")
    return path


@dataclass
class Traced(ServerHandle):
    grpc_port: int = 0


@pytest.fixture(scope="module")
def traced(make_module_server: Callable[..., ServerHandle], receiver: Receiver, keys_file: Path) -> Iterator[Traced]:
    port = free_port()
    handle = make_module_server(grpc_port=port, api_keys_file=keys_file,
                         tracing=TracingConfig(receiver.endpoint, service_name="baton-colocated"))  # fmt: skip
    yield Traced(handle.url, handle.running, handle.loop, handle.thread, port)
    handle.stop()


def _new_spans(receiver: Receiver, handle: ServerHandle, before: int, num_roots: int) -> list[Got]:
    def done(spans: list[Got]) -> bool:
        return sum(s.name == "baton.request" for s in spans[before:]) >= num_roots

    return receiver.wait_for(handle.running.frontend.tracing, done)[before:]


def _assert_private(spans: list[Got]) -> None:
    for span in spans:
        for text in span.strings():
            assert KEY not in text and SECRET not in text, (span.name, text)


def _sse_usage(lines: Iterator[str]) -> int:
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    usage = [c["usage"] for c in chunks if c.get("usage")]
    assert len(usage) == 1
    return int(usage[0]["completion_tokens"])


def test_http_and_grpc_calls_are_traced(traced: Traced, receiver: Receiver) -> None:
    before = len(receiver.snapshot())
    auth = {"Authorization": f"Bearer {KEY}"}
    with traced.client(headers=auth) as http:
        # The client says "not sampled": its traceparent is a parent link only and steers nothing.
        body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8,
                "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        headers = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-00"}
        with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status_code == 200
            assert _sse_usage(r.iter_lines()) == 8
        bad = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "temperature": -1})
        assert bad.status_code == 400
    unauthenticated = traced.client().post("/v1/completions", json={"model": MODEL, "prompt": PROMPT})
    assert unauthenticated.status_code == 401
    with grpc.insecure_channel(f"127.0.0.1:{traced.grpc_port}") as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        request = pb.GenerateRequest(model=MODEL, text=PROMPT,
                                     sampling=pb.Sampling(max_tokens=5, temperature=0.0, ignore_eos=True))
        metadata = (("authorization", f"Bearer {KEY}"), ("traceparent", f"00-{GRPC_TRACE}-{GRPC_SPAN}-01"))
        replies = list(stub.Generate(request, metadata=metadata, timeout=30))
    request_id = replies[0].request_id
    assert HEX32.fullmatch(request_id) and sum(len(m.token_ids) for m in replies) == 5

    spans = _new_spans(receiver, traced, before, num_roots=4)
    roots = [s for s in spans if s.name == "baton.request"]
    assert len(roots) == 4 and all(not s.parent_id or s.parent_id in (CLIENT_SPAN, GRPC_SPAN) for s in roots)
    assert len({s.attributes["baton.req_id"] for s in roots}) == 4
    assert all(HEX32.fullmatch(s.attributes["baton.req_id"]) for s in roots)
    assert {s.service for s in spans} == {"baton-colocated"}

    # The stream: the client's trace continues; the engine's prefill then decode under it.
    [chat] = [s for s in roots if s.trace_id == CLIENT_TRACE]
    assert chat.parent_id == CLIENT_SPAN and not chat.is_error
    a = chat.attributes
    assert (a["baton.api"], a["baton.route"], a["baton.model"], a["baton.tenant"]) == (
        "http", "/v1/chat/completions", MODEL, TENANT)
    assert a["baton.outcome"] == "ok" and a["http.response.status_code"] == 200 and a["baton.stream"] is True
    assert a["baton.prompt_tokens"] > 5 and a["baton.max_tokens"] == 8 and a["baton.output_tokens"] == 8
    assert a["baton.cached_tokens"] >= 0
    kids = children(spans, chat)
    assert sorted(kids) == ["baton.decode", "baton.prefill"]
    [prefill], [decode] = kids["baton.prefill"], kids["baton.decode"]
    for kid in (prefill, decode):
        assert kid.attributes["baton.req_id"] == a["baton.req_id"] and kid.attributes["baton.worker"] == "engine-0"
        assert chat.start_ns <= kid.start_ns <= kid.end_ns <= chat.end_ns and not kid.is_error
    assert prefill.end_ns <= decode.start_ns
    assert decode.events == ("first_token",) and decode.attributes["baton.output_tokens"] == 8

    # Refused by validation: a root of its own (its own trace), error status, the field named.
    [invalid] = [s for s in roots if s.attributes.get("http.response.status_code") == 400]
    assert invalid.is_error and invalid.status_message == "INVALID_ARGUMENT" and not invalid.parent_id
    assert invalid.attributes["baton.error.kind"] == "INVALID_ARGUMENT"
    assert invalid.attributes["baton.error.param"] == "temperature"
    assert invalid.attributes["baton.outcome"] == "error" and invalid.attributes["baton.tenant"] == TENANT
    assert children(spans, invalid) == {}

    [refused] = [s for s in roots if s.attributes.get("http.response.status_code") == 401]
    assert refused.is_error and refused.attributes["baton.error.kind"] == "UNAUTHENTICATED"
    assert "baton.tenant" not in refused.attributes

    # gRPC: the req_id on the span is the request_id the caller got back.
    [rpc] = [s for s in roots if s.trace_id == GRPC_TRACE]
    assert rpc.parent_id == GRPC_SPAN and rpc.attributes["baton.req_id"] == request_id
    assert (rpc.attributes["baton.api"], rpc.attributes["baton.route"]) == ("grpc", "/baton.v1.GenerationService/Generate")
    assert rpc.attributes["baton.output_tokens"] == 5 and rpc.attributes["baton.outcome"] == "ok"
    assert sorted(children(spans, rpc)) == ["baton.decode", "baton.prefill"]

    _assert_private(spans)


def test_a_failed_grpc_call_has_error_status(traced: Traced, receiver: Receiver) -> None:
    """Called by the deprecated service name (a client from before issue 24): the route says so."""
    before = len(receiver.snapshot())
    with grpc.insecure_channel(f"127.0.0.1:{traced.grpc_port}") as channel:
        complete = channel.unary_unary("/baton.v1.Generation/Complete", pb.GenerateRequest.SerializeToString,
                                       pb.CompleteResponse.FromString)  # fmt: skip
        request = pb.GenerateRequest(model=MODEL, text=PROMPT, sampling=pb.Sampling(max_tokens=100_000))
        with pytest.raises(grpc.RpcError) as err:
            complete(request, metadata=(("authorization", f"Bearer {KEY}"),), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    [root] = _new_spans(receiver, traced, before, num_roots=1)
    assert root.is_error and root.attributes["baton.error.kind"] == "INVALID_ARGUMENT"
    assert root.attributes["baton.error.param"] == "max_tokens" and root.attributes["baton.tenant"] == TENANT
    assert root.attributes["baton.route"] == "/baton.v1.Generation/Complete"
    _assert_private([root])


def test_in_process_pd_writes_placement_and_transfer(
    make_server: Callable[..., ServerHandle], receiver: Receiver
) -> None:
    handle = make_server(prefill_workers=1, tracing=TracingConfig(receiver.endpoint, service_name="baton-pd"))
    try:
        before = len(receiver.snapshot())
        with handle.client() as http:
            for text in (LONG, "import os"):  # moved pages; prefilled by decode itself
                r = http.post("/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": 4,
                                                       "temperature": 0, "ignore_eos": True})  # fmt: skip
                assert r.status_code == 200
        spans = _new_spans(receiver, handle, before, num_roots=2)
    finally:
        handle.stop()
    roots = sorted((s for s in spans if s.name == "baton.request"), key=lambda s: s.start_ns)
    moved, local = (children(spans, root) for root in roots)
    assert sorted(moved) == ["baton.decode", "baton.placement", "baton.prefill", "baton.transfer"]
    place = moved["baton.placement"][0].attributes
    assert (place["baton.kind"], place["baton.decode_worker"], place["baton.prefill_worker"]) == (
        "disaggregated", "decode-0", "prefill-0")
    prefill = moved["baton.prefill"][0].attributes
    assert (prefill["baton.worker"], prefill["baton.epoch"], prefill["baton.local"]) == ("prefill-0", 1, False)
    [transfer] = moved["baton.transfer"]
    t = transfer.attributes
    assert t["baton.transport"] == "local" and t["baton.outcome"] == "ok" and not transfer.is_error
    assert t["baton.pages"] > 0 and t["baton.bytes"] > 0 and t["baton.seconds"] > 0
    [decode] = moved["baton.decode"]
    assert decode.events == ("first_token",) and decode.attributes["baton.output_tokens"] == 4
    assert decode.start_ns <= transfer.start_ns  # the first token left before the pages moved

    assert sorted(local) == ["baton.decode", "baton.placement", "baton.prefill"]
    assert local["baton.placement"][0].attributes["baton.kind"] == "local"
    assert local["baton.prefill"][0].attributes["baton.worker"] == "decode-0"
    assert local["baton.prefill"][0].attributes["baton.local"] is True
    _assert_private(spans)


def test_off_by_default(make_server: Callable[..., ServerHandle], monkeypatch: pytest.MonkeyPatch) -> None:
    for name in OTLP_ENDPOINT_ENV:
        monkeypatch.delenv(name, raising=False)
    made: list[object] = []
    real_init = tracing._RecordingRequest.__init__
    monkeypatch.setattr(tracing._RecordingRequest, "__init__",
                        lambda self, *a: made.append(self) or real_init(self, *a))  # fmt: skip
    before = _otel_threads()
    handle = make_server()
    try:
        assert handle.running.frontend.tracing is OFF
        assert not any(m.cls is TracedCalls for m in handle.running.http.config.app.user_middleware)
        r = handle.client().post("/v1/completions", headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"},
                                 json={"model": MODEL, "prompt": PROMPT, "max_tokens": 3})  # fmt: skip
        assert r.status_code == 200
    finally:
        handle.stop()
    assert made == [] and tracing._bound == {}
    assert _otel_threads() == before  # no exporter thread was started


def test_the_standard_endpoint_variable_and_the_file() -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}
    with pytest.MonkeyPatch.context() as mp:
        for name in OTLP_ENDPOINT_ENV:
            mp.delenv(name, raising=False)
        assert TracingConfig().endpoint() is None and configure(TracingConfig()) is OFF
        for name, value in env.items():
            mp.setenv(name, value)
        assert TracingConfig().endpoint() == "http://collector:4317"
        mp.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://traces:4317")
        assert TracingConfig().endpoint() == "http://traces:4317"
        assert TracingConfig("127.0.0.1:4317").endpoint() == "127.0.0.1:4317"  # the file's wins


def test_sampling_and_the_parent_are_decided_here(receiver: Receiver) -> None:
    never = configure(TracingConfig(receiver.endpoint, sample_ratio=0.0))
    always = configure(TracingConfig(receiver.endpoint, service_name="baton-unit"))
    try:
        assert never.is_enabled and never.request("http", "/v1/completions", [(b"traceparent", b"x")]) is NO_TRACE
        good = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-00".encode()
        odd = [
            [(b"traceparent", b"00-" + b"0" * 32 + b"-" + CLIENT_SPAN.encode() + b"-01")],  # invalid trace id
            [(b"traceparent", good), (b"traceparent", good)],  # two of them
            [(b"traceparent", good + b"-" * 200)],  # too long
            [("traceparent", "garbage")],
        ]
        before = len(receiver.snapshot())
        for carrier in [[(b"traceparent", good), (b"tracestate", b"vendor=steer")], *odd]:
            trace = always.request("http", "/v1/completions", carrier)
            assert trace is not NO_TRACE
            trace.end()
        spans = receiver.wait_for(always, lambda s: len(s) >= before + 5)[before:]
    finally:
        never.shutdown()
        always.shutdown()
    assert [(s.trace_id == CLIENT_TRACE, s.parent_id) for s in spans] == [(True, CLIENT_SPAN)] + [(False, "")] * 4
    assert all("steer" not in text for s in spans for text in s.strings())


def test_without_the_sdk_tracing_is_off_and_says_so_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)  # importing it raises ImportError
    monkeypatch.setattr(tracing, "_warned", [])
    with caplog.at_level(logging.WARNING, logger="cluster.ops.tracing"):
        assert configure(TracingConfig("127.0.0.1:4317")) is OFF
        assert configure(TracingConfig("127.0.0.1:4317")) is OFF
    assert [r.getMessage().startswith("tracing is off") for r in caplog.records] == [True]


def _otel_threads() -> int:
    return sum(t.name.startswith("OtelBatch") for t in threading.enumerate())
