"""Configuration of one engine (one model on one device).

Read without torch: a gateway builds one from cluster.yaml even where it runs no engine (a
router, cluster.gateway.router_front), so torch is imported only by the methods that resolve a
config against a model.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.errors import ConfigError
from engine.scheduler import POLICIES
from engine.structured_config import StructuredConfig
from kvcache.tiers import TierConfig

if TYPE_CHECKING:
    import torch

GiB = 1 << 30
KV_DTYPES = ("auto", "float32", "bfloat16", "float16")  # kv_cache_dtype
DTYPE_NAMES = {  # what `dtype` accepts -> torch's name of that dtype
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}


def dtype_name(name: str) -> str:
    """ "float32"/"fp32", "bfloat16"/"bf16", "float16"/"fp16"/"half" (a "torch." prefix allowed)
    -> torch's name of the dtype; ConfigError("dtype") naming the choices otherwise. "auto" is
    not a dtype: the caller resolves it (e.g. from the checkpoint's torch_dtype)."""
    key = name.strip().lower().removeprefix("torch.")
    if key not in DTYPE_NAMES:
        raise ConfigError("dtype", f"unknown dtype {name!r}; use one of {', '.join(sorted(DTYPE_NAMES))}")
    return DTYPE_NAMES[key]


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str = "baton-tiny"  # a built-in name or a Hugging Face checkpoint directory
    device: str = "cpu"
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    page_size: int = 16
    kv_memory_bytes: int | None = None  # KV pool budget; None: a share of free memory
    num_pages: int | None = None  # overrides kv_memory_bytes (tests use it to force pressure)
    max_model_len: int | None = None  # None: the model's own limit
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_prefill_chunk: int = 512
    # Stall-free batching: while requests decode, a step's prompt chunks are sized so the step
    # takes about this long, from per-token costs measured as the engine runs (engine.step_cost);
    # None: the static budget (max_num_batched_tokens) alone.
    itl_target_ms: float | None = None
    # Prompt work within a priority class: "least-uncached" (the prompts nearest their first
    # token first, aged so none starves; engine.scheduler) or "fcfs" (arrival order).
    scheduler_policy: str = "least-uncached"
    detokenize: bool = True
    enable_prefix_cache: bool = True  # reuse the KV pages of shared prefixes across requests
    tiers: TierConfig = TierConfig()  # host-RAM and disk tiers below the device pool
    # Token-id prefixes (e.g. a public system prompt) whose pages every tenant may share.
    shared_prefixes: tuple[tuple[int, ...], ...] = ()
    seed: int = 0  # seeds the generator of requests without their own seed
    num_threads: int | None = None
    # Decode attention: "torch" (the reference), "cpu" (engine.cpu_kernels: compiled, pages
    # read in place; CPU float32), "triton" (paged kernel, CUDA), or "auto" (triton on CUDA when
    # Triton is installed; cpu on CPU in float32 where the kernel builds; else torch).
    attention_backend: str = "auto"
    # The KV pool's element type: "auto" (the model's compute dtype, the parity reference),
    # "bfloat16" or "float16" (half the bytes a page takes: twice the pages in one budget, within
    # the tolerance tests/engine/test_parity.py states), or "float32". A KV dtype other than
    # the compute dtype is widened as it is read (the cpu kernel on CPU float32, else torch).
    kv_cache_dtype: str = "auto"
    # CUDA only: capture decode steps in CUDA graphs for batches up to this size (0: eager).
    cuda_graph_max_batch: int = 128
    structured: StructuredConfig = StructuredConfig()  # constrained decoding (engine.structured)
    # Launch step k+1 before reading step k's tokens back (they reach step k+1 on the device),
    # so the host's scheduling and output work overlaps the device's forward. None: on with
    # CUDA graphs, where the host work is most of a step; a request that stops on a token
    # (EOS, a stop string) then costs one computed token that is dropped.
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        if self.dtype != "auto":
            dtype_name(self.dtype)  # raises ConfigError("dtype", ...) naming the choices
        for name in ("page_size", "max_num_seqs", "max_num_batched_tokens", "max_prefill_chunk"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(name, f"must be a positive integer, got {value!r}")
        for name in ("kv_memory_bytes", "num_pages", "max_model_len", "num_threads"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ConfigError(name, f"must be a positive integer or unset, got {value!r}")
        if self.scheduler_policy not in POLICIES:
            raise ConfigError("scheduler_policy", f"must be one of {', '.join(POLICIES)}, got {self.scheduler_policy!r}")
        if self.itl_target_ms is not None and not (isinstance(self.itl_target_ms, int | float) and self.itl_target_ms > 0):
            raise ConfigError("itl_target_ms", f"must be a positive number of milliseconds or unset, got {self.itl_target_ms!r}")
        if self.attention_backend not in ("auto", "torch", "triton", "cpu"):
            raise ConfigError("attention_backend", f"use auto, torch, cpu or triton, got {self.attention_backend!r}")
        if self.kv_cache_dtype not in KV_DTYPES:
            raise ConfigError("kv_cache_dtype", f"use {', '.join(KV_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.attention_backend == "cpu" and not self.device.startswith("cpu"):
            raise ConfigError("attention_backend", "cpu is the CPU kernel; on CUDA use triton or torch")
        if not isinstance(self.cuda_graph_max_batch, int) or self.cuda_graph_max_batch < 0:
            raise ConfigError("cuda_graph_max_batch", f"must be 0 or a positive integer, got {self.cuda_graph_max_batch!r}")
        if self.async_scheduling not in (None, True, False):
            raise ConfigError("async_scheduling", f"must be true, false or unset, got {self.async_scheduling!r}")
        if not self.device.startswith(("cpu", "cuda")):
            raise ConfigError("device", f"unsupported device {self.device!r}; use cpu or cuda[:N]")

    def resolve_dtype(self, checkpoint_dtype: str) -> torch.dtype:
        """The compute dtype: explicit, or float32 on CPU and the checkpoint's half type on CUDA."""
        import torch

        if self.dtype != "auto":
            dtype: torch.dtype = getattr(torch, dtype_name(self.dtype))
        elif self.device.startswith("cuda"):
            dtype = torch.float16 if checkpoint_dtype == "float16" else torch.bfloat16
        else:
            dtype = torch.float32
        if dtype == torch.float16 and not self.device.startswith("cuda"):
            raise ConfigError("dtype", "float16 is not supported on CPU; use float32 or bfloat16")
        return dtype

    def resolve_kv_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The KV pool's dtype for a model computing in `dtype`."""
        import torch

        return dtype if self.kv_cache_dtype == "auto" else getattr(torch, self.kv_cache_dtype)

    def resolve_attention_backend(self, dtype: torch.dtype | None = None, kv_dtype: torch.dtype | None = None) -> str:
        """The decode attention backend for a model computing in `dtype` (default float32) over KV
        in `kv_dtype` (default: the same). The cpu kernel reads float32 KV, or bfloat16/float16 KV
        for a float32 model (kv_cache_dtype); triton reads KV in the model's dtype."""
        import torch

        dtype = torch.float32 if dtype is None else dtype
        kv_dtype = dtype if kv_dtype is None else kv_dtype
        cpu_reads = dtype == torch.float32 and kv_dtype in (torch.float32, torch.bfloat16, torch.float16)
        if self.attention_backend == "cpu":
            from engine import cpu_kernels

            if not cpu_reads:
                raise ConfigError("attention_backend", f"the cpu kernel computes in float32 (KV float32, bfloat16 or "
                                  f"float16); use torch for a {dtype} model")  # fmt: skip
            if cpu_kernels.load(kv_dtype) is None:
                raise ConfigError("attention_backend", "the cpu kernel could not be built (a C compiler, cc)")
            return "cpu"
        if kv_dtype != dtype and self.attention_backend == "triton":
            raise ConfigError("attention_backend", f"triton reads KV in the model's dtype; kv_cache_dtype "
                              f"{self.kv_cache_dtype} attends on the torch or cpu path")  # fmt: skip
        if self.attention_backend != "auto":
            return self.attention_backend
        if self.device.startswith("cuda"):
            if kv_dtype != dtype:
                return "torch"
            return "triton" if importlib.util.find_spec("triton") is not None else "torch"
        if cpu_reads:
            from engine import cpu_kernels

            if cpu_kernels.load(kv_dtype) is not None:
                return "cpu"
        return "torch"

    def kv_bytes(self, device: torch.device) -> int:
        """The KV pool budget: configured, or 85% of free device memory / 1 GiB of host RAM."""
        if self.kv_memory_bytes is not None:
            return self.kv_memory_bytes
        if device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(device)
            return int(free * 0.85)
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return min(GiB, available // 4)
