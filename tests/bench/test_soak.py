"""The soak's CI-sized run (bench.soak; the 30-minute run is on demand): ~36 s of mixed traffic
against baton disaggregated on a private Ray (1 prefill, 2 decode) with etcd membership, etcd
restarted once and a decode worker SIGKILLed meanwhile. It asserts the invariants (every request
counted once under the outcome the client saw, every page back at idle, every fault happened
and was recovered from), never timings. Its own etcd: the session's cannot be restarted."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest

from bench.soak import Idle, SoakConfig, count_problems, idle_problems, main, report, slope_per_min
from tests.etcd_server import INSTALL_HINT

pytestmark = pytest.mark.timeout(180)


def test_short_soak_counts_every_request_and_returns_every_page(tmp_path: Path, tiny_model_dir: Path) -> None:
    if shutil.which("etcd") is None:
        pytest.fail(INSTALL_HINT, pytrace=False)
    out = tmp_path / "soak"
    code = main(["--minutes", "0.4", "--kill-every", "18", "--sample-every", "2", "--concurrency", "6",
                 "--recover-timeout", "60", "--idle-timeout", "30", "--retain", "5", "--out-dir", str(out)])  # fmt: skip
    report = json.loads((out / "soak.json").read_text())

    # the faults happened, in this order, and the cluster came back from each
    assert [(f["kind"], f["took_effect"]) for f in report["faults"]] == [("etcd-restart", True), ("kill-decode", True)]
    assert all(f["recovered_s"] is not None for f in report["faults"]), report["faults"]
    assert report["recovery"]["baton_worker_restarts_total"] >= 1  # the gateway saw the worker die and rejoin
    # the traffic had every kind of ending the soak means to count
    client = report["client"]
    assert client["ok"] > 50 and client["cancelled-stream"] > 0 and client["cancelled-unary"] > 0, client
    assert client["invalid"] >= 1, client
    # every invariant held: counts match the client's, pages are at baseline at idle
    assert report["problems"] == [] and code == 0, report["problems"]
    assert report["shm_left"] == []  # the killed decode worker's staging region went with its restart
    assert sum(report["server"].values()) == client["sent"] - client["unsent"]  # unsent: never written
    # a hang-up that raced its request's last token is ok on the server (it finished first)
    server = report["server"]
    assert server["ok"] + server["cancelled"] == client["ok"] + client["cancelled"] + client["timeout"]
    assert client["ok"] <= server["ok"] <= client["ok"] + client["cancelled"] + client["timeout"]
    for node in report["idle"]:
        assert node["health"] == "ok" and node["reserved"] == node["pinned"] == node["running"] == 0, node
        assert node["retained"] == 0, node  # the prefill worker's copies went when their lease ended
        assert all(used == 0 for used, _, _ in node["pages_used_cached_total"].values()), node


def test_the_checks_fail_on_a_miscount_and_on_pages_left_behind() -> None:
    client = Counter({"sent": 10, "ok": 7, "cancelled": 2, "invalid": 1})
    assert count_problems(client, {"ok": 7, "cancelled": 2, "rejected": 1}) == []
    # a cancel that raced its last token counts ok on the server: not a miscount
    assert count_problems(client, {"ok": 8, "cancelled": 1, "rejected": 1}) == []
    assert count_problems(client, {"ok": 6, "cancelled": 3, "rejected": 1}) == ["server ok 6 < client ok 7"]
    assert count_problems(client, {"ok": 7, "cancelled": 1, "error": 1, "rejected": 1}) == [
        "server ok + cancelled vs client ok + cancelled + timeout: 8 != 9",
        "server rejected + error + deadline vs client invalid + not-400 + refused + error: 2 != 1"]  # fmt: skip
    assert "requests_total vs requests sent: 9 != 10" in count_problems(client, {"ok": 7, "cancelled": 2})
    assert "1 invalid requests were not answered 400" in count_problems(Counter({"sent": 1, "not-400": 1}), {"ok": 1})
    # a unary call abandoned before its request was written never reached the server: not sent
    unsent = Counter({"sent": 11, "ok": 7, "cancelled": 2, "invalid": 1, "unsent": 1})
    assert count_problems(unsent, {"ok": 7, "cancelled": 2, "rejected": 1}) == []
    # the report carries them (they once went into shm_left by position, so no miscount failed a soak)
    r = report(SoakConfig(minutes=0.1), client, {"ok": 6, "cancelled": 3, "rejected": 1}, [], [(0.0, 1.0, 1)] * 2,
               Idle([], [], {}), [], {})  # fmt: skip
    assert r.problems == ["server ok 6 < client ok 7"] and r.shm_left == []

    tier = {"pages_used": 3, "pages_cached": 5, "pages_total": 64, "hit_tokens": 0}
    node = {"name": "decode-0", "health": "ok", "running": 0, "waiting": 0, "reserved_pages": 2, "pinned_pages": 0,
            "cache": {"tiers": {"device": tier}}}  # fmt: skip
    status = {"gateway": {"waiting": 0, "inflight": 1}, "nodes": [node]}
    assert idle_problems(status, {"baton_kv_reserved_pages": 2.0}, {}) == [
        "gateway: inflight 1", "/metrics baton_kv_reserved_pages = 2",
        "decode-0: reserved_pages 2", "decode-0 device: 3 pages used at idle, 0 at baseline"]  # fmt: skip
    held = {**node, "name": "prefill-0", "reserved_pages": 0, "retained_pages": 3}  # copies past their lease
    assert idle_problems({"gateway": {"waiting": 0, "inflight": 0}, "nodes": [held]}, {}, {("prefill-0", "device"): 3}) == [
        "prefill-0: retained_pages 3"]  # fmt: skip
    assert slope_per_min([(0.0, 1.0), (30.0, 2.0), (60.0, 3.0)]) == pytest.approx(2.0)  # per minute
