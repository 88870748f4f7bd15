"""Network faults across hosts, on the `spread` cluster (tests/multihost/conftest.py): the
gateway on host 0, the prefill worker and decode worker N (near) on host 1, decode worker F
(far) on host 2. The tests run in this order and each leaves the cluster serving:

    the path prefill -> F cut (a blackhole route on host 1: the gateway still reaches both)
        transfers to F fail within the transfer deadline, those requests prefill on F itself
        with the same tokens, the pair turns unroutable, and nothing stays reserved or pinned;
        the path back, a probe makes the pair routable and pages cross again
    the gateway cut from etcd (a blackhole route on host 0) for twice the lease
        it serves on the members it knew, none expires; back, it catches up with what changed
    host 2 lost (its link down, every process on it SIGKILLed) mid-stream
        the stream on F moves to N and completes token for token, the gateway keeps serving,
        membership drops F when its lease runs out
    host 2 back (link up, a new Ray node)
        Ray restarts F there, it rejoins under a new epoch and gets work again by gRPC

Each test proves its fault happened before it asserts the outcome. Bounds (documented in
README "Across hosts"): a cut path costs a request at most the transfer deadline (5 s here)
before it is re-dispatched; a lost decode host's requests move once the watchdog (5 s) passes;
a returning host's worker serves within RETURN_S of its Ray node joining.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from cluster.devhosts import DevHosts
from engine.config import ModelConfig
from engine.engine import Engine
from engine.engine_config import EngineConfig
from engine.sampling import SamplingParams
from tests.multihost.conftest import LONG_MODEL_LEN, Spread
from tests.multihost.gateway import Gateway

DEADLINE_S = 5.0  # transfer.deadline_s in gateway.cluster_yaml
SLACK_S = 10.0  # a loaded 2-core machine: scheduling, not the bound, is what this absorbs
RETURN_S = 120.0
WATCHDOG_S = 5.0  # recovery.watchdog_s in gateway.cluster_yaml
LONG_TOKENS = 400  # a stream still running when its host goes (killed right after its first token)
CONTEXT = 4000  # F's stream's prompt: the context a migration fetches rather than recomputes
DRAIN_TOKENS = 600  # a stream still running long after the SIGTERM that drains its worker
LEASE_S = 3.0  # membership.lease_ttl_s in tests/multihost/conftest.py's spread
WATCH_RESUME_S = 30.0  # keepalive (10 s + 5 s) finds a dead watch; then it resumes from the last revision
PROBE = {"worker_id": "probe-0", "role": "decode", "address": "baton-nobody", "node_id": "nowhere",
         "kv_address": "", "num_pages": 0, "page_size": 0, "max_num_seqs": 0}


def prompts(model_dir: Path, n: int, seed: int, lengths: tuple[int, int] = (40, 100)) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    vocab = ModelConfig.from_dir(model_dir).vocab_size
    return [rng.integers(100, vocab, size=int(k)).tolist() for k in rng.integers(*lengths, size=n)]


def reference(model_dir: Path, batch: list[list[int]], max_tokens: int) -> list[list[int]]:
    engine = Engine(EngineConfig(model=str(model_dir), max_model_len=LONG_MODEL_LEN, enable_prefix_cache=False))
    return engine.generate(batch, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


def migrated(gw: Gateway) -> tuple[float, float]:
    """Context tokens of migrated requests so far: (fetched from a copy, recomputed)."""
    return (gw.metric("baton_migration_context_tokens_total", outcome="fetched"),
            gw.metric("baton_migration_context_tokens_total", outcome="recomputed"))  # fmt: skip


def placed(gw: Gateway, hosts: DevHosts) -> tuple[str, str]:
    """(near, far): the decode workers on host 1 and host 2."""
    where = {n["name"]: n["host"] for n in gw.status()["nodes"] if n["role"] == "decode"}
    near = next(n for n, h in where.items() if h == hosts.hosts[1].ip)
    far = next(n for n, h in where.items() if h == hosts.hosts[2].ip)
    return near, far


def pair(gw: Gateway, decode: str) -> dict[str, object]:
    return next(p for p in gw.status()["pairs"] if p["prefill"] == "prefill-0" and p["decode"] == decode)


def wait_for(what: str, check: object, timeout_s: float) -> float:
    """Seconds until check() is true; fails naming `what` after timeout_s."""
    assert callable(check)
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(0.25)
    return time.monotonic() - start


def went_far(gw: Gateway, prompt: list[int]) -> bool:
    """Complete a short request; True when it was decoded on host 2 (its pages came by gRPC,
    where host 1's decode worker takes them by shm)."""
    before = gw.metric("baton_kv_transfers_total", outcome="ok", transport="grpc")
    gw.complete(prompt, 2)
    return gw.metric("baton_kv_transfers_total", outcome="ok", transport="grpc") > before


def held_pages(gw: Gateway, decode: str | None = None) -> float:
    """Reserved (on every decode worker, or on `decode`) and pinned pages."""
    on = {"node": decode} if decode else {}
    return gw.metric("baton_kv_reserved_pages", **on) + gw.metric("baton_kv_pinned_pages")


def connect_errno(hosts: DevHosts, host: int, ip: str, port: int = 9) -> int:
    """The errno of a TCP connect from `host` to ip:port, 0 when it connects (nothing listens on
    port 9: a reachable host answers ECONNREFUSED)."""
    code = (f"import socket\ntry:\n    socket.create_connection(({ip!r}, {port}), 2)\n    print(0)\n"
            "except OSError as e:\n    print(e.errno or -1)")  # fmt: skip
    return int(hosts.run(host, [sys.executable, "-c", code], timeout_s=10, capture_output=True,
                         text=True).stdout.strip())  # fmt: skip


@pytest.mark.timeout(180)
def test_the_prefill_to_decode_path_cut_and_back(spread: Spread, tiny_model_dir: Path) -> None:
    hosts, gw = spread.hosts, spread.gw
    near, far = placed(gw, hosts)
    far_ip = hosts.hosts[2].ip
    assert connect_errno(hosts, 1, far_ip) == errno.ECONNREFUSED  # reachable before
    cut = hosts.run(1, ["ip", "route", "add", "blackhole", f"{far_ip}/32"], timeout_s=10)
    assert cut.returncode == 0, cut.stderr
    try:
        assert connect_errno(hosts, 1, far_ip) != errno.ECONNREFUSED  # the fault: host 1 cannot reach host 2
        assert gw.status()["ready"]  # while the gateway reaches both
        failed0 = gw.metric("baton_kv_transfers_total", outcome="failed")
        local0 = gw.metric("baton_placements_total", route="local")
        redispatched0 = gw.metric("baton_redispatches_total", to="local")
        batch = prompts(tiny_model_dir, 6, seed=31)
        want = reference(tiny_model_dir, batch, 8)
        got, seconds = [], []
        for p in batch:  # round robin: every other one is decoded on F
            start = time.monotonic()
            got.append(gw.complete(p, 8))
            seconds.append(time.monotonic() - start)
        assert got == want
        failed = gw.metric("baton_kv_transfers_total", outcome="failed") - failed0
        assert failed == 2  # transfer.pair_failures: then F's pair is unroutable and not tried again
        assert gw.metric("baton_redispatches_total", to="local") - redispatched0 == 2
        # F's first two prefilled on F after their transfer failed; its third went there at once
        assert gw.metric("baton_placements_total", route="local") - local0 == 3
        assert max(seconds) < DEADLINE_S + SLACK_S
        assert gw.metric("baton_kv_pair_unroutable", prefill="prefill-0", decode=far) == 1
        assert gw.metric("baton_kv_pair_unroutable", prefill="prefill-0", decode=near) == 0
        shown = pair(gw, far)
        assert not shown["routable"] and shown["reason"]
        wait_for("reserved and pinned pages back", lambda: held_pages(gw) == 0, 15)
    finally:
        hosts.run(1, ["ip", "route", "del", "blackhole", f"{far_ip}/32"], timeout_s=10)
    assert connect_errno(hosts, 1, far_ip) == errno.ECONNREFUSED
    ok0 = gw.metric("baton_kv_transfers_total", outcome="ok", transport="grpc")
    more = prompts(tiny_model_dir, 24, seed=32)
    want = reference(tiny_model_dir, more, 4)

    def probe_passed() -> bool:  # one request at a time: a probe every pair_retry_s (2 s)
        p = more.pop()
        assert gw.complete(p, 4) == want[len(more)]
        return bool(pair(gw, far)["routable"])

    wait_for("the pair routable again", probe_passed, 30)
    assert gw.metric("baton_kv_transfers_total", outcome="ok", transport="grpc") > ok0
    wait_for("reserved and pinned pages back", lambda: held_pages(gw) == 0, 15)


@pytest.mark.timeout(120)
def test_the_gateway_cut_from_etcd_past_the_lease_serves_on_and_catches_up(spread: Spread, tiny_model_dir: Path) -> None:
    hosts, gw, etcd = spread.hosts, spread.gw, spread.etcd
    joins0 = gw.metric("baton_membership_changes_total", kind="join")
    leaves0 = gw.metric("baton_membership_changes_total", kind="leave")
    route = ["ip", "route", "add", "blackhole", f"{spread.etcd_ip}/32"]
    assert hosts.run(0, route, timeout_s=10).returncode == 0
    probe = "/baton/workers/probe-0"  # a member nobody runs: the gateway must see it come and go
    try:
        # the fault: the gateway's host cannot reach etcd; the workers' hosts still can
        assert connect_errno(hosts, 0, spread.etcd_ip, etcd.port) not in (0, errno.ECONNREFUSED)
        assert connect_errno(hosts, 1, spread.etcd_ip, etcd.port) == 0
        batch = prompts(tiny_model_dir, 4, seed=51)
        want = reference(tiny_model_dir, batch, 6)
        end = time.monotonic() + 2 * LEASE_S  # past the lease: nothing the gateway sees may expire it
        got = [gw.complete(p, 6) for p in batch]
        assert etcd.put(probe, json.dumps(PROBE).encode())  # while the gateway cannot see it
        while time.monotonic() < end:
            time.sleep(0.25)
        assert got == want
        health = {n["name"]: n["health"] for n in gw.status()["nodes"]}
        assert set(health.values()) == {"ok"}, health  # served on the last-known members
        assert gw.metric("baton_membership_changes_total", kind="leave") == leaves0
    finally:
        hosts.run(0, ["ip", "route", "del", "blackhole", f"{spread.etcd_ip}/32"], timeout_s=10)
    assert connect_errno(hosts, 0, spread.etcd_ip, etcd.port) == 0
    # caught up: what changed while it was cut off arrives (the watch resumes where it was)
    wait_for("the probe member's join", lambda: gw.metric("baton_membership_changes_total", kind="join") > joins0,
             WATCH_RESUME_S)  # fmt: skip
    assert etcd.delete(probe)
    wait_for("the probe member's leave", lambda: gw.metric("baton_membership_changes_total", kind="leave") > leaves0,
             WATCH_RESUME_S)  # fmt: skip
    again = prompts(tiny_model_dir, 2, seed=52)
    assert [gw.complete(p, 6) for p in again] == reference(tiny_model_dir, again, 6)


@pytest.mark.timeout(180)
def test_a_decode_host_lost_mid_stream_then_back(spread: Spread, tiny_model_dir: Path) -> None:
    hosts, gw = spread.hosts, spread.gw
    near, far = placed(gw, hosts)
    far_epoch = next(n["epoch"] for n in gw.status()["nodes"] if n["name"] == far)
    # N's stream short, F's with a 4,000-token context: it resumes from the prefill worker's copy
    batch = prompts(tiny_model_dir, 1, seed=41, lengths=(40, 60)) + prompts(tiny_model_dir, 1, seed=46,
                                                                            lengths=(CONTEXT, CONTEXT + 1))  # fmt: skip
    want = reference(tiny_model_dir, batch, LONG_TOKENS)
    fetched0, recomputed0 = migrated(gw)
    moved0 = gw.metric("baton_request_migrations_total")
    leaves0 = gw.metric("baton_membership_changes_total", kind="leave")
    probes = iter(prompts(tiny_model_dir, 2, seed=44))
    while not went_far(gw, next(probes)):  # round robin: after one on F, the next goes to N
        pass
    streams = [gw.stream(p, LONG_TOKENS) for p in batch]  # the first on N, the second on F
    restarts0 = gw.metric("baton_worker_restarts_total", role="decode")
    got = [next(s) for s in streams]  # both running: F's killed right after its first token
    hosts.kill_host(2)
    killed = time.monotonic()
    assert hosts.pids(2) == []  # the fault: nothing runs on host 2, and its link is down
    assert connect_errno(hosts, 1, hosts.hosts[2].ip) != errno.ECONNREFUSED

    for ids in streams[0]:  # N's, untouched
        got[0] += ids
    resumed_s = None
    for ids in streams[1]:  # F's: silent until the watchdog moves it to N
        resumed_s = resumed_s or time.monotonic() - killed
        got[1] += ids
    assert got == want  # the stream on F moved to N and went on, token for token
    assert resumed_s is not None and resumed_s < WATCHDOG_S + 1.0 + SLACK_S  # + the long-poll
    assert gw.metric("baton_request_migrations_total") - moved0 == 1, "F's stream ended before its host did"
    fetched, recomputed = (now - then for now, then in zip(migrated(gw), (fetched0, recomputed0), strict=True))
    assert fetched == CONTEXT // 16 * 16 and fetched / (fetched + recomputed) >= 0.9  # only the tail recomputed
    health = {n["name"]: n["health"] for n in gw.status()["nodes"]}
    assert health[far] in ("down", "stalled") and health[near] == "ok"
    fresh = prompts(tiny_model_dir, 2, seed=42)
    assert [gw.complete(p, 6) for p in fresh] == reference(tiny_model_dir, fresh, 6)  # served by N
    wait_for("F's lease ran out", lambda: gw.metric("baton_membership_changes_total", kind="leave") > leaves0, 30)
    # F's last report may show a reservation it held when it died (its 4,000-token push in
    # flight): F is stalled, not known dead, so the survivors' pages are what is checked
    wait_for("pages back on the survivors", lambda: held_pages(gw, near) == 0
             and gw.metric("baton_node_kv_pages", node=near, tier="device", state="used") == 0, 15)  # fmt: skip

    hosts.link_up(2)
    hosts.start_ray(2)  # a new node; Ray restarts F on it (recovery.max_restarts), the gateway revives it
    wait_for("F back", lambda: {n["name"]: n["health"] for n in gw.status()["nodes"]}[far] == "ok", RETURN_S)
    assert gw.metric("baton_worker_restarts_total", role="decode") == restarts0 + 1
    assert next(n["epoch"] for n in gw.status()["nodes"] if n["name"] == far) > far_epoch
    assert pair(gw, far)["routable"] and pair(gw, far)["transport"] == "grpc"
    ok0 = gw.metric("baton_kv_transfers_total", outcome="ok", transport="grpc")
    again = prompts(tiny_model_dir, 4, seed=43)
    assert [gw.complete(p, 6) for p in again] == reference(tiny_model_dir, again, 6)
    assert gw.metric("baton_kv_transfers_total", outcome="ok", transport="grpc") - ok0 == 2  # F gets work again


@pytest.mark.timeout(180)
def test_a_decode_worker_drained_by_sigterm_hands_its_stream_over(spread: Spread, tiny_model_dir: Path) -> None:
    """Last: F drains for good. SIGTERM to F's process (a pod's termination) drains it with
    hand-off: its stream, a 4,000-token context, moves to N at once, and F pushes it its pages
    (prompt and generated tokens, across the hosts) instead of finishing it or having it
    recomputed: only the partial last page is computed again."""
    hosts, gw = spread.hosts, spread.gw
    near, far = placed(gw, hosts)
    batch = prompts(tiny_model_dir, 1, seed=47, lengths=(CONTEXT, CONTEXT + 1))
    want = reference(tiny_model_dir, batch, DRAIN_TOKENS)
    moved0, (fetched0, recomputed0) = gw.metric("baton_request_migrations_total"), migrated(gw)
    handed0 = gw.metric("baton_migration_context_tokens_total", outcome="fetched", source="drained")
    probes = iter(prompts(tiny_model_dir, 4, seed=48))
    while went_far(gw, next(probes)):  # round robin: after one on N, the next request goes to F
        pass
    stream = gw.stream(batch[0], DRAIN_TOKENS)
    got = next(stream)
    pid = next(n["pid"] for n in gw.status()["nodes"] if n["name"] == far)
    assert pid in hosts.pids(2)
    os.kill(pid, signal.SIGTERM)  # the fault: a planned drain, as a pod's termination starts one
    for ids in stream:
        got += ids
    assert got == want[0]
    assert gw.metric("baton_request_migrations_total") - moved0 == 1, "the stream finished on F instead of moving"
    fetched, recomputed = (now - then for now, then in zip(migrated(gw), (fetched0, recomputed0), strict=True))
    assert fetched >= CONTEXT // 16 * 16 and recomputed <= 16  # the partial last page, nothing else
    assert gw.metric("baton_migration_context_tokens_total", outcome="fetched", source="drained") - handed0 == fetched
    wait_for("F gone", lambda: pid not in hosts.pids(2), 60)
    health = {n["name"]: n["health"] for n in gw.status()["nodes"]}
    assert health[near] == "ok" and health.get(far, "left") in ("left", "down")
