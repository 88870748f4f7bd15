"""Small host lists (indices, per-row parameters) as device tensors, without waiting for the
device.

`torch.tensor(values, device="cuda")` copies from pageable memory, and such a copy synchronises
the stream: with async scheduling it would wait for the step in flight, which is the wait async
scheduling exists to hide. From pinned memory the copy is queued (`non_blocking`); the caching
host allocator keeps the pinned block until the copy has run. On the CPU it is one tensor,
made through numpy: torch.tensor parses a list element by element (2.6 us for one int, 4.4 us
for 32, against 0.8 and 1.4 us through numpy), and a CPU decode step makes several.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def upload(values: Sequence[int] | Sequence[float] | Sequence[Sequence[int]], dtype: torch.dtype,
           device: torch.device) -> torch.Tensor:  # fmt: skip
    if device.type == "cuda":
        return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
    if device.type == "cpu" and dtype in _NUMPY:
        return torch.from_numpy(np.array(values, dtype=_NUMPY[dtype]))
    return torch.tensor(values, dtype=dtype, device=device)


_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32, torch.float64: np.float64}
