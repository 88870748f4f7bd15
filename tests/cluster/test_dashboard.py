"""GET /dashboard in a real headless Chromium (Selenium + Debian's chromium and chromedriver)
against a real gateway over loopback: the page finds every node /status reports, its numbers
move with real traffic and agree with /status, a node that leaves /status stays shown as gone,
and a guarded gateway gets its API key from a form.

The page polls every 0.5 s here (`?poll=0.5`; 2 s by default) to keep the file short. The
screenshot of the two-node page after traffic lands in tests/artifacts/dashboard.png.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from selenium import webdriver
from selenium.common.exceptions import TimeoutException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.chrome.webdriver import WebDriver
from selenium.webdriver.common.by import By
from selenium.webdriver.support.wait import WebDriverWait

from cluster.ops.node_status import NodeStatus
from tests.cluster.conftest import ServerHandle

ROOT = Path(__file__).resolve().parents[2]
SCREENSHOT = ROOT / "tests" / "artifacts" / "dashboard.png"
CHROMIUM = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
CHROMEDRIVER = shutil.which("chromedriver")
MODEL = "baton-tiny"
PREFIX = "The quick brown fox jumps over the lazy dog. " * 6  # a few whole pages every prompt shares
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar".split()

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(CHROMIUM is None or CHROMEDRIVER is None,
                       reason="needs chromium and chromedriver on PATH (Debian: apt-get install chromium "
                              "chromium-driver; .ci/run installs them)"),  # fmt: skip
]

# Everything the page shows, read in one call: header fields, and per node its health, fields
# (text and raw data-value), tier rows and chart paths, in the order the cards appear.
SNAPSHOT_JS = """
const read = el => ({text: el.textContent.trim(), value: el.dataset.value ?? null});
const out = {updates: Number(document.body.dataset.updates), state: document.body.dataset.state,
             header: {}, order: [], nodes: {}, authShown: !document.getElementById('auth').hidden,
             authMessage: document.getElementById('auth-message').textContent};
for (const el of document.querySelectorAll('body > header [data-field]')) {
  out.header[el.dataset.field] = read(el);
}
for (const sec of document.querySelectorAll('section[data-node]')) {
  const n = {role: sec.dataset.role, health: sec.dataset.health, fields: {}, tiers: {}, charts: {}};
  for (const el of sec.querySelectorAll('[data-field]')) {
    if (!el.closest('tr[data-tier]') && !el.closest('figure')) n.fields[el.dataset.field] = read(el);
  }
  for (const tr of sec.querySelectorAll('tr[data-tier]:not([hidden])')) {
    n.tiers[tr.dataset.tier] = {pages: read(tr.querySelector('[data-field="pages"]')),
                                rate: read(tr.querySelector('[data-field="tier-hit-rate"]'))};
  }
  for (const svg of sec.querySelectorAll('svg[data-chart]')) {
    n.charts[svg.dataset.chart] = [...svg.querySelectorAll('path')].map(p => p.getAttribute('d')).join('');
  }
  out.order.push(sec.dataset.node);
  out.nodes[sec.dataset.node] = n;
}
return out;
"""

Snapshot = dict[str, Any]


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[WebDriver]:
    assert CHROMIUM is not None and CHROMEDRIVER is not None
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,1000",
                "--no-first-run", "--disable-extensions",
                f"--user-data-dir={tmp_path / 'chromium'}"):  # fmt: skip
        opts.add_argument(arg)
    if os.geteuid() == 0:
        opts.add_argument("--no-sandbox")  # Chromium refuses to sandbox as root
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=opts, service=Service(CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()


def snapshot(driver: WebDriver) -> Snapshot:
    result: Snapshot = driver.execute_script(SNAPSHOT_JS)
    return result


def wait_for(driver: WebDriver, ok: Callable[[Snapshot], bool], what: str, timeout_s: float = 20) -> Snapshot:
    """The first snapshot for which ok() holds (bounded wait; the failure names what it waited for)."""
    box: list[Snapshot] = []

    def check(d: WebDriver) -> bool:
        box[:] = [snapshot(d)]
        return ok(box[0])

    try:
        WebDriverWait(driver, timeout_s, poll_frequency=0.1).until(check)
    except TimeoutException as exc:
        last = box[-1] if box else None
        raise AssertionError(f"the page never showed {what}; console: {page_errors(driver)}; last: {last}") from exc
    return box[0]


def wait_updates(driver: WebDriver, beyond: int) -> Snapshot:
    """A snapshot rendered from a poll that began after the page showed `beyond` updates (the
    poll in flight then may have begun earlier; the one after it cannot have)."""
    return wait_for(driver, lambda s: s["updates"] >= beyond + 2, f"update {beyond + 2}")


def value(snap: Snapshot, node: str, name: str) -> float | None:
    raw = snap["nodes"][node]["fields"][name]["value"]
    return None if raw in (None, "") else float(raw)


def status(server: ServerHandle, headers: dict[str, str] | None = None) -> dict[str, Any]:
    with server.client() as client:
        r = client.get("/status", headers=headers)
        assert r.status_code == 200, r.text
        body: dict[str, Any] = r.json()
        return body


def complete(url: str, prompts: Sequence[str], gap_s: float) -> list[int]:
    """Sequential /v1/completions calls with a pause between them; their status codes."""
    codes = []
    with httpx.Client(base_url=url, timeout=30) as client:
        for prompt in prompts:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 8}
            codes.append(client.post("/v1/completions", json=body).status_code)
            time.sleep(gap_s)
    return codes


def tail(i: int) -> str:
    """~40 tokens no other prompt has: past decode's local-prefill bound, so prefill-0 computes it."""
    return " ".join(f"{WORDS[(i + k) % len(WORDS)]}{i}" for k in range(12))


def page_errors(driver: WebDriver, allowed: str | None = None) -> list[str]:
    logs: list[dict[str, Any]] = driver.get_log("browser")
    return [e["message"] for e in logs
            if e["level"] == "SEVERE" and not (allowed and allowed in e["message"])]  # fmt: skip


def share(hit: int, query: int) -> float:
    return hit / query


def assert_shows(snap: Snapshot, before: dict[str, Any], after: dict[str, Any]) -> None:
    """Every node of `after` as the page shows it, with the window's rates taken from `before`
    (the page loaded before any traffic, so its window starts there)."""
    for old, node in zip(before["nodes"], after["nodes"], strict=True):
        name, cache, old_cache = node["name"], node["cache"], old["cache"]
        shown = snap["nodes"][name]
        assert shown["health"] == "ok" and shown["role"] == node["role"]
        assert value(snap, name, "running") == node["running"]
        assert value(snap, name, "waiting") == node["waiting"]
        assert value(snap, name, "query-tokens") == cache["query_tokens"] > old_cache["query_tokens"]
        assert value(snap, name, "hit-tokens") == cache["hit_tokens"]
        lifetime = share(cache["hit_tokens"], cache["query_tokens"])
        assert value(snap, name, "hit-rate-total") == pytest.approx(lifetime, abs=1e-9)
        assert shown["fields"]["hit-rate-total"]["text"] == f"{100 * lifetime:.1f}%"
        queried = cache["query_tokens"] - old_cache["query_tokens"]
        window = share(cache["hit_tokens"] - old_cache["hit_tokens"], queried)
        assert value(snap, name, "hit-rate") == pytest.approx(window, abs=1e-9)
        assert shown["fields"]["hit-rate"]["text"] == f"{100 * window:.1f}%"
        assert set(shown["tiers"]) == set(cache["tiers"])
        device, row = cache["tiers"]["device"], shown["tiers"]["device"]
        used, cached, total = device["pages_used"], device["pages_cached"], device["pages_total"]
        assert row["pages"]["value"] == f"{used}/{cached}/{total - used - cached}/{total}"
        device_hits = device["hit_tokens"] - old_cache["tiers"]["device"]["hit_tokens"]
        assert float(row["rate"]["value"]) == pytest.approx(share(device_hits, queried), abs=1e-9)
        assert "M" in shown["charts"]["hit"] and "M" in shown["charts"]["load"], f"{name}'s charts are empty"
    assert snap["header"]["requests"]["text"] == f"{after['gateway']['requests']['ok']} ok"
    assert value(snap, "prefill-0", "transfers") == after["nodes"][0]["transfers"]


def shared_prefix_traffic(url: str, driver: WebDriver, names: Sequence[str]) -> list[float]:
    """Prompts that share PREFIX from two clients at once: long tails go to prefill-0 (whose cache
    holds the prefix), short ones decode-0 prefills itself (the transferred pages are cached
    there). The page is read while they run; returns the query tokens it showed, summed."""
    long_prompts = [PREFIX + tail(i) for i in range(1, 9)]
    short_prompts = [PREFIX + f" question {i}?" for i in range(1, 9)]
    seen: list[float] = []
    with ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(complete, url, prompts, 0.2) for prompts in (long_prompts, short_prompts)]
        while not all(r.done() for r in runs):
            snap = snapshot(driver)
            seen.append(sum(value(snap, n, "query-tokens") or 0 for n in names))
            time.sleep(0.1)
        assert [r.result(timeout=60) for r in runs] == [[200] * 8, [200] * 8]
    return seen


def test_dashboard_follows_two_nodes_under_traffic(
    make_server: Callable[..., ServerHandle], browser: WebDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    pd = make_server(prefill_workers=1)  # in-process prefill-0 beside decode-0
    before = status(pd)
    names = [n["name"] for n in before["nodes"]]
    assert names == ["prefill-0", "decode-0"]
    browser.get(pd.url + "/dashboard?poll=0.5")
    snap = wait_for(browser, lambda s: set(s["nodes"]) == set(names)
                    and all(n["health"] == "ok" for n in s["nodes"].values()), "both nodes, ok")  # fmt: skip
    assert snap["order"] == names and snap["state"] == "ok"
    assert snap["header"]["model"]["text"] == MODEL and snap["header"]["state"]["text"] == "ready"
    assert snap["nodes"]["decode-0"]["fields"]["hit-rate"]["text"] == "–"  # nothing looked up yet
    for name in names:  # what each engine runs on (engine.kernel_info): baton's CPU kernels here
        assert snap["nodes"][name]["fields"]["kernels"]["text"].startswith("cpu/panel ")
    first_update = snap["updates"]

    # One cold prompt, computed by prefill-0 (a miss) and sent to decode-0.
    assert complete(pd.url, [PREFIX + tail(0)], 0) == [200]
    cold = status(pd)["nodes"][0]["cache"]
    snap = wait_for(browser, lambda s: value(s, "prefill-0", "query-tokens") == cold["query_tokens"],
                    "prefill-0's first lookup")  # fmt: skip
    assert snap["nodes"]["prefill-0"]["fields"]["hit-rate"]["text"] == "0.0%"
    cold_rates = {n: value(snap, n, "hit-rate") or 0.0 for n in names}

    seen = shared_prefix_traffic(pd.url, browser, names)
    assert seen == sorted(seen) and len(set(seen)) >= 3, f"the counters did not move during traffic: {seen}"
    after = status(pd)
    snap = wait_updates(browser, snapshot(browser)["updates"])  # a poll begun after the traffic
    assert snap["updates"] > first_update + 2
    assert_shows(snap, before, after)
    for name in names:
        assert (value(snap, name, "hit-rate") or 0.0) > cold_rates[name], f"{name}'s hit rate did not go up"
    assert page_errors(browser) == []

    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    height = browser.execute_script("return document.documentElement.scrollHeight")
    browser.set_window_size(1400, max(400, int(height) + 40))
    assert browser.save_screenshot(str(SCREENSHOT))

    # prefill-0 leaves /status (as when membership drops a worker): its card stays, marked gone.
    frontend = pd.running.frontend
    report: Callable[[], Awaitable[list[NodeStatus]]] = frontend.nodes

    async def without_prefill() -> list[NodeStatus]:
        return [n for n in await report() if n.name != "prefill-0"]

    monkeypatch.setattr(frontend, "nodes", without_prefill)
    assert [n["name"] for n in status(pd)["nodes"]] == ["decode-0"]
    snap = wait_for(browser, lambda s: s["nodes"]["prefill-0"]["health"] == "gone", "prefill-0 gone")
    assert snap["nodes"]["prefill-0"]["fields"]["health"]["text"] == "gone"
    assert snap["nodes"]["decode-0"]["health"] == "ok" and snap["order"] == names
    frozen = after["nodes"][0]["cache"]["query_tokens"]
    assert value(snap, "prefill-0", "query-tokens") == frozen
    assert snap["header"]["nodes-summary"]["text"] == "1 ok · 1 gone"


def test_dashboard_asks_for_the_api_key(
    make_server: Callable[..., ServerHandle], browser: WebDriver, tmp_path: Path
) -> None:
    key = "d" * 24
    keys = tmp_path / "keys"
    keys.write_text(f"{key} ops role=operator\n")
    guarded = make_server(api_keys_file=keys)
    with guarded.client() as client:
        assert client.get("/status").status_code == 401
        assert client.get("/dashboard").status_code == 200  # the page itself is open
    browser.get(guarded.url + "/dashboard?poll=0.5")
    snap = wait_for(browser, lambda s: s["authShown"], "the key form")
    assert snap["state"] == "auth" and snap["nodes"] == {} and snap["updates"] == 0

    def submit(text: str) -> None:
        field = browser.find_element(By.ID, "api-key")
        field.clear()
        field.send_keys(text)
        browser.find_element(By.ID, "api-key-submit").click()

    submit("w" * 24)
    snap = wait_for(browser, lambda s: s["authShown"] and "refused" in s["authMessage"], "a refused key")
    assert snap["nodes"] == {}
    submit(key)
    snap = wait_for(browser, lambda s: "engine-0" in s["nodes"], "engine-0 after the key")
    assert not snap["authShown"] and snap["state"] == "ok"
    assert snap["nodes"]["engine-0"]["health"] == "ok"
    assert browser.execute_script("return sessionStorage.getItem('baton.apiKey')") == key
    expected = status(guarded, {"Authorization": f"Bearer {key}"})["nodes"][0]
    assert snap["nodes"]["engine-0"]["role"] == expected["role"] == "colocated"

    browser.refresh()  # the key outlives a reload of the tab: no form the second time
    snap = wait_for(browser, lambda s: "engine-0" in s["nodes"], "engine-0 after a reload")
    assert not snap["authShown"]
    assert page_errors(browser, allowed="401") == []
