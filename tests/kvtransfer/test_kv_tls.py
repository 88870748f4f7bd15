"""kvtransfer.tls: a KV port with mutual TLS takes pushes only from a sender holding the
deployment's certificate (a real gRPC server and client, real certificates from openssl); a
plaintext sender or one with another certificate moves no page, and the pages go back."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from engine.errors import ConfigError
from kvtransfer.grpc_transport import GrpcSender, start_kv_server
from kvtransfer.tls import SERVER_NAME, KVTls, KVTlsPaths
from kvtransfer.transport import build_chunks
from tests.kvtransfer.test_transports import EPOCH, Decode, _assert_landed, _prefill_pages


def _credential(directory: Path, name: str) -> KVTlsPaths:
    """A self-signed certificate naming SERVER_NAME (its own CA), as `openssl` makes it."""
    cert, key = directory / f"{name}.pem", directory / f"{name}.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", f"/CN={name}",
         "-addext", f"subjectAltName=DNS:{SERVER_NAME}"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return KVTlsPaths(str(cert), str(key), str(cert))


@pytest.fixture(scope="module")
def credentials(tmp_path_factory: pytest.TempPathFactory) -> tuple[KVTlsPaths, KVTlsPaths]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    directory = tmp_path_factory.mktemp("kv-tls")
    return _credential(directory, "deployment"), _credential(directory, "stranger")


@pytest.fixture
async def tls_decode(credentials: tuple[KVTlsPaths, KVTlsPaths]) -> AsyncIterator[tuple[Decode, str]]:
    decode = Decode()
    server, port = await start_kv_server(decode.receiver, "127.0.0.1:0", tls=KVTls.load(credentials[0]))
    yield decode, f"127.0.0.1:{port}"
    await server.stop(grace=None)


async def test_a_sender_with_the_deployment_certificate_pushes(
    tls_decode: tuple[Decode, str], credentials: tuple[KVTlsPaths, KVTlsPaths]
) -> None:
    decode, address = tls_decode
    pages = _prefill_pages(8)
    dest = decode.reserve(address, 8)
    sender = GrpcSender(tls=KVTls.load(credentials[0]))  # dials an IP, checks the peer as SERVER_NAME
    try:
        result = await sender.send(dest, build_chunks(dest, pages, EPOCH, pages_per_chunk=3), 10.0)
    finally:
        await sender.close()
    assert (result.accepted, result.pages_received) == (True, 8)
    _assert_landed(decode, dest, pages)


@pytest.mark.parametrize("who", ["plaintext", "stranger"])
async def test_a_sender_without_it_moves_nothing(
    tls_decode: tuple[Decode, str], credentials: tuple[KVTlsPaths, KVTlsPaths], who: str
) -> None:
    decode, address = tls_decode
    pages = _prefill_pages(4)
    dest = decode.reserve(address, 4)
    sender = GrpcSender(tls=None if who == "plaintext" else KVTls.load(credentials[1]))
    try:
        result = await sender.send(dest, build_chunks(dest, pages, EPOCH), 5.0)
    finally:
        await sender.close()
    assert not result.accepted and result.error == "transport error: UNAVAILABLE"
    assert decode.book.num_open == 1 and not any(decode.pool.read_page(p).any() for p in dest.dest_page_ids)
    assert decode.book.release(dest.transfer_id)  # the reservation goes back whole
    assert [r.transfer_id for r in decode.released] == [dest.transfer_id]


def test_a_partial_or_unreadable_credential_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="go together"):
        KVTlsPaths(cert="a.pem")
    assert KVTls.load(KVTlsPaths()) is None  # off
    missing = KVTlsPaths(str(tmp_path / "cert.pem"), str(tmp_path / "key.pem"), str(tmp_path / "ca.pem"))
    with pytest.raises(ConfigError) as err:
        KVTls.load(missing)
    assert err.value.field == "transfer.tls_cert" and "cert.pem" in str(err.value)
    (tmp_path / "cert.pem").write_text("not a certificate")
    with pytest.raises(ConfigError, match="not PEM"):
        KVTls.load(missing)
