"""The ASGI application: FastAPI for probes and metrics, the ingest fast path in front of it."""

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

from fastapi import FastAPI
from redis.exceptions import RedisError

from service.api import health
from service.api.ingest import ProgressIngest
from service.api.openapi import build_openapi
from service.auth import Authenticator
from service.clients import connect_redis
from service.config import Settings, load_settings
from service.logs import configure_logging
from service.progress.buffer import WRITE_SCRIPT, PositionWriter

log = logging.getLogger(__name__)


@asynccontextmanager
async def lifespan(api: FastAPI) -> AsyncIterator[None]:
    settings: Settings = api.state.settings
    ingest: ProgressIngest = api.state.ingest
    redis = connect_redis(settings)
    try:
        await redis.script_load(WRITE_SCRIPT)
    except (RedisError, OSError) as exc:
        # not fatal: readiness reports it, and the writer loads the script once Redis is back
        log.warning("Redis not reachable at start-up (%s); /health/ready will say so", exc)
    writer = PositionWriter(redis, ttl_s=settings.progress_position_ttl_seconds)
    api.state.redis = redis
    ingest.writer = writer
    log.info("progress-service started", extra={"pod": settings.pod_name})
    try:
        yield
    finally:
        ingest.writer = None
        await writer.aclose()
        await redis.aclose()
        log.info("progress-service stopped", extra={"pod": settings.pod_name})


def create_app(settings: Settings | None = None) -> ProgressIngest:
    settings = settings or load_settings()
    settings.check_can_serve()
    api = FastAPI(
        title="progress-service",
        version="1.0.0",
        description="Progress heartbeats of the mobile app, buffered in Redis and flushed to Postgres.",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    api.include_router(health.router)
    api.openapi = partial(build_openapi, api)  # type: ignore[method-assign]
    app = ProgressIngest(api, authenticator=Authenticator(settings), max_body_bytes=settings.max_body_bytes)
    api.state.settings = settings
    api.state.ingest = app
    return app


def app_from_environment() -> ProgressIngest:
    """The factory `serve` gives uvicorn: each worker process reads the environment and logs as JSON."""
    settings = load_settings()
    configure_logging(settings.log_level)
    return create_app(settings)
