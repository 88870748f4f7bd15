"""Configuration of constrained decoding (engine.structured), apart from it so that reading a
config imports no torch (engine.engine_config)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.errors import ConfigError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class StructuredConfig:
    compile_timeout_s: float = 2.0  # wall-clock bound on compiling one constraint
    cache_size: int = 256  # compiled constraints kept (LRU), refusals included
    num_compile_threads: int = 2
    # llguidance's pool for filling a step's masks; None: a quarter of the cores (1 to 8), so
    # that on a CPU-only host the fill leaves the forward pass its cores.
    num_mask_threads: int | None = None
    # Fill masks on a thread while the forward pass runs. None: when it can help, i.e. on a GPU
    # (the CPU waits for the forward anyway) or with a core the forward's threads leave free;
    # on a CPU whose cores all run the forward, the fill would only slow it down by as much.
    overlap: bool | None = None

    def __post_init__(self) -> None:
        if not self.compile_timeout_s > 0:
            raise ConfigError("structured.compile_timeout_s", "must be positive")
        for name in ("cache_size", "num_compile_threads", "num_mask_threads"):
            value = getattr(self, name)
            if (value is not None or name != "num_mask_threads") and (not isinstance(value, int) or value <= 0):
                raise ConfigError(f"structured.{name}", f"must be a positive integer, got {value!r}")

    def resolve_overlap(self, device: torch.device) -> bool:
        if self.overlap is not None:
            return self.overlap
        import torch

        return device.type == "cuda" or (os.cpu_count() or 1) > torch.get_num_threads()

    @property
    def mask_threads(self) -> int:
        return self.num_mask_threads or min(8, max(1, (os.cpu_count() or 1) // 4))
