"""What the gateway routes over, as `cluster.yaml`'s `pools:` and `routing:` sections describe it
(cluster.cluster_config checks the file's keys; this module checks what only makes sense
together: URLs, names, rules that name pools, one own pool).

    pools:
      baton:    {kind: baton}                    this gateway's own workers (model:, workers:);
                                                 enabled: false, none: a router over the others
      vllm:     {kind: vllm, endpoints: [http://10.0.0.5:8000], models: [llama-3-8b],
                 upstream_models: {llama-3-8b: meta-llama/Meta-Llama-3-8B-Instruct},
                 max_concurrency: 64, kv_events: [tcp://10.0.0.5:5557],
                 tokenizer: /models/Meta-Llama-3-8B-Instruct}
    routing:
      route_key: tenant                          tenant | user | header:<name>
      rules: [{overlap_at_least: 0.5, pool: baton}]

A pool serves the names in its `models` (the own pool: the names the gateway's engine is
served under, `model.served_name`); an external pool sends each upstream as `upstream_models`
names it (unchanged where it does not), and answers carry whatever name the engine gives.
Route tokens (the prefix index's pages, the overlap measure) come from the tokenizer of the
request's model: its pools' `tokenizer` (one per model), else the gateway's own model's.
A request's model picks the pools that serve it; among several, the first rule that matches
(its models, its route keys, the route key's measured overlap) names one; else the cost rule
picks the pool whose best endpoint has the lowest predicted TTFT.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Literal
from urllib.parse import urlsplit

from engine.errors import ConfigError

EngineKind = Literal["baton", "vllm", "sglang", "llama.cpp", "openai-compatible"]
EXTERNAL_KINDS: tuple[str, ...] = ("vllm", "sglang", "llama.cpp", "openai-compatible")
OWN = "baton"  # the kind, and the default name, of this gateway's own workers' pool
OWN_ENDPOINT = "local"  # the own pool's one endpoint: this process's engine side

# What each engine answers while it can serve (GET, 200).
HEALTH_PATHS: dict[str, str] = {"vllm": "/health", "sglang": "/health", "llama.cpp": "/health",
                                "openai-compatible": "/v1/models"}  # fmt: skip

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_HEADER = re.compile(r"^[A-Za-z0-9-]{1,64}$")
MODEL_NAME = re.compile(r"[!-~]{1,256}")  # a model's name: printable ASCII, no space (fullmatch)


@dataclass(frozen=True, slots=True)
class HealthSpec:
    path: str | None = None  # None: the kind's (HEALTH_PATHS)
    period_s: float = 5.0
    timeout_s: float = 2.0
    failures: int = 3  # consecutive failed requests or probes: the endpoint is ejected
    eject_s: float = 10.0  # first ejection; doubles while it keeps failing, up to max_eject_s
    max_eject_s: float = 300.0


@dataclass(frozen=True, slots=True)
class PoolSpec:
    name: str
    kind: EngineKind
    endpoints: tuple[str, ...] = ()  # base URLs (http[s]://host:port[/prefix]); none for the own pool
    models: tuple[str, ...] = ()  # names clients send; the own pool's default: its served names
    upstream_models: tuple[tuple[str, str], ...] = ()  # (a name of models, the name sent upstream)
    max_concurrency: int = 64  # requests in flight across the pool; beyond, 429
    api_key_file: str | None = None  # sent upstream as `Authorization: Bearer` (engine.secrets)
    kv_events: tuple[str, ...] = ()  # one tcp://host:port per endpoint, in order (vLLM's publisher)
    kv_events_topic: str = ""
    block_size: int = 16  # the engine's KV block, in tokens: the granularity of its prefix index
    prefill_tokens_per_s: float = 4000.0  # where the cost rule's measured prompt rate starts (endpoints.py)
    endpoint_policy: Literal["prefix", "round_robin"] = "prefix"
    connect_timeout_s: float = 5.0
    health: HealthSpec = field(default_factory=HealthSpec)
    # The engine's tokenizer (a directory with its tokenizer.json, e.g. the checkpoint's): route
    # tokens for this pool's models come from it. None: the gateway's own model's tokenizer, which
    # matches the engine's only when both serve the same checkpoint.
    tokenizer: str | None = None
    enabled: bool = True  # the own pool only: false, the gateway runs no workers (a router over its pools)

    @property
    def is_own(self) -> bool:
        return self.kind == OWN

    @property
    def health_path(self) -> str:
        return self.health.path or HEALTH_PATHS.get(self.kind, "/health")

    def upstream_model(self, model: str) -> str:
        """The name `model` is sent upstream as."""
        return next((up for name, up in self.upstream_models if name == model), model)


@dataclass(frozen=True, slots=True)
class Rule:
    """Send a request to `pool` when all of its conditions hold (an absent one holds)."""

    pool: str
    models: tuple[str, ...] = ()
    route_keys: tuple[str, ...] = ()
    overlap_at_least: float | None = None
    overlap_below: float | None = None

    def matches(self, model: str, route_key: str, overlap: float | None) -> bool:
        if self.models and model not in self.models:
            return False
        if self.route_keys and route_key not in self.route_keys:
            return False
        if self.overlap_at_least is not None and (overlap is None or overlap < self.overlap_at_least):
            return False
        return not (self.overlap_below is not None and (overlap is None or overlap >= self.overlap_below))


@dataclass(frozen=True, slots=True)
class RoutingSpec:
    route_key: str = "tenant"  # tenant (the API key's), user (the body's `user`), header:<name>
    window: int = 64  # requests per route key in the overlap measure
    min_samples: int = 4  # fewer requests seen: the overlap is unknown (rules on it do not match)
    max_route_keys: int = 4096
    pages_per_key: int = 1 << 16  # the overlap measure's memory of a key's prefixes, in pages
    rules: tuple[Rule, ...] = ()
    approx_ttl_s: float = 600.0  # the approximate index forgets what it sent an endpoint after this
    approx_max_pages: int = 1 << 20
    log_path: str | None = None  # the request log (route_log) `baton analyze-prefix --router-log` reads
    log_max_bytes: int = 64 << 20


@dataclass(frozen=True, slots=True)
class GatewaySpec:
    pools: tuple[PoolSpec, ...]
    routing: RoutingSpec = field(default_factory=RoutingSpec)

    def pool(self, name: str) -> PoolSpec:
        for p in self.pools:
            if p.name == name:
                return p
        raise KeyError(name)

    @property
    def own(self) -> PoolSpec | None:
        return next((p for p in self.pools if p.is_own), None)

    @property
    def has_external(self) -> bool:
        return any(not p.is_own for p in self.pools)

    @property
    def is_router_only(self) -> bool:
        """No workers of its own (pools.baton.enabled: false): every model is an external pool's."""
        own = self.own
        return own is not None and not own.enabled

    def serving(self, model: str) -> list[PoolSpec]:
        return [p for p in self.pools if model in p.models]

    def by_rule(self, model: str, route_key: str, overlap: float | None,
                usable: Callable[[str], bool] = lambda _: True) -> str | None:  # fmt: skip
        """The pool the first matching rule names among `usable` pools serving `model`, if any."""
        serving = {p.name for p in self.serving(model)}
        for rule in self.routing.rules:
            if rule.pool in serving and usable(rule.pool) and rule.matches(model, route_key, overlap):
                return rule.pool
        return None

    def with_own_models(self, served_names: tuple[str, ...]) -> GatewaySpec:
        """The own pool serves the gateway's model under its served names, or under those of
        them it lists (a name the engine is not served under would be routed there and refused)."""
        if self.is_router_only:  # its pool leaves the routing: nothing can be sent there
            return GatewaySpec(tuple(p for p in self.pools if not p.is_own), self.routing)
        pools = []
        for p in self.pools:
            if p.is_own:
                unknown = [m for m in p.models if m not in served_names]
                if unknown:
                    raise ConfigError(f"pools.{p.name}.models", f"{unknown[0]!r} is not a name the gateway's model "
                                      f"is served under ({', '.join(served_names)}; model.served_name)")  # fmt: skip
                p = replace(p, models=p.models or tuple(served_names))
            pools.append(p)
        own = next((p for p in pools if p.is_own), None)
        for p in pools:
            shared = [m for m in p.models if own is not None and m in own.models]
            if p.tokenizer is not None and shared:
                raise ConfigError(f"pools.{p.name}.tokenizer", f"the gateway's own pool serves {shared[0]!r} too, "
                                  "with its model's tokenizer: a model has one tokenizer")  # fmt: skip
        return GatewaySpec(tuple(pools), self.routing)

    def tokenizer_paths(self) -> dict[str, str]:
        """model -> the tokenizer its pools name (the models whose pools name one)."""
        return {m: p.tokenizer for p in self.pools if p.tokenizer is not None for m in p.models}


def check(spec: GatewaySpec) -> GatewaySpec:
    """Refuse, naming the key, what the schema alone cannot see."""
    names = [p.name for p in spec.pools]
    if len(set(names)) != len(names):
        raise ConfigError("pools", "pool names must be unique")
    if sum(p.is_own for p in spec.pools) > 1:
        raise ConfigError("pools", f"at most one pool of kind {OWN} (this gateway's own workers)")
    for p in spec.pools:
        key = f"pools.{p.name}"
        if not _NAME.match(p.name):
            raise ConfigError(key, "a pool's name is a word of letters, digits, '.', '_' or '-'")
        if p.is_own:
            if p.endpoints or p.kv_events or p.api_key_file or p.upstream_models or p.tokenizer:
                raise ConfigError(key, f"a {OWN} pool is this gateway's own workers: no endpoints, "
                                       "kv_events, api_key_file, upstream_models or tokenizer")  # fmt: skip
            if not p.enabled and not spec.has_external:
                raise ConfigError(f"{key}.enabled", "a gateway without workers of its own routes to external "
                                  "pools: name at least one")  # fmt: skip
            continue
        if not p.enabled:
            raise ConfigError(f"{key}.enabled", f"only the {OWN} pool (this gateway's own workers) can be turned "
                              "off; leave an external pool out instead")  # fmt: skip
        if not p.endpoints:
            raise ConfigError(f"{key}.endpoints", "an external pool needs at least one endpoint URL")
        if len(set(p.endpoints)) != len(p.endpoints):
            raise ConfigError(f"{key}.endpoints", "endpoint URLs must be unique")
        for url in p.endpoints:
            check_url(url, f"{key}.endpoints")
        if not p.models:
            raise ConfigError(f"{key}.models", "name the models clients reach this pool by")
        for name, upstream in p.upstream_models:
            if name not in p.models:
                raise ConfigError(f"{key}.upstream_models", f"{name!r} is not one of the pool's models")
            if not MODEL_NAME.fullmatch(upstream):
                raise ConfigError(f"{key}.upstream_models.{name}", "1 to 256 characters, no spaces or control "
                                  "characters")  # fmt: skip
        if p.kv_events and len(p.kv_events) != len(p.endpoints):
            raise ConfigError(f"{key}.kv_events", "one publisher address per endpoint, in the endpoints' order")
        if p.kv_events and p.kind != "vllm":
            raise ConfigError(f"{key}.kv_events", "KV events are read in vLLM's format: kind vllm")
    named: dict[str, tuple[str, str | None]] = {}  # model -> (the first external pool serving it, its tokenizer)
    for p in spec.pools:
        for m in p.models if not p.is_own else ():
            first, path = named.setdefault(m, (p.name, p.tokenizer))
            if path != p.tokenizer:
                raise ConfigError(f"pools.{p.name}.tokenizer", f"pools {first!r} and {p.name!r} both serve {m!r}: "
                                  "name the same tokenizer in both (a model has one)")  # fmt: skip
    known = {p.name for p in spec.pools if p.enabled}
    for i, rule in enumerate(spec.routing.rules):
        if rule.pool not in known:
            off = " (enabled: false: it runs no workers)" if rule.pool in names else ""
            raise ConfigError(f"routing.rules.{i}.pool", f"no pool named {rule.pool!r}{off}")
    rk = spec.routing.route_key
    if rk not in ("tenant", "user") and not (rk.startswith("header:") and _HEADER.match(rk[7:])):
        raise ConfigError("routing.route_key", "tenant, user, or header:<name>")
    return spec


def check_url(url: str, key: str) -> None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(key, f"{url!r}: an http:// or https:// URL with a host")
    if parts.username or parts.password or parts.query or parts.fragment:
        raise ConfigError(key, f"{url!r}: no credentials, query or fragment in an endpoint URL")
    try:
        port = parts.port
    except ValueError:
        raise ConfigError(key, f"{url!r}: the port is not a number in 1..65535") from None
    if port == 0:
        raise ConfigError(key, f"{url!r}: the port is not a number in 1..65535")
    host = parts.hostname
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if not re.match(r"^[A-Za-z0-9.-]{1,253}$", host):
            raise ConfigError(key, f"{url!r}: not a host name or an IP address") from None
