"""cluster.edge.tool_calls without a server: the parser reads back what the grammar writes, however
the text is split into steps, and the grammar admits exactly that format."""

from __future__ import annotations

import json
import string
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.edge.tool_calls import OPEN, Tool, ToolCallParser, ToolChoice, ToolUse, finish_reason
from engine.structured import GrammarCompiler
from engine.structured_config import StructuredConfig
from engine.tokenizer import Tokenizer

WEATHER = json.dumps({"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                      "required": ["city"], "additionalProperties": False})  # fmt: skip
TOOLS = (Tool("get_weather", WEATHER), Tool("ping"))


def _call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def _parse(parser: ToolCallParser, pieces: list[str]) -> tuple[str, list[dict[str, Any]]]:
    """Feed the pieces as a stream; assemble content and calls the way an OpenAI client does."""
    content, calls = [], []
    for n, piece in enumerate(pieces):
        parsed = parser.feed(piece)
        if n == len(pieces) - 1:
            parsed.content.extend(parser.finish().content)
        content.append(parsed.text)
        for d in parsed.calls:
            if d.id is not None:
                assert d.index == len(calls)
                calls.append({"id": d.id, "name": d.name, "arguments": ""})
            calls[d.index]["arguments"] += d.arguments
    return "".join(content), calls


def _split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    return [text[a:b] for a, b in zip(points, points[1:], strict=False)] or [""]


_WORDS = st.text(string.ascii_letters + " <>{}\"_/\n", min_size=1, max_size=12).map(str.strip).filter(
    lambda t: t and OPEN not in t)
_ARGS = st.dictionaries(st.text(string.ascii_letters, min_size=1, max_size=4),
                        st.one_of(st.integers(), st.text(max_size=6), st.lists(st.booleans(), max_size=3)),
                        max_size=3).map(lambda d: json.dumps(d, ensure_ascii=False))  # fmt: skip
_NAMES = st.text(string.ascii_letters + string.digits + "_-", min_size=1, max_size=12)


@settings(max_examples=200, deadline=None)
@given(parts=st.lists(st.tuples(_WORDS, _NAMES, _ARGS), max_size=4), tail=st.one_of(st.just(""), _WORDS),
       cuts=st.lists(st.integers(0, 10_000), max_size=12))  # fmt: skip
def test_the_parser_reads_content_and_calls_however_the_text_is_split(
    parts: list[tuple[str, str, str]], tail: str, cuts: list[int]
) -> None:
    text = "".join(f"{words}\n{_call(name, args)}\n" for words, name, args in parts) + tail
    content, calls = _parse(ToolCallParser(), _split(text, cuts))
    assert content == "".join(words for words, _, _ in parts) + tail
    assert [(c["name"], c["arguments"]) for c in calls] == [(name, args) for _, name, args in parts]
    whole = ToolCallParser()
    assert _parse(whole, [text]) == (content, [{**c, "id": w.id} for c, w in zip(calls, whole.calls, strict=True)])


def test_text_without_calls_is_kept_exactly() -> None:
    for text in ["plain <tool_ text  \n", "a <tool_call", "  spaced  \n\n", "<tool_call>\nnot a call"]:
        assert _parse(ToolCallParser(), _split(text, [3, 7]))[0] == text


def test_a_cut_call_keeps_its_truncated_arguments_and_a_cut_head_is_dropped() -> None:
    parser = ToolCallParser(has_text=False)
    content, calls = _parse(parser, [_call("ping", "{}") + "\n" + '<tool_call>\n{"name": "get_weather", "arguments": {"ci'])
    assert content == "" and [(c["name"], c["arguments"]) for c in calls] == [("ping", "{}"), ("get_weather", '{"ci')]
    assert finish_reason("length", parser) == "length" and finish_reason("stop", parser) == "tool_calls"
    content, calls = _parse(ToolCallParser(has_text=False), [_call("ping", "{}") + '\n<tool_call>\n{"na'])
    assert content == "" and len(calls) == 1
    assert finish_reason("stop", ToolCallParser()) == "stop"


def test_none_constrains_nothing_and_a_named_function_allows_only_itself() -> None:
    assert ToolUse(TOOLS, ToolChoice.NONE).constraint() is None
    named = ToolUse(TOOLS, ToolChoice.FUNCTION, "ping").constraint()
    assert named is not None and '"\\"ping\\", \\"arguments\\": "' in named.text and "get_weather" not in named.text


@pytest.fixture(scope="module")
def compiler(tiny_model_dir: Path) -> Iterator[GrammarCompiler]:
    tokenizer = Tokenizer.from_dir(tiny_model_dir)
    compiler = GrammarCompiler(tokenizer.to_json, tokenizer.vocab_size, tokenizer.eos_token_ids, StructuredConfig())
    yield compiler
    compiler.close()


@pytest.mark.parametrize(
    ("use", "accepted", "refused"),
    [
        (ToolUse(TOOLS, ToolChoice.REQUIRED, parallel=False),
         [_call("get_weather", '{"city": "Paris"}')],
         ["hello", _call("get_weather", '{"town": "Paris"}'), _call("ping", "{}") + "\n" + _call("ping", "{}"),
          _call("nope", "{}"), _call("get_weather", '{"city":"Paris"}')]),
        (ToolUse(TOOLS, ToolChoice.REQUIRED),
         [_call("ping", "{}") + "\n" + _call("get_weather", '{"city": "Rome"}')], ["hi " + _call("ping", "{}")]),
        (ToolUse(TOOLS, ToolChoice.FUNCTION, "get_weather"),
         [_call("get_weather", '{"city": "Oslo"}')], [_call("ping", "{}")]),
        (ToolUse(TOOLS, ToolChoice.AUTO),
         ["just text", "thinking " + _call("ping", "{}") + " done " + _call("ping", "{}")],
         ["text " + _call("ping", '{"x": 1}'), "text <tool_call>\nnot json"]),
        (ToolUse(TOOLS, ToolChoice.AUTO, parallel=False),
         ["text", "text " + _call("ping", "{}")], [_call("ping", "{}") + " more"]),
    ],
    ids=["required-one", "required-parallel", "named", "auto", "auto-one"],
)
def test_the_grammar_admits_exactly_the_format(
    compiler: GrammarCompiler, tiny_model_dir: Path, use: ToolUse, accepted: list[str], refused: list[str]
) -> None:
    constraint = use.constraint()
    assert constraint is not None
    tokenizer = Tokenizer.from_dir(tiny_model_dir)
    for text, ok in [(t, True) for t in accepted] + [(t, False) for t in refused]:
        matcher = compiler.matcher(constraint).ll
        ids = tokenizer.encode(text, add_special_tokens=False)
        valid = matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids)
        assert (valid and matcher.is_accepting()) == ok, text
