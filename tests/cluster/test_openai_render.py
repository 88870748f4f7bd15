"""A stream's chunks written into the call's template (Renderer.chunk_sse) are byte for byte
what building the chunk as a dict and serializing it gives (Renderer.chunk + sse), for any text
and ids, and the dict path still renders finish reasons and logprobs."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.edge.openai_render import Renderer, sse
from engine.outputs import StepOutput, TokenLogprobs
from engine.request import NOT_CACHED, FinishReason


def _renderer(chat: bool, want_token_ids: bool, call_id: str = "cmpl-1", model: str = "baton-tiny",
              want_logprobs: bool = False) -> Renderer:
    return Renderer(chat, call_id, model, 1733356800, lambda t: f"<{t}>", want_logprobs, want_token_ids)


def _out(text: str, ids: tuple[int, ...], finish: FinishReason | None = None,
         logprobs: tuple[TokenLogprobs, ...] = ()) -> StepOutput:
    return StepOutput("r", ids, text, logprobs, finish, 7, 3, NOT_CACHED)


texts = st.text(st.characters(codec="utf-8"), max_size=24)  # quotes, backslashes, controls, non-ASCII
ids = st.lists(st.integers(0, 200_000), min_size=1, max_size=4).map(tuple)


@settings(max_examples=300, deadline=None)
@given(text=texts, token_ids=ids, chat=st.booleans(), want_ids=st.booleans(), first=st.booleans(),
       index=st.integers(0, 3), call_id=texts, model=texts)
def test_the_template_writes_the_same_bytes_as_the_dict(
    text: str, token_ids: tuple[int, ...], chat: bool, want_ids: bool, first: bool, index: int, call_id: str, model: str
) -> None:
    r = _renderer(chat, want_ids, call_id, model)
    out = _out(text, token_ids)
    fast = r.chunk_sse(index, out, first)
    chunk = r.chunk(index, out, first)
    assert chunk is not None and fast == sse(chunk)
    parsed = json.loads(fast.removeprefix(b"data: "))
    choice = parsed["choices"][0]
    assert (parsed["id"], parsed["model"], choice["index"]) == (call_id, model, index)
    assert (choice["delta"]["content"] if chat else choice["text"]) == text
    if want_ids:
        assert choice["token_ids"] == list(token_ids)
    else:
        assert "token_ids" not in choice


def test_the_last_chunk_and_logprobs_take_the_dict_path() -> None:
    r = _renderer(False, False, want_logprobs=True)
    last = r.chunk_sse(0, _out("end", (5,), FinishReason.LENGTH), first=False)
    assert last is not None and json.loads(last.removeprefix(b"data: "))["choices"][0]["finish_reason"] == "length"
    lp = r.chunk_sse(0, _out("x", (9,), logprobs=(TokenLogprobs(9, -0.5, ((9, -0.5),)),)), first=False)
    assert lp is not None
    logprobs = json.loads(lp.removeprefix(b"data: "))["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["<9>"] and logprobs["token_logprobs"] == [-0.5]
