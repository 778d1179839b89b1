"""The ASGI application: the route table (service/api/routes.py) over the parts the lifespan builds."""

import asyncio
import gc
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import asyncpg
from fastapi import FastAPI

from service import tracing
from service.api import health
from service.api.catalog import REFRESH_S as CATALOG_REFRESH_S
from service.api.catalog import ContentCatalog
from service.api.ingest import ProgressIngest
from service.api.openapi import openapi_document
from service.api.reads import ProgressReads
from service.api.routes import Handlers, Routes
from service.api.sync import ProgressSync
from service.auth import Authenticator
from service.compose import check_startup, periodic_sweep, relay_routes, start_publisher
from service.config import Settings, load_settings
from service.lifecycle import Lifecycle
from service.logs import RequestIdMiddleware, configure_logging
from service.outbox.outboxes import publish_budget_s
from service.outbox.relay import Relay
from service.postgres import create_db_pool
from service.progress.flush.budget import FlushBudget
from service.progress.flush.flusher import Flusher
from service.progress.flush.redis_persistence import run_redis_persistence_sampler
from service.progress.ingest.buffer import WRITE_MANY_SCRIPT, WRITE_SCRIPT, PositionWriter
from service.progress.ingest.redis_memory import run_redis_memory_sampler
from service.progress.ingest.sink import HeartbeatSink
from service.progress.keys import KeyLayout
from service.progress.read.reads import ProgressReader
from service.progress.read.sync import OfflineSync
from service.redis_client import RedisClient, connect_redis
from service.stores import REDIS_FAILED

log = logging.getLogger(__name__)

Clock = Callable[[], float]


class BackgroundTasks:
    """The pod's loops: each handle kept, its failure logged, all stopped and awaited on shutdown."""

    def __init__(self) -> None:
        self.stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self, name: str, loop: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(loop, name=name)
        task.add_done_callback(self._report)
        self._tasks.append(task)

    def _report(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("background task %s died", task.get_name(), exc_info=task.exception())

    async def aclose(self, timeout_s: float) -> None:
        self.stop.set()
        if not self._tasks:
            return
        _, late = await asyncio.wait(self._tasks, timeout=timeout_s)
        for task in late:
            log.warning("background task %s did not stop in %.0fs; cancelling it", task.get_name(), timeout_s)
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


@dataclass(frozen=True, slots=True)
class Services:
    """The pod's parts, built whole by `start_services` before the first request. None: not configured
    (`pool`, `reader`, `offline` without DATABASE_URL; `catalog` with the door off)."""

    redis: RedisClient
    pool: asyncpg.Pool | None
    # readiness probes left waiting on a hung store (service/api/health.py): cancelled before the pools close
    readiness_checks: dict[str, "asyncio.Task[object]"]
    sink: HeartbeatSink
    catalog: ContentCatalog | None
    reader: ProgressReader | None
    offline: OfflineSync | None


async def start_services(settings: Settings, lifecycle: Lifecycle, clock: Clock = time.monotonic) -> Services:
    """Every part, started in the order that keeps the guarantees at shutdown (stopped in reverse): the
    heartbeat writes (reader, catalog, sink) stop before the loops' last flush, the last flush
    before the relay's final pass, and those before the publisher, the pool and Redis close."""
    if tracing.configure():  # stopped last: the spans of the final flush and pass are exported too
        lifecycle.started_part("tracing", tracing.aclose)
    redis = connect_redis(settings.redis)
    lifecycle.started_part("redis", redis.aclose)
    try:
        for script in (WRITE_SCRIPT, WRITE_MANY_SCRIPT):
            await redis.script_load(script)
    except REDIS_FAILED as exc:
        # not fatal: readiness reports it, and the writer loads the scripts once Redis is back
        log.warning("Redis not reachable at start-up (%s); /health/ready will say so", exc)
    checks = dict[str, "asyncio.Task[object]"]()
    lifecycle.started_part("readiness checks", _cancel_all, checks)
    background = BackgroundTasks()
    budget = FlushBudget.from_settings(settings.flush, redis)  # every row the pod writes: flush, degraded mode, emails
    pool = None
    if settings.database_url:
        pool = await create_db_pool(settings.database)
        lifecycle.started_part("postgres pool", pool.close)
        if settings.progress_flusher_enabled:
            background.start("progress-flusher", Flusher(settings.flush, redis, pool, budget).run(background.stop))
        publisher = start_publisher(settings, lifecycle) if settings.celery_broker_url else None
        if settings.trial_journey_interval_seconds > 0:
            background.start("trial-journey-sweep", periodic_sweep(settings, pool, background.stop, budget))
        if settings.relay_enabled and publisher is not None:
            relay = Relay(settings.relay, pool, relay_routes(settings, redis, publisher))
            background.start("outbox-relay", relay.run(background.stop))
            # stops once the loops have stopped: the final flush's completions go out now, not at another pod's relay
            budget_s = publish_budget_s(settings.celery_publish_timeout_seconds)
            lifecycle.started_part("relay final pass", relay.final_pass, budget_s)
    # the final flush must see every write acknowledged before shutdown: the loops stop after the writes
    lifecycle.started_part("background loops", background.aclose, settings.progress_shutdown_timeout_seconds + 5)
    layout = KeyLayout.from_settings(settings.redis)
    sink = HeartbeatSink(settings.degraded, PositionWriter(redis, layout=layout), pool, budget)
    lifecycle.started_part("heartbeat sink", sink.aclose)
    catalog = None
    if settings.content_catalog_enabled and pool is not None:
        # the door's catalog of known content (hostile clients): its first snapshot is loaded before serving
        catalog = ContentCatalog(pool, clock=clock)
        await catalog.try_refresh()
        lifecycle.started_part("content catalog", catalog.aclose)
        background.start("content-catalog", catalog.run_refresh(background.stop, CATALOG_REFRESH_S))
    background.start("redis-memory", run_redis_memory_sampler(redis, background.stop))
    # what a Redis restart would lose: its first reading is the start's log line
    persistence = run_redis_persistence_sampler(redis, background.stop, flush_interval_s=settings.flush.interval_s)
    background.start("redis-persistence", persistence)
    reader = offline = None
    if pool is not None:
        reader = ProgressReader(redis, pool, margin_s=settings.progress_completion_margin_seconds, layout=layout)
        lifecycle.started_part("progress reader", reader.aclose)
        # its own writer: a sync's pipeline is its own, not shared with the heartbeats of the turn
        offline = OfflineSync(PositionWriter(redis, layout=layout), pool)
    return Services(redis, pool, checks, sink, catalog, reader, offline)


@asynccontextmanager
async def lifespan(api: FastAPI) -> AsyncIterator[None]:
    """The parts start whole, then the table serves them; at shutdown it stops serving, then they stop."""
    settings: Settings = api.state.settings
    api.state.lifecycle = lifecycle = Lifecycle()
    routes: Routes = api.state.routes
    try:
        services = await start_services(settings, lifecycle, api.state.clock)
        probed: health.ProbedParts = services  # what the probes read: held to the Protocol by the type checker
        api.state.services = probed
        authenticator: Authenticator = api.state.authenticator
        api.state.handlers = Handlers(
            ProgressIngest(services.sink, authenticator=authenticator, catalog=services.catalog),
            ProgressReads(services.reader, authenticator=authenticator),
            ProgressSync(services.offline, authenticator=authenticator),
        )
        routes.serve(api.state.handlers)
        # Everything alive now lives as long as the process: moved out of the collector's sight,
        # a full collection under load scans ~1 k objects instead of ~80 k (a 37 ms pause at p99.9).
        gc.collect()
        gc.freeze()
        log.info("progress-service started", extra={"pod": settings.pod_name})
        yield
    finally:
        routes.stop_serving()
        log.info("progress-service stopping", extra={"pod": settings.pod_name})
        await lifecycle.aclose()


def create_app(
    settings: Settings | None = None, *, clock: Clock = time.monotonic, wall_clock: Clock = time.time
) -> Routes:
    """The route table over FastAPI; `clock` (the door's catalog) and `wall_clock` (token expiry) are for tests."""
    settings = settings or load_settings()
    check_startup(settings)
    api = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None)  # the OpenAPI document is openapi.yaml's
    api.include_router(health.router)
    api.add_middleware(RequestIdMiddleware)  # the FastAPI routes only: the heartbeat path stays lean
    api.openapi = openapi_document  # type: ignore[method-assign]
    api.state.settings = settings
    api.state.authenticator = Authenticator(settings.auth, clock=wall_clock)  # a bad auth setting fails here
    api.state.clock = clock
    api.state.routes = routes = Routes(api)
    return routes


def app_from_environment() -> Routes:
    """The factory `serve` gives uvicorn: each worker process reads the environment and logs as JSON."""
    settings = load_settings()
    configure_logging(settings.log_level)
    return create_app(settings)


async def _cancel_all(tasks: dict[str, "asyncio.Task[object]"]) -> None:
    for task in tasks.values():
        task.cancel()
    await asyncio.gather(*tasks.values(), return_exceptions=True)
