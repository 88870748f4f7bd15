"""The streaming client against a real HTTP server on loopback: the conftest's
FakeOpenAIServer, a test double that only exercises the client's parsing and timing."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from bench.client import (
    MAX_LINE_BYTES,
    ClientConfig,
    SSEDecoder,
    StreamClient,
    _read_events,
    _Stream,
    completion_payload,
    list_models,
)
from bench.transport import CompletionRequest
from tests.bench.conftest import FAKE_MODEL, Behaviour, FakeOpenAIServer, fake_output_ids


def config(server: FakeOpenAIServer, new_connection: bool = False) -> ClientConfig:
    return ClientConfig(url=server.url, model=FAKE_MODEL, api_key="k", new_connection=new_connection)


def test_payload_fixes_output_length_and_asks_for_usage() -> None:
    p = completion_payload("m", CompletionRequest([5, 6], 7, want_token_ids=True, user="acme"))
    assert (p["max_tokens"], p["min_tokens"], p["ignore_eos"], p["temperature"]) == (7, 7, True, 0.0)
    assert p["stream"] is True and p["stream_options"] == {"include_usage": True}
    assert p["prompt"] == [5, 6] and p["return_token_ids"] is True and p["user"] == "acme"
    assert "return_token_ids" not in completion_payload("m", CompletionRequest("text", 1))


def test_sse_decoder_joins_data_lines_and_skips_comments() -> None:
    d = SSEDecoder()
    assert [d.feed(x) for x in (": ping", "", "data: {\"a\":", "data:1}", "")] == [None, None, None, None, '{"a":\n1}']
    assert d.feed("") is None


class Pieces:
    """A body that arrives in the given reads."""

    def __init__(self, *pieces: bytes) -> None:
        self.pieces = pieces

    async def iter_any(self) -> AsyncIterator[bytes]:
        for piece in self.pieces:
            yield piece


def _chunk(text: str) -> bytes:
    return b"data: " + json.dumps({"choices": [{"text": text}]}).encode() + b"\r\n\r\n"


async def test_events_are_read_as_they_arrive_split_anywhere() -> None:
    """Events split across reads, several in one read (timed at that read), CRLF line ends."""
    whole = _chunk("a") + _chunk("b") + _chunk("c") + b"data: [DONE]\n\n"
    cut = len(_chunk("a")) + 7  # inside the second event's data line
    stream = _Stream(0.0)
    assert await _read_events(Pieces(whole[:3], whole[3:cut], whole[cut:]), stream, 100) is None
    result = stream.result(1.0, None)
    assert result.text == "abc" and stream.done and result.num_chunks == 3
    assert result.itl_s[1] == 0.0  # "b" and "c" arrived in the last read, together


async def test_a_runaway_line_or_stream_is_refused() -> None:
    huge = b"data: " + b"x" * (MAX_LINE_BYTES + 1)
    assert await _read_events(Pieces(huge), _Stream(0.0), 100) == f"an SSE line over {MAX_LINE_BYTES} bytes"
    many = _chunk("a") * 10
    assert await _read_events(Pieces(many), _Stream(0.0), 15) == "stream exceeded 15 lines"


async def test_stream_records_ttft_itl_usage_and_cached_tokens(fake_server: FakeOpenAIServer) -> None:
    fake_server.state.behaviour = Behaviour(chunk_delay_s=0.02)
    async with StreamClient(config(fake_server)) as client:
        first = await client.complete(CompletionRequest(list(range(100, 140)), 5), timeout_s=10)
        second = await client.complete(CompletionRequest(list(range(100, 130)) + [7], 5, want_token_ids=True), timeout_s=10)
    assert first.ok and first.error is None, first.error
    assert first.ttft_s is not None and 0 < first.ttft_s < first.e2e_s
    assert len(first.itl_s) == 4 and sum(first.itl_s) >= 0.04  # the double paces chunks 20 ms apart
    # [DONE] may come in the last token's read, timed alike: equal but for float rounding
    assert first.e2e_s >= first.ttft_s + sum(first.itl_s) - 1e-9
    assert (first.output_tokens, first.num_chunks, first.prompt_tokens) == (5, 5, 40)
    assert first.cached_tokens == 0 and first.finish_reason == "length"
    assert first.text == "".join(f" t{i}" for i in fake_output_ids(list(range(100, 140)), 5))
    assert first.token_ids is None  # not asked for
    assert second.cached_tokens == 30  # the double reports its longest earlier prefix
    assert second.token_ids == tuple(fake_output_ids(list(range(100, 130)) + [7], 5))
    request = fake_server.state.requests[0]
    assert request["model"] == FAKE_MODEL and request["stream"] is True
    assert fake_server.state.auth_headers == ["Bearer k", "Bearer k"]


async def test_multi_token_chunks_count_tokens_from_usage(fake_server: FakeOpenAIServer) -> None:
    fake_server.state.behaviour = Behaviour(tokens_per_chunk=3)
    async with StreamClient(config(fake_server)) as client:
        r = await client.complete(CompletionRequest([200] * 10, 7), timeout_s=10)
    assert r.ok and r.num_chunks == 3 and len(r.itl_s) == 2 and r.output_tokens == 7


async def test_without_usage_tokens_are_counted_from_ids_or_chunks(fake_server: FakeOpenAIServer) -> None:
    fake_server.state.behaviour = Behaviour(tokens_per_chunk=2, send_usage=False)
    async with StreamClient(config(fake_server)) as client:
        by_chunks = await client.complete(CompletionRequest([200] * 10, 6), timeout_s=10)
        by_ids = await client.complete(CompletionRequest([200] * 10, 6, want_token_ids=True), timeout_s=10)
    assert by_chunks.ok and by_chunks.output_tokens == 3 and by_chunks.prompt_tokens is None
    assert by_chunks.cached_tokens is None
    assert by_ids.ok and by_ids.output_tokens == 6


async def test_failures_are_results_not_exceptions(fake_server: FakeOpenAIServer) -> None:
    async with StreamClient(config(fake_server)) as client:
        fake_server.state.behaviour = Behaviour(status=503)
        http_error = await client.complete(CompletionRequest([200], 2), timeout_s=10)
        fake_server.state.behaviour = Behaviour(send_done=False)
        truncated = await client.complete(CompletionRequest([200], 2), timeout_s=10)
        fake_server.state.behaviour = Behaviour(stall_s=2.0)
        slow = await client.complete(CompletionRequest([200], 2), timeout_s=0.2)
    assert not http_error.ok and http_error.error is not None and http_error.error.startswith("HTTP 503")
    assert "fake failure" in http_error.error
    assert not truncated.ok and truncated.error == "stream ended before [DONE]"
    assert truncated.output_tokens == 2  # what did arrive is still counted
    assert not slow.ok and slow.error is not None and slow.error.startswith("timeout") and slow.ttft_s is None


async def test_unreachable_server_is_a_failed_result() -> None:
    cfg = ClientConfig(url="http://127.0.0.1:9", model="m", connect_timeout_s=2)
    async with StreamClient(cfg) as client:
        r = await client.complete(CompletionRequest([200], 2), timeout_s=5)
    assert not r.ok and r.error is not None and "Connect" in r.error


async def test_new_connection_mode_opens_one_connection_per_request(fake_server: FakeOpenAIServer) -> None:
    async with StreamClient(config(fake_server)) as client:
        reused = [await client.complete(CompletionRequest([300, i], 3), timeout_s=10) for i in range(3)]
    assert len(set(fake_server.state.client_ports)) == 1  # keep-alive: one connection reused
    fake_server.reset()
    async with StreamClient(config(fake_server, new_connection=True)) as client:
        fresh = [await client.complete(CompletionRequest([300, i], 3), timeout_s=10) for i in range(3)]
    assert all(r.ok and r.output_tokens == 3 for r in reused + fresh)
    assert len(set(fake_server.state.client_ports)) == 3


async def test_list_models_returns_the_server_ids(fake_server: FakeOpenAIServer) -> None:
    assert await list_models(fake_server.url) == [FAKE_MODEL]
