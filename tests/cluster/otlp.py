"""A real OTLP/gRPC trace collector for the tracing tests: TraceService.Export on grpc.aio, on
127.0.0.1, run on its own thread and event loop (the tests talk to baton synchronously).
Starting one skips the test where the `trace` packages are not installed."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
import pytest

from cluster.ops.tracing import Tracing

if TYPE_CHECKING:
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
    from opentelemetry.proto.common.v1 import common_pb2
    from opentelemetry.proto.trace.v1 import trace_pb2


@dataclass(frozen=True, slots=True)
class Got:
    """One exported span, decoded."""

    name: str
    trace_id: str  # hex
    span_id: str
    parent_id: str  # "" for a root
    attributes: dict[str, Any]
    events: tuple[str, ...]
    is_error: bool
    status_message: str
    service: str
    start_ns: int
    end_ns: int

    def strings(self) -> Iterator[str]:
        """Every string the span carries (for the privacy checks)."""
        yield from (self.name, self.status_message, self.service, *self.events)
        for key, value in self.attributes.items():
            yield key
            for v in value if isinstance(value, list) else [value]:
                if isinstance(v, str):
                    yield v


def _value(v: common_pb2.AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def _decode(span: trace_pb2.Span, service: str) -> Got:
    from opentelemetry.proto.trace.v1 import trace_pb2

    return Got(
        name=span.name, trace_id=span.trace_id.hex(), span_id=span.span_id.hex(),
        parent_id=span.parent_span_id.hex(), attributes={a.key: _value(a.value) for a in span.attributes},
        events=tuple(e.name for e in span.events), is_error=span.status.code == trace_pb2.Status.STATUS_CODE_ERROR,
        status_message=span.status.message, service=service, start_ns=span.start_time_unix_nano,
        end_ns=span.end_time_unix_nano,
    )  # fmt: skip


async def _export(
    sink: Receiver, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.aio.ServicerContext
) -> trace_service_pb2.ExportTraceServiceResponse:
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

    got = []
    for rs in request.resource_spans:
        names = [a.value.string_value for a in rs.resource.attributes if a.key == "service.name"]
        for ss in rs.scope_spans:
            got += [_decode(s, names[0] if names else "") for s in ss.spans]
    with sink.lock:
        sink.spans += got
        sink.num_exports += 1
    return trace_service_pb2.ExportTraceServiceResponse()


@dataclass
class Receiver:
    port: int = 0
    spans: list[Got] = field(default_factory=list)
    num_exports: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    _loop: asyncio.AbstractEventLoop | None = None
    _stopping: asyncio.Event | None = None
    _thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> Receiver:
        pytest.importorskip("opentelemetry.sdk")
        pytest.importorskip("opentelemetry.exporter.otlp.proto.grpc")
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

        sink = self

        class TraceService(trace_service_pb2_grpc.TraceServiceServicer):
            async def Export(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
                return await _export(sink, request, context)

        loop = asyncio.new_event_loop()
        ready = threading.Event()

        async def serve() -> None:
            self._stopping = asyncio.Event()
            server = grpc.aio.server()
            trace_service_pb2_grpc.add_TraceServiceServicer_to_server(TraceService(), server)
            self.port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            ready.set()
            await self._stopping.wait()
            await server.stop(None)

        self._loop = loop
        self._thread = threading.Thread(target=lambda: loop.run_until_complete(serve()), name="otlp-receiver",
                                        daemon=True)  # fmt: skip
        self._thread.start()
        assert ready.wait(30), "the OTLP receiver did not start"
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stopping is not None:
            self._loop.call_soon_threadsafe(self._stopping.set)
        if self._thread is not None:
            self._thread.join(10)
            assert not self._thread.is_alive(), "the OTLP receiver did not stop"

    def snapshot(self) -> list[Got]:
        with self.lock:
            return list(self.spans)

    def wait_for(self, tracing: Tracing, done: Callable[[list[Got]], bool], timeout_s: float = 20.0) -> list[Got]:
        """Flush and read until `done(spans)` (an edge span ends just after its response's last byte)."""
        deadline = time.monotonic() + timeout_s
        while True:
            tracing.force_flush()
            spans = self.snapshot()
            if done(spans):
                return spans
            if time.monotonic() > deadline:
                raise AssertionError(f"spans not exported in {timeout_s} s: {[(s.name, s.attributes) for s in spans]}")
            time.sleep(0.05)


def roots_with(spans: list[Got], req_id: str) -> list[Got]:
    return [s for s in spans if s.name == "baton.request" and s.attributes.get("baton.req_id") == req_id]


def children(spans: list[Got], parent: Got) -> dict[str, list[Got]]:
    out: dict[str, list[Got]] = {}
    for s in spans:
        if s.parent_id == parent.span_id and s.trace_id == parent.trace_id:
            out.setdefault(s.name, []).append(s)
    return out
