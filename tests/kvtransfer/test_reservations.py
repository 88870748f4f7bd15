"""ReservationBook: one-time tokens, epoch fencing, completion only when all pages arrived, expiry."""

from __future__ import annotations

from batonpb.baton.kv.v1 import kvtransfer_pb2 as pb
from kvtransfer.transport import ABORTED, KVDestination, Reservation, ReservationBook


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _book() -> tuple[ReservationBook, list[Reservation], Clock]:
    released: list[Reservation] = []
    clock = Clock()
    return ReservationBook(num_layers=4, on_release=released.append, clock=clock), released, clock


def _header(dest: KVDestination, pages: list[int], **kw: object) -> pb.PageChunkHeader:
    fields: dict[str, object] = dict(
        req_id=dest.req_id, transfer_id=dest.transfer_id, transfer_token=dest.token,
        sender_epoch=dest.epoch, dest_page_ids=pages, layer_start=0, layer_end=4,
    )  # fmt: skip
    fields.update(kw)
    return pb.PageChunkHeader(**fields)  # type: ignore[arg-type]


def test_tokens_are_random_and_one_per_reservation() -> None:
    book, _, _ = _book()
    a = book.reserve("w", "r1", [1, 2], sender_epoch=3, ttl_s=10)
    b = book.reserve("w", "r2", [3], sender_epoch=3, ttl_s=10)
    assert len(a.token) == 16 and a.token != b.token and a.transfer_id != b.transfer_id
    assert a.dest_page_ids == (1, 2) and a.epoch == 3


def test_wrong_token_and_stale_epoch_are_refused_counted_and_change_nothing() -> None:
    book, released, _ = _book()
    dest = book.reserve("w", "r1", [5, 6], sender_epoch=3, ttl_s=10)
    assert not book.check(_header(dest, [5], transfer_token=b"x" * 16))
    assert not book.check(_header(dest, [5], transfer_token=dest.token[:-1]))
    assert not book.check(_header(dest, [5], transfer_id="nope"))
    assert not book.check(_header(dest, [5], sender_epoch=2))  # a dead incarnation
    assert not book.check(_header(dest, [5], sender_epoch=4))  # not the one reserved for
    assert (book.refused_bad_token, book.refused_stale_epoch) == (3, 2)
    res = book.get(dest.transfer_id)
    assert res is not None and res.layers == {5: 0, 6: 0} and not released
    assert book.check(_header(dest, [5]))  # the real sender is still welcome


def test_unreserved_or_repeated_pages_are_refused() -> None:
    book, _, _ = _book()
    dest = book.reserve("w", "r1", [5, 6], sender_epoch=3, ttl_s=10)
    assert not book.check(_header(dest, [7]))
    assert not book.check(_header(dest, [5], layer_end=2**32 - 1))
    book.mark(_header(dest, [5], layer_end=2))
    assert not book.check(_header(dest, [5], layer_start=1, layer_end=3))  # overlaps layer 1
    assert not book.check(_header(dest, [6, 6]))  # one page twice in a chunk
    assert book.refused_bad_page == 4


def test_complete_only_when_every_layer_of_every_page_arrived() -> None:
    book, released, _ = _book()
    dest = book.reserve("w", "r1", [5, 6], sender_epoch=3, ttl_s=10)
    assert book.mark(_header(dest, [5, 6], layer_end=2)) == 0  # layers 0-1 only
    assert book.mark(_header(dest, [5], layer_start=2, layer_end=4)) == 1
    assert dest.transfer_id not in book.completed and book.num_open == 1
    assert book.check(_header(dest, [6], layer_start=2, layer_end=4))
    assert book.mark(_header(dest, [6], layer_start=2, layer_end=4)) == 2
    assert book.completed[dest.transfer_id].page_ids == (5, 6)
    assert book.num_open == 0 and not released
    # the token is spent: a replay of the last chunk is a bad token
    assert not book.check(_header(dest, [6], layer_start=2, layer_end=4))
    assert book.refused_bad_token == 1


def test_expired_reservations_are_released_once_and_their_token_dies() -> None:
    book, released, clock = _book()
    old = book.reserve("w", "r1", [1, 2], sender_epoch=3, ttl_s=10)
    clock.now += 5
    young = book.reserve("w", "r2", [3], sender_epoch=3, ttl_s=10)
    clock.now += 5
    assert book.expire() == [old.transfer_id]
    assert [r.page_ids for r in released] == [(1, 2)] and book.num_expired == 1
    assert book.expire() == [] and book.get(young.transfer_id) is not None
    assert not book.check(_header(old, [1]))
    assert not book.release(old.transfer_id)  # already gone: no second release
    assert len(released) == 1


def test_a_chunk_for_a_reservation_its_abort_released_is_told_aborted_until_its_deadline() -> None:
    """The request's abort reached the decode side before the prefill side: a chunk still on
    its way is refused as ABORTED (the sender ends its push as aborted, not as a refusal), but
    only with the reservation's own token, and only until the deadline it had."""
    book, released, clock = _book()
    aborted = book.reserve("w", "r1", [1, 2], sender_epoch=3, ttl_s=10)
    failed = book.reserve("w", "r2", [3], sender_epoch=3, ttl_s=10)
    assert book.release(aborted.transfer_id, aborted=True) and book.release(failed.transfer_id)
    assert len(released) == 2
    header = _header(aborted, [1])
    assert not book.check(header) and book.refusal(header) == ABORTED
    assert (book.refused_aborted, book.refused_bad_token) == (1, 0)  # not counted as a bad token
    forged = _header(aborted, [1], transfer_token=b"x" * 16)
    assert not book.check(forged) and book.refusal(forged) == "refused"  # a guess learns nothing
    assert (book.refused_aborted, book.refused_bad_token) == (1, 1)
    assert book.refusal(_header(failed, [3])) == "refused"  # released for another reason
    clock.now += 10
    book.expire()
    assert book.refusal(header) == "refused"
