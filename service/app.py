"""The ASGI application: the route table (service/api/routes.py) over the parts the lifespan builds."""

import asyncio
import gc
import logging
from collections.abc import AsyncIterator, Coroutine
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import asyncpg
from fastapi import FastAPI

from service.api import health
from service.api.catalog import CATALOG_MAX_ANSWERS, CATALOG_MAX_LOOKUPS, ContentCatalog
from service.api.deferred import DeferredHeartbeats
from service.api.ingest import ProgressIngest
from service.api.openapi import openapi_document
from service.api.ratelimit import RateLimiter
from service.api.reads import ProgressReads
from service.api.routes import Routes, route_table
from service.api.sync import ProgressSync
from service.auth import Authenticator
from service.config import Settings, load_settings
from service.logs import RequestIdMiddleware, configure_logging
from service.outbox.celery_publisher import CeleryPublisher, publisher_from_settings
from service.outbox.messages import Publisher
from service.outbox.outboxes import COMPLETIONS, EMAILS, publish_budget_s
from service.outbox.relay import Relay, Route
from service.postgres import create_db_pool
from service.progress.buffer import WRITE_MANY_SCRIPT, WRITE_SCRIPT, PositionWriter
from service.progress.flusher import Flusher
from service.progress.keys import KeyLayout, key_layout
from service.progress.reads import ProgressReader
from service.progress.redis_memory import run_redis_memory_sampler
from service.progress.redis_persistence import run_redis_persistence_sampler
from service.progress.sink import DirectWriter, HeartbeatSink
from service.progress.sync import OfflineSync
from service.redis_client import RedisClient, connect_redis
from service.stores import REDIS_FAILED
from service.trial_emails.batch import BatchOptions
from service.trial_emails.queue import EmailQueue, build_email_queue, email_relay_publisher
from service.trial_emails.sweep import run_periodic_sweep

log = logging.getLogger(__name__)


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


# The background parts from the settings: used by the lifespan, the commands (service.cli) and the tests.


def build_key_layout(settings: Settings) -> KeyLayout:
    return key_layout(
        shards=settings.progress_buffer_shards,
        cluster=settings.redis_cluster,
        previous_shards=settings.progress_buffer_previous_shards,
    )


def build_flusher(settings: Settings, redis: RedisClient, pool: asyncpg.Pool) -> Flusher:
    return Flusher(
        redis=redis,
        pool=pool,
        layout=build_key_layout(settings),
        batch_size=settings.progress_flush_batch_size,
        lease_s=settings.progress_flush_lease_seconds,
        margin_s=settings.progress_completion_margin_seconds,
        interval_s=settings.progress_flush_interval_seconds,
        concurrency=settings.progress_flush_concurrency,
        shutdown_timeout_s=settings.progress_shutdown_timeout_seconds,
        max_rows_per_second=settings.progress_flush_max_rows_per_second,
        statement_timeout_s=settings.database_statement_timeout_seconds,
        lock_timeout_s=settings.database_lock_timeout_seconds,
        value_ttl_s=settings.progress_position_ttl_seconds,
    )


def completion_route(settings: Settings, publisher: Publisher) -> Route:
    return Route(COMPLETIONS, publisher, settings.completion_task_name, settings.completion_task_queue)


def email_route(settings: Settings, publisher: Publisher) -> Route:
    """`publisher` sends the email outbox where EMAIL_PUBLISHER says: Celery, or the trial-email stream."""
    return Route(EMAILS, publisher, settings.email_task_name, settings.email_task_queue)


def relay_routes(settings: Settings, redis: RedisClient, publisher: Publisher) -> list[Route]:
    return [
        completion_route(settings, publisher),
        email_route(settings, email_relay_publisher(settings, redis, publisher)),
    ]


def build_relay(settings: Settings, pool: asyncpg.Pool, routes: list[Route]) -> Relay:
    listen_dsn = settings.relay_listen_database_url or settings.database_url
    return Relay(
        pool=pool,
        routes=routes,
        batch_size=settings.relay_batch_size,
        lease_s=settings.relay_lease_seconds,
        publish_timeout_s=settings.celery_publish_timeout_seconds,
        poll_s=settings.relay_poll_interval_seconds,
        max_backoff_s=settings.relay_max_backoff_seconds,
        listen_dsn=listen_dsn if settings.relay_listen else "",
        connect_timeout_s=settings.database_connect_timeout_seconds,
        max_attempts=settings.outbox_max_attempts,
        retry_backoff_s=settings.outbox_retry_backoff_seconds,
    )


def batch_options(settings: Settings) -> BatchOptions:
    """What a trial-journey batch (and so the sweep) needs to know."""
    return BatchOptions(
        send_email=settings.send_email,
        batch_size=settings.journey_batch_size,
        block_size=settings.reservation_block_size,
        lease_s=settings.relay_lease_seconds,
        publish_timeout_s=settings.celery_publish_timeout_seconds,
    )


def periodic_sweep(
    settings: Settings, pool: asyncpg.Pool, queue: EmailQueue, stop: asyncio.Event
) -> Coroutine[Any, Any, None]:
    return run_periodic_sweep(
        pool=pool,
        queue=queue,
        options=batch_options(settings),
        interval_s=settings.trial_journey_interval_seconds,
        stop=stop,
    )


@asynccontextmanager
async def lifespan(api: FastAPI) -> AsyncIterator[None]:
    settings: Settings = api.state.settings
    ingest: ProgressIngest = api.state.ingest
    reads: ProgressReads = api.state.reads
    sync: ProgressSync = api.state.sync
    async with AsyncExitStack() as resources:  # closed in reverse order of opening
        redis = connect_redis(settings)
        resources.push_async_callback(redis.aclose)
        try:
            for script in (WRITE_SCRIPT, WRITE_MANY_SCRIPT):
                await redis.script_load(script)
        except REDIS_FAILED as exc:
            # not fatal: readiness reports it, and the writer loads the scripts once Redis is back
            log.warning("Redis not reachable at start-up (%s); /health/ready will say so", exc)
        api.state.redis = redis
        api.state.db_pool = pool = None
        # readiness probes left waiting on a hung store (service/api/health.py): cancelled before the pools close
        api.state.readiness_checks = checks = dict[str, asyncio.Task[object]]()
        resources.push_async_callback(_cancel_all, checks)
        background = BackgroundTasks()
        api.state.background = background
        if settings.database_url:
            pool = await create_db_pool(settings)
            resources.push_async_callback(pool.close)
            api.state.db_pool = pool
            if settings.progress_flusher_enabled:
                flusher = build_flusher(settings, redis, pool)
                background.start("progress-flusher", flusher.run(background.stop))
            publisher: CeleryPublisher | None = None
            if settings.celery_broker_url:
                publisher = publisher_from_settings(settings)
                # off the loop: closing waits for a publish in flight
                resources.push_async_callback(asyncio.to_thread, publisher.close)
            if settings.trial_journey_interval_seconds > 0:
                queue = build_email_queue(settings, redis, publisher)
                background.start("trial-journey-sweep", periodic_sweep(settings, pool, queue, background.stop))
            if settings.relay_enabled and publisher is not None:
                relay = build_relay(settings, pool, relay_routes(settings, redis, publisher))
                background.start("outbox-relay", relay.run(background.stop))
                # runs once the loops have stopped (callbacks run in reverse): the final flush's
                # completions go out now instead of waiting for another pod's relay
                final_pass_s = publish_budget_s(settings.celery_publish_timeout_seconds)
                resources.push_async_callback(relay.final_pass, final_pass_s)
        # the final flush must see every write acknowledged before shutdown: stop the loops after the writes
        resources.push_async_callback(background.aclose, settings.progress_shutdown_timeout_seconds + 5)
        direct = None
        if pool is not None:
            direct = DirectWriter(
                pool,
                margin_s=settings.progress_completion_margin_seconds,
                max_concurrency=settings.degraded_max_concurrency,
                max_waiting=settings.degraded_max_waiting,
            )
        writer = PositionWriter(
            redis,
            layout=build_key_layout(settings),
            wait_replicas=settings.redis_wait_replicas,
            wait_timeout_ms=settings.redis_wait_timeout_ms,
        )
        sink = HeartbeatSink(
            writer,
            direct,
            redis_retry_s=settings.degraded_redis_retry_seconds,
            direct_timeout_s=settings.degraded_write_timeout_seconds,
        )
        resources.push_async_callback(sink.aclose)
        # the door and Redis memory (hostile clients): the first catalog snapshot is loaded before serving
        catalog = None
        if settings.content_catalog_enabled and pool is not None:
            catalog = ContentCatalog(
                pool,
                lookup_timeout_s=settings.content_catalog_lookup_timeout_seconds,
                answer_ttl_s=settings.content_catalog_cache_seconds,
                max_answers=CATALOG_MAX_ANSWERS,
                max_lookups=CATALOG_MAX_LOOKUPS,
            )
            await catalog.try_refresh()
            resources.push_async_callback(catalog.aclose)
            background.start(
                "content-catalog", catalog.run_refresh(background.stop, settings.content_catalog_refresh_seconds)
            )
            ingest.catalog = catalog
        if ingest.deferred is not None:  # the rate limit's refused positions, written about twice a second
            background.start("deferred-heartbeats", ingest.deferred.run(sink, background.stop, catalog=catalog))
            # the last ones, before the catalog and the sink close
            resources.push_async_callback(ingest.deferred.drain, sink, catalog)
        background.start("redis-memory", run_redis_memory_sampler(redis, background.stop))
        # what a Redis restart would lose: its first reading is the start's log line
        background.start(
            "redis-persistence",
            run_redis_persistence_sampler(
                redis, background.stop, flush_interval_s=settings.progress_flush_interval_seconds
            ),
        )
        ingest.sink = sink
        if pool is not None:
            reader = ProgressReader(
                redis,
                pool,
                margin_s=settings.progress_completion_margin_seconds,
                batches_in_flight=settings.progress_read_batches_in_flight,
                layout=writer.layout,
            )
            resources.push_async_callback(reader.aclose)
            reads.reader = reader
            # its own writer: a sync's pipeline is its own, not shared with the heartbeats of the turn
            sync.offline = OfflineSync(
                PositionWriter(
                    redis,
                    layout=writer.layout,
                    wait_replicas=settings.redis_wait_replicas,
                    wait_timeout_ms=settings.redis_wait_timeout_ms,
                ),
                pool,
                max_skew_s=settings.sync_max_clock_skew_seconds,
                max_backdate_s=settings.sync_max_backdate_hours * 3600,
                max_concurrency=settings.sync_max_concurrency,
            )
        # Everything alive now lives as long as the process: moved out of the collector's sight,
        # a full collection under load scans ~1 k objects instead of ~80 k (a 37 ms pause at p99.9).
        gc.collect()
        gc.freeze()
        log.info("progress-service started", extra={"pod": settings.pod_name})
        try:
            yield
        finally:
            ingest.sink = None
            reads.reader = sync.offline = None
            ingest.catalog = None
            log.info("progress-service stopping", extra={"pod": settings.pod_name})


def create_app(settings: Settings | None = None) -> Routes:
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
    api.add_middleware(RequestIdMiddleware)  # the FastAPI routes only: the heartbeat path stays lean
    api.openapi = openapi_document  # type: ignore[method-assign]
    limiter = None
    if settings.rate_limit_per_user_per_second > 0:
        limiter = RateLimiter(per_second=settings.rate_limit_per_user_per_second, burst=settings.rate_limit_burst)
    authenticator = Authenticator(settings)
    # the reads and the sync have a bucket of their own, at the same rate: a screen that reads through
    # this service (the monolith, with the user's token) never takes the user's heartbeats away
    reads_limiter = items_limiter = None
    if limiter is not None:
        reads_limiter = RateLimiter(per_second=settings.rate_limit_per_user_per_second, burst=settings.rate_limit_burst)
        items_limiter = RateLimiter(per_second=settings.sync_items_per_user_per_second, burst=settings.sync_items_burst)
    sync = ProgressSync(
        authenticator=authenticator,
        max_body_bytes=settings.sync_max_body_bytes,
        body_read_timeout_s=settings.body_read_timeout_seconds,
        limiter=reads_limiter,
        items_limiter=items_limiter,
    )
    reads = ProgressReads(authenticator=authenticator, limiter=reads_limiter)
    ingest = ProgressIngest(
        authenticator=authenticator,
        max_body_bytes=settings.max_body_bytes,
        body_read_timeout_s=settings.body_read_timeout_seconds,
        limiter=limiter,
        deferred=DeferredHeartbeats() if limiter is not None else None,
    )
    api.state.settings = settings
    api.state.ingest = ingest
    api.state.reads = reads
    api.state.sync = sync
    return Routes(api, route_table(ingest=ingest, sync=sync, api=api), reads)


def app_from_environment() -> Routes:
    """The factory `serve` gives uvicorn: each worker process reads the environment and logs as JSON."""
    settings = load_settings()
    configure_logging(settings.log_level)
    return create_app(settings)


async def _cancel_all(tasks: dict[str, "asyncio.Task[object]"]) -> None:
    for task in tasks.values():
        task.cancel()
    await asyncio.gather(*tasks.values(), return_exceptions=True)
