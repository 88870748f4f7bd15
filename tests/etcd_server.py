"""A real etcd server for tests, and a TCP gate to cut one client off from it.

    server = EtcdServer.launch(tmp_dir)   etcd on 127.0.0.1 (free ports, its own data dir)
    server.stop() / server.start()        by its own PID; the same data dir and port
    gate = await TcpGate.open(server.port)   a relay a client connects through
    gate.cut() / gate.restore()           drop every relayed connection and refuse new ones
                                          (a partition of that client only), then let it back

etcd comes from the Debian package `etcd-server` (ENV-NOTES.md); .ci/run installs it. A
missing binary is a failure (EtcdMissing), never a skip: the membership tests must run.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

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


class EtcdServer:
    def __init__(self, binary: str, data_dir: Path, port: int, peer_port: int) -> None:
        self.binary = binary
        self.data_dir = data_dir
        self.port = port
        self.peer_port = peer_port
        self.log_path = data_dir.parent / f"{data_dir.name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @classmethod
    def launch(cls, tmp_dir: Path) -> EtcdServer:
        binary = shutil.which("etcd")
        if binary is None:
            raise EtcdMissing(INSTALL_HINT)
        server = cls(binary, tmp_dir / "etcd-data", free_port(), free_port())
        server.start()
        return server

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self, timeout_s: float = 15.0) -> None:
        assert self.proc is None or self.proc.poll() is not None, "etcd is already running"
        peer, client = f"http://127.0.0.1:{self.peer_port}", f"http://127.0.0.1:{self.port}"
        args = [
            self.binary, "--name", "baton-test", "--data-dir", str(self.data_dir),
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"baton-test={peer}",
            # a fast election (startup ~0.2 s) and a minimum lease TTL of 1 s
            "--heartbeat-interval", "50", "--election-timeout", "500",
            "--logger", "zap", "--log-level", "warn",
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
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1) as resp:
                return b'"true"' in resp.read()
        except OSError:
            return False

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


class TcpGate:
    """A loopback relay to 127.0.0.1:`target` whose link the test cuts and restores."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.port = 0
        self.is_open = True
        self.num_refused = 0
        self._server: asyncio.Server | None = None
        self._links: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    @classmethod
    async def open(cls, target: int) -> TcpGate:
        gate = cls(target)
        gate._server = await asyncio.start_server(gate._accept, "127.0.0.1", 0)
        gate.port = int(gate._server.sockets[0].getsockname()[1])
        return gate

    def cut(self) -> None:
        self.is_open = False
        for writer in list(self._links):
            writer.transport.abort()  # a reset, as a dropped link looks to the client
        self._links.clear()

    def restore(self) -> None:
        self.is_open = True

    async def close(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.is_open:
            self.num_refused += 1
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            writer.transport.abort()
            return
        self._links |= {writer, up_writer}
        for src, dst in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pipe(src, dst, (writer, up_writer)))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pipe(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, ends: tuple[asyncio.StreamWriter, ...]
    ) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()
        for end in ends:  # one side closed: close both
            self._links.discard(end)
            end.transport.abort()
