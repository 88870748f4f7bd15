"""Fault 7 of issue 8: etcd (the membership backend) stopped, restarted, then stopped for 30 s,
under steady load on a real local Ray deployment whose workers hold etcd leases (2 s TTL).

The gateway keeps serving on the last membership it saw: 0 failed requests to the workers it
knows. Once etcd is back, every worker's registration is there again (a lease that ran out
meanwhile is re-registered under a new epoch) and the gateway's view converges on it.

The etcd is the session's (tests/conftest.py): it is restarted on the same port and data dir,
so the suites after this one find it as they expect.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from cluster.disagg_config import DisaggConfig, MembershipConfig
from engine.engine_config import EngineConfig
from tests.cluster.conftest import ServerHandle
from tests.cluster.test_ray_drain import Load
from tests.etcd_server import EtcdServer, is_listening
from tests.faults.conftest import disaggregated, front_of, wait_for

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.timeout(300)  # the waits below, each at its bound, and the fixture

OUTAGE_S = 10.0  # five of the workers' 2 s lease TTLs: each keepalive fails past its lease, many times


@pytest.fixture(scope="module")
def leased(ray_cluster: Any, tiny_engine_config: EngineConfig, etcd: EtcdServer) -> Iterator[ServerHandle]:
    membership = MembershipConfig(backend="etcd", cluster="faults-etcd", lease_ttl_s=2, etcd_port=etcd.port)
    yield from disaggregated(tiny_engine_config, DisaggConfig(num_prefill=1, num_decode=2, transport="grpc",
                                                              membership=membership))  # fmt: skip


def _stop(etcd: EtcdServer) -> None:
    etcd.stop()
    assert not is_listening(etcd.port) and etcd.proc is not None and etcd.proc.poll() is not None  # it is down


def test_an_etcd_outage_under_load_fails_no_request(leased: ServerHandle, etcd: EtcdServer) -> None:
    front = front_of(leased)
    names = {h.name for h in [*front.fleet.prefills, *front.fleet.decodes]}
    membership = front.fleet.membership
    assert membership is not None
    wait_for(lambda: set(membership.members()) >= names, "every worker registered", 20)
    load = Load(leased, streams=3)
    try:
        wait_for(lambda: load.ok >= 5, "load is flowing", 30)
        _stop(etcd)  # a short outage
        time.sleep(3.0)
        etcd.start()
        wait_for(lambda: load.ok >= 10, "serving after the restart", 30)
        served = load.ok
        _stop(etcd)  # a long one: every lease's TTL passes many times over
        time.sleep(OUTAGE_S)
        assert load.ok > served  # requests kept completing through the outage
        etcd.start()
        wait_for(lambda: set(membership.members()) >= names, "every worker registered again", 30)
        wait_for(lambda: all(h.is_routable for h in [*front.fleet.prefills, *front.fleet.decodes]),
                 "the gateway routes to every worker again", 30)  # fmt: skip
        after = load.ok

        def stalled() -> str:  # what the gateway saw, should serving not resume
            pairs = [(v.prefill, v.decode, v.routable, v.failures, v.reason) for v in front.pairs.views()]
            return f"serving after the outage: {load.ok - after} done, failed {load.failed[:3]}, pairs {pairs}"

        wait_for(lambda: load.ok >= after + 5, stalled, 60)
    finally:
        if etcd.proc is None or etcd.proc.poll() is not None:
            etcd.start()  # the session's etcd stays up for the suites after this one
        load.finish()
    assert load.failed == [], load.failed[:3]  # 0 failed requests to known workers
    members = membership.members()
    for h in [*front.fleet.prefills, *front.fleet.decodes]:  # converged: the gateway's epochs are etcd's
        assert members[h.name].epoch == h.epoch
