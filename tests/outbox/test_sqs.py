"""Production's transport: kombu's SQS, against a local SQS-compatible server, with a real worker consuming."""

import json
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest
from moto.server import ThreadedMotoServer
from redis.asyncio import Redis

from service.config import Settings
from service.dev.embedded import free_port
from service.progress.flush.flusher import Flusher
from tests.helpers import post_near_end, running_app, seed, with_broker
from tests.monolith.fixtures import Executions, kwargs_of, start_worker, stop_worker, wait_worker_ready

pytestmark = pytest.mark.slow  # a local SQS server and a real Celery worker

# credentials in the URL (the server takes any); in production they come from the environment
# (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or the pod's role) with a bare sqs:// URL
TRANSPORT_OPTIONS = {"region": "us-east-1", "polling_interval": 0.2, "wait_time_seconds": 1}


@pytest.fixture(scope="module")
def sqs_url(monolith_table: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    url = f"sqs://test:test@127.0.0.1:{port}"
    log_path = Path(tmp_path_factory.mktemp("sqs-worker")) / "worker.log"
    worker = start_worker(
        url, monolith_table, log_path, transport_options=json.dumps(TRANSPORT_OPTIONS), name="monolith-sqs"
    )
    try:
        wait_worker_ready(worker, log_path)
        yield url
    finally:
        stop_worker(worker)
        server.stop()


async def test_200_completions_reach_the_worker_through_sqs_once_each(
    settings: Settings, sqs_url: str, redis: Redis, db: asyncpg.Pool, executions: Executions
) -> None:
    over_sqs = with_broker(
        settings,
        sqs_url,
        celery_broker_transport_options=TRANSPORT_OPTIONS,
        celery_publish_timeout_seconds=20.0,
        relay_lease_seconds=30.0,
    )
    await seed(db, users=20, contents=10, duration_s=600)
    async with running_app(over_sqs) as (_, client):
        await post_near_end(client, over_sqs)
        await Flusher(over_sqs.flush, redis, db).flush_cycle()
        rows = await executions.wait_for(200, timeout_s=90, settle_s=1.0)

    assert len(rows) == 200
    assert set((await executions.by_task_id()).values()) == {1}
    assert {(kwargs_of(row)["content_id"], kwargs_of(row)["user_id"]) for row in rows} == {
        (lesson, user) for lesson in range(1, 11) for user in range(1, 21)
    }
    assert await db.fetchval("SELECT count(*) FROM progress_completion_event WHERE published_at IS NULL") == 0
