"""Which transport moves a (prefill, decode) pair's pages, chosen once per pair from where the
two workers run (docs/architecture.md, KV transfer):

    same process (node id and pid)         -> local   direct calls into the receiver
    both hold KV on CUDA, NCCL on both     -> nccl    device to device, no host staging
    same node, the decode side serves shm  -> shm     page bytes through /dev/shm
    anything else                          -> grpc    host-staged stream, any host

NCCL wins over shm on one host: shm would stage every page through host memory twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from kvtransfer.listen import host_of, is_loopback


class TransportKind(StrEnum):
    LOCAL = "local"
    SHM = "shm"
    GRPC = "grpc"
    NCCL = "nccl"


@dataclass(frozen=True, slots=True)
class WorkerPlace:
    """Where one worker runs: what the choice of transport reads (node, process, device), and
    what /status shows and a scale-in on Kubernetes names (address, pod)."""

    node_id: str  # the host (Ray node id): one node, one /dev/shm
    pid: int  # the worker's process on that node
    is_cuda: bool = False  # its KV pages live on a CUDA device
    has_nccl: bool = False  # CuPy with NCCL is usable there
    has_shm: bool = False  # it serves KVTransferService.PushShm from an shm region (decode side)
    host: str = ""  # the node's address (Ray's node IP): what /status shows
    pod: str = ""  # the Kubernetes pod it runs in (POD_NAME, from the downward API); "" elsewhere


def choose_transport(prefill: WorkerPlace, decode: WorkerPlace) -> TransportKind:
    same_node = prefill.node_id == decode.node_id
    if same_node and prefill.pid == decode.pid:
        return TransportKind.LOCAL
    if prefill.is_cuda and decode.is_cuda and prefill.has_nccl and decode.has_nccl:
        return TransportKind.NCCL
    if same_node and decode.has_shm:
        return TransportKind.SHM
    return TransportKind.GRPC


def pair_transport(requested: str, prefill: WorkerPlace, decode: WorkerPlace, address: str) -> TransportKind | str:
    """The transport for a pair of Ray actors, or why pages cannot move between them: `requested`
    is the configured one ("auto": choose_transport's). Two actors are two processes (local
    becomes gRPC); shm needs one node, as does nccl's CPU stand-in (gloo's rendezvous is a
    file), so across nodes those become gRPC; a decode worker whose KV address is loopback
    cannot be reached from another node at all."""
    same_node = prefill.node_id == decode.node_id
    if not same_node and is_loopback(host_of(address)):
        return (f"{decode.host or 'the decode node'}'s KV listener is on loopback ({address}), unreachable from "
                f"{prefill.host or 'another node'}: set transfer.bind_host (auto or node)")  # fmt: skip
    kind = choose_transport(prefill, decode) if requested == "auto" else TransportKind(requested)
    if kind is TransportKind.LOCAL:
        return TransportKind.GRPC
    if not same_node and kind is TransportKind.SHM:
        return TransportKind.GRPC
    if not same_node and kind is TransportKind.NCCL and not (prefill.is_cuda and decode.is_cuda):
        return TransportKind.GRPC
    return kind
