"""Real Redis (Valkey) and Postgres for the whole session: embedded servers unless URLs are given.

TEST_REDIS_URL / TEST_DATABASE_URL point the suite at servers you run yourself; otherwise it
starts its own in a temporary folder and stops them at the end. Every test starts from an empty
Redis database and empty tables.

The suite runs in worker processes (pytest-xdist, `-n` in pyproject.toml's addopts), each with servers of its own;
`-n 0` runs it in this process.
"""

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import asyncpg
import httpx
import pytest
from redis.asyncio import Redis

from service.api.routes import Routes
from service.auth import make_token
from service.config import Settings
from service.dev import database, embedded
from tests.helpers import TEST_JWT_SECRET, RunningApp, Servers, running_app

# the monolith stand-in (broker, real Celery worker), started only by the tests that ask for it
pytest_plugins = ["tests.monolith.fixtures"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """xdist's per-file and per-group modes key tests by node id, and schemathesis gives each fuzz case its
    function's: those modes would run one case of each and report the run green. Refuse them."""
    dist = getattr(config.option, "dist", "no")
    ids = [item.nodeid for item in items]
    if dist not in ("no", "load") and len(set(ids)) < len(ids):
        raise pytest.UsageError(f"--dist {dist} would skip the tests that share a node id (the fuzz cases): use load")


# every table the tests write; TRUNCATE ... CASCADE keeps the order irrelevant
_TABLES = (
    "users_user", "courses_lesson", "audios_audio", "audios_meditation", "lives_live",
    "engagements_lessonprogress", "audios_audioprogress", "audios_meditationprogress", "lives_liveprogress",
    "progress_completion_event", "trials_usertrial", "emails_emaildispatch", "trial_email_outbox",
)  # fmt: skip


@pytest.fixture(scope="session")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    base = Path(tmp_path_factory.mktemp("servers"))
    redis_server = pg = None
    redis_url = os.environ.get("TEST_REDIS_URL")
    database_url = os.environ.get("TEST_DATABASE_URL")
    if (redis_url or database_url) and os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") != "1":
        pytest.fail("TEST_REDIS_URL / TEST_DATABASE_URL would be shared by every worker, each emptying them: add -n 0")
    try:
        if not redis_url:
            redis_server = embedded.EmbeddedRedis(base / "valkey", None)
            redis_server.start()
            redis_url = redis_server.url.replace("/0", "/1")
        if not database_url:
            pg = database.EmbeddedPostgres(base / "postgres", None, durable=False)
            pg.start()
            pg.create_database("progress_test")
            database_url = pg.url("progress_test")
        yield Servers(redis_url, database_url, redis_server, pg)
    finally:
        if pg is not None:
            pg.stop()
        if redis_server is not None:
            redis_server.stop()


@pytest.fixture(scope="session")
async def migrated(servers: Servers) -> str:
    await database.prepare_database(servers.database_url, seed=False)
    return servers.database_url


@pytest.fixture
def settings(servers: Servers, migrated: str) -> Settings:
    return Settings(
        redis_url=servers.redis_url,
        database_url=migrated,
        jwt_secret=TEST_JWT_SECRET,
        progress_flush_interval_seconds=0.2,
        progress_flush_lease_seconds=5,
        # the API tests look at the pending sets; the flusher tests start their own flusher
        progress_flusher_enabled=False,
        trial_journey_interval_seconds=0,
        # the tests of the outbox (tests/outbox) bring a broker and a worker; the others do without
        relay_enabled=False,
        email_publisher="redis-stream",
        # the door's own tests (tests/api/test_door.py) turn it on; elsewhere ids need not exist
        content_catalog_enabled=False,
    )


@pytest.fixture
async def redis(servers: Servers) -> AsyncIterator[Redis]:
    client = Redis.from_url(servers.redis_url, decode_responses=True)
    await client.flushdb()
    try:
        yield client
    finally:
        await client.aclose()


@pytest.fixture
async def db(migrated: str) -> AsyncIterator[asyncpg.Pool]:
    pool = await asyncpg.create_pool(migrated, min_size=1, max_size=4)
    assert pool is not None
    await pool.execute(f"TRUNCATE {', '.join(_TABLES)} RESTART IDENTITY CASCADE")
    try:
        yield pool
    finally:
        await pool.close()


@pytest.fixture
def token(settings: Settings) -> str:
    return make_token(settings, 7)


@pytest.fixture
async def served(settings: Settings, redis: Redis) -> AsyncIterator[RunningApp]:
    """The app with its lifespan running, as uvicorn would run it, and a client of it."""
    async with running_app(settings) as served:
        yield served


@pytest.fixture
def app(served: RunningApp) -> Routes:
    return served.app


@pytest.fixture
def client(served: RunningApp) -> httpx.AsyncClient:
    return served.client
