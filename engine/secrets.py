"""Files an operator names for secrets (PEM certificates and keys, a password): read with a
bound, and refused with a ConfigError naming the setting when one cannot be read, is empty, is
too large or, for PEM, is not PEM. Used by the KV transfer's TLS (kvtransfer.tls) and etcd's
(cluster.membership.etcd)."""

from __future__ import annotations

from engine.errors import ConfigError

MAX_SECRET_BYTES = 1 << 20  # a CA bundle is the largest of them


def read_secret(path: str, key: str, pem: bool = False) -> bytes:
    """The bytes of `path`, which the setting `key` names."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_SECRET_BYTES + 1)
    except OSError as exc:
        raise ConfigError(key, f"cannot read {path}: {exc.strerror}") from None
    if not data.strip() or len(data) > MAX_SECRET_BYTES:
        raise ConfigError(key, f"{path} is empty or over {MAX_SECRET_BYTES} bytes")
    if pem and b"-----BEGIN " not in data:
        raise ConfigError(key, f"{path} is not PEM")
    return data
