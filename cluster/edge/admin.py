"""The operator routes (an operator key when keys are set; 404 unless `enable_admin`):

    POST /admin/drain    stop admitting (ready -> 503, new requests -> 503 + Retry-After) and let
                         the in-flight ones finish: a pod's preStop calls this, then waits for
                         inflight to reach 0
    POST /admin/scale    {"prefill": N, "decode": M} (either or both): each role's worker count
                         brought there, one worker at a time, through the planner's scaler
                         (KubeRay on Kubernetes, Ray actors elsewhere); `baton scale` sends it.
                         409 while another scale runs or while the planner owns the counts
"""

from __future__ import annotations

from typing import Any

from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from cluster.edge.frontend import Frontend
from cluster.errors import EdgeError, Kind, invalid

MAX_WORKERS_PER_ROLE = 256


class ScaleBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    prefill: int | None = Field(default=None, ge=0, le=MAX_WORKERS_PER_ROLE)
    decode: int | None = Field(default=None, ge=1, le=MAX_WORKERS_PER_ROLE)


def add_admin_routes(app: FastAPI, frontend: Frontend, enabled: bool) -> None:
    def check() -> None:  # a dependency: it runs before the body is read, so an off route is a 404 whatever it is sent
        if not enabled:
            raise EdgeError(Kind.NOT_FOUND, "Not Found")  # admin routes are off unless configured

    admin = [Depends(check)]

    @app.post("/admin/drain", include_in_schema=False, dependencies=admin)  # an operator route
    async def drain() -> JSONResponse:
        frontend.draining = True
        return JSONResponse({"draining": True, "inflight": frontend.admission.num_inflight})

    @app.post("/admin/scale", include_in_schema=False, dependencies=admin)
    async def scale(body: ScaleBody) -> dict[str, Any]:
        targets = body.model_dump(exclude_none=True)
        if not targets:
            raise invalid("name a target: {\"prefill\": N} and/or {\"decode\": M}")
        if frontend.scaling is None:
            raise EdgeError(Kind.ABORTED, "this gateway has no worker pools to scale (it serves colocated)")
        return await frontend.scaling.scale(targets)
