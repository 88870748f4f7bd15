"""schemathesis against a gateway with API keys (tests/cluster/test_http_schema.py runs the
keyless one): every generated case, positive and negative, is sent twice over real HTTP.

    without a key   401 on every route but the probes (and the static /dashboard)
    with a key      never a 5xx, never a 401; /live stays healthy

The schema itself is behind the key too, so it is fetched with one. Examples are capped (and
the served context is short) to keep the suite inside its budget.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from engine.engine_config import EngineConfig
from tests.cluster.conftest import ServerHandle
from tests.security.conftest import ALPHA_KEY, MODEL, OPEN_PATHS, Guarded, bearer, start_guarded

pytestmark = pytest.mark.timeout(120)

MAX_EXAMPLES = 10
_AUTH_HEADERS = {"authorization", "x-api-key"}


@pytest.fixture(scope="module")
def schema_server(
    make_module_server: Callable[..., ServerHandle], tiny_engine_config: EngineConfig,
    tmp_path_factory: pytest.TempPathFactory,
) -> Guarded:
    """A guarded gateway with a 64-token context: a valid case without max_tokens generates
    the rest of it, so the context bounds each case's time."""
    return start_guarded(make_module_server, replace(tiny_engine_config, max_model_len=64), tmp_path_factory)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
def test_keyless_cases_are_401_and_keyed_ones_never_fail(schema_server: Guarded, mode: GenerationMode) -> None:
    guarded = schema_server
    assert httpx.get(guarded.url + "/openapi.json", timeout=10).status_code == 401
    spec = httpx.get(guarded.url + "/openapi.json", headers=bearer(ALPHA_KEY), timeout=10).json()
    operations = [result.ok() for result in schemathesis.openapi.from_dict(spec).get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/v1/models"}
    if mode == GenerationMode.NEGATIVE:  # only operations with a body have anything to violate
        operations = [op for op in operations if op.method.upper() == "POST"]
    seen: dict[tuple[bool, int], int] = {}
    for operation in operations:

        @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))  # fmt: skip
        @given(case=operation.as_strategy(generation_mode=mode))
        def check(case: Any) -> None:
            if mode == GenerationMode.POSITIVE and isinstance(case.body, dict) and "model" in case.body:
                case.body["model"] = MODEL  # otherwise nearly every valid body is a 404
            if case.headers:  # a generated header must not stand in for (or drop) the key
                case.headers = {k: v for k, v in case.headers.items() if k.lower() not in _AUTH_HEADERS}
            keyless = case.call(base_url=guarded.url, timeout=60)
            keyed = case.call(base_url=guarded.url, headers=bearer(ALPHA_KEY), timeout=60)
            for has_key, reply in ((False, keyless), (True, keyed)):
                seen[(has_key, reply.status_code)] = seen.get((has_key, reply.status_code), 0) + 1
            if case.path in OPEN_PATHS:
                assert keyless.status_code < 500, (case.method, case.path, keyless.status_code)
            else:
                assert keyless.status_code == 401, (case.method, case.path, keyless.status_code, keyless.text[:200])
                assert keyless.json()["error"]["type"] == "authentication_error"
            assert keyed.status_code < 500 and keyed.status_code != 401, (
                case.method, case.path, keyed.status_code, keyed.text[:300]
            )  # fmt: skip
            if keyed.status_code >= 400 and case.path.startswith("/v1/"):
                error = keyed.json()["error"]
                assert error["message"] and error["type"]

        check()
        assert httpx.get(guarded.url + "/live", timeout=10).status_code == 200
    print(f"[schemathesis {mode.value}, keyed?] status codes seen: {dict(sorted(seen.items()))}")
    if mode == GenerationMode.POSITIVE:  # the key let valid cases through, not just past the guard
        assert any(has_key and status == 200 for has_key, status in seen)
    assert guarded.server.wait_idle(10.0)
