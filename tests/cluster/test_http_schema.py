"""schemathesis against /openapi.json, positive and negative: no 5xx, /live healthy after each case.

Cases come from schemathesis' strategies for every operation in the served schema and are
sent over real HTTP. Examples are capped (and the served context kept short) to fit the
suite's time budget.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from engine.engine_config import EngineConfig
from tests.cluster.conftest import ServerHandle

MAX_EXAMPLES = 30


@pytest.fixture(scope="module")
def fuzz_server(make_module_server: Any, tiny_engine_config: EngineConfig) -> ServerHandle:
    return make_module_server(engine=replace(tiny_engine_config, max_model_len=64))


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
def test_no_input_produces_a_server_error(fuzz_server: ServerHandle, mode: GenerationMode) -> None:
    schema = schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/v1/models"}
    if mode == GenerationMode.NEGATIVE:  # only operations with a body have anything to violate
        operations = [op for op in operations if op.method.upper() == "POST"]
    seen: dict[int, int] = {}
    for operation in operations:

        @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy(generation_mode=mode))
        def check(case: Any) -> None:
            if mode == GenerationMode.POSITIVE and isinstance(case.body, dict) and "model" in case.body:
                case.body["model"] = "baton-tiny"  # otherwise nearly every valid body is a 404
            response = case.call(base_url=fuzz_server.url, timeout=60)
            seen[response.status_code] = seen.get(response.status_code, 0) + 1
            assert response.status_code < 500, (case.method, case.path, response.status_code, response.text[:300])
            if response.status_code >= 400 and case.path.startswith("/v1/"):
                error = response.json()["error"]
                assert error["message"] and error["type"]
            assert httpx.get(fuzz_server.url + "/live", timeout=10).status_code == 200

        check()
    print(f"[schemathesis {mode.value}] status codes seen: {dict(sorted(seen.items()))}")
    assert fuzz_server.wait_idle()
