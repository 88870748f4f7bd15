"""Membership over etcd (aetcd), the production backend (docs/architecture.md, Membership and control).

    worker     lease = grant(ttl); txn(create_revision(key) == 0 -> put(key, info, lease))
               epoch = that put's revision (= the key's create_revision: it only grows)
               keepalive every ttl/3; a lost lease (TTL 0: it expired while this process
               was cut off) -> grant a new one and create again: a new, higher epoch
    scheduler  list /{cluster}/workers/ at revision R, then watch from R + 1; after a
               disconnect, watch again from last_seen + 1 (etcd replays what was missed);
               if that history was compacted, list again and diff
    etcd down  members() answers the last-known view; register() fails (no new joins); the
               loops retry every retry_s and resume by themselves when etcd is back

Keys: /{cluster}/workers/{worker_id} -> WorkerInfo JSON without the epoch (readers take it from
the key's create_revision, so the two cannot disagree). etcd keeps leases alive across its own
restart (it extends them when it becomes leader), so a restart costs no worker its epoch.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import aetcd  # type: ignore[import-untyped]
import aetcd.client  # type: ignore[import-untyped]
import aetcd.exceptions  # type: ignore[import-untyped]
import grpc

from cluster.disagg_config import EtcdAccess
from cluster.membership.protocol import (
    MembershipUnavailable,
    MemberView,
    ViewBacked,
    WorkerIdTaken,
    WorkerInfo,
    is_name,
)
from engine.secrets import read_secret

logger = logging.getLogger(__name__)

# gRPC's reconnect backoff grows to 120 s by default: cap it so a restarted etcd is found soon.
# Keepalive pings find a connection whose packets vanish (a cut link, a lost host: no reset
# ever arrives) within time + timeout, so the watch resumes on a new one; etcd accepts pings
# every 5 s (its --grpc-keepalive-min-time).
_CHANNEL_OPTIONS = {
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.min_reconnect_backoff_ms": 100,
    "grpc.max_reconnect_backoff_ms": 1000,
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 5_000,
}
_UNREACHABLE = (aetcd.ConnectionFailedError, aetcd.ConnectionTimeoutError, TimeoutError)


@dataclass(frozen=True, slots=True)
class EtcdConfig:
    host: str = "127.0.0.1"
    port: int = 2379
    cluster: str = "baton"
    lease_ttl_s: int = 10  # a dead worker is gone from every view within this (+ etcd's 0.5 s tick)
    request_timeout_s: float = 5.0
    retry_s: float = 0.5  # after a failed watch or registration
    max_queued_events: int = 10_000  # per watcher
    access: EtcdAccess = EtcdAccess()  # TLS and auth; all off: plaintext (loopback only)

    def __post_init__(self) -> None:
        if not is_name(self.cluster):
            raise ValueError(f"cluster name {self.cluster!r}: 1-128 of [A-Za-z0-9._-]")
        if self.lease_ttl_s < 1 or not self.request_timeout_s > 0 or not self.retry_s > 0:
            raise ValueError("lease_ttl_s >= 1 and positive timeouts")

    @property
    def prefix(self) -> bytes:
        return f"/{self.cluster}/workers/".encode()


class EtcdStats(NamedTuple):
    revision: int  # the view is current to this etcd revision
    is_connected: bool  # the watch is up
    num_relists: int  # full listings (the first, and after lost history)
    num_resumes: int  # watches re-created from last_seen + 1 after a disconnect
    num_reregistrations: int  # leases lost and registrations created again (new epochs)
    num_bad_values: int  # keys whose value was not a WorkerInfo (skipped)
    num_reauthentications: int = 0  # auth tokens etcd forgot, fetched again


@dataclass(slots=True)
class _Held:
    """One registration this process keeps alive."""

    info: WorkerInfo  # with its epoch
    lease_id: int
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # keepalive vs. update
    task: asyncio.Task[None] | None = None


class EtcdMembership(ViewBacked):
    """Use `await EtcdMembership.open(cfg)`: it lists the members before it returns."""

    def __init__(self, cfg: EtcdConfig, client: Any) -> None:
        self.cfg = cfg
        self._client = client  # aetcd.Client
        self._view = MemberView(cfg.max_queued_events)
        self._held: dict[str, _Held] = {}
        self._follower: asyncio.Task[None] | None = None
        self._is_connected = False
        self._is_closed = False
        self._num_relists = self._num_watches = self._num_reregistrations = self._num_bad_values = 0
        self._num_reauthentications = 0
        self._reauth_lock = asyncio.Lock()
        self._reauthenticated_at = float("-inf")

    @classmethod
    async def open(cls, cfg: EtcdConfig) -> EtcdMembership:
        """Connect and list; MembershipUnavailable when etcd cannot be reached."""
        client = _client(cfg)
        membership = cls(cfg, client)
        try:
            await membership._relist()
        except _UNREACHABLE as exc:
            await client.close()
            raise MembershipUnavailable(f"etcd at {cfg.host}:{cfg.port} is unreachable") from exc
        except aetcd.ClientError as exc:  # refused: credentials (auth, permissions) or TLS
            await client.close()
            raise MembershipUnavailable(f"etcd at {cfg.host}:{cfg.port} refused this client: {exc}") from exc
        membership._follower = asyncio.create_task(membership._follow(), name=f"baton-etcd-{cfg.cluster}")
        return membership

    # -- the Membership interface ---------------------------------------------------------------

    async def register(self, info: WorkerInfo) -> int:
        held = self._held.get(info.worker_id)
        try:
            if held is not None:
                async with held.lock:
                    return await self._update(held, info)
            held = await self._create(info)
        except _UNREACHABLE as exc:
            raise MembershipUnavailable(f"cannot register {info.worker_id}: etcd is unreachable") from exc
        if held is None:
            raise WorkerIdTaken(info.worker_id)
        self._held[info.worker_id] = held
        held.task = asyncio.create_task(self._keepalive(held), name=f"baton-lease-{info.worker_id}")
        logger.info("registered %s (%s) at epoch %d", info.worker_id, info.role, held.info.epoch)
        return held.info.epoch

    async def deregister(self, worker_id: str) -> None:
        """Leave now (revoking the lease deletes the key); if etcd cannot be reached, the key
        goes by itself when the lease runs out."""
        held = self._held.pop(worker_id, None)
        if held is None:
            return
        await _cancel(held.task)
        try:
            await self._client.revoke_lease(held.lease_id)
        except aetcd.ClientError as exc:
            logger.warning("%s: lease not revoked (%s); it expires within %d s", worker_id, exc, self.cfg.lease_ttl_s)

    async def close(self) -> None:
        if self._is_closed:
            return
        self._is_closed = True
        for worker_id in list(self._held):
            await self.deregister(worker_id)
        await _cancel(self._follower)
        self._view.close()
        await self._client.close()

    def stats(self) -> EtcdStats:
        return EtcdStats(self._view.revision, self._is_connected, self._num_relists,
                         max(self._num_watches - 1, 0), self._num_reregistrations, self._num_bad_values,
                         self._num_reauthentications)  # fmt: skip

    # -- worker side: create, update, keep alive --------------------------------------------------

    async def _create(self, info: WorkerInfo) -> _Held | None:
        """Grant a lease and create the key under it if absent -> the registration; None when
        another live registration holds the key."""
        lease = await self._client.lease(self.cfg.lease_ttl_s)
        key, tx = self._key(info.worker_id), self._client.transactions
        try:
            is_created, responses = await self._client.transaction(
                compare=[tx.create(key) == 0], success=[tx.put(key, info.to_json(), lease=lease.id)], failure=[]
            )
        except BaseException:
            await self._revoke_quietly(lease.id)  # an ambiguous failure: the key goes with it
            raise
        if not is_created:
            await self._revoke_quietly(lease.id)
            return None
        return _Held(info.with_epoch(int(responses[0].response_put.header.revision)), lease.id)

    async def _update(self, held: _Held, info: WorkerInfo) -> int:
        """New fields for a registration this process holds (only while it is still ours)."""
        key, tx = self._key(info.worker_id), self._client.transactions
        is_ours, _ = await self._client.transaction(
            compare=[tx.create(key) == held.info.epoch],
            success=[tx.put(key, info.to_json(), lease=held.lease_id)], failure=[],
        )  # fmt: skip
        held.info = info.with_epoch(held.info.epoch)
        if not is_ours and not await self._rejoin(held):
            raise WorkerIdTaken(info.worker_id)
        return held.info.epoch

    async def _keepalive(self, held: _Held) -> None:
        while True:
            await asyncio.sleep(self.cfg.lease_ttl_s / 3)
            try:
                reply = await self._client.refresh_lease(held.lease_id)
                if reply is not None and reply.TTL > 0:
                    continue
                async with held.lock:
                    await self._rejoin(held)
            except (aetcd.ClientError, TimeoutError) as exc:  # unreachable: retry at the next tick
                logger.info("%s: keepalive failed (%s)", held.info.worker_id, exc)
                await self._after_error(exc)
            except Exception:  # never let the lease lapse silently over a bug
                logger.exception("%s: keepalive failed", held.info.worker_id)

    async def _rejoin(self, held: _Held) -> bool:
        worker_id, old = held.info.worker_id, held.info.epoch
        logger.warning("%s lost its lease (epoch %d): registering again", worker_id, old)
        new = await self._create(held.info)
        if new is None:  # someone else registered this id meanwhile: this process is the stale one
            logger.error("%s: the id is held by another registration; retrying", worker_id)
            return False
        held.info, held.lease_id = new.info, new.lease_id
        self._num_reregistrations += 1
        logger.warning("%s registered again: epoch %d -> %d", worker_id, old, new.info.epoch)
        return True

    async def _after_error(self, exc: BaseException) -> None:
        """etcd forgot this client's auth token (it keeps them in memory: a restart loses them):
        drop the connection, so that the next call connects and authenticates again. Once for
        the keepalives and the watch together; it never raises (it runs in their error paths)."""
        if not (isinstance(exc, aetcd.exceptions.UnauthenticatedError) and self.cfg.access.username):
            return
        async with self._reauth_lock:
            if time.monotonic() - self._reauthenticated_at < 2 * self.cfg.retry_s:
                return  # another loop just did: its new token is the one in use
            self._num_reauthentications += 1
            logger.warning("etcd refused the auth token (%s): authenticating again", exc)
            try:
                await self._client.close()
            except Exception as close_exc:  # e.g. waiting on a connect already under way
                logger.warning("closing the etcd connection failed (%r): the next call connects again", close_exc)
            self._reauthenticated_at = time.monotonic()

    async def _revoke_quietly(self, lease_id: int) -> None:
        try:
            await self._client.revoke_lease(lease_id)
        except aetcd.ClientError:
            pass  # it expires by itself

    # -- scheduler side: list, then watch ---------------------------------------------------------

    async def _follow(self) -> None:
        must_relist = False
        while not self._is_closed:
            try:
                if must_relist:
                    await self._relist()
                    must_relist = False
                elif self.cfg.access.username:
                    # aetcd takes a watch that etcd refused (cancelled at creation: a token etcd
                    # forgot) as created, and it never delivers: prove the token first
                    await self._client.get(self.cfg.prefix)
                await self._watch_from(self._view.revision + 1)
            except aetcd.RevisionCompactedError as exc:
                logger.warning("etcd compacted past revision %d (%s): listing again", self._view.revision, exc)
                must_relist = True
            except (aetcd.ClientError, TimeoutError) as exc:
                if self._is_connected:
                    logger.warning("etcd unreachable (%s): serving on the last-known membership", exc)
                self._is_connected = False
                await self._after_error(exc)
            except Exception:  # a bug: start over from a listing rather than stop following
                logger.exception("membership watch failed: listing again")
                must_relist, self._is_connected = True, False
            await asyncio.sleep(self.cfg.retry_s)

    async def _watch_from(self, start_revision: int) -> None:
        watch = await self._client.watch_prefix(self.cfg.prefix, start_revision=start_revision)
        if self._is_closed:  # closed while the watch was created (see _cancel)
            return
        if not self._is_connected:
            logger.info("etcd reachable: watching from revision %d", start_revision)
        self._is_connected = True
        self._num_watches += 1
        async for event in watch:
            self._apply(event)

    async def _relist(self) -> None:
        listing = await self._client.get_prefix(self.cfg.prefix)
        infos = [info for kv in listing if (info := self._decode(kv)) is not None]
        self._view.replace(infos, int(listing.header.revision))
        self._num_relists += 1
        self._is_connected = True

    def _apply(self, event: Any) -> None:
        kv = event.kv
        if event.kind == aetcd.EventKind.DELETE:
            self._view.delete(kv.key[len(self.cfg.prefix):].decode(errors="replace"), kv.mod_revision)
        elif (info := self._decode(kv)) is not None:
            self._view.put(info, kv.mod_revision)
        else:
            self._view.advance(kv.mod_revision)

    def _decode(self, kv: Any) -> WorkerInfo | None:
        try:
            info = WorkerInfo.from_json(kv.value, epoch=kv.create_revision)
            if self._key(info.worker_id) != kv.key:
                raise ValueError(f"worker_id {info.worker_id!r} under another key")
            return info
        except ValueError as exc:
            self._num_bad_values += 1
            logger.warning("skipping %r: %s", kv.key, exc)
            return None

    def _key(self, worker_id: str) -> bytes:
        return self.cfg.prefix + worker_id.encode()


def _client(cfg: EtcdConfig) -> Any:
    """An aetcd client for `cfg`: plaintext, or TLS with its CA (and a client certificate);
    with a username, it authenticates with the password file's first line."""
    access = cfg.access
    password = read_secret(access.password_file, "membership.etcd.password_file").decode().splitlines()[0] \
        if access.username else None  # fmt: skip
    options: dict[str, Any] = dict(_CHANNEL_OPTIONS)
    if not access.is_tls:
        return aetcd.Client(cfg.host, cfg.port, access.username or None, password, timeout=cfg.request_timeout_s,
                            options=options)  # fmt: skip
    credentials = grpc.ssl_channel_credentials(
        read_secret(access.tls_ca, "membership.etcd.tls_ca", pem=True),
        read_secret(access.tls_key, "membership.etcd.tls_key", pem=True) if access.tls_key else None,
        read_secret(access.tls_cert, "membership.etcd.tls_cert", pem=True) if access.tls_cert else None,
    )
    if access.server_name:
        options["grpc.ssl_target_name_override"] = access.server_name
    return _TlsClient(credentials, cfg.host, cfg.port, access.username or None, password,
                      timeout=cfg.request_timeout_s, options=options)  # fmt: skip


class _TlsClient(aetcd.Client):  # type: ignore[misc]
    """aetcd's client over TLS. aetcd 1.0 dials plaintext only, so this `connect` is aetcd's
    (the same stubs, authentication and watcher, in the same order) over a secure channel;
    aetcd is pinned in pyproject.toml, and tests/cluster/test_etcd_tls.py runs it against a
    real etcd that takes https only."""

    _is_connecting: bool  # aetcd's

    def __init__(self, credentials: grpc.ChannelCredentials, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._credentials = credentials

    @aetcd.client._handle_errors  # type: ignore[untyped-decorator]  # grpc errors -> aetcd's, as its own
    async def connect(self) -> None:
        if self._connected.is_set():
            return
        if self._is_connecting:  # another task is connecting: wait for it
            await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
            return
        rpc = aetcd.rpc
        try:
            self._is_connecting = True
            self.channel = grpc.aio.secure_channel(f"{self._host}:{self._port}", self._credentials,
                                                   options=list(self._options.items()))  # fmt: skip
            if self._username is not None and self._password is not None:
                self.auth_stub = rpc.AuthStub(self.channel)
                request = rpc.AuthenticateRequest(name=self._username, password=self._password)
                try:
                    reply = await self.auth_stub.Authenticate(request, timeout=self._timeout)
                except BaseException:  # refused or unreachable: this channel is not kept (nor leaked)
                    await self.channel.close()
                    self._init_channel_attrs()
                    raise
                self.metadata = (("token", reply.token),)
            self.kvstub = rpc.KVStub(self.channel)
            self.clusterstub = rpc.ClusterStub(self.channel)
            self.leasestub = rpc.LeaseStub(self.channel)
            self.maintenancestub = rpc.MaintenanceStub(self.channel)
            self._watcher = aetcd.watcher.Watcher(rpc.WatchStub(self.channel), timeout=self._timeout,
                                                  metadata=self.metadata)  # fmt: skip
            self._connected.set()
        finally:
            self._is_connecting = False


CANCEL_TRIES = 50  # x CANCEL_WAIT_S: how long close() waits for a task that swallows cancellation
CANCEL_WAIT_S = 0.1


async def _cancel(task: asyncio.Task[None] | None) -> None:
    """Cancel `task` and wait for it, bounded. aetcd can swallow a cancellation that lands
    while it creates a watch (the task then waits on the new watch's events for ever, and a
    single cancel-and-gather hangs close()): cancel again until the task is done."""
    if task is None:
        return
    for _ in range(CANCEL_TRIES):
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=CANCEL_WAIT_S)
        if done:
            return
    logger.error("%s did not stop within %.0f s of being cancelled", task.get_name(), CANCEL_TRIES * CANCEL_WAIT_S)
