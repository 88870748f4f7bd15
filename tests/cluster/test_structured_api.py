"""Structured output and tool calls through the APIs, on baton-tiny's random weights: the
constraint, not the model, makes every output parse — through the official `openai` client
(JSON schemas, regex and grammar extensions, tool calls streamed and not) and baton's gRPC
client — and hostile constraints are refused with a 400 / INVALID_ARGUMENT naming the field
while the requests beside them run to their last token.

Every schema bounds its free-form fields (maxLength, enums, patterns, integer ranges): a random
model never chooses to close an unbounded string, so only a finite language surely completes.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, cast

import grpc
import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from cluster.client import BatonClient, BatonClientError, Message, Sampling, Tool, Tools
from cluster.edge.frontend import Frontend
from cluster.errors import EdgeError, Kind
from cluster.fleet.pd import PDFront
from cluster.server import ServerConfig
from engine.config import ModelConfig
from engine.constraint import Constraint
from engine.engine import Engine
from engine.engine_config import EngineConfig
from engine.sampling import SamplingParams
from engine.tokenizer import Tokenizer
from tests.cluster.conftest import ServerHandle, free_port, start_server
from tests.engine.test_structured import ORDER, PERSON
from tests.json_prefix import close_json

pytestmark = pytest.mark.timeout(120)

MODEL = "baton-tiny"
TAGS = {
    "type": "object",
    "properties": {
        "level": {"enum": ["low", "mid", "high"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 2},
        "note": {"type": ["string", "null"], "maxLength": 6},
    },
    "required": ["level", "tags"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather now", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
        "additionalProperties": False}}},
    {"type": "function", "function": {"name": "ping"}},  # no parameters: no arguments
]  # fmt: skip
SCHEMAS = {"get_weather": WEATHER, "get_time": TOOLS[1]["function"]["parameters"], "ping": {"type": "object",
           "properties": {}, "additionalProperties": False}}  # fmt: skip
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(server: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _post(server: ServerHandle, path: str, body: dict[str, Any]) -> httpx.Response:
    with server.client() as http:
        return http.post(path, json=body)


# -- JSON schemas, regexes, grammars ----------------------------------------------------------------


@pytest.mark.parametrize("schema", [PERSON, ORDER, TAGS], ids=["person", "order", "tags"])
def test_json_schema_outputs_parse_and_validate(client: openai.OpenAI, schema: dict[str, Any]) -> None:
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    greedy = client.chat.completions.create(model=MODEL, messages=ASK, response_format=fmt, temperature=0,
                                            max_tokens=160)  # fmt: skip
    sampled = client.chat.completions.create(model=MODEL, messages=ASK, response_format=fmt, temperature=1,
                                             seed=11, n=3, max_tokens=160)  # fmt: skip
    texts = set()
    for choice in [*greedy.choices, *sampled.choices]:
        assert choice.finish_reason == "stop"  # the grammar completed
        assert choice.message.content is not None
        jsonschema.validate(json.loads(choice.message.content), schema)
        texts.add(choice.message.content)
    assert len(texts) > 1  # the seeds did sample different outputs
    again = client.chat.completions.create(model=MODEL, messages=ASK, response_format=fmt, temperature=1,
                                           seed=11, n=3, max_tokens=160)  # fmt: skip
    assert [c.message.content for c in again.choices] == [c.message.content for c in sampled.choices]


class City(BaseModel):
    name: str = Field(max_length=10)
    country: Literal["fr", "de", "it"]


class Trip(BaseModel):
    days: int = Field(ge=1, le=9)
    cities: list[City] = Field(max_length=2)


def test_the_openai_clients_parse_helper_gets_its_pydantic_model(client: openai.OpenAI) -> None:
    # The client sends a strict schema with $defs / $ref; it parses the reply into the model.
    for seed in (1, 2):
        done = client.chat.completions.parse(model=MODEL, messages=ASK, response_format=Trip, seed=seed,
                                             max_tokens=120)  # fmt: skip
        trip = done.choices[0].message.parsed
        assert isinstance(trip, Trip) and 1 <= trip.days <= 9


def test_json_object_and_json_schema_streamed(client: openai.OpenAI) -> None:
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "t", "schema": TAGS}}
    stream = client.chat.completions.create(model=MODEL, messages=ASK, response_format=fmt, temperature=0,
                                            max_tokens=80, stream=True)  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), TAGS)
    assert chunks[-1].choices[0].finish_reason == "stop"
    # Any JSON object: baton-tiny never closes a free string, so it may be cut by max_tokens.
    done = client.chat.completions.create(model=MODEL, messages=ASK, response_format={"type": "json_object"},
                                          temperature=0, max_tokens=24)  # fmt: skip
    content = done.choices[0].message.content or ""
    assert done.choices[0].finish_reason in ("stop", "length")
    closed = content if done.choices[0].finish_reason == "stop" else close_json(content)
    assert isinstance(json.loads(closed), dict), content  # an object, or a prefix that closes into one
    plain = client.chat.completions.create(model=MODEL, messages=ASK, response_format={"type": "text"},
                                           temperature=0, max_tokens=4)  # fmt: skip
    assert plain.choices[0].finish_reason == "length"


REGEXES = {"phone": r"\(\d{3}\) \d{3}-\d{4}", "date": r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"}


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_regex_and_grammar_extensions(client: openai.OpenAI, endpoint: str) -> None:
    grammar = 'start: "SELECT " COL (", " COL)? " FROM " TABLE\nCOL: /[a-z]{1,6}/\nTABLE: "users" | "orders"'
    language = r"SELECT [a-z]{1,6}(, [a-z]{1,6})? FROM (users|orders)"
    cases = [({"regex": rx}, rx) for rx in REGEXES.values()] + [({"grammar": grammar}, language)]
    for extra, pattern in cases:
        for temperature, seed in ((0.0, None), (1.0, 5)):
            if endpoint == "chat":
                done = client.chat.completions.create(model=MODEL, messages=ASK, temperature=temperature, seed=seed,
                                                      max_tokens=40, extra_body=extra)  # fmt: skip
                text, finish = done.choices[0].message.content or "", done.choices[0].finish_reason
            else:
                raw = client.completions.create(model=MODEL, prompt="Answer:", temperature=temperature, seed=seed,
                                                max_tokens=40, extra_body=extra)  # fmt: skip
                text, finish = raw.choices[0].text, raw.choices[0].finish_reason
            assert finish == "stop" and re.fullmatch(pattern, text), (extra, text)


def test_completions_accept_response_format(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
    done = client.completions.create(model=MODEL, prompt="Person:", max_tokens=120, temperature=1, seed=3,
                                     extra_body={"response_format": fmt})  # fmt: skip
    assert done.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(done.choices[0].text), PERSON)


# -- tool calls -------------------------------------------------------------------------------------


def _check_calls(calls: Any) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for call in calls:
        assert call.type == "function" and re.fullmatch(r"call_[0-9a-f]{24}", call.id)
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        out.append((call.function.name, arguments))
    assert len({call.id for call in calls}) == len(calls)
    return out


def test_tool_choice_required_and_named(client: openai.OpenAI) -> None:
    for temperature, seed in ((0.0, None), (1.0, 1), (1.0, 2), (1.0, 3)):
        done = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                              parallel_tool_calls=False, temperature=temperature, seed=seed,
                                              max_tokens=80)  # fmt: skip
        choice = done.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert choice.message.tool_calls is not None and len(_check_calls(choice.message.tool_calls)) == 1
        named = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, temperature=temperature, seed=seed, max_tokens=80,
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        calls = _check_calls(named.choices[0].message.tool_calls)
        assert named.choices[0].finish_reason == "tool_calls" and [n for n, _ in calls] == ["get_weather"]
    # Parallel calls: each one parses whether or not max_tokens cut the last one.
    many = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", seed=4,
                                          max_tokens=120)  # fmt: skip
    calls = many.choices[0].message.tool_calls or []
    if many.choices[0].finish_reason == "tool_calls":
        _check_calls(calls)
    else:
        assert many.choices[0].finish_reason == "length" and calls
        _check_calls(calls[:-1])


def test_tool_choice_none_and_auto(client: openai.OpenAI) -> None:
    none = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none",
                                          temperature=0, max_tokens=12)  # fmt: skip
    plain = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=12)
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason == "length"
    assert none.choices[0].message.content  # free text (the tools are in its prompt, not plain's)
    assert none.usage is not None and plain.usage is not None
    assert none.usage.prompt_tokens > plain.usage.prompt_tokens
    for seed in range(4):  # auto: text, or calls that parse (baton-tiny rarely starts one)
        auto = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, seed=seed, max_tokens=24)
        choice = auto.choices[0]
        if choice.message.tool_calls:
            _check_calls(choice.message.tool_calls)
        else:
            assert choice.finish_reason in ("stop", "length") and choice.message.content


@pytest.mark.parametrize(("choice", "seed"), [({"type": "function", "function": {"name": "get_weather"}}, 1),
                                             ("required", 4)], ids=["named", "required"])  # fmt: skip
def test_tool_calls_stream_as_openai_deltas(client: openai.OpenAI, choice: Any, seed: int) -> None:
    kwargs: Any = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, seed=seed, max_tokens=100)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)
    # Per call: id, type and name first, then argument fragments only.
    by_index: dict[int, list[Any]] = {}
    for d in deltas:
        by_index.setdefault(d.index, []).append(d)
    wanted = whole.choices[0].message.tool_calls or []
    assert sorted(by_index) == list(range(len(wanted))) and wanted
    for index, parts in by_index.items():
        assert parts[0].id and parts[0].type == "function" and parts[0].function.name == wanted[index].function.name
        assert all(p.id is None and p.function.name is None for p in parts[1:])
        assert "".join(p.function.arguments or "" for p in parts) == wanted[index].function.arguments
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


class GetWeather(BaseModel):
    city: str = Field(max_length=10)
    unit: Literal["c", "f"]


def test_the_openai_clients_stream_helper_assembles_tool_calls(client: openai.OpenAI) -> None:
    tool = openai.pydantic_function_tool(GetWeather, name="get_weather")  # strict: parsed by the client
    for seed in (1, 2):
        with client.chat.completions.stream(model=MODEL, messages=ASK, tools=[tool], tool_choice="required",
                                            parallel_tool_calls=False, seed=seed, max_tokens=60) as stream:  # fmt: skip
            final = stream.get_final_completion()
        choice = final.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        call = choice.message.tool_calls[0]
        assert call.function.name == "get_weather" and isinstance(call.function.parsed_arguments, GetWeather)


def test_a_conversation_with_tool_results(client: openai.OpenAI, server: ServerHandle) -> None:
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, temperature=0, max_tokens=80)  # fmt: skip
    call = (first.choices[0].message.tool_calls or [])[0]
    messages: Any = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18}'},
    ]
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none",
                                            temperature=0, max_tokens=8)  # fmt: skip
    assert second.choices[0].message.content and second.choices[0].finish_reason == "length"
    # The prompt is the template's rendering of the tool turns (the call exactly as generated).
    tokenizer = server.engine.tokenizer
    rendered = tokenizer.apply_chat_template(
        [ASK[0], {"role": "assistant", "content": "", "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": json.loads(call.function.arguments)}}]},
         {"role": "tool", "content": '{"temperature": 18}', "tool_call_id": call.id}],
        True, tools=[{"type": "function", "function": {"name": t["function"]["name"],
                      **({"description": t["function"]["description"]} if "description" in t["function"] else {}),
                      "parameters": SCHEMAS[t["function"]["name"]]}} for t in TOOLS])  # fmt: skip
    assert f'<tool_call>\n{{"name": "{call.function.name}", "arguments": {call.function.arguments}}}\n</tool_call>' in rendered
    assert second.usage is not None and second.usage.prompt_tokens == len(tokenizer.encode(rendered, False))


# -- refusals: a 400 naming the field, before any page is allocated ---------------------------------


def _deep(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


HUGE = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 64} for i in range(1200)}}
JSON_SCHEMA = "response_format.json_schema.schema"
CHAT = "/v1/chat/completions"
REFUSALS: list[tuple[str, str, dict[str, Any], str, str]] = [
    # (case, path, body fields, param, part of the message)
    ("huge schema", CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "h", "schema": HUGE}}},
     JSON_SCHEMA, "at most 65536 are allowed"),
    ("deep schema", CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "d", "schema": _deep(200)}}},
     JSON_SCHEMA, "nests more than 64 levels deep"),
    ("pathological pattern", CHAT, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "p", "schema": {"type": "string", "pattern": "(x{1,100}){1,100}"}}}}, JSON_SCHEMA, "too complex"),
    ("schema that does not compile", CHAT, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "r", "schema": {"$ref": "#/$defs/missing"}}}}, JSON_SCHEMA, "does not compile"),
    ("json_schema missing", CHAT, {"response_format": {"type": "json_schema"}}, "response_format.json_schema",
     "required"),
    ("unknown format type", CHAT, {"response_format": {"type": "yaml"}}, "response_format.type", ""),
    ("regex too complex", "/v1/completions", {"regex": "[a-z]{1000}{1000}"}, "regex", "too complex"),
    ("regex nesting", CHAT, {"regex": "(" * 40 + "a" + ")" * 40}, "regex", "nests groups more than 32 deep"),
    ("regex syntax", "/v1/completions", {"regex": "([a-z"}, "regex", "does not compile"),
    ("regex look-around", CHAT, {"regex": "(?=a)a"}, "regex", "does not compile"),
    ("grammar terminal", CHAT, {"grammar": "start: A\nA: /(ab{1,50}){1,200}/"}, "grammar", "too complex"),
    ("grammar undefined rule", "/v1/completions", {"grammar": 'start: "a" missing_rule'}, "grammar", "missing_rule"),
    ("two constraints", CHAT, {"regex": "a+", "grammar": 'start: "a"'}, "grammar", "only one output constraint"),
    ("constraint and tools", CHAT, {"regex": "a+", "tools": TOOLS, "tool_choice": "required"}, "regex",
     "cannot be combined with tool calls"),
    ("tool_choice without tools", CHAT, {"tool_choice": "required"}, "tool_choice", "only with tools"),
    ("unknown named tool", CHAT, {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name", "no tool is named 'nope'"),
    ("duplicate tool", CHAT, {"tools": [TOOLS[0], TOOLS[0]]}, "tools.1.function.name", "defined twice"),
    ("bad tool name", CHAT, {"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.0.function.name", ""),
    ("parameters not an object", CHAT, {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "string"}}}]}, "tools.0.function.parameters", "type object"),
    ("deep parameters", CHAT, {"tools": [{"type": "function", "function": {"name": "f", "parameters": _deep(100)}}]},
     "tools.0.function.parameters", "nests more than 64 levels deep"),
    ("bad arguments in history", CHAT, {"messages": [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]},
     "messages.0.tool_calls.0.function.arguments", "not valid JSON"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "fields", "param", "message"), [c[1:] for c in REFUSALS], ids=[c[0] for c in REFUSALS])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_bad_constraints_are_a_400_naming_the_field(
    server: ServerHandle, path: str, fields: dict[str, Any], param: str, message: str, stream: bool
) -> None:
    prompt = {"messages": ASK} if path == CHAT else {"prompt": "x"}
    reply = _post(server, path, {"model": MODEL, **prompt, "max_tokens": 8, "stream": stream, **fields})
    assert reply.status_code == 400, reply.text[:300]
    assert reply.headers["content-type"] == "application/json"  # refused before any stream started
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert error["message"].startswith(param) and message in error["message"], error["message"]
    assert server.wait_idle()


def test_requests_beside_hostile_ones_run_to_their_last_token(server: ServerHandle) -> None:
    hostile = [fields for _, _, fields, _, _ in REFUSALS]

    async def run() -> tuple[list[dict[str, Any]], list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            async def normal(i: int) -> dict[str, Any]:
                body = {"model": MODEL, "prompt": f"request {i}", "max_tokens": 32, "ignore_eos": True,
                        "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
                if i % 2:  # half of them constrained, with a valid schema
                    body.update(max_tokens=160, ignore_eos=False, response_format={
                        "type": "json_schema", "json_schema": {"name": "o", "schema": ORDER}})
                texts, usage, finish = [], None, None
                async with http.stream("POST", "/v1/completions", json=body) as reply:
                    async for line in reply.aiter_lines():
                        if line.startswith("data: {"):
                            chunk = json.loads(line[6:])
                            usage = chunk.get("usage") or usage
                            for c in chunk["choices"]:
                                texts.append(c["text"])
                                finish = c["finish_reason"] or finish
                return {"i": i, "text": "".join(texts), "usage": usage, "finish": finish}

            async def bad(fields: dict[str, Any]) -> httpx.Response:
                return await http.post(CHAT, json={"model": MODEL, "messages": ASK, "max_tokens": 8, **fields})

            results = await asyncio.gather(*(normal(i) for i in range(6)), *(bad(f) for f in hostile * 2))
            return list(results[:6]), list(results[6:])  # type: ignore[arg-type]

    normals, refused = asyncio.run(run())
    assert all(r.status_code == 400 for r in refused)
    for r in normals:
        if r["i"] % 2:
            assert r["finish"] == "stop"
            jsonschema.validate(json.loads(r["text"]), ORDER)
        else:
            assert r["finish"] == "length" and r["usage"]["completion_tokens"] == 32
    assert server.wait_idle()


def test_a_body_too_deep_to_parse_is_a_400(server: ServerHandle) -> None:
    deep = '{"a":' * 100_000 + "1" + "}" * 100_000
    head = '{"model": "baton-tiny", "messages": [{"role": "user", "content": "x"}], "response_format": '
    body = head + '{"type": "json_schema", "json_schema": {"name": "x", "schema": ' + deep + "}}}"
    with server.client() as http:
        reply = http.post(CHAT, content=body, headers={"content-type": "application/json"})
    assert reply.status_code == 400 and reply.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(server.url + "/live", timeout=10).status_code == 200


# -- disaggregated (prefill and decode engines apart) and gRPC ---------------------------------------

LONG = "Describe the order in JSON. " * 12  # ~100 tokens: prefilled by the prefill engine


@dataclass(frozen=True, slots=True)
class Served:
    handle: ServerHandle
    grpc_target: str


@pytest.fixture(scope="module")
def pd(tiny_engine_config: EngineConfig) -> Iterator[Served]:
    """Prefill and decode engines apart, in one process, with HTTP and gRPC (stopped with the module)."""
    port = free_port()
    cfg = ServerConfig(engine=tiny_engine_config, grpc_port=port, served_model_name=MODEL, prefill_workers=1)
    handle = start_server(cfg, Engine(tiny_engine_config))
    assert isinstance(handle.running.front, PDFront)
    yield Served(handle, f"127.0.0.1:{port}")
    handle.stop()


@pytest.fixture(scope="module")
def grpc_client(pd: Served) -> Iterator[BatonClient]:
    client = BatonClient(pd.grpc_target, model=MODEL, timeout_s=60)
    yield client
    client.close()


def test_the_constraint_starts_on_the_prefill_side_and_goes_on_at_decode(pd: Served) -> None:
    front = pd.handle.running.front
    assert isinstance(front, PDFront)
    before = front.num_disaggregated
    client = openai.OpenAI(base_url=pd.handle.url + "/v1", api_key="unused", max_retries=0)
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "order", "schema": ORDER}}
    messages: Any = [{"role": "user", "content": LONG}]
    for seed in (1, 2, 3):
        done = client.chat.completions.create(model=MODEL, messages=messages, response_format=fmt, seed=seed,
                                              max_tokens=160)  # fmt: skip
        assert done.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(done.choices[0].message.content or ""), ORDER)
        messages = [{"role": "user", "content": LONG + f" variant {seed} " * 8}]  # a fresh, uncached tail
    assert front.num_disaggregated >= before + 3  # each went prefill -> transfer -> decode
    assert pd.handle.wait_idle()


def test_grpc_constrained_requests(grpc_client: BatonClient) -> None:
    for temperature, seed in ((0.0, None), (1.0, 7)):
        base = Sampling(max_tokens=160, temperature=temperature, seed=seed)
        done = grpc_client.complete("Person:", sampling=replace(base, json_schema=json.dumps(PERSON)))
        assert done.finish_reason == "stop"
        jsonschema.validate(json.loads(done.text), PERSON)
        for rx in REGEXES.values():
            deltas = list(grpc_client.generate(LONG, sampling=replace(base, regex=rx)))
            assert deltas[-1].finish_reason == "stop" and re.fullmatch(rx, "".join(d.text for d in deltas))
        chat = grpc_client.complete(messages=[Message("user", "hi")],
                                    sampling=replace(base, grammar='start: "yes" | "no" | "maybe"'))  # fmt: skip
        assert chat.finish_reason == "stop" and chat.text in ("yes", "no", "maybe")
    cut = grpc_client.complete("JSON:", sampling=Sampling(max_tokens=6, temperature=0.0, json_object=True))
    assert cut.finish_reason == "stop" or len(cut.token_ids) == 6
    assert isinstance(json.loads(cut.text if cut.finish_reason == "stop" else close_json(cut.text)), dict), cut.text


GRPC_TOOLS = tuple(Tool(t["function"]["name"], json.dumps(t["function"].get("parameters", "")) if "parameters" in
                        t["function"] else "", t["function"].get("description", "")) for t in TOOLS)  # fmt: skip


def test_grpc_tool_calls_whole_and_streamed(grpc_client: BatonClient) -> None:
    question = [Message("user", "What is the weather in Paris?")]
    for tools in (Tools(GRPC_TOOLS, "required", parallel=False), Tools(GRPC_TOOLS, "function", "get_weather")):
        sampling = Sampling(max_tokens=80, temperature=1.0, seed=5)
        done = grpc_client.complete(messages=question, tools=tools, sampling=sampling)
        assert done.finish_reason == "tool_calls" and done.text == "" and len(done.tool_calls) == 1
        call = done.tool_calls[0]
        assert call.id.startswith("call_") and (tools.function is None or call.name == tools.function)
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        deltas = list(grpc_client.generate(messages=question, tools=tools, sampling=sampling))
        pieces = [d for delta in deltas for d in delta.tool_calls]
        assert deltas[-1].finish_reason == "tool_calls" and not "".join(d.text for d in deltas)
        assert pieces[0].id and pieces[0].name == call.name and all(not p.id and not p.name for p in pieces[1:])
        assert {p.index for p in pieces} == {0} and "".join(p.arguments for p in pieces) == call.arguments
    # The conversation goes on with the call and its result.
    conversation = [*question, Message("assistant", "", tool_calls=(call,)),
                    Message("tool", '{"temperature": 18}', tool_call_id=call.id)]  # fmt: skip
    after = grpc_client.complete(messages=conversation, tools=Tools(GRPC_TOOLS, "none"),
                                 sampling=Sampling(max_tokens=4, temperature=0.0))  # fmt: skip
    assert after.finish_reason == "length" and after.text and not after.tool_calls


@pytest.mark.parametrize(
    ("sampling", "tools", "field", "message"),
    [
        (Sampling(json_schema=json.dumps(_deep(100))), None, "sampling.json_schema", "nests 201 levels deep"),
        (Sampling(json_schema=json.dumps(HUGE)), None, "sampling.json_schema", "at most 65536"),
        (Sampling(json_schema='{"$ref": "#/$defs/missing"}'), None, "sampling.json_schema", "does not compile"),
        (Sampling(regex="(x{1,100}){1,100}"), None, "sampling.regex", "too complex"),
        (Sampling(regex="([a-z"), None, "sampling.regex", "does not compile"),
        (Sampling(grammar='start: "a" missing_rule'), None, "sampling.grammar", "missing_rule"),
        (Sampling(), Tools((Tool("f", '{"type": "string"}'),), "required"), "tools.0.parameters", "type object"),
        (Sampling(), Tools((Tool("f b"),)), "tools.0.name", "must match"),
        (Sampling(), Tools((Tool("f"), Tool("f"))), "tools.1.name", "defined twice"),
        (Sampling(), Tools((Tool("f"),), "function", "g"), "tool_function", "no tool is named 'g'"),
        (Sampling(regex="a"), Tools((Tool("f"),), "required"), "sampling.regex", "cannot be combined"),
    ],
)
def test_grpc_refuses_bad_constraints_naming_the_field(
    grpc_client: BatonClient, sampling: Sampling, tools: Tools | None, field: str, message: str
) -> None:
    with pytest.raises(BatonClientError) as info:
        grpc_client.complete(messages=[Message("user", "hi")], sampling=replace(sampling, max_tokens=8), tools=tools)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.message.startswith(field) and message in info.value.message, info.value.message
    with pytest.raises(BatonClientError, match="at most one output constraint"):
        grpc_client.complete("x", sampling=Sampling(regex="a", grammar='start: "a"'))


def test_other_servers_constraint_fields_are_refused_not_ignored(server: ServerHandle) -> None:
    for field, ours in [("guided_json", "response_format"), ("guided_regex", "regex"), ("ebnf", "grammar")]:
        reply = _post(server, CHAT, {"model": MODEL, "messages": ASK, field: "x"})
        assert reply.status_code == 400 and ours in reply.json()["error"]["message"]


def test_a_gateway_without_engines_compiles_constraints_itself(tiny_model_dir: Path) -> None:
    # The Ray deployment's gateway holds no engine (RayFront has no `prepare`): it refuses a
    # constraint that does not compile with its own compiler, before anything is placed.
    model = _Model(Tokenizer.from_dir(tiny_model_dir), 512, ModelConfig.from_dir(tiny_model_dir))
    frontend = Frontend(cast(Any, _NoEngines(model)), MODEL)
    good = SamplingParams(constraint=Constraint("regex", "[0-9]{3}"))
    asyncio.run(frontend.prepare_constraint(good, "regex"))
    with pytest.raises(EdgeError) as info:
        asyncio.run(frontend.prepare_constraint(SamplingParams(constraint=Constraint("regex", "([a-z")), "regex"))
    assert info.value.kind == Kind.INVALID_ARGUMENT and info.value.param == "regex"
    assert info.value.message.startswith("regex: the regex does not compile")


@dataclass(frozen=True, slots=True)
class _Model:
    tokenizer: Tokenizer
    max_model_len: int
    model_config: ModelConfig


@dataclass(frozen=True, slots=True)
class _NoEngines:
    engine: _Model
    is_alive: bool = True
    last_stats: None = None
