"""What crosses the gateway <-> actor boundary: frozen values only, nothing alive.

    PrefillResult   prefill -> gateway: the first token, at once (before the pages move)
    TransferReport  prefill -> gateway: how one push went (kvtransfer.jobs: the prefill role makes it)
    OutputBatch     decode  -> gateway: every request's new tokens of one or more steps
    PrefillStats / DecodeStats   what each worker reports for /metrics and for placement
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.kernel_info import EngineKernels
from engine.outputs import StepOutput
from kvcache.report import CacheReport


@dataclass(frozen=True, slots=True)
class PrefillResult:
    output: StepOutput  # the first token as the edge streams it; finish_reason set if it ends here
    transfer_id: str  # the push that was started ("" when nothing has to move)

    @property
    def first_token(self) -> int:
        return self.output.token_ids[0]


@dataclass(frozen=True, slots=True)
class PrefillStats:
    epoch: int
    num_running: int  # prompts in the engine
    num_inflight_transfers: int
    num_pinned_pages: int  # pages held for transfers until ack, abort or lease end
    num_transfers: int
    num_failed_transfers: int
    num_lease_expired: int
    last_event_seq: int = 0  # its prefix cache's last KV event (the index finds lost ones)
    num_query_tokens: int = 0  # prompt tokens its prefix cache was asked for
    num_hit_tokens: int = 0  # ... of which it served (the per-worker hit counter)
    num_pending_tokens: int = 0  # prompt tokens queued or being computed
    prefill_s_per_token: float = 0.0  # measured over its recent steps (moving average); 0: none yet
    cache: CacheReport = CacheReport()  # by tier, for status and the per-node metrics
    num_preempted: int = 0  # requests its engine preempted since start
    pid: int = 0  # its process: another one than before means Ray restarted the actor
    pushes_ended: dict[str, int] = field(default_factory=dict)  # how its pushes ended (prefill.pushes.END_REASONS)
    num_retained_pages: int = 0  # pages held as retained copies of pushed prompts (kvcache.retained)
    num_retained_copies: int = 0
    retained_released: dict[str, int] = field(default_factory=dict)  # copies let go, by kvcache.retained.RELEASE_REASONS
    kernels: EngineKernels = EngineKernels()  # what its engine runs on (engine.kernel_info)


@dataclass(frozen=True, slots=True)
class DecodeStats:
    address: str
    num_pages: int
    num_used_pages: int
    num_free_pages_at_idle: int  # free or only cached: equals num_pages when nothing is held
    num_cached_pages: int
    num_reserved_pages: int  # held by reservations not yet admitted
    num_open_reservations: int
    num_expired: int  # open reservations whose transfer deadline passed
    num_lease_expired: int  # complete reservations never admitted
    num_running: int
    num_waiting: int
    refused_bad_token: int
    refused_stale_epoch: int
    refused_bad_page: int
    last_event_seq: int = 0  # as PrefillStats
    num_query_tokens: int = 0
    num_hit_tokens: int = 0
    cache: CacheReport = CacheReport()  # read at most every CACHE_REPORT_S (it walks the cache)
    num_preempted: int = 0
    pid: int = 0  # its process
    handing_off: bool = False  # draining: its requests should move to the other decode workers
    num_kept_pages: int = 0  # verified pages of failed transfers it kept cached (decode.worker)
    num_handed_off: int = 0  # requests it pushed to another decode worker while draining (decode.handoff)
    kernels: EngineKernels = EngineKernels()  # as PrefillStats
    refused_aborted: int = 0  # push chunks for reservations their requests' aborts had released


@dataclass(frozen=True, slots=True)
class OutputBatch:
    """Steps `first_seq..last_seq` of one decode worker, merged (a consumer that keeps up
    gets one step per batch). `first_seq > after + 1` means steps were dropped: the consumer
    fell past the feed's bound."""

    first_seq: int
    last_seq: int
    outputs: tuple[StepOutput, ...]
    stats: DecodeStats
