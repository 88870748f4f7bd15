"""The benchmark workloads of BENCHMARKS.md, deterministic from a seed.

A workload is a stream of sessions. A session is one or more turns; turn k's prompt is every
earlier turn's new parts and actual output, then its own new parts, so a later turn can only
be built once the earlier one has finished:

    turn 0:  [msg0]
    turn 1:  [msg0][out0][msg1]
    turn 2:  [msg0][out0][msg1][out1][msg2]

`sessions(seed)` feeds the closed loop (or Poisson arrivals); `timed(seed)` yields sessions
that arrive at fixed offsets whatever the loop does (mixed's long prompts, trace replay).
Every field of a workload is a parameter (`baton bench --param name=value`). Segment keys
start with the seed, so a fresh seed gives a cold prompt set.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from bench.prompts import Output, Part, Segment


@dataclass(frozen=True, slots=True)
class Turn:
    new_parts: tuple[Segment, ...]
    output_len: int


@dataclass(frozen=True, slots=True)
class Session:
    session_id: str
    turns: tuple[Turn, ...]
    tag: str = ""  # a report breaks figures down by tag when a run has several
    tenant: str | None = None

    def prompt_parts(self, turn: int, outputs: Sequence[Output]) -> tuple[Part, ...]:
        """Turn `turn`'s prompt, given the outputs of turns 0..turn-1."""
        if len(outputs) < turn:
            raise ValueError(f"turn {turn} needs {turn} earlier outputs, got {len(outputs)}")
        parts: list[Part] = []
        for k in range(turn):
            parts.extend(self.turns[k].new_parts)
            parts.append(outputs[k])
        parts.extend(self.turns[turn].new_parts)
        return tuple(parts)

    def nominal_prompt_len(self, turn: int) -> int:
        """Prompt tokens of `turn`, counting each earlier output at its requested length."""
        earlier = sum(sum(s.num_tokens for s in t.new_parts) + t.output_len for t in self.turns[:turn])
        return earlier + sum(s.num_tokens for s in self.turns[turn].new_parts)


class Workload(ABC):
    name: ClassVar[str]
    replayed: ClassVar[bool] = False  # without --concurrency/--rate: replayed on its own times

    @abstractmethod
    def sessions(self, seed: str) -> Iterator[Session]:
        """Sessions for the loop, in order; may be endless (the run's request budget stops it)."""

    def timed(self, seed: str) -> Iterator[tuple[float, Session]]:
        """(seconds from the run's start, session), in order of time."""
        return iter(())

    @property
    def turns_per_session(self) -> int:
        return 1

    @property
    def active_sessions(self) -> int:
        """Sessions kept open at once in a closed loop, at least the concurrency. More than the
        concurrency interleaves their turns, so each history is revisited only after the others
        have passed through the cache (the `tiered` working set)."""
        return 0


def _single(session_id: str, parts: tuple[Segment, ...], output_len: int, tag: str = "") -> Session:
    return Session(session_id, (Turn(parts, output_len),), tag=tag)


def _unique_prompts(name: str, seed: str, prompt_len: int, output_len: int) -> Iterator[Session]:
    """Sessions of one prompt each, no two sharing a token prefix (random, code)."""
    for i in itertools.count():
        yield _single(f"{name}-{i}", (Segment(f"{seed}/{name}/{i}", prompt_len),), output_len)


@dataclass(frozen=True, slots=True)
class RandomWorkload(Workload):
    """Raw batching throughput: nothing shared."""

    name: ClassVar[str] = "random"
    prompt_len: int = 256
    output_len: int = 128

    def sessions(self, seed: str) -> Iterator[Session]:
        return _unique_prompts(self.name, seed, self.prompt_len, self.output_len)


@dataclass(frozen=True, slots=True)
class RagWorkload(Workload):
    """Cross-user prefix reuse: one shared system prompt, a unique question each."""

    name: ClassVar[str] = "rag"
    system_len: int = 2000
    question_len: int = 50
    output_len: int = 64

    def sessions(self, seed: str) -> Iterator[Session]:
        system = Segment(f"{seed}/rag/system", self.system_len)
        for i in itertools.count():
            question = Segment(f"{seed}/rag/question/{i}", self.question_len)
            yield _single(f"rag-{i}", (system, question), self.output_len)


@dataclass(frozen=True, slots=True)
class CodeWorkload(Workload):
    """The no-overlap case: long prompts with no common prefix."""

    name: ClassVar[str] = "code"
    prompt_len: int = 1000
    output_len: int = 64

    def sessions(self, seed: str) -> Iterator[Session]:
        return _unique_prompts(self.name, seed, self.prompt_len, self.output_len)


@dataclass(frozen=True, slots=True)
class MultiturnWorkload(Workload):
    """Reuse of a growing history. `context_len` opens each conversation with that many unique
    tokens (a document); `num_active` > concurrency interleaves conversations (`tiered`)."""

    name: ClassVar[str] = "multiturn"
    turns: int = 5
    message_len: int = 50
    output_len: int = 32
    context_len: int = 0
    num_active: int = 0

    def sessions(self, seed: str) -> Iterator[Session]:
        for i in itertools.count():
            opener = (Segment(f"{seed}/multiturn/{i}/context", self.context_len),) if self.context_len else ()
            messages = [Segment(f"{seed}/multiturn/{i}/{k}", self.message_len) for k in range(self.turns)]
            turns = tuple(
                Turn((opener if k == 0 else ()) + (message,), self.output_len) for k, message in enumerate(messages)
            )
            yield Session(f"multiturn-{i}", turns)

    @property
    def turns_per_session(self) -> int:
        return self.turns

    @property
    def active_sessions(self) -> int:
        return self.num_active


@dataclass(frozen=True, slots=True)
class AgentWorkload(Workload):
    """The triple reuse of agent traffic: a system prompt and a tool schema shared by every
    agent, then each agent's own trajectory (task, then per step its action and a tool
    result), re-sent in full at every step."""

    name: ClassVar[str] = "agent"
    system_len: int = 1500
    tools_len: int = 1000
    task_len: int = 50
    observation_len: int = 100
    steps: int = 5
    output_len: int = 32
    context_len: int = 0
    num_active: int = 0

    def sessions(self, seed: str) -> Iterator[Session]:
        shared = (Segment(f"{seed}/agent/system", self.system_len), Segment(f"{seed}/agent/tools", self.tools_len))
        for i in itertools.count():
            context = (Segment(f"{seed}/agent/{i}/context", self.context_len),) if self.context_len else ()
            first = Turn(shared + context + (Segment(f"{seed}/agent/{i}/task", self.task_len),), self.output_len)
            steps = tuple(
                Turn((Segment(f"{seed}/agent/{i}/observation/{k}", self.observation_len),), self.output_len)
                for k in range(1, self.steps)
            )
            yield Session(f"agent-{i}", (first, *steps))

    @property
    def turns_per_session(self) -> int:
        return self.steps

    @property
    def active_sessions(self) -> int:
        return self.num_active


@dataclass(frozen=True, slots=True)
class MixedWorkload(Workload):
    """Prefill/decode interference: the loop runs short, decode-heavy requests (tag "short")
    while a long prompt (tag "long") arrives every `long_interval_s`; 0 turns them off, which
    is the baseline P6 compares against."""

    name: ClassVar[str] = "mixed"
    short_len: int = 64
    short_output_len: int = 256
    long_len: int = 4000
    long_output_len: int = 16
    long_interval_s: float = 3.0

    def sessions(self, seed: str) -> Iterator[Session]:
        for i in itertools.count():
            parts = (Segment(f"{seed}/mixed/short/{i}", self.short_len),)
            yield _single(f"short-{i}", parts, self.short_output_len, "short")

    def timed(self, seed: str) -> Iterator[tuple[float, Session]]:
        if self.long_interval_s <= 0:
            return
        for i in itertools.count():
            parts = (Segment(f"{seed}/mixed/long/{i}", self.long_len),)
            yield (i + 1) * self.long_interval_s, _single(f"long-{i}", parts, self.long_output_len, "long")


@dataclass(frozen=True, slots=True)
class TieredWorkload(Workload):
    """`multiturn` or `agent` with a working set larger than the device pool: each session
    opens with `context_len` unique tokens and `num_active` sessions are interleaved, so the
    working set is about num_active x (context_len + the session's history). Size it to 4x
    the server's device KV pool (e.g. 64 x ~2.4k tokens against a ~37k-token pool)."""

    name: ClassVar[str] = "tiered"
    base: str = "multiturn"
    context_len: int = 2000
    num_active: int = 64
    turns: int = 5

    def _base(self) -> MultiturnWorkload | AgentWorkload:
        if self.base == "multiturn":
            return MultiturnWorkload(turns=self.turns, context_len=self.context_len, num_active=self.num_active)
        if self.base == "agent":
            return AgentWorkload(steps=self.turns, context_len=self.context_len, num_active=self.num_active)
        raise ValueError(f"tiered base must be multiturn or agent, not {self.base!r}")

    def sessions(self, seed: str) -> Iterator[Session]:
        return self._base().sessions(f"{seed}/tiered")

    @property
    def turns_per_session(self) -> int:
        return self.turns

    @property
    def active_sessions(self) -> int:
        return self.num_active


@dataclass(frozen=True, slots=True)
class BurstAgentWorkload(Workload):
    """Agent fan-out in bursts (issue 21's shape, built here; the held-out traces stay out of
    the repository): every burst is one task handed to `fanout` agents at once. Each agent's
    prompt is the fleet's system prompt and tool schema (shared by all), the task's context
    (shared by its burst) and the agent's own instruction: ~4.4k tokens of which ~88% another
    request already sent. Bursts start at Poisson times (`bursts_per_s`), the agents of a burst
    within `spread_s` of each other. Replayed on those times (run it with neither
    --concurrency nor --rate); deterministic from the seed."""

    name: ClassVar[str] = "burst-agent"
    replayed: ClassVar[bool] = True
    system_len: int = 1500
    tools_len: int = 1000
    task_len: int = 1400
    own_len: int = 500
    fanout: int = 8
    bursts_per_s: float = 0.25
    spread_s: float = 0.5
    output_len: int = 64

    def _session(self, seed: str, burst: int, agent: int) -> Session:
        parts = (
            Segment(f"{seed}/burst-agent/system", self.system_len),
            Segment(f"{seed}/burst-agent/tools", self.tools_len),
            Segment(f"{seed}/burst-agent/{burst}/task", self.task_len),
            Segment(f"{seed}/burst-agent/{burst}/{agent}", self.own_len),
        )
        return _single(f"burst-{burst}-agent-{agent}", parts, self.output_len)

    def sessions(self, seed: str) -> Iterator[Session]:
        for burst in itertools.count():
            for agent in range(self.fanout):
                yield self._session(seed, burst, agent)

    def timed(self, seed: str) -> Iterator[tuple[float, Session]]:
        if self.bursts_per_s <= 0 or self.fanout < 1:
            return
        rng = random.Random(f"{seed}/burst-agent/times")  # str seeds hash with SHA-512: stable
        start = 0.0  # the first burst at once, then Poisson gaps
        for burst in itertools.count():
            offsets = sorted(rng.uniform(0.0, self.spread_s) for _ in range(self.fanout))
            for agent, offset in enumerate(offsets):
                yield start + offset, self._session(seed, burst, agent)
            start += rng.expovariate(self.bursts_per_s)


@dataclass(frozen=True, slots=True)
class TenantRagWorkload(Workload):
    """Multi-tenant RAG with bursty arrivals (issue 21's shape, built here): `tenants` tenants,
    each with its own system prompt and `docs` documents; a request is its tenant's system
    prompt, `per_request` documents drawn by popularity (Zipf, exponent `skew`: hot documents
    and a tail; in order of their ids, so only a request with the same leading documents shares
    more than the system prompt) and a unique question, ~4.4k tokens; ~84% of its tokens were
    sent before by another request (the ideal hit rate, measured with the defaults). Arrivals are a Poisson
    process whose rate switches between `rate` and `burst_rate` (on for `burst_s` every
    `period_s`). Tagged by tenant; deterministic from the seed."""

    name: ClassVar[str] = "tenant-rag"
    replayed: ClassVar[bool] = True
    tenants: int = 4
    system_len: int = 400
    docs: int = 5
    doc_len: int = 1300
    per_request: int = 3
    question_len: int = 100
    skew: float = 1.5
    rate: float = 1.0
    burst_rate: float = 6.0
    period_s: float = 20.0
    burst_s: float = 4.0
    output_len: int = 64

    def _session(self, seed: str, rng: random.Random, i: int) -> Session:
        tenant = rng.randrange(self.tenants)
        weights = [1.0 / (rank + 1) ** self.skew for rank in range(self.docs)]
        picked: list[int] = []
        while len(picked) < min(self.per_request, self.docs):
            doc = rng.choices(range(self.docs), weights)[0]
            if doc not in picked:
                picked.append(doc)
        parts = (
            Segment(f"{seed}/tenant-rag/{tenant}/system", self.system_len),
            *(Segment(f"{seed}/tenant-rag/{tenant}/doc/{d}", self.doc_len) for d in sorted(picked)),
            Segment(f"{seed}/tenant-rag/question/{i}", self.question_len),
        )
        return Session(f"tenant-rag-{i}", (Turn(parts, self.output_len),), tag=f"t{tenant}", tenant=f"t{tenant}")

    def sessions(self, seed: str) -> Iterator[Session]:
        rng = random.Random(f"{seed}/tenant-rag/picks")
        for i in itertools.count():
            yield self._session(seed, rng, i)

    def timed(self, seed: str) -> Iterator[tuple[float, Session]]:
        if self.rate <= 0:
            return
        times = random.Random(f"{seed}/tenant-rag/times")
        picks = random.Random(f"{seed}/tenant-rag/picks")
        t = 0.0
        for i in itertools.count():
            bursting = self.period_s > 0 and t % self.period_s < self.burst_s
            t += times.expovariate(self.burst_rate if bursting and self.burst_rate > 0 else self.rate)
            yield t, self._session(seed, picks, i)


WORKLOADS: dict[str, type[Workload]] = {
    w.name: w
    for w in (
        RandomWorkload, RagWorkload, MultiturnWorkload, AgentWorkload, CodeWorkload, MixedWorkload, TieredWorkload,
        BurstAgentWorkload, TenantRagWorkload,
    )
}


def _convert(default: object, value: str) -> object:
    """`value` as the type of the field's default."""
    if isinstance(default, bool):
        return value.lower() in ("1", "true", "yes", "on")
    if isinstance(default, int | float):
        return type(default)(value)
    return value


def make_workload(name: str, params: Sequence[str] = ()) -> Workload:
    """The named workload with `key=value` overrides of its fields, converted to the field's type."""
    try:
        cls = WORKLOADS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)} or --trace") from None
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    overrides: dict[str, Any] = {}
    for item in params:
        key, sep, value = item.partition("=")
        if not sep or key not in fields:
            raise ValueError(f"bad --param {item!r} for {name}: fields are {', '.join(fields)}")
        overrides[key] = _convert(fields[key].default, value)
    workload = cls(**overrides)
    if isinstance(workload, TieredWorkload):
        workload._base()  # reject a bad base now, not mid-run
    return workload
