"""bench.p7's traffic (the benchmark itself is run by hand): the same seeded stream for every
policy, each request a tenant's shared prompt plus fresh tokens."""

from __future__ import annotations

import argparse

from bench.p7 import traffic


def test_traffic_is_seeded_and_shares_each_tenants_prefix() -> None:
    args = argparse.Namespace(tenants=3, prefix=32, suffix=8, requests=40)
    stream = traffic(args)
    assert stream == traffic(args) and len(stream) == 40
    by_tenant: dict[str, list[list[int]]] = {}
    for tenant, prompt in stream:
        assert len(prompt) == 40
        by_tenant.setdefault(tenant, []).append(prompt)
    assert len(by_tenant) == 3
    prefixes = {tenant: {tuple(p[:32]) for p in prompts} for tenant, prompts in by_tenant.items()}
    assert all(len(p) == 1 for p in prefixes.values())  # one system prompt per tenant
    assert len({next(iter(p)) for p in prefixes.values()}) == 3  # and they differ
