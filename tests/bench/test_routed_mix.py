"""bench.routed_mix: the mixed multi-tenant schedule (deterministic, bounded, each part the overlap
it claims), the goodput arithmetic per part, how a request carries its tenant (API key, `user`),
vLLM's KV-events arguments (bench.peers.vllm_cpu); then the command against the client's test
double and, end to end, against a real baton server that requires API keys."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench import routed_mix as rm
from bench.peers import vllm_cpu
from bench.prompts import PromptMode, PromptRenderer
from bench.report import SLO
from bench.runner import RequestRecord, RunPlan, RunResult
from bench.transport import StreamResult
from cluster.server import ServerConfig
from engine.engine import Engine
from engine.engine_config import EngineConfig
from tests.bench.conftest import FakeOpenAIServer
from tests.cluster.conftest import ServerHandle, start_server

TOKENS = PromptRenderer(PromptMode.TOKENS, vocab_size=16384)
DEFAULT = rm.MixSpec(rate=2.0, num_requests=48, shares=(("rag", 1.0), ("random", 1.0), ("agent", 1.0)))


def prompts(arrivals: tuple[rm.Arrival, ...]) -> list[list[int]]:
    out = []
    for a in arrivals:
        ids = TOKENS.render(a.session.prompt_parts(0, ()))
        assert isinstance(ids, list)
        out.append(ids)
    return out


def shape(arrivals: tuple[rm.Arrival, ...]) -> list[tuple[float, str, int, int, str | None]]:
    return [(a.offset_s, a.part, a.session.nominal_prompt_len(0), a.session.turns[0].output_len, a.session.tenant)
            for a in arrivals]  # fmt: skip


def test_the_schedule_is_deterministic_and_only_the_prompt_seed_changes_the_tokens() -> None:
    first, again = rm.build_mix(DEFAULT, "s1", "s1"), rm.build_mix(DEFAULT, "s1", "s1")
    assert first == again and prompts(first) == prompts(again)
    other_target = rm.build_mix(DEFAULT, "s1", "s1/vllm")
    assert shape(other_target) == shape(first)  # same parts, order, times, lengths and tenants
    assert all(a != b for a, b in zip(prompts(other_target), prompts(first), strict=True))  # fresh tokens
    assert shape(rm.build_mix(DEFAULT, "s2", "s1")) != shape(first)  # another seed: other times


def test_every_part_is_its_own_tenant_with_the_overlap_it_claims() -> None:
    arrivals = rm.build_mix(DEFAULT, "s1", "s1")
    assert {a.part: (a.session.tag, a.session.tenant) for a in arrivals} == {p: (p, p) for p in ("rag", "random", "agent")}
    overlap = rm.overlap_by_part(arrivals, TOKENS)
    # rag: 16 prompts of 2,050 tokens, all but the first reuse the 2,000-token system prompt (125 pages)
    assert overlap["rag"] == round(15 * 2000 / (16 * 2050), 4)
    # agent: 2 bursts of 8 agents, 2,850 tokens each: a burst's first agent reuses the fleet's
    # 2,500-token prefix (156 whole pages: 2,496), the other seven the burst's 2,800 as well
    assert overlap["agent"] == round((14 * 2800 + 2496) / (16 * 2850), 4)
    assert overlap["random"] == 0.0
    by_part = {p: [ids for ids, a in zip(prompts(arrivals), arrivals, strict=True) if a.part == p] for p in overlap}
    assert len({tuple(ids[:2000]) for ids in by_part["rag"]}) == 1
    assert len({tuple(ids[:2500]) for ids in by_part["agent"]}) == 1
    assert len({tuple(ids[:16]) for ids in by_part["random"]}) == 16


def test_arrivals_are_bounded_split_by_weight_and_ordered_in_time() -> None:
    assert rm.part_counts(10, [("rag", 1.0), ("random", 1.0), ("agent", 1.0)]) == {"rag": 4, "random": 3, "agent": 3}
    assert rm.part_counts(7, [("rag", 2.0), ("random", 0.0), ("agent", 1.0)]) == {"rag": 5, "random": 0, "agent": 2}
    spec = dataclasses.replace(DEFAULT, num_requests=7, shares=(("rag", 2.0), ("random", 0.0), ("agent", 1.0)))
    arrivals = rm.build_mix(spec, "s", "s")
    assert [a.part for a in arrivals].count("rag") == 5 and len(arrivals) == 7
    offsets = [a.offset_s for a in arrivals]
    assert offsets == sorted(offsets) and all(math.isfinite(t) and t > 0 for t in offsets)
    for bad in (0, rm.MAX_REQUESTS + 1):
        with pytest.raises(ValueError, match="--requests"):
            rm.build_mix(dataclasses.replace(DEFAULT, num_requests=bad), "s", "s")
    with pytest.raises(ValueError, match="weights"):
        rm.part_counts(4, [("rag", 0.0)])


def test_a_part_arrives_at_its_share_of_the_rate_and_agents_in_bursts() -> None:
    import random

    times = rm.arrival_times(random.Random("t"), 4000, 2.0, rm.Schedule())
    assert len(times) == 4000 and 0.9 < 4000 / times[-1] / 2.0 < 1.1  # Poisson at 2 req/s
    bursts = rm.arrival_times(random.Random("t"), 20, 2.0, rm.Schedule(), fanout=8, spread_s=0.5)
    assert len(bursts) == 20  # 8 + 8 + 4
    for start in (0, 8, 16):
        group = bursts[start : start + 8]
        assert max(group) - min(group) <= 0.5
    assert bursts[8] - bursts[7] > 0  # groups start at Poisson times after each other
    bursty = rm.arrival_times(random.Random("t"), 2000, 1.0, rm.Schedule(bursty=True, burst_factor=4.0))
    inside = sum(1 for t in bursty if t % 20.0 < 4.0)
    assert inside > 0.4 * len(bursty)  # 4 s of every 20 at 4x the rate: half the arrivals, not a fifth


def result(ok: bool = True, ttft: float = 0.5, itls: tuple[float, ...] = (0.05,) * 7) -> StreamResult:
    return StreamResult(ok=ok, error=None if ok else "HTTP 500: boom", ttft_s=ttft if ok else None,
                        e2e_s=ttft + sum(itls), itl_s=itls if ok else (), num_chunks=len(itls) + 1 if ok else 0,
                        output_tokens=len(itls) + 1 if ok else 0, prompt_tokens=10, cached_tokens=None,
                        finish_reason="length", text="", token_ids=None)  # fmt: skip


def record(part: str, start: float, res: StreamResult) -> RequestRecord:
    return RequestRecord(f"{part}/{start}", 0, part, part, start, 8, 10, None, res)


def test_goodput_counts_requests_meeting_both_slos_per_second_of_the_whole_run() -> None:
    records = (
        record("rag", 0.0, result()),  # meets both
        record("rag", 1.0, result(ttft=3.0)),  # TTFT over 2 s
        record("rag", 2.0, result(itls=(0.05,) * 6 + (0.5,))),  # its own ITL p99 over 0.2 s
        record("rag", 3.0, result(ok=False)),  # failed
        record("random", 4.0, result(ttft=1.9)),
        record("random", 5.0, result(itls=())),  # one token: no interval, meets the ITL SLO
    )
    plan = RunPlan("gateway", "s", None, None, len(records))
    run = RunResult(plan, "routed-mix", 10.0, records)
    s = rm.part_summaries(run, SLO(2.0, 0.2), ["rag", "random"])
    assert (s["all"].goodput_req_s, s["rag"].goodput_req_s, s["random"].goodput_req_s) == (0.3, 0.1, 0.2)
    assert (s["rag"].num_ok, s["rag"].num_failed, s["random"].num_failed) == (3, 1, 0)
    assert s["rag"].ttft_p90_ms == 2500.0  # of 0.5, 3.0, 0.5 s
    assert s["rag"].label == "rag" and s["all"].label == "gateway"
    v = rm.verdict([("gateway", 0.3), ("vllm", 0.2), ("llama", 0.25)])
    assert v is not None and (v["best_other"], v["beats"]) == ("llama", True) and v["ratio"] == pytest.approx(1.2)
    assert rm.verdict_line(v).endswith("= 1.20x: beats it")
    lost = rm.verdict([("gateway", 0.0), ("vllm", 0.0)])
    assert lost is not None and (lost["ratio"], lost["beats"]) == (None, False)
    assert rm.verdict([("gateway", 1.0)]) is None


def test_parts_fields_and_keys_are_checked_before_anything_is_sent(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, message in ((["--mix", "rag=1,chat=1"], "parts are"), (["--mix", "rag=1,rag=2"], "each once"),
                          (["--param", "agent.nope=1"], "bad --param"), (["--key", "chat=k"], "not a part"),
                          (["--rate", "0"], "rate"), (["--requests", "0"], "--requests")):  # fmt: skip
        with pytest.raises(SystemExit):
            rm.main(["--dry-run", *argv])
        assert message in capsys.readouterr().err
    assert rm.main(["--dry-run", "--seed", "s1", "--max-tokens", "random=64", "--param", "agent.fanout=4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[:4] == ["random", "16", "256", "64"] and lines[1].endswith("0.0%")


def test_kv_events_start_vllm_publishing_over_zmq_with_prefix_caching_on() -> None:
    args = vllm_cpu.server_args(Path("/v/python"), Path("/m"), "baton-tiny", 8101, kv_events="tcp://127.0.0.1:5557")
    assert "--enable-prefix-caching" in args
    config = json.loads(args[args.index("--kv-events-config") + 1])
    # vLLM binds only a wildcard endpoint (a concrete host it would connect to)
    assert config == {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557",
                      "topic": "kv-events"}  # fmt: skip
    assert "--kv-events-config" not in vllm_cpu.server_args(Path("/v/python"), Path("/m"), "baton-tiny", 8101)
    with pytest.raises(ValueError, match="prefix caching"):
        vllm_cpu.server_args(Path("/p"), Path("/m"), "m", 1, prefix_caching=False, kv_events="tcp://127.0.0.1:5557")
    for bad in ("127.0.0.1:5557", "tcp://127.0.0.1", "ipc:///tmp/x", "tcp://h:70000"):
        with pytest.raises(ValueError, match="tcp://HOST:PORT"):
            vllm_cpu.kv_events_config(bad)


SMALL = ["--param", "rag.system_len=64", "--param", "rag.question_len=16", "--param", "random.prompt_len=32",
         "--param", "agent.system_len=32", "--param", "agent.tools_len=32", "--param", "agent.task_len=16",
         "--param", "agent.own_len=8", "--param", "agent.fanout=3", "--max-tokens", "rag=6,random=6,agent=6",
         "--requests", "9", "--rate", "30", "--seed", "t", "--quiet-idle", "0", "--time-cap", "60"]  # fmt: skip


def test_each_request_carries_its_tenant_as_key_and_user(fake_server: FakeOpenAIServer, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    out = tmp_path / "mix.json"
    code = rm.main(["--target", f"gw={fake_server.url}", "--target", f"pool={fake_server.url}", *SMALL,
                    "--key", "rag=k-rag,agent=k-agent", "--out", str(out)])  # fmt: skip
    assert code == 0
    state = fake_server.state
    assert len(state.requests) == 18
    users = [body["user"] for body in state.requests]
    assert sorted(users[:9]) == sorted(users[9:]) == ["agent"] * 3 + ["rag"] * 3 + ["random"] * 3
    keys = {"rag": "Bearer k-rag", "agent": "Bearer k-agent", "random": None}
    assert all(auth == keys[user] for user, auth in zip(users, state.auth_headers, strict=True))
    # the same schedule, fresh tokens per target
    assert [len(p) for p in state.seen_prompts[:9]] == [len(p) for p in state.seen_prompts[9:]]
    assert not set(map(tuple, state.seen_prompts[:9])) & set(map(tuple, state.seen_prompts[9:]))
    doc = json.loads(out.read_text())
    assert doc["keys_for"] == ["agent", "rag"] and "k-rag" not in out.read_text()  # the keys stay out of files
    for target in doc["targets"]:
        assert set(target["runs"]) == {"all", "rag", "random", "agent"}
        assert target["runs"]["all"]["num_ok"] == 9 and target["runs"]["rag"]["num_ok"] == 3
    printed = capsys.readouterr().out.splitlines()
    assert printed[-1].startswith("goodput: gw ") and "best other (pool)" in printed[-1]
    assert len([line for line in printed if line.startswith(("gw ", "pool "))]) == 8  # all + 3 parts, each
    fake_server.reset()
    assert rm.main(["--target", f"gw={fake_server.url}", *SMALL, "--no-user", "--same-prompts"]) == 0
    assert all("user" not in body for body in fake_server.state.requests)


@pytest.fixture(scope="module")
def keyed_baton(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text("rag-key-0123456789 rag\nrandom-key-0123456789 random\n")  # no key for the agent part
    engine_cfg = EngineConfig(model=str(tiny_model_dir), dtype="float32", max_model_len=1024)
    cfg = ServerConfig(engine=engine_cfg, served_model_name="baton-tiny", api_keys_file=keys)
    handle = start_server(cfg, Engine(engine_cfg))
    yield handle
    handle.stop()


def test_a_small_mix_end_to_end_against_a_baton_that_requires_keys(keyed_baton: ServerHandle,
                                                                    tmp_path: Path) -> None:  # fmt: skip
    out = tmp_path / "mix.json"
    code = rm.main(["--target", f"baton={keyed_baton.url}", "--model", "baton-tiny", *SMALL,
                    "--key", "rag=rag-key-0123456789", "--key", "random=random-key-0123456789", "--out", str(out)])  # fmt: skip
    assert code == 0  # some requests finished
    runs = json.loads(out.read_text())["targets"][0]["runs"]
    for part in ("rag", "random"):  # keyed: the server took them and generated exactly 6 tokens each
        assert (runs[part]["num_ok"], runs[part]["output_tokens"], runs[part]["num_short"]) == (3, 18, 0)
        assert runs[part]["ttft_p90_ms"] > 0 and runs[part]["goodput_req_s"] > 0
    # without a key, a server that requires keys refuses: proof the others' keys were sent
    errors = runs["agent"]["errors"]
    assert runs["agent"]["num_ok"] == 0 and len(errors) == 1 and next(iter(errors)).startswith("HTTP 401")
    assert runs["rag"]["ideal_hit_rate"] == round(2 * 64 / (3 * 80), 4)  # the 64-token system prompt, twice
