"""Prefix pins at the gateway: an operator keeps a tenant's prefix (a shared system prompt, a
RAG corpus header) resident on every worker of a role until a TTL (engine.pins on each one).

    gRPC PinPrefix / POST /admin/pins    check bounds -> every worker of the role pins it, and
                                         the call waits (PIN_WAIT_S at most) until each holds
                                         the pages -> the book records what each said (/status)
    gRPC UnpinPrefix / DELETE /admin/pins/{tenant}/{pin_id}   every worker releases it

The book bounds pins per tenant (MAX_PINS_PER_TENANT, MAX_PINNED_TOKENS_PER_TENANT); each
worker bounds the pages its pins hold (half its pool). On Ray a pin stands until its TTL: a
worker of its role that joins later (the planner's, `baton scale`'s, adopted) or that Ray
restarted gets it too, for what is left of the TTL (cluster.fleet.pins), and the book adds
what that worker answered. A colocated or one-process gateway has no workers that join.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from cluster.errors import EdgeError, Kind, invalid
from engine.pins import PinAnswer, PinView

MAX_PINS_PER_TENANT = 8
MAX_PINNED_TOKENS_PER_TENANT = 65_536
MIN_TTL_S, MAX_TTL_S = 1.0, 86_400.0
PIN_WAIT_S = 30.0  # a pin call waits this long for the workers to hold the pages (else: "computing")
PIN_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
ROLES = ("", "prefill", "decode")  # "": where prompts are computed (prefill workers, else decode)


@runtime_checkable
class PinsPrefixes(Protocol):
    """An engine side whose workers can pin prefixes (PDFront, RayFront; a colocated
    AsyncEngine is pinned through engine.pins.pin_on)."""

    async def pin_prefix(
        self, role: str, pin_id: str, prompt_ids: tuple[int, ...], cache_salt: str, ttl_s: float, wait_s: float
    ) -> list[PinAnswer]: ...

    async def unpin_prefix(self, pin_id: str) -> int: ...

    def follow_pins(self, answered: Callable[[str, PinAnswer], None]) -> None:
        """`answered(worker pin id, answer)` for each pin re-applied to a worker that joined."""


def worker_pin_id(tenant: str, pin_id: str) -> str:
    """The id on the workers: tenants name their pins independently (a pin id has no ':')."""
    return f"{tenant}:{pin_id}"


@dataclass(slots=True)
class PinRecord:
    tenant: str
    pin_id: str
    role: str
    num_tokens: int
    num_pages: int
    ttl_s: float
    expires_at: float  # time.time()
    workers: dict[str, str] = field(default_factory=dict)  # worker -> "held", "computing" or why not

    def to_json(self, now: float) -> dict[str, Any]:
        return {"tenant": self.tenant, "pin_id": self.pin_id, "role": self.role or "default",
                "num_tokens": self.num_tokens, "num_pages": self.num_pages, "ttl_s": self.ttl_s,
                "expires_in_s": round(max(0.0, self.expires_at - now), 1), "workers": dict(self.workers)}  # fmt: skip


class PinBook:
    def __init__(self) -> None:
        self._pins: dict[tuple[str, str], PinRecord] = {}

    def records(self) -> list[PinRecord]:
        now = time.time()
        for key in [k for k, r in self._pins.items() if r.expires_at <= now]:
            del self._pins[key]
        return sorted(self._pins.values(), key=lambda r: (r.tenant, r.pin_id))

    def check(self, tenant: str, pin_id: str, num_tokens: int, ttl_s: float, role: str) -> None:
        """Every bound, before any worker is asked (INVALID_ARGUMENT / RESOURCE_EXHAUSTED)."""
        if not PIN_ID.match(pin_id):
            raise invalid("pin_id: 1 to 64 of [A-Za-z0-9_.-]", "pin_id")
        if not MIN_TTL_S <= ttl_s <= MAX_TTL_S:
            raise invalid(f"ttl: {MIN_TTL_S:g} to {MAX_TTL_S:g} seconds", "ttl")
        if role not in ROLES:
            raise invalid("role: prefill or decode (or unset: where prompts are computed)", "role")
        mine = [r for r in self.records() if r.tenant == tenant and r.pin_id != pin_id]
        if len(mine) >= MAX_PINS_PER_TENANT:
            raise EdgeError(Kind.RESOURCE_EXHAUSTED, f"tenant {tenant!r} has {len(mine)} pins, the most allowed")
        if sum(r.num_tokens for r in mine) + num_tokens > MAX_PINNED_TOKENS_PER_TENANT:
            raise EdgeError(Kind.RESOURCE_EXHAUSTED,
                            f"tenant {tenant!r} may pin at most {MAX_PINNED_TOKENS_PER_TENANT} tokens in all")

    def record(
        self, tenant: str, pin_id: str, role: str, num_tokens: int, ttl_s: float, answers: Sequence[PinAnswer]
    ) -> PinRecord:
        views = [a for _, a in answers if isinstance(a, PinView)]
        rec = PinRecord(tenant, pin_id, role, num_tokens, views[0].num_pages if views else 0, ttl_s,
                        time.time() + ttl_s, {w: a.state if isinstance(a, PinView) else a for w, a in answers})
        if views:
            self._pins[(tenant, pin_id)] = rec
        else:
            self._pins.pop((tenant, pin_id), None)
        return rec

    def answered(self, worker_pin: str, answer: PinAnswer) -> None:
        """A worker that joined later answered a standing pin (cluster.fleet.pins)."""
        tenant, _, pin_id = worker_pin.rpartition(":")  # a pin id has no ':' (PIN_ID)
        rec = self._pins.get((tenant, pin_id))
        if rec is not None and rec.expires_at > time.time():
            worker, said = answer
            rec.workers[worker] = said.state if isinstance(said, PinView) else said

    def forget(self, tenant: str, pin_id: str) -> None:
        self._pins.pop((tenant, pin_id), None)
