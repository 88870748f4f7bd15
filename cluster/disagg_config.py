"""Configuration of disaggregated serving on Ray (no `ray` import: the server reads it first)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.errors import ConfigError
from kvtransfer.listen import BIND_MODES, check_host
from kvtransfer.tls import NO_TLS, KVTlsPaths


@dataclass(frozen=True, slots=True)
class ActorResources:
    """What one actor asks Ray for. 0 CPUs by default: Ray would otherwise hold one core per
    actor and leave the third of a 2 prefill + 2 decode cluster pending on a 2-core machine;
    on Kubernetes a custom resource (a worker group's) keeps each role on its own pods."""

    num_cpus: float = 0.0
    num_gpus: float = 0.0
    resources: tuple[tuple[str, float], ...] = ()

    def options(self) -> dict[str, object]:
        opts: dict[str, object] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.resources:
            opts["resources"] = dict(self.resources)
        return opts


@dataclass(frozen=True, slots=True)
class EtcdAccess:
    """How a process proves itself to etcd, and etcd to it (cluster.yaml's membership.etcd; on
    Kubernetes the files are a mounted Secret). All off: plaintext, no auth (loopback only).

    tls_ca                https: etcd's certificate is checked against this CA (and against
                          `server_name`, when etcd is dialled by an address its certificate
                          does not name)
    tls_cert, tls_key     a client certificate (etcd's --client-cert-auth); with etcd's auth on,
                          its CN is the user: no password, no token that can expire
    username, password_file   etcd's password auth (the token is fetched again when etcd
                          forgets it, e.g. after its restart)"""

    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    server_name: str = ""
    username: str = ""
    password_file: str = ""

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("membership.etcd.tls_cert", "tls_cert and tls_key go together")
        if (self.tls_cert or self.server_name) and not self.tls_ca:
            raise ConfigError("membership.etcd.tls_ca", "a client certificate or server_name needs tls_ca (https)")
        if bool(self.username) != bool(self.password_file):
            raise ConfigError("membership.etcd.username", "username and password_file go together")

    @property
    def is_tls(self) -> bool:
        return bool(self.tls_ca)


@dataclass(frozen=True, slots=True)
class MembershipConfig:
    """Who registers workers: `ray` (a registry actor, the embedded default) or `etcd` (leases)."""

    backend: str = "ray"
    cluster: str = "baton"  # etcd keys live under /{cluster}/workers/
    lease_ttl_s: int = 10
    etcd_host: str = "127.0.0.1"
    etcd_port: int = 2379
    etcd_access: EtcdAccess = EtcdAccess()

    def __post_init__(self) -> None:
        if self.backend not in ("ray", "etcd"):
            raise ConfigError("membership.backend", f"use ray or etcd, got {self.backend!r}")
        if self.lease_ttl_s < 1:
            raise ConfigError("membership.lease_ttl_s", "must be >= 1")


@dataclass(frozen=True, slots=True)
class DisaggConfig:
    num_prefill: int = 1
    num_decode: int = 1
    local_prefill_tokens: int = 32  # decode prefills prompts whose uncached part is this short
    transfer_deadline_s: float = 10.0  # first token -> every page arrived (then re-dispatch)
    reservation_ttl_s: float = 30.0  # reserve -> every page arrived (queueing and prefill too)
    num_threads: int = 1  # torch threads per actor
    pages_per_chunk: int | None = None  # None: chunks of about 4 MiB (kvtransfer.codec.chunk_pages)
    chunk_pause_s: float = 0.0  # fault drills only: prefill pauses before each chunk
    poll_wait_s: float = 1.0  # the output stream's long-poll bound
    ray_address: str | None = None  # None: a private local Ray (or the one this process has)
    transport: str = "auto"  # auto (nccl between CUDA pools, shm on one host, else gRPC), grpc, shm or nccl
    shm_slots: int = 4  # per decode worker's /dev/shm region (each slot holds one chunk)
    bind_host: str = "auto"  # the decode workers' KV listener (kvtransfer.listen): auto, node or an IP
    advertise_host: str = ""  # what senders dial ("": the bound address, or the node's)
    pair_failures: int = 3  # consecutive failed transfers after which a (prefill, decode) pair is unroutable
    pair_retry_s: float = 30.0  # an unroutable pair gets one probing transfer this often (cluster.placement.pair_health)
    kv_tls: KVTlsPaths = NO_TLS  # mutual TLS between workers' KV ports (kvtransfer.tls); off by default
    pin_cores: bool = False  # each actor on its own core, round robin: prefills first (cluster.fleet.cpu)
    placement: str = "cache"  # cache: the cost model (cluster.placement.policy); round_robin: for comparison (P7)
    prefill_resources: ActorResources = ActorResources()
    decode_resources: ActorResources = ActorResources()
    decode_threads: int | None = None  # torch threads per decode actor (None: num_threads)
    membership: MembershipConfig = field(default_factory=MembershipConfig)
    max_migrations: int = 2  # times a request moves to another decode worker when its own is lost
    watchdog_s: float = 30.0  # a worker that answers nothing this long (past a long-poll) is stalled
    max_restarts: int = 3  # Ray restarts an actor whose process died (its engine failed) this often
    # KV-preserving failover: prefill workers keep the prompts they pushed (a share of their
    # pool, a lease past each push) and a migrated request reuses every copy the cost model
    # finds. Off: migrations recompute their context (the baseline it is measured against).
    preserve_kv: bool = True
    retain_share: float = 0.25  # of a prefill worker's pool, at most, held as retained copies
    retain_s: float = 30.0  # a retained copy's lease past its push's end
    drain_hand_off: bool = True  # a drained decode worker's requests move now, as after a loss (False: they finish there)

    def __post_init__(self) -> None:
        if self.num_prefill < 0 or self.num_decode < 1:
            raise ConfigError("workers", "need --prefill >= 0 and --decode >= 1")
        if self.max_migrations < 0:
            raise ConfigError("max_migrations", "must be >= 0")
        if not 0 <= self.retain_share <= 0.5 or self.retain_s < 0:
            raise ConfigError("recovery.retain_share", "must be in [0, 0.5], and retain_s >= 0")
        if not self.watchdog_s > 0 or self.max_restarts < 0:
            raise ConfigError("recovery", "watchdog_s must be > 0 and max_restarts >= 0")
        if self.local_prefill_tokens < 0:
            raise ConfigError("local_prefill_tokens", "must be >= 0")
        if self.placement not in ("cache", "round_robin"):
            raise ConfigError("placement", f"use cache or round_robin, got {self.placement!r}")
        if self.transport not in ("auto", "grpc", "shm", "nccl"):
            raise ConfigError("transport", f"use auto, grpc, shm or nccl, got {self.transport!r}")
        if self.shm_slots < 0 or (self.transport == "shm" and not self.shm_slots):
            raise ConfigError("shm_slots", "the shm transport needs at least one slot")
        if self.bind_host not in BIND_MODES:
            check_host(self.bind_host, "transfer.bind_host")
        if self.advertise_host:
            check_host(self.advertise_host, "transfer.advertise_host")
        if self.pair_failures < 1 or not self.pair_retry_s > 0:
            raise ConfigError("transfer.pair_failures", "pair_failures must be >= 1 and pair_retry_s > 0")
        if not self.transfer_deadline_s > 0 or not self.reservation_ttl_s > 0:
            raise ConfigError("transfer_deadline_s", "deadlines must be positive")
