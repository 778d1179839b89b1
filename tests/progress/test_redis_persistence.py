"""What a Redis restart would lose, as the service reads it from the real Valkey: at start, in `status`, as a metric.

The session's Valkey runs with AOF (appendfsync everysec) and no RDB schedule; a test that changes that with CONFIG
SET puts it back.
"""

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from redis.asyncio import Redis, RedisCluster

from service.config import Settings
from service.dev import embedded
from service.progress.flush.redis_persistence import read_persistence, run_redis_persistence_sampler, weakest
from tests.helpers import Servers, metric, run_status, running_app, wait_for

LOGGER = "service.progress.flush.redis_persistence"


@asynccontextmanager
async def configured(redis: Redis | RedisCluster, **config: str) -> AsyncIterator[None]:
    """CONFIG SET for the block, then the values from before."""
    before = {name: (await redis.config_get(name))[name] for name in config}
    try:
        for name, value in config.items():
            await redis.config_set(name, value)
        yield
    finally:
        for name, value in before.items():
            await redis.config_set(name, value)


@pytest.fixture
def config_disabled(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[embedded.EmbeddedRedis]:
    """A Valkey whose CONFIG command is renamed away, as managed Redis (ElastiCache) refuses it."""
    server = embedded.EmbeddedRedis(tmp_path / "valkey", None)
    server.extra_args = ("--rename-command", "CONFIG", "", "--appendonly", request.param)
    server.start()
    try:
        yield server
    finally:
        server.stop()


async def test_with_aof_everysec_a_restart_loses_about_a_second(redis: Redis) -> None:
    (node, persistence), = (await read_persistence(redis)).items()  # fmt: skip
    assert (node, persistence.mode, persistence.source, persistence.appendfsync) == ("", "aof", "config", "everysec")
    assert "about the last second" in persistence.restart_loses(60)


async def test_rdb_only_and_none_are_told_apart_and_none_says_everything_not_flushed(redis: Redis) -> None:
    async with configured(redis, appendonly="no", save="3600 1 300 100"):
        (before,) = (await read_persistence(redis)).values()
        await redis.set("progress:test", "1")
        (persistence,) = (await read_persistence(redis)).values()
        assert (persistence.mode, persistence.save) == ("rdb", "3600 1 300 100")
        # counted since the server's last save, whatever the tests before wrote: this write is one more
        assert before.changes_since_save is not None and persistence.changes_since_save == before.changes_since_save + 1
        assert persistence.restart_loses(60).startswith("every heartbeat written since the last RDB save")
        async with configured(redis, save=""):
            (persistence,) = (await read_persistence(redis)).values()
            assert (persistence.mode, persistence.source) == ("none", "config")
            assert "up to one flush interval (60 s), the final positions of sessions" in persistence.restart_loses(60)


@pytest.mark.parametrize(("config_disabled", "mode"), [("yes", "aof"), ("no", "none")], indirect=["config_disabled"])
async def test_where_config_is_refused_info_persistence_tells(
    config_disabled: embedded.EmbeddedRedis, mode: str
) -> None:
    client = Redis.from_url(config_disabled.url)
    try:
        (persistence,) = (await read_persistence(client)).values()
    finally:
        await client.aclose()
    assert (persistence.mode, persistence.source, persistence.appendfsync) == (mode, "info", None)


async def test_the_start_logs_it_and_the_gauge_follows_a_change(
    settings: Settings, redis: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger=LOGGER):
        async with running_app(settings):
            await wait_for(lambda: _logged(caplog, "Redis persistence: aof"))
        assert metric("progress_redis_persistence", mode="aof") == 1
        assert "would lose about the last second" in _lines(caplog)[0]

        stop = asyncio.Event()
        sampler = asyncio.create_task(run_redis_persistence_sampler(redis, stop, flush_interval_s=60, interval_s=0.05))
        try:
            async with configured(redis, appendonly="no", save=""):
                await wait_for(lambda: _gauge_is("none"))
                await wait_for(lambda: _logged(caplog, "Redis persistence: none"))
            await wait_for(lambda: _gauge_is("aof"))
        finally:
            stop.set()
            await sampler
    warning = next(record for record in caplog.records if "persistence: none" in record.getMessage())
    assert warning.levelno == logging.WARNING and "every position not yet flushed" in warning.getMessage()
    assert metric("progress_redis_persistence", mode="none") == 0


async def test_status_says_what_a_restart_would_lose(servers: Servers, redis: Redis) -> None:
    run = await run_status(servers)
    persistence = run.report["redis"]["persistence"]
    assert (run.code, persistence["mode"], persistence["appendfsync"]) == (0, "aof", "everysec")
    assert "about the last second" in persistence["restart_loses"]
    async with configured(redis, appendonly="no", save=""):
        run = await run_status(servers, PROGRESS_FLUSH_INTERVAL_SECONDS="30")
    assert run.report["redis"]["persistence"]["mode"] == "none"
    assert "up to one flush interval (30 s)" in run.report["redis"]["persistence"]["restart_loses"]


@pytest.mark.slow  # the session's Valkey Cluster
async def test_on_a_cluster_the_weakest_master_is_the_one_reported(
    servers: Servers, cluster_redis: RedisCluster, cluster_settings: Settings
) -> None:
    await cluster_redis.initialize()
    master = cluster_redis.get_primaries()[1]
    await cluster_redis.config_set("appendonly", "no", target_nodes=master)
    try:
        by_node = await read_persistence(cluster_redis)
        assert weakest(by_node)[0] == master.name
        assert {name: p.mode for name, p in by_node.items() if name != master.name} == {
            node.name: "aof" for node in cluster_redis.get_primaries() if node is not master
        }
        run = await run_status(servers, REDIS_URL=cluster_settings.redis_url, REDIS_CLUSTER="true")
    finally:
        await cluster_redis.config_set("appendonly", "yes", target_nodes=master)
    persistence = run.report["redis"]["persistence"]
    assert (persistence["mode"], persistence["node"]) == ("none", master.name)
    assert run.report["redis"]["nodes"][master.name]["persistence"] == "none"


async def _logged(caplog: pytest.LogCaptureFixture, text: str) -> bool:
    return any(text in line for line in _lines(caplog))


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == LOGGER]


async def _gauge_is(mode: str) -> bool:
    return metric("progress_redis_persistence", mode=mode) == 1
