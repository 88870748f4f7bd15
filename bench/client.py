"""The HTTP transport (bench.transport): a streaming `/v1/completions` client that times one
request: TTFT, every inter-chunk interval, end-to-end latency, token counts and the server's
cached-token count.

aiohttp, as vLLM's serving benchmark uses: its HTTP/1.1 parser is C (llhttp). The client shares
the machine with the server it measures, so its CPU per token is taken from the server: on the
2-core machine at c=1 (128 tokens a request, streamed) httpx's pure-Python parser cost 345 us of
CPU per token, aiohttp 192 us, aiohttp on uvloop 138 us (the bench commands run on uvloop:
`bench.transport.run`). One `aiohttp.ClientSession` per run, no connection limit; with
`new_connection` every request opens its own connection and closes it (llama-server closes idle
keep-alive connections in a way that races with reuse).

Timing: TTFT is the first SSE event that carries text or token ids; each later such event adds
one inter-token interval (per chunk, as a user sees it; a chunk may carry several tokens, which
the token count from `usage` reveals). Output tokens come from the final `usage` chunk
(`stream_options.include_usage`) when the server sends one, else from returned ids, else one
per chunk.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp

from bench.transport import CompletionRequest, StreamResult

logger = logging.getLogger(__name__)

MAX_ERROR_BODY = 2048  # bytes of an error response kept for the report
LINES_PER_TOKEN = 16  # bound on SSE lines read per requested token (data + blank + slack)
MAX_LINE_BYTES = 4 << 20  # one SSE line (an event with logprobs is long; a runaway one is not)


@dataclass(frozen=True, slots=True)
class ClientConfig:
    url: str  # base URL, e.g. http://127.0.0.1:8000
    model: str
    api_key: str | None = None
    new_connection: bool = False
    connect_timeout_s: float = 10.0


def completion_payload(model: str, req: CompletionRequest) -> dict[str, Any]:
    """Greedy, fixed-length generation: max_tokens = min_tokens = output_len, EOS ignored."""
    payload: dict[str, Any] = {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.output_len,
        "min_tokens": req.output_len,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if req.want_token_ids:
        payload["return_token_ids"] = True  # vLLM's name (baton follows it)
        payload["return_tokens"] = True  # llama-server's name
    if req.user is not None:
        payload["user"] = req.user
    return payload


class SSEDecoder:
    """Line-level Server-Sent Events: returns an event's data when its blank line arrives."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        if not line:
            if not self._data:
                return None
            data, self._data = "\n".join(self._data), []
            return data
        if line.startswith("data:"):
            value = line[5:]
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None  # comments (":"), event:, id:, retry: carry nothing we time


class _Stream:
    """What one response's events add up to, as they arrive."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.chunk_times: list[float] = []
        self.text: list[str] = []
        self.ids: list[int] = []
        self.has_ids = False
        self.usage: dict[str, Any] | None = None
        self.cache_n: int | None = None
        self.finish_reason: str | None = None
        self.done = False
        self.done_at: float | None = None

    def on_event(self, data: str, now: float) -> None:
        if data.strip() == "[DONE]":
            self.done, self.done_at = True, now
            return
        obj = json.loads(data)
        if not isinstance(obj, dict):
            raise ValueError(f"SSE data is not an object: {data[:200]}")
        if obj.get("error"):
            raise ValueError(f"server error in stream: {json.dumps(obj['error'])[:500]}")
        if isinstance(obj.get("usage"), dict):
            self.usage = obj["usage"]
        timings = obj.get("timings")  # llama-server reports its prompt-cache reuse here
        if isinstance(timings, dict) and isinstance(timings.get("cache_n"), int):
            self.cache_n = timings["cache_n"]
        carried = False
        for choice in obj.get("choices") or ():
            text = choice.get("text") or ""
            ids = choice.get("token_ids") or choice.get("tokens")
            if isinstance(ids, list) and ids and all(isinstance(i, int) for i in ids):
                self.ids.extend(ids)
                self.has_ids = carried = True
            if text:
                self.text.append(text)
                carried = True
            if choice.get("finish_reason"):
                self.finish_reason = str(choice["finish_reason"])
        if carried:
            self.chunk_times.append(now)

    def result(self, end: float, error: str | None) -> StreamResult:
        times = self.chunk_times
        usage = self.usage or {}
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        counted = len(self.ids) if self.has_ids else len(times)
        return StreamResult(
            ok=error is None,
            error=error,
            ttft_s=times[0] - self.start if times else None,
            e2e_s=(self.done_at or end) - self.start,
            itl_s=tuple(b - a for a, b in zip(times, times[1:], strict=False)),
            num_chunks=len(times),
            output_tokens=int(usage.get("completion_tokens", counted)),
            prompt_tokens=int(usage["prompt_tokens"]) if "prompt_tokens" in usage else None,
            cached_tokens=int(cached) if isinstance(cached, int) else self.cache_n,
            finish_reason=self.finish_reason,
            text="".join(self.text),
            token_ids=tuple(self.ids) if self.has_ids else None,
        )


class StreamClient:
    """`async with StreamClient(cfg) as c: await c.complete(req, timeout_s)`."""

    def __init__(self, config: ClientConfig) -> None:
        self.config = config
        self._headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        self._url = config.url.rstrip("/")
        self._http: aiohttp.ClientSession | None = None  # made on the running loop, at first use

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None:
            self._http = aiohttp.ClientSession(
                headers=self._headers,
                # No pool limit: an open-loop run must not queue requests inside the client,
                # where the wait would be charged to the server's TTFT.
                connector=aiohttp.TCPConnector(limit=0, force_close=self.config.new_connection),
                timeout=aiohttp.ClientTimeout(total=None, connect=self.config.connect_timeout_s),
                trust_env=False,  # loopback benchmarks must not go through a proxy from the env
            )
        return self._http

    async def __aenter__(self) -> StreamClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    async def complete(self, req: CompletionRequest, timeout_s: float) -> StreamResult:
        """One streamed completion; never raises for a server or network failure."""
        stream = _Stream(time.perf_counter())
        error: str | None = None
        try:
            async with asyncio.timeout(timeout_s):
                error = await self._run(req, stream)
        except TimeoutError:
            error = f"timeout after {timeout_s:.1f} s"
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        if error is None and not stream.done:
            error = "stream ended before [DONE]"
        if error is not None:
            logger.debug("request failed: %s", error)
        return stream.result(time.perf_counter(), error)

    async def _run(self, req: CompletionRequest, stream: _Stream) -> str | None:
        payload = completion_payload(self.config.model, req)
        async with self._session().post(f"{self._url}/v1/completions", json=payload) as response:
            if response.status != 200:
                return f"HTTP {response.status}: {await _read_bounded(response)}"
            return await _read_events(response.content, stream, LINES_PER_TOKEN * (req.output_len + 8))


class Body(Protocol):
    """A response body as it arrives (aiohttp's StreamReader)."""

    def iter_any(self) -> AsyncIterator[bytes]: ...


async def _read_events(body: Body, stream: _Stream, max_lines: int) -> str | None:
    """Feed `stream` the events of an SSE body, read as it arrives (whatever the socket has, not
    a line at a time: on two cores the client's CPU per token comes out of the server's, and
    aiohttp's readline cost two awaits and a buffer scan per event); events that arrived in one
    read are timed at that read. None, or why the body was refused. No break at [DONE]: reading
    the body to its end is what lets the connection go back to the pool for keep-alive reuse."""
    decoder, tail, n = SSEDecoder(), b"", 0
    async for piece in body.iter_any():
        now = time.perf_counter()
        lines = (tail + piece).split(b"\n")
        tail = lines.pop()  # the start of a line still arriving
        if len(tail) > MAX_LINE_BYTES:
            return f"an SSE line over {MAX_LINE_BYTES} bytes"
        n += len(lines)
        if n > max_lines:
            return f"stream exceeded {max_lines} lines"
        for raw in lines:
            data = decoder.feed(raw.decode("utf-8").rstrip("\r"))
            if data is not None and not stream.done:
                stream.on_event(data, now)
    return None


async def _read_bounded(response: aiohttp.ClientResponse) -> str:
    body = b""
    while len(body) < MAX_ERROR_BODY and (piece := await response.content.read(MAX_ERROR_BODY - len(body))):
        body += piece
    return body.decode("utf-8", "replace").strip()


async def list_models(url: str, api_key: str | None = None, timeout_s: float = 10.0) -> list[str]:
    """Model ids from `GET /v1/models`, in the server's order."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s),
                                     trust_env=False) as http:
        async with http.get(f"{url.rstrip('/')}/v1/models") as response:
            response.raise_for_status()
            data = (await response.json(content_type=None)).get("data") or []  # any content type
    return [str(m["id"]) for m in data if isinstance(m, dict) and "id" in m]
