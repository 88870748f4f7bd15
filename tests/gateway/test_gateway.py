"""The gateway over pools, with real servers on loopback: baton servers as plain OpenAI
endpoints (no KV events) behind a gateway whose own baton-tiny workers run beside them.
Model routing, overlap-rule routing, the approximate index's stickiness against round robin,
ejection of a killed endpoint with no failed request, and a client's cancel reaching the
upstream."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.server_proc import BatonProcess
from cluster.cli import main
from cluster.gateway.config import HealthSpec, RoutingSpec, Rule
from cluster.gateway.endpoints import RATE_CLAMP, RATE_EMA
from engine.tokenizer import Tokenizer
from tests.cluster.conftest import ServerHandle, all_pages_free
from tests.cluster.test_metrics_catalog import (
    GATEWAY_FROM,
    RAY_ONLY_FROM,
    catalog,
    check_exports,
    section,
)
from tests.gateway.conftest import EXT, pool

pytestmark = pytest.mark.timeout(120)

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()  # fmt: skip


def text(seed: int, n: int) -> str:
    """n words, a different sequence for each seed (no 16-token page shared between seeds)."""
    return " ".join(f"{WORDS[(seed * 7 + i * 3) % len(WORDS)]}{seed}" for i in range(n))


def complete(url: str, prompt: str, model: str = EXT, **extra: object) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0, **extra}
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def samples(url: str, family: str) -> dict[tuple[tuple[str, str], ...], float]:
    text_ = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for fam in text_string_to_metric_families(text_):
        for s in fam.samples:
            if s.name == family:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def count(url: str, family: str, **labels: str) -> float:
    return sum(v for k, v in samples(url, family).items() if all((n, labels[n]) in k for n in labels))


def test_model_routing_sends_each_model_to_its_pool(
    upstreams: list[ServerHandle], make_gateway: Callable[..., ServerHandle]
) -> None:
    """Each name to the pool that serves it: the own model under each of its served names,
    an external pool's names with the one it renames sent upstream as the engine's."""
    gw = make_gateway([pool("ext", [upstreams[0].url], models=(EXT, "chat"), upstream_models=(("chat", EXT),))],
                      served=("baton-tiny", "tiny-alias"))  # fmt: skip
    before = count(upstreams[0].url, "baton_requests_total", outcome="ok")
    own = complete(gw.url, "hello there", model="baton-tiny")
    alias = complete(gw.url, "hello there", model="tiny-alias")
    ext = complete(gw.url, "hello there")
    renamed = complete(gw.url, "hello there", model="chat")  # the upstream serves only EXT: it 404s any other
    assert own.status_code == 200 and own.headers["x-baton-pool"] == "baton"
    assert alias.status_code == 200 and alias.headers["x-baton-pool"] == "baton", alias.text
    assert alias.json()["model"] == "baton-tiny" and alias.json()["choices"] == own.json()["choices"]  # the first name
    assert ext.status_code == 200 and ext.headers["x-baton-pool"] == "ext", ext.text
    assert ext.json()["model"] == EXT and ext.json()["choices"][0]["text"]
    assert renamed.status_code == 200 and renamed.headers["x-baton-pool"] == "ext", renamed.text
    assert renamed.json()["model"] == EXT and renamed.json()["choices"] == ext.json()["choices"]
    assert count(upstreams[0].url, "baton_requests_total", outcome="ok") == before + 2
    missing = complete(gw.url, "hello", model="nope")
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
    models = {m["id"]: m["owned_by"] for m in httpx.get(gw.url + "/v1/models").json()["data"]}
    assert models == {"baton-tiny": "baton", "tiny-alias": "baton", EXT: "ext", "chat": "ext"}
    # streamed, through the proxy: SSE passed on as it came, TTFT per pool on the gateway
    with httpx.stream("POST", gw.url + "/v1/completions", timeout=60,
                      json={"model": EXT, "prompt": "one two", "max_tokens": 4, "stream": True}) as r:  # fmt: skip
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 2
    assert count(gw.url, "baton_pool_ttft_seconds_count", pool="ext") == 1
    assert count(gw.url, "baton_route_decisions_total", pool="ext", reason="model") == 3
    status = httpx.get(gw.url + "/status").json()["pools"]
    assert status["pools"]["ext"]["endpoints"][0]["index"] == "approximate"
    # a two-token prompt is no sample of the prompt rate; a 360-token one is (the cost rule's)
    assert status["pools"]["ext"]["endpoints"][0]["prompt_rate"] == {"tokens_per_s": 4000.0, "samples": 0,
                                                                      "age_s": None}  # fmt: skip
    with httpx.stream("POST", gw.url + "/v1/completions", timeout=60,
                      json={"model": EXT, "prompt": text(300, 100), "max_tokens": 4, "stream": True}) as r:  # fmt: skip
        assert r.status_code == 200 and [line for line in r.iter_lines() if line.startswith("data: ")][-1] == "data: [DONE]"
    rate = httpx.get(gw.url + "/status").json()["pools"]["pools"]["ext"]["endpoints"][0]["prompt_rate"]
    # one sample moved the average off the configured 4,000 tokens/s, by at most a clamped sample
    # (RATE_EMA of the way to 32x slower or faster in seconds per token)
    assert rate["samples"] == 1 and rate["tokens_per_s"] != 4000.0 and rate["age_s"] >= 0
    assert 4000 / (1 - RATE_EMA + RATE_EMA * RATE_CLAMP) <= rate["tokens_per_s"] <= 4000 / (1 - RATE_EMA + RATE_EMA / RATE_CLAMP)
    assert count(gw.url, "baton_pool_prompt_rate_tokens_per_second", pool="ext") == pytest.approx(
        rate["tokens_per_s"], abs=0.05)
    # the own pool's streams are watched the same way: its first output ends its prompt work
    assert count(gw.url, "baton_pool_ttft_seconds_count", pool="baton") == 0  # non-streamed so far
    with httpx.stream("POST", gw.url + "/v1/completions", timeout=60,
                      json={"model": "baton-tiny", "prompt": text(302, 100), "max_tokens": 4, "stream": True}) as r:  # fmt: skip
        assert r.headers["x-baton-pool"] == "baton" and [line for line in r.iter_lines() if line][-1] == "data: [DONE]"
    own = httpx.get(gw.url + "/status").json()["pools"]["pools"]["baton"]["endpoints"][0]
    assert own["prompt_rate"]["samples"] == 1 and own["inflight"] == 0
    assert count(gw.url, "baton_pool_ttft_seconds_count", pool="baton") == 1
    # docs/metrics.md, whole: the colocated rows and the gateway's (tests/cluster/test_metrics_catalog.py)
    rows = catalog()
    check_exports(gw.url, {**section(rows, None, RAY_ONLY_FROM), **section(rows, GATEWAY_FROM, None)})


def test_overlap_rules_send_prefix_heavy_keys_to_the_prefix_pool(
    upstreams: list[ServerHandle], make_gateway: Callable[..., ServerHandle], tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    log = tmp_path / "routes.jsonl"
    routing = RoutingSpec(route_key="user", window=8, min_samples=2, log_path=str(log),
                          rules=(Rule(pool="prefixed", overlap_at_least=0.5), Rule(pool="plain")))  # fmt: skip
    gw = make_gateway([pool("prefixed", [upstreams[0].url]), pool("plain", [upstreams[1].url])], routing)
    shared = text(1, 120)  # a long shared document, then a short question
    got: dict[str, list[str]] = {"rag": [], "chat": []}
    for i in range(6):
        for user, prompt in (("rag", f"{shared} question {i}"), ("chat", text(100 + i, 40))):
            r = complete(gw.url, prompt, user=user)
            assert r.status_code == 200, r.text
            got[user].append(r.headers["x-baton-pool"])
    # unknown overlap (fewer than min_samples requests) matches no overlap rule: the catch-all;
    # after two, rag's rate is (0 + ~0.95) / 2 < 0.5, from the third on it is above
    assert got["rag"] == ["plain"] * 3 + ["prefixed"] * 3
    assert got["chat"] == ["plain"] * 6
    overlap = httpx.get(gw.url + "/status").json()["pools"]["overlap"]
    assert overlap["rag"]["overlap"] > 0.8 and overlap["chat"]["overlap"] == 0.0
    assert count(gw.url, "baton_route_decisions_total", pool="prefixed", reason="rule") == 3
    # the request log, read back by `baton analyze-prefix`: per route key, the same overlap and
    # where the rules of a cluster.yaml send it (no prompt text in the log)
    assert "alpha" not in log.read_text() and len(log.read_text().splitlines()) == 12
    config = tmp_path / "cluster.yaml"
    config.write_text(f"""
pools:
  prefixed: {{kind: vllm, endpoints: ["{upstreams[0].url}"], models: [{EXT}]}}
  plain: {{kind: llama.cpp, endpoints: ["{upstreams[1].url}"], models: [{EXT}]}}
routing:
  rules: [{{overlap_at_least: 0.5, pool: prefixed}}, {{pool: plain}}]
""")
    capsys.readouterr()
    assert main(["analyze-prefix", str(log), "--router-log", "--config", str(config)]) == 0
    report = json.loads(capsys.readouterr().out.split("\n}\n")[0] + "\n}")
    rag, chat = report["routes"]["rag"], report["routes"]["chat"]
    assert rag["went_to"] == {"plain": 3, "prefixed": 3} and rag["rules_send_to"] == "prefixed"
    assert rag["overlap"] == pytest.approx(overlap["rag"]["overlap"], abs=0.02)
    assert chat["overlap"] == 0.0 and chat["rules_send_to"] == "plain"


def _conversations(gw: ServerHandle, user: str, seed: int, turns: int = 4, convs: int = 3) -> tuple[int, int]:
    """Multi-turn chats interleaved, each turn the whole history again; -> (cached, prompt) tokens
    as the upstream engines reported them."""
    history = [text(seed + c, 30) for c in range(convs)]
    cached = prompt = 0
    for turn in range(turns):
        for c in range(convs):
            history[c] += " " + text(seed + 50 + c * 10 + turn, 12)
            r = complete(gw.url, history[c], user=user)
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
            prompt += usage["prompt_tokens"]
            cached += usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return cached, prompt


def test_the_approximate_index_keeps_conversations_where_their_prefix_is(
    upstreams: list[ServerHandle], make_gateway: Callable[..., ServerHandle]
) -> None:
    urls = [u.url for u in upstreams]
    routing = RoutingSpec(route_key="user", rules=(Rule(pool="sticky", route_keys=("s",)),
                                                   Rule(pool="rr", route_keys=("r",))))  # fmt: skip
    gw = make_gateway([pool("sticky", urls), pool("rr", urls, endpoint_policy="round_robin")], routing)
    sticky_cached, sticky_prompt = _conversations(gw, "s", seed=300)
    rr_cached, rr_prompt = _conversations(gw, "r", seed=600)
    sticky, rr = sticky_cached / sticky_prompt, rr_cached / rr_prompt
    assert sticky > 0.5 and sticky > rr + 0.2, (sticky, rr)
    # the gateway's estimate agrees with what the engines reported, on the sticky pool
    est = count(gw.url, "baton_pool_estimated_hit_tokens_total", pool="sticky")
    rep = count(gw.url, "baton_pool_reported_cached_tokens_total", pool="sticky")
    assert rep == sticky_cached and abs(est - rep) <= 0.1 * sticky_prompt, (est, rep)
    # new conversations spread over the endpoints when neither holds their prefix
    per_endpoint = samples(gw.url, "baton_pool_requests_total")
    sticky_counts = [v for k, v in per_endpoint.items() if ("pool", "sticky") in k]
    assert len(sticky_counts) == 2 and min(sticky_counts) >= 4


def test_a_killed_endpoint_is_ejected_and_no_request_fails(
    upstreams: list[ServerHandle], make_gateway: Callable[..., ServerHandle], tiny_model_dir: Path, tmp_path: Path
) -> None:
    with BatonProcess(["--model", str(tiny_model_dir), "--served-model-name", EXT, "--max-model-len", "512",
                       "--kv-pages", "128"], tmp_path / "victim.log") as victim:  # fmt: skip
        victim.wait_ready(90)
        health = HealthSpec(period_s=3600.0, failures=2, eject_s=60.0)
        gw = make_gateway([pool("ext", [victim.url, upstreams[0].url], endpoint_policy="round_robin", health=health)])
        for i in range(4):  # both endpoints serve, and hold pooled connections
            assert complete(gw.url, text(900 + i, 10)).status_code == 200
        other_ok = count(gw.url, "baton_pool_requests_total", endpoint=upstreams[0].url, outcome="ok")
        assert victim.proc is not None
        body = {"model": EXT, "prompt": text(940, 10), "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", gw.url + "/v1/completions", json=body, timeout=60) as r:  # round robin: the victim's
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            victim.proc.send_signal(signal.SIGKILL)  # mid-stream: ~390 tokens still to come
            rest = list(lines)
        victim.proc.wait(10)
        # broken off after its first byte: never sent elsewhere, the stream just ends (no [DONE])
        assert "data: [DONE]" not in rest
        assert count(gw.url, "baton_pool_requests_total", endpoint=victim.url, outcome="broken") == 1
        assert count(gw.url, "baton_pool_requests_total", endpoint=upstreams[0].url, outcome="ok") == other_ok
        codes = [complete(gw.url, text(950 + i, 10)).status_code for i in range(8)]
    assert codes == [200] * 8  # the one sent to the dead endpoint could not connect: retried, and it is ejected
    assert count(gw.url, "baton_pool_endpoint_up", endpoint=victim.url) == 0
    assert count(gw.url, "baton_pool_ejections_total", endpoint=victim.url) == 1
    assert count(gw.url, "baton_pool_requests_total", endpoint=victim.url, outcome="unreachable") == 1
    assert count(gw.url, "baton_pool_requests_total", endpoint=upstreams[0].url, outcome="ok") >= 10
    assert count(gw.url, "baton_requests_total", outcome="error") == 1  # the stream that had started


def test_a_client_that_leaves_cancels_the_upstream_request(
    upstreams: list[ServerHandle], make_gateway: Callable[..., ServerHandle]
) -> None:
    up = upstreams[1]
    gw = make_gateway([pool("ext", [up.url], max_concurrency=1)])
    before = count(up.url, "baton_requests_total", outcome="cancelled")
    gate, paused = threading.Event(), threading.Event()

    def hold(_engine: object) -> None:  # on the upstream's step thread: no step runs meanwhile
        paused.set()
        gate.wait(30)

    body = {"model": EXT, "prompt": text(7, 20), "max_tokens": 400, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", gw.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["choices"][0]["text"] is not None
            asyncio.run_coroutine_threadsafe(up.running.front.call(hold), up.loop)  # type: ignore[union-attr]
            assert paused.wait(10)
            full = complete(gw.url, "another")  # the pool's one place is taken: 429, never sent
            assert full.status_code == 429 and full.headers["retry-after"] == "1"
            assert full.json()["error"]["type"] == "rate_limit_exceeded"
        # the client has gone mid-stream, with 390-odd tokens still to come upstream
        for _ in range(200):
            if count(gw.url, "baton_pool_requests_total", outcome="cancelled") == 1:
                break
            threading.Event().wait(0.05)
        assert count(gw.url, "baton_pool_requests_total", outcome="cancelled") == 1
    finally:
        gate.set()
    assert asyncio.run_coroutine_threadsafe(all_pages_free(up.engine), up.loop).result(10)
    for _ in range(200):  # the upstream counts its call when its handler has ended
        if count(up.url, "baton_requests_total", outcome="cancelled") == before + 1:
            break
        threading.Event().wait(0.05)
    assert count(up.url, "baton_requests_total", outcome="cancelled") == before + 1


def test_grpc_clients_are_served_from_an_http_pool(
    upstreams: list[ServerHandle], make_gateway: Callable[..., ServerHandle]
) -> None:
    import grpc

    from batonpb.baton.v1 import generation_pb2 as pb
    from batonpb.baton.v1 import generation_pb2_grpc as pb_grpc
    from bench.server_proc import free_port

    port = free_port()
    gw = make_gateway([pool("ext", [upstreams[0].url], models=(EXT, "chat"), upstream_models=(("chat", EXT),))],
                      grpc_port=port, served=("baton-tiny", "tiny-alias"))  # fmt: skip
    prompt = text(11, 12)
    want = complete(gw.url, prompt, max_tokens=8).json()["choices"][0]["text"]
    sampling = pb.Sampling(max_tokens=8, temperature=0.0)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        parts = list(stub.Generate(pb.GenerateRequest(model=EXT, text=prompt, sampling=sampling), timeout=60))
        whole = stub.Complete(pb.CompleteRequest(model=EXT, text=prompt, sampling=sampling), timeout=60)
        own = stub.Complete(pb.CompleteRequest(model="baton-tiny", text=prompt, sampling=sampling), timeout=60)
        own_parts = list(stub.Generate(pb.GenerateRequest(model="baton-tiny", text=text(303, 100), sampling=sampling),
                                       timeout=60))  # fmt: skip
        alias = stub.Complete(pb.CompleteRequest(model="tiny-alias", text=prompt, sampling=sampling), timeout=60)
        renamed = stub.Complete(pb.CompleteRequest(model="chat", text=prompt, sampling=sampling), timeout=60)
        with pytest.raises(grpc.RpcError) as refused:  # constrained output stays with the own pool
            stub.Complete(pb.CompleteRequest(model=EXT, text=prompt, sampling=pb.Sampling(json_object=True)))
    assert "".join(p.text for p in parts) == want == whole.text
    assert parts[0].request_id and parts[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert parts[-1].usage.completion_tokens == 8 and parts[-1].usage.prompt_tokens > 0
    assert whole.usage.completion_tokens == 8 and own.text and own.token_ids
    assert (alias.text, alias.token_ids) == (own.text, own.token_ids) and renamed.text == want  # sent upstream as EXT
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert count(gw.url, "baton_route_decisions_total", pool="ext") == 5
    assert count(gw.url, "baton_requests_total", api="grpc", outcome="ok") == 6
    # an own-pool stream over gRPC: its first output is the own pool's TTFT and prompt-rate sample,
    # the time between its outputs the pool's ITL
    assert sum(len(p.token_ids) for p in own_parts) == 8
    assert count(gw.url, "baton_pool_ttft_seconds_count", pool="baton") == 1
    outputs = [p for p in own_parts if p.text or p.token_ids]
    assert len(outputs) >= 2 and count(gw.url, "baton_pool_itl_seconds_count", pool="baton") == len(outputs) - 1
    own_rate = httpx.get(gw.url + "/status").json()["pools"]["pools"]["baton"]["endpoints"][0]["prompt_rate"]
    assert own_rate["samples"] == 1


def word_tokenizer(directory: Path, words: set[str]) -> Tokenizer:
    """Another engine's tokenizer: one id per whitespace-separated word (a tokenizer.json in
    `directory`, as a checkpoint holds it), its ids unlike baton-tiny's."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    backend = HFTokenizer(WordLevel({w: 1000 + i for i, w in enumerate(["[UNK]", *sorted(words)])}, unk_token="[UNK]"))
    backend.pre_tokenizer = Whitespace()
    directory.mkdir(parents=True, exist_ok=True)
    backend.save(str(directory / "tokenizer.json"))
    return Tokenizer.from_dir(directory)


@pytest.mark.parametrize(("engine_tokens", "named"), [
    ("gateway's", False),  # the engine serves the gateway's own checkpoint: its tokens are the gateway's
    ("another", True),  # another checkpoint, whose tokenizer the pool names
    ("another", False),  # ... not named: the gateway's route tokens never match the engine's blocks
])  # fmt: skip
def test_kv_events_from_a_publisher_steer_requests_to_the_endpoint_holding_the_prefix(
    upstreams: list[ServerHandle], make_gateway: Callable[..., ServerHandle], tmp_path: Path, engine_tokens: str,
    named: bool,
) -> None:
    """Precise prefix awareness: a vLLM-shaped publisher per endpoint says the second endpoint
    holds a prompt's blocks; the router sends that prompt there (the first is idle and equal
    in every other way), and /status says the endpoints' index is fed by KV events. The blocks'
    tokens are the engine's: they match the request only through the engine's tokenizer."""
    import msgpack
    import zmq

    from bench.server_proc import free_port

    prompt = text(21, 60)
    other = word_tokenizer(tmp_path / "other", set(prompt.split()))
    ports = [free_port(), free_port()]
    ctx = zmq.Context.instance()
    pubs = [ctx.socket(zmq.PUB) for _ in ports]
    try:
        for sock, port in zip(pubs, ports, strict=True):
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(f"tcp://127.0.0.1:{port}")
        gw = make_gateway([pool("ext", [u.url for u in upstreams], kind="vllm", block_size=16,  # probed at /health
                                kv_events=tuple(f"tcp://127.0.0.1:{p}" for p in ports), kv_events_topic="kv",
                                tokenizer=str(tmp_path / "other") if named else None)])  # fmt: skip
        subs = gw.running.frontend.gateway._subscribers  # type: ignore[union-attr]
        seqs = [0, 0]

        def publish(i: int, events: list[list[object]]) -> None:
            payload = msgpack.packb([1.0, events, 0])
            pubs[i].send_multipart([b"kv", seqs[i].to_bytes(8, "big"), payload])
            seqs[i] += 1

        for i, (_, _, sub, _) in enumerate(subs):  # ZMQ's slow joiner: until each subscriber hears
            for _ in range(400):
                publish(i, [["AllBlocksCleared"]])
                if sub.stats()["messages"]:
                    break
                threading.Event().wait(0.01)
            assert sub.stats()["messages"]
        tok = gw.running.frontend.tokenizer if engine_tokens == "gateway's" else other
        tokens = tok.encode(prompt, True)
        blocks = len(tokens) // 16
        assert blocks >= 3
        publish(1, [["BlockStored", list(range(1, blocks + 1)), None, tokens[: blocks * 16], 16, None, None]])
        for _ in range(400):  # the subscriber applies what it receives on the gateway's loop
            if subs[1][2].stats()["events"] >= 1:
                break
            threading.Event().wait(0.01)
        # what the request is sent stays expected until this test reads /status, however slow the
        # machine (10 s by default: a timing the assertion below must not ride on)
        gw.running.frontend.gateway.router.index.expect_s = 3600.0  # type: ignore[union-attr]
        assert complete(gw.url, prompt).status_code == 200
    finally:
        for sock in pubs:
            sock.close()
    status = httpx.get(gw.url + "/status").json()["pools"]
    endpoints = status["pools"]["ext"]["endpoints"]
    assert {e["index"] for e in endpoints} == {"kv-events"}
    if engine_tokens == "gateway's" or named:
        assert [e["ok"] for e in endpoints] == [0, 1] and endpoints[1]["estimated_hit_tokens"] == blocks * 16
        assert status["expected_pages"] == 0  # the events had said it holds every page it was sent
    else:  # nothing matched: a tie, which the first endpoint takes
        assert [e["ok"] for e in endpoints] == [1, 0] and endpoints[1]["estimated_hit_tokens"] == 0
        assert status["expected_pages"] >= 3  # what it was sent counts until its events say


def test_health_probes_eject_an_endpoint_and_bring_it_back(make_gateway: Callable[..., ServerHandle]) -> None:
    """A probe that fails ejects (no request needed); one that passes ends the ejection."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from bench.server_proc import free_port

    class Health(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self.send_response(200 if self.path == "/health" else 404)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    gw = make_gateway([pool("ext", [url], kind="llama.cpp", health=HealthSpec(period_s=3600.0, failures=1))])
    gateway = gw.running.frontend.gateway
    assert gateway is not None

    def probe() -> dict[str, object]:
        asyncio.run_coroutine_threadsafe(gateway.probe_all(), gw.loop).result(10)
        return httpx.get(gw.url + "/status").json()["pools"]["pools"]["ext"]["endpoints"][0]

    assert probe()["up"] is False  # nothing listens there
    assert complete(gw.url, "hello").status_code == 503  # every endpoint ejected: 503, retry-after
    server = ThreadingHTTPServer(("127.0.0.1", port), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        endpoint = probe()
    finally:
        server.shutdown()
        server.server_close()
    assert endpoint["up"] is True and endpoint["failures"] == 0 and endpoint["ejections"] >= 1


def test_a_connection_the_engine_closes_is_dialled_again_without_blaming_it(
    make_gateway: Callable[..., ServerHandle],
) -> None:
    """An engine that closes a pooled connection as the next request goes out (its keep-alive
    timer firing just then): the request is sent again on a new connection and answered; the
    endpoint stays in, nothing counted as its failure."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from bench.server_proc import free_port

    seen = {"connections": 0, "posts": 0}  # connections that carried a POST, POSTs read
    answer = json.dumps({"id": "cmpl-1", "object": "text_completion", "created": 0, "model": EXT,
                         "choices": [{"index": 0, "text": " ok", "finish_reason": "length", "logprobs": None}],
                         "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}).encode()  # fmt: skip

    class ClosesOnReuse(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: the gateway pools the connection
        posts = 0  # on this connection

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            # the health probe; its connection closes, so the gateway pools only the POSTs'
            self.send_response(200 if self.path == "/health" else 404)
            self.send_header("content-length", "0")
            self.send_header("connection", "close")
            self.close_connection = True
            self.end_headers()

        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers["content-length"]))
            seen["posts"] += 1
            self.posts += 1
            if self.posts > 1:  # the second request on a connection: closed unanswered
                self.close_connection = True
                return
            seen["connections"] += 1
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args: object) -> None:
            pass

    port = free_port()
    server = ThreadingHTTPServer(("127.0.0.1", port), ClosesOnReuse)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    try:
        gw = make_gateway([pool("ext", [url], kind="llama.cpp")])  # one endpoint: nowhere else to go
        first, second = complete(gw.url, "hello"), complete(gw.url, "hello again")
    finally:
        server.shutdown()
        server.server_close()
    assert (first.status_code, second.status_code) == (200, 200), second.text
    # the second went out on the first's pooled connection, was dropped, and went again on a new one
    assert seen == {"connections": 2, "posts": 3}
    assert count(gw.url, "baton_pool_requests_total", endpoint=url, outcome="dropped") == 1
    assert count(gw.url, "baton_pool_requests_total", endpoint=url, outcome="unreachable") == 0
    assert count(gw.url, "baton_pool_requests_total", endpoint=url, outcome="ok") == 2
    endpoint = httpx.get(gw.url + "/status").json()["pools"]["pools"]["ext"]["endpoints"][0]
    assert endpoint["up"] is True and endpoint["failures"] == 0 and endpoint["failed"] == 0
