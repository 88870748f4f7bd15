"""Each endpoint's state as the router sees it: requests in flight, health, ejection.

    ok -- `failures` consecutive failures (requests that could not connect or answered 5xx,
          or health probes) --> ejected for eject_s --> probed: ok again, or ejected for
          twice as long (up to max_eject_s)

An ejected endpoint takes no requests; the health loop probes every endpoint each period_s,
and a probe that passes brings an ejected one back. A pool admits up to max_concurrency
requests in flight across its endpoints; beyond, the request is refused (429) before it is
sent anywhere.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from cluster.gateway.config import HealthSpec, PoolSpec

RECENT = 512  # latencies kept per pool for /status's medians
# The cost rule's prompt rate, measured per endpoint from streamed requests' first outputs. A
# sample is a request's own uncached tokens plus those of the requests whose first output came
# while it waited (the prompt work the engine did meanwhile, in whatever order it chose), over
# its wait; it needs at least RATE_MIN_TOKENS of such work (below it the fixed latency -- the
# network, a decode step -- is most of a TTFT). Samples are averaged as seconds per token (what
# the cost rule multiplies by) with weight RATE_EMA, starting from the pool's configured
# prefill_tokens_per_s, each clamped to within RATE_CLAMP times of it so that one outlier (a
# prompt the engine held in a cache the index did not know of) cannot swing the estimate.
RATE_MIN_TOKENS = 256
RATE_EMA = 0.25
RATE_CLAMP = 32.0


@dataclass(slots=True, eq=False)  # compared by identity: each is one endpoint's live state
class Endpoint:
    pool: str
    url: str  # base URL (no trailing slash); the own pool's is OWN_ENDPOINT
    health: HealthSpec
    configured_seconds_per_token: float  # 1 / the pool's prefill_tokens_per_s: the rate's prior
    inflight: int = 0
    inflight_tokens: int = 0  # uncached prompt tokens of requests sent and not answered yet (queued)
    failures: int = 0  # consecutive
    ejected_until: float = 0.0
    eject_s: float = 0.0  # the current ejection's length (doubles while it keeps failing)
    num_ejections: int = 0
    num_routed: int = 0  # requests sent here (among equal costs, the least used is chosen)
    # for /status and the dashboard (the metrics have the same, as counters)
    num_ok: int = 0
    num_failed: int = 0  # error, broken or unreachable
    prompt_tokens: int = 0
    hit_tokens: int = 0  # the index's estimate, when chosen
    cached_tokens: int = 0  # what the engine reported
    kv_events: str | None = None  # its publisher's address, when its index entries are precise
    prefilled_tokens: int = 0  # uncached prompt tokens of the streamed requests whose first output came
    seconds_per_token: float = 0.0  # the prompt rate, inverted: the prior until samples move it (RATE_*)
    rate_samples: int = 0
    sampled_at: float = 0.0

    def __post_init__(self) -> None:
        self.seconds_per_token = self.configured_seconds_per_token

    @property
    def prompt_rate(self) -> float:
        """The rate the cost rule divides by (tokens/s)."""
        return 1.0 / self.seconds_per_token

    def first_output(self, own_tokens: int, prefilled_before: int, seconds: float, now: float) -> None:
        """A streamed request's first output came `seconds` after it was sent, with `own_tokens`
        uncached; `prefilled_before` was `prefilled_tokens` when it was sent."""
        work = own_tokens + self.prefilled_tokens - prefilled_before
        self.prefilled_tokens += own_tokens
        if work < RATE_MIN_TOKENS or not seconds > 0:
            return
        configured = self.configured_seconds_per_token
        sample = min(max(seconds / work, configured / RATE_CLAMP), configured * RATE_CLAMP)
        self.seconds_per_token += RATE_EMA * (sample - self.seconds_per_token)
        self.rate_samples += 1
        self.sampled_at = now

    def is_available(self, now: float) -> bool:
        return now >= self.ejected_until

    def succeeded(self) -> None:
        self.failures = 0
        self.ejected_until = 0.0
        self.eject_s = 0.0

    def failed(self, now: float) -> bool:
        """One more failure; True when it ejects the endpoint now."""
        self.failures += 1
        if self.failures < self.health.failures or now < self.ejected_until:
            return False
        self.eject_s = min(self.health.max_eject_s, self.eject_s * 2 if self.eject_s else self.health.eject_s)
        self.ejected_until = now + self.eject_s
        self.num_ejections += 1
        return True


@dataclass(slots=True, eq=False)
class Pool:
    spec: PoolSpec
    endpoints: list[Endpoint] = field(default_factory=list)
    inflight: int = 0
    next_rr: int = 0  # round robin's cursor
    ttfts: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))  # seconds, the latest
    itls: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))

    @classmethod
    def of(cls, spec: PoolSpec, own_endpoint: str) -> Pool:
        urls = (own_endpoint,) if spec.is_own else tuple(u.rstrip("/") for u in spec.endpoints)
        events = spec.kv_events or (None,) * len(urls)
        prior = 1.0 / spec.prefill_tokens_per_s
        return cls(spec, [Endpoint(spec.name, u, spec.health, prior, kv_events=e)
                          for u, e in zip(urls, events, strict=True)])

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def has_room(self) -> bool:
        return self.inflight < self.spec.max_concurrency

    def available(self, clock: Callable[[], float] = time.monotonic) -> list[Endpoint]:
        now = clock()
        return [e for e in self.endpoints if e.is_available(now)]
