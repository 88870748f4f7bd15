"""Who is in the cluster: one interface, two backends (docs/architecture.md, Membership and control).

    epoch = await m.register(info)      join (create-if-absent) under a lease kept alive in the
                                        background; a lost lease -> joins again, a new epoch
    m.members()                         the last-known snapshot: it keeps answering while the
                                        backend is unreachable (serving goes on, nobody joins)
    events = m.watch()                  JOIN / UPDATE / LEAVE after that snapshot, in order
    m.check_epoch(worker_id, epoch)     is this the sender's current registration?
    await m.deregister(worker_id); await m.close()

Backends: cluster.membership.etcd.EtcdMembership (production: etcd leases; list, then watch
from revision + 1) and cluster.membership.embedded.RayMembership (the embedded `baton up`: a
registry actor with heartbeats, or the same registry in-process for tests and --no-ray).

The epoch is a fencing token: the backend's revision at which the registration was created,
so it only grows, and a worker that lost its lease and came back has a new one. A command or
a KV transfer stamped with any other epoch is refused (EpochFence): its sender was declared
dead, and what it held may have been given away.

Read `members()` and call `watch()` with no `await` between them: the stream then starts
exactly where the snapshot ends.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import re
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from types import MappingProxyType
from typing import Any, Protocol, TypeVar

logger = logging.getLogger(__name__)

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # worker ids, node ids, cluster names
MAX_TEXT = 256  # an address or node id
MAX_VALUE_BYTES = 16 << 10  # a WorkerInfo as stored in the backend


class Role(enum.StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"


class EventKind(enum.IntEnum):
    JOIN = 1
    UPDATE = 2  # same registration (same epoch), new fields (capacity, address)
    LEAVE = 3  # deregistered, or its lease expired


class MembershipError(Exception):
    pass


class MembershipUnavailable(MembershipError):
    """The backend cannot be reached: nothing joins until it is back."""


class WorkerIdTaken(MembershipError):
    """Another live registration holds this worker id."""

    def __init__(self, worker_id: str) -> None:
        super().__init__(f"worker id {worker_id!r} is registered by someone else")
        self.worker_id = worker_id


class MembershipLagged(MembershipError):
    """A watcher fell too far behind and was ended: read members() and watch again."""


def is_name(text: str) -> bool:
    return _NAME.fullmatch(text) is not None


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    worker_id: str
    role: Role
    address: str  # where its control calls go (host:port, or a Ray actor name)
    node_id: str
    kv_address: str = ""  # where KV pages are pushed to it (decode), "" when none
    epoch: int = 0  # set by the backend on registration; 0 = not registered
    num_pages: int = 0  # capacity: KV pages on its device
    page_size: int = 0
    max_num_seqs: int = 0

    def __post_init__(self) -> None:
        if not is_name(self.worker_id) or not is_name(self.node_id):
            raise ValueError("worker_id and node_id: 1-128 of [A-Za-z0-9._-], starting alphanumeric")
        if not isinstance(self.role, Role):
            raise ValueError(f"role must be a Role, not {self.role!r}")
        for text in (self.address, self.kv_address):
            if not isinstance(text, str) or len(text) > MAX_TEXT:
                raise ValueError(f"addresses are strings of at most {MAX_TEXT} characters")
        for n in (self.epoch, self.num_pages, self.page_size, self.max_num_seqs):
            if type(n) is not int or n < 0:
                raise ValueError("epoch and capacity fields are non-negative integers")

    def with_epoch(self, epoch: int) -> WorkerInfo:
        return replace(self, epoch=epoch)

    def to_json(self) -> bytes:
        """What the backend stores; the epoch is not in it (the backend's revision is)."""
        fields = asdict(self)
        del fields["epoch"]
        return json.dumps(fields, separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, epoch: int) -> WorkerInfo:
        """Parse a stored value; ValueError on anything malformed. Unknown fields are ignored
        (a newer worker during a rolling upgrade), missing ones are an error."""
        if len(data) > MAX_VALUE_BYTES:
            raise ValueError(f"worker info is {len(data)} bytes, over {MAX_VALUE_BYTES}")
        try:
            obj: Any = json.loads(data)
        except RecursionError:  # nesting past the interpreter's limit: not a ValueError by itself
            raise ValueError("worker info nests too deeply") from None
        if not isinstance(obj, dict):
            raise ValueError("worker info is not a JSON object")
        try:
            return cls(
                worker_id=_field(obj, "worker_id", str), role=Role(_field(obj, "role", str)),
                address=_field(obj, "address", str), node_id=_field(obj, "node_id", str),
                kv_address=_field(obj, "kv_address", str), epoch=epoch,
                num_pages=_field(obj, "num_pages", int), page_size=_field(obj, "page_size", int),
                max_num_seqs=_field(obj, "max_num_seqs", int),
            )  # fmt: skip
        except (TypeError, KeyError) as exc:
            raise ValueError(f"malformed worker info: {exc}") from None


_T = TypeVar("_T")


def _field(obj: dict[str, Any], name: str, kind: type[_T]) -> _T:
    value = obj[name]
    if type(value) is not kind:
        raise TypeError(f"{name} must be {kind.__name__}")
    return value


@dataclass(frozen=True, slots=True)
class MemberEvent:
    kind: EventKind
    worker: WorkerInfo  # for LEAVE: the registration that left, as last known
    revision: int  # the backend's revision of the change


class EventStream:
    """One watcher's events, in order. Bounded: a watcher `max_queued` events behind is ended
    with MembershipLagged rather than growing without bound."""

    def __init__(self, max_queued: int, on_close: Callable[[EventStream], None]) -> None:
        self.max_queued = max_queued
        self._items: deque[MemberEvent] = deque()
        self._ready = asyncio.Event()
        self._end: BaseException | None = None
        self._is_ended = False
        self._on_close = on_close

    def push(self, event: MemberEvent) -> None:
        if self._is_ended:
            return
        if len(self._items) >= self.max_queued:
            self.end(MembershipLagged(f"a membership watcher fell {self.max_queued} events behind"))
            return
        self._items.append(event)
        self._ready.set()

    def end(self, error: BaseException | None = None) -> None:
        if not self._is_ended:
            self._is_ended, self._end = True, error
            self._ready.set()
            self._on_close(self)

    def close(self) -> None:
        self.end()

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> MemberEvent:
        while not self._items:
            if self._is_ended:
                if self._end is not None:
                    raise self._end
                raise StopAsyncIteration
            self._ready.clear()
            await self._ready.wait()
        return self._items.popleft()


class Membership(Protocol):
    async def register(self, info: WorkerInfo) -> int:
        """Join (or, for an id this instance holds, update its fields) -> its epoch.
        WorkerIdTaken when another registration holds the id; MembershipUnavailable when the
        backend cannot be reached."""
        ...

    async def deregister(self, worker_id: str) -> None: ...

    def members(self) -> Mapping[str, WorkerInfo]:
        """The last-known membership (immutable; replaced, never changed in place)."""
        ...

    def watch(self) -> EventStream: ...

    def check_epoch(self, worker_id: str, epoch: int) -> bool: ...

    def held_epoch(self, worker_id: str) -> int | None: ...

    async def close(self) -> None: ...


class MemberView:
    """The last-known membership, the revision it is current to, and its watchers. Backends
    feed it changes in revision order; it turns them into events."""

    def __init__(self, max_queued: int = 10_000) -> None:
        self.max_queued = max_queued
        self.revision = 0
        self._members: Mapping[str, WorkerInfo] = MappingProxyType({})
        self._streams: set[EventStream] = set()

    def members(self) -> Mapping[str, WorkerInfo]:
        return self._members

    def check_epoch(self, worker_id: str, epoch: int) -> bool:
        current = self._members.get(worker_id)
        return current is not None and current.epoch == epoch

    def watch(self) -> EventStream:
        stream = EventStream(self.max_queued, self._streams.discard)
        self._streams.add(stream)
        return stream

    def put(self, info: WorkerInfo, revision: int) -> None:
        old = self._members.get(info.worker_id)
        if old is not None and old.epoch != info.epoch:  # it left and came back meanwhile
            self._emit(EventKind.LEAVE, old, revision)
            old = None
        if info != old:
            self._set({**self._members, info.worker_id: info})
            self._emit(EventKind.JOIN if old is None else EventKind.UPDATE, info, revision)
        self.advance(revision)

    def delete(self, worker_id: str, revision: int) -> None:
        old = self._members.get(worker_id)
        if old is not None:
            self._set({k: v for k, v in self._members.items() if k != worker_id})
            self._emit(EventKind.LEAVE, old, revision)
        self.advance(revision)

    def apply(self, event: MemberEvent) -> None:
        if event.kind == EventKind.LEAVE:
            self.delete(event.worker.worker_id, event.revision)
        else:
            self.put(event.worker, event.revision)

    def replace(self, infos: Iterable[WorkerInfo], revision: int) -> None:
        """A fresh listing at `revision` (after history was lost): diff it against the view."""
        new = {w.worker_id: w for w in infos}
        for worker_id in sorted(self._members.keys() - new.keys()):
            self.delete(worker_id, revision)
        for worker_id in sorted(new):
            self.put(new[worker_id], revision)
        self.advance(revision)

    def advance(self, revision: int) -> None:
        self.revision = max(self.revision, revision)

    def close(self, error: BaseException | None = None) -> None:
        for stream in list(self._streams):
            stream.end(error)

    def _set(self, members: dict[str, WorkerInfo]) -> None:
        self._members = MappingProxyType(members)

    def _emit(self, kind: EventKind, info: WorkerInfo, revision: int) -> None:
        event = MemberEvent(kind, info, revision)
        for stream in list(self._streams):
            stream.push(event)


class ViewBacked:
    """The read side both backends share: answers from their MemberView (the last-known
    membership, which keeps serving while the backend is unreachable)."""

    _view: MemberView
    _held: dict[str, Any]  # worker id -> this process's registration (its .info carries the epoch)

    def members(self) -> Mapping[str, WorkerInfo]:
        return self._view.members()

    def held_epoch(self, worker_id: str) -> int | None:
        """The epoch of a registration this process holds (it changes when the lease was lost
        and the keepalive registered again); None when it holds none."""
        held = self._held.get(worker_id)
        return held.info.epoch if held is not None else None

    def watch(self) -> EventStream:
        return self._view.watch()

    def check_epoch(self, worker_id: str, epoch: int) -> bool:
        return self._view.check_epoch(worker_id, epoch)


class EpochFence:
    """Admits a command or KV transfer only when its epoch is the sender's current
    registration, and counts what it refuses:

        stale    the sender is registered under a newer epoch: this one is a zombie's
        unknown  the sender is not registered (its lease expired, it left), or under an epoch
                 this view has not seen yet (the sender's caller retries)
    """

    def __init__(self, membership: Membership) -> None:
        self.membership = membership
        self.num_admitted = 0
        self.num_refused_stale = 0
        self.num_refused_unknown = 0

    @property
    def num_refused(self) -> int:
        return self.num_refused_stale + self.num_refused_unknown

    def admit(self, worker_id: str, epoch: int) -> bool:
        current = self.membership.members().get(worker_id)
        if current is not None and current.epoch == epoch:
            self.num_admitted += 1
            return True
        if current is not None and epoch < current.epoch:
            self.num_refused_stale += 1
        else:
            self.num_refused_unknown += 1
        logger.info("refused %s at epoch %d (current: %s)", worker_id, epoch,
                    current.epoch if current is not None else "not registered")  # fmt: skip
        return False
