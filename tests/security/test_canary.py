"""A pickle canary sent to every listener and planted on every disk path runs nothing.

The canary (conftest.canary) is a pickle whose loading creates a file; the fixture proves it
fires when unpickled. Each listener gets it raw, in every framing it could be taken for, and
must refuse it clearly (a status, a codec error, a counter), never create the file, and still
serve a good request afterwards:

    HTTP             every route, as a JSON, octet-stream and pickle body, with and without a key
    gRPC             every method of the gateway (GenerationService, under its deprecated name
                     too, health, reflection), as raw bytes
    KV transfer      Push and PushShm of a real decode worker's KV server, raw and framed
    membership       a WorkerInfo value in etcd under the cluster prefix (and a deeply nested
                     one): counted as bad values, the watch goes on
    disk tier        a segment file of it, and a well-formed record carrying it as its payload
    checkpoints      pytorch_model.bin / model.safetensors made of it
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aetcd  # type: ignore[import-untyped]
import grpc
import httpx
import pytest
import torch
from fastapi.routing import APIRoute
from grpc_health.v1 import health_pb2
from starlette.routing import Route

from batonpb.baton.kv.v1 import kvtransfer_pb2 as pb
from batonpb.baton.v1 import generation_pb2 as gen_pb
from cluster.membership.etcd import EtcdConfig, EtcdMembership
from cluster.membership.protocol import Role, WorkerInfo
from decode.worker import DecodeWorker
from engine.config import ModelConfig
from engine.engine import Engine
from engine.engine_config import EngineConfig
from engine.errors import CheckpointError
from engine.job import Job
from engine.loader import load_state_dict
from kvcache.disk import DiskTier
from kvcache.disk_record import encode_record
from kvtransfer.codec import (
    HEADER_FIELD,
    PAYLOAD_FIELD,
    ChunkMeta,
    encode_chunk,
    field_prefix,
    frame,
)
from kvtransfer.grpc_transport import PUSH, GrpcSender, start_kv_server
from kvtransfer.shm import PUSH_SHM, ShmRegion, shm_handler
from kvtransfer.transport import KVDestination, build_chunks
from tests.etcd_server import EtcdServer
from tests.security.conftest import ALPHA_KEY, MODEL, OPEN_PATHS, ROOT, Canary, Guarded, bearer

pytestmark = pytest.mark.timeout(120)

BODY_TYPES = ("application/json", "application/octet-stream", "application/python-pickle")
GOOD = {"model": MODEL, "prompt": "hello", "max_tokens": 2, "temperature": 0}


def _routes(guarded: Guarded) -> list[tuple[str, str]]:
    app = guarded.server.running.http.config.app
    out = []
    for route in app.routes:
        if isinstance(route, APIRoute | Route) and route.methods:
            out += [(method, route.path) for method in sorted(route.methods) if method != "HEAD"]
    assert ("POST", "/v1/completions") in out and ("GET", "/metrics") in out
    return out


def _assert_serves(guarded: Guarded) -> None:
    reply = httpx.post(guarded.url + "/v1/completions", json=GOOD, headers=bearer(ALPHA_KEY), timeout=30)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2


# -- HTTP ----------------------------------------------------------------------------------------


def test_http_refuses_the_canary_on_every_route(guarded: Guarded, canary: Canary) -> None:
    seen: dict[tuple[str, str, bool], int] = {}
    with httpx.Client(base_url=guarded.url, timeout=30) as client:
        for method, path in _routes(guarded):
            for content_type in BODY_TYPES:
                for with_key in (False, True):
                    if with_key and path.startswith("/admin/"):
                        continue  # an operator action (drain) that reads no body: not this test's
                    headers = {"Content-Type": content_type, **(bearer(ALPHA_KEY) if with_key else {})}
                    reply = client.request(method, path, content=canary.payload, headers=headers)
                    seen[(method, path, with_key)] = reply.status_code
                    if not with_key and path not in OPEN_PATHS:
                        assert reply.status_code == 401, (method, path, content_type)
                    elif method == "POST":  # every POST route with a body refuses it as input
                        assert reply.status_code in (400, 413, 415, 422), (method, path, content_type, reply.text)
                        assert reply.json()["error"]["type"] == "invalid_request_error"
                    else:  # GET routes read no body: they answer as usual
                        assert reply.status_code < 500, (method, path, reply.status_code)
    assert not canary.fired
    assert seen[("POST", "/v1/completions", True)] == 400
    _assert_serves(guarded)


# -- gRPC (the gateway) --------------------------------------------------------------------------


def grpc_methods() -> list[tuple[str, str]]:
    """(path, kind) of every method the gateway's gRPC server hosts."""
    out = []
    generation = gen_pb.DESCRIPTOR.services_by_name["GenerationService"]
    services = ((generation.full_name, generation), ("baton.v1.Generation", generation),  # deprecated name
                ("grpc.health.v1.Health", health_pb2.DESCRIPTOR.services_by_name["Health"]))  # fmt: skip
    for name, service in services:
        for m in service.methods:
            kind = ("stream" if m.client_streaming else "unary") + "_" + ("stream" if m.server_streaming else "unary")
            out.append((f"/{name}/{m.name}", kind))
    out.append(("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", "stream_stream"))
    assert ("/baton.v1.GenerationService/Generate", "unary_stream") in out
    assert ("/baton.v1.Generation/Generate", "unary_stream") in out
    return out


def raw_call(
    channel: grpc.Channel, path: str, kind: str, payload: bytes, metadata: tuple[tuple[str, str], ...] = ()
) -> tuple[grpc.StatusCode, str]:
    """Send `payload` as the request message, unserialized; the call's status and details."""
    stub = getattr(channel, kind)(path)  # no serializers: the bytes go out as they are
    try:
        if kind == "unary_unary":
            stub(payload, metadata=metadata, timeout=10)
        elif kind == "unary_stream":
            list(stub(payload, metadata=metadata, timeout=10))
        else:
            list(stub(iter([payload]), metadata=metadata, timeout=5))
    except grpc.RpcError as err:
        return err.code(), err.details() or ""  # type: ignore[attr-defined]
    return grpc.StatusCode.OK, ""


def test_grpc_refuses_the_canary_on_every_method(guarded: Guarded, canary: Canary) -> None:
    with grpc.insecure_channel(guarded.grpc_target) as channel:
        for path, kind in grpc_methods():
            for metadata in ((), (("authorization", f"Bearer {ALPHA_KEY}"),)):
                code, details = raw_call(channel, path, kind, canary.payload, metadata)
                # refused by grpc's message parser before any handler runs (UNKNOWN: the
                # status grpc.aio gives a deserializer's exception; see test_auth for what
                # its details say), by the handler's checks, or not implemented
                assert code in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INVALID_ARGUMENT,
                                grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNIMPLEMENTED), (path, code)  # fmt: skip
                assert "Traceback" not in details and str(ROOT) not in details
        generate = channel.unary_unary(
            "/baton.v1.GenerationService/Complete", request_serializer=gen_pb.CompleteRequest.SerializeToString,
            response_deserializer=gen_pb.CompleteResponse.FromString,
        )  # fmt: skip
        good = gen_pb.CompleteRequest(model=MODEL, text="hello", sampling=gen_pb.Sampling(max_tokens=2, temperature=0))
        reply = generate(good, metadata=(("x-api-key", ALPHA_KEY),), timeout=30)
    assert len(reply.token_ids) == 2
    assert not canary.fired


# -- the KV transfer server ----------------------------------------------------------------------

PROMPT = tuple(range(100, 180))  # 80 tokens: 5 pages of 16


@pytest.fixture(scope="module")
def decode_engine(tiny_model_dir: Path) -> Engine:
    return Engine(EngineConfig(model=str(tiny_model_dir), dtype="float32", num_pages=32, max_model_len=256))


@pytest.fixture
async def kv_server(decode_engine: Engine) -> AsyncIterator[tuple[DecodeWorker, str]]:
    worker = DecodeWorker(decode_engine)
    region = ShmRegion(num_slots=2, slot_bytes=1 << 20)
    server, port = await start_kv_server(worker.receiver, "127.0.0.1:0", extra_handlers=[shm_handler(worker.receiver, region)])
    worker.address = f"127.0.0.1:{port}"
    try:
        yield worker, worker.address
    finally:
        await server.stop(None)
        region.close()
        for dest in list(worker._dests.values()):
            worker.cancel(dest)
        assert decode_engine.free_pages_at_idle() == decode_engine.pool.num_pages


def _kv_pages(worker: DecodeWorker, n: int, data: bytes = b"") -> torch.Tensor:
    """n pages of this worker's shape: `data` (zero-padded) reinterpreted as float32, or randn."""
    lay = worker.engine.pool.layout
    shape = (n, lay.num_layers, 2, lay.page_size, lay.num_kv_heads, lay.head_dim)
    numel = n * lay.num_layers * 2 * lay.page_size * lay.num_kv_heads * lay.head_dim
    if not data:
        return torch.randn(shape, generator=torch.Generator().manual_seed(0))
    raw = bytearray(numel * 4)
    raw[: len(data)] = data
    return torch.frombuffer(raw, dtype=torch.float32).reshape(shape).clone()


async def _push_raw(address: str, messages: list[bytes]) -> pb.PushResponse:
    async with grpc.aio.insecure_channel(address) as channel:
        push = channel.stream_unary(PUSH, request_serializer=None, response_deserializer=pb.PushResponse.FromString)
        ack: pb.PushResponse = await push(iter(messages), timeout=10)
        return ack


async def test_kv_push_refuses_the_canary_raw_and_framed(kv_server: tuple[DecodeWorker, str], canary: Canary) -> None:
    worker, address = kv_server
    dest = worker.reserve(Job("canary", PROMPT, _sampling()), sender_epoch=3)
    assert dest is not None
    forged = encode_chunk(ChunkMeta(dest.req_id, dest.transfer_id, b"\x00" * 16, 3, dest.dest_page_ids),
                          _kv_pages(worker, 5, canary.payload))  # fmt: skip
    head = forged.header.SerializeToString()
    attempts = {
        "raw": [canary.payload],
        "as header": [field_prefix(HEADER_FIELD, len(canary.payload)) + canary.payload],
        "as payload, wrong token": [frame(forged)],
        "after a header": [field_prefix(HEADER_FIELD, len(head)) + head + canary.payload],
        "as the payload field": [field_prefix(HEADER_FIELD, len(head)) + head
                                 + field_prefix(PAYLOAD_FIELD, len(canary.payload)) + canary.payload],
    }
    for name, messages in attempts.items():
        ack = await _push_raw(address, messages)
        assert not ack.accepted and ack.error, name
    assert worker.book.get(dest.transfer_id) is not None  # a forged push cancels nothing
    assert worker.book.refused_bad_token == 1
    # the token holder may send any bytes: they land as float32 bits, never as objects
    pages = _kv_pages(worker, 5, canary.payload)
    result = await GrpcSender().send(dest, build_chunks(dest, pages, 3), 10.0)
    assert result.accepted, result.error
    landed = worker.engine.pool.kv[:, :, list(dest.dest_page_ids)].permute(2, 0, 1, 3, 4, 5)
    assert landed.contiguous().numpy().tobytes()[: len(canary.payload)] == canary.payload
    worker.cancel(dest)
    assert not canary.fired


async def test_kv_push_shm_refuses_the_canary(kv_server: tuple[DecodeWorker, str], canary: Canary) -> None:
    worker, address = kv_server
    dest = worker.reserve(Job("canary-shm", PROMPT, _sampling()), sender_epoch=3)
    assert dest is not None
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.stream_stream(PUSH_SHM, request_serializer=None, response_deserializer=pb.PushShmResponse.FromString)(timeout=10)
        await call.write(canary.payload)  # as the stream's open: refused before any slot is granted
        await call.done_writing()
        replies = []
        while (reply := await call.read()) is not grpc.aio.EOF:
            replies.append(reply)
    assert len(replies) == 1 and not replies[0].free_offsets  # no grant, only the refusal
    assert not replies[-1].ack.accepted and replies[-1].ack.error == "malformed header"
    assert worker.book.get(dest.transfer_id) is not None
    await _good_push(worker, dest)
    assert not canary.fired


async def _good_push(worker: DecodeWorker, dest: KVDestination) -> None:
    sender = GrpcSender()
    try:
        result = await sender.send(dest, build_chunks(dest, _kv_pages(worker, len(dest.dest_page_ids)), dest.epoch), 10.0)
    finally:
        await sender.close()
    assert result.accepted, result.error
    worker.cancel(dest)


def _sampling() -> object:
    from engine.sampling import SamplingParams

    return SamplingParams(max_tokens=2, temperature=0.0)


# -- membership (a real etcd) --------------------------------------------------------------------


async def _wait(predicate: object, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(0.05)


async def test_membership_counts_the_canary_as_a_bad_value_and_keeps_watching(etcd: EtcdServer, canary: Canary) -> None:
    cfg = EtcdConfig(port=etcd.port, cluster="security-canary", lease_ttl_s=2, request_timeout_s=2.0, retry_s=0.1)
    raw = aetcd.Client("127.0.0.1", etcd.port, timeout=2)
    scheduler = await EtcdMembership.open(cfg)
    late: EtcdMembership | None = None
    try:
        # When the canary, and a value nested deeper than json.loads can recurse, appear
        # under the cluster's prefix
        await raw.put(cfg.prefix + b"evil", canary.payload)
        await raw.put(cfg.prefix + b"deep", b"[" * 16_000)
        # Then the watcher counts both as bad values and keeps going: a real join is seen
        await _wait(lambda: scheduler.stats().num_bad_values == 2, "two bad values counted")
        node = await EtcdMembership.open(cfg)
        try:
            info = WorkerInfo("d-0", Role.DECODE, "d-0.actor", "node-a", "127.0.0.1:7000", 0, 64, 16, 8)
            epoch = await node.register(info)
            await _wait(lambda: "d-0" in scheduler.members(), "the real worker joined the view")
            assert scheduler.members()["d-0"] == info.with_epoch(epoch) and set(scheduler.members()) == {"d-0"}
            # and a view listed now skips them the same way
            late = await EtcdMembership.open(cfg)
            assert set(late.members()) == {"d-0"} and late.stats().num_bad_values == 2
        finally:
            await node.close()
    finally:
        if late is not None:
            await late.close()
        await scheduler.close()
        await raw.delete_prefix(cfg.prefix)
        await raw.close()
    assert not canary.fired


# -- disk ----------------------------------------------------------------------------------------

FINGERPRINT = bytes(range(16))
SHAPE = (2, 2, 4, 1, 8)  # 128 float32 = 512 bytes a page: room for the canary


def test_disk_tier_never_unpickles_a_planted_segment(tmp_path: Path, canary: Canary) -> None:
    assert len(canary.payload) <= 512
    padded = canary.payload + bytes(512 - len(canary.payload))
    page = torch.frombuffer(bytearray(padded), dtype=torch.float32).reshape(SHAPE).clone()
    (tmp_path / "seg-00000001.bkv").write_bytes(canary.payload)  # raw: not a record
    (tmp_path / "seg-00000002.bkv").write_bytes(encode_record(FINGERPRINT, b"\x05" * 16, page))
    (tmp_path / "model.pkl").write_bytes(canary.payload)  # not a segment name: never read
    tier = DiskTier(tmp_path, FINGERPRINT, SHAPE, torch.float32, capacity_pages=4)
    try:
        assert tier.hashes() == [b"\x05" * 16]  # the well-formed record, as bytes
        got = tier.get(b"\x05" * 16)
        assert got is not None and got.numpy().tobytes() == padded
        tier.check_integrity()
    finally:
        tier.close()
    assert not canary.fired


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.safetensors", "model.pt"])
def test_a_pickle_checkpoint_is_refused_unread(tiny_model_dir: Path, tmp_path: Path, canary: Canary, name: str) -> None:
    shutil.copy(tiny_model_dir / "config.json", tmp_path / "config.json")
    (tmp_path / name).write_bytes(canary.payload)
    with pytest.raises(CheckpointError) as caught:
        load_state_dict(tmp_path, ModelConfig.from_dir(tmp_path), torch.float32)
    assert "safetensors" in str(caught.value)
    assert not canary.fired
