"""The gRPC transport (bench.transport): baton's streaming `GenerationService.Generate` through
cluster.client.AsyncBatonClient, timed exactly as the HTTP client times SSE chunks.

    GenerateResponse  token_ids=[t0]              <- TTFT
    GenerateResponse  token_ids=[t1]              <- ITL[0]
    ...
    GenerateResponse  token_ids=[tn] finish_reason usage{prompt, completion, cached}

Each message is one engine step's delta (usually one token). A message that carries tokens
or text is a "chunk": the first sets TTFT, each later one adds an inter-token interval; the
final message's usage gives the output, prompt and cached token counts. A stream that ends
without a finishing message is a failure, as an SSE stream without [DONE] is. Token ids come
back on every message; they are reported only when asked for (`want_token_ids`), as over HTTP,
so the ideal prefix index sees the same sequences on both transports.

One channel (one HTTP/2 connection, calls multiplexed on it) per run; `new_connection` opens
a channel per request instead. The trace's tenant is not sent: the gRPC API takes the tenant
from the API key.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

from bench.transport import CompletionRequest, StreamResult
from cluster.client import AsyncBatonClient, BatonClientError, Delta, Sampling, Usage

logger = logging.getLogger(__name__)

EXTRA_MESSAGES = 8  # bound on messages per request beyond one per requested token
DEADLINE_GRACE_S = 1.0  # the call's deadline trails the local timeout, so the timeout reports


@dataclass(frozen=True, slots=True)
class GrpcConfig:
    target: str  # host:port, e.g. 127.0.0.1:50051
    model: str
    api_key: str | None = None
    new_connection: bool = False
    tls: bool = False


def fixed_length_sampling(output_len: int) -> Sampling:
    """Greedy, fixed-length generation, as bench.client.completion_payload asks over HTTP."""
    return Sampling(max_tokens=output_len, min_tokens=output_len, temperature=0.0, ignore_eos=True)


class _Deltas:
    """What one call's messages add up to, as they arrive."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.chunk_times: list[float] = []
        self.text: list[str] = []
        self.ids: list[int] = []
        self.usage: Usage | None = None
        self.finish_reason: str | None = None
        self.finished_at: float | None = None
        self.num_messages = 0

    def on_delta(self, delta: Delta, now: float) -> None:
        self.num_messages += 1
        if delta.token_ids or delta.text:
            self.chunk_times.append(now)
            self.ids.extend(delta.token_ids)
            self.text.append(delta.text)
        if delta.usage is not None:
            self.usage = delta.usage
        if delta.finish_reason is not None:
            self.finish_reason, self.finished_at = delta.finish_reason, now

    def result(self, end: float, error: str | None, want_ids: bool) -> StreamResult:
        times = self.chunk_times
        usage = self.usage
        return StreamResult(
            ok=error is None,
            error=error,
            ttft_s=times[0] - self.start if times else None,
            e2e_s=(self.finished_at or end) - self.start,
            itl_s=tuple(b - a for a, b in zip(times, times[1:], strict=False)),
            num_chunks=len(times),
            output_tokens=usage.completion_tokens if usage is not None else len(self.ids),
            prompt_tokens=usage.prompt_tokens if usage is not None else None,
            cached_tokens=usage.cached_tokens if usage is not None else None,
            finish_reason=self.finish_reason,
            text="".join(self.text),
            token_ids=tuple(self.ids) if want_ids else None,
        )


class GrpcClient:
    """`async with GrpcClient(cfg) as c: await c.complete(req, timeout_s)`; open it inside the
    event loop that uses it (a grpc.aio channel belongs to one loop)."""

    def __init__(self, config: GrpcConfig) -> None:
        self.config = config
        self._shared = None if config.new_connection else self._open()

    def _open(self) -> AsyncBatonClient:
        c = self.config
        return AsyncBatonClient(c.target, model=c.model, api_key=c.api_key, tls=c.tls)

    async def __aenter__(self) -> GrpcClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._shared is not None:
            await self._shared.close()

    async def complete(self, req: CompletionRequest, timeout_s: float) -> StreamResult:
        """One streamed generation; never raises for a server or network failure."""
        deltas = _Deltas(time.perf_counter())
        error: str | None = None
        try:
            async with asyncio.timeout(timeout_s):
                error = await self._run(req, deltas, timeout_s + DEADLINE_GRACE_S)
        except TimeoutError:
            error = f"timeout after {timeout_s:.1f} s"
        except BatonClientError as exc:
            error = f"gRPC {exc}"
        if error is None and deltas.finish_reason is None:
            error = "stream ended without a finishing message"
        if error is not None:
            logger.debug("request failed: %s", error)
        return deltas.result(time.perf_counter(), error, req.want_token_ids)

    async def _run(self, req: CompletionRequest, deltas: _Deltas, deadline_s: float) -> str | None:
        client = self._shared or self._open()
        max_messages = req.output_len + EXTRA_MESSAGES
        try:
            sampling = fixed_length_sampling(req.output_len)
            stream = client.generate(req.prompt, sampling=sampling, timeout_s=deadline_s)
            # aclosing: leaving early (a bound, a timeout) cancels the call, which aborts the
            # request on the server and frees its pages.
            async with contextlib.aclosing(stream) as messages:
                async for delta in messages:
                    deltas.on_delta(delta, time.perf_counter())
                    if deltas.num_messages > max_messages:
                        return f"stream exceeded {max_messages} messages"
        finally:
            if client is not self._shared:
                await client.close()
        return None
