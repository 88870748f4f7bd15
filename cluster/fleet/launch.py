"""Start disaggregated serving on Ray: P PrefillActors and D DecodeActors, and the gateway's
RayFront over them (`baton up --prefill P --decode D`, `baton serve --ray-address ADDR`).

    ray_runtime.start_local() / connect(addr)    (the caller; Ray first, then this)
    front = await launch(engine_cfg, DisaggConfig(num_prefill=P, num_decode=D))
    front.start()                                the output streams and the health poll

Membership (DisaggConfig.membership): with `ray`, the gateway spawns a registry actor; with
`etcd`, the workers hold leases there. Each actor registers itself once started (its epoch
comes from the backend), and the RayFront follows joins, leaves and new epochs from then on.

With `pin_cores` each actor pins its own process to one core (cluster.fleet.cpu), round robin
over the cores of its node: prefill actors take slots 0..P-1, decode actors P..P+D-1.

The gateway keeps no weights: it loads the checkpoint's tokenizer and config only
(GatewayModel), enough for the edge to tokenize, validate and render.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from cluster.disagg_config import DisaggConfig
from cluster.fleet.actors import spawn_decode, spawn_prefill
from cluster.fleet.front import RayFront
from cluster.fleet.registration import open_membership, spawn_registry
from cluster.fleet.routes import route
from cluster.fleet.workers import DecodeHandle, PrefillHandle
from engine.builtin import resolve_model_dir
from engine.config import ModelConfig
from engine.engine_config import EngineConfig
from engine.tokenizer import Tokenizer
from kvcache.tiers import TierConfig

logger = logging.getLogger(__name__)

ACTOR_START_S = 300.0  # loading a model into each actor; generous for a cold node


@dataclass(frozen=True, slots=True)
class GatewayModel:
    """What the edge needs of the model (frontend.ModelView), without the weights."""

    tokenizer: Tokenizer
    max_model_len: int
    model_config: ModelConfig

    @classmethod
    def load(cls, cfg: EngineConfig) -> GatewayModel:
        model_dir = resolve_model_dir(cfg.model)
        mc = ModelConfig.from_dir(model_dir)
        max_len = min(cfg.max_model_len or mc.max_model_len, mc.max_model_len)  # as the Engine does
        return cls(Tokenizer.from_dir(model_dir), max_len, mc)


async def launch(engine_cfg: EngineConfig, cfg: DisaggConfig, shared_prefix_texts: Sequence[str] = ()) -> RayFront:
    """Spawn the actors on the connected Ray and wait until each has loaded its model."""
    model = await asyncio.to_thread(GatewayModel.load, engine_cfg)
    shared = tuple(tuple(model.tokenizer.encode(t)) for t in shared_prefix_texts)
    engine_cfg = replace(engine_cfg, shared_prefixes=engine_cfg.shared_prefixes + shared)
    run = secrets.token_hex(3)  # actor names of this gateway, apart from any other's
    registry_name = f"baton-{run}-registry"
    registry = spawn_registry(cfg.membership, registry_name)  # None with etcd
    spawner = Spawner(engine_cfg, cfg, run, registry_name)
    decodes = [spawner.decode(i, pin_slot=cfg.num_prefill + i if cfg.pin_cores else None) for i in range(cfg.num_decode)]
    prefills = [spawner.prefill(i, pin_slot=i if cfg.pin_cores else None) for i in range(cfg.num_prefill)]
    async with asyncio.timeout(ACTOR_START_S):
        addresses: list[str] = await asyncio.gather(*(d.start.remote() for d in decodes))
        await asyncio.gather(*(p.ping.remote() for p in prefills))
        routes = await route([(f"prefill-{i}", p) for i, p in enumerate(prefills)],
                             [(f"decode-{i}", d, a) for i, (d, a) in enumerate(zip(decodes, addresses, strict=True))],
                             cfg.transport)  # fmt: skip
        # Each worker registers itself (its lease is its own); the gateway follows membership.
        prefill_epochs: list[int] = await asyncio.gather(
            *(p.join.remote(cfg.membership, registry_name, f"prefill-{i}") for i, p in enumerate(prefills)))
        decode_epochs: list[int] = await asyncio.gather(
            *(d.join.remote(cfg.membership, registry_name, f"decode-{i}") for i, d in enumerate(decodes)))
        membership = await open_membership(cfg.membership, registry_name)
        if cfg.pin_cores:
            cores: list[list[int]] = await asyncio.gather(*(a.cores.remote() for a in (*prefills, *decodes)))
            logger.info("pinned: prefill actors on cores %s, decode actors on %s",
                        cores[: len(prefills)], cores[len(prefills):])  # fmt: skip
        fingerprint: bytes = await decodes[0].fingerprint.remote()  # what the engines hash pages with
    logger.info("%d prefill and %d decode actors up; decode KV at %s", len(prefills), len(decodes), addresses)
    mc = model.model_config
    # one page of KV, all layers, K and V, at 2 bytes an element (a placement cost input only)
    page_bytes = mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * engine_cfg.page_size * 2
    return RayFront(
        model,
        [PrefillHandle(f"prefill-{i}", actor, epoch) for i, (actor, epoch) in enumerate(zip(prefills, prefill_epochs,
                                                                                            strict=True))],
        [DecodeHandle(f"decode-{i}", actor, addr, cfg.poll_wait_s, epoch=epoch, watchdog_s=cfg.watchdog_s)
         for i, (actor, addr, epoch)
         in enumerate(zip(decodes, addresses, decode_epochs, strict=True))],
        cfg, fingerprint, engine_cfg.page_size, engine_cfg.max_num_seqs, page_bytes,
        membership=membership, registry=registry, registry_name=registry_name, spawner=spawner, routes=routes,
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class Spawner:
    """Starts this gateway's worker actors: at launch, and later for Fleet.add_worker (the
    planner), where the new actor joins membership and the gateway adopts it from the JOIN."""

    engine_cfg: EngineConfig
    cfg: DisaggConfig
    run: str  # actor names: baton-{run}-{role}-{index}
    registry_name: str

    def decode(self, index: int, pin_slot: int | None = None) -> Any:
        cfg = self.cfg
        return spawn_decode(
            _decode_cfg(self.engine_cfg, index, cfg.num_decode), name=f"baton-{self.run}-decode-{index}",
            reservation_ttl_s=cfg.reservation_ttl_s, admit_lease_s=cfg.transfer_deadline_s,
            local_prefill_tokens=cfg.local_prefill_tokens, resources=cfg.decode_resources,
            num_threads=cfg.decode_threads or cfg.num_threads, shm_slots=0 if cfg.transport in ("grpc", "nccl") else cfg.shm_slots,
            shm_slot_pages=cfg.pages_per_chunk, pin_slot=pin_slot, max_restarts=cfg.max_restarts,
            bind_host=cfg.bind_host, advertise_host=cfg.advertise_host, tls=cfg.kv_tls,
            hand_off_on_drain=cfg.drain_hand_off, hand_off_pages=cfg.preserve_kv,
        )  # fmt: skip

    def prefill(self, index: int, pin_slot: int | None = None) -> Any:
        cfg = self.cfg
        # The prefill role keeps only its device cache: the lower tiers belong to decode workers.
        return spawn_prefill(
            replace(self.engine_cfg, tiers=TierConfig()), name=f"baton-{self.run}-prefill-{index}", epoch=index + 1,
            pages_per_chunk=cfg.pages_per_chunk, num_threads=cfg.num_threads, resources=cfg.prefill_resources,
            push_deadline_s=cfg.transfer_deadline_s, chunk_pause_s=cfg.chunk_pause_s, pin_slot=pin_slot,
            retain_share=cfg.retain_share if cfg.preserve_kv else 0.0, retain_s=cfg.retain_s,
            reservation_ttl_s=cfg.reservation_ttl_s, max_restarts=cfg.max_restarts, tls=cfg.kv_tls,
        )  # fmt: skip

    async def start_worker(self, role: str, index: int, timeout_s: float = ACTOR_START_S) -> Any:
        """Spawn one more worker, wait (up to `timeout_s`: on KubeRay its pod is made first)
        until its model is loaded, and let it join membership as `{role}-{index}`. Keep the
        returned handle: the actor lives while its creator's handle does (a name alone does not
        keep it)."""
        actor = self.decode(index) if role == "decode" else self.prefill(index)
        async with asyncio.timeout(timeout_s):
            await (actor.start.remote() if role == "decode" else actor.ping.remote())
            await actor.join.remote(self.cfg.membership, self.registry_name, f"{role}-{index}")
        return actor


def _decode_cfg(cfg: EngineConfig, index: int, count: int) -> EngineConfig:
    """Each decode worker owns its disk tier: a directory is locked by one engine."""
    if count == 1 or not cfg.tiers.disk_dir:
        return cfg
    return replace(cfg, tiers=replace(cfg.tiers, disk_dir=str(Path(cfg.tiers.disk_dir) / f"decode-{index}")))
