"""/tokenize, /detokenize and GET /v1/models/{model} over real HTTP, against a real engine: the ids
/tokenize returns are the ones the generation routes compute (the same greedy answer from them)."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from engine.builtin import BOS_ID
from tests.cluster.conftest import ServerHandle

MODEL = "baton-tiny"
PROMPT = "def fib(n):\n    return"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime."}]
WEATHER = {"type": "function", "function": {"name": "weather", "description": "today's weather",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}  # fmt: skip


def _post(server: ServerHandle, path: str, body: dict[str, Any]) -> Any:
    with server.client() as client:
        response = client.post(path, json=body)
    return response.status_code, response.json()


def _greedy(server: ServerHandle, path: str, body: dict[str, Any]) -> dict[str, Any]:
    status, out = _post(server, path, {"model": MODEL, "max_tokens": 6, "temperature": 0, "ignore_eos": True, **body})
    assert status == 200, out
    return out


def test_a_prompts_ids_are_the_ones_completions_computes(server: ServerHandle) -> None:
    status, tok = _post(server, "/tokenize", {"model": MODEL, "prompt": PROMPT})
    assert status == 200
    assert tok["count"] == len(tok["tokens"]) and tok["tokens"][0] == BOS_ID
    assert tok["max_model_len"] == server.engine.max_model_len and tok["token_strs"] is None
    as_text = _greedy(server, "/v1/completions", {"prompt": PROMPT})
    as_ids = _greedy(server, "/v1/completions", {"prompt": tok["tokens"]})
    assert as_text["usage"]["prompt_tokens"] == tok["count"]
    assert as_ids["choices"][0]["text"] == as_text["choices"][0]["text"]

    status, bare = _post(server, "/tokenize", {"prompt": PROMPT, "add_special_tokens": False})  # model absent: the served one
    assert status == 200 and bare["tokens"] == tok["tokens"][1:]
    status, back = _post(server, "/detokenize", {"model": MODEL, "tokens": bare["tokens"]})
    assert status == 200 and back == {"prompt": PROMPT}
    status, strs = _post(server, "/tokenize", {"prompt": PROMPT, "return_token_strs": True})
    assert status == 200 and len(strs["token_strs"]) == strs["count"]
    assert all(isinstance(s, str) and s for s in strs["token_strs"])
    status, with_bos = _post(server, "/detokenize", {"tokens": tok["tokens"]})  # special tokens kept, as vLLM's
    assert status == 200 and with_bos["prompt"].endswith(PROMPT) and with_bos["prompt"] != PROMPT


@pytest.mark.parametrize("tools", [None, [WEATHER]], ids=["plain", "tools"])
def test_messages_ids_are_the_ones_chat_completions_computes(server: ServerHandle, tools: Any) -> None:
    extra = {"tools": tools} if tools else {}
    status, tok = _post(server, "/tokenize", {"model": MODEL, "messages": MESSAGES, **extra})
    assert status == 200, tok
    chat = _greedy(server, "/v1/chat/completions", {"messages": MESSAGES, "tool_choice": "none", **extra} if tools
                   else {"messages": MESSAGES})  # fmt: skip
    as_ids = _greedy(server, "/v1/completions", {"prompt": tok["tokens"]})
    assert chat["usage"]["prompt_tokens"] == tok["count"]
    assert as_ids["choices"][0]["text"] == chat["choices"][0]["message"]["content"]
    status, no_prompt = _post(server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False, **extra})
    assert status == 200 and no_prompt["count"] < tok["count"]
    assert tok["tokens"][: no_prompt["count"]] == no_prompt["tokens"]
    if tools:  # the tools are in the rendering
        status, bare = _post(server, "/tokenize", {"messages": MESSAGES})
        assert bare["count"] < tok["count"]


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"model": MODEL}, 400, None),
        ("/tokenize", {"prompt": "a", "messages": MESSAGES}, 400, None),
        ("/tokenize", {"prompt": "a", "tools": [WEATHER]}, 400, None),
        ("/tokenize", {"messages": MESSAGES, "chat_template": "{{ 1 }}"}, 400, None),
        ("/tokenize", {"messages": MESSAGES, "continue_final_message": True}, 400, None),
        ("/tokenize", {"messages": [{"role": "user", "content": "x", "tool_calls": [
            {"id": "1", "function": {"name": "f", "arguments": "{not json"}}]}]}, 400, "messages.0.tool_calls.0.function.arguments"),
        ("/tokenize", {"prompt": "a", "add_special_tokens": 1}, 400, "add_special_tokens"),
        ("/tokenize", {"model": "gpt-4", "prompt": "a"}, 404, "model"),
        ("/detokenize", {"tokens": [1, -1]}, 400, "tokens.1"),
        ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
        ("/detokenize", {"model": "gpt-4", "tokens": [1]}, 404, "model"),
        ("/detokenize", {"tokens": "1 2"}, 400, "tokens"),
    ],
)
def test_bad_bodies_get_openai_errors(server: ServerHandle, path: str, body: dict[str, Any], status: int,
                                      param: str | None) -> None:  # fmt: skip
    got, out = _post(server, path, body)
    assert got == status, out
    assert out["error"]["message"] and out["error"]["type"]
    if param is not None:
        assert out["error"]["param"] == param
    if status == 404:
        assert out["error"]["code"] == "not_found"  # as every route answers an unknown model


def test_a_model_is_looked_up_as_openais_client_does(server: ServerHandle) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.owned_by == "baton"
    assert card.model_dump() == client.models.list().data[0].model_dump()
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("org/no-such-model")
    assert "org/no-such-model" in str(missing.value)


def test_the_tokenizer_routes_need_a_key_when_keys_are_set(make_server: Any, tmp_path: Any) -> None:
    keys = tmp_path / "keys"
    keys.write_text("k" * 24 + " acme\n")
    guarded = make_server(api_keys_file=keys)
    with guarded.client() as client:
        assert client.post("/tokenize", json={"prompt": "a"}).status_code == 401
        assert client.post("/detokenize", json={"tokens": [1]}).status_code == 401
        assert client.get(f"/v1/models/{MODEL}").status_code == 401
        good = client.post("/tokenize", json={"prompt": "a"}, headers={"Authorization": "Bearer " + "k" * 24})
        assert good.status_code == 200 and good.json()["count"] >= 1
