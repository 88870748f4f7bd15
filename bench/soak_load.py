"""The soak's traffic (bench.soak): seeded OpenAI requests and the client's view of each.

    call = make_call(index, seed, prompts)  chat or completions, streamed or not, a short or a
                                            long prompt that shares its prefix with others;
                                            ~10% cancelled by the client, 1% invalid
    outcome, is_short = await send(client, call, timeout_s)
    await load(url, cfg, stop_at, tally)    `concurrency` bounded client loops (max requests,
                                            deadline), outcomes counted into `tally`

Client outcomes: ok (the answer finished: [DONE] without an error event, or a 200 body),
cancelled (the client hung up: after `cancel_after` streamed chunks, or a unary call abandoned
after `cancel_after` seconds, each long before the answer could finish), invalid (an invalid
request answered 400, as it must be), not-400 (one answered otherwise), refused (a valid
request answered 4xx or 503 before any token), error (5xx, an error event in the stream, a
stream that broke off, a transport error), timeout (no answer within the client's bound).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import httpx

from bench.client import SSEDecoder
from bench.prompts import WORDS

MODEL = "baton-tiny"


@dataclass(frozen=True, slots=True)
class LoadConfig:
    concurrency: int
    max_requests: int
    request_timeout_s: float
    seed: int
    abandon_s: tuple[float, float] = (0.2, 0.8)  # a unary call is abandoned after this long


@dataclass(frozen=True, slots=True)
class Call:
    path: str
    body: bytes  # JSON, or (one kind of invalid request) not JSON
    stream: bool
    max_tokens: int
    cancel_after: float | None = None  # streamed: token chunks to read; unary: seconds to wait
    is_invalid: bool = False


class Prompts:
    """Four long system prompts and four short preambles, each shared by many requests."""

    def __init__(self, seed: int) -> None:
        rng = random.Random(seed)
        self.long = [self.words(rng, 400) for _ in range(4)]
        self.short = [self.words(rng, 24) for _ in range(4)]

    @staticmethod
    def words(rng: random.Random, n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))


def make_call(index: int, seed: int, prompts: Prompts, abandon_s: tuple[float, float] = (0.2, 0.8)) -> Call:
    """Request `index` of the run: every 100th invalid (the first early, so that a short run has
    one), ~10% cancelled (8% mid-stream; 2% unary, abandoned after `abandon_s` seconds, long
    before their 900 tokens can be done), the rest drawn from the seed."""
    rng = random.Random(seed * 1_000_003 + index)
    if index % 100 == 7:
        return _invalid_call(index // 100 % 4)
    roll = rng.random()
    is_chat, is_long = rng.random() < 0.5, rng.random() < 0.4 and not 0.08 <= roll < 0.10  # room for 900 tokens
    system = rng.choice(prompts.long if is_long else prompts.short)
    question = Prompts.words(rng, 40 if is_long else 8)
    stream, cancel_after, max_tokens = rng.random() < 0.6, None, rng.choice((8, 16, 32, 64))
    if roll < 0.08:  # read a few tokens of a long answer, then hang up
        stream, cancel_after, max_tokens = True, float(rng.randint(1, 8)), 256
    elif roll < 0.10:  # a unary call abandoned long before it could be done
        stream, cancel_after, max_tokens = False, rng.uniform(*abandon_s), 900
    body: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens, "min_tokens": max_tokens, "ignore_eos": True,
                            "temperature": rng.choice((0.0, 0.8)), "seed": rng.randrange(1 << 16), "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if is_chat:
        body["messages"] = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    else:
        body["prompt"] = system + " " + question
    path = "/v1/chat/completions" if is_chat else "/v1/completions"
    return Call(path, json.dumps(body).encode(), stream, max_tokens, cancel_after)


def _invalid_call(kind: int) -> Call:
    base: dict[str, Any] = {"model": MODEL, "prompt": "hello there", "max_tokens": 8}
    if kind == 0:
        body = json.dumps({**base, "max_tokens": 0}).encode()
    elif kind == 1:
        body = json.dumps({**base, "temperature": -1.0}).encode()
    elif kind == 2:  # longer than the model's context
        body = json.dumps({**base, "prompt": " ".join(WORDS[i % len(WORDS)] for i in range(3000))}).encode()
    else:
        body = b'{"model": "' + MODEL.encode() + b'", "prompt": '  # cut short: not JSON
    return Call("/v1/completions", body, False, 8, is_invalid=True)


async def send(client: httpx.AsyncClient, call: Call, timeout_s: float) -> tuple[str, bool]:
    """The client's outcome (ok, cancelled, unsent, invalid, refused, error, timeout, not-400) and
    whether an ok answer carried fewer tokens than asked."""
    headers = {"content-type": "application/json"}
    try:
        async with asyncio.timeout(timeout_s):
            if not call.stream:
                if call.cancel_after is None:
                    return _unary_outcome(call, await client.post(call.path, content=call.body, headers=headers))
                return await _abandoned(client, call, headers)
            async with client.stream("POST", call.path, content=call.body, headers=headers) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    return _status_outcome(call, resp.status_code), False
                return await _read_stream(call, resp)
    except TimeoutError:
        return "timeout", False
    except httpx.TransportError:
        return "error", False


async def _abandoned(client: httpx.AsyncClient, call: Call, headers: dict[str, str]) -> tuple[str, bool]:
    """A unary call the client hangs up on after `cancel_after` seconds: "unsent" when nothing of
    it was written by then (no connection yet, during a fault: the server never sees it, so it
    is not one of the requests sent), else "cancelled" -- once it has been written whole, never
    in the middle of writing it, which the server could see or not (a request counted on one
    side only)."""
    writing, written = asyncio.Event(), asyncio.Event()

    async def trace(event: str, info: dict[str, Any]) -> None:
        if event.endswith(".send_request_headers.started"):  # the first byte is about to go
            writing.set()
        elif event.endswith(".send_request_body.complete"):
            written.set()

    post = asyncio.ensure_future(client.post(call.path, content=call.body, headers=headers,
                                             extensions={"trace": trace}))  # fmt: skip
    whole = asyncio.ensure_future(written.wait())
    try:
        await asyncio.wait({post}, timeout=call.cancel_after)
        if not post.done() and writing.is_set():
            await asyncio.wait({post, whole}, return_when=asyncio.FIRST_COMPLETED)
        if post.done():
            return _unary_outcome(call, post.result())
        return ("cancelled" if writing.is_set() else "unsent"), False
    finally:
        for task in (post, whole):
            task.cancel()
        await asyncio.gather(post, whole, return_exceptions=True)


def _status_outcome(call: Call, status: int) -> str:
    if call.is_invalid:
        return "invalid" if status == 400 else "not-400"
    return "error" if status >= 500 and status != 503 else "refused"


def _unary_outcome(call: Call, resp: httpx.Response) -> tuple[str, bool]:
    if resp.status_code != 200:
        return _status_outcome(call, resp.status_code), False
    if call.is_invalid:
        return "not-400", False
    return "ok", resp.json()["usage"]["completion_tokens"] != call.max_tokens


async def _read_stream(call: Call, resp: httpx.Response) -> tuple[str, bool]:
    decoder, num_chunks, failed, tokens = SSEDecoder(), 0, False, -1
    async for line in resp.aiter_lines():
        data = decoder.feed(line)
        if data is None:
            continue
        if data.strip() == "[DONE]":
            return ("error", False) if failed else ("ok", tokens != call.max_tokens)
        obj = json.loads(data)
        failed = failed or "error" in obj
        if obj.get("usage"):
            tokens = obj["usage"]["completion_tokens"]
        if obj.get("choices"):
            num_chunks += 1
            if call.cancel_after is not None and num_chunks >= call.cancel_after:
                return "cancelled", False  # leaving the block closes the connection mid-stream
    return "error", False  # the stream broke off without [DONE]


async def load(url: str, cfg: LoadConfig, stop_at: float, tally: Counter[str]) -> None:
    prompts = Prompts(cfg.seed)
    limits = httpx.Limits(max_connections=cfg.concurrency * 2, max_keepalive_connections=cfg.concurrency)
    async with httpx.AsyncClient(base_url=url, limits=limits, trust_env=False, timeout=cfg.request_timeout_s) as client:

        async def one_client() -> None:
            while tally["sent"] < cfg.max_requests and time.monotonic() < stop_at:
                call = make_call(tally["sent"], cfg.seed, prompts, cfg.abandon_s)
                tally["sent"] += 1
                outcome, is_short = await send(client, call, cfg.request_timeout_s)
                tally[outcome] += 1
                tally["short"] += is_short
                if outcome == "cancelled":
                    tally["cancelled-stream" if call.stream else "cancelled-unary"] += 1

        await asyncio.gather(*(one_client() for _ in range(cfg.concurrency)))


