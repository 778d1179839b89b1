"""A real Valkey Cluster (3 masters, 3 replicas), started once per session for the tests that ask for it,
and a standalone Valkey of a test's own to stop and start."""

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from redis.asyncio import RedisCluster

from service.config import Settings
from service.dev import embedded
from service.dev.embedded import EmbeddedCluster
from service.progress.ingest.buffer import WRITE_SCRIPT
from service.progress.keys import KeyLayout


@pytest.fixture(scope="session")
def valkey_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedCluster]:
    cluster = EmbeddedCluster(Path(tmp_path_factory.mktemp("cluster")), masters=3, node_timeout_ms=1000)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def cluster_settings(settings: Settings, valkey_cluster: EmbeddedCluster) -> Settings:
    return settings.model_copy(update={"redis_url": valkey_cluster.url, "redis_cluster": True})


@pytest.fixture
def cluster_layout(cluster_settings: Settings) -> KeyLayout:
    return KeyLayout.from_settings(cluster_settings.redis)


@pytest.fixture
async def cluster_redis(valkey_cluster: EmbeddedCluster) -> AsyncIterator[RedisCluster]:
    """A client of the cluster whose masters are empty and have the write script loaded."""
    valkey_cluster.wait_until_healthy(timeout_s=30)  # a test before may have failed a master over
    client = RedisCluster.from_url(valkey_cluster.url, decode_responses=True)
    await client.flushall(target_nodes=RedisCluster.PRIMARIES)
    await client.script_load(WRITE_SCRIPT)
    try:
        yield client
    finally:
        await client.aclose()


@pytest.fixture
async def own_redis(tmp_path: Path) -> AsyncIterator[embedded.EmbeddedRedis]:
    """A Redis of this test's own, to stop and start without disturbing the session's."""
    server = embedded.EmbeddedRedis(tmp_path / "valkey", None)
    server.start()
    try:
        yield server
    finally:
        server.stop()
