"""The router's logic on its own: the overlap measure (the same numbers analyze-prefix gives a
trace), the prefix index's two feeds, rules, the cost rule, admission, ejection, and the
config's refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from bench.analyze_prefix import analyze, summarize
from bench.trace import TraceEntry
from cluster.cluster_config import parse_cluster_file, to_server_config
from cluster.errors import EdgeError, Kind
from cluster.gateway.config import OWN, GatewaySpec, HealthSpec, PoolSpec, RoutingSpec, Rule, check
from cluster.gateway.endpoints import RATE_CLAMP, RATE_EMA
from cluster.gateway.overlap import OverlapMeter
from cluster.gateway.prefix_index import PrefixIndex
from cluster.gateway.route_log import hash_id
from cluster.gateway.router import OVERLAP_PAGE, Router, endpoint_id
from engine.errors import ConfigError
from engine.tokenizer import Tokenizer
from kvcache.events import Tier
from kvcache.hashing import model_fingerprint, page_hashes

FP = model_fingerprint("t")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def ext(name: str, urls: tuple[str, ...], **kw: object) -> PoolSpec:
    return PoolSpec(name=name, kind="vllm", endpoints=urls, models=("m",), **kw)  # type: ignore[arg-type]


def spec(*pools: PoolSpec, rules: tuple[Rule, ...] = (), **routing: object) -> GatewaySpec:
    return check(GatewaySpec((PoolSpec(name=OWN, kind="baton", models=("own",)), *pools),
                             RoutingSpec(rules=rules, **routing)))  # type: ignore[arg-type]  # fmt: skip


def test_the_overlap_meter_agrees_with_analyze_prefix_on_the_same_requests() -> None:
    prompts = [[1] * 64 + [i] * 40 for i in range(5)] + [[7] * 100, [1] * 64 + [9] * 3]
    meter = OverlapMeter(window=100, min_samples=1)
    entries = []
    for n, p in enumerate(prompts):
        hashes = page_hashes(p, 16, b"", FP)
        meter.observe("k", hashes, len(p), 16)
        entries.append(TraceEntry(float(n), len(p), 1, tuple(hash_id(h) for h in hashes) + (10_000 + n,), "k"))
    ideal = summarize(analyze(entries, block_size=16, page_size=16, cache_tokens=1 << 20), 1 << 20)["ideal_hit_rate"]
    assert meter.overlap("k") == pytest.approx(ideal, abs=1e-4) and ideal > 0.3


def test_the_overlap_window_slides_and_keys_are_bounded() -> None:
    meter = OverlapMeter(window=2, min_samples=2, max_keys=2)
    same = page_hashes([3] * 64, 16, b"", FP)
    assert meter.observe("a", same, 64, 16) == 0 and meter.overlap("a") is None  # below min_samples
    assert meter.observe("a", same, 64, 16) == 48  # whole pages, never the last token
    assert meter.overlap("a") == pytest.approx(48 / 128)
    meter.observe("a", same, 64, 16)
    assert meter.overlap("a") == pytest.approx(96 / 128)  # the cold first request left the window
    meter.observe("b", same, 64, 16)
    meter.observe("c", same, 64, 16)
    assert meter.overlap("a") is None and set(meter.snapshot()) == {"b", "c"}


def test_the_index_forgets_what_it_sent_after_the_ttl_and_past_its_bound() -> None:
    clock = Clock()
    index = PrefixIndex(max_pages=4, ttl_s=10.0, clock=clock)
    a = page_hashes(list(range(48)), 16, b"", FP)
    index.sent("e1", a)
    assert index.hits(a, ["e1", "e2"])["e1"].num_pages == 3 and index.hits(a, ["e1", "e2"])["e2"].num_pages == 0
    b = page_hashes(list(range(100, 132)), 16, b"", FP)
    index.sent("e2", b)  # 5 pages sent, 4 kept: e1's oldest page goes, and with it its whole run
    assert index.hits(a, ["e1"])["e1"].num_pages == 0 and index.hits(b, ["e2"])["e2"].num_pages == 2
    clock.now += 11
    assert index.hits(b, ["e2"])["e2"].num_pages == 0 and index.num_expired >= 2


def test_precise_events_and_a_clear_feed_the_same_index() -> None:
    index = PrefixIndex()
    hashes = page_hashes(list(range(64)), 16, b"", FP)
    index.stored("v1", hashes[:3], Tier.DEVICE)
    index.stored("v1", hashes[3:], Tier.HOST)
    hit = index.hits(hashes, ["v1"])["v1"]
    assert (hit.num_device, hit.num_host) == (3, 1)
    index.removed("v1", hashes[1:2], Tier.DEVICE)
    assert index.hits(hashes, ["v1"])["v1"].num_pages == 1
    index.cleared("v1")
    assert index.hits(hashes, ["v1"])["v1"].num_pages == 0


def test_rules_then_cost_then_admission() -> None:
    clock = Clock()
    router = Router(spec(ext("p", ("http://a:1",), max_concurrency=1), ext("q", ("http://b:1", "http://c:1")),
                         rules=(Rule(pool="p", route_keys=("vip",)),)), clock)  # fmt: skip
    with pytest.raises(EdgeError) as missing:
        router.admit("nope", "k", [1, 2, 3])
    assert missing.value.kind == Kind.NOT_FOUND
    vip = router.admit("m", "vip", list(range(500, 540)))
    assert (vip.pool.name, vip.reason) == ("p", "rule")
    with pytest.raises(EdgeError) as full:  # the rule names a full pool: 429, not elsewhere
        router.admit("m", "vip", list(range(500, 540)))
    assert full.value.kind == Kind.RESOURCE_EXHAUSTED and full.value.retry_after_s
    other = router.admit("m", "k", list(range(40)))  # the cost rule passes the full pool by
    assert (other.pool.name, other.reason) == ("q", "cost")
    router.finish(vip, ok=True)
    router.finish(other, ok=True)
    assert router.pools["p"].inflight == 0 and other.endpoint.inflight == 0 and other.endpoint.inflight_tokens == 0
    # what was sent is where the next request with that prefix goes, within the pool
    again = router.admit("m", "k", list(range(40)) + [99] * 8)
    assert again.endpoint is other.endpoint and again.hit_tokens == 32
    router.finish(again, ok=True)


def test_the_cost_rule_weighs_the_uncached_prompt_against_the_queue() -> None:
    router = Router(spec(ext("p", ("http://a:1",)), ext("q", ("http://b:1",))))
    long = list(range(400))
    first = router.admit("m", "k", long)
    router.finish(first, ok=True)
    assert router.admit("m", "k", long).pool is first.pool  # it holds the prefix: cheaper
    busy = [router.admit("m", "x", list(range(1000, 1000 + 3000))) for _ in range(2)]
    assert busy[0].pool is not first.pool  # the first big prompt went to the idle pool,
    assert busy[1].pool is first.pool  # the second to the shorter queue (16 tokens against 3,000)


def test_the_cost_rule_learns_each_endpoints_prompt_rate_from_its_first_outputs() -> None:
    """Both pools configured at 4,000 tokens/s; p turns out slower (a smaller machine, or one
    carrying decode streams): once measured, the cost rule sends the work where it drains soonest.
    A sample is a request's own uncached tokens and those prefilled while it waited, over its
    wait; the average is of seconds per token, from the configured rate."""
    clock = Clock()
    router = Router(spec(ext("p", ("http://a:1",)), ext("q", ("http://b:1",))), clock)
    prior = 1 / 4000

    def rate_after(spt: float, sample: float) -> float:
        return 1 / (spt + RATE_EMA * (sample - spt))

    a = router.admit("m", "k", list(range(1000)))
    assert a.pool.name == "p"  # a tie at the configured rate: the first pool
    clock.now += 2.0
    router.first_output(a)  # 1,000 uncached tokens, nothing prefilled meanwhile, in 2 s
    router.finish(a, ok=True)
    p = a.endpoint
    assert p.prompt_rate == pytest.approx(rate_after(prior, 2.0 / 1000))
    b = router.admit("m", "k", list(range(2000, 3000)))  # p now ~1,450 tokens/s: 0.69 s; q 0.25 s
    assert b.pool.name == "q"
    c = router.admit("m", "k", list(range(4000, 5000)))  # behind b: 0.5 s on q, still less than p
    assert c.pool.name == "q"
    clock.now += 0.25
    router.first_output(b)  # 1,000 tokens in 0.25 s
    clock.now += 0.25
    router.first_output(c)  # its 1,000 and b's, prefilled while it waited, in 0.5 s
    q = b.endpoint
    assert q.prompt_rate == pytest.approx(4000.0) and q.rate_samples == 2
    # a request that ends before its first output (cancelled; or not streamed) is no work done
    gone = router.admit("m", "k", list(range(6000, 6600)))
    router.finish(gone, ok=False)
    d = router.admit("m", "k", list(range(7000, 7600)))
    assert gone.endpoint is q and d.endpoint is q
    clock.now += 0.3
    router.first_output(d)  # 600 tokens in 0.3 s: 2,000 tokens/s, not (600 + 600) / 0.3
    assert q.prompt_rate == pytest.approx(rate_after(prior, 0.3 / 600))
    assert q.prefilled_tokens == 2600
    # a short prompt's first output is mostly fixed latency: not a sample
    short = router.admit("m", "k", list(range(8000, 8100)))
    clock.now += 5.0
    router.first_output(short)
    assert short.endpoint is q and q.rate_samples == 3 and q.sampled_at < clock.now
    # an outlier (a prompt the engine had cached) moves the average by at most a clamped sample
    spt = 1 / q.prompt_rate
    fast = router.admit("m", "k", list(range(9000, 10000)))
    assert fast.endpoint is q
    clock.now += 1e-6
    router.first_output(fast)
    assert q.prompt_rate == pytest.approx(rate_after(spt, prior / RATE_CLAMP))
    # and the measurement stays (no expiry back to a configured guess)
    clock.now += 3600
    assert q.prompt_rate == pytest.approx(rate_after(spt, prior / RATE_CLAMP))
    for route in (b, c, d, short, fast):
        router.finish(route, ok=True)


def test_an_endpoint_is_ejected_after_failures_and_comes_back() -> None:
    clock = Clock()
    health = HealthSpec(failures=2, eject_s=5.0, max_eject_s=8.0)
    router = Router(spec(ext("p", ("http://a:1", "http://b:1"), health=health)), clock)
    a = router.pools["p"].endpoints[0]
    for _ in range(2):
        route = router.admit("m", "k", [1], exclude=[router.pools["p"].endpoints[1]])
        assert route.endpoint is a
        router.finish(route, ok=False, failed_endpoint=True)
    assert not a.is_available(clock()) and a.ejected_until == clock() + 5.0
    assert router.admit("m", "k", [1]).endpoint is not a
    clock.now += 5.0
    assert a.is_available(clock())
    assert a.failed(clock()) and a.eject_s == 8.0  # failing again: longer, up to the cap
    a.succeeded()
    assert a.is_available(clock()) and a.failures == 0


def test_every_endpoint_ejected_is_unavailable() -> None:
    clock = Clock()
    router = Router(spec(ext("p", ("http://a:1",), health=HealthSpec(failures=1))), clock)
    route = router.admit("m", "k", [1])
    router.finish(route, ok=False, failed_endpoint=True)
    with pytest.raises(EdgeError) as err:
        router.admit("m", "k", [1])
    assert err.value.kind == Kind.UNAVAILABLE


def test_the_own_pool_serves_its_models_and_overlap_uses_16_token_pages() -> None:
    router = Router(spec(ext("p", ("http://a:1",), block_size=32)))
    route = router.admit("own", "k", list(range(64)))
    assert route.is_own and route.reason == "model" and len(route.hashes) == 4 and len(route.overlap_hashes) == 4
    route = router.admit("m", "k", list(range(64)))
    assert len(route.hashes) == 2 and len(route.overlap_hashes) == 64 // OVERLAP_PAGE
    eid = endpoint_id("p", "http://a:1")
    assert router.index.hits(route.hashes, [eid])[eid].num_pages == 2  # indexed as sent, at admission


CONFIG = """
model: {served_name: tiny}
pools:
  vllm:
    kind: vllm
    endpoints: [http://127.0.0.1:8101]
    models: [tiny]
    kv_events: [tcp://127.0.0.1:5557]
  llama:
    kind: llama.cpp
    endpoints: [http://127.0.0.1:8102, http://127.0.0.1:8103]
    models: [tiny]
    max_concurrency: 32
routing:
  route_key: header:x-team
  rules:
    - {overlap_at_least: 0.5, pool: vllm}
    - {pool: llama}
"""


def test_cluster_yaml_pools_and_routing() -> None:
    cfg = to_server_config(parse_cluster_file(CONFIG))
    gw = cfg.gateway
    assert [p.name for p in gw.pools] == [OWN, "vllm", "llama"] and gw.own.kind == "baton"
    assert gw.pool("llama").health_path == "/health" and gw.pool("vllm").kv_events == ("tcp://127.0.0.1:5557",)
    assert gw.routing.route_key == "header:x-team" and gw.routing.rules[0] == Rule(pool="vllm", overlap_at_least=0.5)
    assert to_server_config(parse_cluster_file("model: {}")).gateway is None


@pytest.mark.parametrize(("change", "where"), [
    ("    kind: vlm\n", "pools.vllm.kind"),
    ("    endpoint: [x]\n", "pools.vllm.endpoint"),
    ("    max_concurrency: 0\n", "pools.vllm.max_concurrency"),
])  # fmt: skip
def test_a_bad_pool_key_is_refused_with_its_path(change: str, where: str) -> None:
    text = CONFIG.replace("    models: [tiny]\n    kv_events", change + "    models: [tiny]\n    kv_events", 1)
    if "kind" in change:
        text = text.replace("    kind: vllm\n", "", 1)
    with pytest.raises(ConfigError) as err:
        parse_cluster_file(text)
    assert where in str(err.value)


@pytest.mark.parametrize(("edit", "key"), [
    (("http://127.0.0.1:8101]", "ftp://127.0.0.1:8101]"), "pools.vllm.endpoints"),
    (("http://127.0.0.1:8101]", "http://u:p@127.0.0.1:8101]"), "pools.vllm.endpoints"),
    (("kv_events: [tcp://127.0.0.1:5557]", "kv_events: [tcp://a:1, tcp://b:2]"), "pools.vllm.kv_events"),
    (("{pool: llama}", "{pool: nowhere}"), "routing.rules.1.pool"),
    (("header:x-team", "cookie"), "routing.route_key"),
    (("    models: [tiny]\n    kv_events", "    kv_events"), "pools.vllm.models"),
    (("kind: llama.cpp", "kind: baton"), "pools.llama"),
    (("    models: [tiny]\n    kv_events", "    models: [tiny]\n    upstream_models: {chat: tiny}\n    kv_events"),
     "pools.vllm.upstream_models"),  # a name the pool does not serve
    (("    models: [tiny]\n    kv_events", "    models: [tiny]\n    upstream_models: {tiny: 'a b'}\n    kv_events"),
     "pools.vllm.upstream_models.tiny"),
    (("    models: [tiny]\n    kv_events", "    models: [tiny]\n    tokenizer: /models/a\n    kv_events"),
     "pools.llama.tokenizer"),  # two pools serving one model with different tokenizers
    (("pools:\n", "pools:\n  baton: {kind: baton, tokenizer: /models/a}\n"), "pools.baton"),
])  # fmt: skip
def test_pools_that_cannot_work_are_refused(edit: tuple[str, str], key: str) -> None:
    with pytest.raises(ConfigError) as err:
        to_server_config(parse_cluster_file(CONFIG.replace(*edit, 1)))
    assert err.value.field == key


def test_served_names_and_upstream_names() -> None:
    from dataclasses import replace

    from cluster.server import served_names

    text = CONFIG.replace("pools:\n", "model: {served_name: [baton-tiny, tiny-chat]}\npools:\n", 1).replace(
        "    models: [tiny]\n    kv_events", "    models: [tiny, rag]\n    upstream_models: {rag: tiny}\n    kv_events", 1)
    cfg = to_server_config(parse_cluster_file(text))
    names = served_names(cfg)
    assert names == ("baton-tiny", "tiny-chat")
    gw = cfg.gateway.with_own_models(names)
    assert gw.own.models == names and [p.name for p in gw.serving("tiny-chat")] == [OWN]
    vllm = gw.pool("vllm")
    assert (vllm.upstream_model("rag"), vllm.upstream_model("tiny")) == ("tiny", "tiny")
    assert served_names(replace(cfg, served_model_name=None)) == (Path(cfg.engine.model).name,)
    assert served_names(replace(cfg, served_model_name="one")) == ("one",)
    for bad in (("a", "a"), ("a b",), ("",), tuple(f"m{i}" for i in range(17))):
        with pytest.raises(ConfigError) as err:
            served_names(replace(cfg, served_model_name=bad))
        assert err.value.field == "model.served_name"
    own = replace(cfg.gateway, pools=(replace(cfg.gateway.own, models=("tiny-chat", "other")), *cfg.gateway.pools[1:]))
    with pytest.raises(ConfigError) as err:  # the own engine would refuse a name it is not served under
        own.with_own_models(names)
    assert err.value.field == "pools.baton.models" and "'other'" in str(err.value)
    narrowed = replace(own, pools=(replace(own.own, models=("tiny-chat",)), *own.pools[1:])).with_own_models(names)
    assert narrowed.own.models == ("tiny-chat",)


def test_a_model_has_one_tokenizer_its_pools_name(tiny_model_dir: Path, tmp_path: Path) -> None:
    from cluster.gateway.service import Gateway

    named = CONFIG.replace("    models: [tiny]\n", f"    models: [tiny]\n    tokenizer: {tiny_model_dir}\n")
    with pytest.raises(ConfigError) as err:  # the own pool serves tiny with its model's tokenizer
        to_server_config(parse_cluster_file(named)).gateway.with_own_models(("tiny",))
    assert err.value.field == "pools.vllm.tokenizer"
    spec = to_server_config(parse_cluster_file(named)).gateway.with_own_models(("other",))
    assert spec.tokenizer_paths() == {"tiny": str(tiny_model_dir)}
    own = object()
    gateway = Gateway(spec, CollectorRegistry(), 60.0)
    assert isinstance(gateway.tokenizer_for("tiny", own), Tokenizer)  # type: ignore[arg-type]
    assert gateway.tokenizer_for("other", own) is own  # type: ignore[arg-type]
    missing = named.replace(str(tiny_model_dir), str(tmp_path / "none"))
    with pytest.raises(ConfigError) as err:  # at start, naming the key, before anything is routed
        Gateway(to_server_config(parse_cluster_file(missing)).gateway.with_own_models(("other",)),
                CollectorRegistry(), 60.0)  # fmt: skip
    assert err.value.field == "pools.vllm.tokenizer" and "tokenizer.json" in str(err.value)


def test_the_router_example_parses() -> None:
    from cluster.cluster_config import load_cluster_config

    gw = load_cluster_config(Path(__file__).resolve().parents[2] / "examples" / "router.yaml").gateway
    assert gw is not None and gw.is_router_only
    assert [p.name for p in gw.with_own_models(()).pools] == ["vllm", "llama"]


def test_the_gateway_example_parses() -> None:
    from cluster.cluster_config import load_cluster_config

    cfg = load_cluster_config(Path(__file__).resolve().parents[2] / "examples" / "gateway.yaml")
    gw = cfg.gateway
    assert gw is not None and [p.name for p in gw.pools] == ["baton", "vllm", "llama"]
    assert gw.pool("vllm").kv_events == ("tcp://127.0.0.1:5557",) and gw.pool("vllm").block_size == 128
    assert gw.by_rule("tiny", "anyone", 0.9) == "vllm" and gw.by_rule("tiny", "anyone", None) is None  # cost
    assert gw.by_rule("tiny", "batch-jobs", 0.1) == "llama" and gw.by_rule("tiny", "batch-jobs", None) is None
    assert gw.pool("vllm").upstream_model("rag-tiny") == "tiny" and gw.serving("rag-tiny") == [gw.pool("vllm")]


def test_a_retry_is_placed_again_but_measured_once() -> None:
    router = Router(spec(ext("p", ("http://a:1", "http://b:1"))))
    first = router.admit("m", "k", list(range(64)))
    router.finish(first, ok=False, failed_endpoint=True)
    again = router.admit("m", "k", list(range(64)), exclude=[first.endpoint], only_pool="p")
    assert again.endpoint is not first.endpoint
    assert router.meter.snapshot()["k"]["requests"] == 1


def test_pages_sent_to_a_publisher_count_until_its_events_confirm_or_the_guess_expires() -> None:
    clock = Clock()
    index = PrefixIndex(clock=clock, expect_s=10.0)
    hashes = page_hashes(list(range(64)), 16, b"", FP)
    index.add_endpoint("v1")
    index.add_endpoint("v2")
    index.expect("v1", hashes)  # sent, no event yet
    hits = index.hits(hashes, ["v1", "v2"])
    assert (hits["v1"].num_device, hits["v2"].num_pages) == (4, 0) and index.num_expected == 4
    index.stored("v1", hashes[:2], Tier.DEVICE)  # the events confirm two: no longer guesses
    assert index.hits(hashes, ["v1"])["v1"].num_pages == 4 and index.num_expected == 2
    clock.now += 11  # the rest never came: the guess goes, and with it nothing the events said
    assert index.hits(hashes, ["v1"])["v1"].num_pages == 2 and index.num_expected == 0
    index.expect("v1", hashes)  # sent again: only what the events do not hold is a guess
    assert index.num_expected == 2
    index.removed("v1", hashes[2:3], Tier.DEVICE)  # evicted: neither held nor expected past it
    assert index.hits(hashes, ["v1"])["v1"].num_pages == 2
    index.cleared("v1")
    assert index.hits(hashes, ["v1"])["v1"].num_pages == 0 and index.num_expected == 0


def test_a_burst_sharing_a_prefix_is_computed_once_per_publisher_before_its_events_come() -> None:
    """Two endpoints that publish KV events, none received yet, and a burst of six prompts that
    share a 2,000-token prefix: each endpoint computes the prefix once (the cost rule sends the
    second prompt to the idle one), and every later prompt finds it where it was sent -- not six
    computations of it, as when only events counted."""
    router = Router(spec(ext("v", ("http://a:1", "http://b:1"),
                             kv_events=("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558"))), Clock())  # fmt: skip
    shared = list(range(2000))  # the clock stands still: no guess expires meanwhile
    burst = [router.admit("m", "k", [*shared, 10_000 + i]) for i in range(6)]
    assert [r.hit_tokens for r in burst] == [0, 0, 2000, 2000, 2000, 2000]
    assert {r.endpoint.url for r in burst[:2]} == {"http://a:1", "http://b:1"}
    for r in burst:
        router.finish(r, ok=True)
