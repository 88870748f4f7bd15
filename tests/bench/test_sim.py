"""`baton sim`: the simulator's mechanics on tiny fleets (exact times, pages and events), the
policies' choices over the real GlobalIndex and Placer, and the CLI's table.

Costs in these tests (CAL): 1 ms per prefill token, a decode step of 10 ms at batch 1 growing
to 50 ms at batch 33, 1,000-byte pages pushed at 1 MB/s (1 ms a page)."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

from bench.prompts import Segment
from bench.sim.cache import EventBus, TieredCache
from bench.sim.calibration import BUILTIN, Calibration, load_calibration
from bench.sim.policies import Baton, PrefixOnly, RoundRobin
from bench.sim.report import RequestRecord
from bench.sim.simulation import FleetConfig, Simulation
from bench.sim.traffic import Mix, PromptHasher, SessionRun, load_trace_traffic, parse_mix
from bench.sim.workers import DecodeWorker, SimRequest
from bench.workloads import Session, Turn
from cluster.cli import main as baton_main
from cluster.placement.global_index import GlobalIndex
from cluster.placement.policy import PlacementConfig, PlacementKind, Role, WorkerStats
from kvcache.events import EventKind, KVEvent, Tier

PS = 16
CAL = Calibration("test", "unit-test numbers", page_size=PS, page_bytes=1000, prefill_s_per_token=1e-3,
                  decode_step_s=((1, 0.01), (33, 0.05)), transfer_bytes_per_s={"grpc": 1e6}, host_bytes_per_s=1e6)
SLO = (10.0, 1.0)


def one_turn(key: str, *parts: Segment, output_len: int = 2) -> Session:
    return Session(key, (Turn(parts, output_len),))


@dataclass
class Script:
    """Traffic given request by request: (arrival, session, tenant)."""

    items: list[tuple[float, Session, str]]
    think_s: float = 0.0
    end: float = field(default=0.0)

    def arrivals(self) -> Iterator[tuple[float, SessionRun]]:
        for i, (t, session, tenant) in enumerate(self.items):
            yield t, SessionRun(session, tenant, f"script/{i}")

    @property
    def end_s(self) -> float:
        return max([self.end, *(t for t, _, _ in self.items)])


def run(script: Script, policy: str = "round-robin", cal: Calibration = CAL,
        **fleet: int | float) -> tuple[Simulation, list[RequestRecord]]:
    cfg = FleetConfig(**{"num_prefill": 1, "num_decode": 1, "prefill_pages": 1000, "host_pages": 0,
                         "decode_pages": 1000, **fleet})  # type: ignore[arg-type]
    sim = Simulation(cal, cfg, policy, script, SLO, seed=0, keep_records=True)
    result = sim.run()
    assert result.num_failed == 0
    records = sim.recorder.records
    assert records is not None
    return sim, sorted(records, key=lambda r: r.arrival_s)


# -- workers ----------------------------------------------------------------------------------


def test_a_prefill_queue_serves_in_arrival_order() -> None:
    # Given three 1,000-token prompts arriving 10 ms apart at one prefill worker
    script = Script([(0.01 * i, one_turn(f"s{i}", Segment(f"unique/{i}", 1000)), "a") for i in range(3)])
    # When they run
    _, records = run(script)
    # Then each waits for the one before it: first tokens at 1 s, 2 s, 3 s
    assert [r.first_token_s for r in records] == pytest.approx([1.0, 2.0, 3.0])
    # and each 63-page push (63 ms) streams while its prompt is computed: the last page lands
    # 1 ms after the first token, then one decode step of 10 ms
    assert [r.finish_s - r.first_token_s for r in records] == pytest.approx([0.011] * 3)
    assert [r.prefill_id for r in records] == ["p0"] * 3 and [r.hit_pages for r in records] == [0, 0, 0]


def test_a_slow_link_serializes_the_pushes_of_one_prefill_worker() -> None:
    # Given pushes at 20 kB/s (50 ms a page: 3.15 s for 63 pages, longer than the 1 s compute)
    slow = replace(CAL, transfer_bytes_per_s={"grpc": 2e4})
    script = Script([(0.01 * i, one_turn(f"s{i}", Segment(f"unique/{i}", 1000)), "a") for i in range(3)])
    _, records = run(script, cal=slow)
    # Then the first push streams from its compute's start; each next one waits for the link
    assert [r.first_token_s for r in records] == pytest.approx([1.0, 2.0, 3.0])
    assert [r.finish_s for r in records] == pytest.approx([3.15 + 0.01, 6.3 + 0.01, 9.45 + 0.01])


def test_a_cache_hit_skips_recomputing_the_shared_pages() -> None:
    # Given two prompts sharing a 1,000-token prefix (62 full pages), the second arriving later
    shared = Segment("doc", 1000)
    script = Script([(0.0, one_turn("a", shared, Segment("q/a", 50)), "t"),
                     (5.0, one_turn("b", shared, Segment("q/b", 50)), "t")])
    _, (first, second) = run(script)
    # Then the first computes all 1,050 tokens and the second only the 58 after the hit
    assert (first.hit_pages, first.first_token_s) == (0, pytest.approx(1.05))
    assert second.hit_pages == 62
    assert second.first_token_s - second.arrival_s == pytest.approx(0.058)


def test_a_different_tenant_gets_no_hit_on_the_same_tokens() -> None:
    shared = Segment("doc", 1000)
    script = Script([(0.0, one_turn("a", shared), "t1"), (5.0, one_turn("b", shared), "t2")])
    _, records = run(script)
    assert [r.hit_pages for r in records] == [0, 0]  # the salt keeps tenants apart


def test_lru_eviction_demotes_to_host_then_emits_removed_and_the_index_follows() -> None:
    index = GlobalIndex()
    bus = EventBus(index)
    events: list[KVEvent] = []

    def emit(event: KVEvent) -> None:
        events.append(event)
        bus.emit(event)

    cache = TieredCache("w", device_pages=4, host_pages=1, emit=emit)
    bus.add(cache)
    a = [b"a%015d" % i for i in range(3)]
    b = [b"b%015d" % i for i in range(3)]
    cache.store(a)
    cache.store(b)  # 6 pages for 4 device + 1 host: a's tail goes first, head last
    assert [(e.seq, e.kind, e.page_hashes, e.tier) for e in events] == [
        (1, EventKind.STORED, tuple(reversed(a)), Tier.DEVICE),
        (2, EventKind.STORED, tuple(reversed(b)), Tier.DEVICE),
        (3, EventKind.TIER_CHANGED, (a[2], a[1]), Tier.HOST),
        (4, EventKind.REMOVED, (a[2],), Tier.HOST),
    ]
    assert cache.match(a, 3) == (1, 1) and cache.match(b, 3) == (3, 0)  # a[0] on the device, a[1] on the host
    assert index.worker_pages("w") == dict(cache.snapshot()) == {
        a[0]: Tier.DEVICE, a[1]: Tier.HOST, **dict.fromkeys(b, Tier.DEVICE)
    }
    cache.store(a[:2])  # a host hit is promoted back to the device
    assert (events[4].kind, events[4].page_hashes, events[4].tier) == (EventKind.TIER_CHANGED, (a[1],), Tier.DEVICE)
    assert index.worker_pages("w") == dict(cache.snapshot())


class _Losing(random.Random):
    """A draw of 0.0 (lost) for the events whose numbers are listed, 0.99 (kept) otherwise."""

    def __init__(self, lose: set[int]) -> None:
        super().__init__(0)
        self.lose, self.n = lose, 0

    def random(self) -> float:
        self.n += 1
        return 0.0 if self.n in self.lose else 0.99


def test_lost_events_are_found_by_the_index_and_repaired_by_a_snapshot() -> None:
    index = GlobalIndex()
    bus = EventBus(index, delay_s=0.5, loss=0.5, rng=_Losing({2, 4}))
    cache = TieredCache("w", device_pages=100, host_pages=0, emit=bus.emit)
    bus.add(cache)
    pages = [b"p%015d" % i for i in range(4)]
    cache.store(pages[:1])  # seq 1: delivered after the delay
    assert index.worker_pages("w") == {}
    bus.flush(0.5)
    assert index.worker_pages("w") == {pages[0]: Tier.DEVICE}
    cache.store(pages[1:2])  # seq 2: lost
    cache.store(pages[2:3])  # seq 3: shows the gap -> a snapshot, which arrives 0.5 s later
    bus.flush(1.0)
    assert (bus.num_lost, bus.num_snapshots, index.sync_state("w")) == (1, 1, (1, 1, True))
    bus.flush(1.5)
    assert index.worker_pages("w") == dict(cache.snapshot()) and index.sync_state("w") == (1, 3, False)
    cache.store(pages[3:])  # seq 4: lost, and no later event: the heartbeat's seq shows it
    bus.heartbeat("w")
    bus.flush(2.0)
    bus.flush(2.5)
    assert (bus.num_lost, bus.num_snapshots) == (2, 2)
    assert index.worker_pages("w") == dict(cache.snapshot()) == dict.fromkeys(pages, Tier.DEVICE)


def _req(name: str, tokens: int, output_len: int = 8) -> SimRequest:
    return SimRequest(name, None, "t", [], tokens, output_len, 0.0, -(-(tokens + output_len) // PS))


def test_decode_steps_slow_down_with_the_batch_and_local_prefill_chunks_stall_them() -> None:
    decode = DecodeWorker("d0", CAL, TieredCache("d0", 0, 0, lambda e: None), num_pages=1000, max_running=64)
    decode.waiting.append(_req("one", 100))
    assert decode.begin_step(0.0) == (pytest.approx(0.01), [])
    decode.end_step(0.01)
    decode.waiting.extend(_req(f"r{i}", 100) for i in range(32))
    assert decode.begin_step(0.01) == (pytest.approx(0.01 + 0.05), [])  # batch 33
    decode.end_step(0.06)
    long, short = _req("long", 1200), _req("short", 100)
    decode.add_local(long)
    decode.add_local(short)
    # step 3 carries 512 tokens of the long prompt and all 100 of the short one: 612 ms of stall
    assert decode.begin_step(0.06) == (pytest.approx(0.06 + 0.05 + 0.612), [short])
    decode.end_step(0.722)
    assert decode.begin_step(0.722) == (pytest.approx(0.722 + 0.05 + 0.512), [])
    decode.end_step(1.284)
    assert decode.begin_step(1.284) == (pytest.approx(1.284 + 0.05 + 0.176), [long])
    assert not decode.local


def test_decode_reservations_wait_for_pages_in_order() -> None:
    decode = DecodeWorker("d0", CAL, TieredCache("d0", 0, 0, lambda e: None), num_pages=10, max_running=64)
    big, mid, small = _req("big", 100), _req("mid", 50), _req("small", 10)  # 7, 4, 2 pages
    assert decode.reserve(big)
    assert not decode.reserve(mid)  # 3 pages left
    assert not decode.reserve(small)  # it would fit, but does not overtake
    assert decode.num_free_pages == 10 - 7 - 4 - 2 and not mid.is_reserved
    assert decode.release(big, []) == [mid, small] and decode.in_use == 6 and small.is_reserved


# -- policies ---------------------------------------------------------------------------------


def _fleet_index(cached: dict[str, list[bytes]] | None = None) -> GlobalIndex:
    index = GlobalIndex()
    for w in ("p0", "p1", "p2", "d0", "d1"):
        index.load_snapshot(w, 1, 0, [(h, Tier.DEVICE) for h in (cached or {}).get(w, [])])
    return index


def test_round_robin_cycles_through_both_roles() -> None:
    policy = RoundRobin(_fleet_index(), ["p0", "p1", "p2"], ["d0", "d1"], random.Random(0), PlacementConfig())
    got = [policy.place(_req(f"r{i}", 100)) for i in range(4)]
    assert [(d.prefill_id, d.decode_id) for d in got] == [("p0", "d0"), ("p1", "d1"), ("p2", "d0"), ("p0", "d1")]


def test_prefix_only_picks_the_holder_when_overloaded_while_batons_placer_sheds() -> None:
    prompt = [b"h%015d" % i for i in range(100)]
    req = SimRequest("r", None, "t", prompt, 100 * PS + 5, 8, 0.0, 110)
    cfg = PlacementConfig(page_size=PS, page_bytes=1000, transfer_bytes_per_s=1e6)
    index = _fleet_index({"p0": prompt})
    prefix_only = PrefixOnly(index, ["p0", "p1", "p2"], ["d0", "d1"], random.Random(0), cfg)
    baton = Baton(index, ["p0", "p1", "p2"], ["d0", "d1"], random.Random(0), cfg)
    baton.update([WorkerStats("p0", Role.PREFILL, 1e-3, queue_delay_s=30.0)]  # p0 holds it, 30 s behind
                 + [WorkerStats(p, Role.PREFILL, 1e-3) for p in ("p1", "p2")]
                 + [WorkerStats(d, Role.DECODE, 1e-3, itl_s=0.01, num_running=32, num_free_pages=1000)
                    for d in ("d0", "d1")])  # fmt: skip
    for _ in range(3):
        held = prefix_only.place(req)
        assert (held.prefill_id, held.chosen_hit_pages, held.best_hit_pages) == ("p0", 100, 100)
    shed = baton.place(req)
    assert shed.kind == PlacementKind.DISAGGREGATED and shed.prefill_id in ("p1", "p2")
    assert (shed.chosen_hit_pages, shed.best_hit_pages) == (0, 100)  # locality given up, on purpose


def test_on_a_burst_prefix_only_piles_onto_the_one_holder_and_baton_spreads_it() -> None:
    # Given one worker alone has computed a 2,000-token system prompt (2 s cold at 1 ms a
    # token): p0 under prefix-only (round robin while nobody holds it), d0 (locally) under baton
    # When 80 requests on it arrive within 0.8 s (50 ms of work each on a holder: 4 s in all)
    system = Segment("system", 2000)
    script = Script([(0.0, one_turn("first", system, Segment("q/first", 50)), "t")]
                    + [(3.0 + 0.01 * i, one_turn(f"q{i}", system, Segment(f"q/{i}", 50)), "t") for i in range(80)])
    fleet = {"num_prefill": 4, "num_decode": 2, "decode_pages": 20_000}
    _, only = run(script, "prefix-only", **fleet)
    _, spread = run(script, "baton", **fleet)
    # Then prefix-only queues all of them on p0, the last one waiting 3.2 s for its turn
    assert {r.prefill_id for r in only} == {"p0"}
    assert max(r.first_token_s - r.arrival_s for r in only) == pytest.approx(3.0 + 80 * 0.05 - 3.79)
    # while baton's placer sends part of the burst to cold workers once the holder's queue
    # outweighs recomputing the prefix elsewhere (2 s)
    sites = [r.prefill_id or r.decode_id for r in spread[1:]]
    holder = max(set(sites), key=sites.count)
    assert len(set(sites)) >= 4 and sites.count(holder) < len(sites) - 4


# -- traffic, calibration, CLI ----------------------------------------------------------------


def test_a_session_turn_reuses_the_history_hashed_with_the_previous_output() -> None:
    hasher = PromptHasher(PS, b"fingerprint-0000")
    run_ = SessionRun(next(parse_mix("multiturn")[0][0].sessions("s")), "t", "k")
    with_output, n1 = hasher.hash(run_.salt, run_.parts(0, with_output=True))
    turn1, n2 = hasher.hash(run_.salt, run_.parts(1))
    assert n1 == 50 + 32 and n2 == 50 + 32 + 50
    assert turn1[: len(with_output)] == with_output and len(with_output) == 5


def test_calibration_file_overrides_and_rejects_unknown_keys(tmp_path: Path) -> None:
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({"prefill_s_per_token": 2e-5, "decode_step_s": [[1, 0.01], [64, 0.02]],
                                "transfer_bytes_per_s": {"nccl": 5e10}}))
    cal = load_calibration(str(path))
    assert (cal.name, cal.prefill_s_per_token, cal.page_bytes) == ("gpu.json", 2e-5, BUILTIN["baton-small"].page_bytes)
    assert cal.step_s(32) == pytest.approx(0.01 + 0.01 * 31 / 63) and cal.step_s(128) == pytest.approx(0.01 + 0.01 * 127 / 63)
    path.write_text(json.dumps({"prefill_tok_s": 1}))
    with pytest.raises(ValueError, match="unknown keys"):
        load_calibration(str(path))


def test_a_trace_replays_on_its_timestamps_with_tenants(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    rows = [{"timestamp": 1000 * i, "input_length": 700, "output_length": 4, "hash_ids": [1, 2], "tenant": "x"}
            for i in range(3)]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    trace = load_trace_traffic(path, "s", block_size=512)
    assert trace.end_s == 2.0
    _, records = run(trace)  # type: ignore[arg-type]
    assert [r.arrival_s for r in records] == [0.0, 1.0, 2.0]
    assert [r.hit_pages for r in records] == [0, 43, 43]  # 700 tokens: 43 full pages, all shared


def test_the_cli_prints_a_table_per_policy_with_the_calibration(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json = tmp_path / "sim.json"
    argv = ["sim", "--prefill", "4", "--decode", "4", "--tenants", "3", "--rate", "6", "--duration", "5",
            "--calibration", "baton-tiny", "--jobs", "1", "--event-delay", "0.05", "--event-loss", "0.02",
            "--json", str(out_json)]  # fmt: skip
    assert baton_main(argv) == 0
    out = capsys.readouterr().out
    assert "calibration: baton-tiny (built-in)" in out and "bench.transfer" in out
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("policy"))
    assert "goodput/s" in lines[head] and "TTFT p99" in lines[head] and "imb P" in lines[head]
    assert [line.split()[0] for line in lines[head + 2 : head + 6]] == ["round-robin", "least-loaded", "prefix-only", "baton"]
    assert any(line.startswith("goodput baton / prefix-only:") for line in lines)
    saved = json.loads(out_json.read_text())
    assert [r["policy"] for r in saved["results"]] == ["round-robin", "least-loaded", "prefix-only", "baton"]
    assert all(r["num_finished"] + r["num_failed"] == r["num_requests"] > 0 for r in saved["results"])
    assert saved["slo"] == {"ttft_s": 2.0, "itl_s": 0.2} and saved["fleet"]["event_loss"] == 0.02


def test_the_cli_refuses_bad_input_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert baton_main(["sim", "--policies", "random-walk"]) == 2
    assert "unknown policies" in capsys.readouterr().err


def test_an_index_fed_late_and_lossy_events_ends_equal_to_the_workers_caches() -> None:
    # Given a small fleet whose KV events arrive 50 ms late and 5% never arrive
    mix = Mix(parse_mix("multiturn+rag"), num_tenants=3, rate=8.0, duration_s=6.0, think_s=0.2, seed="lossy")
    cfg = FleetConfig(num_prefill=3, num_decode=2, prefill_pages=300, host_pages=100, decode_pages=2000,
                      event_delay_s=0.05, event_loss=0.05)  # fmt: skip
    sim = Simulation(BUILTIN["baton-tiny"], cfg, "baton", mix, SLO, seed=3)
    result = sim.run()
    # Then events were lost, the index asked for snapshots, and the run still placed everything
    assert result.num_lost_events > 0 and result.num_snapshots > 0 and result.num_failed == 0
    # and once the last heartbeats and snapshots are through, the index is the caches' truth
    for worker_id in sim.bus.caches:
        sim.bus.heartbeat(worker_id)
    sim.bus.flush(1e9)
    sim.bus.flush(2e9)
    for worker_id, cache in sim.bus.caches.items():
        assert sim.index.worker_pages(worker_id) == dict(cache.snapshot()), worker_id
