"""cluster.placement.pair_health: a pair whose transfers keep failing is named and avoided, probed now and
then, and routable again once a probe succeeds; a pair that cannot work is never tried."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from cluster.ops.status_view import render_status
from cluster.placement.pair_health import PairCollector, PairHealth, PairRoute


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def health(clock: Clock) -> PairHealth:
    pairs = PairHealth(max_failures=3, retry_s=30.0, clock=clock)
    pairs.routed([PairRoute("prefill-0", "decode-0", "grpc", "10.0.0.2", "10.0.0.3"),
                  PairRoute("prefill-0", "decode-1", "shm", "10.0.0.2", "10.0.0.2")])  # fmt: skip
    return pairs


def test_consecutive_failures_make_a_pair_unroutable_and_a_probe_restores_it(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    pairs = health(clock)
    pairs.failed("prefill-0", "decode-0", "transport error: UNAVAILABLE")
    pairs.succeeded("prefill-0", "decode-0")  # a success between resets the run
    for _ in range(2):
        pairs.failed("prefill-0", "decode-0", "transport error: UNAVAILABLE")
    assert pairs.can_route("prefill-0", "decode-0")
    with caplog.at_level(logging.ERROR, logger="cluster.placement.pair_health"):
        pairs.failed("prefill-0", "decode-0", "transport error: UNAVAILABLE")
    assert "prefill-0 (10.0.0.2) -> decode-0 (10.0.0.3) is unroutable" in caplog.text
    assert not pairs.can_route("prefill-0", "decode-0")
    assert pairs.can_route("prefill-0", "decode-1")  # the other pair is untouched
    clock.now += 30.0
    assert pairs.can_route("prefill-0", "decode-0")  # one probe
    assert not pairs.can_route("prefill-0", "decode-0")  # and only one per retry_s
    pairs.failed("prefill-0", "decode-0", "deadline")
    clock.now += 30.0
    assert pairs.can_route("prefill-0", "decode-0")
    pairs.succeeded("prefill-0", "decode-0")
    assert pairs.can_route("prefill-0", "decode-0") and pairs.can_route("prefill-0", "decode-0")
    (view,) = [v for v in pairs.views() if v.decode == "decode-0"]
    assert view.routable and view.failures == 0 and view.total_failures == 5 and view.transfers == 2


def test_a_pair_that_cannot_route_is_never_probed_until_routed_again() -> None:
    clock = Clock()
    pairs = PairHealth(clock=clock)
    pairs.routed([PairRoute("prefill-0", "decode-0", "", "10.0.0.2", "10.0.0.3", error="loopback")])
    clock.now += 3600
    assert not pairs.can_route("prefill-0", "decode-0")
    pairs.routed([PairRoute("prefill-0", "decode-0", "grpc", "10.0.0.2", "10.0.0.3")])  # the worker restarted
    assert pairs.can_route("prefill-0", "decode-0")
    assert pairs.can_route("prefill-1", "decode-0")  # not routed yet: nothing known against it


def test_metrics_and_status_name_the_unroutable_pair() -> None:
    pairs = health(Clock())
    for _ in range(3):
        pairs.failed("prefill-0", "decode-0", "transport error: UNAVAILABLE")
    registry = CollectorRegistry()
    registry.register(PairCollector(pairs))
    text = generate_latest(registry).decode()
    assert 'baton_kv_pair_unroutable{decode="decode-0",prefill="prefill-0"} 1.0' in text
    assert 'baton_kv_pair_unroutable{decode="decode-1",prefill="prefill-0"} 0.0' in text
    assert 'baton_kv_pair_failures_total{decode="decode-0",prefill="prefill-0"} 3.0' in text
    assert ('baton_kv_pair_info{decode="decode-0",decode_host="10.0.0.3",prefill="prefill-0",'
            'prefill_host="10.0.0.2",transport="grpc"} 1.0') in text  # fmt: skip
    from dataclasses import asdict

    shown = render_status({"nodes": [], "pairs": [asdict(v) for v in pairs.views()]})
    assert "prefill-0 (10.0.0.2) -> decode-0 (10.0.0.3)  UNROUTABLE  grpc  failed 3: transport error" in shown
    assert "prefill-0 (10.0.0.2) -> decode-1 (10.0.0.2)  shm  ok 0  failed 0" in shown
