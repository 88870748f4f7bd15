"""The operator routes (an operator key when keys are set; 404 unless `enable_admin`):

    POST /admin/drain    stop admitting (ready -> 503, new requests -> 503 + Retry-After) and let
                         the in-flight ones finish: a pod's preStop calls this, then waits for
                         inflight to reach 0
    POST /admin/scale    {"prefill": N, "decode": M} (either or both): each role's worker count
                         brought there, one worker at a time, through the planner's scaler
                         (KubeRay on Kubernetes, Ray actors elsewhere); `baton scale` sends it.
                         409 while another scale runs or while the planner owns the counts
    POST /admin/pins     {"pin_id", "tenant", "prompt" (text) or "token_ids", "ttl_s", "role"}:
                         keep the prefix's whole pages resident for the tenant's requests on
                         every worker of the role until the TTL (cluster.edge.pins); listed in
                         /status; the same id again replaces it
    DELETE /admin/pins/{tenant}/{pin_id}   release it on every worker
"""

from __future__ import annotations

import asyncio
import time
from typing import Annotated, Any, Literal

from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from cluster.edge.frontend import Frontend
from cluster.edge.openai_schema import MAX_PROMPT_CHARS, MAX_PROMPT_TOKENS
from cluster.edge.pins import MAX_TTL_S, MIN_TTL_S, PIN_ID
from cluster.errors import EdgeError, Kind, invalid

MAX_WORKERS_PER_ROLE = 256


class ScaleBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    prefill: int | None = Field(default=None, ge=0, le=MAX_WORKERS_PER_ROLE)
    decode: int | None = Field(default=None, ge=1, le=MAX_WORKERS_PER_ROLE)


class PinBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    pin_id: str = Field(pattern=PIN_ID.pattern)
    tenant: str = Field(min_length=1, max_length=256, description="whose requests reuse the pinned pages")
    prompt: str | None = Field(default=None, min_length=1, max_length=MAX_PROMPT_CHARS)
    token_ids: list[Annotated[int, Field(ge=0, lt=2**31)]] | None = Field(default=None, min_length=1,
                                                                           max_length=MAX_PROMPT_TOKENS)
    ttl_s: float = Field(ge=MIN_TTL_S, le=MAX_TTL_S)
    role: Literal["prefill", "decode"] | None = None


def add_admin_routes(app: FastAPI, frontend: Frontend, enabled: bool) -> None:
    def check() -> None:  # a dependency: it runs before the body is read, so an off route is a 404 whatever it is sent
        if not enabled:
            raise EdgeError(Kind.NOT_FOUND, "Not Found")  # admin routes are off unless configured

    admin = [Depends(check)]

    @app.post("/admin/drain", include_in_schema=False, dependencies=admin)  # an operator route
    async def drain() -> JSONResponse:
        frontend.draining = True
        return JSONResponse({"draining": True, "inflight": frontend.num_inflight})

    @app.post("/admin/scale", include_in_schema=False, dependencies=admin)
    async def scale(body: ScaleBody) -> dict[str, Any]:
        targets = body.model_dump(exclude_none=True)
        if not targets:
            raise invalid("name a target: {\"prefill\": N} and/or {\"decode\": M}")
        if frontend.scaling is None:
            raise EdgeError(Kind.ABORTED, "this gateway has no worker pools to scale (it serves colocated)")
        return await frontend.scaling.scale(targets)

    @app.post("/admin/pins", include_in_schema=False, dependencies=admin)
    async def pin(body: PinBody) -> dict[str, Any]:
        if (body.prompt is None) == (body.token_ids is None):
            raise invalid("give the prefix as prompt (text) or token_ids, not both", "prompt")
        ids = body.token_ids
        if ids is None:
            assert body.prompt is not None
            ids = await asyncio.to_thread(frontend.tokenizer.encode, body.prompt, True)
        record = await frontend.pin(body.tenant, body.pin_id, ids, body.ttl_s, body.role or "")
        return record.to_json(time.time())

    @app.delete("/admin/pins/{tenant}/{pin_id}", include_in_schema=False, dependencies=admin)
    async def unpin(tenant: str, pin_id: str) -> dict[str, Any]:
        if not await frontend.unpin(tenant, pin_id):
            raise EdgeError(Kind.NOT_FOUND, f"tenant {tenant!r} has no pin {pin_id!r}", "pin_id")
        return {"released": True}
