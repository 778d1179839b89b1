"""Probes for the load balancer and the Prometheus scrape."""

import asyncio

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
    checks = {"redis": await _check_redis(request)}
    healthy = all(result == "ok" for result in checks.values())
    return JSONResponse(
        {"status": "ready" if healthy else "unavailable", "checks": checks}, status_code=200 if healthy else 503
    )


async def _check_redis(request: Request) -> str:
    try:
        async with asyncio.timeout(_READY_TIMEOUT_S):
            await request.app.state.redis.ping()
    except (RedisError, OSError, TimeoutError) as exc:
        return f"unreachable: {type(exc).__name__}: {exc}"
    return "ok"


@router.get("/metrics", summary="Prometheus metrics", response_class=Response)
async def prometheus_metrics() -> Response:
    body, content_type = metrics.render_latest()
    return Response(body, media_type=content_type)
