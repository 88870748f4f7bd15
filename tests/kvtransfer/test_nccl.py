"""The NCCL transport's state machine and checks, on CPU over the in-memory LoopbackFabric.

What is not here is only the NCCL calls themselves (CupyComm): bench/gpu_check.py runs the
same code over CuPy's NCCL on a GPU, send-to-self on one device.
"""

from __future__ import annotations

import threading

import pytest
import torch

from kvcache.pool import DevicePool, KVLayout
from kvtransfer.codec import TransferError
from kvtransfer.nccl import (
    ChannelState,
    LoopbackFabric,
    NcclChannel,
    NcclReceiver,
    device_digest,
    nccl_chunks,
    transfer_to_self,
)
from kvtransfer.transport import KVDestination, PoolReceiver, Reservation, ReservationBook

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=16, page_size=8)
EPOCH = 4


class Decode:
    def __init__(self) -> None:
        self.pool = DevicePool(LAYOUT, 40, torch.bfloat16)
        self.released: list[Reservation] = []
        self.book = ReservationBook(LAYOUT.num_layers, self._release)
        self.receiver = NcclReceiver(PoolReceiver(self.pool, self.book), torch.device("cpu"))
        self.pool.pages.allocate(5)

    def _release(self, res: Reservation) -> None:
        self.released.append(res)
        self.pool.pages.free(res.page_ids)

    def reserve(self, n: int) -> KVDestination:
        pages = self.pool.pages.allocate(n)
        assert pages is not None
        return self.book.reserve("decode-0", "req-1", pages, EPOCH, 10.0)


def _kv(n: int, seed: int = 1) -> torch.Tensor:
    shape = (n, LAYOUT.num_layers, 2, LAYOUT.page_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _channel(fabric: LoopbackFabric, rank: int = 0, peer: int = 0) -> NcclChannel:
    channel = NcclChannel(lambda: fabric.comm(rank), peer=peer)
    channel.open(deadline_s=2.0)
    return channel


def test_pages_move_to_self_bit_exact_in_chunks() -> None:
    decode, fabric = Decode(), LoopbackFabric()
    dest, kv = decode.reserve(7), _kv(7)
    channel = _channel(fabric)
    assert transfer_to_self(channel, decode.receiver, nccl_chunks(dest, kv, EPOCH, pages_per_chunk=3), 5.0) == ""
    for i, page_id in enumerate(dest.dest_page_ids):
        assert torch.equal(decode.pool.read_page(page_id), kv[i])
    assert dest.transfer_id in decode.book.completed and not decode.released
    assert channel.state is ChannelState.READY and channel.bytes_sent == kv.numel() * 2


def test_a_forged_token_or_stale_epoch_posts_no_recv_and_keeps_the_reservation() -> None:
    decode, fabric = Decode(), LoopbackFabric()
    dest = decode.reserve(2)
    forged = KVDestination(dest.address, dest.req_id, dest.transfer_id, b"x" * 16, dest.epoch, dest.dest_page_ids)
    header, _ = next(nccl_chunks(forged, _kv(2), EPOCH))
    with pytest.raises(TransferError, match="refused"):
        decode.receiver.prepare(header)
    header, _ = next(nccl_chunks(dest, _kv(2), EPOCH - 1))
    with pytest.raises(TransferError, match="refused"):
        decode.receiver.prepare(header)
    assert decode.book.refused_bad_token == 1 and decode.book.refused_stale_epoch == 1
    assert decode.book.get(dest.transfer_id) is not None and not decode.released
    assert not fabric.queues


def test_corruption_on_the_wire_fails_the_checksum_and_releases_the_pages() -> None:
    decode, fabric = Decode(), LoopbackFabric()
    dest = decode.reserve(4)
    fabric.flip = True
    error = transfer_to_self(_channel(fabric), decode.receiver, nccl_chunks(dest, _kv(4), EPOCH), 5.0)
    assert error == "checksum mismatch"
    assert [r.transfer_id for r in decode.released] == [dest.transfer_id]
    assert decode.pool.pages.num_free == decode.pool.num_pages - 5


def test_a_stalled_peer_is_aborted_at_the_deadline_and_the_channel_is_dead() -> None:
    decode, fabric = Decode(), LoopbackFabric()
    dest = decode.reserve(3)
    channel = _channel(fabric)
    fabric.stall = True
    error = transfer_to_self(channel, decode.receiver, nccl_chunks(dest, _kv(3), EPOCH), 0.2)
    assert error == "deadline exceeded"
    assert channel.state is ChannelState.ABORTED and fabric.aborted == [0]
    assert [r.transfer_id for r in decode.released] == [dest.transfer_id]
    with pytest.raises(TransferError, match="aborted"):
        channel.run([torch.zeros(4)], [], 1.0)


def test_rendezvous_that_never_completes_fails_within_its_deadline() -> None:
    never = threading.Event()

    def connect():  # type: ignore[no-untyped-def]
        never.wait(5.0)
        raise AssertionError("unreachable")

    channel = NcclChannel(connect, peer=1)
    with pytest.raises(TransferError, match="rendezvous deadline"):
        channel.open(deadline_s=0.1)
    assert channel.state is ChannelState.ABORTED
    never.set()


def test_two_ranks_send_and_receive_from_their_own_threads() -> None:
    decode, fabric = Decode(), LoopbackFabric()
    dest, kv = decode.reserve(5), _kv(5, seed=3)
    sender, receiver = _channel(fabric, rank=0, peer=1), _channel(fabric, rank=1, peer=0)
    chunks = list(nccl_chunks(dest, kv, EPOCH, pages_per_chunk=2))
    # The headers cross on the control channel; each side posts its own half of the group.
    staging = [decode.receiver.prepare(h) for h, _ in chunks]
    thread = threading.Thread(target=sender.run, args=([b for _, b in chunks], [], 5.0))
    thread.start()
    receiver.run([], staging, 5.0)
    thread.join()
    for (header, _), buf in zip(chunks, staging, strict=True):
        decode.receiver.finish(header, buf)
    assert dest.transfer_id in decode.book.completed
    assert receiver.bytes_received == sender.bytes_sent == kv.numel() * 2


@pytest.mark.parametrize(("i", "j"), [(3, 9), (3, 3 + 16), (5, 16 * 7 + 2), (0, 299)])
def test_device_digest_sees_a_swap_of_two_words_in_a_row_a_column_or_neither(i: int, j: int) -> None:
    x = torch.arange(300, dtype=torch.int32) * 7 + 1  # 300 words: rows of 16, the last padded
    y = x.clone()
    y[[i, j]] = y[[j, i]]
    assert device_digest(x, width=16) != device_digest(y, width=16)
    assert device_digest(x, width=16) == device_digest(x.clone(), width=16)
    z = x.clone()
    z[i] ^= 1 << 30
    assert device_digest(z, width=16) != device_digest(x, width=16)
