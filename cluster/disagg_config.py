"""Configuration of disaggregated serving on Ray (no `ray` import: the server reads it first)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import ConfigError


@dataclass(frozen=True, slots=True)
class DisaggConfig:
    num_prefill: int = 1
    num_decode: int = 1
    local_prefill_tokens: int = 32  # decode prefills prompts whose uncached part is this short
    transfer_deadline_s: float = 10.0  # first token -> every page arrived (then re-dispatch)
    reservation_ttl_s: float = 30.0  # reserve -> every page arrived (queueing and prefill too)
    num_threads: int = 1  # torch threads per actor
    pages_per_chunk: int = 32
    chunk_pause_s: float = 0.0  # fault drills only: prefill pauses before each chunk
    poll_wait_s: float = 1.0  # the output stream's long-poll bound
    ray_address: str | None = None  # None: a private local Ray (or the one this process has)
    transport: str = "auto"  # auto (shm on one host, else gRPC), grpc or shm
    shm_slots: int = 4  # per decode worker's /dev/shm region (each slot holds one chunk)
    pin_cores: bool = False  # each actor on its own core, round robin: prefills first (cluster.cpu)
    placement: str = "cache"  # cache: the cost model (cluster.placement); round_robin: for comparison (P7)

    def __post_init__(self) -> None:
        if self.num_prefill < 0 or self.num_decode < 1:
            raise ConfigError("workers", "need --prefill >= 0 and --decode >= 1")
        if self.local_prefill_tokens < 0:
            raise ConfigError("local_prefill_tokens", "must be >= 0")
        if self.placement not in ("cache", "round_robin"):
            raise ConfigError("placement", f"use cache or round_robin, got {self.placement!r}")
        if self.transport not in ("auto", "grpc", "shm"):
            raise ConfigError("transport", f"use auto, grpc or shm, got {self.transport!r}")
        if self.shm_slots < 0 or (self.transport == "shm" and not self.shm_slots):
            raise ConfigError("shm_slots", "the shm transport needs at least one slot")
        if not self.transfer_deadline_s > 0 or not self.reservation_ttl_s > 0:
            raise ConfigError("transfer_deadline_s", "deadlines must be positive")
