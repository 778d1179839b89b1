"""Probes for the load balancer and the Prometheus scrape."""

import asyncio
from typing import Literal

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from service import metrics
from service.clients import ping
from service.stores import POSTGRES_FAILED, REDIS_FAILED

router = APIRouter(tags=["operations"])

_READY_TIMEOUT_S = 1.0


class Readiness(BaseModel):
    """The body of both readiness answers (200 and 503), as openapi.yaml documents it."""

    status: Literal["ready", "unavailable"]
    mode: Literal["normal", "degraded", "unavailable"] = Field(
        description="normal: heartbeats go to Redis; degraded: straight to Postgres while Redis is unreachable."
    )
    checks: dict[str, str] = Field(description="`ok` or why not, for `redis` and (with a database) `postgres`.")


@router.get("/health/live", summary="The process is up")
async def live() -> dict[str, str]:
    return {"status": "ok"}


@router.get(
    "/health/ready",
    summary="Heartbeats can be accepted without being lost",
    response_model=None,
    responses={
        200: {"model": Readiness, "description": "Ready; `mode` says which store takes the heartbeats."},
        503: {"model": Readiness, "description": "No store can keep a heartbeat; `checks` says why."},
    },
)
async def ready(request: Request) -> JSONResponse:
    """Ready while one path can keep a heartbeat: Redis (normal) or Postgres directly (degraded)."""
    redis_check, postgres_check = await asyncio.gather(_check_redis(request), _check_postgres(request))
    sink = request.app.state.ingest.sink
    if redis_check == "ok" and sink is not None and sink.redis_writes_failing:
        # PING answers, writes do not (a full Redis under noeviction, a node of the cluster down)
        redis_check = "answers, but heartbeat writes fail: degraded mode"
    checks = {"redis": redis_check}
    if postgres_check is not None:
        checks["postgres"] = postgres_check
    if redis_check == "ok":
        readiness = Readiness(status="ready", mode="normal", checks=checks)
    elif postgres_check == "ok":
        readiness = Readiness(status="ready", mode="degraded", checks=checks)
    else:
        readiness = Readiness(status="unavailable", mode="unavailable", checks=checks)
    return JSONResponse(readiness.model_dump(), status_code=200 if readiness.status == "ready" else 503)


async def _check_redis(request: Request) -> str:
    try:
        async with asyncio.timeout(_READY_TIMEOUT_S):
            await ping(request.app.state.redis)
    except REDIS_FAILED as exc:  # TimeoutError is an OSError
        return f"unreachable: {type(exc).__name__}: {exc}"
    return "ok"


async def _check_postgres(request: Request) -> str | None:
    pool = request.app.state.db_pool
    if pool is None:
        return None
    try:
        async with asyncio.timeout(_READY_TIMEOUT_S):
            await pool.fetchval("SELECT 1")
    except POSTGRES_FAILED as exc:
        return f"unreachable: {type(exc).__name__}: {exc}"
    return "ok"


@router.get(
    "/metrics",
    summary="Prometheus metrics",
    response_class=Response,
    responses={
        200: {"description": "Prometheus text format.", "content": {"text/plain": {"schema": {"type": "string"}}}}
    },
)
async def prometheus_metrics() -> Response:
    body, content_type = metrics.render_latest()
    return Response(body, media_type=content_type)
