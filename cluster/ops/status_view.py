"""`baton status`: the gateway's GET /status JSON (cluster.ops.node_status) as a table.

    baton-tiny  ready  up 2m05s  waiting 0  inflight 3  requests: ok 120, cancelled 2
    NODE      ROLE     ADDRESS   HEALTH  EPOCH  RUN  WAIT  HIT%   DEVICE used/cached/total  HOST cached/total ...
    decode-0  decode   10.0.0.3  ok          1    3     0  42.1%  120/30/512                -

ADDRESS is the node's (Ray's node IP; "-" in one process); HOST is the host-RAM tier. KERNELS
is what the node's engine runs on (engine.kernel_info): `cpu/panel avx2` is baton's compiled CPU
kernels; `torch/...` on a CPU node means they could not be built there (a slower path).

    KV ROUTES
      prefill-0 (10.0.0.2) -> decode-0 (10.0.0.3)  grpc  ok 118  failed 0

HIT% is token-weighted and cumulative: prompt tokens served from any tier of the node's
prefix cache over prompt tokens looked up (by tier: `baton status --json` or /metrics).
"""

from __future__ import annotations

from typing import Any


def render_status(body: dict[str, Any]) -> str:
    gw = body.get("gateway", {})
    outcomes = ", ".join(f"{k} {v}" for k, v in sorted(gw.get("requests", {}).items())) or "none yet"
    state = "draining" if body.get("draining") else "ready" if body.get("ready") else "not ready"
    model = body.get("model") or ("a router (no model of its own)" if body.get("pools") else "?")
    lines = [f"{model}  {state}  up {_duration(float(body.get('uptime_s', 0)))}  "
             f"waiting {gw.get('waiting', 0)}  inflight {gw.get('inflight', 0)}  requests: {outcomes}"]  # fmt: skip
    header = ["NODE", "ROLE", "ADDRESS", "HEALTH", "EPOCH", "RUN", "WAIT", "HIT%",
              "DEVICE used/cached/total", "HOST cached/total", "DISK cached/total", "KERNELS"]  # fmt: skip
    rows = [header]
    for n in body.get("nodes", []):
        cache = n.get("cache", {})
        tiers = cache.get("tiers", {})
        query, hit = cache.get("query_tokens", 0), cache.get("hit_tokens", 0)
        device = tiers.get("device")
        rows.append([
            str(n.get("name")), str(n.get("role")), str(n.get("host") or "-"), str(n.get("health")),
            str(n.get("epoch", 0)),
            str(n.get("running", 0)), str(n.get("waiting", 0)), f"{100 * hit / query:.1f}%" if query else "-",
            f"{device['pages_used']}/{device['pages_cached']}/{device['pages_total']}" if device else "-",
            _lower(tiers.get("host")), _lower(tiers.get("disk")), _kernels(n.get("kernels")),
        ])  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    numeric = {4, 5, 6, 7}
    for r in rows:
        cells = [c.rjust(w) if i in numeric and r is not header else c.ljust(w)
                 for i, (c, w) in enumerate(zip(r, widths, strict=True))]  # fmt: skip
        lines.append("  ".join(cells).rstrip())
    if len(rows) == 1:
        lines.append("(no nodes)")
    lines += _pairs(body.get("pairs", []))
    lines += _pools(body.get("pools"))
    return "\n".join(lines)


def _kernels(k: dict[str, Any] | None) -> str:
    """attention/projections and ISA, as the dashboard shows them (engine.kernel_info)."""
    if not k or not k.get("attention"):
        return "-"
    return f"{k['attention']}/{k['linear']}" + (f" {k['isa']}" if k.get("isa") else "")


def _pools(gateway: dict[str, Any] | None) -> list[str]:
    """The external engines a gateway routes to (cluster.gateway): each endpoint's state."""
    pools = (gateway or {}).get("pools") or {}
    external = {name: p for name, p in pools.items() if p.get("kind") != "baton"}
    if not external:
        return []
    lines = ["", "POOLS"]
    for name, p in external.items():
        lines.append(f"  {name} ({p.get('kind')}: {', '.join(p.get('models', []))})  inflight "
                     f"{p.get('inflight', 0)}/{p.get('max_concurrency', '?')}")  # fmt: skip
        for e in p.get("endpoints", []):
            state = "up" if e.get("up") else f"EJECTED for {e.get('ejected_for_s', 0)} s"
            lines.append(f"    {e.get('url')}  {state}  inflight {e.get('inflight', 0)}  ok {e.get('ok', 0)}  "
                         f"failed {e.get('failed', 0)}  index {e.get('index')}")  # fmt: skip
    return lines


def _pairs(pairs: list[dict[str, Any]]) -> list[str]:
    """The KV routes between prefill and decode workers; an unroutable pair says why."""
    if not pairs:
        return []
    lines = ["", "KV ROUTES"]
    for p in pairs:
        route = f"{p['prefill']} ({p['prefill_host'] or '?'}) -> {p['decode']} ({p['decode_host'] or '?'})"
        state = (f"{p['transport'] or '-'}  ok {p['transfers']}  failed {p['total_failures']}" if p["routable"]
                 else f"UNROUTABLE  {p['transport'] or '-'}  failed {p['total_failures']}: {p['reason']}")  # fmt: skip
        lines.append(f"  {route}  {state}")
    return lines


def _lower(tier: dict[str, Any] | None) -> str:
    return f"{tier['pages_cached']}/{tier['pages_total']}" if tier else "-"


def _duration(seconds: float) -> str:
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
