"""Which transport moves a (prefill, decode) pair's pages, chosen once per pair from where the
two workers run (DESIGN.md section 6):

    same process (node id and pid)         -> local   direct calls into the receiver
    both hold KV on CUDA, NCCL on both     -> nccl    device to device, no host staging
    same node, the decode side serves shm  -> shm     page bytes through /dev/shm
    anything else                          -> grpc    host-staged stream, any host

NCCL wins over shm on one host: shm would stage every page through host memory twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class TransportKind(StrEnum):
    LOCAL = "local"
    SHM = "shm"
    GRPC = "grpc"
    NCCL = "nccl"


@dataclass(frozen=True, slots=True)
class WorkerPlace:
    """Where one worker runs, as far as moving KV pages is concerned."""

    node_id: str  # the host (Ray node id): one node, one /dev/shm
    pid: int  # the worker's process on that node
    is_cuda: bool = False  # its KV pages live on a CUDA device
    has_nccl: bool = False  # CuPy with NCCL is usable there
    has_shm: bool = False  # it serves KVTransfer.PushShm from an shm region (decode side)


def choose_transport(prefill: WorkerPlace, decode: WorkerPlace) -> TransportKind:
    same_node = prefill.node_id == decode.node_id
    if same_node and prefill.pid == decode.pid:
        return TransportKind.LOCAL
    if prefill.is_cuda and decode.is_cuda and prefill.has_nccl and decode.has_nccl:
        return TransportKind.NCCL
    if same_node and decode.has_shm:
        return TransportKind.SHM
    return TransportKind.GRPC
