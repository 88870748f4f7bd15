"""Response shapes of the OpenAI API, from StepOutputs (no I/O here).

With tool calls parsed (cluster.edge.tool_calls), each chat choice's text goes through its own
ToolCallParser: content and `tool_calls` deltas (index; id, type and name first, then argument
fragments) in a stream, a `message.tool_calls` list in a body, and finish_reason "tool_calls"
when the output ended after a call."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii as _json_str  # what json.dumps uses for a str
from typing import Any

from cluster.edge.tool_calls import Parsed, ToolCallParser, ToolUse, finish_reason
from cluster.errors import EdgeError
from engine.outputs import StepOutput, TokenLogprobs
from engine.request import NOT_CACHED, CachedTokens

TokenText = Callable[[int], str]


def error_body(err: EdgeError) -> dict[str, Any]:
    return err.openai_body()


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


@dataclass(slots=True)
class ChoiceState:
    """What one choice has produced so far (for non-streaming bodies and usage)."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached: CachedTokens = NOT_CACHED
    completion_tokens: int = 0

    def add(self, out: StepOutput) -> None:
        self.text.append(out.text)
        self.token_ids.extend(out.token_ids)
        self.logprobs.extend(out.logprobs)
        self.prompt_tokens = out.num_prompt_tokens
        self.cached = out.cached
        self.completion_tokens = out.num_output_tokens
        if out.finish_reason is not None:
            self.finish_reason = out.finish_reason.openai_name


def usage(choices: Sequence[ChoiceState], prompts: int) -> dict[str, Any]:
    # Each prompt counts once even when n > 1 fans it out (as OpenAI reports it).
    per_prompt = len(choices) // max(prompts, 1)
    prompt_tokens = sum(c.prompt_tokens for c in choices[::per_prompt]) if choices else 0
    cached = [sum(tokens) for tokens in zip(*(c.cached for c in choices[::per_prompt]), strict=True)]
    device, host, disk, remote = cached or NOT_CACHED
    completion = sum(c.completion_tokens for c in choices)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        # OpenAI's cached_tokens, then baton's: the tier each cached page was found in, and how
        # many of those tokens another worker's cache held (a prefill worker's, shipped here).
        "prompt_tokens_details": {
            "cached_tokens": device + host + disk,
            "cached_tokens_by_tier": {"device": device, "host": host, "disk": disk},
            "cached_tokens_remote": remote,
        },
    }


def completion_logprobs(items: Sequence[TokenLogprobs], token_text: TokenText, offset: int) -> dict[str, Any]:
    """The legacy completions format: parallel lists."""
    tokens, values, tops, offsets = [], [], [], []
    for lp in items:
        text = token_text(lp.token_id)
        tokens.append(text)
        values.append(lp.logprob)
        tops.append({token_text(t): v for t, v in lp.top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(items: Sequence[TokenLogprobs], token_text: TokenText) -> dict[str, Any]:
    def entry(token_id: int, value: float) -> dict[str, Any]:
        text = token_text(token_id)
        return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8", "replace"))}

    return {
        "content": [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
            for lp in items
        ]
    }


class Renderer:
    """Builds completion or chat bodies/chunks for one call."""

    def __init__(self, chat: bool, call_id: str, model: str, created: int, token_text: TokenText,
                 want_logprobs: bool, want_token_ids: bool = False, tools: ToolUse | None = None) -> None:
        self.chat = chat
        self.tools = tools if chat and tools is not None and tools.is_parsed else None
        self._parsers: dict[int, ToolCallParser] = {}  # a stream's, per choice
        self.id = call_id
        self.model = model
        self.created = created
        self.token_text = token_text
        self.want_logprobs = want_logprobs
        self.want_token_ids = want_token_ids
        self._offsets: dict[int, int] = {}
        obj = "chat.completion.chunk" if chat else "text_completion"
        # what every chunk of this call begins with, up to its choice's index (chunk_sse)
        self._chunk_head = (f'data: {{"id":{_json_str(call_id)},"object":"{obj}","created":{created:d},'
                            f'"model":{_json_str(model)},"choices":[{{"index":')

    def _envelope(self, chunk: bool) -> dict[str, Any]:
        obj = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def chunk(self, index: int, out: StepOutput | None, first: bool) -> dict[str, Any] | None:
        """One SSE chunk; None when it would say nothing (text held back by a tool-call parser)."""
        finish = out.finish_reason.openai_name if out and out.finish_reason is not None else None
        text = out.text if out else ""
        logprobs = None
        if self.want_logprobs and out is not None and out.logprobs:
            if self.chat:
                logprobs = chat_logprobs(out.logprobs, self.token_text)
            else:
                offset = self._offsets.get(index, 0)
                logprobs = completion_logprobs(out.logprobs, self.token_text, offset)
                self._offsets[index] = offset + len(text)
        if self.chat:
            if self.tools is not None:
                delta, finish = self._tool_delta(self.tools, index, text, first, finish)
            else:
                delta = {"role": "assistant", "content": text} if first else {"content": text}
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        if self.want_token_ids:
            choice["token_ids"] = list(out.token_ids) if out else []
        elif not choice.get("delta", True) and finish is None and logprobs is None:
            return None
        return {**self._envelope(True), "choices": [choice]}

    def chunk_sse(self, index: int, out: StepOutput, first: bool) -> bytes | None:
        """`sse(self.chunk(index, out, first))`, the same bytes: a token's chunk in the common
        case (no finish reason, logprobs or tool calls) is written into the call's template
        rather than built as a dict and serialized, for every token of every stream."""
        if out.finish_reason is not None or self.tools is not None or (self.want_logprobs and out.logprobs):
            chunk = self.chunk(index, out, first)
            return None if chunk is None else sse(chunk)
        text = _json_str(out.text)
        ids = f',"token_ids":[{",".join(map(str, out.token_ids))}]' if self.want_token_ids else ""
        if self.chat:
            role = '"role":"assistant",' if first else ""
            choice = f'"delta":{{{role}"content":{text}}}'
        else:
            choice = f'"text":{text}'
        return f'{self._chunk_head}{index:d},{choice},"logprobs":null,"finish_reason":null{ids}}}]}}\n\n'.encode()

    def _tool_delta(
        self, tools: ToolUse, index: int, text: str, first: bool, finish: str | None
    ) -> tuple[dict[str, Any], str | None]:
        parser = self._parsers.get(index)
        if parser is None:
            parser = self._parsers[index] = tools.parser()
        parsed = parser.feed(text)
        if finish is not None:
            parsed.content.extend(parser.finish().content)
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if parsed.content or first:
            delta["content"] = parsed.text if parsed.content or not parsed.calls else None
        if parsed.calls:
            delta["tool_calls"] = [c.to_openai() for c in parsed.calls]
        return delta, finish_reason(finish, parser)

    def usage_chunk(self, choices: Sequence[ChoiceState], prompts: int) -> dict[str, Any]:
        return {**self._envelope(True), "choices": [], "usage": usage(choices, prompts)}

    def body(self, choices: Sequence[ChoiceState], prompts: int) -> dict[str, Any]:
        rendered = []
        for index, c in enumerate(choices):
            text = "".join(c.text)
            logprobs = None
            if self.want_logprobs:
                logprobs = (
                    chat_logprobs(c.logprobs, self.token_text)
                    if self.chat else completion_logprobs(c.logprobs, self.token_text, 0)
                )
            if self.tools is not None:
                message, finish = _tool_message(self.tools.parser(), text, c.finish_reason)
                rendered.append({"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish})
            elif self.chat:
                message = {"role": "assistant", "content": text}
                rendered.append({"index": index, "message": message, "logprobs": logprobs,
                                 "finish_reason": c.finish_reason})
            else:
                rendered.append({"index": index, "text": text, "logprobs": logprobs,
                                 "finish_reason": c.finish_reason})
            if self.want_token_ids:
                rendered[-1]["token_ids"] = c.token_ids
        return {**self._envelope(False), "choices": rendered, "usage": usage(choices, prompts)}


def _tool_message(parser: ToolCallParser, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
    """A whole choice's message with its tool calls parsed out (the stream's parser, fed once)."""
    parsed = Parsed()
    for part in (parser.feed(text), parser.finish()):
        parsed.content.extend(part.content)
    message: dict[str, Any] = {"role": "assistant", "content": parsed.text or (None if parser.calls else "")}
    if parser.calls:
        message["tool_calls"] = [c.to_openai() for c in parser.calls]
    return message, finish_reason(finish, parser)
