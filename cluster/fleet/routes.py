"""Which transport each (prefill, decode) pair of actors uses, and telling the prefill worker:
at launch, when a worker is adopted or revived (cluster.fleet.fleet). The pair's choice is
kvtransfer.select's; what came of it, per pair, is a PairRoute for cluster.placement.pair_health."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from cluster.placement.pair_health import PairRoute
from kvtransfer.select import TransportKind, pair_transport

logger = logging.getLogger(__name__)


async def route(
    prefills: Sequence[tuple[str, Any]], decodes: Sequence[tuple[str, Any, str]], transport: str
) -> list[PairRoute]:
    """Tell each prefill worker (name, actor) how to reach each decode worker (name, actor, KV
    address): kvtransfer.select's choice for the pair (nccl between CUDA pools, shm on one node,
    else gRPC), or the configured transport where the pair allows it. An nccl pair opens its
    channel here: the decode worker listens, the prefill worker joins. A pair whose pages
    cannot move (kvtransfer.select.pair_transport says why) is not routed: the prefill worker
    is never told the address, and the gateway's PairHealth marks it unroutable."""
    prefill_places = await asyncio.gather(*(p.place_of.remote() for _, p in prefills))
    decode_places = await asyncio.gather(*(d.place_of.remote() for _, d, _ in decodes))
    routes: list[PairRoute] = []
    calls = []
    for (p_name, prefill), p_place in zip(prefills, prefill_places, strict=True):
        for (d_name, decode, address), d_place in zip(decodes, decode_places, strict=True):
            kind = pair_transport(transport, p_place, d_place, address)
            if not isinstance(kind, TransportKind):
                routes.append(PairRoute(p_name, d_name, "", p_place.host, d_place.host, error=kind))
                continue
            routes.append(PairRoute(p_name, d_name, kind.value, p_place.host, d_place.host))
            calls.append(_route_pair(prefill, decode, address, kind))
    used = await asyncio.gather(*calls)
    it = iter(used)
    return [replace(r, transport=next(it)) if not r.error else r for r in routes]


async def _route_pair(prefill: Any, decode: Any, address: str, kind: TransportKind) -> str:
    if kind is not TransportKind.NCCL:
        return str(await prefill.route.remote(address, kind.value))
    rendezvous = await decode.nccl_listen.remote()
    used = str(await prefill.route.remote(address, kind.value, rendezvous))
    if used != kind.value:
        logger.warning("the pair to %s fell back to %s", address, used)
    return used
