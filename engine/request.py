"""A request inside the engine: counters, not phases.

    num_tokens          = len(prompt_ids) + len(output_ids)
    num_computed_tokens = tokens whose K/V are in this request's pages

Each step computes some of the `num_tokens - num_computed_tokens` pending tokens; when a step
catches up (computed == num_tokens) the engine samples one more token. A prefill, a chunk of a
long prompt, a decode step and a re-prefill after preemption are all that one rule.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from engine.sampling import SamplingParams

if TYPE_CHECKING:
    from engine.structured import GrammarMatcher
    from engine.textstate import TextState


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED = 3


class SloClass(enum.IntEnum):
    """A request's service class, lowest most urgent: the scheduler orders by class, then
    priority, then arrival; a LATENCY request that cannot be admitted preempts running BATCH
    ones (engine.scheduler); admission keeps room for the first two (cluster.edge.admission)."""

    LATENCY = 0  # interactive: first token as soon as possible
    STANDARD = 1
    BATCH = 2  # throughput work: yields its seat and pages to a LATENCY request


# Classes apart in one sort key: wider than any priority's range ([-100, 100] at the edges),
# so the class always decides before the priority does.
SLO_BAND = 1_000_000


class FinishReason(enum.IntEnum):
    STOP = 0  # EOS, a stop token id or a stop string
    LENGTH = 1  # max_tokens or the model's context
    ABORT = 2  # aborted by the caller

    @property
    def openai_name(self) -> str:
        return ("stop", "length", "abort")[self]


class CachedTokens(NamedTuple):
    """Where a request's reused prompt tokens were found (usage): the tier of the cache that
    held each page when the request was admitted, and how many of them another worker held
    (a prefill worker's cache, its pages then shipped to the decode worker that streams)."""

    device: int = 0
    host: int = 0
    disk: int = 0
    remote: int = 0  # of the three, tokens reused from another worker's cache

    @property
    def total(self) -> int:
        return self.device + self.host + self.disk

    def moved(self) -> CachedTokens:
        """The same reuse, as seen by the worker the pages were shipped to."""
        return self._replace(remote=self.total)


NOT_CACHED = CachedTokens()


@dataclass(slots=True, eq=False)
class Request:
    req_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    priority: int  # lower runs first; FCFS inside a class
    arrival: int  # admission order, the FCFS tie-break
    slo: SloClass = SloClass.STANDARD  # ranks before the priority (class_priority)
    output_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    page_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    cache_salt: bytes = b""  # the tenant's: its pages are invisible to other tenants
    in_session: bool = False  # a session's request: its pages outlast its tenant's others in the cache
    reuse_cache: bool = True  # False: its prefix is computed even where cached (Job.reuse_cache)
    num_shared_pages: int = 0  # leading pages inside an operator-shared prefix (no salt)
    page_hashes: list[bytes] = field(default_factory=list)  # of full pages, filled as needed
    num_committed_pages: int = 0  # leading pages already offered to the prefix cache
    cached: CachedTokens = NOT_CACHED  # prompt tokens reused from the cache at first admission
    # Prompt tokens the engine had computed when this request arrived: its age in work done
    # (engine.scheduler's least-uncached order ages requests by it, deterministically).
    work_mark: int = 0
    rank_pages: int = 0  # leading pages cached or being computed when it was last ranked
    export_kv: bool = False  # prefill role: keep a copy of the prompt's KV when it finishes
    text: TextState | None = None  # detokenizer + stop strings; None when not detokenizing
    matcher: GrammarMatcher | None = None  # where the output is in its grammar (constrained only)
    # Async scheduling: the request's last token is in flight and ends it whatever it is
    # (max_tokens, the context): the scheduler leaves it out until the engine reads it.
    finishing: bool = False

    @property
    def num_cached_tokens(self) -> int:
        return self.cached.total

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_pending(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def class_priority(self) -> int:
        """The class and the priority as one number, lowest first: the class decides, the
        priority orders within it."""
        return self.priority + (self.slo - SloClass.STANDARD) * SLO_BAND

    @property
    def sort_key(self) -> tuple[int, int]:
        return (self.class_priority, self.arrival)

    def token_slice(self, start: int, end: int) -> list[int]:
        n_prompt = len(self.prompt_ids)
        if end <= n_prompt:
            return self.prompt_ids[start:end]
        if start >= n_prompt:
            return self.output_ids[start - n_prompt : end - n_prompt]
        return self.prompt_ids[start:] + self.output_ids[: end - n_prompt]
