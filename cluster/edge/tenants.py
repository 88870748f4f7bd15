"""API keys and tenants: who is calling, at what priority, within which rate limits.

Keys come from config or a key file (BATON_API_KEYS), one per line:

    <key> <tenant> [priority=<int>] [rps=<float>] [tps=<float>] [role=tenant|metrics|operator]

A role says what a key may do: `tenant` (the default) generates; `metrics` only reads /metrics
and /status (a scraper's key: it can neither generate nor drain); `operator` reads them too and
may use /admin/* (when enabled) -- and generate.

Lookup compares the presented key against every configured key in constant time (no early
exit), so timing reveals neither a prefix nor which key matched. With no keys configured,
every caller is the "default" tenant.
"""

from __future__ import annotations

import hmac
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from engine.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    priority: int = 0  # lower runs first (the engine's priority classes)
    requests_per_s: float | None = None  # None: unlimited
    tokens_per_s: float | None = None  # prompt + generated tokens
    role: str = "tenant"  # one of ROLES

    @property
    def is_operator(self) -> bool:
        return self.role == "operator"

    @property
    def may_observe(self) -> bool:
        """/metrics and /status: every tenant and node."""
        return self.role in ("metrics", "operator")

    @property
    def may_generate(self) -> bool:
        return self.role != "metrics"


ROLES = ("tenant", "metrics", "operator")


DEFAULT_TENANT = Tenant("default")


class TokenBucket:
    """A classic token bucket; `take` may drive it negative (tokens accounted after the fact)."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate = rate
        self.burst = burst
        self._level = burst
        self._stamp = time.monotonic()
        self._lock = threading.Lock()

    def _refill(self, now: float) -> None:
        self._level = min(self.burst, self._level + (now - self._stamp) * self.rate)
        self._stamp = now

    def try_take(self, amount: float) -> float:
        """Take `amount` now (0.0 returned), or say in how many seconds it could be taken.

        An amount above the burst is allowed from a full bucket and drives it negative, so a
        single large request is slow to repeat rather than impossible.
        """
        with self._lock:
            self._refill(time.monotonic())
            needed = min(amount, self.burst)
            if self._level >= needed:
                self._level -= amount
                return 0.0
            return (needed - self._level) / self.rate

    def charge(self, amount: float) -> None:
        with self._lock:
            self._refill(time.monotonic())
            self._level -= amount


class TenantLimits:
    """Per-tenant request-rate and token-rate buckets, created on first use."""

    def __init__(self) -> None:
        self._requests: dict[str, TokenBucket] = {}
        self._tokens: dict[str, TokenBucket] = {}

    def admit(self, tenant: Tenant, prompt_tokens: int) -> float:
        """0 if the tenant may start a request of `prompt_tokens` now, else seconds to wait."""
        if tenant.requests_per_s is not None:
            bucket = self._requests.setdefault(
                tenant.name, TokenBucket(tenant.requests_per_s, max(1.0, tenant.requests_per_s))
            )
            wait = bucket.try_take(1.0)
            if wait:
                return wait
        if tenant.tokens_per_s is not None:
            bucket = self._tokens.setdefault(tenant.name, TokenBucket(tenant.tokens_per_s, tenant.tokens_per_s))
            return bucket.try_take(float(prompt_tokens))
        return 0.0

    def charge_generated(self, tenant: Tenant, tokens: int) -> None:
        bucket = self._tokens.get(tenant.name)
        if bucket is not None:
            bucket.charge(float(tokens))


class ApiKeys:
    def __init__(self, keys: dict[str, Tenant]) -> None:
        self._keys = [(key.encode(), tenant) for key, tenant in keys.items()]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def lookup(self, presented: str | None) -> Tenant | None:
        """The presented key's tenant; None if keys are required and this one is not valid."""
        if not self._keys:
            return DEFAULT_TENANT
        if not presented:
            return None
        candidate = presented.encode()
        found: Tenant | None = None
        for key, tenant in self._keys:  # no early exit: every key is compared
            if hmac.compare_digest(key, candidate):
                found = tenant
        return found

    @classmethod
    def from_file(cls, path: Path) -> ApiKeys:
        keys: dict[str, Tenant] = {}
        try:
            lines = path.read_text().splitlines()
        except OSError as exc:
            raise ConfigError("api_keys_file", f"cannot read {path}: {exc.strerror}") from None
        for lineno, raw in enumerate(lines, 1):
            line = raw.split("#", 1)[0].strip()
            if line:
                key, tenant = _parse_key_line(line, f"{path}:{lineno}")
                keys[key] = tenant
        return cls(keys)


def _parse_key_line(line: str, where: str) -> tuple[str, Tenant]:
    parts = line.split()
    if len(parts) < 2:
        raise ConfigError("api_keys_file", f"{where}: expected '<key> <tenant> [options]'")
    key, name, options = parts[0], parts[1], parts[2:]
    if len(key) < 16:
        raise ConfigError("api_keys_file", f"{where}: keys must be at least 16 characters")
    values: dict[str, str] = {}
    for option in options:
        field, sep, value = option.partition("=")
        if not sep or field not in ("priority", "rps", "tps", "role"):
            raise ConfigError("api_keys_file", f"{where}: unknown option {option!r}")
        values[field] = value
    try:
        tenant = Tenant(
            name=name,
            priority=int(values.get("priority", "0")),
            requests_per_s=float(values["rps"]) if "rps" in values else None,
            tokens_per_s=float(values["tps"]) if "tps" in values else None,
            role=values.get("role", "tenant"),
        )
    except ValueError:
        raise ConfigError("api_keys_file", f"{where}: bad number in {options}") from None
    if tenant.role not in ROLES:
        raise ConfigError("api_keys_file", f"{where}: role is one of {', '.join(ROLES)}, not {tenant.role!r}")
    for limit in (tenant.requests_per_s, tenant.tokens_per_s):
        if limit is not None and limit <= 0:
            raise ConfigError("api_keys_file", f"{where}: rate limits must be positive")
    return key, tenant
