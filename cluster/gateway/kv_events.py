"""An external vLLM engine's KV-cache events, read as data, into the gateway's prefix index.

vLLM run with `--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://*:5557", "topic": "kv-events"}'` publishes one multipart message per scheduler
step on a ZMQ PUB socket (shapes from vllm/distributed/kv_events.py, ZmqEventPublisher):

    [topic, seq: 8-byte big-endian int (0, 1, 2, ... per publisher), payload: msgpack]

The payload is a msgspec-encoded KVEventBatch, `[ts, events, data_parallel_rank]` (older vLLM
has no rank; a map with those keys is read too). Each event is tagged by its class name: an array
of every field in declaration order through vLLM 0.23 (`array_like=True`), a map with the tag
under "type" and fields at their default left out since vLLM's PR 42892. Fields vLLM added over
time may be absent (older vLLM); fields this module does not know are ignored (newer vLLM):

    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
                    lora_id, medium, lora_name, extra_keys, group_idx, ...]
    ["BlockRemoved", block_hashes, medium, group_idx]
    ["AllBlocksCleared"]

A block hash is an int (unsigned 64-bit; signed in old vLLM) or bytes (a 32-byte sha256), made
bytes here; token_ids holds all the stored blocks' tokens, block after block. Decoding is data
only: no pickle, no msgpack ext type, every length bounded and every field checked, else
MalformedEvent and the message is dropped and counted.

Mapping. vLLM's hashes are its own (seed, hash function), so each stored block gets baton's page
hash, chained as a request's are (kvcache.hashing, salt b""):

    vLLM:   parent ----------- h1 ------------------------- h2     BlockStored([h1, h2], parent)
    baton:  map[parent] or ROOT_HASH -> p1 = page_hash(., tokens[:bs]) -> p2 = page_hash(p1, ...)

and an LRU of `max_blocks` remembers h1 -> p1, h2 -> p2, so a later BlockStored naming h2 as
parent continues the chain and a BlockRemoved names the pages. Blocks no base-model prompt can
match are dropped and counted: "lora", "block_size", "group" (another KV-cache group of a hybrid
model), "extra_keys" (a cache_salt or multimodal input is in vLLM's hash) and "unknown_parent"
(e.g. blocks stored before this subscriber joined).

Gaps. A seq other than the last plus one (lost messages, or the engine restarted) makes the map
stale: the endpoint's pages are cleared from the sink and the map starts over. vLLM's replay
ROUTER socket (`replay_endpoint`) could fill the gap instead; that is not implemented.
"""

from __future__ import annotations

import asyncio
import ipaddress
import itertools
import logging
import math
import re
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import msgpack  # type: ignore[import-untyped]
import zmq
import zmq.asyncio

from kvcache.events import Tier
from kvcache.hashing import ROOT_HASH, page_hash

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 4 << 20
MAX_EVENTS_PER_BATCH = 1 << 16
MAX_BLOCKS_PER_EVENT = 1 << 16
MAX_BLOCK_SIZE = 4096
MAX_HASH_BYTES = 64
TOKEN_ID_BOUND = 1 << 31
MAX_STR_LEN = 4096  # tags, media, LoRA names, extra keys' strings
MAX_BIN_LEN = 4096  # hashes (checked to MAX_HASH_BYTES), extra keys' bytes
MAX_MAP_LEN = 256
RECEIVE_BUDGET_BYTES = 256 << 20  # what queued messages may hold: RCVHWM * max_message_bytes
LOG_INTERVAL_S = 60.0

_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                  "medium", "lora_name", "extra_keys", "group_idx")
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
_MEDIA = {"cpu": Tier.HOST, "disk": Tier.DISK}  # anything else ("GPU", "cuda", None): DEVICE
_monitor_ids = itertools.count()
_DNS_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


class MalformedEvent(ValueError):
    """A message that is not a KV event batch of the shape above; its text says why."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: tuple[int, ...]  # len == block_size * len(block_hashes)
    block_size: int
    tier: Tier
    is_lora: bool
    has_extra_keys: bool
    group_idx: int | None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[bytes, ...]
    tier: Tier
    group_idx: int | None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


BlockEvent = BlockStored | BlockRemoved | AllBlocksCleared


class PageSink(Protocol):
    def stored(self, endpoint: str, page_hashes: Sequence[bytes], tier: Tier) -> None: ...
    def removed(self, endpoint: str, page_hashes: Sequence[bytes], tier: Tier) -> None: ...
    def cleared(self, endpoint: str) -> None: ...


def decode_batch(payload: bytes, max_bytes: int = MAX_MESSAGE_BYTES) -> list[BlockEvent]:
    """The events of one KVEventBatch payload, in order; MalformedEvent if any part is wrong."""
    if len(payload) > max_bytes:
        raise MalformedEvent(f"payload of {len(payload)} bytes is over {max_bytes}")
    try:
        raw = msgpack.unpackb(
            payload, raw=False, strict_map_key=True, use_list=True, ext_hook=_refuse_ext,
            max_ext_len=0, max_str_len=MAX_STR_LEN, max_bin_len=MAX_BIN_LEN,
            max_array_len=max_bytes, max_map_len=MAX_MAP_LEN)
    except (ValueError, msgpack.UnpackException) as exc:  # MalformedEvent from the hook too
        raise MalformedEvent(f"not a msgpack value: {exc}") from exc
    if isinstance(raw, list) and len(raw) >= 2:
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    elif isinstance(raw, dict) and "events" in raw:
        ts, events, rank = raw.get("ts"), raw["events"], raw.get("data_parallel_rank")
    else:
        raise MalformedEvent("batch is not [ts, events, ...]")
    if type(ts) not in (float, int) or not (rank is None or type(rank) is int):
        raise MalformedEvent("batch ts or data_parallel_rank has the wrong type")
    if not isinstance(events, list) or len(events) > MAX_EVENTS_PER_BATCH:
        raise MalformedEvent("batch events is not a list of bounded length")
    return [_decode_event(event) for event in events]


def tier_of(medium: str | None) -> Tier:
    return Tier.DEVICE if medium is None else _MEDIA.get(medium.lower(), Tier.DEVICE)


def _refuse_ext(code: int, data: bytes) -> object:
    raise MalformedEvent(f"msgpack ext type {code}")


def _decode_event(raw: object) -> BlockEvent:
    tag = None
    if isinstance(raw, list) and raw:
        tag = raw[0]
    elif isinstance(raw, dict):
        tag = raw.get("type")
    if tag == "BlockStored":
        f = _fields(raw, _STORED_FIELDS, 4)
        hashes, tokens = _hashes(f["block_hashes"]), f["token_ids"]
        block_size = _int(f["block_size"], "block_size", 1, MAX_BLOCK_SIZE)
        if not isinstance(tokens, list) or len(tokens) != block_size * len(hashes):
            raise MalformedEvent("token_ids is not block_size tokens per block")
        if not all(type(t) is int and 0 <= t < TOKEN_ID_BOUND for t in tokens):
            raise MalformedEvent("a token id is not an int in [0, 2**31)")
        extra_keys, lora_name = f["extra_keys"], _str(f["lora_name"], "lora_name")
        if extra_keys is not None and not isinstance(extra_keys, list):
            raise MalformedEvent("extra_keys is not a list")
        parent = None if f["parent_block_hash"] is None else _hash(f["parent_block_hash"])
        return BlockStored(
            hashes, parent, tuple(tokens), block_size, tier_of(_str(f["medium"], "medium")),
            is_lora=_int_or_none(f["lora_id"], "lora_id") is not None or lora_name is not None,
            has_extra_keys=any(key is not None for key in extra_keys or ()),
            group_idx=_int_or_none(f["group_idx"], "group_idx"))
    if tag == "BlockRemoved":
        f = _fields(raw, _REMOVED_FIELDS, 1)
        return BlockRemoved(_hashes(f["block_hashes"]), tier_of(_str(f["medium"], "medium")),
                            _int_or_none(f["group_idx"], "group_idx"))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise MalformedEvent(f"unknown event tag {str(tag)[:40]!r}")


def _fields(raw: object, names: tuple[str, ...], num_required: int) -> dict[str, object]:
    """An event's fields by name, None where absent; unknown trailing fields ignored."""
    if isinstance(raw, list):
        values = raw[1:]
        if len(values) < num_required:
            raise MalformedEvent(f"{raw[0]} has {len(values)} of {num_required} required fields")
        return {name: values[i] if i < len(values) else None for i, name in enumerate(names)}
    assert isinstance(raw, dict)
    if any(name not in raw for name in names[:num_required]):
        raise MalformedEvent(f"{raw['type']} lacks a required field")
    return {name: raw.get(name) for name in names}


def _hash(value: object) -> bytes:
    if type(value) is int:  # msgpack holds ints in [-2**63, 2**64): always 8 bytes
        return (value & ((1 << 64) - 1)).to_bytes(8, "big")  # signed or unsigned: same bytes
    if isinstance(value, bytes) and 0 < len(value) <= MAX_HASH_BYTES:
        return value
    raise MalformedEvent(f"a block hash is not an int or 1..{MAX_HASH_BYTES} bytes")


def _hashes(value: object) -> tuple[bytes, ...]:
    if not isinstance(value, list) or not 0 < len(value) <= MAX_BLOCKS_PER_EVENT:
        raise MalformedEvent(f"block_hashes is not a list of 1..{MAX_BLOCKS_PER_EVENT} hashes")
    return tuple(_hash(v) for v in value)


def _int(value: object, name: str, lo: int, hi: int) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise MalformedEvent(f"{name} is not an int in [{lo}, {hi}]")
    return value


def _int_or_none(value: object, name: str) -> int | None:
    return None if value is None else _int(value, name, -(1 << 63), (1 << 64) - 1)


def _str(value: object, name: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise MalformedEvent(f"{name} is not a string")
    return value


def check_address(address: str) -> None:
    """A PUB address to connect to: tcp://host:port, host a literal IP or a DNS name."""
    match = re.fullmatch(r"tcp://(\[[0-9A-Fa-f:.]+\]|[^\[\]:/;*]+):([0-9]{1,5})", address)
    if match is None or not 1 <= int(match[2]) <= 65535:
        raise ValueError(f"KV events address {address!r} is not tcp://host:port")
    host, labels = match[1], match[1].split(".")
    try:
        ipaddress.ip_address(host.removeprefix("[").removesuffix("]"))
        is_ip = host.startswith("[") == (":" in host)  # IPv6 in brackets, IPv4 without
    except ValueError:
        is_ip = False
    is_dns = (len(host) <= 253 and all(_DNS_LABEL.fullmatch(label) for label in labels)
              and not labels[-1].isdigit())
    if not (is_ip or is_dns):
        raise ValueError(f"KV events address {address!r}: {host!r} is no IP or DNS name")


class PageMapper:
    """One endpoint's vLLM block hash -> baton page hash, an LRU of `max_blocks` entries. An entry
    also keeps the tiers vLLM holds the block in, so removal from one tier keeps it for another."""

    def __init__(self, block_size: int, fingerprint: bytes, max_blocks: int) -> None:
        self.block_size, self.fingerprint, self.max_blocks = block_size, fingerprint, max_blocks
        self._pages: OrderedDict[bytes, tuple[bytes, int]] = OrderedDict()  # -> (page, tier bits)

    def store(self, event: BlockStored) -> list[bytes] | None:
        """Baton's hashes of the event's blocks; None when its parent is not known."""
        parent = ROOT_HASH
        if event.parent_block_hash is not None:
            entry = self._pages.get(event.parent_block_hash)
            if entry is None:
                return None
            self._pages.move_to_end(event.parent_block_hash)
            parent = entry[0]
        bs, out = self.block_size, []
        for i, block_hash in enumerate(event.block_hashes):
            tokens = event.token_ids[i * bs : (i + 1) * bs]
            parent = page_hash(parent, tokens, b"", self.fingerprint)
            _, tiers = self._pages.pop(block_hash, (b"", 0))
            self._pages[block_hash] = (parent, tiers | 1 << event.tier)
            out.append(parent)
        while len(self._pages) > self.max_blocks:
            self._pages.popitem(last=False)
        return out

    def remove(self, event: BlockRemoved) -> list[bytes]:
        """Baton's hashes of the known removed blocks; an entry goes once no tier holds it."""
        out = []
        for block_hash in event.block_hashes:
            entry = self._pages.get(block_hash)
            if entry is not None:
                out.append(entry[0])
                tiers = entry[1] & ~(1 << event.tier)
                if tiers:
                    self._pages[block_hash] = (entry[0], tiers)
                else:
                    del self._pages[block_hash]
        return out

    def clear(self) -> None:
        self._pages.clear()


class KVEventSubscriber:
    """One external endpoint's KV events into a PageSink: `run()` until cancelled or `close()`d.
    `handle(frames)` is the whole logic for one message; it never raises."""

    def __init__(self, endpoint: str, address: str, topic: str, sink: PageSink, block_size: int,
                 fingerprint: bytes, max_message_bytes: int = MAX_MESSAGE_BYTES,
                 max_blocks: int = 1 << 18) -> None:
        check_address(address)
        if not 1 <= block_size <= MAX_BLOCK_SIZE or max_message_bytes < 1 or max_blocks < 1:
            raise ValueError("KV events: block_size, max_message_bytes or max_blocks out of range")
        self.endpoint, self.address, self.topic, self.sink = endpoint, address, topic, sink
        self.max_message_bytes = max_message_bytes
        self.mapper = PageMapper(block_size, fingerprint, max_blocks)
        self._last_seq: int | None = None
        self._counts: Counter[str] = Counter()
        self._logged_at: dict[str, float] = {}
        self._is_closing = False
        self._pending: tuple[asyncio.Future[list[bytes]], ...] = ()

    async def run(self) -> None:
        sock = zmq.asyncio.Context.instance().socket(zmq.SUB)
        monitor: zmq.asyncio.Socket | None = None
        messages: asyncio.Future[list[bytes]] | None = None
        disconnects: asyncio.Future[list[bytes]] | None = None
        try:
            # a name of its own: pyzmq's default (from the socket's fd) can meet a closed socket's
            monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED,
                                              f"inproc://kv-events-monitor-{next(_monitor_ids)}")
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IPV6, 1)
            sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)  # libzmq drops larger frames
            sock.setsockopt(zmq.RCVHWM, max(16, RECEIVE_BUDGET_BYTES // self.max_message_bytes))
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 5000)
            sock.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
            sock.connect(self.address)
            while not self._is_closing:
                # (zmq.asyncio's Poller over these two sockets stops waking up once a few
                # subscribers have come and gone; two pending receives do not)
                messages = messages or asyncio.ensure_future(sock.recv_multipart())
                disconnects = disconnects or asyncio.ensure_future(monitor.recv_multipart())
                self._pending = (messages, disconnects)
                await asyncio.wait(self._pending, return_when=asyncio.FIRST_COMPLETED)
                if self._is_closing:
                    break
                if disconnects.done():
                    disconnects.result()
                    disconnects = None
                    self._reconnect(sock)
                if messages.done():
                    frames, messages = messages.result(), None
                    self.handle(frames)
        finally:
            for pending in (messages, disconnects):
                if pending is not None:
                    pending.cancel()
            if monitor is not None:
                sock.disable_monitor()
                monitor.close(linger=0)
            sock.close(linger=0)

    def _reconnect(self, sock: zmq.asyncio.Socket) -> None:
        """After a disconnect. libzmq reconnects by itself after a connection error, but not after
        a protocol error (a frame over MAXMSGSIZE among them): it ends that peer's session for
        good. So connect anew; the messages lost meanwhile show up as a seq gap."""
        self._counts["reconnects"] += 1
        self._log("disconnected", "reconnecting")
        try:
            sock.disconnect(self.address)
        except zmq.ZMQError:
            pass  # libzmq had ended the session already
        sock.connect(self.address)

    def close(self) -> None:
        """Ends `run()`, which closes the socket (cancelling its task does the same)."""
        self._is_closing = True
        for pending in self._pending:
            pending.cancel()

    def stats(self) -> dict[str, int]:
        """messages, events (applied), gaps, reconnects, and dropped_<reason> for each reason."""
        return {"messages": 0, "events": 0, "gaps": 0, "reconnects": 0, **self._counts}

    def handle(self, frames: Sequence[bytes]) -> None:
        try:
            self._handle(frames)
        except Exception:  # a sink's failure must not end the subscription
            self._drop("error", "applying a message failed", exc_info=True)

    def _handle(self, frames: Sequence[bytes]) -> None:
        if len(frames) != 3:
            self._drop("frames", f"{len(frames)} frames, not [topic, seq, payload]")
            return
        topic, seq_bytes, payload = frames
        if topic != self.topic.encode():  # SUBSCRIBE matches a prefix; the topic is exact
            self._drop("topic", f"topic {bytes(topic[:40])!r}")
            return
        if len(seq_bytes) != 8:
            self._drop("seq", f"a seq of {len(seq_bytes)} bytes, not 8")
            return
        seq = int.from_bytes(seq_bytes, "big", signed=True)
        if self._last_seq is not None and seq != self._last_seq + 1:
            self._counts["gaps"] += 1
            self.mapper.clear()
            self.sink.cleared(self.endpoint)
            self._log("gap", f"seq {seq} after {self._last_seq}: lost messages or a restart")
        self._last_seq = seq
        try:
            events = decode_batch(payload, self.max_message_bytes)
        except MalformedEvent as exc:
            self._drop("oversize" if len(payload) > self.max_message_bytes else "malformed",
                       str(exc))
            return
        for event in events:
            self._apply(event)
        self._counts["messages"] += 1

    def _apply(self, event: BlockEvent) -> None:
        if isinstance(event, AllBlocksCleared):
            self.mapper.clear()
            self.sink.cleared(self.endpoint)
        elif event.group_idx not in (None, 0):
            self._counts["dropped_group"] += 1  # another KV-cache group of a hybrid model
            return
        elif isinstance(event, BlockRemoved):
            removed = self.mapper.remove(event)
            if removed:
                self.sink.removed(self.endpoint, removed, event.tier)
        else:
            reason = ("lora" if event.is_lora else "extra_keys" if event.has_extra_keys
                      else "block_size" if event.block_size != self.mapper.block_size else None)
            pages = None if reason else self.mapper.store(event)
            if pages is None:
                self._counts[f"dropped_{reason or 'unknown_parent'}"] += 1  # expected: no log
                return
            self.sink.stored(self.endpoint, pages, event.tier)
        self._counts["events"] += 1

    def _drop(self, reason: str, detail: str, exc_info: bool = False) -> None:
        self._counts[f"dropped_{reason}"] += 1
        self._log(reason, detail, exc_info)

    def _log(self, reason: str, detail: str, exc_info: bool = False) -> None:
        """At most one line per reason per LOG_INTERVAL_S: a bad publisher cannot flood the log."""
        now = time.monotonic()
        if now - self._logged_at.get(reason, -math.inf) >= LOG_INTERVAL_S:
            self._logged_at[reason] = now
            logger.warning("KV events from %s (%s): %s: %s", self.endpoint, self.address, reason,
                           detail, exc_info=exc_info)
