"""The one internal path both APIs share: admit → validate → engine → token stream.

    HTTP / gRPC handler
      tenant = keys.lookup(...)                      (401 / UNAUTHENTICATED)
      ticket = frontend.admit()                      (429 / RESOURCE_EXHAUSTED, before tokenizing)
      req    = frontend.prepare(ids, sampling, ...)  (400 / INVALID_ARGUMENT, before allocating)
      await frontend.prepare_constraint(sampling, field)  (400: a constraint that does not compile)
      async for out in frontend.stream(req, ticket, api, trace): render SSE / protobuf

`trace` is the call's edge span (cluster.ops.tracing: the edge opens it, from `frontend.tracing`);
while a request streams, its engine side finds it by req_id.

Both APIs build the same frozen GenerateRequest and consume the same StepOutput stream, so
they cannot drift apart in what they accept or how they finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar, cast, runtime_checkable

from cluster.edge.admission import Admission, AdmissionConfig, Ticket
from cluster.edge.pins import (
    PIN_ID,
    PIN_WAIT_S,
    PinBook,
    PinRecord,
    PinsPrefixes,
    worker_pin_id,
)
from cluster.edge.tenants import Tenant, TenantLimits
from cluster.errors import EdgeError, Kind, classify, invalid
from cluster.gateway.service import Gateway
from cluster.ops.metrics import EdgeMetrics
from cluster.ops.node_status import NodeCollector, NodeStatus, collect_nodes
from cluster.ops.tracing import NO_TRACE, OFF, RequestTrace, Tracing, first_token
from cluster.placement.pair_health import ReportsPairs
from engine.async_engine import AsyncEngine
from engine.constraint import ConstraintError
from engine.job import Job
from engine.outputs import StepOutput, StepStats
from engine.pins import pin_on, unpin_on
from engine.request import SloClass
from engine.sampling import SamplingParams
from engine.tokenizer import Tokenizer
from kvcache.hashing import cache_salt

if TYPE_CHECKING:  # a router (no engine of its own) runs this edge without torch: see _engine_in_process
    from engine.engine import Engine
    from engine.structured import GrammarCompiler

logger = logging.getLogger(__name__)

T = TypeVar("T")


_ENGINE_NODE = "engine-0"  # the colocated engine's node name (cluster.ops.node_status)


class ModelFacts(Protocol):
    """What the edge reads of a model's config (engine.config.ModelConfig has them)."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...


class ModelView(Protocol):
    """What the edge reads of the model: an Engine in-process, or the gateway's own copy of
    the tokenizer and config when the engines live in Ray actors (or, with no workers of its
    own, only a tokenizer for route tokens: cluster.gateway.router_front)."""

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def model_config(self) -> ModelFacts: ...


class PoolUsage(NamedTuple):
    used: int  # held by requests (and reservations)
    cached: int  # held only by the prefix cache
    total: int
    running: int  # requests in the running batches


@runtime_checkable
class ReportsPools(Protocol):
    """An engine side whose pools live elsewhere (Ray actors) reports them itself."""

    def pool_usage(self) -> PoolUsage: ...


class EngineFront(Protocol):
    """What the Frontend needs from the engine side: an AsyncEngine (colocated), a PDFront
    (prefill and decode apart, in-process) or a RayFront (actors)."""

    @property
    def engine(self) -> ModelView: ...

    @property
    def is_alive(self) -> bool:
        """Requests can be served now (some engine or decode worker is up): /ready, admission."""
        ...

    def is_live(self, max_heartbeat_age_s: float) -> bool:
        """The parts of this process that serve work (the step threads it runs): False means a
        restart would help. Workers it only calls are not part of it (/ready says whether any
        can serve): a gateway restarted for their sake would take its healthy workers down."""
        ...

    @property
    def last_stats(self) -> StepStats | None: ...

    def generate(self, job: Job) -> AsyncIterator[StepOutput]: ...


@runtime_checkable
class PreparesConstraints(Protocol):
    """An engine side that compiles a request's constraint ahead of it (AsyncEngine, PDFront),
    raising ConstraintError when it is refused; one without (RayFront) is checked by the
    gateway's own compiler instead."""

    async def prepare(self, sampling: SamplingParams) -> None: ...


class Scaling(Protocol):
    """POST /admin/scale's other end (cluster.fleet.scalers.ScaleControl): each role's worker
    count brought to its target -> what was done; EdgeError(ABORTED) when it may not now."""

    async def scale(self, targets: Mapping[str, int]) -> dict[str, Any]: ...


MAX_HINT_CHARS = 256


def allowed_slo(slo: SloClass, callers_schedule: bool) -> SloClass:
    """A request's service class as its edge may take it: LATENCY takes its place (and may
    preempt) ahead of others' work, so only where the operator lets callers set scheduling
    (`allow_priority_field`, the switch `priority` has); BATCH only gives ground."""
    if slo == SloClass.LATENCY and not callers_schedule:
        raise EdgeError(Kind.PERMISSION_DENIED, "slo_class: latency is not allowed here: the operator has not let "
                                                "callers set scheduling (allow_priority_field)", "slo_class")  # fmt: skip
    return slo


@dataclass(frozen=True, slots=True)
class CacheHints:
    """A request's say in how its pages are reused, on both APIs.

    cache_salt: an extra salt in its page hashes (vLLM's field): only the tenant's requests
        with the same salt share its pages, so a tenant can keep some requests out of each
        other's reuse. Pages of an operator-shared prefix stay shared.
    session: a conversation's key (gRPC `session_id`, HTTP `prompt_cache_key`): placement
        prefers the worker that served the session last, where its pages are, while the cost
        model may still move it from an overloaded one."""

    cache_salt: str | None = None
    session: str | None = None
    field_names: tuple[str, str] = ("cache_salt", "session_id")  # as the edge calls them (errors)

    def check(self) -> None:
        for value, name in zip((self.cache_salt, self.session), self.field_names, strict=True):
            if value is not None and not 1 <= len(value) <= MAX_HINT_CHARS:  # an edge reads "" as absent
                raise invalid(f"{name}: at most {MAX_HINT_CHARS} characters, got {len(value)}", name)


NO_HINTS = CacheHints()


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    job: Job  # what the engine side gets, whole: its req_id the server's, never the client's
    tenant: Tenant
    deadline: float | None  # time.monotonic() seconds; None: no deadline


class Frontend:
    def __init__(
        self,
        engine: EngineFront,
        model_name: str,
        admission: AdmissionConfig | None = None,
        request_timeout_s: float = 600.0,
        tracing: Tracing = OFF,
        aliases: Sequence[str] = (),
    ) -> None:
        self.engine = engine
        self.tracing = tracing
        # Colocated, the engine side writes no spans of its own: stream() writes its prefill and decode.
        self._engine_trace = isinstance(engine, AsyncEngine)
        self.model_name = model_name  # the name answers carry ("": no model of its own, a router)
        self.model_names = (model_name, *aliases) if model_name else ()  # every name clients may call it by
        model = engine.engine
        self.tokenizer: Tokenizer = model.tokenizer
        self.max_model_len = model.max_model_len
        self.vocab_size = model.model_config.vocab_size
        self.admission = Admission(admission or AdmissionConfig())
        self.limits = TenantLimits()
        self.metrics = EdgeMetrics()
        self._local = _engine_in_process(model)  # its pools are read directly
        self.node_metrics = NodeCollector()  # baton_node_*, refreshed by nodes()
        self.metrics.registry.register(self.node_metrics)
        self.request_timeout_s = request_timeout_s
        self.draining = False
        self.scaling: Scaling | None = None  # set on Ray: `baton scale` (POST /admin/scale)
        self.started_at = time.time()
        self._compiler: GrammarCompiler | None = None  # the gateway's, when the engines are elsewhere
        self.pins = PinBook()  # prefixes pinned through this gateway (cluster.edge.pins)
        if isinstance(self.engine, PinsPrefixes):
            self.engine.follow_pins(self.pins.answered)
        self.gateway: Gateway | None = None  # set when cluster.yaml names external pools (cluster.gateway)

    # -- operations -----------------------------------------------------------------------------

    async def nodes(self) -> list[NodeStatus]:
        """Every engine behind this gateway (cluster.ops.node_status); refreshes the node metrics."""
        nodes = await collect_nodes(self.engine)
        self.node_metrics.nodes = nodes
        return nodes

    async def status(self) -> dict[str, Any]:
        """GET /status: the gateway and its nodes, for `baton status` and /dashboard."""
        nodes = await self.nodes()
        adm = self.admission
        return {
            "model": self.model_name or None, "time": time.time(), "uptime_s": time.time() - self.started_at,
            "ready": self.is_ready(), "draining": self.draining,
            "gateway": {"waiting": adm.num_waiting, "inflight": self.num_inflight,
                        "requests": self.metrics.outcomes()},
            "nodes": [n.to_json() for n in nodes],
            "pins": [r.to_json(time.time()) for r in self.pins.records()],
            "pairs": [asdict(p) for p in self.engine.pairs.views()] if isinstance(self.engine, ReportsPairs) else [],
            "pools": self.gateway.status() if self.gateway is not None else None,
        }  # fmt: skip

    # -- before the engine ------------------------------------------------------------------

    def admit(self, slo: SloClass = SloClass.STANDARD) -> Ticket:
        """A place in the queue for one request of class `slo` (BATCH requests get a share of
        it: cluster.edge.admission); RESOURCE_EXHAUSTED with retry-after when there is none."""
        if self.draining or not self.engine.is_alive:
            raise EdgeError(Kind.UNAVAILABLE, "the server is not accepting requests", None, 1.0)
        try:
            return self.admission.enter(slo)
        except EdgeError:
            self.metrics.admission_rejected.labels(slo.name.lower()).inc()
            raise

    def deadline(self, timeout_s: float | None) -> float:
        """Absolute deadline from a client's timeout, capped by the server's."""
        limit = self.request_timeout_s if timeout_s is None else min(timeout_s, self.request_timeout_s)
        return time.monotonic() + limit

    def default_max_tokens(self, prompt_ids: Sequence[int]) -> int:
        """max_tokens when a request gives none: the rest of the context after its prompt (at
        least 1: a prompt that leaves no room is refused by `prepare`, which names the prompt).
        The one place the default is made; the edges build their SamplingParams with it."""
        return max(1, self.max_model_len - len(prompt_ids))

    def prepare(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        tenant: Tenant,
        deadline: float | None,
        req_id: str | None = None,
        hints: CacheHints = NO_HINTS,
        slo: SloClass = SloClass.STANDARD,
    ) -> GenerateRequest:
        """Check a tokenized prompt, and its max_tokens, against the model: the request as one
        value from here on. `req_id`: the one the edge minted with its trace (else a new one;
        never the client's). `hints`: the request's own cache salt and session key, if any.
        `slo`: its service class, as the edge allowed it (the API's caller may not set LATENCY
        unless the operator lets callers set scheduling)."""
        hints.check()
        n = len(prompt_ids)
        if n == 0:
            raise invalid("the prompt is empty", "prompt")
        if any(not 0 <= t < self.vocab_size for t in prompt_ids):
            raise invalid(f"token ids must be in [0, {self.vocab_size})", "prompt")
        if any(t >= self.vocab_size for t, _ in sampling.logit_bias):
            raise invalid(f"token ids must be in [0, {self.vocab_size})", "logit_bias")
        if n >= self.max_model_len:
            raise invalid(
                f"the prompt has {n} tokens; the model's context is {self.max_model_len} tokens, "
                "which leaves no room to generate",
                "prompt",
            )
        remaining = self.max_model_len - n
        if sampling.max_tokens > remaining:
            raise invalid(
                f"prompt ({n} tokens) + max_tokens ({sampling.max_tokens}) exceeds the model's "
                f"context of {self.max_model_len} tokens",
                "max_tokens",
            )
        # Both hints are scoped to the key's tenant: a salt only narrows the tenant's own reuse,
        # and one tenant's session key never names (or moves) another's session.
        session = cache_salt(tenant.name, hints.session) if hints.session else ""
        job = Job(req_id or uuid.uuid4().hex, tuple(prompt_ids), sampling, tenant.priority,
                  cache_salt=cache_salt(tenant.name, hints.cache_salt), session=session, slo=slo)  # fmt: skip
        return GenerateRequest(job, tenant, deadline)

    async def prepare_constraint(self, sampling: SamplingParams, field: str | None) -> None:
        """Compile the request's output constraint before anything streams, so that one that
        does not compile is a 400 / INVALID_ARGUMENT naming `field`, never an error mid-stream.
        The compile is cached (refusals too) and bounded in time (engine.structured)."""
        if sampling.constraint is None:
            return
        try:
            if isinstance(self.engine, PreparesConstraints):
                await self.engine.prepare(sampling)
            else:
                await asyncio.to_thread(self._gateway_compiler().compile, sampling.constraint)
        except ConstraintError as exc:
            raise invalid(f"{field}: {exc.reason}" if field else exc.reason, field) from None

    def _gateway_compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            from engine.structured import GrammarCompiler  # torch: only where a constraint comes
            from engine.structured_config import StructuredConfig

            model = self.engine.engine
            eos = tuple(dict.fromkeys(self.tokenizer.eos_token_ids + model.model_config.eos_token_ids))
            self._compiler = GrammarCompiler(self.tokenizer.to_json, self.vocab_size, eos, StructuredConfig())
        return self._compiler

    def check_tenant(self, ticket: Ticket, req: GenerateRequest) -> None:
        ticket.reserve(len(req.job.prompt_ids))
        wait = self.limits.admit(req.tenant, len(req.job.prompt_ids))
        if wait:
            ticket.release()
            raise EdgeError(
                Kind.RESOURCE_EXHAUSTED, f"rate limit of tenant {req.tenant.name!r} exceeded", None, wait
            )

    # -- pinned prefixes --------------------------------------------------------------------

    async def pin(self, tenant: str, pin_id: str, prompt_ids: list[int], ttl_s: float, role: str = "") -> PinRecord:
        """Keep `prompt_ids`' whole pages resident for `tenant`'s requests on every worker of
        `role` for `ttl_s` seconds (cluster.edge.pins); pinning the same id again replaces it."""
        if not self.model_names:  # a router (cluster.gateway.router_front): its pools' engines hold the pages
            raise EdgeError(Kind.ABORTED, "this gateway runs no workers of its own: it has nothing to pin prefixes on")
        self.pins.check(tenant, pin_id, len(prompt_ids), ttl_s, role)
        if not 1 <= len(prompt_ids) < self.max_model_len:
            raise invalid(f"the prefix must have 1 to {self.max_model_len - 1} tokens", "prompt")
        if any(not 0 <= t < self.vocab_size for t in prompt_ids):
            raise invalid(f"token ids must be in [0, {self.vocab_size})", "prompt")
        key, prompt = worker_pin_id(tenant, pin_id), tuple(prompt_ids)
        if isinstance(self.engine, AsyncEngine):  # colocated: one engine does both roles
            answers = [await pin_on(self.engine, _ENGINE_NODE, key, prompt, tenant, ttl_s, PIN_WAIT_S)]
        elif isinstance(self.engine, PinsPrefixes):
            answers = await self.engine.pin_prefix(role, key, prompt, tenant, ttl_s, PIN_WAIT_S)
        else:
            raise EdgeError(Kind.ABORTED, "this gateway's workers cannot pin prefixes")
        if not answers:
            raise EdgeError(Kind.UNAVAILABLE, f"no {role or 'serving'} worker is up to pin the prefix", None, 1.0)
        refused = [a for _, a in answers if isinstance(a, str)]
        if len(refused) == len(answers):
            raise invalid(f"no worker pinned it: {refused[0]}", "prompt")
        return self.pins.record(tenant, pin_id, role, len(prompt_ids), ttl_s, answers)

    async def unpin(self, tenant: str, pin_id: str) -> bool:
        """Release a pin on every worker; False when no worker had it."""
        if not PIN_ID.match(pin_id):
            raise invalid("pin_id: 1 to 64 of [A-Za-z0-9_.-]", "pin_id")
        key, released = worker_pin_id(tenant, pin_id), 0
        if isinstance(self.engine, AsyncEngine):
            released = int(await unpin_on(self.engine, key))
        elif isinstance(self.engine, PinsPrefixes):
            released = await self.engine.unpin_prefix(key)
        self.pins.forget(tenant, pin_id)
        return released > 0  # the workers say: a pin past its TTL is gone there already

    # -- the stream -------------------------------------------------------------------------

    async def stream(
        self, req: GenerateRequest, ticket: Ticket, api: str, trace: RequestTrace = NO_TRACE
    ) -> AsyncIterator[StepOutput]:
        """The request's outputs; raises EdgeError. Leaving early aborts the engine request."""
        start = last = time.monotonic()
        outcome = "error"
        m = self.metrics
        # Label lookups hash and lock: resolve this tenant's counters once, not per token.
        prompt_tokens, cached_tokens, generated_tokens = (
            m.tenant_tokens.labels(req.tenant.name, kind) for kind in ("prompt", "cached", "generated")
        )
        trace.bind(req.job.req_id)
        trace.set(max_tokens=req.job.sampling.max_tokens)
        trace.add_usage(prompt_tokens=len(req.job.prompt_ids))
        engine_trace = trace if self._engine_trace else NO_TRACE
        stage = engine_trace.span("baton.prefill", req_id=req.job.req_id, worker=_ENGINE_NODE)  # then decode
        num_tokens = 0
        failure: BaseException | None = None
        deadline = _Deadline(self._remaining(req))
        try:
            stream = self.engine.generate(req.job)
            async with contextlib.aclosing(cast(AsyncGenerator[StepOutput, None], stream)) as outs:
                while True:
                    try:
                        out = await deadline.wait(anext(outs))
                    except StopAsyncIteration:
                        break
                    now = time.monotonic()
                    if out.num_output_tokens == len(out.token_ids):
                        ticket.started()
                        m.ttft.observe(now - start)
                        prompt_tokens.inc(out.num_prompt_tokens)
                        cached_tokens.inc(out.num_cached_tokens)
                        trace.add_usage(cached_tokens=out.num_cached_tokens)
                        stage.end()
                        stage = first_token(engine_trace, out.finished, req_id=req.job.req_id, worker=_ENGINE_NODE)
                    else:
                        m.itl.observe(now - last)
                    last = now
                    num_tokens = out.num_output_tokens
                    generated_tokens.inc(len(out.token_ids))
                    self.limits.charge_generated(req.tenant, len(out.token_ids))
                    yield out
            outcome = "ok"
        except TimeoutError:
            outcome = "deadline"
            failure = EdgeError(Kind.DEADLINE_EXCEEDED, "the request's deadline passed")
            raise failure from None
        except (asyncio.CancelledError, GeneratorExit) as exc:
            outcome, failure = "cancelled", exc
            raise
        except EdgeError as exc:
            failure = exc
            raise
        except Exception as exc:
            edge = failure = classify(exc)
            if edge.kind == Kind.INTERNAL:
                logger.exception("request %s failed", req.job.req_id)
            raise edge from None
        finally:
            deadline.cancel()
            ticket.release()
            m.requests.labels(api, outcome).inc()
            m.e2e.observe(time.monotonic() - start)
            if failure is not None:
                stage.fail(failure)
                trace.fail(failure)
            if num_tokens:  # the stage is decode's
                stage.set(output_tokens=num_tokens)
            stage.end()
            trace.add_usage(output_tokens=num_tokens)
            trace.unbind(req.job.req_id)

    def _remaining(self, req: GenerateRequest) -> float | None:
        return None if req.deadline is None else max(0.0, req.deadline - time.monotonic())

    # -- health -----------------------------------------------------------------------------

    def is_live(self, max_heartbeat_age_s: float = 10.0) -> bool:
        """/live: this process works (EngineFront.is_live); kubelet restarts it otherwise."""
        return self.engine.is_live(max_heartbeat_age_s)

    def is_ready(self) -> bool:
        """/ready: live, not draining, and something can serve a request now."""
        return self.is_live() and not self.draining and self.engine.is_alive

    @property
    def num_inflight(self) -> int:
        """Requests in flight through this gateway: the admitted ones and, on a gateway over
        pools, its calls to external engines (a drain waits for both)."""
        return self.admission.num_inflight + (self.gateway.num_inflight if self.gateway is not None else 0)

    def refresh_gauges(self) -> None:
        m, adm = self.metrics, self.admission
        m.waiting.set(adm.num_waiting)
        m.inflight.set(self.num_inflight)
        usage = self._pool_usage()
        if usage is None:
            return
        m.pages_used.labels("device").set(usage.used)
        m.pages_cached.labels("device").set(usage.cached)
        m.pages_total.labels("device").set(usage.total)
        if usage.running >= 0:
            m.running.set(usage.running)

    def _pool_usage(self) -> PoolUsage | None:
        if isinstance(self.engine, ReportsPools):
            return self.engine.pool_usage()
        if self._local is None:
            return None
        pages, cache, stats = self._local.pool.pages, self._local.prefix_cache, self.engine.last_stats
        cached = cache.num_cached_pages if cache else 0
        running = stats.num_running if stats is not None else -1
        return PoolUsage(pages.num_used - cached, cached, pages.num_pages, running)


def _engine_in_process(model: ModelView) -> Engine | None:
    """The model view where it is an Engine of this process (colocated, or in-process PD's decode
    side). Only a process that built an engine has imported engine.engine, and torch with it: a
    router has not, and its model view is none (cluster.gateway.router_front)."""
    module = sys.modules.get("engine.engine")
    return cast("Engine", model) if module is not None and isinstance(model, module.Engine) else None


class _Deadline:
    """A request's deadline over its waits for the engine: one timer per request, where
    `asyncio.timeout` around each wait armed one per token (a sixth of the event loop's work
    per streamed token). Like asyncio.timeout it cancels the waiting task and turns that
    cancellation into TimeoutError; it bounds only the waits, never a `yield`: a cancellation
    while the consumer holds the token (a socket write) would surface there, as a cancelled
    request rather than this request's deadline, so a deadline that passes then is raised at
    the next wait."""

    __slots__ = ("_task", "_handle", "_waiting", "_expired", "_cancelling")

    def __init__(self, remaining_s: float | None) -> None:
        self._task = asyncio.current_task()
        self._waiting = self._expired = False
        self._cancelling = 0
        self._handle = None if remaining_s is None else asyncio.get_running_loop().call_later(remaining_s, self._fire)

    def _fire(self) -> None:
        self._expired = True
        if self._waiting and self._task is not None:
            self._task.cancel()

    async def wait(self, awaitable: Awaitable[T]) -> T:
        if self._expired:
            raise TimeoutError
        assert self._task is not None
        self._cancelling = self._task.cancelling()
        self._waiting = True
        try:
            return await awaitable
        except asyncio.CancelledError:
            if self._expired and self._task.uncancel() <= self._cancelling:
                raise TimeoutError from None  # ours, not the caller's
            raise
        finally:
            self._waiting = False

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()


async def merge_streams(
    streams: Sequence[AsyncIterator[StepOutput]],
) -> AsyncGenerator[tuple[int, StepOutput], None]:
    """Interleave the samples' streams of one call as (index, output), in arrival order.
    Leaving early (or a failure in any one) closes every stream at once, so each aborts its
    engine request: one stream is read in place under `aclosing`; several each in a task of
    their own that closes its stream when cancelled."""
    if len(streams) == 1:
        async with contextlib.aclosing(cast(AsyncGenerator[StepOutput, None], streams[0])) as only:
            async for out in only:
                yield 0, out
        return
    queue: asyncio.Queue[tuple[int, StepOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[StepOutput]) -> None:
        try:
            async with contextlib.aclosing(cast(AsyncGenerator[StepOutput, None], stream)) as outs:
                async for out in outs:
                    queue.put_nowait((index, out))
            queue.put_nowait((index, None))
        except Exception as exc:
            queue.put_nowait((index, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
