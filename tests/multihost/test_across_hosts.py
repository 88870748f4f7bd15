"""baton across hosts: the gateway on host 0, a prefill worker on host 1, decode workers on host 1
and host 2, each host a network namespace with its own address and Ray node (cluster.devhosts).

Pages of a request decoded on host 2 cross the veth link by gRPC to the decode worker's KV
server on host 2's address; those decoded on host 1 stay on that node, by shm. On a8aa895 the
decode KV server listened on loopback on every node, so every cross-host transfer failed and
the request fell back to local prefill: this test fails there.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from engine.config import ModelConfig
from engine.engine import Engine
from engine.engine_config import EngineConfig
from engine.sampling import SamplingParams
from tests.multihost.conftest import Spread
from tests.multihost.gateway import Gateway

MAX_TOKENS = 8
NUM_REQUESTS = 6


def prompts(vocab_size: int) -> list[list[int]]:
    rng = np.random.default_rng(20)
    return [rng.integers(100, vocab_size, size=int(n)).tolist() for n in rng.integers(40, 200, size=NUM_REQUESTS)]


def reference(model_dir: Path, batch: list[list[int]]) -> list[list[int]]:
    engine = Engine(EngineConfig(model=str(model_dir), max_model_len=512, enable_prefix_cache=False))
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return engine.generate(batch, greedy)


def test_pages_cross_hosts_by_grpc_and_stay_on_a_node_by_shm(
    spread: Spread, tiny_model_dir: Path
) -> None:
    hosts, gw = spread.hosts, spread.gw
    status = gw.status()
    where = {n["name"]: n["host"] for n in status["nodes"]}
    assert where["prefill-0"] == hosts.hosts[1].ip
    assert sorted(where[d] for d in ("decode-0", "decode-1")) == [hosts.hosts[1].ip, hosts.hosts[2].ip]
    routes = {(p["prefill"], p["decode"]): p for p in status["pairs"]}
    for name in ("decode-0", "decode-1"):
        pair = routes["prefill-0", name]
        assert pair["routable"] and pair["transport"] == ("shm" if where[name] == hosts.hosts[1].ip else "grpc")
        assert pair["decode_host"] == where[name]  # an address of that host, not loopback

    batch = prompts(ModelConfig.from_dir(tiny_model_dir).vocab_size)
    want = reference(tiny_model_dir, batch)
    got = [gw.complete(p, MAX_TOKENS) for p in batch]
    assert got == want

    # Every request disaggregated (local_prefill_tokens 0), in turn on each decode worker; each
    # one's pages moved, by gRPC to host 2 and by shm on host 1, and none fell back.
    assert gw.metric("baton_placements_total", route="disaggregated") == NUM_REQUESTS
    assert gw.metric("baton_kv_transfers_total", outcome="ok", transport="grpc") == NUM_REQUESTS // 2
    assert gw.metric("baton_kv_transfers_total", outcome="ok", transport="shm") == NUM_REQUESTS // 2
    assert gw.metric("baton_kv_transfers_total", outcome="failed") == 0
    assert gw.metric("baton_redispatches_total") == 0
    assert gw.metric("baton_kv_pair_unroutable") == 0
    assert gw.metric("baton_kv_transfer_bytes_total", transport="grpc") > 0
    remote = gw.metrics()
    infos = [dict(labels) for (name, labels), v in remote.items() if name == "baton_kv_pair_info" and v == 1]
    assert {(i["transport"], i["decode_host"]) for i in infos} == {("shm", hosts.hosts[1].ip),
                                                                   ("grpc", hosts.hosts[2].ip)}  # fmt: skip
    wait_idle(gw)


def wait_idle(gw: Gateway, timeout_s: float = 10.0) -> None:
    """Every reserved and pinned page back (the stats arrive with the next report)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        held = gw.metric("baton_kv_reserved_pages") + gw.metric("baton_kv_pinned_pages")
        if held == 0:
            return
        time.sleep(0.2)
    raise AssertionError(f"pages still held: reserved {gw.metric('baton_kv_reserved_pages')}, "
                         f"pinned {gw.metric('baton_kv_pinned_pages')}")  # fmt: skip
