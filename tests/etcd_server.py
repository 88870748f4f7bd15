"""A real etcd server for tests (bench.etcd_proc), and a TCP gate to cut one client off from it.

    server = EtcdServer.launch(tmp_dir)   etcd on 127.0.0.1 (free ports, its own data dir)
    server.stop() / server.start()        by its own PID; the same data dir and port
    gate = await TcpGate.open(server.port)   a relay a client connects through
    gate.cut() / gate.restore()           drop every relayed connection and refuse new ones
                                          (a partition of that client only), then let it back

A missing etcd binary is a failure (EtcdMissing), never a skip: the membership tests must run.
"""

from __future__ import annotations

import asyncio
import contextlib

from bench.etcd_proc import INSTALL_HINT, EtcdMissing, EtcdServer, is_listening

__all__ = ["INSTALL_HINT", "EtcdMissing", "EtcdServer", "TcpGate", "is_listening"]


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
