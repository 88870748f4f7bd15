"""/dashboard's pools table in a real headless Chromium against a real gateway over loopback
(tests/cluster/test_dashboard.py's browser): one row per endpoint, agreeing with /status."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest
from selenium.webdriver.chrome.webdriver import WebDriver
from selenium.webdriver.support.wait import WebDriverWait

from tests.cluster.conftest import ServerHandle
from tests.cluster.test_dashboard import CHROMEDRIVER, CHROMIUM, browser, page_errors  # noqa: F401 (a fixture)
from tests.gateway.conftest import EXT, pool

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(CHROMIUM is None or CHROMEDRIVER is None,
                       reason="needs chromium and chromedriver on PATH (.ci/run installs them)"),  # fmt: skip
]

ROWS_JS = """
const out = {hidden: document.getElementById('pools').hidden, rows: []};
for (const tr of document.querySelectorAll('#pools tbody tr')) {
  const row = {pool: tr.dataset.pool, endpoint: tr.dataset.endpoint, up: tr.dataset.up};
  for (const td of tr.querySelectorAll('[data-field]')) row[td.dataset.field] = td.dataset.value ?? td.textContent;
  out.rows.push(row);
}
out.overlap = document.querySelector('#pools [data-field="overlap"]').textContent;
return out;
"""


def test_the_dashboard_shows_each_pools_endpoints(
    upstreams: list[ServerHandle], make_gateway: Callable[..., ServerHandle], browser: WebDriver,  # noqa: F811
) -> None:
    gw = make_gateway([pool("ext", [u.url for u in upstreams])])
    for i in range(6):
        body = {"model": EXT, "prompt": "shared words for every request " * 4 + str(i), "max_tokens": 2, "user": "u"}
        assert httpx.post(gw.url + "/v1/completions", json=body, timeout=60).status_code == 200
    whole = httpx.get(gw.url + "/status").json()["pools"]
    status = whole["pools"]
    (key, measured), = whole["overlap"].items()
    browser.get(gw.url + "/dashboard?poll=0.5")
    shown = WebDriverWait(browser, 20).until(
        lambda d: (lambda s: s if not s["hidden"] and len(s["rows"]) == 3 else False)(d.execute_script(ROWS_JS)))
    rows = {(r["pool"], r["endpoint"]): r for r in shown["rows"]}
    assert set(rows) == {("baton", "local"), *(("ext", u.url) for u in upstreams)}
    for e in status["ext"]["endpoints"]:
        row = rows[("ext", e["url"])]
        assert row["up"] == "1" and int(row["ok"]) == e["ok"] and int(row["failed"]) == 0
        assert int(row["estimated-hit"]) == e["estimated_hit_tokens"] and row["index"] == "approximate"
    assert sum(int(rows[("ext", u.url)]["ok"]) for u in upstreams) == 6
    assert shown["overlap"] == f"prefix overlap by route key: {key} {measured['overlap'] * 100:.0f}%"
    assert page_errors(browser) == []
