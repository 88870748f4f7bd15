"""What the engine hands back each step: per-request deltas and one stats record."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from engine.request import CachedTokens, FinishReason

if TYPE_CHECKING:  # the edges read outputs without torch (a router imports none: cluster.gateway.router_front)
    import torch


class TokenLogprobs(NamedTuple):
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token_id, logprob), most likely first


@dataclass(frozen=True, slots=True)
class StepOutput:
    """New output of one request in one step (a token, its text, or the finish)."""

    req_id: str
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprobs, ...]  # one per token in token_ids when requested, else ()
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int  # so far, including token_ids
    cached: CachedTokens  # prompt tokens served from the prefix cache, by tier

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_cached_tokens(self) -> int:
        return self.cached.total


@dataclass(frozen=True, slots=True)
class StepStats:
    """One step, for metrics (aggregated in cluster/) and for the offline benchmark."""

    step_s: float  # wall time of the whole step
    forward_s: float  # model forward + logits
    num_prefill_tokens: int
    num_decode_tokens: int
    num_running: int
    num_waiting: int
    num_preempted: int
    num_finished: int
    pages_used: int
    pages_total: int
    num_constrained: int = 0  # requests sampled under a grammar mask this step
    mask_wait_s: float = 0.0  # the step's wait for those masks after the forward pass


@dataclass(frozen=True, slots=True)
class ExportedKV:
    """A prefill's result for the decode side: the prompt's KV pages and the first token."""

    req_id: str
    num_tokens: int  # prompt tokens covered (the last page may be partial)
    first_token: int
    kv: torch.Tensor  # [pages, layers, 2, page_size, kv_heads, head_dim], contiguous, on the pool's device
    page_hashes: tuple[bytes, ...] = ()  # of its whole pages, as this worker's prefix cache names them
