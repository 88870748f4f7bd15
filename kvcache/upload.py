"""Small host lists (indices, per-row parameters) as device tensors, without waiting for the
device.

`torch.tensor(values, device="cuda")` copies from pageable memory, and such a copy synchronises
the stream: with async scheduling it would wait for the step in flight, which is the wait async
scheduling exists to hide. From pinned memory the copy is queued (`non_blocking`); the caching
host allocator keeps the pinned block until the copy has run. On the CPU it is one tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def upload(values: Sequence[int] | Sequence[float] | Sequence[Sequence[int]], dtype: torch.dtype,
           device: torch.device) -> torch.Tensor:  # fmt: skip
    if device.type == "cuda":
        return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
    return torch.tensor(values, dtype=dtype, device=device)
