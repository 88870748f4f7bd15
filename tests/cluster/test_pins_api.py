"""Prefix pins through the operator's HTTP routes on a real server (cluster.edge.pins): a pin
is computed on the worker and reused by the tenant's requests, listed in /status, bounded per
tenant, released by DELETE; an operator key is required when keys are set. The eviction and
TTL behaviour on the worker is tests/engine/test_pins.py's."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from cluster.edge.http_api import HttpConfig
from cluster.edge.pins import MAX_PINS_PER_TENANT
from tests.cluster.conftest import ServerHandle

pytestmark = pytest.mark.timeout(120)

MODEL = "baton-tiny"
SYSTEM = list(range(500, 600))  # 100 tokens: 6 whole pages


def _pins(client: httpx.Client) -> list[dict[str, Any]]:
    return list(client.get("/status").json()["pins"])


def test_a_pin_is_computed_listed_reused_and_released(make_server: Callable[..., ServerHandle]) -> None:
    server = make_server(http=HttpConfig(enable_admin=True))
    with server.client() as client:
        made = client.post("/admin/pins", json={"pin_id": "sys", "tenant": "default", "token_ids": SYSTEM,
                                                "ttl_s": 600})  # fmt: skip
        assert made.status_code == 200, made.text
        # The call returns once the worker holds the pages (its own request computed them).
        assert made.json()["num_pages"] == 6 and made.json()["workers"] == {"engine-0": "held"}
        [pin] = _pins(client)
        assert (pin["tenant"], pin["pin_id"], pin["num_tokens"]) == ("default", "sys", 100)
        assert 0 < pin["expires_in_s"] <= 600
        body = {"model": MODEL, "prompt": SYSTEM + [7, 8], "max_tokens": 2, "temperature": 0}
        reply = client.post("/v1/completions", json=body).json()
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 96  # the pin computed them
        assert client.delete("/admin/pins/default/sys").json() == {"released": True}
        assert _pins(client) == []
        assert client.delete("/admin/pins/default/sys").status_code == 404
    engine = server.engine
    assert engine.pins.num_held_pages == 0
    assert server.wait_idle()
    engine.check_integrity()


def test_pins_are_bounded_and_checked(make_server: Callable[..., ServerHandle]) -> None:
    server = make_server(http=HttpConfig(enable_admin=True))
    with server.client() as client:
        def pin(**fields: Any) -> httpx.Response:
            return client.post("/admin/pins", json={"pin_id": "p", "tenant": "acme", "token_ids": SYSTEM[:32],
                                                    "ttl_s": 60, **fields})  # fmt: skip

        assert pin(ttl_s=0).status_code == 400
        assert pin(pin_id="a b").status_code == 400
        assert pin(token_ids=SYSTEM[:10]).json()["error"]["message"].startswith("no worker pinned it")
        assert pin(prompt="x", token_ids=[1]).status_code == 400
        assert pin(token_ids=[10**6]).status_code == 400  # not in the vocabulary
        for i in range(MAX_PINS_PER_TENANT):
            assert pin(pin_id=f"p{i}").status_code == 200
        assert pin(pin_id="one-more").status_code == 429
        assert pin(pin_id="p0", ttl_s=5).status_code == 200  # replacing one is not one more
        assert pin(pin_id="other", tenant="globex").status_code == 200  # per tenant
    assert not server.engine.has_unfinished()  # every pin call waited for its pages
    server.engine.check_integrity()


def test_pins_need_an_operator_key_and_admin_routes(make_server: Callable[..., ServerHandle], tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("t" * 24 + " acme\n" + "o" * 24 + " ops role=operator\n")
    server = make_server(api_keys_file=keys, http=HttpConfig(enable_admin=True))
    body = {"pin_id": "sys", "tenant": "acme", "token_ids": SYSTEM, "ttl_s": 60}
    with server.client(headers={"Authorization": "Bearer " + "t" * 24}) as client:
        assert client.post("/admin/pins", json=body).status_code == 403
    with server.client(headers={"Authorization": "Bearer " + "o" * 24}) as client:
        assert client.post("/admin/pins", json=body).status_code == 200
    off = make_server()
    with off.client() as client:
        assert client.post("/admin/pins", json=body).status_code == 404
