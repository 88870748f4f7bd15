"""One benchmark run: a workload driven against an endpoint (through a bench.transport
Transport, HTTP or gRPC alike) until its request budget or its time cap runs out.

- closed loop (`concurrency` N): `max(N, workload.active_sessions)` session slots, each running
  sessions one after another, turn after turn; a semaphore lets N requests be in flight.
- open loop (`rate` R): sessions start at Poisson arrivals (R per second, from the seed);
  later turns of a session follow as soon as the previous one finishes.
- replay (neither): only the workload's timed sessions (a trace on its timestamps).

Timed sessions (mixed's long prompts) are sent at their offsets alongside a loop until the
loop is done. At the time cap nothing new is sent and in-flight requests end as failures
("time cap"), so a run that cannot finish still reports what it did.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import sys
import time
from dataclasses import dataclass

from tqdm import tqdm  # type: ignore[import-untyped]  # no stubs in the env

from bench.ideal import IdealPrefixIndex
from bench.prompts import MissingTokenIds, Output, PromptMode, PromptRenderer
from bench.transport import CompletionRequest, StreamResult, Transport
from bench.workloads import Session, Workload

logger = logging.getLogger(__name__)

DEFAULT_REQUESTS = {1: 12, 8: 32, 32: 64}  # BENCHMARKS.md; other levels get max(12, 2N)
DEFAULT_RATE_REQUESTS = 64


@dataclass(frozen=True, slots=True)
class RunPlan:
    label: str
    seed: str  # every prompt of the run derives from it
    concurrency: int | None
    rate: float | None  # requests (sessions) per second, open loop
    num_requests: int
    time_cap_s: float = 120.0
    request_timeout_s: float = 600.0
    page_size: int = 16  # for the ideal prefix-hit count
    progress: bool | None = None  # None: a bar only when stderr is a terminal


@dataclass(frozen=True, slots=True)
class RequestRecord:
    session_id: str
    turn: int
    tag: str
    tenant: str | None
    start_s: float  # from the run's start
    output_len: int  # requested
    nominal_prompt_tokens: int
    ideal_cached_tokens: int | None  # token mode only
    result: StreamResult


@dataclass(frozen=True, slots=True)
class RunResult:
    plan: RunPlan
    workload: str
    duration_s: float
    records: tuple[RequestRecord, ...]


def default_num_requests(workload: Workload, concurrency: int | None, rate: float | None) -> int:
    """BENCHMARKS.md's counts; multi-turn workloads get whole sessions, at least one per slot."""
    if concurrency is None:
        return DEFAULT_RATE_REQUESTS
    n = DEFAULT_REQUESTS.get(concurrency, max(12, 2 * concurrency))
    turns = workload.turns_per_session
    if turns > 1:
        slots = max(concurrency, workload.active_sessions)
        n = max(n, slots * turns)
        n = -(-n // turns) * turns
    return n


class _Run:
    def __init__(self, plan: RunPlan, workload: Workload, client: Transport, renderer: PromptRenderer) -> None:
        self.plan = plan
        self.workload = workload
        self.client = client
        self.renderer = renderer
        self.start = time.perf_counter()
        self.deadline = self.start + plan.time_cap_s
        self.num_issued = 0
        self.records: list[RequestRecord] = []
        self.fatal: MissingTokenIds | None = None  # a setup problem: stop and tell the user
        self.ideal = IdealPrefixIndex(plan.page_size) if renderer.mode is PromptMode.TOKENS else None
        disable = None if plan.progress is None else not plan.progress
        self.bar = tqdm(total=plan.num_requests, desc=plan.label, file=sys.stderr, disable=disable, leave=False)

    def can_issue(self) -> bool:
        return (
            self.fatal is None
            and self.num_issued < self.plan.num_requests
            and time.perf_counter() < self.deadline
        )

    async def sleep_until(self, offset_s: float, stop: asyncio.Event | None = None) -> bool:
        """Wait until `offset_s` into the run; False when the cap or `stop` comes first."""
        target = self.start + offset_s
        if target >= self.deadline:
            return False
        delay = target - time.perf_counter()
        if delay <= 0:
            return not (stop and stop.is_set())
        if stop is None:
            await asyncio.sleep(delay)
            return True
        try:
            await asyncio.wait_for(stop.wait(), delay)
        except TimeoutError:
            return True
        return False

    async def run_session(self, session: Session, sem: asyncio.Semaphore | None) -> None:
        """The session's turns in order; a failed turn ends it (its output is unknown)."""
        outputs: list[Output] = []
        for turn in range(len(session.turns)):
            if sem is None:
                record = await self.send(session, turn, outputs)
            else:
                async with sem:
                    record = await self.send(session, turn, outputs)
            if record is None or not record.result.ok:
                return
            outputs.append(Output(record.result.text, record.result.token_ids))

    async def send(self, session: Session, turn: int, outputs: list[Output]) -> RequestRecord | None:
        if not self.can_issue():
            return None
        try:
            prompt = self.renderer.render(session.prompt_parts(turn, outputs))
        except MissingTokenIds as exc:
            self.fatal = exc
            return None
        self.num_issued += 1
        ideal = None
        if self.ideal is not None and isinstance(prompt, list):
            ideal = self.ideal.match_and_add(prompt)
        sent = time.perf_counter()
        capped = self.deadline - sent < self.plan.request_timeout_s
        request = CompletionRequest(
            prompt=prompt,
            output_len=session.turns[turn].output_len,
            # Only a turn with a successor needs its output as ids (the next prompt holds it).
            want_token_ids=self.renderer.mode is PromptMode.TOKENS and turn + 1 < len(session.turns),
            user=session.tenant,
        )
        result = await self.client.complete(request, min(self.plan.request_timeout_s, self.deadline - sent))
        if capped and result.error is not None and result.error.startswith("timeout"):
            result = dataclasses.replace(result, error=f"time cap ({self.plan.time_cap_s:g} s)")
        if self.ideal is not None and isinstance(prompt, list) and result.ok and result.token_ids:
            self.ideal.add(prompt + list(result.token_ids))
        record = RequestRecord(
            session_id=session.session_id,
            turn=turn,
            tag=session.tag,
            tenant=session.tenant,
            start_s=sent - self.start,
            output_len=request.output_len,
            nominal_prompt_tokens=len(prompt) if isinstance(prompt, list) else session.nominal_prompt_len(turn),
            ideal_cached_tokens=ideal,
            result=result,
        )
        self.records.append(record)
        self.bar.update(1)
        return record

    async def closed_loop(self, concurrency: int) -> None:
        sem = asyncio.Semaphore(concurrency)
        sessions = self.workload.sessions(self.plan.seed)

        async def slot() -> None:
            while self.can_issue():
                session = next(sessions, None)
                if session is None:
                    return
                await self.run_session(session, sem)

        async with asyncio.TaskGroup() as tg:
            for _ in range(max(concurrency, self.workload.active_sessions)):
                tg.create_task(slot())

    async def open_loop(self, rate: float, tg: asyncio.TaskGroup) -> None:
        rng = random.Random(f"{self.plan.seed}/arrivals")  # str seeds hash with SHA-512: stable
        sessions = self.workload.sessions(self.plan.seed)
        offset = 0.0
        while self.can_issue():
            offset += rng.expovariate(rate)
            if not await self.sleep_until(offset):
                return
            session = next(sessions, None)
            if session is None:
                return
            tg.create_task(self.run_session(session, None))

    async def timed_loop(self, stop: asyncio.Event, tg: asyncio.TaskGroup) -> None:
        for offset, session in self.workload.timed(self.plan.seed):
            if not await self.sleep_until(offset, stop) or not self.can_issue():
                return
            tg.create_task(self.run_session(session, None))


async def execute(plan: RunPlan, workload: Workload, client: Transport, renderer: PromptRenderer) -> RunResult:
    """Run `plan` to completion (budget spent, sessions exhausted or time cap reached)."""
    run = _Run(plan, workload, client, renderer)
    try:
        stop = asyncio.Event()
        async with asyncio.TaskGroup() as tg:
            tg.create_task(run.timed_loop(stop, tg))
            if plan.concurrency is not None:
                await run.closed_loop(plan.concurrency)
                stop.set()
            elif plan.rate is not None:
                await run.open_loop(plan.rate, tg)
                stop.set()
    finally:
        run.bar.close()
    if run.fatal is not None:
        raise run.fatal
    duration = time.perf_counter() - run.start
    records = tuple(sorted(run.records, key=lambda r: r.start_s))
    logger.info("run %s: %d requests in %.1f s", plan.label, len(records), duration)
    return RunResult(plan=plan, workload=workload.name, duration_s=duration, records=records)
