"""What the runner sends and gets back, whatever carries it: one `Transport` per run, picked
once by `baton bench` (`--url`: OpenAI SSE in bench.client, `--grpc`: baton's gRPC in
bench.grpc_client), so the runner never branches on it.

Both transports measure the same way, so their figures compare: TTFT is the first message
that carries tokens, each later such message adds one inter-token interval, output and
cached tokens come from the server's usage, and a request is fixed-length and greedy
(max_tokens = min_tokens = output_len, EOS ignored, temperature 0).
"""

from __future__ import annotations

from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    prompt: list[int] | str
    output_len: int
    want_token_ids: bool = False  # ask for output ids (multi-turn history in token mode)
    user: str | None = None  # the trace's tenant (HTTP's `user` field; gRPC has none)


@dataclass(frozen=True, slots=True)
class StreamResult:
    ok: bool
    error: str | None
    ttft_s: float | None
    e2e_s: float
    itl_s: tuple[float, ...]  # intervals between successive token-carrying messages
    num_chunks: int  # token-carrying messages
    output_tokens: int
    prompt_tokens: int | None
    cached_tokens: int | None
    finish_reason: str | None
    text: str
    token_ids: tuple[int, ...] | None  # only when asked for (want_token_ids)


class Transport(Protocol):
    """One endpoint, opened for one run; `complete` never raises for a server or network
    failure (it returns a result with `ok=False`)."""

    async def complete(self, req: CompletionRequest, timeout_s: float) -> StreamResult: ...

    async def aclose(self) -> None: ...


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run a benchmark's client loop on uvloop. The client shares the machine with the server
    it measures, and uvloop's loop costs less CPU per streamed event than asyncio's (bench.client)."""
    import uvloop

    return uvloop.run(main)
