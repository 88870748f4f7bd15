"""A small typed Python client of the gRPC API (`baton.v1.GenerationService`), sync and asyncio.

    with BatonClient("127.0.0.1:50051", model="baton-tiny", api_key=KEY) as client:
        for delta in client.generate("Once upon", sampling=Sampling(max_tokens=32)):
            print(delta.text, end="")

    async with AsyncBatonClient(...) as client:
        async with contextlib.aclosing(client.generate(...)) as deltas:
            async for delta in deltas: ...

Structured output and tool calls:

    client.complete("Name:", sampling=Sampling(max_tokens=64, json_schema=json.dumps(schema)))
    client.complete(messages=[Message("user", "Weather in Paris?")],
                    tools=Tools((Tool("get_weather", parameters=json.dumps(params)),), choice="required"))
        -> Completion(text=content, tool_calls=(ToolCall(id, "get_weather", '{"city": ...}'),), ...)

Serving options (several samples, a session key that keeps a conversation where its pages
are, a cache salt, an SLO class) and prefix pins (operator keys):

    client.complete(prompt, sampling=..., options=Options(n=4, session_id="conv-17"))
        -> Completion(..., choices=(Choice(0, ...), ..., Choice(3, ...)))
    client.pin_prefix(system_prompt, pin_id="sys", ttl_s=3600, tenant="acme")

Values are frozen dataclasses, not protobuf messages, so callers do not depend on the
generated stubs. Every failure is a BatonClientError carrying the gRPC status code, the
server's message and, when the server is overloaded, how long to wait before retrying.
Leaving a stream early cancels the call, which aborts the request on the server.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Generator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from batonpb.baton.v1 import generation_pb2 as pb
from batonpb.baton.v1 import generation_pb2_grpc as pb_grpc

_FINISH_NAMES = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
    pb.FINISH_REASON_TOOL_CALLS: "tool_calls",
}
_TOOL_CHOICES = {
    "auto": pb.TOOL_CHOICE_UNSPECIFIED,  # unset: auto on servers from before TOOL_CHOICE_AUTO too
    "none": pb.TOOL_CHOICE_NONE,
    "required": pb.TOOL_CHOICE_REQUIRED,
    "function": pb.TOOL_CHOICE_FUNCTION,
}
_CONSTRAINTS = ("json_schema", "regex", "grammar")
_SLO_CLASSES = {"standard": pb.SLO_CLASS_UNSPECIFIED, "latency": pb.SLO_CLASS_LATENCY, "batch": pb.SLO_CLASS_BATCH}
_ROLES = {"": pb.WORKER_ROLE_UNSPECIFIED, "prefill": pb.WORKER_ROLE_PREFILL, "decode": pb.WORKER_ROLE_DECODE}
# Generate's request or Complete's: the same fields (proto/baton/v1/generation.proto)
Request = TypeVar("Request", pb.GenerateRequest, pb.CompleteRequest)


@dataclass(frozen=True, slots=True)
class Sampling:
    """Sampling fields; None means the server's default (max_tokens: the rest of the context).
    The server checks the bounds (see proto/baton/v1/generation.proto)."""

    max_tokens: int | None = None
    min_tokens: int = 0
    temperature: float | None = None  # default 1.0; 0 is greedy
    top_p: float | None = None
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]) pairs
    # Structured output (at most one): any JSON object, a JSON schema (JSON text), a regex the
    # whole output matches, or a Lark grammar (llguidance's). Bounds: see the .proto.
    json_object: bool = False
    json_schema: str | None = None
    regex: str | None = None
    grammar: str | None = None


@dataclass(frozen=True, slots=True)
class Options:
    """How the request is served (the server bounds them; see the .proto)."""

    n: int = 1  # independent samples of the prompt (sharing its cached pages), up to 16
    session_id: str = ""  # a conversation's key: its requests prefer the worker holding its pages
    cache_salt: str = ""  # only this tenant's requests with the same salt share cached pages
    slo_class: str = "standard"  # "latency" (when the server allows callers to set it) or "batch"


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str  # "call_..."
    name: str
    arguments: str  # JSON text


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A piece of a streamed tool call: the first of each call has id and name, the next ones
    fragments of its arguments."""

    index: int
    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class Tool:
    name: str  # [A-Za-z0-9_-]{1,64}
    parameters: str = ""  # the arguments' JSON schema (an object) as JSON text; "": none
    description: str = ""


@dataclass(frozen=True, slots=True)
class Tools:
    """Functions the model may call (chat only). choice: "auto", "none", "required", or
    "function" (call `function`, once); parallel False: at most one call."""

    tools: tuple[Tool, ...]
    choice: str = "auto"
    function: str | None = None
    parallel: bool = True


@dataclass(frozen=True, slots=True)
class Message:
    role: str  # system, developer, user, assistant or tool
    content: str
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant turn's calls
    tool_call_id: str = ""  # a tool turn: the call it answers


@dataclass(frozen=True, slots=True)
class Logprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token_id, logprob), most likely first


@dataclass(frozen=True, slots=True)
class CachedTokens:
    """Where the cached prompt tokens were found; `remote` of them in another worker's cache."""

    device: int = 0
    host: int = 0
    disk: int = 0
    remote: int = 0


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cached: CachedTokens = CachedTokens()


@dataclass(frozen=True, slots=True)
class Delta:
    """One streamed step; finish_reason and usage are set on the last one only."""

    request_id: str  # on the first delta only
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[Logprob, ...]
    finish_reason: str | None  # "stop", "length", "abort" or "tool_calls"
    usage: Usage | None
    tool_calls: tuple[ToolCallDelta, ...] = ()  # with tools (their text is not in `text`)
    index: int = 0  # which sample (Options.n); each sample ends with its own finish_reason


@dataclass(frozen=True, slots=True)
class Choice:
    """One sample of a Completion with Options.n > 1."""

    index: int
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[Logprob, ...]
    finish_reason: str | None
    tool_calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True, slots=True)
class Completion:
    request_id: str
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[Logprob, ...]
    finish_reason: str | None
    usage: Usage | None  # the prompt once, completion tokens of every sample
    tool_calls: tuple[ToolCall, ...] = ()  # with tools: `text` is the content
    choices: tuple[Choice, ...] = ()  # with Options.n > 1: every sample (the fields above are the first's)


@dataclass(frozen=True, slots=True)
class Pin:
    """A pinned prefix (operator keys): what each worker said ("held", "computing" or why not)."""

    pin_id: str
    tenant: str
    num_tokens: int
    num_pages: int
    workers: dict[str, str]


class BatonClientError(Exception):
    def __init__(
        self, code: grpc.StatusCode, message: str, retry_after_s: float | None = None
    ) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s  # set when the server asks to retry later


# -- shared by both clients -------------------------------------------------------------------


def build_request(
    kind: type[Request], model: str, prompt: str | Sequence[int] | None,
    messages: Sequence[Message] | None, sampling: Sampling | None, tools: Tools | None = None,
    options: Options | None = None,
) -> Request:
    """The request message of `kind` (GenerateRequest or CompleteRequest); a value protobuf
    cannot hold (a negative count) is INVALID_ARGUMENT."""
    try:
        opts = options or Options()
        if opts.slo_class not in _SLO_CLASSES:
            raise ValueError(f"slo_class must be one of {', '.join(_SLO_CLASSES)}, got {opts.slo_class!r}")
        request = kind(model=model, sampling=_sampling(sampling or Sampling()), n=opts.n, session_id=opts.session_id,
                       cache_salt=opts.cache_salt, slo_class=_SLO_CLASSES[opts.slo_class])  # fmt: skip
        if messages is not None:
            request.chat = True
            request.messages.extend(_message(m) for m in messages)
        if isinstance(prompt, str):
            request.text = prompt
        elif prompt is not None:
            request.token_ids.ids.extend(prompt)
        if tools is not None:
            _tools(request, tools)
    except (TypeError, ValueError) as exc:
        raise BatonClientError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
    return request


def _message(m: Message) -> pb.ChatMessage:
    calls = [pb.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in m.tool_calls]
    return pb.ChatMessage(role=m.role, content=m.content, tool_calls=calls, tool_call_id=m.tool_call_id)


def _tools(request: pb.GenerateRequest | pb.CompleteRequest, tools: Tools) -> None:
    if tools.choice not in _TOOL_CHOICES:
        raise ValueError(f"tool choice must be one of {', '.join(_TOOL_CHOICES)}, got {tools.choice!r}")
    request.tools.extend(
        pb.Tool(name=t.name, description=t.description, parameters=t.parameters) for t in tools.tools
    )
    request.tool_choice = _TOOL_CHOICES[tools.choice]
    request.tool_function = tools.function or ""
    request.parallel_tool_calls = tools.parallel


def _sampling(s: Sampling) -> pb.Sampling:
    msg = pb.Sampling(
        min_tokens=s.min_tokens, top_k=s.top_k, min_p=s.min_p, presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty, stop=s.stop, stop_token_ids=s.stop_token_ids,
        ignore_eos=s.ignore_eos, logit_bias=dict(s.logit_bias),
    )
    # proto3 `optional` fields: set only when given, so absence keeps the server's default.
    for name in ("max_tokens", "temperature", "top_p", "repetition_penalty", "seed", "logprobs"):
        value = getattr(s, name)
        if value is not None:
            setattr(msg, name, value)
    given = [name for name in _CONSTRAINTS if getattr(s, name) is not None] + ["json_object"] * s.json_object
    if len(given) > 1:
        raise ValueError(f"set at most one output constraint, got {', '.join(given)}")
    for name in given:
        setattr(msg, name, True if name == "json_object" else getattr(s, name))
    return msg


def _logprobs(items: Sequence[pb.TokenLogprob]) -> tuple[Logprob, ...]:
    return tuple(
        Logprob(lp.token_id, lp.logprob, tuple((t.token_id, t.logprob) for t in lp.top))
        for lp in items
    )


def _usage(msg: pb.GenerateResponse | pb.CompleteResponse) -> Usage | None:
    if not msg.HasField("usage"):
        return None
    u, c = msg.usage, msg.usage.cached
    return Usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens, CachedTokens(c.device, c.host, c.disk, c.remote))


def to_delta(msg: pb.GenerateResponse) -> Delta:
    return Delta(
        msg.request_id, tuple(msg.token_ids), msg.text, _logprobs(msg.logprobs),
        _FINISH_NAMES.get(msg.finish_reason), _usage(msg),
        tuple(ToolCallDelta(d.index, d.id, d.name, d.arguments) for d in msg.tool_calls), msg.index,
    )


def _calls(msg: pb.CompleteResponse | pb.CompleteChoice) -> tuple[ToolCall, ...]:
    return tuple(ToolCall(c.id, c.name, c.arguments) for c in msg.tool_calls)


def to_completion(msg: pb.CompleteResponse) -> Completion:
    choices = tuple(Choice(c.index, tuple(c.token_ids), c.text, _logprobs(c.logprobs),
                           _FINISH_NAMES.get(c.finish_reason), _calls(c)) for c in msg.choices)  # fmt: skip
    return Completion(
        msg.request_id, tuple(msg.token_ids), msg.text, _logprobs(msg.logprobs),
        _FINISH_NAMES.get(msg.finish_reason), _usage(msg), _calls(msg), choices,
    )


def pin_request(
    model: str, prefix: str | Sequence[int], pin_id: str, ttl_s: float, tenant: str, role: str
) -> pb.PinPrefixRequest:
    try:
        if role not in _ROLES:
            raise ValueError(f"role must be one of prefill, decode or '', got {role!r}")
        request = pb.PinPrefixRequest(model=model, pin_id=pin_id, tenant=tenant, ttl_seconds=round(ttl_s),
                                      role=_ROLES[role])  # fmt: skip
        if isinstance(prefix, str):
            request.text = prefix
        else:
            request.token_ids.ids.extend(prefix)
    except (TypeError, ValueError) as exc:
        raise BatonClientError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
    return request


def to_pin(msg: pb.PinPrefixResponse) -> Pin:
    return Pin(msg.pin_id, msg.tenant, msg.num_tokens, msg.num_pages, {w.worker: w.state for w in msg.workers})


def client_error(exc: grpc.RpcError) -> BatonClientError:
    """The error of a failed call, with the server's retry hint when it sent one."""
    if not isinstance(exc, grpc.Call | grpc.aio.AioRpcError):  # every call's error is one
        return BatonClientError(grpc.StatusCode.UNKNOWN, str(exc))
    trailing = exc.trailing_metadata() or ()
    return BatonClientError(exc.code(), exc.details() or "", retry_after(trailing))


def retry_after(metadata: Sequence[tuple[str, Any]]) -> float | None:
    values = {key: value for key, value in metadata if isinstance(value, str)}
    try:
        if "grpc-retry-pushback-ms" in values:
            return int(values["grpc-retry-pushback-ms"]) / 1000
        if "retry-after" in values:
            return float(values["retry-after"])
    except ValueError:
        return None
    return None


@dataclass(frozen=True, slots=True)
class _Connection:
    metadata: tuple[tuple[str, str], ...]
    options: tuple[tuple[str, int], ...]
    credentials: grpc.ChannelCredentials | None


def _connection(
    api_key: str | None, tls: bool, root_certificates: bytes | None, max_message_bytes: int
) -> _Connection:
    metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
    options = (
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    )
    use_tls = tls or root_certificates is not None
    credentials = grpc.ssl_channel_credentials(root_certificates) if use_tls else None
    return _Connection(metadata, options, credentials)


# -- the clients --------------------------------------------------------------------------------

Prompt = str | Sequence[int] | None  # text, or token ids; None with `messages`


class BatonClient:
    """Blocking client over a grpc.Channel (thread-safe, like the channel)."""

    def __init__(
        self, target: str, *, model: str, api_key: str | None = None,
        timeout_s: float | None = None, tls: bool = False, root_certificates: bytes | None = None,
        max_message_bytes: int = 64 << 20,
    ) -> None:
        conn = _connection(api_key, tls, root_certificates, max_message_bytes)
        if conn.credentials is None:
            self.channel = grpc.insecure_channel(target, options=conn.options)
        else:
            self.channel = grpc.secure_channel(target, conn.credentials, options=conn.options)
        self._stub = pb_grpc.GenerationServiceStub(self.channel)
        self._metadata = conn.metadata
        self.model = model
        self.timeout_s = timeout_s

    def generate(
        self, prompt: Prompt = None, *, messages: Sequence[Message] | None = None,
        sampling: Sampling | None = None, timeout_s: float | None = None, tools: Tools | None = None,
        options: Options | None = None,
    ) -> Generator[Delta, None, None]:
        request = build_request(pb.GenerateRequest, self.model, prompt, messages, sampling, tools, options)
        call = self._stub.Generate(request, **self._call(timeout_s))
        try:
            for msg in call:
                yield to_delta(msg)
        except grpc.RpcError as exc:
            raise client_error(exc) from None
        finally:
            call.cancel()  # a no-op once finished; aborts the request if the caller left early

    def complete(
        self, prompt: Prompt = None, *, messages: Sequence[Message] | None = None,
        sampling: Sampling | None = None, timeout_s: float | None = None, tools: Tools | None = None,
        options: Options | None = None,
    ) -> Completion:
        request = build_request(pb.CompleteRequest, self.model, prompt, messages, sampling, tools, options)
        try:
            return to_completion(self._stub.Complete(request, **self._call(timeout_s)))
        except grpc.RpcError as exc:
            raise client_error(exc) from None

    def pin_prefix(
        self, prefix: str | Sequence[int], *, pin_id: str, ttl_s: float, tenant: str = "", role: str = "",
        timeout_s: float | None = None,
    ) -> Pin:
        """Keep a prefix's pages resident for `tenant` (an operator key's call); returns once
        the workers hold them."""
        request = pin_request(self.model, prefix, pin_id, ttl_s, tenant, role)
        try:
            return to_pin(self._stub.PinPrefix(request, **self._call(timeout_s)))
        except grpc.RpcError as exc:
            raise client_error(exc) from None

    def unpin_prefix(self, pin_id: str, *, tenant: str = "", timeout_s: float | None = None) -> bool:
        """Release a pin; False when there was none."""
        request = pb.UnpinPrefixRequest(model=self.model, pin_id=pin_id, tenant=tenant)
        try:
            return bool(self._stub.UnpinPrefix(request, **self._call(timeout_s)).released)
        except grpc.RpcError as exc:
            raise client_error(exc) from None

    def tokenize(
        self, text: str, *, add_special_tokens: bool = True, timeout_s: float | None = None
    ) -> list[int]:
        request = pb.TokenizeRequest(
            model=self.model, text=text, add_special_tokens=add_special_tokens
        )
        try:
            return list(self._stub.Tokenize(request, **self._call(timeout_s)).token_ids)
        except grpc.RpcError as exc:
            raise client_error(exc) from None

    def detokenize(self, token_ids: Sequence[int], *, timeout_s: float | None = None) -> str:
        """The text of `token_ids` (special tokens kept)."""
        request = pb.DetokenizeRequest(model=self.model, token_ids=token_ids)
        try:
            return str(self._stub.Detokenize(request, **self._call(timeout_s)).text)
        except grpc.RpcError as exc:
            raise client_error(exc) from None

    def _call(self, timeout_s: float | None) -> dict[str, Any]:
        return {"metadata": self._metadata, "timeout": timeout_s or self.timeout_s}

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> BatonClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class AsyncBatonClient:
    """asyncio client over a grpc.aio channel; use it from one event loop."""

    def __init__(
        self, target: str, *, model: str, api_key: str | None = None,
        timeout_s: float | None = None, tls: bool = False, root_certificates: bytes | None = None,
        max_message_bytes: int = 64 << 20,
    ) -> None:
        conn = _connection(api_key, tls, root_certificates, max_message_bytes)
        if conn.credentials is None:
            self.channel = grpc.aio.insecure_channel(target, options=conn.options)
        else:
            self.channel = grpc.aio.secure_channel(target, conn.credentials, options=conn.options)
        self._stub = pb_grpc.GenerationServiceStub(self.channel)
        self._metadata = conn.metadata
        self.model = model
        self.timeout_s = timeout_s

    async def generate(
        self, prompt: Prompt = None, *, messages: Sequence[Message] | None = None,
        sampling: Sampling | None = None, timeout_s: float | None = None, tools: Tools | None = None,
        options: Options | None = None,
    ) -> AsyncGenerator[Delta, None]:
        """Stream deltas. Close it (contextlib.aclosing) to cancel the call when leaving early."""
        request = build_request(pb.GenerateRequest, self.model, prompt, messages, sampling, tools, options)
        call = self._stub.Generate(request, **self._call(timeout_s))
        try:
            async for msg in call:
                yield to_delta(msg)
        except grpc.RpcError as exc:
            raise client_error(exc) from None
        finally:
            call.cancel()

    async def complete(
        self, prompt: Prompt = None, *, messages: Sequence[Message] | None = None,
        sampling: Sampling | None = None, timeout_s: float | None = None, tools: Tools | None = None,
        options: Options | None = None,
    ) -> Completion:
        request = build_request(pb.CompleteRequest, self.model, prompt, messages, sampling, tools, options)
        try:
            return to_completion(await self._stub.Complete(request, **self._call(timeout_s)))
        except grpc.RpcError as exc:
            raise client_error(exc) from None

    async def pin_prefix(
        self, prefix: str | Sequence[int], *, pin_id: str, ttl_s: float, tenant: str = "", role: str = "",
        timeout_s: float | None = None,
    ) -> Pin:
        """Keep a prefix's pages resident for `tenant` (an operator key's call); returns once
        the workers hold them."""
        request = pin_request(self.model, prefix, pin_id, ttl_s, tenant, role)
        try:
            return to_pin(await self._stub.PinPrefix(request, **self._call(timeout_s)))
        except grpc.RpcError as exc:
            raise client_error(exc) from None

    async def unpin_prefix(self, pin_id: str, *, tenant: str = "", timeout_s: float | None = None) -> bool:
        """Release a pin; False when there was none."""
        request = pb.UnpinPrefixRequest(model=self.model, pin_id=pin_id, tenant=tenant)
        try:
            return bool((await self._stub.UnpinPrefix(request, **self._call(timeout_s))).released)
        except grpc.RpcError as exc:
            raise client_error(exc) from None

    async def tokenize(
        self, text: str, *, add_special_tokens: bool = True, timeout_s: float | None = None
    ) -> list[int]:
        request = pb.TokenizeRequest(
            model=self.model, text=text, add_special_tokens=add_special_tokens
        )
        try:
            return list((await self._stub.Tokenize(request, **self._call(timeout_s))).token_ids)
        except grpc.RpcError as exc:
            raise client_error(exc) from None

    async def detokenize(self, token_ids: Sequence[int], *, timeout_s: float | None = None) -> str:
        """The text of `token_ids` (special tokens kept)."""
        request = pb.DetokenizeRequest(model=self.model, token_ids=token_ids)
        try:
            return str((await self._stub.Detokenize(request, **self._call(timeout_s))).text)
        except grpc.RpcError as exc:
            raise client_error(exc) from None

    def _call(self, timeout_s: float | None) -> dict[str, Any]:
        return {"metadata": self._metadata, "timeout": timeout_s or self.timeout_s}

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncBatonClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
