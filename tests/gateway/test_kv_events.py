"""vLLM's KV events into baton's page hashes: the decoder and the mapping through the synchronous
`handle()`, and a real ZMQ PUB socket publishing exactly as vLLM's ZmqEventPublisher does for the
subscriber's own loop (slow joiner handled by probing, never by sleeping)."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence

import msgpack  # type: ignore[import-untyped]
import pytest
import zmq
import zmq.utils.monitor

from cluster.gateway.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventSubscriber,
    MalformedEvent,
    check_address,
    decode_batch,
    tier_of,
)
from kvcache.events import Tier
from kvcache.hashing import model_fingerprint, page_hashes

pytestmark = pytest.mark.timeout(10)

BS = 4
TOPIC = "kv-events"
ENDPOINT = "vllm-a"
FP = model_fingerprint("test-model", "bf16")
TOKENS = list(range(1000, 1000 + 4 * BS))  # four full blocks


# -- an encoder mirroring vLLM's (msgspec, array_like + tag, omit_defaults) -------------------

STORED_NAMES = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind")
REMOVED_NAMES = ("block_hashes", "medium", "group_idx")


def vllm_hashes(first: int, n: int, as_int: bool) -> list[int | bytes]:
    """vLLM's block hashes: sha256 bytes, or (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES) their low 64
    bits as an unsigned int."""
    digests = [hashlib.sha256(f"block {i}".encode()).digest() for i in range(first, first + n)]
    return [int.from_bytes(d, "big") & ((1 << 64) - 1) if as_int else d for d in digests]


def stored(hashes: Sequence[object], parent: object, tokens: Sequence[object], *tail: object,
           block_size: object = BS) -> list[object]:
    """BlockStored as an array; `tail` is lora_id, medium, lora_name, ... (absent: omitted)."""
    return ["BlockStored", list(hashes), parent, list(tokens), block_size, *tail]


def removed(hashes: Sequence[object], *tail: object) -> list[object]:
    return ["BlockRemoved", list(hashes), *tail]


def cleared() -> list[object]:
    return ["AllBlocksCleared"]


def as_map(event: list[object]) -> dict[str, object]:
    """The same event as vLLM encodes it since its PR 42892: a map tagged under "type"."""
    names = STORED_NAMES if event[0] == "BlockStored" else REMOVED_NAMES
    return {"type": event[0], **dict(zip(names, event[1:], strict=False))}


def batch(*events: object, dp_rank: int | None = 0) -> bytes:
    body: list[object] = [time.time(), list(events)]
    payload: bytes = msgpack.packb(body if dp_rank is None else [*body, dp_rank])
    return payload


def message(seq: int, payload: bytes, topic: str = TOPIC) -> list[bytes]:
    return [topic.encode(), seq.to_bytes(8, "big"), payload]


class RecordingSink:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, tuple[bytes, ...], Tier | None]] = []
        self.changed = asyncio.Event()

    def stored(self, endpoint: str, page_hashes: Sequence[bytes], tier: Tier) -> None:
        self._record(("stored", endpoint, tuple(page_hashes), tier))

    def removed(self, endpoint: str, page_hashes: Sequence[bytes], tier: Tier) -> None:
        self._record(("removed", endpoint, tuple(page_hashes), tier))

    def cleared(self, endpoint: str) -> None:
        self._record(("cleared", endpoint, (), None))

    def _record(self, call: tuple[str, str, tuple[bytes, ...], Tier | None]) -> None:
        self.calls.append(call)
        self.changed.set()

    def kinds(self) -> list[str]:
        return [call[0] for call in self.calls]


class Feed:
    """Drives a subscriber's handle() with consecutive seqs, as one publisher would."""

    def __init__(self, sub: KVEventSubscriber) -> None:
        self.sub, self.seq = sub, 0

    def __call__(self, *events: object, **kw: int | None) -> None:
        self.sub.handle(message(self.seq, batch(*events, **kw)))
        self.seq += 1


@pytest.fixture
def sink() -> RecordingSink:
    return RecordingSink()


@pytest.fixture
def sub(sink: RecordingSink) -> KVEventSubscriber:
    return KVEventSubscriber(ENDPOINT, "tcp://127.0.0.1:5557", TOPIC, sink, BS, FP)


@pytest.fixture
def feed(sub: KVEventSubscriber) -> Feed:
    return Feed(sub)


def baton(tokens: Sequence[int]) -> tuple[bytes, ...]:
    return tuple(page_hashes(tokens, BS, b"", FP))


# -- decoding and mapping, through handle() ------------------------------------------------------

@pytest.mark.parametrize("as_int", [True, False], ids=["int-hashes", "bytes-hashes"])
@pytest.mark.parametrize("encode", [lambda e: e, as_map], ids=["array", "map"])
@pytest.mark.parametrize("dp_rank", [0, None], ids=["dp-rank", "no-dp-rank"])
def test_stored_blocks_get_the_page_hashes_a_prompt_has(
    sink: RecordingSink, sub: KVEventSubscriber, feed: Feed, as_int: bool,
    encode: Callable[[list[object]], object], dp_rank: int | None
) -> None:
    feed(encode(stored(vllm_hashes(0, 2, as_int), None, TOKENS[: 2 * BS], None, "GPU")),
         dp_rank=dp_rank)

    assert sink.calls == [("stored", ENDPOINT, baton(TOKENS[: 2 * BS]), Tier.DEVICE)]
    assert sub.stats() == {"messages": 1, "events": 1, "gaps": 0, "reconnects": 0}


# Golden payloads: vLLM's structs (vllm/distributed/kv_events.py, fields up to
# kv_cache_spec_sliding_window) encoded by msgspec 0.23, a batch of BlockStored(blocks 0-1, GPU,
# extra_keys [None, None], group 0, "full_attention"), BlockStored(blocks 2-3, parent block 1),
# BlockRemoved(block 3), AllBlocksCleared, over TOKENS with BS 4. The tagged-array encoding
# (vLLM through 0.23; msgspec writes every field, None included) with int hashes, and the
# tagged-map one (since vLLM's PR 42892; fields at their default left out) with bytes hashes.
VLLM_ARRAY_INT_HASHES = bytes.fromhex(
    "93cb41dac5598a86f310949cab426c6f636b53746f72656492cf37077017bbe0e947cfb278992a3967c67fc0"
    "98cd03e8cd03e9cd03eacd03ebcd03eccd03edcd03eecd03ef04c0a3475055c092c0c000ae66756c6c5f6174"
    "74656e74696f6ec09cab426c6f636b53746f72656492cf7c8b78de5eed6ea5cfbbf70ea67de45aabcfb27899"
    "2a3967c67f98cd03f0cd03f1cd03f2cd03f3cd03f4cd03f5cd03f6cd03f704c0a3475055c0c0c0c0c094ac42"
    "6c6f636b52656d6f76656491cfbbf70ea67de45aaba3475055c091b0416c6c426c6f636b73436c6561726564"
    "00")
VLLM_MAP_BYTES_HASHES = bytes.fromhex(
    "93cb41dac5598a88f319948ba474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392c4"
    "20b280d41aeb995be37ebe7594ca13036fefa9d29b194015a137077017bbe0e947c420cabdbdfa02c612a965"
    "2e5e4965db9180b25e68ffcdb4deb4b278992a3967c67fb1706172656e745f626c6f636b5f68617368c0a974"
    "6f6b656e5f69647398cd03e8cd03e9cd03eacd03ebcd03eccd03edcd03eecd03efaa626c6f636b5f73697a65"
    "04a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0aa65787472615f6b65797392"
    "c0c0a967726f75705f69647800b26b765f63616368655f737065635f6b696e64ae66756c6c5f617474656e74"
    "696f6e88a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392c4203c2001aacceab2"
    "01c95baff79bd10da83adf2ee27bf846777c8b78de5eed6ea5c420567744ae5cd2f67aa5ed24d01eb161c743"
    "c9bd6c62df2d07bbf70ea67de45aabb1706172656e745f626c6f636b5f68617368c420cabdbdfa02c612a965"
    "2e5e4965db9180b25e68ffcdb4deb4b278992a3967c67fa9746f6b656e5f69647398cd03f0cd03f1cd03f2cd"
    "03f3cd03f4cd03f5cd03f6cd03f7aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da347"
    "5055a96c6f72615f6e616d65c083a474797065ac426c6f636b52656d6f766564ac626c6f636b5f6861736865"
    "7391c420567744ae5cd2f67aa5ed24d01eb161c743c9bd6c62df2d07bbf70ea67de45aaba66d656469756da3"
    "47505581a474797065b0416c6c426c6f636b73436c656172656400")


@pytest.mark.parametrize("payload", [VLLM_ARRAY_INT_HASHES, VLLM_MAP_BYTES_HASHES],
                         ids=["array-int-hashes", "map-bytes-hashes"])
def test_payloads_msgspec_encoded_from_vllms_structs(
    sink: RecordingSink, sub: KVEventSubscriber, payload: bytes
) -> None:
    sub.handle(message(0, payload))

    assert sink.calls == [("stored", ENDPOINT, baton(TOKENS)[:2], Tier.DEVICE),
                          ("stored", ENDPOINT, baton(TOKENS)[2:], Tier.DEVICE),
                          ("removed", ENDPOINT, baton(TOKENS)[3:], Tier.DEVICE),
                          ("cleared", ENDPOINT, (), None)]


@pytest.mark.parametrize("as_int", [True, False], ids=["int-hashes", "bytes-hashes"])
def test_a_parent_from_an_earlier_message_continues_the_chain(
    sink: RecordingSink, feed: Feed, as_int: bool
) -> None:
    first, second = vllm_hashes(0, 2, as_int), vllm_hashes(2, 2, as_int)
    feed(stored(first, None, TOKENS[: 2 * BS], None, "GPU"))
    feed(stored(second, first[-1], TOKENS[2 * BS :], None, "GPU"))

    assert sink.calls[0][2] + sink.calls[1][2] == baton(TOKENS)


def test_omitted_defaults_and_newer_trailing_fields_are_both_read(
    sink: RecordingSink, sub: KVEventSubscriber, feed: Feed
) -> None:
    h = vllm_hashes(0, 3, as_int=True)
    feed(stored(h[:1], None, TOKENS[:BS]),  # vLLM's first shape: no lora_id, no medium
         stored(h[1:2], h[0], TOKENS[BS : 2 * BS], None, "GPU", None, [None], 0,
                "full_attention", None, "a field of a vLLM yet to come"),
         as_map(stored(h[2:], h[1], TOKENS[2 * BS : 3 * BS], None, "GPU", None, None, 0)),
         removed(h[2:]))  # medium omitted

    assert [c[0] for c in sink.calls] == ["stored", "stored", "stored", "removed"]
    assert b"".join(b for c in sink.calls[:3] for b in c[2]) == b"".join(baton(TOKENS[: 3 * BS]))
    assert sink.calls[3] == ("removed", ENDPOINT, baton(TOKENS[: 3 * BS])[2:], Tier.DEVICE)
    assert sub.stats()["events"] == 4


def test_removed_and_cleared_forget_the_blocks(
    sink: RecordingSink, sub: KVEventSubscriber, feed: Feed
) -> None:
    h = vllm_hashes(0, 4, as_int=True)
    feed(stored(h[:2], None, TOKENS[: 2 * BS], None, "GPU"))
    feed(removed(h[1:2] + vllm_hashes(50, 1, as_int=True), "GPU"))  # one unknown: skipped
    assert sink.calls[-1] == ("removed", ENDPOINT, baton(TOKENS[: 2 * BS])[1:], Tier.DEVICE)

    feed(stored(h[2:3], h[1], TOKENS[2 * BS : 3 * BS], None, "GPU"))  # its parent is gone
    assert sub.stats()["dropped_unknown_parent"] == 1

    feed(cleared())
    feed(stored(h[1:2], h[0], TOKENS[BS : 2 * BS], None, "GPU"))  # cleared: h[0] unknown too
    assert sink.kinds() == ["stored", "removed", "cleared"]
    assert sub.stats()["dropped_unknown_parent"] == 2


@pytest.mark.parametrize(("medium", "tier"), [
    (None, Tier.DEVICE), ("GPU", Tier.DEVICE), ("cuda", Tier.DEVICE), ("CPU", Tier.HOST),
    ("cpu", Tier.HOST), ("DISK", Tier.DISK), ("disk", Tier.DISK), ("LMCache", Tier.DEVICE)])
def test_medium_becomes_a_tier(sink: RecordingSink, feed: Feed, medium: str | None,
                               tier: Tier) -> None:
    assert tier_of(medium) is tier
    feed(stored(vllm_hashes(0, 1, as_int=True), None, TOKENS[:BS], None, medium))
    assert sink.calls == [("stored", ENDPOINT, baton(TOKENS[:BS]), tier)]


def test_a_block_held_in_two_tiers_stays_known_until_both_drop_it(
    sink: RecordingSink, sub: KVEventSubscriber, feed: Feed
) -> None:
    h = vllm_hashes(0, 2, as_int=True)
    feed(stored(h[:1], None, TOKENS[:BS], None, "GPU"),
         stored(h[:1], None, TOKENS[:BS], None, "CPU"))
    feed(removed(h[:1], "GPU"))
    feed(stored(h[1:], h[0], TOKENS[BS : 2 * BS], None, "CPU"))  # h[0] still known: in CPU
    feed(removed(h[:1], "CPU"), removed(h[:1], "CPU"))  # the second names nothing known

    page = baton(TOKENS[:BS])
    assert sink.calls[2] == ("removed", ENDPOINT, page, Tier.DEVICE)
    assert sink.calls[3] == ("stored", ENDPOINT, baton(TOKENS[: 2 * BS])[1:], Tier.HOST)
    assert sink.calls[4:] == [("removed", ENDPOINT, page, Tier.HOST)]


@pytest.mark.parametrize(("event", "reason"), [
    (stored(vllm_hashes(0, 1, True), None, TOKENS[:BS], 3, "GPU"), "lora"),
    (stored(vllm_hashes(0, 1, True), None, TOKENS[:BS], None, "GPU", "adapter"), "lora"),
    (stored(vllm_hashes(0, 1, True), None, TOKENS[: 2 * BS], None, "GPU", block_size=2 * BS),
     "block_size"),
    (stored(vllm_hashes(0, 1, True), None, TOKENS[:BS], None, "GPU", None, None, 1), "group"),
    (removed(vllm_hashes(0, 1, True), "GPU", 1), "group"),
    (stored(vllm_hashes(0, 1, True), None, TOKENS[:BS], None, "GPU", None, [["tenant-a"]]),
     "extra_keys"),
    (stored(vllm_hashes(1, 1, True), vllm_hashes(0, 1, True)[0], TOKENS[:BS], None, "GPU"),
     "unknown_parent"),
], ids=["lora-id", "lora-name", "block-size", "group", "removed-group", "extra-keys",
        "unknown-parent"])
def test_blocks_no_base_model_prompt_can_match_are_dropped_and_counted(
    sink: RecordingSink, sub: KVEventSubscriber, feed: Feed, event: list[object], reason: str
) -> None:
    feed(event)
    assert sink.calls == []
    assert sub.stats() == {"messages": 1, "events": 0, "gaps": 0, "reconnects": 0,
                           f"dropped_{reason}": 1}


def test_the_map_is_bounded_and_forgets_its_least_recently_used(sink: RecordingSink) -> None:
    sub = KVEventSubscriber(ENDPOINT, "tcp://127.0.0.1:5557", TOPIC, sink, BS, FP, max_blocks=2)
    feed, h = Feed(sub), vllm_hashes(0, 4, as_int=True)
    feed(stored(h[:3], None, TOKENS[: 3 * BS]))  # h[0] pushed out
    feed(stored(h[3:], h[0], TOKENS[3 * BS :]))
    feed(stored(h[3:], h[2], TOKENS[3 * BS :]))
    assert sub.stats()["dropped_unknown_parent"] == 1
    assert sink.calls[-1][2] == baton(TOKENS)[3:]


@pytest.mark.parametrize("next_seq", [3, 0], ids=["lost-messages", "publisher-restarted"])
def test_a_seq_gap_clears_the_endpoint(
    sink: RecordingSink, sub: KVEventSubscriber, next_seq: int
) -> None:
    h = vllm_hashes(0, 2, as_int=True)
    sub.handle(message(0, batch(stored(h[:1], None, TOKENS[:BS]))))
    sub.handle(message(1, batch(cleared(), stored(h[:1], None, TOKENS[:BS]))))
    sub.handle(message(next_seq, batch(stored(h[1:], h[0], TOKENS[BS : 2 * BS]))))

    assert sink.kinds() == ["stored", "cleared", "stored", "cleared"]
    assert sub.stats() == {"messages": 3, "events": 3, "gaps": 1, "reconnects": 0,
                           "dropped_unknown_parent": 1}


MALFORMED = {
    "not-msgpack": b"\xc1",
    "truncated": batch(cleared())[:-1],
    "trailing-data": batch(cleared()) + b"\x00",
    "ext-type": msgpack.packb([time.time(), [msgpack.ExtType(5, b"x")]]),
    "empty-ext-type": msgpack.packb([time.time(), [msgpack.ExtType(5, b"")]]),
    "timestamp-ext": msgpack.packb([msgpack.Timestamp(1, 0), []]),
    "bad-utf8": b"\x92\xcb" + b"\x00" * 8 + b"\x91\x91\xa2\xff\xfe",
    "int-map-key": msgpack.packb([time.time(), [{1: "BlockStored"}]]),
    "batch-not-array": msgpack.packb(5),
    "batch-without-events": msgpack.packb([time.time()]),
    "events-not-list": msgpack.packb([time.time(), "events"]),
    "ts-not-number": msgpack.packb(["now", []]),
    "unknown-tag": batch(["BlockMoved", [1]]),
    "tag-not-str": batch([7, [1]]),
    "empty-event": batch([]),
    "map-without-required": batch({"type": "BlockStored", "block_hashes": [1]}),
    "missing-fields": batch(["BlockStored", [1], None, TOKENS[:BS]]),
    "block-size-str": batch(stored([1], None, TOKENS[:BS], block_size="4")),
    "block-size-bool": batch(stored([1], None, [1], block_size=True)),
    "block-size-zero": batch(stored([1], None, [], block_size=0)),
    "block-size-huge": batch(stored([1], None, [1] * 4097, block_size=4097)),
    "hashes-not-list": batch(["BlockStored", b"\x01", None, TOKENS[:BS], BS]),
    "no-hashes": batch(stored([], None, [])),
    "hash-float": batch(stored([1.5], None, TOKENS[:BS])),
    "hash-65-bytes": batch(stored([b"x" * 65], None, TOKENS[:BS])),
    "hash-empty-bytes": batch(removed([b""])),
    "parent-str": batch(stored([1], "0x1", TOKENS[:BS])),
    "tokens-not-list": batch(["BlockStored", [1], None, b"\x01\x02\x03\x04", BS]),
    "negative-token": batch(stored([1], None, [1, 2, -3, 4])),
    "token-2**31": batch(stored([1], None, [1, 2, 1 << 31, 4])),
    "token-float": batch(stored([1], None, [1, 2, 3.0, 4])),
    "token-bool": batch(stored([1], None, [1, 2, True, 4])),
    "tokens-short": batch(stored([1, 2], None, TOKENS[: 2 * BS - 1])),
    "tokens-long": batch(stored([1], None, TOKENS[: BS + 1])),
    "lora-id-str": batch(stored([1], None, TOKENS[:BS], "3")),
    "medium-int": batch(removed([1], 1)),
    "extra-keys-not-list": batch(stored([1], None, TOKENS[:BS], None, None, None, "salt")),
}


@pytest.mark.parametrize("payload", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_payloads_are_refused(payload: bytes) -> None:
    with pytest.raises(MalformedEvent):
        decode_batch(payload)


def test_each_bad_message_is_dropped_and_counted_and_good_ones_still_apply(
    sink: RecordingSink, caplog: pytest.LogCaptureFixture
) -> None:
    sub = KVEventSubscriber(ENDPOINT, "tcp://127.0.0.1:5557", TOPIC, sink, BS, FP,
                            max_message_bytes=16 << 10)
    oversize = batch(stored(vllm_hashes(0, 1, True), None, TOKENS[:BS], None, "x" * (17 << 10)))
    caplog.set_level(logging.WARNING, logger="cluster.gateway.kv_events")
    seq = 0
    for payload in MALFORMED.values():
        sub.handle(message(seq, payload))
        seq += 1
    sub.handle(message(seq, oversize))
    good = batch(stored(vllm_hashes(0, 1, True), None, TOKENS[:BS]))
    sub.handle([TOPIC.encode(), (seq + 1).to_bytes(8, "big")])  # 2 frames
    sub.handle([*message(seq + 1, good), b""])  # 4 frames
    sub.handle([TOPIC.encode(), (seq + 1).to_bytes(7, "big"), good])  # a 7-byte seq
    sub.handle(message(seq + 1, good, topic=TOPIC + "-other"))  # SUBSCRIBE matched the prefix
    sub.handle(message(seq + 1, good))

    assert sink.calls == [("stored", ENDPOINT, baton(TOKENS[:BS]), Tier.DEVICE)]
    assert sub.stats() == {"messages": 1, "events": 1, "gaps": 0, "reconnects": 0,
                           "dropped_malformed": len(MALFORMED), "dropped_oversize": 1,
                           "dropped_frames": 2, "dropped_seq": 1, "dropped_topic": 1}
    # rate-limited: one line per reason, however many messages had it
    reasons = sorted(r.getMessage().split(": ")[1] for r in caplog.records)
    assert reasons == ["frames", "malformed", "oversize", "seq", "topic"]


class FailOnceSink(RecordingSink):
    def stored(self, endpoint: str, page_hashes: Sequence[bytes], tier: Tier) -> None:
        super().stored(endpoint, page_hashes, tier)
        if len(self.calls) == 1:
            raise RuntimeError("index unavailable")


def test_a_failing_sink_does_not_end_the_subscription() -> None:
    sink = FailOnceSink()
    sub = KVEventSubscriber(ENDPOINT, "tcp://127.0.0.1:5557", TOPIC, sink, BS, FP)
    feed = Feed(sub)
    feed(stored(vllm_hashes(0, 1, True), None, TOKENS[:BS]))
    feed(stored(vllm_hashes(1, 1, True), None, TOKENS[:BS]))
    assert sink.kinds() == ["stored", "stored"]
    assert sub.stats() == {"messages": 1, "events": 1, "gaps": 0, "reconnects": 0,
                           "dropped_error": 1}


def test_decode_batch_returns_typed_events() -> None:
    digest = hashlib.sha256(b"block 0").digest()
    events = decode_batch(batch(stored([digest], None, TOKENS[:BS], None, "CPU"), removed([-1]),
                                cleared()))
    assert events == [
        BlockStored((digest,), None, tuple(TOKENS[:BS]), BS, Tier.HOST, is_lora=False,
                    has_extra_keys=False, group_idx=None),
        BlockRemoved((b"\xff" * 8,), Tier.DEVICE, None),  # signed -1 == unsigned 2**64 - 1
        AllBlocksCleared(),
    ]


@pytest.mark.parametrize("address", [
    "tcp://127.0.0.1:5557", "tcp://[::1]:5557", "tcp://vllm-0.vllm.svc.cluster.local:5557",
    "tcp://localhost:1", "tcp://engine:65535"])
def test_addresses_accepted(address: str) -> None:
    check_address(address)


@pytest.mark.parametrize("address", [
    "ipc:///tmp/kv", "inproc://kv", "tcp://*:5557", "tcp://127.0.0.1", "tcp://127.0.0.1:0",
    "tcp://127.0.0.1:65536", "tcp://::1:5557", "tcp://[vllm]:5557", "tcp://[127.0.0.1]:5557",
    "tcp://eth0;10.0.0.1:5557", "tcp://-bad.example:5557", "tcp://a..b:5557",
    "tcp://999.1.1.1:5557", "tcp://host_name:5557", "tcp://10.0.0.1:5557/x", "udp://h:5557",
    " tcp://h:5557"])
def test_addresses_refused_at_construction(sink: RecordingSink, address: str) -> None:
    with pytest.raises(ValueError):
        KVEventSubscriber(ENDPOINT, address, TOPIC, sink, BS, FP)


@pytest.mark.parametrize("block_size", [0, 4097])
def test_block_size_out_of_range_is_a_config_error(sink: RecordingSink, block_size: int) -> None:
    with pytest.raises(ValueError):
        KVEventSubscriber(ENDPOINT, "tcp://127.0.0.1:5557", TOPIC, sink, block_size, FP)


# -- over a real ZMQ socket -----------------------------------------------------------------------

class Publisher:
    """vLLM's side: a PUB socket bound on loopback sending [topic, seq, payload]."""

    def __init__(self) -> None:
        self.sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        port: int = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.address, self.seq = f"tcp://127.0.0.1:{port}", 0
        self.monitor: zmq.Socket[bytes] = self.sock.get_monitor_socket(
            zmq.EVENT_DISCONNECTED, f"inproc://test-kv-events-publisher-{port}")

    def send(self, payload: bytes) -> None:
        self.sock.send_multipart(message(self.seq, payload))
        self.seq += 1

    async def send_until(self, payload: bytes, sink: RecordingSink, kind: str) -> None:
        """Send `payload` again (a new seq each time) until the sink records `kind`: the SUB
        joins, or rejoins, at a moment the PUB cannot know, and misses what was sent before."""
        for _ in range(400):
            sink.changed.clear()
            self.send(payload)
            try:
                await asyncio.wait_for(sink.changed.wait(), 0.02)
            except TimeoutError:
                continue
            if kind in sink.kinds():
                return
        raise AssertionError(f"the subscriber never recorded {kind!r}")


async def wait_for_call(sink: RecordingSink, predicate: Callable[[], bool]) -> None:
    async def until() -> None:
        while not predicate():
            sink.changed.clear()
            await sink.changed.wait()
    await asyncio.wait_for(until(), 5)


@pytest.fixture
def publisher() -> Iterator[Publisher]:
    pub = Publisher()
    yield pub
    pub.sock.disable_monitor()
    pub.monitor.close(linger=0)
    pub.sock.close(linger=0)


async def test_events_over_zmq_reach_the_sink_past_bad_messages(
    publisher: Publisher, sink: RecordingSink
) -> None:
    sub = KVEventSubscriber(ENDPOINT, publisher.address, TOPIC, sink, BS, FP)
    task = asyncio.create_task(sub.run())
    try:
        await publisher.send_until(batch(cleared()), sink, "cleared")
        h = vllm_hashes(0, 4, as_int=True)
        publisher.send(batch(stored(h[:2], None, TOKENS[: 2 * BS], None, "GPU")))
        publisher.send(b"\xc1")  # not msgpack
        publisher.send(MALFORMED["ext-type"])
        publisher.sock.send_multipart([TOPIC.encode(), b"\x00" * 8])  # 2 frames
        publisher.send(batch(stored(h[2:], h[1], TOKENS[2 * BS :], None, "GPU")))
        publisher.send(batch(removed(h[3:], "GPU")))
        await wait_for_call(sink, lambda: sink.kinds()[-1:] == ["removed"])
    finally:
        task.cancel()

    stored_pages = [call[2] for call in sink.calls if call[0] == "stored"]
    assert b"".join(b for pages in stored_pages for b in pages) == b"".join(baton(TOKENS))
    assert sink.calls[-1] == ("removed", ENDPOINT, baton(TOKENS)[3:], Tier.DEVICE)
    stats = sub.stats()
    assert (stats["dropped_malformed"], stats["dropped_frames"], stats["gaps"]) == (2, 1, 0)
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_an_oversize_frame_is_dropped_by_libzmq_and_seen_as_a_gap(
    publisher: Publisher, sink: RecordingSink
) -> None:
    sub = KVEventSubscriber(ENDPOINT, publisher.address, TOPIC, sink, BS, FP,
                            max_message_bytes=64 << 10)
    task = asyncio.create_task(sub.run())
    try:
        await publisher.send_until(batch(cleared()), sink, "cleared")
        big = batch(stored(vllm_hashes(0, 1, True), None, TOKENS[:BS], None, "x" * (80 << 10)))
        publisher.send(big)  # libzmq drops it, and the connection: the SUB reconnects
        sink.calls.clear()
        good = batch(stored(vllm_hashes(0, 1, True), None, TOKENS[:BS], None, "GPU"))
        await publisher.send_until(good, sink, "stored")
    finally:
        task.cancel()

    assert sink.calls[:2] == [("cleared", ENDPOINT, (), None),  # the gap: the map was stale
                              ("stored", ENDPOINT, baton(TOKENS[:BS]), Tier.DEVICE)]
    stats = sub.stats()
    assert stats["gaps"] == 1 and stats["reconnects"] >= 1
    with pytest.raises(asyncio.CancelledError):
        await task


def assert_disconnected(publisher: Publisher) -> None:
    """The subscriber's socket is closed: the PUB side sees its connection go."""
    event = zmq.utils.monitor.recv_monitor_message(publisher.monitor)  # the PUB is not asyncio
    assert event["event"] == zmq.EVENT_DISCONNECTED


@pytest.mark.parametrize("stop", ["cancel", "close"])
async def test_cancel_or_close_ends_run_and_closes_the_socket(
    publisher: Publisher, sink: RecordingSink, stop: str
) -> None:
    sub = KVEventSubscriber(ENDPOINT, publisher.address, TOPIC, sink, BS, FP)
    task = asyncio.create_task(sub.run())
    await publisher.send_until(batch(cleared()), sink, "cleared")
    assert publisher.monitor.poll(0) == 0  # connected, and still so
    if stop == "cancel":
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    else:
        sub.close()
        await asyncio.wait_for(task, 5)  # returns, rather than raising
    assert publisher.monitor.poll(5000)
    assert_disconnected(publisher)
