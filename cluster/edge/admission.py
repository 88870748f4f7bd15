"""Admission control: a bounded waiting queue, decided in microseconds without the engine.

A request is *waiting* from admission until its first token, and *in flight* until it ends.
Two checks, both O(1):

    enter(slo)              before tokenization: waiting and in-flight request counts
    ticket.reserve(tokens)  after tokenization:  waiting prompt tokens

Beyond either bound the caller gets Overloaded (HTTP 429 + Retry-After, gRPC
RESOURCE_EXHAUSTED) before any work is done for it.

A BATCH request (engine.request.SloClass) has only `batch_share` of the two request bounds: it
is refused once the waiting or in-flight requests reach that share of theirs, so a queue full
of batch work still leaves the rest for LATENCY and STANDARD requests, which have all of it.
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.errors import EdgeError, Kind
from engine.request import SloClass


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    max_waiting_requests: int = 256  # admitted, no first token yet
    max_waiting_tokens: int = 1 << 19  # prompt tokens of waiting requests
    max_inflight_requests: int = 1024  # admitted and not finished
    retry_after_s: float = 1.0
    batch_share: float = 0.5  # of both request bounds, what BATCH requests may fill

    def __post_init__(self) -> None:
        if not 0 < self.batch_share <= 1:
            raise ValueError(f"admission.batch_share must be in (0, 1], got {self.batch_share}")


def overloaded(what: str, retry_after_s: float) -> EdgeError:
    return EdgeError(Kind.RESOURCE_EXHAUSTED, f"server overloaded: {what}; retry later", None, retry_after_s)


class Admission:
    def __init__(self, cfg: AdmissionConfig) -> None:
        self.cfg = cfg
        self.num_waiting = 0
        self.num_inflight = 0
        self.waiting_tokens = 0
        self.num_rejected = 0

    def enter(self, slo: SloClass = SloClass.STANDARD) -> Ticket:
        cfg = self.cfg
        share = cfg.batch_share if slo == SloClass.BATCH else 1.0
        if self.num_waiting >= share * cfg.max_waiting_requests or self.num_inflight >= share * cfg.max_inflight_requests:
            self.num_rejected += 1
            what = "too many queued batch requests" if share < 1 else "too many queued requests"
            raise overloaded(what, cfg.retry_after_s)
        self.num_waiting += 1
        self.num_inflight += 1
        return Ticket(self)


class Ticket:
    """One admitted request's share of the queue; every method is idempotent."""

    __slots__ = ("_admission", "_tokens", "_waiting", "_inflight")

    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self._tokens = 0
        self._waiting = True
        self._inflight = True

    def reserve(self, prompt_tokens: int) -> None:
        adm = self._admission
        if adm.waiting_tokens + prompt_tokens > adm.cfg.max_waiting_tokens and adm.waiting_tokens > 0:
            adm.num_rejected += 1
            self.release()
            raise overloaded("too many queued prompt tokens", adm.cfg.retry_after_s)
        adm.waiting_tokens += prompt_tokens
        self._tokens += prompt_tokens

    def started(self) -> None:
        """The first token arrived: the request no longer waits."""
        if self._waiting:
            self._waiting = False
            self._admission.num_waiting -= 1
            self._admission.waiting_tokens -= self._tokens
            self._tokens = 0

    def release(self) -> None:
        self.started()
        if self._inflight:
            self._inflight = False
            self._admission.num_inflight -= 1
