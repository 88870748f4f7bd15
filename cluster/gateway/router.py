"""Where one request goes: a pool, then an endpoint of it.

    pools = those serving the request's model                   none: 404 model_not_found
    one pool                  -> it                              (reason "model")
    several: the first rule that matches (its models, route keys and the route key's
             measured overlap, cluster.gateway.overlap)          (reason "rule")
             else the cost rule: the pool whose best endpoint has the lowest predicted TTFT
                                                                 (reason "cost")
    endpoint: the lowest predicted TTFT among the pool's endpoints that are not ejected
              (endpoint_policy prefix), or the next in turn (round_robin)

Predicted TTFT of an endpoint = (prompt tokens it has queued -- sent, no output yet -- + this
prompt's tokens it does not hold) / its prompt rate, where what it holds comes from the prefix
index (precise from KV events, else what the gateway sent it). The prompt rate is measured for
every endpoint, the own pool's too: each streamed request's first output (`first_output`, from
the proxy's watch of the answer, or an own-pool gRPC stream) takes its tokens off the queue and
is a sample (its own uncached tokens and those of the requests that got their first output while
it waited, over its wait), so a pool on slower hardware, or one already carrying many decode
streams, is seen to be slower; the pool's configured prefill_tokens_per_s is where the average
starts (cluster.gateway.endpoints, RATE_*). A pool at its max_concurrency takes
nothing more: the cost rule passes it by, and a model or rule that names it is refused with 429.

`admit` teaches the overlap measure and the approximate index what is being sent (at once, so
a burst sharing a prefix sees its own first requests) and returns a Route, which the caller must
`finish` exactly once: it counts the request in flight on its pool and endpoint until then.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from cluster.errors import EdgeError, Kind
from cluster.gateway.config import OWN_ENDPOINT, GatewaySpec, PoolSpec
from cluster.gateway.endpoints import Endpoint, Pool
from cluster.gateway.overlap import OverlapMeter
from cluster.gateway.prefix_index import PrefixIndex
from kvcache.hashing import model_fingerprint, page_hashes

OVERLAP_PAGE = 16  # the overlap measure's page, in tokens (analyze-prefix's default page size)
_OVERLAP_FP = model_fingerprint("baton-gateway", "overlap")


def pool_fingerprint(pool: PoolSpec) -> bytes:
    """The page-hash fingerprint of a pool's index entries: its name (an endpoint serves its pool's models)."""
    return model_fingerprint("baton-gateway", pool.name)


def endpoint_id(pool: str, url: str) -> str:
    return f"{pool}/{url}"


@dataclass(slots=True)
class Route:
    pool: Pool
    endpoint: Endpoint
    reason: str  # model, rule, cost
    route_key: str
    overlap: float | None
    prompt_tokens: int
    hit_tokens: int  # of the prompt, what the endpoint is estimated to hold
    prefilled_before: int  # the endpoint's prefilled_tokens when this one was sent (its rate's sample)
    hashes: list[bytes]  # the prompt's pages in the pool's block size
    overlap_hashes: list[bytes]
    started: float = field(default_factory=time.monotonic)
    done: bool = False
    prefilled: bool = False  # its first output came: its prompt is no longer in the endpoint's queue
    tokens: Sequence[int] = ()  # the route tokens, kept where a retry needs them (gRPC)

    @property
    def is_own(self) -> bool:
        return self.pool.spec.is_own


class Router:
    def __init__(self, spec: GatewaySpec, clock: Callable[[], float] = time.monotonic) -> None:
        self.spec = spec
        self.clock = clock
        self.pools = {p.name: Pool.of(p, OWN_ENDPOINT) for p in spec.pools}
        r = spec.routing
        self.meter = OverlapMeter(r.window, r.min_samples, r.max_route_keys, r.pages_per_key)
        self.index = PrefixIndex(r.approx_max_pages, r.approx_ttl_s, clock)
        for pool in self.pools.values():
            for e in pool.endpoints:
                self.index.add_endpoint(endpoint_id(pool.name, e.url))
        self._fingerprints = {p.name: pool_fingerprint(p) for p in spec.pools}

    def serving(self, model: str) -> list[Pool]:
        return [p for p in self.pools.values() if model in p.spec.models]

    def admit(
        self, model: str, route_key: str, tokens: Sequence[int], exclude: Sequence[Endpoint] = (),
        only_pool: str | None = None,
    ) -> Route:
        """Pick a pool and an endpoint and count the request in flight there (EdgeError:
        NOT_FOUND for a model no pool serves, UNAVAILABLE when every endpoint is ejected,
        RESOURCE_EXHAUSTED when the chosen pool is full). `exclude`: endpoints that already
        failed this request (a retry before its first byte goes elsewhere when it can);
        `only_pool`: the retry stays in the pool first chosen (and the overlap measure, which
        saw the request the first time, does not count it again)."""
        pools = [p for p in self.serving(model) if only_pool is None or p.name == only_pool]
        if not pools:
            raise EdgeError(Kind.NOT_FOUND, f"model {model!r} does not exist", "model")
        overlap = self.meter.overlap(route_key)
        now = self.clock()
        live = {p.name: [e for e in p.endpoints if e.is_available(now) and e not in exclude] or
                        [e for e in p.endpoints if e.is_available(now)] for p in pools}  # fmt: skip
        hashes = {p.name: self._hashes(p.spec, tokens) for p in pools}
        options: dict[str, list[_Option]] = {}

        def options_of(p: Pool) -> list[_Option]:  # each pool's endpoints costed once a request
            if p.name not in options:
                options[p.name] = self._options(p, live[p.name], hashes[p.name], len(tokens))
            return options[p.name]

        pool, reason = self._pool(model, route_key, overlap, pools, live, options_of)
        if not live[pool.name]:
            raise EdgeError(Kind.UNAVAILABLE, f"every endpoint of pool {pool.name!r} is ejected", retry_after_s=1.0)
        if not pool.has_room:
            raise EdgeError(Kind.RESOURCE_EXHAUSTED, f"pool {pool.name!r} has {pool.spec.max_concurrency} requests "
                                                     "in flight, its max_concurrency", retry_after_s=1.0)  # fmt: skip
        if pool.spec.endpoint_policy == "round_robin":
            _, endpoint, hit = options_of(pool)[pool.next_rr % len(live[pool.name])]
            pool.next_rr += 1
        else:
            _, endpoint, hit = min(options_of(pool), key=lambda o: o.key)
        pool.inflight += 1
        endpoint.inflight += 1
        endpoint.num_routed += 1
        endpoint.inflight_tokens += len(tokens) - hit
        overlap_hashes = page_hashes(tokens, OVERLAP_PAGE, b"", _OVERLAP_FP)
        # Learned as the request is sent, not when it ends: a burst that shares a prefix sees its
        # own first requests (the overlap measure, and where the prefix is going to be).
        if only_pool is None:
            self.meter.observe(route_key, overlap_hashes, len(tokens), OVERLAP_PAGE)
        if endpoint.kv_events is None:  # what it was sent stands for what it holds
            self.index.sent(endpoint_id(pool.name, endpoint.url), hashes[pool.name])
        else:  # its own events are the truth; what it was sent counts only until they come
            self.index.expect(endpoint_id(pool.name, endpoint.url), hashes[pool.name])
        return Route(pool, endpoint, reason, route_key, overlap, len(tokens), hit, endpoint.prefilled_tokens, hashes[pool.name],
                     overlap_hashes, started=now)  # fmt: skip

    def first_output(self, route: Route) -> None:
        """The endpoint has prefilled this prompt: the cost rule stops counting it as queued, and
        the time it took is a sample of the endpoint's prompt rate."""
        if not route.prefilled and not route.done:
            route.prefilled = True
            uncached = route.prompt_tokens - route.hit_tokens
            route.endpoint.inflight_tokens -= uncached
            now = self.clock()
            route.endpoint.first_output(uncached, route.prefilled_before, now - route.started, now)

    def finish(self, route: Route, ok: bool, failed_endpoint: bool = False) -> None:
        """The request ended: `ok` (answered), or not; `failed_endpoint`: the endpoint's fault
        (no connection, a 5xx), which counts toward its ejection."""
        if route.done:
            return
        route.done = True
        route.pool.inflight -= 1
        e = route.endpoint
        e.inflight -= 1
        if not route.prefilled:
            e.inflight_tokens -= route.prompt_tokens - route.hit_tokens
        if failed_endpoint:
            e.failed(self.clock())
        elif ok:
            e.succeeded()

    # -- choices -----------------------------------------------------------------------------

    def _hashes(self, pool: PoolSpec, tokens: Sequence[int]) -> list[bytes]:
        return page_hashes(tokens, pool.block_size, b"", self._fingerprints[pool.name])

    def _pool(
        self, model: str, route_key: str, overlap: float | None, pools: list[Pool], live: dict[str, list[Endpoint]],
        options_of: Callable[[Pool], list[_Option]],
    ) -> tuple[Pool, str]:
        if len(pools) == 1:
            return pools[0], "model"
        by_name = {p.name: p for p in pools}
        ruled = self.spec.by_rule(model, route_key, overlap, lambda name: name in by_name and bool(live[name]))
        if ruled is not None:
            return by_name[ruled], "rule"
        costed = [(min(o.key for o in options_of(p))[0], i, p) for i, p in enumerate(pools)
                  if live[p.name] and p.has_room]  # fmt: skip
        if costed:
            return min(costed, key=lambda c: (c[0], c[1]))[2], "cost"
        # every pool full or ejected: the first with a live endpoint answers (429 when full)
        return next((p for p in pools if live[p.name]), pools[0]), "cost"

    def _options(self, pool: Pool, live: list[Endpoint], hashes: list[bytes], num_tokens: int) -> list[_Option]:
        """Each live endpoint with the prompt tokens it holds and its predicted TTFT (one index lookup)."""
        spec = pool.spec
        held = self.index.hits(hashes, [endpoint_id(pool.name, e.url) for e in live])
        out = []
        for i, e in enumerate(live):
            hit_tokens = min(held[endpoint_id(pool.name, e.url)].num_pages * spec.block_size, max(0, num_tokens - 1))
            cost = (e.inflight_tokens + num_tokens - hit_tokens) / e.prompt_rate
            out.append(_Option((cost, e.inflight, e.num_routed, i), e, hit_tokens))
        return out


class _Option(NamedTuple):
    key: tuple[float, int, int, int]  # predicted TTFT (s), then fewer in flight, fewer routed, order
    endpoint: Endpoint
    hit_tokens: int
