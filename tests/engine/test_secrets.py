"""Secret files (engine.secrets.read_secret): each way a file can be wrong is a ConfigError that
names the setting and the file, before any connection is made. (Through their users:
tests/kvtransfer/test_kv_tls.py, tests/cluster/test_etcd_tls.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.errors import ConfigError
from engine.secrets import MAX_SECRET_BYTES, read_secret

PEM = b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"


@pytest.mark.parametrize(
    ("content", "pem", "why"),
    [
        (None, False, "cannot read"),
        (b"", False, "empty"),
        (b" \n", False, "empty"),
        (b"x" * (MAX_SECRET_BYTES + 1), False, "over"),
        (b"hunter2\n", True, "not PEM"),
    ],
)
def test_a_bad_secret_file_names_its_setting(tmp_path: Path, content: bytes | None, pem: bool, why: str) -> None:
    path = tmp_path / "secret"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ConfigError, match=why) as err:
        read_secret(str(path), "membership.etcd.tls_ca", pem=pem)
    assert err.value.field == "membership.etcd.tls_ca" and str(path) in str(err.value)


def test_a_good_secret_is_read_whole(tmp_path: Path) -> None:
    (tmp_path / "ca.crt").write_bytes(PEM)
    (tmp_path / "password").write_bytes(b"hunter2\n")
    assert read_secret(str(tmp_path / "ca.crt"), "k", pem=True) == PEM
    assert read_secret(str(tmp_path / "password"), "k") == b"hunter2\n"
