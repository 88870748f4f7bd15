"""The gRPC API over a real grpc.aio server on loopback, driving a real engine (baton-tiny).

Expected tokens come from a separate, synchronous reference engine on the same weights.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple, cast

import grpc
import pytest
from google.protobuf.descriptor import Descriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from batonpb.baton.v1 import generation_pb2 as pb
from batonpb.baton.v1 import generation_pb2_grpc as pb_grpc
from bench.server_proc import free_port
from cluster.client import AsyncBatonClient, BatonClient, BatonClientError, Message, Sampling
from cluster.edge.admission import AdmissionConfig
from cluster.edge.frontend import Frontend
from cluster.edge.grpc_output import output_spec
from cluster.edge.grpc_server import GrpcConfig, create_grpc_server
from cluster.edge.tenants import ApiKeys, Tenant
from cluster.edge.tool_calls import ToolChoice
from cluster.errors import EdgeError
from engine.async_engine import AsyncEngine
from engine.engine import Engine
from engine.engine_config import EngineConfig
from engine.sampling import SamplingParams
from tests.cluster.conftest import all_pages_free

MODEL = "baton-tiny"
KEY = "k" * 20
KEYS = ApiKeys({KEY: Tenant("t")})
AUTH = (("authorization", f"Bearer {KEY}"),)
PROMPT = "the quick brown fox jumps over the lazy dog"
GREEDY = Sampling(max_tokens=12, temperature=0.0, ignore_eos=True)
LONG = pb.Sampling(max_tokens=400, temperature=0.0, ignore_eos=True)
LONG_SAMPLING = Sampling(max_tokens=400, temperature=0.0, ignore_eos=True)


@dataclass(frozen=True, slots=True)
class Served:
    frontend: Frontend
    target: str

    def client(self, api_key: str | None = KEY) -> AsyncBatonClient:
        return AsyncBatonClient(self.target, model=MODEL, api_key=api_key, timeout_s=30)


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> Engine:
    cfg = EngineConfig(model=str(tiny_model_dir), dtype="float32", max_model_len=512, num_pages=64)
    return Engine(cfg)


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Engine:
    return Engine(EngineConfig(model=str(tiny_model_dir), dtype="float32", max_model_len=512))


@pytest.fixture(scope="module")
async def front(engine: Engine) -> AsyncIterator[AsyncEngine]:
    front = AsyncEngine(engine)
    front.start()
    yield front
    await front.stop()


@contextlib.asynccontextmanager
async def serving(
    front: AsyncEngine, keys: ApiKeys = KEYS, admission: AdmissionConfig | None = None,
    request_timeout_s: float = 30.0, **cfg: object,
) -> AsyncIterator[Served]:
    frontend = Frontend(front, MODEL, admission, request_timeout_s=request_timeout_s)
    port = free_port()
    config = GrpcConfig(port=port, **cfg)  # type: ignore[arg-type]
    server = create_grpc_server(frontend, keys, config)
    await server.start()
    try:
        yield Served(frontend, f"127.0.0.1:{port}")
    finally:
        await server.stop(None)


@pytest.fixture(scope="module")
async def served(front: AsyncEngine) -> AsyncIterator[Served]:
    async with serving(front) as s:
        yield s


@contextlib.asynccontextmanager
async def _stub(target: str) -> AsyncIterator[pb_grpc.GenerationServiceAsyncStub]:
    async with grpc.aio.insecure_channel(target) as channel:
        yield cast("pb_grpc.GenerationServiceAsyncStub", pb_grpc.GenerationServiceStub(channel))


@pytest.fixture
async def stub(served: Served) -> AsyncIterator[pb_grpc.GenerationServiceAsyncStub]:
    async with _stub(served.target) as s:
        yield s


class _Held(NamedTuple):
    gate: threading.Event
    call: asyncio.Future[bool]

    async def release(self) -> None:
        self.gate.set()
        assert await self.call  # the step thread waited at the gate, not past its bound


def _hold_steps(front: AsyncEngine) -> _Held:
    """Stop the step thread, and every request with it, until `release`: a deadline passes
    mid-stream on a machine of any speed (400 tokens took ~7 s here once, 0.8 s later)."""
    gate = threading.Event()
    return _Held(gate, asyncio.ensure_future(front.call(lambda _: gate.wait(60))))


def _expected(reference: Engine, prompt_ids: list[int], params: Sampling = GREEDY) -> list[int]:
    sampling = SamplingParams(max_tokens=params.max_tokens or 16, temperature=0.0, ignore_eos=True)
    return reference.generate([prompt_ids], sampling)[0]


def _outcomes(frontend: Frontend, outcome: str) -> float:
    value = frontend.metrics.registry.get_sample_value(
        "baton_requests_total", {"api": "grpc", "outcome": outcome}
    )
    return value or 0.0


# -- generation ------------------------------------------------------------------------------


async def test_generate_streams_the_engines_greedy_tokens(
    served: Served, reference: Engine
) -> None:
    prompt_ids = reference.tokenizer.encode(PROMPT)
    async with served.client() as client:
        deltas = [d async for d in client.generate(PROMPT, sampling=GREEDY)]
    assert [t for d in deltas for t in d.token_ids] == _expected(reference, prompt_ids)
    assert deltas[0].request_id and all(not d.request_id for d in deltas[1:])
    assert all(d.finish_reason is None and d.usage is None for d in deltas[:-1])
    last = deltas[-1]
    assert last.finish_reason == "length"
    assert last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(prompt_ids), 12)
    text = "".join(d.text for d in deltas)
    assert text == reference.tokenizer.decode(_expected(reference, prompt_ids))


async def test_complete_returns_the_whole_sequence_with_logprobs(
    served: Served, reference: Engine
) -> None:
    prompt_ids = list(range(40, 80))
    async with served.client() as client:
        sampling = Sampling(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
        done = await client.complete(prompt_ids, sampling=sampling)
    assert list(done.token_ids) == _expected(reference, prompt_ids, Sampling(max_tokens=8))
    assert done.request_id and done.finish_reason == "length"
    assert done.usage is not None and done.usage.completion_tokens == 8
    assert len(done.logprobs) == 8
    for token, lp in zip(done.token_ids, done.logprobs, strict=True):
        assert lp.token_id == token and len(lp.top) == 2
        assert lp.top[0][0] == token  # greedy: the sampled token is the most likely one


async def test_logit_bias_forces_a_token_and_bans_the_greedy_ones(served: Served) -> None:
    """Sampling.logit_bias through the Python client: +100 all but forces a token; -100 on the
    greedy tokens bans them."""
    prompt_ids = list(range(40, 80))
    async with served.client() as client:
        greedy = Sampling(max_tokens=6, temperature=0.0, ignore_eos=True)
        free = list((await client.complete(prompt_ids, sampling=greedy)).token_ids)
        forced = await client.complete(prompt_ids, sampling=replace(greedy, logit_bias=((4242, 100.0),)))
        banned = replace(greedy, logit_bias=tuple((t, -100.0) for t in sorted(set(free))))
        other = list((await client.complete(prompt_ids, sampling=banned)).token_ids)
    assert list(forced.token_ids) == [4242] * 6
    assert not set(other) & set(free) and len(other) == 6


async def test_chat_messages_are_rendered_with_the_template(
    served: Served, reference: Engine
) -> None:
    messages = [Message("system", "be brief"), Message("user", "hello")]
    rendered = reference.tokenizer.apply_chat_template(
        [{"role": m.role, "content": m.content} for m in messages], add_generation_prompt=True
    )
    prompt_ids = reference.tokenizer.encode(rendered, add_special_tokens=False)
    async with served.client() as client:
        sampling = Sampling(max_tokens=5, temperature=0.0, ignore_eos=True)
        done = await client.complete(messages=messages, sampling=sampling)
    assert done.usage is not None and done.usage.prompt_tokens == len(prompt_ids)
    assert list(done.token_ids) == _expected(reference, prompt_ids, Sampling(max_tokens=5))


async def test_absent_max_tokens_means_the_rest_of_the_context(served: Served) -> None:
    async with served.client() as client:
        ids = list(range(10, 10 + 500))  # max_model_len is 512: 12 tokens are left
        done = await client.complete(ids, sampling=Sampling(temperature=0.0, ignore_eos=True))
    assert len(done.token_ids) == 12 and done.finish_reason == "length"


async def test_tokenize(served: Served, reference: Engine) -> None:
    async with served.client() as client:
        assert await client.tokenize(PROMPT) == reference.tokenizer.encode(PROMPT)
        plain = await client.tokenize(PROMPT, add_special_tokens=False)
    assert plain == reference.tokenizer.encode(PROMPT, add_special_tokens=False)
    assert len(plain) == len(reference.tokenizer.encode(PROMPT)) - 1  # no BOS


async def test_detokenize_is_tokenizes_inverse_with_special_tokens_kept(served: Served, reference: Engine) -> None:
    async with served.client() as client:
        plain = await client.detokenize(await client.tokenize(PROMPT, add_special_tokens=False))
        with_bos = await client.detokenize(await client.tokenize(PROMPT))
        with pytest.raises(BatonClientError) as beyond:
            await client.detokenize([1, reference.model_config.vocab_size])
    assert plain == PROMPT
    assert with_bos == reference.tokenizer.decode(reference.tokenizer.encode(PROMPT), skip_special_tokens=False)
    assert with_bos != PROMPT and with_bos.endswith(PROMPT)
    assert beyond.value.code == grpc.StatusCode.INVALID_ARGUMENT and beyond.value.message.startswith("token_ids:")
    async with AsyncBatonClient(served.target, model="gpt-9", api_key=KEY) as other:
        with pytest.raises(BatonClientError) as missing:
            await other.detokenize([1])
    assert missing.value.code == grpc.StatusCode.NOT_FOUND


# -- deadlines and cancellation --------------------------------------------------------------


async def test_call_deadline_aborts_the_request_and_frees_its_pages(
    served: Served, front: AsyncEngine, engine: Engine, stub: pb_grpc.GenerationServiceAsyncStub
) -> None:
    before = _outcomes(served.frontend, "deadline") + _outcomes(served.frontend, "cancelled")
    request = pb.GenerateRequest(model=MODEL, text=PROMPT, sampling=LONG)
    call = stub.Generate(request, metadata=AUTH, timeout=1.0)
    received = 0
    held: _Held | None = None
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in call:
            received += 1
            held = held or _hold_steps(front)  # generating, and stopped there until the deadline passed
    assert held is not None
    await held.release()
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert 0 < received < 400
    assert await all_pages_free(engine)
    after = _outcomes(served.frontend, "deadline") + _outcomes(served.frontend, "cancelled")
    assert after == before + 1  # the server-side stream ended early, not by finishing


async def test_server_timeout_is_deadline_exceeded(front: AsyncEngine, engine: Engine) -> None:
    async with serving(front, request_timeout_s=0.5) as s, s.client() as client:
        held: _Held | None = None
        with pytest.raises(BatonClientError) as caught:
            async for _ in client.generate(PROMPT, sampling=LONG_SAMPLING):
                held = held or _hold_steps(front)  # stopped mid-stream until the server's deadline passed
        assert held is not None
        await held.release()
        assert caught.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "deadline" in caught.value.message.lower()  # ours, or grpc's "Deadline Exceeded" under load
        # The client can see the status before the server's stream has closed and counted it.
        for _ in range(100):
            if _outcomes(s.frontend, "deadline"):
                break
            await asyncio.sleep(0.05)
        assert _outcomes(s.frontend, "deadline") == 1, s.frontend.metrics.outcomes()
    assert await all_pages_free(engine)


async def test_client_cancellation_mid_stream_frees_pages(
    served: Served, engine: Engine, stub: pb_grpc.GenerationServiceAsyncStub
) -> None:
    call = stub.Generate(pb.GenerateRequest(model=MODEL, text=PROMPT, sampling=LONG), metadata=AUTH)
    received = 0
    async for _ in call:
        received += 1
        if received == 3:
            break
    assert engine.pool.pages.num_free < engine.pool.num_pages  # it holds pages while running
    call.cancel()
    assert await all_pages_free(engine)
    assert served.frontend.admission.num_inflight == 0


async def test_many_streams_cancelled_at_different_points_free_every_page(
    served: Served, engine: Engine, stub: pb_grpc.GenerationServiceAsyncStub
) -> None:
    async def cancel_after(messages: int) -> int:
        request = pb.GenerateRequest(model=MODEL, text=PROMPT, sampling=LONG)
        call = stub.Generate(request, metadata=AUTH)
        seen = 0
        async for _ in call:
            seen += 1
            if seen == messages:
                break
        call.cancel()
        return seen

    seen = await asyncio.gather(*(cancel_after(1 + i % 5) for i in range(16)))
    assert seen == [1 + i % 5 for i in range(16)]
    assert await all_pages_free(engine)
    assert served.frontend.admission.num_inflight == 0


# -- refusals --------------------------------------------------------------------------------


def _message(role: str) -> pb.ChatMessage:
    return pb.ChatMessage(role=role, content="x")


def _sampled(**fields: Any) -> pb.GenerateRequest:
    return pb.GenerateRequest(model=MODEL, text="hi", sampling=pb.Sampling(**fields))


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (_sampled(temperature=5.0), "temperature"),
        (_sampled(top_p=0.0), "top_p"),
        (_sampled(max_tokens=0), "max_tokens"),
        (_sampled(max_tokens=600), "max_tokens"),  # past the 512-token context
        (_sampled(logprobs=21), "logprobs"),
        (_sampled(stop=["x"] * 17), "stop"),
        (_sampled(max_tokens=2, min_tokens=3), "min_tokens"),
        (_sampled(top_k=10**5), "top_k"),
        (_sampled(seed=2**63), "seed"),
        (_sampled(logit_bias={5: 100.5}), "logit_bias"),
        (_sampled(logit_bias={16_384: 1.0}), "logit_bias"),  # past the vocabulary
        (_sampled(logit_bias={i: 1.0 for i in range(301)}), "logit_bias"),
        (pb.GenerateRequest(model=MODEL, token_ids=pb.TokenIds(ids=[1, 10**6])), "prompt"),
        (pb.GenerateRequest(model=MODEL, token_ids=pb.TokenIds(ids=[1] * 512)), "prompt"),
        (pb.GenerateRequest(model=MODEL), "prompt"),
        (pb.GenerateRequest(model=MODEL, chat=True, messages=[_message("root")]), "messages.role"),
        (pb.GenerateRequest(model=MODEL, text="hi", messages=[_message("user")]), "messages"),
        (pb.GenerateRequest(model="", text="hi"), "model"),
    ],
)
async def test_bad_fields_are_invalid_argument_naming_the_field(
    served: Served, stub: pb_grpc.GenerationServiceAsyncStub, request_: pb.GenerateRequest, field: str
) -> None:
    for call, request in ((stub.Complete, _as_complete(request_)), (stub.Generate, request_)):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await _finish(call(request, metadata=AUTH))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (caught.value.details() or "").startswith(f"{field}:"), caught.value.details()
    assert served.frontend.admission.num_inflight == 0


def _as_complete(request: pb.GenerateRequest) -> pb.CompleteRequest:
    return pb.CompleteRequest.FromString(request.SerializeToString())  # wire-identical


async def _finish(call: Any) -> None:
    if hasattr(call, "__aiter__"):
        async for _ in call:
            pass
    else:
        await call


async def test_unknown_model_is_not_found(served: Served) -> None:
    async with AsyncBatonClient(served.target, model="gpt-9", api_key=KEY) as client:
        with pytest.raises(BatonClientError) as caught:
            await client.complete("hi")
    assert caught.value.code == grpc.StatusCode.NOT_FOUND and "gpt-9" in caught.value.message


async def test_overload_is_resource_exhausted_with_retry_metadata(
    front: AsyncEngine, engine: Engine
) -> None:
    admission = AdmissionConfig(max_inflight_requests=1, retry_after_s=2.5)
    async with serving(front, admission=admission) as s, _stub(s.target) as stub:
        request = pb.GenerateRequest(model=MODEL, text=PROMPT, sampling=LONG)
        holder = stub.Generate(request, metadata=AUTH)
        await holder.read()  # admitted and generating: the one in-flight slot is taken
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Complete(pb.CompleteRequest(model=MODEL, text="hi"), metadata=AUTH)
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        trailing = dict(caught.value.trailing_metadata() or ())
        assert trailing["grpc-retry-pushback-ms"] == "2500" and trailing["retry-after"] == "3"
        async with s.client() as client:
            with pytest.raises(BatonClientError) as typed:
                await client.complete("hi")
        assert typed.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert typed.value.retry_after_s == 2.5
        holder.cancel()
    assert await all_pages_free(engine)


async def test_api_key_is_required_when_keys_are_set(served: Served) -> None:
    for key in (None, "wrong-key-of-twenty-chars"):
        async with served.client(api_key=key) as client:
            with pytest.raises(BatonClientError) as caught:
                await client.tokenize("hi")
            assert caught.value.code == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(BatonClientError) as caught:
                await client.complete("hi")
            assert caught.value.code == grpc.StatusCode.UNAUTHENTICATED
    async with _stub(served.target) as stub:
        request = pb.TokenizeRequest(model=MODEL, text="hi")
        reply = await stub.Tokenize(request, metadata=(("x-api-key", KEY),))
    assert reply.token_ids and reply.max_model_len == 512


# -- health, reflection, clients --------------------------------------------------------------


async def test_health_is_open_and_follows_drain(served: Served) -> None:
    serving_ = health_pb2.HealthCheckResponse.SERVING
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    async with grpc.aio.insecure_channel(served.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "baton.v1.GenerationService"):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=service))  # no key
            assert reply.status == serving_
        for unknown in ("nope", "baton.v1.Generation"):  # the legacy name has no status of its own
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await health.Check(health_pb2.HealthCheckRequest(service=unknown))
            assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        served.frontend.draining = True
        try:
            assert (await health.Check(health_pb2.HealthCheckRequest())).status == not_serving
            async with served.client() as client:
                with pytest.raises(BatonClientError) as refused:
                    await client.complete("hi")
            assert refused.value.code == grpc.StatusCode.UNAVAILABLE
        finally:
            served.frontend.draining = False
        assert (await health.Check(health_pb2.HealthCheckRequest())).status == serving_


async def test_reflection_lists_the_service_without_a_key(served: Served) -> None:
    async with grpc.aio.insecure_channel(served.target) as channel:
        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        ask = reflection_pb2.ServerReflectionRequest(list_services="")
        call = refl.ServerReflectionInfo(iter([ask]))
        replies = [r async for r in call]
    names = {s.name for s in replies[0].list_services_response.service}
    assert {"baton.v1.GenerationService", "grpc.health.v1.Health"} <= names
    assert "baton.v1.Generation" not in names  # the deprecated name is served, not advertised


# -- the contract: names and wire compatibility (issue 24) -------------------------------------


def _fields(message: Descriptor) -> list[tuple[object, ...]]:
    return [
        (f.name, f.number, f.type, f.is_repeated, f.has_presence,
         f.containing_oneof.name if f.containing_oneof else None,
         f.message_type.full_name if f.message_type else None,
         f.enum_type.full_name if f.enum_type else None)
        for f in message.fields
    ]  # fmt: skip


def test_complete_request_has_exactly_generate_requests_fields() -> None:
    """The server parses Complete's CompleteRequest as a GenerateRequest: a field added to one
    must be added to the other, with the same name, number, type and oneof."""
    assert _fields(pb.CompleteRequest.DESCRIPTOR) == _fields(pb.GenerateRequest.DESCRIPTOR)
    full = pb.GenerateRequest(
        model=MODEL, chat=True, messages=[_message("user")], priority=-3, tools=[pb.Tool(name="f")],
        tool_choice=pb.TOOL_CHOICE_FUNCTION, tool_function="f", parallel_tool_calls=False,
        sampling=pb.Sampling(max_tokens=3, regex="a+", logit_bias={5: 1.0}),
    )  # fmt: skip
    as_complete = pb.CompleteRequest.FromString(full.SerializeToString())
    assert pb.GenerateRequest.FromString(as_complete.SerializeToString()) == full


def test_unset_and_explicit_auto_tool_choice_mean_auto() -> None:
    """TOOL_CHOICE_UNSPECIFIED (0: what clients from before issue 24 send for their AUTO) and
    TOOL_CHOICE_AUTO (4) are both auto; a value the enum does not have is refused."""

    def choice(value: int) -> ToolChoice:
        request = pb.GenerateRequest(model=MODEL, chat=True, messages=[_message("user")],
                                     tools=[pb.Tool(name="f")], tool_choice=value)  # fmt: skip
        spec = output_spec(request)
        assert spec.tools is not None
        return spec.tools.choice

    assert pb.TOOL_CHOICE_UNSPECIFIED == 0 and pb.TOOL_CHOICE_AUTO == 4
    assert choice(pb.TOOL_CHOICE_UNSPECIFIED) == choice(pb.TOOL_CHOICE_AUTO) == ToolChoice.AUTO
    assert choice(pb.TOOL_CHOICE_REQUIRED) == ToolChoice.REQUIRED
    with pytest.raises(EdgeError, match="tool_choice"):
        choice(5)


async def test_the_legacy_service_name_serves_clients_built_on_it(
    served: Served, reference: Engine
) -> None:
    """A client of `baton.v1.Generation` (before issue 24) keeps working: the same three
    methods and checks, its Complete sending a GenerateRequest, the same tokens."""
    sampling = pb.Sampling(max_tokens=12, temperature=0.0, ignore_eos=True)  # GREEDY's
    request = pb.GenerateRequest(model=MODEL, text=PROMPT, sampling=sampling)
    path = "/baton.v1.Generation/"
    async with grpc.aio.insecure_channel(served.target) as channel:
        generate = channel.unary_stream(
            path + "Generate", pb.GenerateRequest.SerializeToString, pb.GenerateResponse.FromString
        )
        complete = channel.unary_unary(
            path + "Complete", pb.GenerateRequest.SerializeToString, pb.CompleteResponse.FromString
        )
        tokenize = channel.unary_unary(
            path + "Tokenize", pb.TokenizeRequest.SerializeToString, pb.TokenizeResponse.FromString
        )
        streamed = [t async for msg in generate(request, metadata=AUTH) for t in msg.token_ids]
        done = await complete(request, metadata=AUTH)
        ids = await tokenize(pb.TokenizeRequest(model=MODEL, text=PROMPT), metadata=AUTH)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await complete(request)  # no key
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    expected = _expected(reference, reference.tokenizer.encode(PROMPT))
    assert streamed == list(done.token_ids) == expected
    assert list(ids.token_ids) == reference.tokenizer.encode(PROMPT)


def _sync_session(target: str) -> tuple[list[int], list[int], str, list[int]]:
    with BatonClient(target, model=MODEL, api_key=KEY, timeout_s=30) as client:
        streamed = [t for d in client.generate(PROMPT, sampling=GREEDY) for t in d.token_ids]
        done = client.complete(PROMPT, sampling=GREEDY)
        try:
            client.complete(PROMPT, sampling=Sampling(top_k=10**5))
        except BatonClientError as exc:
            error = f"{exc.code.name} {exc.message}"
        return streamed, list(done.token_ids), error, client.tokenize(PROMPT)


async def test_sync_client(served: Served, reference: Engine) -> None:
    streamed, completed, error, ids = await asyncio.to_thread(_sync_session, served.target)
    expected = _expected(reference, reference.tokenizer.encode(PROMPT))
    assert streamed == completed == expected
    assert error.startswith("INVALID_ARGUMENT top_k:")
    assert ids == reference.tokenizer.encode(PROMPT)


async def test_async_client_leaving_a_stream_early_cancels_it(
    served: Served, engine: Engine
) -> None:
    async with served.client() as client:
        async with contextlib.aclosing(client.generate(PROMPT, sampling=LONG_SAMPLING)) as deltas:
            async for delta in deltas:
                assert delta.request_id
                break
        assert await all_pages_free(engine)


# -- TLS --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    import shutil
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    directory = tmp_path_factory.mktemp("tls")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True, capture_output=True, timeout=60,
    )
    yield cert, key


async def test_tls(front: AsyncEngine, certificate: tuple[Path, Path]) -> None:
    cert, key = certificate
    async with serving(front, tls_cert_file=str(cert), tls_key_file=str(key)) as s:
        root = cert.read_bytes()
        trusted = AsyncBatonClient(s.target, model=MODEL, api_key=KEY, root_certificates=root)
        async with trusted as client:
            assert await client.tokenize("hi")
        async with AsyncBatonClient(s.target, model=MODEL, api_key=KEY, timeout_s=5) as plain:
            with pytest.raises(BatonClientError) as caught:
                await plain.tokenize("hi")  # a plaintext client cannot talk to a TLS port
        assert caught.value.code == grpc.StatusCode.UNAVAILABLE

