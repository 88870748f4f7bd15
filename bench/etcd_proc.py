"""A real etcd on loopback, for the tests and the soak (bench.soak restarts it under load).

    server = EtcdServer.launch(tmp_dir)   etcd on 127.0.0.1 (free ports, its own data dir)
    server.stop() / server.start()        by its own PID; the same data dir and port
    server.count_keys(prefix)             how many keys under prefix (the JSON gateway)
    EtcdServer.launch(tmp_dir, tls=EtcdServerTls(...))   https only, client certificates required

etcd comes from the Debian package `etcd-server` (ENV-NOTES.md); .ci/run installs it. A
missing binary is EtcdMissing, never a silent skip.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.server_proc import free_port

INSTALL_HINT = (
    "etcd is not on PATH: the membership tests run a real etcd server on loopback. "
    "Install it with `sudo apt-get install -y etcd-server` (Debian/Ubuntu; .ci/run does this "
    "in CI) or put an etcd 3.4+ binary on PATH."
)


class EtcdMissing(RuntimeError):
    pass


def is_listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


@dataclass(frozen=True, slots=True)
class EtcdServerTls:
    """PEM files for an etcd that serves https only and requires a client certificate from
    `ca` (--client-cert-auth); `client_cert`/`client_key` are what this harness itself
    presents (its health checks and JSON-gateway calls)."""

    ca: Path
    cert: Path
    key: Path
    client_cert: Path
    client_key: Path

    def args(self) -> list[str]:
        return ["--cert-file", str(self.cert), "--key-file", str(self.key), "--trusted-ca-file", str(self.ca),
                "--client-cert-auth"]  # fmt: skip

    def context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.ca))
        ctx.load_cert_chain(str(self.client_cert), str(self.client_key))
        return ctx


class EtcdServer:
    """One etcd on loopback, started and stopped by its own PID (restartable: the same data dir
    and ports)."""

    def __init__(self, binary: str, data_dir: Path, port: int, peer_port: int, name: str = "baton",
                 host: str = "127.0.0.1", tls: EtcdServerTls | None = None) -> None:  # fmt: skip
        self.binary = binary
        self.tls = tls
        self.host = host  # loopback, or a test's own private address (tests/multihost: the bridge)
        self.name = name
        self.data_dir = data_dir
        self.port = port
        self.peer_port = peer_port
        self.log_path = data_dir.parent / f"{data_dir.name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @classmethod
    def launch(cls, tmp_dir: Path, name: str = "baton", host: str = "127.0.0.1",
               tls: EtcdServerTls | None = None) -> EtcdServer:  # fmt: skip
        """etcd with its data in tmp_dir/etcd-data (log: tmp_dir/etcd-data.log), free ports on `host`."""
        binary = shutil.which("etcd")
        if binary is None:
            raise EtcdMissing(INSTALL_HINT)
        server = cls(binary, tmp_dir / "etcd-data", free_port(host), free_port(host), name, host, tls)
        server.start()
        return server

    @property
    def url(self) -> str:
        """Where clients reach it: http, or https with TLS."""
        return f"{'https' if self.tls is not None else 'http'}://{self.host}:{self.port}"

    def _open(self, req: str | urllib.request.Request, timeout: float) -> Any:
        return urllib.request.urlopen(req, timeout=timeout, context=self.tls.context() if self.tls else None)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self, timeout_s: float = 15.0) -> None:
        assert self.proc is None or self.proc.poll() is not None, "etcd is already running"
        peer, client = f"http://{self.host}:{self.peer_port}", self.url
        args = [
            self.binary, "--name", self.name, "--data-dir", str(self.data_dir),
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"{self.name}={peer}",
            # a fast election (startup ~0.2 s) and a minimum lease TTL of 1 s
            "--heartbeat-interval", "50", "--election-timeout", "500",
            "--logger", "zap", "--log-level", "warn",
            *(self.tls.args() if self.tls is not None else []),
        ]  # fmt: skip
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}:\n{self.log_tail()}")
            if self.is_healthy():
                return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"etcd not healthy within {timeout_s} s:\n{self.log_tail()}")

    def is_healthy(self) -> bool:
        try:
            with self._open(f"{self.url}/health", timeout=1) as resp:
                return b'"true"' in resp.read()
        except OSError:
            return False

    def count_keys(self, prefix: str) -> int | None:
        """Keys under `prefix` (etcd's JSON gateway, /v3/kv/range); None if etcd does not answer."""
        end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
        body = {"key": _b64(prefix), "range_end": _b64(end), "count_only": True}
        req = urllib.request.Request(f"{self.url}/v3/kv/range", json.dumps(body).encode(),
                                     method="POST")  # fmt: skip
        try:
            with self._open(req, timeout=2) as resp:
                return int(json.load(resp).get("count", 0))
        except OSError:
            return None

    def put(self, key: str, value: bytes) -> bool:
        """Write one key (etcd's JSON gateway, /v3/kv/put); False if etcd does not answer."""
        body = {"key": _b64(key), "value": base64.b64encode(value).decode()}
        return self._post("/v3/kv/put", body) is not None

    def delete(self, key: str) -> bool:
        return self._post("/v3/kv/deleterange", {"key": _b64(key)}) is not None

    def _post(self, path: str, body: dict[str, str]) -> dict[str, object] | None:
        req = urllib.request.Request(f"{self.url}{path}", json.dumps(body).encode(), method="POST")
        try:
            with self._open(req, timeout=2) as resp:
                return dict(json.load(resp))
        except OSError:
            return None

    def stop(self, timeout_s: float = 10.0) -> int:
        """SIGTERM to our own etcd (by PID), SIGKILL if it lingers -> its exit status."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout_s)
        return self.proc.returncode

    def is_running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()
