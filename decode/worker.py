"""The decode role: reserve pages, receive them, decode in the continuous batch.

    reserve(job)        allocate pages for the prompt; a KVDestination with a one-time token
    (transport)         chunks land through `receiver` (token, epoch and checksum checked)
    start_prefilled()   every page arrived: the request joins the batch after its first token
    start_local(job)    or prefill here, when the prompt is short (conditional disaggregation)
    step()              one engine step; expired reservations return their pages first

A plain class: cluster/ wraps it in a Ray actor; tests drive it directly.
"""

from __future__ import annotations

from engine.engine import Engine
from engine.outputs import StepOutput
from kvtransfer.codec import TransferError
from kvtransfer.transport import KVDestination, PoolReceiver, Reservation, ReservationBook
from prefill.worker import PrefillJob


class DecodeWorker:
    def __init__(
        self,
        engine: Engine,
        address: str = "decode-0",
        reservation_ttl_s: float = 10.0,
        local_prefill_tokens: int = 32,
    ) -> None:
        self.engine = engine
        self.address = address
        self.reservation_ttl_s = reservation_ttl_s
        self.local_prefill_tokens = local_prefill_tokens
        self.book = ReservationBook(engine.model_config.num_layers, on_release=self._release)
        self.receiver = PoolReceiver(engine.pool, self.book)

    def prefers_local(self, job: PrefillJob) -> bool:
        """Short prompts are cheaper to prefill here than to move."""
        return len(job.prompt_ids) <= self.local_prefill_tokens

    def reserve(self, job: PrefillJob, sender_epoch: int) -> KVDestination | None:
        pages = self.engine.reserve_pages(len(job.prompt_ids))
        if pages is None:
            return None
        return self.book.reserve(self.address, job.req_id, pages, sender_epoch, self.reservation_ttl_s)

    def cancel(self, dest: KVDestination) -> None:
        """The transfer failed or the request went elsewhere: the pages go back."""
        if not self.book.release(dest.transfer_id):
            done = self.book.completed.pop(dest.transfer_id, None)
            if done is not None:
                self._release(done)

    def start_prefilled(
        self, job: PrefillJob, dest: KVDestination, first_token: int, num_cached_tokens: int = 0
    ) -> None:
        done = self.book.completed.pop(dest.transfer_id, None)
        if done is None:
            raise TransferError(f"transfer {dest.transfer_id} did not complete")
        self.engine.add_prefilled(
            job.req_id, job.prompt_ids, first_token, job.sampling, list(done.page_ids), job.priority,
            job.cache_salt, num_cached_tokens,
        )

    def start_local(self, job: PrefillJob) -> None:
        self.engine.add_request(job.req_id, job.prompt_ids, job.sampling, job.priority, job.cache_salt)

    def step(self) -> list[StepOutput]:
        self.book.expire()
        return self.engine.step()

    def _release(self, reservation: Reservation) -> None:
        self.engine.release_pages(list(reservation.page_ids))
