"""The communicators under the NCCL transport (kvtransfer.nccl's `Comm`): CuPy's NCCL between
CUDA devices, torch's gloo between CPU pools (the same state machine, tested for real on CPU),
the rendezvous ids both use, and whether a device can take the nccl route at all.

    uid = make_uid(device)           the receiving side's rendezvous id (NCCL unique id, or gloo:)
    comm = open_comm(uid, rank, device)
    forget_uid(uid)                  a gloo rendezvous directory, once both ranks joined
"""

from __future__ import annotations

import importlib
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from kvtransfer.codec import TransferError
from kvtransfer.nccl import Comm, Completion, nbytes


def unique_id() -> bytes:
    """A fresh NCCL unique id (128 bytes), made by the receiving side."""
    from cupy.cuda import nccl

    uid = nccl.get_unique_id()
    return uid if isinstance(uid, bytes) else bytes(b & 0xFF for b in uid)


class _Event:
    def __init__(self, event: torch.cuda.Event) -> None:
        self._event = event

    def query(self) -> bool:
        return bool(self._event.query())


class CupyComm:
    """A Comm over cupy.cuda.nccl on its own CUDA stream (ordered after the caller's)."""

    def __init__(self, nranks: int, uid: bytes, rank: int, device: torch.device) -> None:
        import cupy
        from cupy.cuda import nccl

        self._nccl = nccl
        self.device = device
        with cupy.cuda.Device(device.index or 0):
            self._comm = nccl.NcclCommunicator(nranks, uid, rank)
        self.stream = torch.cuda.Stream(device)

    @contextmanager
    def group(self) -> Iterator[None]:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the pages are written
        self._nccl.groupStart()
        try:
            yield
        finally:
            self._nccl.groupEnd()

    def send(self, buf: torch.Tensor, peer: int) -> None:
        buf.record_stream(self.stream)  # not reused by the allocator while NCCL still reads it
        self._comm.send(buf.data_ptr(), nbytes(buf), self._nccl.NCCL_UINT8, peer, self.stream.cuda_stream)

    def recv(self, buf: torch.Tensor, peer: int) -> None:
        buf.record_stream(self.stream)
        self._comm.recv(buf.data_ptr(), nbytes(buf), self._nccl.NCCL_UINT8, peer, self.stream.cuda_stream)

    def completion(self) -> Completion:
        event = torch.cuda.Event()
        event.record(self.stream)
        return _Event(event)

    def abort(self) -> None:
        self._comm.abort()


# -- gloo between CPU pools (torch.distributed) ------------------------------------------------

GLOO_UID = b"gloo:"


class _Waited:
    """Done once a thread has waited out every gloo work of a group (gloo's is_completed does
    not report send/recv); a failed wait is raised from query."""

    def __init__(self, works: list[Any]) -> None:
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._wait, args=(works,), name="gloo-wait", daemon=True
        )
        self._thread.start()

    def _wait(self, works: list[Any]) -> None:
        try:
            for work in works:
                work.wait()
        except Exception as err:  # noqa: BLE001 - raised to the poller
            self._error = err

    def query(self) -> bool:
        if self._thread.is_alive():
            return False
        if self._error is not None:
            raise TransferError(f"gloo: {self._error}")
        return True


class GlooComm:
    """A Comm over gloo between two processes of one host whose pools are on the CPU: the same
    channel, rendezvous and wire protocol as NCCL. The rendezvous is a FileStore in a private
    directory (the uid names it), so nothing listens for it; gloo's own pairs bind loopback."""

    def __init__(self, uid: bytes, rank: int, timeout_s: float = 30.0) -> None:
        from datetime import timedelta

        dist: Any = importlib.import_module("torch.distributed")  # its stubs miss the gloo classes
        store = dist.FileStore(os.path.join(_gloo_dir(uid), "store"), 2)
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timedelta(seconds=timeout_s)
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        self._group: Any = dist.ProcessGroupGloo(store, rank, 2, options)
        self._works: list[Any] = []

    @contextmanager
    def group(self) -> Iterator[None]:
        yield

    def send(self, buf: torch.Tensor, peer: int) -> None:
        self._works.append(self._group.send([_bytes_of(buf)], peer, 0))

    def recv(self, buf: torch.Tensor, peer: int) -> None:
        self._works.append(self._group.recv([_bytes_of(buf)], peer, 0))

    def completion(self) -> Completion:
        works, self._works = self._works, []
        return _Waited(works)

    def abort(self) -> None:
        self._group.abort()


def _bytes_of(buf: torch.Tensor) -> torch.Tensor:
    if not buf.is_contiguous():
        raise TransferError("a buffer on the channel must be contiguous")
    return buf.view(-1).view(torch.uint8)


def _gloo_dir(uid: bytes) -> str:
    path = uid[len(GLOO_UID) :].decode()
    if not uid.startswith(GLOO_UID) or not os.path.isdir(path):
        raise TransferError("not a gloo rendezvous")
    return path


def make_uid(device: torch.device) -> bytes:
    """A fresh rendezvous for one pair, made by the receiving side: NCCL's unique id for a CUDA
    pool, else a private gloo rendezvous directory (`forget_uid` removes it once joined)."""
    if device.type == "cuda":
        return unique_id()
    return GLOO_UID + tempfile.mkdtemp(prefix="baton-gloo-").encode()


def forget_uid(uid: bytes) -> None:
    if uid.startswith(GLOO_UID):
        shutil.rmtree(uid[len(GLOO_UID) :].decode(), ignore_errors=True)


def open_comm(uid: bytes, rank: int, device: torch.device) -> Comm:
    """This side's end of a two-rank communicator (blocks until the peer joins too)."""
    if uid.startswith(GLOO_UID):
        return GlooComm(uid, rank)
    return CupyComm(2, uid, rank, device)


def nccl_usable(device: torch.device) -> bool:
    """Whether this process can open NCCL communicators for a pool on `device`."""
    if device.type != "cuda":
        return False
    try:
        from cupy.cuda import nccl

        return bool(nccl.get_version())
    except Exception:  # noqa: BLE001 - no CuPy, no NCCL, or no driver: not usable
        return False


