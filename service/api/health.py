"""Probes for the load balancer and the Prometheus scrape."""

import asyncio

import asyncpg
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from redis.exceptions import RedisError

from service import metrics

router = APIRouter(tags=["operations"])

_READY_TIMEOUT_S = 1.0


@router.get("/health/live", summary="The process is up")
async def live() -> dict[str, str]:
    return {"status": "ok"}


@router.get(
    "/health/ready",
    summary="Heartbeats can be accepted without being lost",
    responses={503: {"description": "A dependency is down; `checks` says which."}},
)
async def ready(request: Request) -> JSONResponse:
    """Ready while one path can keep a heartbeat: Redis (normal) or Postgres directly (degraded)."""
    redis_check, postgres_check = await asyncio.gather(_check_redis(request), _check_postgres(request))
    checks = {"redis": redis_check}
    if postgres_check is not None:
        checks["postgres"] = postgres_check
    if redis_check == "ok":
        mode = "normal"
    elif postgres_check == "ok":
        mode = "degraded"
    else:
        return JSONResponse({"status": "unavailable", "mode": "unavailable", "checks": checks}, status_code=503)
    return JSONResponse({"status": "ready", "mode": mode, "checks": checks})


async def _check_redis(request: Request) -> str:
    try:
        async with asyncio.timeout(_READY_TIMEOUT_S):
            await request.app.state.redis.ping()
    except (RedisError, OSError, TimeoutError) as exc:
        return f"unreachable: {type(exc).__name__}: {exc}"
    return "ok"


async def _check_postgres(request: Request) -> str | None:
    pool = request.app.state.db_pool
    if pool is None:
        return None
    try:
        async with asyncio.timeout(_READY_TIMEOUT_S):
            await pool.fetchval("SELECT 1")
    except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError, TimeoutError) as exc:
        return f"unreachable: {type(exc).__name__}: {exc}"
    return "ok"


@router.get("/metrics", summary="Prometheus metrics", response_class=Response)
async def prometheus_metrics() -> Response:
    body, content_type = metrics.render_latest()
    return Response(body, media_type=content_type)
