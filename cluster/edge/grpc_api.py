"""The gRPC API: `baton.v1.GenerationService` (proto/baton/v1/generation.proto) on grpc.aio.

One call, the same internal path as the HTTP API (cluster/edge/frontend.py):

    key     = `authorization: Bearer <key>` or `x-api-key`  -> keys.lookup   (UNAUTHENTICATED)
    bounds  = model, prompt / messages, sampling fields      (INVALID_ARGUMENT, NOT_FOUND)
              (cluster.edge.grpc_fields), constraint and tools (cluster.edge.grpc_output)
    ticket  = frontend.admit()                               (RESOURCE_EXHAUSTED + retry metadata)
    req     = frontend.prepare(tokenize(prompt), sampling, tenant, deadline of the call)
    frontend.check_tenant(ticket, req)
    frontend.prepare_constraint(req.job.sampling, field)     (INVALID_ARGUMENT: does not compile)
    async for out in frontend.stream(req, ticket, "grpc"): context.write(delta)

With tools, a reply's `text` is the content and its tool calls come apart (cluster.edge.tool_calls).

Handlers are coroutines that write with `context.write`, not async generators: when the
client cancels or the deadline passes, grpc.aio cancels the handler's task, and the
CancelledError then lands inside our own `await`, so `aclosing` closes the frontend stream at
once (its `finally` aborts the engine request and frees its pages). An async-generator handler
suspended at `yield` would instead be closed only whenever the garbage collector gets to it.

Tracing (cluster.ops.tracing, when configured): Generate and Complete each open a `baton.request`
span before anything is checked; its parent is the `traceparent` metadata the client sent.

A call whose model the gateway routes to an external pool goes there (cluster.edge.grpc_gateway).
The server around the service, with health and reflection, is cluster.edge.grpc_server.

The service's name before issue 24, `baton.v1.Generation`, is still served by the same handlers
for the clients built on it (LEGACY_SERVICE_NAME: deprecated, not in reflection, no health
status). Its Complete sent a GenerateRequest, and the new one a CompleteRequest: the two are
wire-identical (the proto keeps their fields the same), so Complete parses either as a
GenerateRequest and one handler serves Generate and Complete alike.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any, NoReturn, TypeVar, cast

import grpc

from batonpb.baton.v1 import generation_pb2 as pb
from batonpb.baton.v1 import generation_pb2_grpc as pb_grpc
from cluster.edge.admission import Ticket
from cluster.edge.constraint_fields import OutputSpec
from cluster.edge.frontend import CacheHints, Frontend, GenerateRequest, allowed_slo, merge_streams
from cluster.edge.grpc_fields import (
    MAX_MODEL_NAME_CHARS,
    MAX_PRIORITY,
    MAX_PROMPT_CHARS,
    MAX_PROMPT_TOKENS,
    build_sampling,
    check_parsed,
    check_prompt,
    num_samples,
)
from cluster.edge.grpc_gateway import (
    call_pool,
    detokenize_at_pool,
    output_watch,
    own_route,
    route_key,
    tokenize_at_pool,
)
from cluster.edge.grpc_output import (
    FINISH,
    delta,
    ended_in_calls,
    logprob,
    output_spec,
    split_tool_calls,
    template_messages,
    usage,
)
from cluster.edge.tenants import ApiKeys, Tenant
from cluster.edge.tokenize_api import off_loop
from cluster.errors import EdgeError, Kind, classify, invalid
from cluster.gateway.endpoints import Pool
from cluster.gateway.router import Route
from cluster.gateway.tokenize_proxy import external_pool
from cluster.ops.tracing import NO_SPAN, NO_TRACE, RequestTrace, Span
from engine.outputs import StepOutput
from engine.request import SloClass
from engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

SERVICE = pb.DESCRIPTOR.services_by_name["GenerationService"]
SERVICE_NAME = SERVICE.full_name  # "baton.v1.GenerationService"
LEGACY_SERVICE_NAME = f"{pb.DESCRIPTOR.package}.Generation"  # deprecated: the module docstring
_ROLES = {pb.WORKER_ROLE_UNSPECIFIED: "", pb.WORKER_ROLE_PREFILL: "prefill", pb.WORKER_ROLE_DECODE: "decode"}
_SLO_CLASSES = {pb.SLO_CLASS_UNSPECIFIED: SloClass.STANDARD, pb.SLO_CLASS_STANDARD: SloClass.STANDARD,
                pb.SLO_CLASS_LATENCY: SloClass.LATENCY, pb.SLO_CLASS_BATCH: SloClass.BATCH}

T = TypeVar("T")

# The edge's error kinds are named after gRPC's status codes.
_CODES = {kind: grpc.StatusCode[kind.name] for kind in Kind}


class GenerationService(pb_grpc.GenerationServiceServicer):
    def __init__(
        self, frontend: Frontend, keys: ApiKeys, allow_priority_field: bool = False, name: str = SERVICE_NAME
    ) -> None:
        self.frontend = frontend
        self.keys = keys
        self.allow_priority_field = allow_priority_field  # callers may set `priority` (else their key's)
        self.name = name  # the service name it is served under (a trace's route)

    # grpc.aio accepts a coroutine that writes with context.write for a streaming method; the
    # generated stub types only the iterator form (see the module docstring for why).
    async def Generate(  # type: ignore[override]
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        with self._trace("Generate", context) as trace:
            await _guarded(context, self._generate(request, context, trace), trace)

    async def Complete(  # type: ignore[override]  # its CompleteRequest, parsed as a GenerateRequest
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> pb.CompleteResponse:
        with self._trace("Complete", context) as trace:
            return await _guarded(context, self._complete(request, context, trace), trace)

    async def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        return await _guarded(context, self._tokenize(request, context))

    async def Detokenize(
        self, request: pb.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.DetokenizeResponse:
        return await _guarded(context, self._detokenize(request, context))

    async def PinPrefix(
        self, request: pb.PinPrefixRequest, context: grpc.aio.ServicerContext
    ) -> pb.PinPrefixResponse:
        return await _guarded(context, self._pin(request, context))

    async def UnpinPrefix(
        self, request: pb.UnpinPrefixRequest, context: grpc.aio.ServicerContext
    ) -> pb.UnpinPrefixResponse:
        return await _guarded(context, self._unpin(request, context))

    # -- the calls --------------------------------------------------------------------------

    async def _generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext, trace: RequestTrace
    ) -> None:
        route = await self._route(request, context)
        if route is not None and not route.is_own:
            await call_pool(self.frontend, route, request, context)
            return
        with own_route(self.frontend.gateway, route):
            await self._generate_here(request, context, trace, output_watch(self.frontend.gateway, route))

    async def _generate_here(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext, trace: RequestTrace,
        on_output: Callable[[], None] | None = None,
    ) -> None:
        reqs, tickets, spec = await self._open(request, context, trace)
        parsers = [spec.tools.parser() if spec.tools is not None and spec.tools.is_parsed else None for _ in reqs]
        streams = [_stream(self.frontend, req, ticket, trace) for req, ticket in zip(reqs, tickets, strict=True)]
        try:
            async with contextlib.aclosing(merge_streams(streams)) as outs:
                request_id = reqs[0].job.req_id
                async for index, out in outs:
                    message = delta(out, request_id, parsers[index])
                    message.index = index
                    await context.write(message)
                    request_id = ""  # only the first message carries it
                    if on_output is not None and (message.text or message.token_ids):
                        on_output()  # the gateway's route: its TTFT, then the time between outputs
        finally:
            for ticket in tickets:
                ticket.release()

    async def _complete(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext, trace: RequestTrace
    ) -> pb.CompleteResponse:
        route = await self._route(request, context)
        if route is not None and not route.is_own:
            reply = await call_pool(self.frontend, route, request, context, whole=True)
            assert reply is not None
            return reply
        with own_route(self.frontend.gateway, route):
            return await self._complete_here(request, context, trace)

    async def _complete_here(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext, trace: RequestTrace
    ) -> pb.CompleteResponse:
        reqs, tickets, spec = await self._open(request, context, trace)
        choices = [pb.CompleteChoice(index=i) for i in range(len(reqs))]
        texts: list[list[str]] = [[] for _ in reqs]
        last: list[StepOutput | None] = [None] * len(reqs)
        streams = [_stream(self.frontend, req, ticket, trace) for req, ticket in zip(reqs, tickets, strict=True)]
        try:
            async with contextlib.aclosing(merge_streams(streams)) as outs:
                async for index, out in outs:
                    choice = choices[index]
                    choice.token_ids.extend(out.token_ids)
                    choice.logprobs.extend(logprob(lp) for lp in out.logprobs)
                    texts[index].append(out.text)
                    if out.finish_reason is not None:
                        choice.finish_reason = FINISH[out.finish_reason]
                        last[index] = out
        finally:
            for ticket in tickets:
                ticket.release()
        for choice, text in zip(choices, texts, strict=True):
            choice.text = "".join(text)
            if spec.tools is not None and spec.tools.is_parsed:
                parser = spec.tools.parser()
                split_tool_calls(choice, parser, True)
                ended_in_calls(choice, parser)
        first = choices[0]
        reply = pb.CompleteResponse(
            request_id=reqs[0].job.req_id, token_ids=first.token_ids, text=first.text, logprobs=first.logprobs,
            finish_reason=first.finish_reason, tool_calls=first.tool_calls,
            choices=choices if len(choices) > 1 else (),
        )  # fmt: skip
        ended = [out for out in last if out is not None]
        if len(ended) == len(last):
            counted = usage(ended[0])  # the prompt (and its reuse) once
            counted.completion_tokens = sum(out.num_output_tokens for out in ended)
            reply.usage.CopyFrom(counted)
        return reply

    # -- through the gateway's pools (cluster.gateway) ------------------------------------------

    async def _route(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> Route | None:
        """Where the gateway sends this call (None: no gateway, or a model it does not know,
        which the call's own checks answer). The checks that need no engine come first."""
        gateway = self.frontend.gateway
        if gateway is None:
            return None
        try:
            check_parsed(request)
            tenant = self._authenticate(context)
            if not request.model or not gateway.router.serving(request.model[:MAX_MODEL_NAME_CHARS]):
                return None
            if self.frontend.draining:  # as admission answers while draining: no new calls go out
                raise EdgeError(Kind.UNAVAILABLE, "the server is not accepting requests", None, 1.0)
            check_prompt(request, MAX_PROMPT_CHARS)
            build_sampling(request.sampling, 1)
            num_samples(request)
            spec = output_spec(request)
            tok = gateway.tokenizer_for(request.model, self.frontend.tokenizer)  # the model's route tokens
            tokens = await self._prompt_ids(request, spec, tok)
            route = gateway.router.admit(request.model, route_key(gateway, context, tenant), tokens)
        except Exception:
            self.frontend.metrics.requests.labels("grpc", "rejected").inc()
            raise
        gateway.upstreams.metrics.decisions.labels(route.pool.name, route.reason).inc()
        if not route.is_own and (spec.constraint is not None or spec.tools is not None):
            gateway.router.finish(route, ok=False)
            self.frontend.metrics.requests.labels("grpc", "rejected").inc()
            raise invalid(f"pool {route.pool.name!r} is an external engine: constrained output and tools are "
                          "served by this gateway's own pool only", "sampling")  # fmt: skip
        route.tokens = tokens
        return route

    async def _tokenize(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        check_parsed(request)
        self._authenticate(context)
        if len(request.text) > MAX_PROMPT_CHARS:
            raise invalid(f"text: at most {MAX_PROMPT_CHARS} characters", "text")
        special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        pool = self._tokenizing_pool(request.model)
        if pool is not None:
            return await tokenize_at_pool(self.frontend, pool, request.model, request.text, special)
        self._check_model(request.model)
        ids = await self._encode(request.text, special)
        return pb.TokenizeResponse(token_ids=ids, max_model_len=self.frontend.max_model_len)

    async def _detokenize(
        self, request: pb.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.DetokenizeResponse:
        check_parsed(request)
        self._authenticate(context)
        ids = list(request.token_ids)
        if len(ids) > MAX_PROMPT_TOKENS:
            raise invalid(f"token_ids: at most {MAX_PROMPT_TOKENS} ids", "token_ids")
        pool = self._tokenizing_pool(request.model)
        if pool is not None:
            return await detokenize_at_pool(self.frontend, pool, request.model, ids)
        self._check_model(request.model)
        vocab = self.frontend.vocab_size
        if any(t >= vocab for t in ids):
            raise invalid(f"token_ids: ids must be below the vocabulary size ({vocab})", "token_ids")
        text = await off_loop(4 * len(ids), self.frontend.tokenizer.decode, ids, skip_special_tokens=False)
        return pb.DetokenizeResponse(text=text)

    # -- the shared path --------------------------------------------------------------------

    def _trace(self, method: str, context: grpc.aio.ServicerContext) -> RequestTrace:
        tracing = self.frontend.tracing
        if not tracing.is_enabled:  # off: the metadata is not even read
            return NO_TRACE
        return tracing.request("grpc", f"/{self.name}/{method}", context.invocation_metadata() or ())

    async def _pin(self, request: pb.PinPrefixRequest, context: grpc.aio.ServicerContext) -> pb.PinPrefixResponse:
        check_parsed(request)
        tenant = self._operator(context, request.tenant)
        self._check_model(request.model)
        kind = request.WhichOneof("prompt")
        if kind is None:
            raise invalid("prompt: set text or token_ids", "prompt")
        if kind == "text":
            if not 1 <= len(request.text) <= MAX_PROMPT_CHARS:
                raise invalid(f"text: 1 to {MAX_PROMPT_CHARS} characters", "text")
            ids = await self._encode(request.text, True)
        else:
            ids = list(request.token_ids.ids)
        role = _ROLES.get(request.role)
        if role is None:
            raise invalid("role: WORKER_ROLE_PREFILL, WORKER_ROLE_DECODE or unset", "role")
        record = await self.frontend.pin(tenant, request.pin_id, ids, float(request.ttl_seconds), role)
        return pb.PinPrefixResponse(
            pin_id=record.pin_id, tenant=record.tenant, num_tokens=record.num_tokens, num_pages=record.num_pages,
            ttl_seconds=request.ttl_seconds,
            workers=[pb.PinnedWorker(worker=w, state=state) for w, state in record.workers.items()],
        )  # fmt: skip

    async def _unpin(
        self, request: pb.UnpinPrefixRequest, context: grpc.aio.ServicerContext
    ) -> pb.UnpinPrefixResponse:
        check_parsed(request)
        tenant = self._operator(context, request.tenant)
        self._check_model(request.model)
        return pb.UnpinPrefixResponse(released=await self.frontend.unpin(tenant, request.pin_id))

    def _operator(self, context: grpc.aio.ServicerContext, tenant: str) -> str:
        """The tenant a pin call acts for: pins change what the workers keep, so with API keys
        only an operator key may make them (for any tenant); without keys, the one tenant."""
        caller = self._authenticate(context)
        if self.keys.enabled and not caller.is_operator:
            raise EdgeError(Kind.PERMISSION_DENIED, "pinning prefixes needs an operator key (role=operator)")
        if len(tenant) > MAX_MODEL_NAME_CHARS:
            raise invalid(f"tenant: at most {MAX_MODEL_NAME_CHARS} characters", "tenant")
        return tenant or caller.name

    async def _open(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext, trace: RequestTrace
    ) -> tuple[list[GenerateRequest], list[Ticket], OutputSpec]:
        """Authenticate, bound, admit, tokenize and prepare: the frozen requests (one per
        sample) and their tickets. A refusal here counts as outcome "rejected" (nothing
        reached an engine)."""
        try:
            check_parsed(request)
            return await self._admit(request, context, trace)
        except Exception:
            self.frontend.metrics.requests.labels("grpc", "rejected").inc()
            raise

    async def _admit(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext, trace: RequestTrace
    ) -> tuple[list[GenerateRequest], list[Ticket], OutputSpec]:
        tenant = self._authenticate(context)
        trace.set(tenant=tenant.name)
        self._check_model(request.model)
        trace.set(model=self.frontend.model_name)
        check_prompt(request, self.frontend.max_model_len)
        build_sampling(request.sampling, self.frontend.max_model_len - 1)  # every field bounded before admission
        num = num_samples(request)
        hints = CacheHints(request.cache_salt or None, request.session_id or None)
        hints.check()
        slo = self._slo_class(request)
        spec = output_spec(request)
        tenant = self._priority(request, tenant)
        deadline = self.frontend.deadline(context.time_remaining())
        tickets: list[Ticket] = []
        try:
            for _ in range(num):  # one O(1) ticket per sample, before any tokenizing
                tickets.append(self.frontend.admit(slo))
            prompt_ids = await self._prompt_ids(request, spec)
            sampling = build_sampling(request.sampling, self.frontend.default_max_tokens(prompt_ids))
            sampling = replace(sampling, constraint=spec.constraint)
            reqs = []
            for i, ticket in enumerate(tickets):
                params = sampling if sampling.seed is None else replace(sampling, seed=sampling.seed + i)
                req = self.frontend.prepare(prompt_ids, params, tenant, deadline, None if i else trace.req_id, hints,
                                            slo=slo)  # fmt: skip
                self.frontend.check_tenant(ticket, req)
                reqs.append(req)
            trace.set(choices=num)
            await self.frontend.prepare_constraint(reqs[0].job.sampling, spec.param)
        except BaseException:
            for ticket in tickets:
                ticket.release()
            raise
        return reqs, tickets, spec

    def _authenticate(self, context: grpc.aio.ServicerContext) -> Tenant:
        tenant = self.keys.lookup(api_key(context.invocation_metadata() or ()))
        if tenant is None:
            raise EdgeError(Kind.UNAUTHENTICATED, "a valid API key is required")
        if self.keys.enabled and not tenant.may_generate:
            raise EdgeError(Kind.PERMISSION_DENIED, "a metrics key (role=metrics) only reads /metrics and /status")
        return tenant

    def _tokenizing_pool(self, model: str) -> Pool | None:
        """The external pool whose engine tokenizes for `model` (None: this gateway's own, or none)."""
        gateway = self.frontend.gateway
        if gateway is None or model in self.frontend.model_names:
            return None
        return external_pool(gateway.router, model[:MAX_MODEL_NAME_CHARS])

    def _check_model(self, model: str) -> None:
        if not model:
            raise invalid("model: required", "model")
        if len(model) > MAX_MODEL_NAME_CHARS:
            raise invalid(f"model: at most {MAX_MODEL_NAME_CHARS} characters", "model")
        if model not in self.frontend.model_names:
            raise EdgeError(Kind.NOT_FOUND, f"model {model!r} does not exist", "model")

    def _slo_class(self, request: pb.GenerateRequest) -> SloClass:
        slo = _SLO_CLASSES.get(request.slo_class)
        if slo is None:
            raise invalid("slo_class: SLO_CLASS_STANDARD, SLO_CLASS_LATENCY, SLO_CLASS_BATCH or unset", "slo_class")
        return allowed_slo(slo, self.allow_priority_field)

    def _priority(self, request: pb.GenerateRequest, tenant: Tenant) -> Tenant:
        if not (self.allow_priority_field and request.HasField("priority")):
            return tenant
        if not -MAX_PRIORITY <= request.priority <= MAX_PRIORITY:
            raise invalid(f"priority: must be in [{-MAX_PRIORITY}, {MAX_PRIORITY}]", "priority")
        return replace(tenant, priority=request.priority)

    async def _prompt_ids(self, request: pb.GenerateRequest, spec: OutputSpec, tok: Tokenizer | None = None) -> list[int]:
        """The prompt's ids by `tok` (default: the served model's tokenizer)."""
        tok = tok or self.frontend.tokenizer
        if request.chat:
            messages = template_messages(request)
            tools = [t.template_value() for t in spec.tools.tools] if spec.tools is not None else None
            render = functools.partial(tok.apply_chat_template, tools=tools)
            text = await off_loop(
                sum(len(m.content) for m in request.messages), render, messages, True
            )
            return await self._encode(text, False, tok)
        if request.WhichOneof("prompt") == "text":
            return await self._encode(request.text, True, tok)
        return list(request.token_ids.ids)

    async def _encode(self, text: str, special: bool, tok: Tokenizer | None = None) -> list[int]:
        return await off_loop(len(text), (tok or self.frontend.tokenizer).encode, text, special)


def _stream(
    frontend: Frontend, req: GenerateRequest, ticket: Ticket, trace: RequestTrace
) -> AsyncGenerator[StepOutput, None]:
    # Frontend.stream is an async generator function (annotated as an AsyncIterator): name the
    # type that has aclose(), which is what closes it at once on cancellation.
    return cast(AsyncGenerator[StepOutput, None], frontend.stream(req, ticket, "grpc", trace))


async def _guarded(context: grpc.aio.ServicerContext, work: Awaitable[T], trace: Span = NO_SPAN) -> T:
    """Run a call; turn any failure into its status (internals never leak)."""
    try:
        return await work
    except Exception as exc:
        err = classify(exc)
        trace.fail(err)
        if err.kind == Kind.INTERNAL and not isinstance(exc, EdgeError):
            logger.exception("gRPC call failed")
        await abort(context, err)


async def abort(context: grpc.aio.ServicerContext, err: EdgeError) -> NoReturn:
    details = err.message
    if err.kind == Kind.INVALID_ARGUMENT and err.param and not details.startswith(err.param):
        details = f"{err.param}: {details}"  # the details start with the field's name
    await context.abort(_CODES[err.kind], details, retry_metadata(err.retry_after_s))
    raise AssertionError("context.abort returned")  # it always raises


def retry_metadata(retry_after_s: float | None) -> tuple[tuple[str, str], ...]:
    """gRPC's own pushback key (read by clients with a retry policy) and an HTTP-style one."""
    if retry_after_s is None:
        return ()
    return (
        ("grpc-retry-pushback-ms", str(max(1, math.ceil(retry_after_s * 1000)))),
        ("retry-after", str(max(1, math.ceil(retry_after_s)))),
    )


def api_key(metadata: Sequence[tuple[str, Any]]) -> str | None:
    for key, value in metadata:
        if key == "authorization" and isinstance(value, str):
            scheme, _, token = value.partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
        if key == "x-api-key" and isinstance(value, str):
            return value.strip()
    return None


