"""Probes for the load balancer and the Prometheus scrape."""

import asyncio
from collections.abc import Callable, Coroutine
from functools import partial
from typing import Any, Literal, Protocol

import asyncpg
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from service import metrics
from service.asgi import draining
from service.progress.ingest.sink import HeartbeatSink
from service.redis_client import RedisClient, ping
from service.stores import POSTGRES_FAILED, REDIS_FAILED

router = APIRouter(tags=["operations"])

_READY_TIMEOUT_S = 1.0


class ProbedParts(Protocol):
    """What the probes read of the pod's parts: the lifespan's `Services` (service/app.py), in `app.state.services`."""

    @property
    def redis(self) -> RedisClient: ...
    @property
    def pool(self) -> asyncpg.Pool | None: ...
    @property
    def sink(self) -> HeartbeatSink: ...
    @property
    def readiness_checks(self) -> dict[str, "asyncio.Task[object]"]: ...


class Readiness(BaseModel):
    """The body of both readiness answers (200 and 503), as openapi.yaml documents it."""

    status: Literal["ready", "unavailable", "draining"] = Field(
        description="draining: the pod got SIGTERM and is leaving the load balancer (it still takes heartbeats)."
    )
    mode: Literal["normal", "degraded", "unavailable"] = Field(
        description="normal: heartbeats go to Redis; degraded: straight to Postgres while Redis is unreachable."
    )
    checks: dict[str, str] = Field(
        description="`ok` or why not, for `redis` and (with a database) `postgres`; `shutdown` while draining."
    )


@router.get("/health/live", summary="The process is up")
async def live() -> dict[str, str]:
    return {"status": "ok"}


@router.get(
    "/health/ready",
    summary="Heartbeats can be accepted without being lost",
    response_model=None,
    responses={
        200: {"model": Readiness, "description": "Ready; `mode` says which store takes the heartbeats."},
        503: {
            "model": Readiness,
            "description": "No store can keep a heartbeat (`checks` says why), or the pod is draining before it stops.",
        },
    },
)
async def ready(request: Request) -> JSONResponse:
    """Ready while one path can keep a heartbeat: Redis (normal) or Postgres directly (degraded), and not draining."""
    pod: ProbedParts = request.app.state.services
    probes = {"redis": _bounded_check(pod, "redis", partial(ping, pod.redis), REDIS_FAILED)}
    if pod.pool is not None:
        probes["postgres"] = _bounded_check(pod, "postgres", partial(pod.pool.fetchval, "SELECT 1"), POSTGRES_FAILED)
    checks = dict(zip(probes, await asyncio.gather(*probes.values()), strict=True))
    if checks["redis"] == "ok" and pod.sink.redis_writes_failing:
        # PING answers, writes do not (a full Redis under noeviction, a node of the cluster down)
        checks["redis"] = "answers, but heartbeat writes fail: degraded mode"
    mode = "normal" if checks["redis"] == "ok" else "degraded" if checks.get("postgres") == "ok" else "unavailable"
    status = "unavailable" if mode == "unavailable" else "ready"
    if draining(request.scope) and status == "ready":
        # SIGTERM came (service/serving.py): the load balancer must take the pod out while it still answers
        checks["shutdown"] = "draining: SIGTERM received, the pod stops once the drain is over"
        status = "draining"
    body = {"status": status, "mode": mode, "checks": checks}  # a Readiness
    return JSONResponse(body, status_code=200 if status == "ready" else 503)


async def _bounded_check(
    pod: ProbedParts, store: str, probe: Callable[[], Coroutine[Any, Any, object]], failed: tuple[type[Exception], ...]
) -> str:
    """The store's answer within _READY_TIMEOUT_S, or why not.

    The probe is not cancelled at the deadline: cancelling an asyncpg query on a hung server waits for
    the cancel request's own connection (~30 s), longer than any probe waits. It goes on as the one check
    in flight for its store, which later probes wait on instead of starting another (the lifespan cancels
    what is left at shutdown).
    """
    checks = pod.readiness_checks
    task = checks.get(store)
    if task is None or task.done():
        task = checks[store] = asyncio.create_task(probe(), name=f"readiness-{store}")
        # retrieved when nobody waited for its end: its failure was (or will be) answered by the next probe
        task.add_done_callback(lambda done: done.cancelled() or done.exception())
    done, _ = await asyncio.wait({task}, timeout=_READY_TIMEOUT_S)
    if not done:
        return f"unreachable: no answer in {_READY_TIMEOUT_S:g} s"
    error = task.exception()
    if error is None:
        return "ok"
    if isinstance(error, failed):
        return f"unreachable: {type(error).__name__}: {error}"
    raise error


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
