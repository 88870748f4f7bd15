"""The gRPC server: `baton.v1.GenerationService` (cluster.edge.grpc_api) under its name and its
deprecated one, `grpc.health.v1` and reflection, on one grpc.aio server bound to the
configured address (TLS when a certificate is set).

Health (`grpc.health.v1`, SERVING while the step loop is live and the frontend not draining)
and reflection need no key.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from batonpb.baton.v1 import generation_pb2 as pb
from cluster.edge.frontend import Frontend
from cluster.edge.grpc_api import LEGACY_SERVICE_NAME, SERVICE, SERVICE_NAME, GenerationService
from cluster.edge.grpc_fields import tolerant
from cluster.edge.tenants import ApiKeys
from engine.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class GrpcConfig:
    host: str = "127.0.0.1"
    port: int = 50051  # 0: any free port (logged)
    max_receive_message_bytes: int = 8 << 20  # bounds every request before it is parsed
    max_send_message_bytes: int = 64 << 20  # a Complete reply with logprobs of a long context
    tls_cert_file: str | None = None  # PEM; both or neither
    tls_key_file: str | None = None
    allow_priority_field: bool = False  # let callers set `priority` (else it comes from the key)

    def __post_init__(self) -> None:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ConfigError("grpc.tls", "set both tls_cert_file and tls_key_file, or neither")
        if not 0 <= self.port <= 65535:
            raise ConfigError("grpc.port", f"must be in [0, 65535], got {self.port}")
        for name in ("max_receive_message_bytes", "max_send_message_bytes"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"grpc.{name}", "must be positive")


def create_grpc_server(frontend: Frontend, keys: ApiKeys, cfg: GrpcConfig) -> grpc.aio.Server:
    """A server with GenerationService (and its legacy name), health and reflection bound to
    cfg's address (not started)."""
    server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", cfg.max_receive_message_bytes),
        ("grpc.max_send_message_length", cfg.max_send_message_bytes),
        # gRPC sets SO_REUSEPORT by default: a second server on the same port would silently
        # take half the connections instead of failing to start.
        ("grpc.so_reuseport", 0),
    ])
    _add_generation(frontend, keys, cfg, server)
    health_pb2_grpc.add_HealthServicer_to_server(LiveHealth(frontend, ("", SERVICE_NAME)), server)
    health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
    names = (SERVICE_NAME, health_name, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    address = f"{cfg.host}:{cfg.port}"
    if cfg.tls_cert_file is not None and cfg.tls_key_file is not None:
        pair = (Path(cfg.tls_key_file).read_bytes(), Path(cfg.tls_cert_file).read_bytes())
        port = server.add_secure_port(address, grpc.ssl_server_credentials([pair]))
    else:
        port = server.add_insecure_port(address)
    logger.info("gRPC API on %s:%d (%s)", cfg.host, port, "TLS" if cfg.tls_cert_file else "no TLS")
    return server


def _add_generation(
    frontend: Frontend, keys: ApiKeys, cfg: GrpcConfig, server: grpc.aio.Server
) -> None:
    """The generated add_GenerationServiceServicer_to_server, with tolerant request parsing,
    and the same methods under LEGACY_SERVICE_NAME (a trace names the path that was called)."""
    current = _handlers(GenerationService(frontend, keys, cfg.allow_priority_field, SERVICE_NAME))
    legacy = _handlers(GenerationService(frontend, keys, cfg.allow_priority_field, LEGACY_SERVICE_NAME))
    server.add_generic_rpc_handlers((
        grpc.method_handlers_generic_handler(SERVICE_NAME, current),
        grpc.method_handlers_generic_handler(LEGACY_SERVICE_NAME, legacy),
    ))  # fmt: skip
    server.add_registered_method_handlers(SERVICE_NAME, current)


# method -> (its answer streams, the request message it is parsed as, the response message).
# Complete's CompleteRequest is parsed as the GenerateRequest it is identical to on the wire.
_METHODS: dict[str, tuple[bool, Any, Any]] = {
    "Generate": (True, pb.GenerateRequest, pb.GenerateResponse),
    "Complete": (False, pb.GenerateRequest, pb.CompleteResponse),
    "Tokenize": (False, pb.TokenizeRequest, pb.TokenizeResponse),
    "Detokenize": (False, pb.DetokenizeRequest, pb.DetokenizeResponse),
    "PinPrefix": (False, pb.PinPrefixRequest, pb.PinPrefixResponse),
    "UnpinPrefix": (False, pb.UnpinPrefixRequest, pb.UnpinPrefixResponse),
}


def _handlers(service: GenerationService) -> dict[str, grpc.RpcMethodHandler]:
    assert set(_METHODS) == set(SERVICE.methods_by_name)
    handlers = {}
    for name, (streams, request, response) in _METHODS.items():
        handler = grpc.unary_stream_rpc_method_handler if streams else grpc.unary_unary_rpc_method_handler
        handlers[name] = handler(getattr(service, name), request_deserializer=tolerant(request),
                                 response_serializer=response.SerializeToString)  # fmt: skip
    return handlers


class LiveHealth(health_pb2_grpc.HealthServicer):  # type: ignore[misc]  # grpc_health is untyped
    """grpc.health.v1, computed from the frontend on every call: there is no stored status to
    keep in sync, so a dead step loop or a drain shows at once. "" is the whole server."""

    def __init__(
        self, frontend: Frontend, services: Sequence[str], watch_interval_s: float = 1.0
    ) -> None:
        self.frontend = frontend
        self.services = frozenset(services)
        self.watch_interval_s = watch_interval_s

    def status(self, service: str) -> int:
        if service not in self.services:
            return int(health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
        if self.frontend.is_ready():  # live and not draining
            return int(health_pb2.HealthCheckResponse.SERVING)
        return int(health_pb2.HealthCheckResponse.NOT_SERVING)

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        status = self.status(request.service)
        if status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN:
            await context.abort(grpc.StatusCode.NOT_FOUND, "unknown service")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> None:
        last = None
        while True:  # until the client cancels
            status = self.status(request.service)
            if status != last:
                await context.write(health_pb2.HealthCheckResponse(status=status))
                last = status
            await asyncio.sleep(self.watch_interval_s)
