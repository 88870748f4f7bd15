"""docs/openai_fields.md against a real server: each row's example answered as the row says
(supported and ignored: 200; refused: 400 naming the field), every field of the request models
in the table, and every request field of OpenAI's Completions and Chat Completions references; the
tokenizer routes' tables too."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from cluster.edge.openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeBody,
    TokenizeBody,
)
from tests.cluster.conftest import ServerHandle

pytestmark = pytest.mark.timeout(300)

DOC = Path(__file__).resolve().parents[2] / "docs" / "openai_fields.md"
MODEL = "baton-tiny"
COMPLETIONS, CHAT, TOKENIZE, DETOKENIZE = "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"
BASE: dict[str, dict[str, Any]] = {
    COMPLETIONS: {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3},
    CHAT: {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
    TOKENIZE: {"model": MODEL, "prompt": "hi"},
    DETOKENIZE: {"model": MODEL, "tokens": [5, 6, 7]},
}
MODELS = {COMPLETIONS: CompletionRequest, CHAT: ChatCompletionRequest, TOKENIZE: TokenizeBody, DETOKENIZE: DetokenizeBody}
# The request fields of OpenAI's API reference (Completions; Chat Completions), 2026.
OPENAI = {
    COMPLETIONS: {"model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens",
                  "n", "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix", "temperature",
                  "top_p", "user"},
    CHAT: {"messages", "model", "audio", "frequency_penalty", "function_call", "functions", "logit_bias", "logprobs",
           "max_completion_tokens", "max_tokens", "metadata", "modalities", "n", "parallel_tool_calls", "prediction",
           "presence_penalty", "prompt_cache_key", "reasoning_effort", "response_format", "safety_identifier", "seed",
           "service_tier", "stop", "store", "stream", "stream_options", "temperature", "tool_choice", "tools",
           "top_logprobs", "top_p", "user", "verbosity", "web_search_options"},
}  # fmt: skip
# Rows whose example needs a companion field to be valid on its own.
_AS_CHAT = {"prompt": None, "messages": [{"role": "user", "content": "hi"}]}  # /tokenize's other form
COMPANIONS = {(CHAT, "top_logprobs"): {"logprobs": True}, (TOKENIZE, "messages"): {"prompt": None},
              **{(TOKENIZE, f): _AS_CHAT for f in ("add_generation_prompt", "tools", "continue_final_message")}}


class Row(NamedTuple):
    path: str
    field: str
    handling: str
    example: Any


def _rows() -> list[Row]:
    rows: list[Row] = []
    path = None
    for line in DOC.read_text(encoding="utf-8").splitlines():
        if line.startswith("## "):
            path = line[3:].strip()
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if path is None or len(cells) != 4 or not cells[0].startswith("`"):
            continue
        field, handling, example = cells[0].strip("`"), cells[1], cells[2].strip("`")
        assert handling in ("supported", "refused", "ignored"), line
        rows.append(Row(path, field, handling, json.loads(example)))
    return rows


ROWS = _rows()


def test_the_table_covers_the_request_models_and_openais_reference() -> None:
    assert {r.path for r in ROWS} == set(MODELS)
    for path, model in MODELS.items():
        listed = [r.field for r in ROWS if r.path == path]
        assert len(listed) == len(set(listed)), f"{path}: a field listed twice"
        assert set(model.model_fields) <= set(listed), f"{path}: not in the table: {set(model.model_fields) - set(listed)}"
        openai = OPENAI.get(path, set())  # the tokenizer routes are vLLM's, not OpenAI's
        assert openai <= set(listed), f"{path}: OpenAI's fields not in the table: {openai - set(listed)}"


@pytest.mark.parametrize("row", ROWS, ids=[f"{'chat' if r.path == CHAT else r.path.rsplit('/', 1)[-1]}-{r.field}"
                                           for r in ROWS])  # fmt: skip
def test_each_field_is_answered_as_the_table_says(server: ServerHandle, row: Row) -> None:
    body = {**BASE[row.path], **COMPANIONS.get((row.path, row.field), {}), row.field: row.example}
    with server.client() as client:
        reply = client.post(row.path, json=body)
    if row.handling == "refused":
        assert reply.status_code == 400, (row, reply.text[:300])
        error = reply.json()["error"]
        assert row.field in error["message"] or error.get("param") == row.field, error
    else:
        assert reply.status_code == 200, (row, reply.text[:300])


def test_the_value_that_changes_nothing_is_accepted(server: ServerHandle) -> None:
    """A refused field is refused for what it would change: its neutral value passes."""
    neutral = {COMPLETIONS: {"echo": False, "suffix": "", "best_of": 1, "use_beam_search": False, "length_penalty": 1,
                             "skip_special_tokens": True, "bad_words": []},
               CHAT: {"modalities": ["text"], "continue_final_message": False, "chat_template_kwargs": {},
                      "function_call": "none", "reasoning_effort": None}}  # fmt: skip
    with server.client() as client:
        for path, fields in neutral.items():
            for field, value in fields.items():
                reply = client.post(path, json={**BASE[path], field: value})
                assert reply.status_code == 200, (path, field, reply.text[:300])
