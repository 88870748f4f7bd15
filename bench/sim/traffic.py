"""Traffic for `baton sim`: BENCHMARKS.md workloads (several mixed, over many tenants) or a
Mooncake trace, as sessions arriving on a virtual clock, and their prompts as page hashes.

    --workload agent:2+multiturn+rag --tenants 32 --rate 160
      sessions arrive as a Poisson process (rate / mean turns per session a second), each of
      one workload (by weight) and one tenant (Zipf-skewed: a few hot tenants, a long tail);
      a tenant's prompts come from its own seed and its pages are salted with its name
      turn k+1 of a session arrives `think` seconds (exponential) after turn k finished;
      its prompt is every earlier turn's parts and output, then its own parts

    --trace file.jsonl   one single-turn session per line, on its timestamps (bench.trace)

Tokens are the prompt segments' deterministic ids (bench.prompts); a turn's output is a
segment keyed by its session and turn, so the next turn's history is the same tokens the
decode worker cached. Page hashes are kvcache.hashing's, chained from a memo of the longest
already-hashed prefix of parts (a system prompt is hashed once per tenant, a history once).
"""

from __future__ import annotations

import dataclasses
import heapq
import random
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from bench.prompts import Segment, segment_ids
from bench.trace import TraceWorkload, load_trace
from bench.workloads import WORKLOADS, Session, Workload, make_workload
from kvcache.hashing import ROOT_HASH, page_hashes

VOCAB_SIZE = 16_384  # baton-tiny's and baton-small's
MAX_MEMO = 20_000  # hashed prefixes kept
MAX_SESSIONS = 5_000_000  # a bound on any arrival loop


@dataclass(slots=True, eq=False)
class SessionRun:
    """One session in flight: which turn is next."""

    session: Session
    tenant: str
    key: str  # unique per session in the run: output segments are keyed on it
    next_turn: int = 0

    @property
    def salt(self) -> bytes:
        return self.tenant.encode()

    def parts(self, turn: int, with_output: bool = False) -> tuple[Segment, ...]:
        """Turn `turn`'s prompt (and its output after it, when asked)."""
        parts: list[Segment] = []
        turns = self.session.turns
        for k in range(turn):
            parts.extend(_segments(turns[k].new_parts))
            parts.append(Segment(f"{self.key}/out/{k}", turns[k].output_len))
        parts.extend(_segments(turns[turn].new_parts))
        if with_output:
            parts.append(Segment(f"{self.key}/out/{turn}", turns[turn].output_len))
        return tuple(parts)


def _segments(parts: Sequence[object]) -> list[Segment]:
    out = [p for p in parts if isinstance(p, Segment)]
    if len(out) != len(parts):
        raise ValueError("simulated sessions are built of segments only")
    return out


class PromptHasher:
    """Parts -> (full-page hashes, token count), reusing the longest hashed prefix of parts."""

    def __init__(self, page_size: int, fingerprint: bytes, vocab_size: int = VOCAB_SIZE) -> None:
        self.page_size = page_size
        self.fingerprint = fingerprint
        self.vocab_size = vocab_size
        self._memo: OrderedDict[tuple[bytes, tuple[Segment, ...]], tuple[tuple[bytes, ...], tuple[int, ...]]] = (
            OrderedDict()
        )

    def hash(self, salt: bytes, parts: tuple[Segment, ...]) -> tuple[list[bytes], int]:
        hashes: list[bytes] = []
        tail: list[int] = []
        start = 0
        for k in range(len(parts), 0, -1):
            found = self._memo.get((salt, parts[:k]))
            if found is not None:
                self._memo.move_to_end((salt, parts[:k]))
                hashes, tail, start = list(found[0]), list(found[1]), k
                break
        ps = self.page_size
        for k in range(start, len(parts)):
            seg = parts[k]
            tokens = tail + segment_ids(seg.key, seg.num_tokens, self.vocab_size)
            new = page_hashes(tokens, ps, salt, self.fingerprint, hashes[-1] if hashes else ROOT_HASH)
            hashes.extend(new)
            tail = tokens[len(new) * ps :]
            self._memo[(salt, parts[: k + 1])] = (tuple(hashes), tuple(tail))
            if len(self._memo) > MAX_MEMO:
                self._memo.popitem(last=False)
        return hashes, len(hashes) * ps + len(tail)


class Traffic(Protocol):
    """Where a run's sessions come from: a fresh stream per policy."""

    def arrivals(self) -> Iterator[tuple[float, SessionRun]]: ...

    @property
    def end_s(self) -> float: ...  # when the last session arrives (at the latest)

    @property
    def think_s(self) -> float: ...  # mean pause before a session's next turn


@dataclass(frozen=True, slots=True)
class Mix:
    """Workloads by weight, over Zipf-skewed tenants, arriving at `rate` requests a second."""

    workloads: tuple[tuple[Workload, float], ...]
    num_tenants: int = 32
    tenant_skew: float = 1.0  # Zipf exponent over tenants; 0: uniform
    rate: float = 100.0  # requests / s (sessions arrive at rate / mean turns)
    duration_s: float = 60.0  # sessions arrive in [0, duration)
    think_s: float = 1.0  # mean pause between a turn's end and the next turn
    seed: str = "0"

    def __post_init__(self) -> None:
        if not self.workloads or any(w <= 0 for _, w in self.workloads):
            raise ValueError("a mix needs workloads with positive weights")
        if self.num_tenants < 1 or self.tenant_skew < 0 or self.rate <= 0 or self.duration_s <= 0 or self.think_s < 0:
            raise ValueError("tenants >= 1, skew >= 0, rate > 0, duration > 0, think >= 0")

    @property
    def end_s(self) -> float:
        return self.duration_s

    @property
    def mean_turns(self) -> float:
        total = sum(w for _, w in self.workloads)
        return sum(wl.turns_per_session * w for wl, w in self.workloads) / total

    def arrivals(self) -> Iterator[tuple[float, SessionRun]]:
        """(arrival time, session), in time order: the Poisson stream and each workload's
        timed sessions (mixed's long prompts), for every tenant."""
        rng = random.Random(f"{self.seed}/arrivals")
        tenants = [f"t{i}" for i in range(self.num_tenants)]
        tenant_weights = [1.0 / (i + 1) ** self.tenant_skew for i in range(self.num_tenants)]
        kinds = list(range(len(self.workloads)))
        kind_weights = [w for _, w in self.workloads]
        streams: dict[tuple[str, int], Iterator[Session]] = {}
        timed = heapq.merge(*(_timed(wl, tenant, kind, self.seed) for tenant in tenants
                              for kind, (wl, _) in enumerate(self.workloads)), key=lambda item: item[0])
        session_rate = self.rate / self.mean_turns
        t, n = rng.expovariate(session_rate), 0
        next_timed = next(timed, None)
        while n < MAX_SESSIONS:
            if next_timed is not None and next_timed[0] <= t and next_timed[0] < self.duration_s:
                at, tenant, kind, session = next_timed
                next_timed = next(timed, None)
            elif t < self.duration_s:
                at = t
                tenant = rng.choices(tenants, tenant_weights)[0]
                kind = rng.choices(kinds, kind_weights)[0]
                stream = streams.get((tenant, kind))
                if stream is None:
                    stream = streams[(tenant, kind)] = self.workloads[kind][0].sessions(f"{self.seed}/{tenant}/{kind}")
                session = next(stream)
                t += rng.expovariate(session_rate)
            else:
                return
            n += 1
            yield at, SessionRun(session, tenant, f"{self.seed}/{tenant}/{kind}/{session.session_id}")


def _timed(workload: Workload, tenant: str, kind: int, seed: str) -> Iterator[tuple[float, str, int, Session]]:
    for t, session in workload.timed(f"{seed}/{tenant}/{kind}"):
        yield t, tenant, kind, session


def parse_mix(spec: str, params: Sequence[str] = ()) -> tuple[tuple[Workload, float], ...]:
    """`agent:2+multiturn+rag` -> workloads with weights. `--param name.field=v` sets a field of
    one workload; `field=v` sets it on every workload of the mix that has it."""
    items: list[tuple[str, float]] = []
    for item in spec.split("+"):
        name, _, weight = item.strip().partition(":")
        if name not in WORKLOADS:
            raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
        items.append((name, float(weight) if weight else 1.0))
    per_item: list[list[str]] = [[] for _ in items]
    for p in params:
        key, _, value = p.partition("=")
        scope, dot, field_name = key.rpartition(".")
        targets = [i for i, (name, _) in enumerate(items)
                   if (name == scope if dot else field_name in _field_names(name))]
        if not targets:
            raise ValueError(f"--param {p!r} matches no field of the workloads in {spec!r}")
        for i in targets:
            per_item[i].append(f"{field_name}={value}")
    mix = tuple((make_workload(name, mine), weight) for (name, weight), mine in zip(items, per_item, strict=True))
    return mix


def _field_names(name: str) -> set[str]:
    return {f.name for f in dataclasses.fields(WORKLOADS[name])}  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class Trace:
    """A Mooncake trace's requests, one single-turn session each, on their timestamps."""

    workload: TraceWorkload
    seed: str = "0"

    def arrivals(self) -> Iterator[tuple[float, SessionRun]]:
        for i, (t, s) in enumerate(self.workload.timed(self.seed)):
            yield t, SessionRun(s, s.tenant or "", f"{self.seed}/trace/{i}")

    @property
    def end_s(self) -> float:
        entries = self.workload.entries
        start = entries[0].timestamp_ms if entries else 0.0
        return max((e.timestamp_ms - start for e in entries), default=0.0) / 1000 / self.workload.speed

    @property
    def think_s(self) -> float:
        return 0.0  # single turns


def load_trace_traffic(path: str | Path, seed: str, block_size: int = 512, speed: float = 1.0,
                       limit: int | None = None) -> Trace:
    return Trace(TraceWorkload(tuple(load_trace(path, limit)), block_size=block_size, speed=speed), seed)
