"""Requests to external endpoints: one HTTP client for the gateway (aiohttp, pooled connections),
one retry on a connection failure before the first byte, never after, and what passes through
watched on the way (TTFT, the time between chunks, the engine's reported cached tokens).

Pooled connections are closed after UPSTREAM_IDLE_S idle, below the idle timeout engines' HTTP
servers close theirs at, so a request is not written into a connection the engine is closing
(the race answers it with a reset or a bare close). A connection that still closes before any
byte of an answer (`dropped`) is dialled again once, anywhere in the pool, the endpoint not
blamed: it was reached. Only a connection that cannot be made counts toward ejection.

    attempt = await upstreams.send(route_for, path, body, headers)
        route_for(exclude) -> Route   the router's choice (again, elsewhere, for the retry)
        -> Attempt: the route it went to and the response, headers read, body not yet
    async for chunk in upstreams.relay(attempt): ...     the body as it arrives, unbuffered
    upstreams.finish(attempt, outcome)                    exactly once

A client that leaves closes the upstream response (`finish` with "cancelled"): the connection
is dropped, which is how an OpenAI server learns to abort (vLLM, SGLang and baton all do).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from cluster.errors import EdgeError, Kind
from cluster.gateway.endpoints import Endpoint
from cluster.gateway.metrics import GatewayMetrics
from cluster.gateway.router import Route, Router
from engine.secrets import read_secret

logger = logging.getLogger(__name__)

MAX_SSE_EVENT_BYTES = 1 << 20  # an event longer than this is passed on without being looked at
FORWARDED_HEADERS = ("content-type", "accept", "traceparent", "tracestate", "x-request-id")
# An idle pooled connection is closed after this long: under the 5 s after which uvicorn (vLLM,
# SGLang) and cpp-httplib (llama-server) close one. aiohttp's default, 15 s, let the gateway reuse
# connections the engine was closing: in a routed run on 2026-12-07, three requests to vLLM were
# reset in 90 ms after a lull of about 5 s, which ejected the pool's one endpoint for 10 s.
UPSTREAM_IDLE_S = 2.0


def dropped(exc: BaseException) -> bool:
    """The connection was open and closed (reset, or shut) before any byte of an answer: most
    often a pooled one the engine had just closed; not a connection that could not be made."""
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return True
    return isinstance(exc, aiohttp.ClientOSError) and not isinstance(exc, aiohttp.ClientConnectorError)


@dataclass(slots=True)
class Watch:
    """What one answer's bytes have shown as they passed: its first output (the route's TTFT,
    the endpoint's prompt-rate sample), the time between outputs, the engine's cached tokens."""

    route: Route
    first_at: float | None = None
    last_at: float | None = None
    pending: bytes = b""  # a streamed answer's unfinished event; a whole answer's body (its usage)
    cached_tokens: int = 0


@dataclass(slots=True)
class Attempt:
    route: Route
    response: aiohttp.ClientResponse
    stream: bool
    watch: Watch
    _finished: bool = field(default=False)


class Upstreams:
    def __init__(self, router: Router, metrics: GatewayMetrics, request_timeout_s: float) -> None:
        self.router = router
        self.metrics = metrics
        self.request_timeout_s = request_timeout_s
        self._keys: dict[str, str] = {}
        for pool in router.pools.values():
            if pool.spec.api_key_file:
                key = read_secret(pool.spec.api_key_file, f"pools.{pool.name}.api_key_file").decode().strip()
                self._keys[pool.name] = key
        self._session: aiohttp.ClientSession | None = None

    def key_of(self, pool: str) -> str | None:
        return self._keys.get(pool)

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:  # made in the serving loop, on first use
            connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=60, enable_cleanup_closed=True,
                                             keepalive_timeout=UPSTREAM_IDLE_S)
            self._session = aiohttp.ClientSession(connector=connector, auto_decompress=False, trust_env=False)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def headers_for(self, route: Route, incoming: Mapping[str, str]) -> dict[str, str]:
        """What goes upstream: the content headers and trace context, never the client's own
        API key (that is the gateway's); the pool's key when it has one."""
        out = {k: v for k, v in incoming.items() if k.lower() in FORWARDED_HEADERS}
        out.setdefault("content-type", "application/json")
        key = self._keys.get(route.pool.name)
        if key:
            out["authorization"] = f"Bearer {key}"
        return out

    async def send(
        self, route_for: Callable[[Sequence[Endpoint]], Route], path: str, body: bytes,
        incoming: Mapping[str, str], stream: bool,
    ) -> Attempt:
        """POST `body` to the chosen endpoint's `path`; once more elsewhere when the first could
        not be reached (no byte of an answer had come). EdgeError(UNAVAILABLE) when neither could.
        A connection dropped before the answer began is dialled again once first (`dropped`)."""
        tried: list[Endpoint] = []
        redialled = False
        while True:
            route = route_for(tried)
            spec = route.pool.spec
            timeout = aiohttp.ClientTimeout(total=self.request_timeout_s, connect=spec.connect_timeout_s)
            try:
                response = await self.session.post(route.endpoint.url + path, data=body, timeout=timeout,
                                                   headers=self.headers_for(route, incoming))  # fmt: skip
            except (aiohttp.ClientConnectionError, TimeoutError) as exc:
                if dropped(exc) and not redialled:
                    redialled = True  # the endpoint was reached: not its failure, and not excluded
                    self.ended(route, "dropped")
                    logger.info("pool %s endpoint %s dropped a connection (%s): dialled again",
                                route.pool.name, route.endpoint.url, exc)  # fmt: skip
                    continue
                self.ended(route, "unreachable", failed_endpoint=True)
                logger.warning("pool %s endpoint %s unreachable: %s", route.pool.name, route.endpoint.url, exc)
                tried.append(route.endpoint)
                if len(tried) < 2:
                    continue
                raise EdgeError(Kind.UNAVAILABLE, f"pool {route.pool.name!r}: no endpoint could be reached",
                                retry_after_s=1.0) from None  # fmt: skip
            except BaseException:
                self.ended(route, "cancelled")
                raise
            return Attempt(route, response, stream and response.status == 200, Watch(route))

    async def relay(self, attempt: Attempt) -> AsyncIterator[bytes]:
        """The response body as it arrives, each chunk passed on as it is. EdgeError
        (UNAVAILABLE) when the connection breaks or times out before the body ended."""
        try:
            async for chunk in attempt.response.content.iter_any():
                now = time.monotonic()
                if attempt.stream:
                    self.watch(attempt.watch, chunk, now)
                elif len(attempt.watch.pending) < MAX_SSE_EVENT_BYTES:  # kept for its usage
                    attempt.watch.pending += chunk
                yield chunk
        except (aiohttp.ClientError, OSError) as exc:
            pool = attempt.route.pool.name
            raise EdgeError(Kind.UNAVAILABLE, f"pool {pool!r} broke off its answer: {exc!r}"[:512]) from None

    async def events(self, attempt: Attempt) -> AsyncIterator[dict[str, Any]]:
        """A streamed answer's SSE events, parsed (for callers that translate them: gRPC)."""
        pending = b""
        async for chunk in self.relay(attempt):
            *whole, pending = (pending + chunk).replace(b"\r\n", b"\n").split(b"\n\n")
            if len(pending) > MAX_SSE_EVENT_BYTES:
                raise EdgeError(Kind.UNAVAILABLE, f"pool {attempt.route.pool.name!r} sent an event over "
                                                  f"{MAX_SSE_EVENT_BYTES} bytes")  # fmt: skip
            for event in whole:
                for line in event.split(b"\n"):
                    if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                        continue
                    try:
                        body = json.loads(line[5:])
                    except ValueError:
                        continue
                    if isinstance(body, dict):
                        yield body

    async def read_body(self, attempt: Attempt, limit: int = MAX_SSE_EVENT_BYTES) -> bytes:
        """A whole (non-streamed, or error) answer, up to `limit` bytes."""
        held = b""
        async for chunk in self.relay(attempt):
            held += chunk
            if len(held) > limit:
                raise EdgeError(Kind.UNAVAILABLE, f"pool {attempt.route.pool.name!r} answered over {limit} bytes")
        return held

    def finish(self, attempt: Attempt, outcome: str) -> None:
        """ok, error (the engine answered an error), cancelled (the client left), broken (the
        stream broke off after it started)."""
        if attempt._finished:
            return
        attempt._finished = True
        attempt.response.close()
        route = attempt.route
        status = attempt.response.status
        if outcome == "ok" and status >= 400:
            outcome = "error"
        failed = outcome == "broken" or status >= 500
        if not attempt.stream and outcome == "ok":
            self._usage(attempt.watch)
        self.ended(route, outcome, failed_endpoint=failed)

    def ended(self, route: Route, outcome: str, failed_endpoint: bool = False) -> None:
        """Count a routed request's end (the own pool's too) and release its place."""
        pool, url = route.pool.name, route.endpoint.url
        ok = outcome == "ok"
        was_ejected = route.endpoint.ejected_until
        self.router.finish(route, ok, failed_endpoint)
        if route.endpoint.ejected_until > was_ejected:
            self.metrics.ejections.labels(pool, url).inc()
            logger.warning("pool %s endpoint %s ejected for %.0f s after %d failures", pool, url,
                           route.endpoint.eject_s, route.endpoint.failures)  # fmt: skip
        self.metrics.requests.labels(pool, url, outcome).inc()
        e = route.endpoint
        if ok:
            e.num_ok += 1
            e.prompt_tokens += route.prompt_tokens
            e.hit_tokens += route.hit_tokens
            self.metrics.prompt_tokens.labels(pool, url).inc(route.prompt_tokens)
            self.metrics.hit_tokens.labels(pool, url).inc(route.hit_tokens)
        elif outcome not in ("cancelled", "dropped"):
            e.num_failed += 1

    # -- what passes through -----------------------------------------------------------------

    def watch(self, w: Watch, chunk: bytes, now: float) -> None:
        """One chunk of a streamed (SSE) answer, as it passes: the first output ends the route's
        prompt work (Router.first_output) and is its TTFT; each one after, the time between."""
        data = (w.pending + chunk).replace(b"\r\n", b"\n")
        *events, w.pending = data.split(b"\n\n")
        if len(w.pending) > MAX_SSE_EVENT_BYTES:
            w.pending = b""
        for event in events:
            if not event.startswith(b"data:") or event.startswith(b"data: [DONE]"):
                continue
            if w.first_at is not None and b'"usage"' not in event:
                output = True  # past the first output, each chunk is one (parsing them all cost the loop)
            else:
                try:
                    body = json.loads(event[5:])
                except ValueError:
                    continue
                if not isinstance(body, dict):
                    continue
                self._cached_from(w, body)
                output = _has_output(body)
            if output:
                self.output(w, now)

    def output(self, w: Watch, now: float) -> None:
        """An output of a streamed answer (an SSE chunk with text or tokens; an own-pool gRPC
        message): the first is its TTFT, the route's prompt work done; each one after, the time
        since the one before (its pool's ITL)."""
        if w.first_at is None:
            w.first_at = now
            self.first_output(w.route, now)
        elif w.last_at is not None:
            self.metrics.itl.labels(w.route.pool.name, w.route.endpoint.url).observe(now - w.last_at)
            w.route.pool.itls.append(now - w.last_at)
        w.last_at = now

    def first_output(self, route: Route, now: float) -> None:
        """The route's first output came (its TTFT): the endpoint has done its prompt work."""
        self.router.first_output(route)
        self.metrics.ttft.labels(route.pool.name, route.endpoint.url).observe(now - route.started)
        route.pool.ttfts.append(now - route.started)

    def _usage(self, w: Watch) -> None:
        body = w.pending
        if not body:
            return
        try:
            parsed = json.loads(body)
        except ValueError:
            return
        if isinstance(parsed, dict):
            self._cached_from(w, parsed)

    def _cached_from(self, w: Watch, body: dict[str, object]) -> None:
        usage = body.get("usage")
        if not isinstance(usage, dict):
            return
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if isinstance(cached, int) and 0 <= cached <= 1 << 31 and not w.cached_tokens:
            w.cached_tokens = cached
            route = w.route
            route.endpoint.cached_tokens += cached
            self.metrics.cached_tokens.labels(route.pool.name, route.endpoint.url).inc(cached)


def _has_output(body: dict[str, object]) -> bool:
    choices = body.get("choices")
    if not isinstance(choices, list):
        return False
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        if choice.get("text"):
            return True
        delta = choice.get("delta")
        if isinstance(delta, dict) and (delta.get("content") or delta.get("tool_calls") or delta.get("reasoning_content")):
            return True
    return False


async def drain_disconnect(receive: Callable[[], object]) -> None:
    """Returns when the client has gone (its http.disconnect)."""
    while True:
        message = await receive()  # type: ignore[misc]
        if isinstance(message, dict) and message.get("type") == "http.disconnect":
            return


async def cancel(task: asyncio.Task[object]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
