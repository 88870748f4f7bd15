"""TLS for the worker-to-worker KV port (transfer.tls_cert / tls_key / tls_ca): once a decode
worker's KV server listens on its node's address (kvtransfer.listen), its peers are other
hosts, and the network between them need not be trusted.

Mutual TLS with one deployment credential: every worker holds the same certificate and key
(on Kubernetes, one Secret mounted in each Ray pod) and trusts the CA that signed it. The
server requires a client certificate from that CA, so only baton's own workers open a push
stream at all (the one-time transfer token and the epoch still fence each transfer inside it).
Workers dial each other by IP, which changes with every pod, so the certificate names one
fixed server name (SERVER_NAME, a DNS SAN) and senders check the peer against that name.

    tls = KVTls.load(cert_path, key_path, ca_path)      read once, when a worker starts
    server.add_secure_port(address, tls.server_credentials())
    grpc.aio.secure_channel(address, tls.channel_credentials(), options=tls.channel_options())
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from engine.errors import ConfigError
from engine.secrets import read_secret

SERVER_NAME = "baton-kv"  # the DNS SAN a KV certificate carries


@dataclass(frozen=True, slots=True)
class KVTlsPaths:
    """Where the credential lives on every node (config: the same paths on each)."""

    cert: str = ""
    key: str = ""
    ca: str = ""

    def __post_init__(self) -> None:
        given = [bool(self.cert), bool(self.key), bool(self.ca)]
        if any(given) and not all(given):
            raise ConfigError("transfer.tls_cert", "tls_cert, tls_key and tls_ca go together")

    @property
    def is_on(self) -> bool:
        return bool(self.cert)


NO_TLS = KVTlsPaths()


@dataclass(frozen=True, slots=True)
class KVTls:
    cert_pem: bytes
    key_pem: bytes
    ca_pem: bytes
    server_name: str = SERVER_NAME

    @classmethod
    def load(cls, paths: KVTlsPaths) -> KVTls | None:
        """The credential at `paths`, or None when TLS is off; a clear error naming the file
        that is missing, too large or not PEM."""
        if not paths.is_on:
            return None
        cert, key, ca = (read_secret(path, f"transfer.tls_{name}", pem=True)
                         for path, name in ((paths.cert, "cert"), (paths.key, "key"), (paths.ca, "ca")))  # fmt: skip
        return cls(cert, key, ca)

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.key_pem, self.cert_pem)], root_certificates=self.ca_pem, require_client_auth=True
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.ca_pem, self.key_pem, self.cert_pem)

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)]
