"""Admission by service class: BATCH requests fill only `batch_share` of the queue's request
bounds, so LATENCY and STANDARD requests always find the rest; a refusal is RESOURCE_EXHAUSTED
with retry-after, whatever the class, counted by class on /metrics."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from cluster.edge.admission import Admission, AdmissionConfig, Ticket
from cluster.errors import EdgeError, Kind
from engine.request import SloClass
from tests.cluster.conftest import ServerHandle

LATENCY, STANDARD, BATCH = SloClass.LATENCY, SloClass.STANDARD, SloClass.BATCH


def _refused(adm: Admission, slo: SloClass) -> EdgeError:
    with pytest.raises(EdgeError) as caught:
        adm.enter(slo)
    assert caught.value.kind == Kind.RESOURCE_EXHAUSTED and caught.value.retry_after_s == 3.0
    return caught.value


def test_batch_requests_wait_only_in_their_share_of_the_queue() -> None:
    adm = Admission(AdmissionConfig(max_waiting_requests=4, max_inflight_requests=100, retry_after_s=3.0))
    batch = [adm.enter(BATCH), adm.enter(BATCH)]  # 2 < 0.5 x 4 each time
    assert "batch" in _refused(adm, BATCH).message  # 2 waiting: the batch share is full
    standard = adm.enter(STANDARD)
    latency = adm.enter(LATENCY)  # the other half is theirs
    _refused(adm, LATENCY)
    _refused(adm, STANDARD)
    assert adm.num_rejected == 3 and adm.num_waiting == 4
    batch[0].started()  # a first token: it no longer waits (it is still in flight)
    standard.release()
    _refused(adm, BATCH)  # still 2 waiting, one of them latency: 2 >= 2
    latency.started()
    assert isinstance(adm.enter(BATCH), Ticket)  # 1 waiting


def test_batch_requests_run_only_in_their_share_of_the_in_flight_bound() -> None:
    adm = Admission(AdmissionConfig(max_waiting_requests=100, max_inflight_requests=5, retry_after_s=3.0,
                                    batch_share=0.4))  # fmt: skip
    first = adm.enter(BATCH)
    first.started()
    adm.enter(BATCH).started()
    _refused(adm, BATCH)  # 2 in flight >= 0.4 x 5
    for _ in range(3):
        adm.enter(STANDARD).started()
    _refused(adm, LATENCY)  # 5 in flight: every class is refused at the whole bound
    first.release()
    first.release()  # idempotent
    assert adm.num_inflight == 4
    adm.enter(LATENCY)
    assert adm.num_inflight == 5


def test_the_batch_share_is_checked() -> None:
    for share in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match="batch_share"):
            AdmissionConfig(batch_share=share)
    full = Admission(AdmissionConfig(max_waiting_requests=1, batch_share=1.0))
    full.enter(BATCH)  # a share of 1: batch requests may fill the whole queue
    with pytest.raises(EdgeError):
        full.enter(STANDARD)


def test_a_batch_request_is_refused_over_http_while_a_standard_one_is_admitted(make_server: Any) -> None:
    # One request in flight (a ticket held on the server's loop, as a stream holds one) fills
    # the batch share of two: a batch request is refused (429), a standard one is not.
    srv: ServerHandle = make_server(admission=AdmissionConfig(max_inflight_requests=2, retry_after_s=2.0))

    async def admit() -> Ticket:
        return srv.running.frontend.admit()

    async def release(ticket: Ticket) -> None:
        ticket.release()

    held = asyncio.run_coroutine_threadsafe(admit(), srv.loop).result(10)
    body = {"model": "baton-tiny", "prompt": [9, 10, 11], "max_tokens": 2, "temperature": 0}
    with srv.client() as client:
        refused = client.post("/v1/completions", json={**body, "slo_class": "batch"})
        assert refused.status_code == 429 and refused.headers["retry-after"] == "2"
        assert refused.json()["error"]["code"] == "resource_exhausted"
        assert client.post("/v1/completions", json=body).status_code == 200
        metrics = client.get("/metrics").text
        assert 'baton_admission_rejected_total{slo_class="batch"} 1.0' in metrics
        assert 'slo_class="standard"' not in metrics
        asyncio.run_coroutine_threadsafe(release(held), srv.loop).result(10)
        assert client.post("/v1/completions", json={**body, "slo_class": "batch"}).status_code == 200
    assert srv.wait_idle(5.0)
    adm = srv.running.frontend.admission
    assert adm.num_inflight == 0 and adm.num_rejected == 1
