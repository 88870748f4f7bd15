"""`baton analyze-prefix trace.jsonl`: measure a workload's prefix overlap before deploying.

Reads a Mooncake-format trace (bench/trace.py: input_length, hash_ids of `block_size`-token
blocks, optional tenant) in file order and, for every request, finds the longest prefix it
shares with any earlier request, the way baton's cache keys pages:

    request i blocks: [7 | 3 | 9 (176 of 512)]      earlier: [7 | 3 | 4 ...]
    shared prefix: 1,024 tokens -> reusable: whole pages only, and never the last prompt token

Reported:
- the distribution of shared-prefix length (tokens) and of the shared fraction per request;
- the ideal hit rate: reusable prompt tokens / prompt tokens, token-weighted, with an
  unbounded cache, and with an LRU cache of `--cache-tokens` (what one worker could hold);
- how much of the reuse crosses tenants (baton salts pages per tenant, so that part is only
  reusable through operator-shared prefixes), and the per-tenant rates;
- a reading of the numbers for the deployment.

Everything is computed from the hash ids: no tokens, no model, no server.
"""

from __future__ import annotations

import argparse
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bench.trace import TraceEntry, load_trace

FRACTION_BUCKETS = (0.0, 0.25, 0.5, 0.75, 0.9, 1.0)


@dataclass
class _Node:
    children: dict[int, _Node] = field(default_factory=dict)
    longest: dict[str | None, int] = field(default_factory=dict)  # tenant -> most tokens of this block seen


def _blocks(entry: TraceEntry, block_size: int) -> list[tuple[int, int]]:
    """(hash id, tokens of that block in this request); padding past the ids is unique."""
    out: list[tuple[int, int]] = []
    left = entry.input_length
    for hash_id in entry.hash_ids:
        if left <= 0:
            break
        out.append((hash_id, min(block_size, left)))
        left -= block_size
    return out


def _reusable(shared: int, entry: TraceEntry, page_size: int) -> int:
    """Prompt tokens a cache can serve: whole pages, and at most input_length - 1 tokens."""
    return min(shared // page_size * page_size, (entry.input_length - 1) // page_size * page_size)


@dataclass(frozen=True)
class RequestOverlap:
    tenant: str | None
    input_length: int
    shared_any: int  # with any earlier request (ignoring tenants)
    shared_same_tenant: int  # with an earlier request of the same tenant
    reusable_unbounded: int  # page-granular, same tenant, unbounded cache
    reusable_lru: int  # page-granular, same tenant, LRU cache of cache_tokens


def analyze(entries: Sequence[TraceEntry], block_size: int, page_size: int, cache_tokens: int) -> list[RequestOverlap]:
    root = _Node()
    # (tenant, hash of the block chain) -> tokens held: a chained key, like baton's page hashes
    lru: OrderedDict[tuple[str | None, int], int] = OrderedDict()
    lru_tokens = 0
    results = []
    for entry in entries:
        blocks = _blocks(entry, block_size)
        node, shared_any, shared_tenant, tenant_run = root, 0, 0, True
        for hash_id, n in blocks:
            child = node.children.get(hash_id)
            if child is None:
                break
            overlap = min(n, max(child.longest.values()))
            shared_any += overlap
            mine = min(n, child.longest.get(entry.tenant, 0)) if tenant_run else 0
            shared_tenant += mine
            tenant_run = mine == n
            if overlap < n:
                break
            node = child
        # the same walk against a bounded LRU of this tenant's block chains
        in_lru, chain = 0, 0
        for hash_id, n in blocks:
            chain = hash((chain, hash_id))
            held = lru.get((entry.tenant, chain))
            if held is None:
                break
            lru.move_to_end((entry.tenant, chain))
            in_lru += min(n, held)
            if held < n:
                break
        results.append(RequestOverlap(entry.tenant, entry.input_length, shared_any, shared_tenant,
                                      _reusable(shared_tenant, entry, page_size),
                                      _reusable(in_lru, entry, page_size)))  # fmt: skip
        node, chain = root, 0
        for hash_id, n in blocks:
            node = node.children.setdefault(hash_id, _Node())
            node.longest[entry.tenant] = max(node.longest.get(entry.tenant, 0), n)
            chain = hash((chain, hash_id))
            key = (entry.tenant, chain)
            old = lru.pop(key, 0)
            lru[key] = max(old, n)
            lru_tokens += max(old, n) - old
        while lru_tokens > cache_tokens and lru:
            _, tokens = lru.popitem(last=False)
            lru_tokens -= tokens
    return results


def summarize(results: Sequence[RequestOverlap], cache_tokens: int) -> dict[str, Any]:
    if not results:
        raise ValueError("the trace has no requests")
    prompt = sum(r.input_length for r in results)
    shared = np.array([r.shared_same_tenant for r in results], dtype=np.float64)
    fraction = np.array([r.shared_same_tenant / r.input_length for r in results])
    counts, _ = np.histogram(fraction, bins=FRACTION_BUCKETS)
    cross = sum(r.shared_any - r.shared_same_tenant for r in results)
    tenants: dict[str, dict[str, float]] = {}
    for name in sorted({str(r.tenant) for r in results}):
        mine = [r for r in results if str(r.tenant) == name]
        tokens = sum(r.input_length for r in mine)
        tenants[name] = {"requests": len(mine), "hit_rate": round(sum(r.reusable_unbounded for r in mine) / tokens, 4)}
    return {
        "requests": len(results),
        "prompt_tokens": prompt,
        "shared_prefix_tokens": {p: float(np.percentile(shared, q)) for p, q in (("p50", 50), ("p90", 90), ("p99", 99))},
        "shared_fraction_histogram": {
            f"[{lo:.2f}, {hi:.2f}{']' if hi == 1.0 else ')'}": int(c)
            for lo, hi, c in zip(FRACTION_BUCKETS, FRACTION_BUCKETS[1:], counts, strict=False)
        },
        "ideal_hit_rate": round(sum(r.reusable_unbounded for r in results) / prompt, 4),
        "lru_hit_rate": round(sum(r.reusable_lru for r in results) / prompt, 4),
        "lru_cache_tokens": cache_tokens,
        "cross_tenant_share_of_overlap": round(cross / max(1, sum(r.shared_any for r in results)), 4),
        "tenants": tenants,
    }


def reading(summary: dict[str, Any]) -> list[str]:
    """What the numbers mean for a deployment, in plain sentences."""
    ideal, lru, cross = summary["ideal_hit_rate"], summary["lru_hit_rate"], summary["cross_tenant_share_of_overlap"]
    lines = [f"At most {ideal:.0%} of prompt tokens can come from a prefix cache (unbounded, per tenant)."]
    if ideal < 0.1:
        lines.append("Little overlap: prefix caching and cache-aware routing will not pay much; size for raw prefill.")
    elif lru < 0.8 * ideal:
        lines.append(f"A cache of {summary['lru_cache_tokens']:,} tokens keeps only {lru:.0%}: add host/disk tiers "
                     "or more workers' worth of cache; the working set is larger than one worker.")  # fmt: skip
    else:
        lines.append(f"A cache of {summary['lru_cache_tokens']:,} tokens already keeps {lru:.0%}: "
                     "cache-aware routing matters more than capacity.")  # fmt: skip
    if cross > 0.2:
        lines.append(f"{cross:.0%} of the overlap is between tenants: shareable only as operator-shared "
                     "prefixes (--shared-prefix), since baton isolates tenants' pages.")  # fmt: skip
    return lines


def routes(path: str, summary: dict[str, Any], config: str | None, limit: int | None) -> dict[str, Any]:
    """Per route key (the log's `tenant`): its overlap (the measure the gateway routes by), the
    pools its requests went to (a gateway's log), and with a cluster.yaml, where its rules send
    a key with that overlap (the first rule that matches; else the cost rule decides per request)."""
    import json
    from collections import Counter

    went: dict[str, Counter[str]] = {}
    models: dict[str, Counter[str]] = {}
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f):
            if (limit is not None and n >= limit) or not line.strip():
                continue
            raw = json.loads(line)
            key = str(raw.get("tenant"))
            went.setdefault(key, Counter())[str(raw.get("pool", "?"))] += 1
            models.setdefault(key, Counter())[str(raw.get("model", ""))] += 1
    spec = None
    if config is not None:
        from cluster.cluster_config import load_cluster_config
        from cluster.server import served_names

        cfg = load_cluster_config(config)
        if cfg.gateway is None:
            raise SystemExit(f"{config} names no pools")
        spec = cfg.gateway.with_own_models(served_names(cfg))
    out: dict[str, Any] = {}
    for key, row in summary["tenants"].items():
        entry: dict[str, Any] = {"requests": row["requests"], "overlap": row["hit_rate"]}
        if key in went:
            entry["went_to"] = dict(went[key].most_common())
        if spec is not None:
            model = models.get(key, Counter({"": 1})).most_common(1)[0][0]
            serving = [p.name for p in spec.serving(model)]
            ruled = spec.by_rule(model, key, row["hit_rate"])
            entry["rules_send_to"] = (serving[0] if len(serving) == 1 else ruled) or "the cost rule (no rule matches)"
        out[key] = entry
    return out


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser("analyze-prefix", help="prefix-overlap analysis of a trace (JSONL)")
    p.add_argument("trace", help="Mooncake-format JSONL: input_length, output_length, hash_ids, tenant")
    p.add_argument("--block-size", type=int, default=512, help="tokens per hash id (Mooncake: 512)")
    p.add_argument("--page-size", type=int, default=16, help="baton's KV page size")
    p.add_argument("--cache-tokens", type=int, default=1_000_000, help="LRU cache size to simulate")
    p.add_argument("--limit", type=int, default=None, help="read only the first N requests")
    p.add_argument("--router-log", action="store_true",
                   help="the trace is a gateway's request log (routing.log_path): 16-token pages, and per "
                        "route key the pools its requests went to")  # fmt: skip
    p.add_argument("--config", default=None,
                   help="a cluster.yaml: per route key, the pool its routing rules send it to at its overlap")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    import json

    for name in ("block_size", "page_size", "cache_tokens"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be positive")
    if args.router_log:
        from cluster.gateway.router import OVERLAP_PAGE

        args.block_size = args.page_size = OVERLAP_PAGE
    results = analyze(load_trace(args.trace, args.limit), args.block_size, args.page_size, args.cache_tokens)
    summary = summarize(results, args.cache_tokens)
    if args.router_log or args.config:
        summary["routes"] = routes(args.trace, summary, args.config, args.limit)
    print(json.dumps(summary, indent=2))
    for line in reading(summary):
        print(line)
    return 0
