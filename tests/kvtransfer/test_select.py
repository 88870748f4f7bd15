"""choose_transport: local in one process, NCCL between CUDA workers, shm on one host, else gRPC."""

from __future__ import annotations

import pytest

from kvtransfer.select import TransportKind, WorkerPlace, choose_transport, pair_transport

CPU_A = WorkerPlace("node-a", 100, has_shm=True)
GPU_A = WorkerPlace("node-a", 200, is_cuda=True, has_nccl=True, has_shm=True)


@pytest.mark.parametrize(
    ("prefill", "decode", "expected"),
    [
        (CPU_A, CPU_A, TransportKind.LOCAL),  # one process, even with shm on offer
        (GPU_A, GPU_A, TransportKind.LOCAL),  # one process, even on CUDA
        (WorkerPlace("node-a", 1), CPU_A, TransportKind.SHM),
        (WorkerPlace("node-a", 1), WorkerPlace("node-a", 2), TransportKind.GRPC),  # no region
        (WorkerPlace("node-b", 100), CPU_A, TransportKind.GRPC),  # same pid, another host
        (WorkerPlace("node-a", 1, is_cuda=True, has_nccl=True), GPU_A, TransportKind.NCCL),
        (WorkerPlace("node-b", 1, is_cuda=True, has_nccl=True), GPU_A, TransportKind.NCCL),
        (WorkerPlace("node-a", 1, is_cuda=True), GPU_A, TransportKind.SHM),  # no NCCL there
        (WorkerPlace("node-b", 1, is_cuda=True), GPU_A, TransportKind.GRPC),
        (WorkerPlace("node-a", 1, has_nccl=True), GPU_A, TransportKind.SHM),  # prefill on CPU
    ],
)
def test_choose_transport(
    prefill: WorkerPlace, decode: WorkerPlace, expected: TransportKind
) -> None:
    assert choose_transport(prefill, decode) == expected
    assert choose_transport(prefill, decode).value == expected.name.lower()


@pytest.mark.parametrize(
    ("requested", "prefill", "decode", "address", "expected"),
    [
        ("auto", WorkerPlace("node-a", 1), CPU_A, "127.0.0.1:5000", TransportKind.SHM),  # one node: loopback is fine
        ("auto", WorkerPlace("node-b", 1), CPU_A, "10.0.0.1:5000", TransportKind.GRPC),
        ("shm", WorkerPlace("node-b", 1), CPU_A, "10.0.0.1:5000", TransportKind.GRPC),  # shm needs one node
        ("nccl", WorkerPlace("node-b", 1), CPU_A, "10.0.0.1:5000", TransportKind.GRPC),  # gloo's rendezvous too
        ("nccl", WorkerPlace("node-b", 1, is_cuda=True, has_nccl=True), GPU_A, "10.0.0.1:5000", TransportKind.NCCL),
        ("auto", CPU_A, CPU_A, "127.0.0.1:5000", TransportKind.GRPC),  # two actors are two processes
        ("grpc", WorkerPlace("node-a", 1), CPU_A, "127.0.0.1:5000", TransportKind.GRPC),
    ],
)
def test_pair_transport(
    requested: str, prefill: WorkerPlace, decode: WorkerPlace, address: str, expected: TransportKind
) -> None:
    assert pair_transport(requested, prefill, decode, address) == expected


@pytest.mark.parametrize("address", ["127.0.0.1:5000", "127.0.1.1:5000", "[::1]:5000", "localhost:5000"])
def test_a_loopback_kv_address_across_nodes_is_no_route_and_says_why(address: str) -> None:
    decode = WorkerPlace("node-a", 100, has_shm=True, host="10.0.0.3")
    why = pair_transport("auto", WorkerPlace("node-b", 1, host="10.0.0.2"), decode, address)
    assert isinstance(why, str) and not isinstance(why, TransportKind)
    assert address in why and "10.0.0.2" in why and "transfer.bind_host" in why
