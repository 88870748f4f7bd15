"""`cluster.yaml`: one file describing a baton deployment (`baton serve --config cluster.yaml`,
`baton up --config ...`; on Kubernetes it is the ConfigMap the head pod mounts).

    cfg = load_cluster_config(path)      -> ServerConfig; a ConfigError naming every bad key

Every section and key is optional; what is left out takes `baton up`'s default. A key this
schema does not know is an error (a typo must not silently fall back to a default), as is a
value of the wrong type or out of its range. An example with every key is examples/cluster.yaml.

    cluster: baton                 the name: etcd keys live under /{cluster}/workers/
    model:      path, served_name (a name, or a list: answers carry the first), device, dtype,
                max_model_len, attention_backend
    ray:        address            null: a private Ray on this machine; host:port: attach
    workers:    prefill / decode: count, threads, num_cpus, num_gpus, resources, pin_cores
    kv_cache:   page_size, device_pages, device_memory_gb, host_pages, disk_pages, disk_dir,
                prefix_cache, shared_prefixes, dtype (auto: the model's; bfloat16, float16)
    scheduler:  max_num_seqs, max_batched_tokens, max_prefill_chunk, async_scheduling (auto: on
                with CUDA graphs; true/on; false/off), itl_target_ms (stall-free prompt chunks), policy
                (least-uncached: prompts nearest their first token first; fcfs)
    transfer:   transport (auto, grpc, shm, nccl), deadline_s, reservation_ttl_s, pages_per_chunk,
                shm_slots, bind_host (auto, node or an IP), advertise_host, pair_failures, pair_retry_s,
                tls_cert, tls_key, tls_ca (mutual TLS between the workers' KV ports)
    recovery:   max_migrations, watchdog_s, max_restarts, preserve_kv, retain_share, retain_s,
                drain_hand_off, write_back_pages
    placement:  policy (cache, round_robin), local_prefill_tokens
    membership: backend (ray, etcd), lease_ttl_s, etcd: {host, port, tls_ca, tls_cert, tls_key,
                server_name, username, password_file}
    planner:    enabled, period_s, ttft_slo_s, itl_slo_s, min/max_prefill, min/max_decode,
                max_total, out_samples, in_samples, cooldown_s   (cluster.ops.planner)
    api:        host, port, grpc_port (0: off), api_keys_file, tls_cert, tls_key,
                allow_priority_field, request_timeout_s, max_body_bytes
    admission:  max_waiting_requests, max_waiting_tokens, max_inflight_requests, batch_share (of the
                request bounds, what batch-class requests may fill)
    tracing:    otlp_endpoint (null: $OTEL_EXPORTER_OTLP_ENDPOINT, else off), service_name,
                sample_ratio, insecure                                 (cluster.ops.tracing)
    pools:      name -> {kind, endpoints, models, upstream_models, max_concurrency, api_key_file,
                kv_events, kv_events_topic, block_size, prefill_tokens_per_s, endpoint_policy,
                connect_timeout_s, health, tokenizer, enabled (the own pool: false, a router)}
    routing:    route_key, window, min_samples, rules, ...                (cluster.gateway.config)

No pickle: the file is parsed with yaml.safe_load, then checked by the schema below.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.errors import ConfigError

if TYPE_CHECKING:
    from cluster.disagg_config import EtcdAccess

MAX_CONFIG_BYTES = 1 << 20
_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class ModelSection(_Section):
    path: str = "baton-tiny"  # a built-in name or a Hugging Face checkpoint directory
    # The names clients call the model by (the first is the one answers carry): a name or a list.
    served_name: str | list[str] | None = None
    device: str = "cpu"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_model_len: int | None = Field(default=None, ge=16)
    # decode attention (engine.attention): auto, torch (the reference), cpu (compiled), triton
    attention_backend: Literal["auto", "torch", "cpu", "triton"] = "auto"


class RaySection(_Section):
    address: str | None = None


class RoleSection(_Section):
    count: int = Field(default=1, ge=0, le=4096)
    threads: int = Field(default=1, ge=1, le=1024)  # torch threads per actor
    num_cpus: float = Field(default=0.0, ge=0)  # Ray's logical CPUs per actor (0: share the cores)
    num_gpus: float = Field(default=0.0, ge=0)
    resources: dict[str, float] = Field(default_factory=dict)  # Ray custom resources (a worker group's)


class WorkersSection(_Section):
    prefill: RoleSection = RoleSection(count=0)
    decode: RoleSection = RoleSection()
    pin_cores: bool = False


class KVCacheSection(_Section):
    page_size: int = Field(default=16, ge=1, le=1024)
    device_pages: int | None = Field(default=None, ge=2)
    device_memory_gb: float | None = Field(default=None, gt=0)
    host_pages: int = Field(default=0, ge=0)
    disk_pages: int = Field(default=0, ge=0)
    disk_dir: str | None = None
    prefix_cache: bool = True
    shared_prefixes: list[str] = Field(default_factory=list, max_length=64)
    # the pool's element type: auto (the model's dtype), or bfloat16/float16 (half the bytes)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"


# The CLI's --async-scheduling and the file's scheduler.async_scheduling -> EngineConfig's
ASYNC_SCHEDULING: dict[str | bool, bool | None] = {"auto": None, "on": True, "off": False, True: True, False: False}


class SchedulerSection(_Section):
    max_num_seqs: int = Field(default=64, ge=1, le=4096)
    max_batched_tokens: int = Field(default=2048, ge=16)
    max_prefill_chunk: int = Field(default=512, ge=16)
    async_scheduling: bool | Literal["auto"] = "auto"  # YAML's on/off/true/false are booleans
    # while requests decode, size prompt chunks so a step takes about this long (null: off)
    itl_target_ms: float | None = Field(default=None, gt=0, le=60_000)
    # prompt work within a priority class: least uncached first (aged), or arrival order
    policy: Literal["least-uncached", "fcfs"] = "least-uncached"


class TransferSection(_Section):
    transport: Literal["auto", "grpc", "shm", "nccl"] = "auto"
    deadline_s: float = Field(default=10.0, gt=0)
    reservation_ttl_s: float = Field(default=30.0, gt=0)
    pages_per_chunk: int | None = Field(default=None, ge=1, le=4096)  # unset: chunks of about 4 MiB
    shm_slots: int = Field(default=4, ge=0, le=256)
    # the decode workers' KV listener (kvtransfer.listen): auto (loopback on one node, the node's
    # address on more), node, or an IP; advertise_host: what senders dial, when not the bound address
    bind_host: str = "auto"
    advertise_host: str | None = None
    pair_failures: int = Field(default=3, ge=1, le=1000)  # consecutive failed transfers: the pair is unroutable
    pair_retry_s: float = Field(default=30.0, gt=0, le=3600)  # then one transfer probes it this often
    # mutual TLS between the workers' KV ports (kvtransfer.tls): the same files on every node
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None


class RecoverySection(_Section):
    max_migrations: int = Field(default=2, ge=0, le=16)  # a request whose decode worker is lost moves this often
    watchdog_s: float = Field(default=30.0, gt=0, le=3600)  # a worker silent this long is stalled: its work moves
    max_restarts: int = Field(default=3, ge=0, le=100)  # Ray restarts a worker whose engine failed this often
    preserve_kv: bool = True  # a lost or drained decode worker's requests resume from copies of their pages
    retain_share: float = Field(default=0.25, ge=0, le=0.5)  # of a prefill worker's pool, for retained copies
    retain_s: float = Field(default=30.0, ge=0, le=3600)  # a retained copy's lease past its push's end
    drain_hand_off: bool = True  # a drained decode worker's requests move at once (false: they finish there)
    # > 0: decode workers also write their sequences' pages to their disk tier, this many at a time,
    # so a worker that dies leaves them on its disk for its restarted self (needs kv_cache.disk_pages)
    write_back_pages: int = Field(default=0, ge=0, le=1 << 20)


class PlacementSection(_Section):
    policy: Literal["cache", "round_robin"] = "cache"
    local_prefill_tokens: int = Field(default=32, ge=0)


class EtcdSection(_Section):
    host: str = "127.0.0.1"
    port: int = Field(default=2379, ge=1, le=65535)
    # TLS and auth (cluster.disagg_config.EtcdAccess): file paths, e.g. a mounted Secret
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    server_name: str | None = None
    username: str | None = None
    password_file: str | None = None


class MembershipSection(_Section):
    backend: Literal["ray", "etcd"] = "ray"
    lease_ttl_s: int = Field(default=10, ge=1, le=3600)
    etcd: EtcdSection = EtcdSection()


class PlannerSection(_Section):
    enabled: bool = False  # Ray deployments only: the gateway resizes its own worker pools
    period_s: float = Field(default=5.0, gt=0)
    ttft_slo_s: float = Field(default=2.0, gt=0)
    itl_slo_s: float = Field(default=0.1, gt=0)
    min_prefill: int = Field(default=1, ge=0)
    max_prefill: int = Field(default=8, ge=0)
    min_decode: int = Field(default=1, ge=1)
    max_decode: int = Field(default=8, ge=1)
    max_total: int = Field(default=16, ge=2)
    out_samples: int = Field(default=3, ge=1)
    in_samples: int = Field(default=10, ge=1)
    cooldown_s: float = Field(default=60.0, ge=0)


class ApiSection(_Section):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    grpc_port: int = Field(default=50051, ge=0, le=65535)
    api_keys_file: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    allow_priority_field: bool = False
    enable_admin: bool = False  # POST /admin/drain (preStop), /admin/scale (baton scale); keys set: an operator key
    request_timeout_s: float = Field(default=600.0, gt=0)
    max_body_bytes: int = Field(default=8 << 20, ge=1024)


class AdmissionSection(_Section):
    max_waiting_requests: int = Field(default=256, ge=1)
    max_waiting_tokens: int = Field(default=1 << 19, ge=1)
    max_inflight_requests: int = Field(default=1024, ge=1)
    batch_share: float = Field(default=0.5, gt=0, le=1)


class TracingSection(_Section):
    otlp_endpoint: str | None = Field(default=None, min_length=1, max_length=2048)  # OTLP/gRPC collector
    service_name: str = Field(default="baton", min_length=1, max_length=256)
    sample_ratio: float = Field(default=1.0, ge=0.0, le=1.0)
    insecure: bool = True  # false: TLS to the collector (an https:// endpoint is TLS anyway)


class HealthSection(_Section):
    path: str | None = Field(default=None, pattern=r"^/[A-Za-z0-9/._-]{0,255}$")  # null: the kind's
    period_s: float = Field(default=5.0, gt=0, le=3600)
    timeout_s: float = Field(default=2.0, gt=0, le=600)
    failures: int = Field(default=3, ge=1, le=1000)
    eject_s: float = Field(default=10.0, gt=0, le=86400)
    max_eject_s: float = Field(default=300.0, gt=0, le=86400)


class PoolSection(_Section):
    kind: Literal["baton", "vllm", "sglang", "llama.cpp", "openai-compatible"]
    endpoints: list[str] = Field(default_factory=list, max_length=256)
    models: list[str] = Field(default_factory=list, max_length=64)
    upstream_models: dict[str, str] = Field(default_factory=dict, max_length=64)  # a name of models -> upstream's
    max_concurrency: int = Field(default=64, ge=1, le=1_000_000)
    api_key_file: str | None = None
    kv_events: list[str] = Field(default_factory=list, max_length=256)  # vLLM's publishers, one per endpoint
    kv_events_topic: str = Field(default="", max_length=256)
    block_size: int = Field(default=16, ge=1, le=4096)
    prefill_tokens_per_s: float = Field(default=4000.0, gt=0)
    endpoint_policy: Literal["prefix", "round_robin"] = "prefix"
    connect_timeout_s: float = Field(default=5.0, gt=0, le=600)
    health: HealthSection = HealthSection()
    tokenizer: str | None = Field(default=None, min_length=1, max_length=4096)  # a directory with tokenizer.json
    enabled: bool = True  # the own pool (kind baton) only: false runs no workers (a router over the pools)


class RuleSection(_Section):
    pool: str
    models: list[str] = Field(default_factory=list, max_length=64)
    route_keys: list[str] = Field(default_factory=list, max_length=1024)
    overlap_at_least: float | None = Field(default=None, ge=0, le=1)
    overlap_below: float | None = Field(default=None, ge=0, le=1)


class RoutingSection(_Section):
    route_key: str = "tenant"  # tenant, user, header:<name>
    window: int = Field(default=64, ge=1, le=100_000)
    min_samples: int = Field(default=4, ge=1, le=100_000)
    max_route_keys: int = Field(default=4096, ge=1, le=1_000_000)
    pages_per_key: int = Field(default=1 << 16, ge=1, le=1 << 24)
    rules: list[RuleSection] = Field(default_factory=list, max_length=256)
    approx_ttl_s: float = Field(default=600.0, gt=0, le=86400)
    approx_max_pages: int = Field(default=1 << 20, ge=1, le=1 << 26)
    log_path: str | None = None
    log_max_bytes: int = Field(default=64 << 20, ge=4096)


class ClusterFile(_Section):
    cluster: str = Field(default="baton", pattern=_NAME)
    model: ModelSection = ModelSection()
    ray: RaySection = RaySection()
    workers: WorkersSection = WorkersSection()
    kv_cache: KVCacheSection = KVCacheSection()
    scheduler: SchedulerSection = SchedulerSection()
    transfer: TransferSection = TransferSection()
    recovery: RecoverySection = RecoverySection()
    placement: PlacementSection = PlacementSection()
    membership: MembershipSection = MembershipSection()
    planner: PlannerSection = PlannerSection()
    api: ApiSection = ApiSection()
    admission: AdmissionSection = AdmissionSection()
    tracing: TracingSection = TracingSection()
    pools: dict[str, PoolSection] = Field(default_factory=dict, max_length=64)
    routing: RoutingSection = RoutingSection()


def parse_cluster_file(text: str, source: str = "cluster.yaml") -> ClusterFile:
    """The file's schema check alone: every problem in one ConfigError, by key path."""
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(source, f"not valid YAML: {exc}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(source, "the top level must be a mapping of sections")
    try:
        return ClusterFile.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(source, "; ".join(_describe(e) for e in exc.errors())) from None


def _describe(err: Any) -> str:
    where = ".".join(str(p) for p in err["loc"]) or "(top level)"
    if err["type"] == "extra_forbidden":
        return f"{where}: unknown key"
    return f"{where}: {err['msg']}"


def load_cluster_config(path: str | Path):  # type: ignore[no-untyped-def]  # -> ServerConfig
    """The ServerConfig a cluster.yaml describes."""
    p = Path(path)
    try:
        if p.stat().st_size > MAX_CONFIG_BYTES:
            raise ConfigError(str(p), f"larger than {MAX_CONFIG_BYTES} bytes")
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(str(p), f"cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(str(p), "not UTF-8 text") from None
    return to_server_config(parse_cluster_file(text, str(p)))


def to_server_config(f: ClusterFile):  # type: ignore[no-untyped-def]  # -> ServerConfig
    from cluster.disagg_config import DisaggConfig, MembershipConfig
    from cluster.edge.admission import AdmissionConfig
    from cluster.edge.http_api import HttpConfig
    from cluster.ops.tracing import TracingConfig
    from cluster.server import ServerConfig
    from engine.engine_config import EngineConfig
    from kvcache.tiers import TierConfig
    from kvtransfer.tls import KVTlsPaths

    w, kv, t = f.workers, f.kv_cache, f.transfer
    if (f.api.tls_cert is None) != (f.api.tls_key is None):
        raise ConfigError("api.tls_cert", "tls_cert and tls_key go together")
    if kv.disk_pages and not kv.disk_dir:
        raise ConfigError("kv_cache.disk_dir", "a disk tier (disk_pages > 0) needs disk_dir")
    if f.recovery.write_back_pages and not kv.disk_pages:
        raise ConfigError("recovery.write_back_pages", "writing pages back needs the disk tier: kv_cache.disk_pages > 0")
    if f.ray.address is not None and w.prefill.count == 0:
        raise ConfigError("workers.prefill.count", "attaching to a Ray cluster runs prefill actors: count >= 1")
    if w.prefill.count and w.decode.count < 1:
        raise ConfigError("workers.decode.count", "disaggregated serving needs at least one decode worker")
    if f.planner.enabled and w.prefill.count == 0:
        raise ConfigError("planner.enabled", "the planner resizes Ray worker pools: workers.prefill.count >= 1")
    if f.membership.backend == "etcd" and w.prefill.count == 0:
        raise ConfigError("membership.backend", "etcd membership is for Ray workers: workers.prefill.count >= 1")
    threads = w.decode.threads if w.prefill.count else None
    engine = EngineConfig(
        model=f.model.path, device=f.model.device, dtype=f.model.dtype, max_model_len=f.model.max_model_len,
        page_size=kv.page_size, num_pages=kv.device_pages,
        kv_memory_bytes=int(kv.device_memory_gb * (1 << 30)) if kv.device_memory_gb else None,
        enable_prefix_cache=kv.prefix_cache, kv_cache_dtype=kv.dtype, tiers=TierConfig(kv.host_pages, kv.disk_pages, kv.disk_dir, write_back_pages=f.recovery.write_back_pages),
        max_num_seqs=f.scheduler.max_num_seqs, max_num_batched_tokens=f.scheduler.max_batched_tokens,
        max_prefill_chunk=f.scheduler.max_prefill_chunk, num_threads=threads,
        async_scheduling=ASYNC_SCHEDULING[f.scheduler.async_scheduling],
        attention_backend=f.model.attention_backend, itl_target_ms=f.scheduler.itl_target_ms,
        scheduler_policy=f.scheduler.policy,
    )  # fmt: skip
    disagg = None
    if w.prefill.count:
        m = f.membership
        disagg = DisaggConfig(
            num_prefill=w.prefill.count, num_decode=w.decode.count, ray_address=f.ray.address,
            local_prefill_tokens=f.placement.local_prefill_tokens, transfer_deadline_s=t.deadline_s,
            reservation_ttl_s=t.reservation_ttl_s, num_threads=w.prefill.threads, pages_per_chunk=t.pages_per_chunk,
            transport=t.transport, shm_slots=t.shm_slots, bind_host=t.bind_host,
            advertise_host=t.advertise_host or "", pair_failures=t.pair_failures, pair_retry_s=t.pair_retry_s,
            kv_tls=KVTlsPaths(t.tls_cert or "", t.tls_key or "", t.tls_ca or ""),
            pin_cores=w.pin_cores, placement=f.placement.policy,
            max_migrations=f.recovery.max_migrations, watchdog_s=f.recovery.watchdog_s,
            max_restarts=f.recovery.max_restarts, preserve_kv=f.recovery.preserve_kv,
            retain_share=f.recovery.retain_share, retain_s=f.recovery.retain_s,
            drain_hand_off=f.recovery.drain_hand_off,
            prefill_resources=_resources(w.prefill), decode_resources=_resources(w.decode),
            decode_threads=w.decode.threads,
            membership=MembershipConfig(m.backend, f.cluster, m.lease_ttl_s, m.etcd.host, m.etcd.port,
                                        _etcd_access(m.etcd)),
        )  # fmt: skip
    planner = _planner(f) if f.planner.enabled else None
    a, tr = f.api, f.tracing
    return ServerConfig(
        engine=engine,
        http=HttpConfig(host=a.host, port=a.port, max_body_bytes=a.max_body_bytes,
                        allow_priority_field=a.allow_priority_field, tls_certfile=a.tls_cert, tls_keyfile=a.tls_key,
                        enable_admin=a.enable_admin),
        admission=AdmissionConfig(f.admission.max_waiting_requests, f.admission.max_waiting_tokens,
                                  f.admission.max_inflight_requests, batch_share=f.admission.batch_share),
        grpc_port=a.grpc_port or None,
        api_keys_file=Path(a.api_keys_file) if a.api_keys_file else None,
        request_timeout_s=a.request_timeout_s,
        served_model_name=tuple(names) if isinstance(names := f.model.served_name, list) else names,
        shared_prefix_texts=tuple(kv.shared_prefixes),
        prefill_workers=w.prefill.count,
        local_prefill_tokens=f.placement.local_prefill_tokens,
        disagg=disagg,
        pin_cores=w.pin_cores,
        planner=planner,
        planner_period_s=f.planner.period_s,
        tracing=TracingConfig(tr.otlp_endpoint, tr.service_name, tr.sample_ratio, tr.insecure),
        gateway=_gateway(f),
    )  # fmt: skip


def _gateway(f: ClusterFile):  # type: ignore[no-untyped-def]  # -> GatewaySpec | None
    """pools: and routing: as cluster.gateway.config's spec (checked there); None without pools."""
    from cluster.gateway.config import (
        OWN,
        GatewaySpec,
        HealthSpec,
        PoolSpec,
        RoutingSpec,
        Rule,
        check,
    )

    if not f.pools:
        return None
    pools = [PoolSpec(name=name, kind=p.kind, endpoints=tuple(p.endpoints), models=tuple(p.models),
                      upstream_models=tuple(p.upstream_models.items()), max_concurrency=p.max_concurrency,
                      api_key_file=p.api_key_file, kv_events=tuple(p.kv_events), kv_events_topic=p.kv_events_topic,
                      block_size=p.block_size, prefill_tokens_per_s=p.prefill_tokens_per_s,
                      endpoint_policy=p.endpoint_policy, connect_timeout_s=p.connect_timeout_s,
                      health=HealthSpec(**p.health.model_dump()), tokenizer=p.tokenizer, enabled=p.enabled)
             for name, p in f.pools.items()]  # fmt: skip
    if not any(p.kind == OWN for p in pools):  # this gateway's own workers are always a pool
        pools.insert(0, PoolSpec(name=OWN, kind="baton"))
    r = f.routing
    rules = tuple(Rule(pool=x.pool, models=tuple(x.models), route_keys=tuple(x.route_keys),
                       overlap_at_least=x.overlap_at_least, overlap_below=x.overlap_below) for x in r.rules)  # fmt: skip
    routing = RoutingSpec(route_key=r.route_key, window=r.window, min_samples=r.min_samples,
                          max_route_keys=r.max_route_keys, pages_per_key=r.pages_per_key, rules=rules,
                          approx_ttl_s=r.approx_ttl_s, approx_max_pages=r.approx_max_pages, log_path=r.log_path,
                          log_max_bytes=r.log_max_bytes)  # fmt: skip
    return check(GatewaySpec(tuple(pools), routing))


def _planner(f: ClusterFile):  # type: ignore[no-untyped-def]  # -> PlannerConfig
    from cluster.ops.planner import Limits, PlannerConfig

    pl = f.planner
    return PlannerConfig(
        ttft_slo_s=pl.ttft_slo_s, itl_slo_s=pl.itl_slo_s, out_samples=pl.out_samples, in_samples=pl.in_samples,
        cooldown_s=pl.cooldown_s, decode_max_running=f.scheduler.max_num_seqs,
        limits=Limits(min_prefill=pl.min_prefill, max_prefill=pl.max_prefill, min_decode=pl.min_decode,
                      max_decode=pl.max_decode, min_total=max(2, pl.min_prefill + pl.min_decode),
                      max_total=pl.max_total),
    )  # fmt: skip


def _etcd_access(e: EtcdSection) -> EtcdAccess:
    from cluster.disagg_config import EtcdAccess

    return EtcdAccess(e.tls_ca or "", e.tls_cert or "", e.tls_key or "", e.server_name or "", e.username or "",
                      e.password_file or "")  # fmt: skip


def _resources(role: RoleSection):  # type: ignore[no-untyped-def]
    from cluster.disagg_config import ActorResources

    return ActorResources(num_cpus=role.num_cpus, num_gpus=role.num_gpus,
                          resources=tuple(sorted(role.resources.items())))
