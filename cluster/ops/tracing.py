"""OpenTelemetry traces of requests, exported over OTLP/gRPC when an endpoint is configured.

    baton.request        the edge (a SERVER span): one HTTP or gRPC generation call. Parent: the
    │                    client's W3C traceparent, when it sent one (a parent link only)
    ├─ baton.placement   where it goes: kind, decode and prefill worker, hit pages, locality given up
    ├─ baton.prefill     the prompt's computation, dispatch -> first token (one per attempt)
    ├─ baton.transfer    the push of its pages to the decode worker (one per attempt)
    └─ baton.decode      first token -> last token on the decode worker (event first_token)

    colocated (AsyncEngine)   prefill and decode of engine-0 (written by Frontend.stream)
    in-process PD (PDFront)   placement, prefill, transfer (local), decode
    Ray (RayFront)            all five, as the gateway sees them (the actors do not trace)

    tracing = configure(TracingConfig(...))   OFF unless an endpoint is set (and the SDK installed)
    trace = tracing.request("http", route, headers)   the edge span, or NO_TRACE
    trace.bind(req_id) ... trace_of(req_id)   an engine side finds the trace by req_id, so the
                                              EngineFront interface carries no tracing argument
    with trace.span("baton.prefill", worker=...) as span: ...
    tracing.shutdown()                        flushes what is queued

Off, every call goes to one shared object whose methods do nothing: no SDK object is made and
no exporter thread runs. On, spans go to a BatchSpanProcessor (its own thread); the request
path only queues them.

What a span may hold: counts, worker names, the tenant's name, the model, outcomes, error
kinds and the offending field's name. Never the API key, the prompt or any text of the output,
nor an error's message (it may quote the request). Whether a call is traced is a draw against
`sample_ratio` here; the client's traceparent only names the parent (its sampled flag and its
tracestate are dropped), so it cannot steer sampling, placement or anything else.
"""

from __future__ import annotations

import logging
import random
import threading
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

from cluster.errors import EdgeError, Kind, classify
from engine.env import otlp_endpoint
from engine.errors import ConfigError

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span as OtelSpan
    from opentelemetry.trace import Tracer

logger = logging.getLogger(__name__)

Attr = str | bool | int | float
EXPORT_TIMEOUT_S = 5.0  # one export, retries included
SHUTDOWN_S = 5.0  # then a collector that does not answer gets no more tries (what is queued is dropped)
_MAX_TRACEPARENT_CHARS = 128  # a version-00 traceparent has 55
_MAX_PARAM_CHARS = 64
_KIND_OF_STATUS = {kind.http_status: kind for kind in Kind} | {413: Kind.INVALID_ARGUMENT, 422: Kind.INVALID_ARGUMENT}


@dataclass(frozen=True, slots=True)
class TracingConfig:
    otlp_endpoint: str | None = None  # host:port or http(s)://host:port; None: $OTEL_EXPORTER_OTLP_*ENDPOINT, else off
    service_name: str = "baton"
    sample_ratio: float = 1.0  # share of calls traced, drawn per call
    insecure: bool = True  # plaintext gRPC; False: TLS (system roots, or $OTEL_EXPORTER_OTLP_CERTIFICATE)

    def __post_init__(self) -> None:
        if not 0.0 <= self.sample_ratio <= 1.0:
            raise ConfigError("tracing.sample_ratio", f"must be in [0, 1], got {self.sample_ratio}")
        if not self.service_name:
            raise ConfigError("tracing.service_name", "must not be empty")

    def endpoint(self) -> str | None:
        """The configured endpoint, else the standard environment variables (traces' own first)."""
        if self.otlp_endpoint:
            return self.otlp_endpoint
        return otlp_endpoint()


# -- the no-op side: what every call gets when nothing records ------------------------------------


class Span:
    """One span. This base records nothing: tracing off, a call not sampled."""

    def set(self, **attributes: Attr) -> None:
        """Attributes, each named `baton.<key>`."""

    def event(self, name: str) -> None:
        """A point in time on the span (now)."""

    def fail(self, error: BaseException | str) -> None:
        """It failed: an exception (its EdgeError kind; a cancellation is an outcome, not an
        error) or a reason word ("deadline", "died", ...). The first failure is the one kept."""

    def end(self) -> None:
        """Close it (again: nothing)."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is not None:
            self.fail(exc)
        self.end()


class RequestTrace(Span):
    """The edge span of one call and the parent of its engine-side spans; this base records nothing."""

    req_id: str | None = None  # minted with a recording trace: the call's (first) engine request's id

    def span(self, name: str, start_ns: int | None = None, **attributes: Attr) -> Span:
        """A child span, started now (or at `start_ns`, time.time_ns())."""
        return NO_SPAN

    def bind(self, req_id: str) -> None:
        """Make this the trace `trace_of(req_id)` finds, while the engine request runs."""

    def unbind(self, req_id: str) -> None: ...

    def add_usage(self, prompt_tokens: int = 0, cached_tokens: int = 0, output_tokens: int = 0) -> None:
        """Token counts of one engine request (a call with n choices adds n times)."""

    def http_status(self, status: int) -> None:
        """The HTTP status the call answered with (>= 400: failed, if nothing said why yet)."""


NO_SPAN = Span()
NO_TRACE = RequestTrace()
_bound: dict[str, RequestTrace] = {}  # req_id -> its call's trace, for the engine sides


def trace_of(req_id: str) -> RequestTrace:
    """The trace of the call that runs engine request `req_id` (NO_TRACE if none records)."""
    return _bound.get(req_id, NO_TRACE) if _bound else NO_TRACE


def first_token(trace: RequestTrace, finished: bool, **attributes: Attr) -> Span:
    """The first token reached the edge: the decode span starts (its first_token event marks the
    moment), unless that token ended the request."""
    if finished:
        return NO_SPAN
    span = trace.span("baton.decode", None, **attributes)
    span.event("first_token")
    return span


class Tracing:
    """Tracing off: no SDK object, no thread; every call's trace is NO_TRACE."""

    is_enabled = False

    def request(self, api: str, route: str, carrier: Iterable[tuple[Any, Any]] = ()) -> RequestTrace:
        """The edge span of a call; `carrier` holds its headers or metadata (for traceparent)."""
        return NO_TRACE

    def force_flush(self) -> bool:
        return True

    def shutdown(self) -> None:
        """Export what is queued and stop (blocks up to a few seconds when the collector is gone)."""


OFF = Tracing()
_warned: list[str] = []


def configure(cfg: TracingConfig) -> Tracing:
    """An OTLP exporter behind a batch processor when an endpoint is set, else OFF."""
    endpoint = cfg.endpoint()
    if endpoint is None:
        return OFF
    try:
        tracing = _OtlpTracing(cfg, endpoint)
    except ImportError as exc:
        if not _warned:  # once per process, however many servers it starts
            _warned.append(endpoint)
            logger.warning("tracing is off: %s (install baton[trace] to export to %s)", exc, endpoint)
        return OFF
    logger.info("tracing: OTLP/gRPC to %s (%s, sample ratio %g)", endpoint,
                "TLS" if not cfg.insecure or endpoint.startswith("https://") else "plaintext", cfg.sample_ratio)
    return tracing


# -- the recording side (the OpenTelemetry SDK, imported only when configured) ---------------------


class _Recording(Span):
    def __init__(self, span: OtelSpan) -> None:
        self._span = span
        self._outcome: str | None = None
        self._ended = False

    def set(self, **attributes: Attr) -> None:
        if not self._ended:
            self._span.set_attributes({f"baton.{key}": value for key, value in attributes.items()})

    def event(self, name: str) -> None:
        if not self._ended:
            self._span.add_event(name)

    def fail(self, error: BaseException | str) -> None:
        if self._ended or self._outcome is not None:
            return
        from opentelemetry.trace import Status, StatusCode

        if isinstance(error, str):
            self._outcome = error
            self._span.set_status(Status(StatusCode.ERROR, error))
            return
        err = classify(error) if isinstance(error, Exception) else None  # else: cancelled, GeneratorExit
        if err is None or err.kind == Kind.CANCELLED:
            self._outcome = "cancelled"
            return
        self._outcome = "deadline" if err.kind == Kind.DEADLINE_EXCEEDED else "error"
        kind = err.kind.name
        attributes: dict[str, Attr] = {"baton.error.kind": kind}
        if err.param:
            attributes["baton.error.param"] = err.param[:_MAX_PARAM_CHARS]
        self._span.set_attributes(attributes)
        self._span.set_status(Status(StatusCode.ERROR, kind))  # the kind, never the message

    def end(self) -> None:
        if not self._ended:
            self._span.set_attribute("baton.outcome", self._outcome or "ok")
            self._span.end()
            self._ended = True


class _RecordingRequest(_Recording, RequestTrace):
    def __init__(self, tracer: Tracer, span: OtelSpan) -> None:
        from opentelemetry.trace import set_span_in_context

        super().__init__(span)
        self._tracer = tracer
        self._context = set_span_in_context(span)
        self.req_id = uuid.uuid4().hex
        self._req_ids = [self.req_id]
        self._usage = [0, 0, 0]  # prompt, cached, output tokens
        span.set_attribute("baton.req_id", self.req_id)

    def span(self, name: str, start_ns: int | None = None, **attributes: Attr) -> Span:
        if self._ended:
            return NO_SPAN
        child = self._tracer.start_span(name, context=self._context, start_time=start_ns,
                                        attributes={f"baton.{key}": value for key, value in attributes.items()})
        return _Recording(child)

    def bind(self, req_id: str) -> None:
        _bound[req_id] = self
        if req_id not in self._req_ids:
            self._req_ids.append(req_id)

    def unbind(self, req_id: str) -> None:
        if _bound.get(req_id) is self:
            del _bound[req_id]

    def add_usage(self, prompt_tokens: int = 0, cached_tokens: int = 0, output_tokens: int = 0) -> None:
        self._usage[0] += prompt_tokens
        self._usage[1] += cached_tokens
        self._usage[2] += output_tokens

    def http_status(self, status: int) -> None:
        if self._ended:
            return
        self._span.set_attribute("http.response.status_code", status)
        if status >= 400:
            kind = _KIND_OF_STATUS.get(status, Kind.INTERNAL if status >= 500 else Kind.INVALID_ARGUMENT)
            self.fail(EdgeError(kind, ""))

    def end(self) -> None:
        if self._ended:
            return
        prompt, cached, output = self._usage
        self._span.set_attributes({"baton.prompt_tokens": prompt, "baton.cached_tokens": cached,
                                   "baton.output_tokens": output})  # fmt: skip
        if len(self._req_ids) > 1:
            self._span.set_attribute("baton.req_ids", self._req_ids)
        for req_id in self._req_ids:
            self.unbind(req_id)
        super().end()


class _OtlpTracing(Tracing):
    is_enabled = True

    def __init__(self, cfg: TracingConfig, endpoint: str) -> None:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ALWAYS_ON

        exporter = self._exporter = OTLPSpanExporter(endpoint=endpoint, insecure=cfg.insecure, timeout=EXPORT_TIMEOUT_S)
        # Sampling is decided per call in request(); what is started is recorded.
        self._provider: TracerProvider = TracerProvider(
            sampler=ALWAYS_ON, resource=Resource.create({"service.name": cfg.service_name}), shutdown_on_exit=False
        )
        self._provider.add_span_processor(BatchSpanProcessor(exporter))
        self._tracer = self._provider.get_tracer("baton")
        self._ratio = cfg.sample_ratio

    def request(self, api: str, route: str, carrier: Iterable[tuple[Any, Any]] = ()) -> RequestTrace:
        if self._ratio < 1.0 and random.random() >= self._ratio:
            return NO_TRACE
        from opentelemetry.trace import SpanKind

        span = self._tracer.start_span("baton.request", context=_parent(carrier), kind=SpanKind.SERVER,
                                       attributes={"baton.api": api, "baton.route": route})  # fmt: skip
        return _RecordingRequest(self._tracer, span)

    def force_flush(self) -> bool:
        return self._provider.force_flush()

    def shutdown(self) -> None:
        # The SDK's shutdown exports every queued batch, each retried for up to EXPORT_TIMEOUT_S:
        # against a collector that is gone that is tens of seconds. Give it SHUTDOWN_S, then stop
        # the exporter, which ends its retries at once.
        flushing = threading.Thread(target=self._provider.shutdown, name="baton-trace-shutdown", daemon=True)
        flushing.start()
        flushing.join(SHUTDOWN_S)
        if flushing.is_alive():
            logger.warning("tracing: the collector did not take the last spans in %.0f s; dropping them", SHUTDOWN_S)
            self._exporter.shutdown()
            flushing.join(SHUTDOWN_S)


def _parent(carrier: Iterable[tuple[Any, Any]]) -> Context | None:
    """The client's span as a remote parent: its trace and span ids only. None unless exactly one
    well-formed traceparent came."""
    values = [value for key, value in carrier if key in ("traceparent", b"traceparent")]
    if len(values) != 1:
        return None
    value = values[0].decode("latin-1") if isinstance(values[0], bytes) else values[0]
    if not isinstance(value, str) or len(value) > _MAX_TRACEPARENT_CHARS:
        return None
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    sent = trace.get_current_span(TraceContextTextMapPropagator().extract({"traceparent": value}))
    remote = sent.get_span_context()
    if not remote.is_valid:
        return None
    parent = trace.SpanContext(remote.trace_id, remote.span_id, is_remote=True,
                               trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED))  # fmt: skip
    return trace.set_span_in_context(trace.NonRecordingSpan(parent))
