"""choose_transport: local in one process, NCCL between CUDA workers, shm on one host, else gRPC."""

from __future__ import annotations

import pytest

from kvtransfer.select import TransportKind, WorkerPlace, choose_transport

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
