"""A refusal is not final at once: a busy broker is waited out, a refused message retried with backoff, then parked."""

import asyncio
import time

import asyncpg
import pytest
from redis.asyncio import Redis

from service.compose import completion_route
from service.config import Settings
from service.outbox.celery_publisher import CeleryPublisher, _broker_reply
from service.outbox.relay import Relay
from service.progress.flush.flusher import Flusher
from tests.helpers import add_events, limited_broker_user, metric, post_near_end, running_app, seed
from tests.monolith.fixtures import Broker, BusyBroker, Executions

BUSY_S = 3.5


def redis_reply(reply: str, *, in_pipeline: bool) -> BaseException:
    """An error reply as redis-py raises it, wrapped as kombu wraps it in a publish."""
    from kombu.exceptions import OperationalError
    from redis._parsers.base import BaseParser

    error = BaseParser.parse_error(reply)
    if in_pipeline:  # how redis-py annotates an error of a pipeline's command
        error.args = (f"Command # 1 (LLEN onion-progress) of pipeline caused error: {error.args[0]}",)
    wrapped = OperationalError(str(error))
    wrapped.__cause__ = error
    return wrapped


@pytest.mark.parametrize("in_pipeline", [False, True])
@pytest.mark.parametrize(
    ("reply", "answer"),
    [
        ("BUSY Valkey is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE.", "temporary"),
        ("LOADING Valkey is loading the dataset in memory", "temporary"),
        ("OOM command not allowed when used memory > 'maxmemory'.", "temporary"),
        ("READONLY You can't write against a read only replica.", "temporary"),
        ("MISCONF Errors writing to the AOF file", "temporary"),
        ("MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.", "temporary"),
        ("TRYAGAIN Multiple keys request during rehashing of slot", "temporary"),
        ("CLUSTERDOWN The cluster is down", "temporary"),
        ("NOPERM No permissions to access a key", "refused"),
        ("WRONGTYPE Operation against a key holding the wrong kind of value", "refused"),
        ("ERR Protocol error: invalid bulk length", "refused"),
    ],
)
def test_temporary_broker_replies_are_an_outage_and_the_others_a_refusal(
    reply: str, answer: str, in_pipeline: bool
) -> None:
    assert _broker_reply(redis_reply(reply, in_pipeline=in_pipeline)) == answer


@pytest.mark.parametrize(
    ("code", "answer"),
    [
        ("ThrottlingException", "temporary"),
        ("RequestThrottled", "temporary"),
        ("AccessDenied", "refused"),
        ("InvalidMessageContents", "refused"),
    ],
)
def test_sqs_throttling_is_an_outage_and_a_denial_a_refusal(code: str, answer: str) -> None:
    from botocore.exceptions import ClientError

    error = ClientError({"Error": {"Code": code, "Message": "..."}}, "SendMessage")
    assert _broker_reply(error) == answer


def test_a_lost_connection_is_no_broker_reply() -> None:
    from kombu.exceptions import OperationalError
    from redis.exceptions import ConnectionError as RedisConnectionError

    lost = OperationalError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")
    lost.__cause__ = RedisConnectionError("Connection refused")
    assert _broker_reply(lost) is None


@pytest.mark.slow  # a real broker made busy, a real Celery worker
async def test_completions_published_while_the_broker_answers_busy_are_delivered_once_and_none_is_parked(
    relay_settings: Settings, broker: Broker, redis: Redis, db: asyncpg.Pool, executions: Executions
) -> None:
    await seed(db, users=20, contents=1, duration_s=600)
    async with running_app(relay_settings) as (_, client):
        with BusyBroker(broker) as busy:
            busy_since = time.monotonic()
            await post_near_end(client, relay_settings, users=20, lessons=1)
            result = await Flusher(relay_settings.flush, redis, db).flush_cycle()
            assert result.failed_batches == 0
            assert await db.fetchval("SELECT count(*) FROM progress_completion_event") == 20
            # the relay, woken by the flush, meets BUSY for the rest of the hiccup
            await asyncio.sleep(max(0.0, BUSY_S - (time.monotonic() - busy_since)))
            assert busy.busy()
            assert await executions.count() == 0
        rows = await executions.wait_for(20, timeout_s=30, settle_s=1.0)

    assert len(rows) == 20
    assert set((await executions.by_task_id()).values()) == {1}
    parked = await db.fetchval("SELECT count(*) FROM progress_completion_event WHERE publish_failed_at IS NOT NULL")
    assert parked == 0
    assert await db.fetchval("SELECT count(*) FROM progress_completion_event WHERE published_at IS NULL") == 0


@pytest.mark.slow  # a real broker
async def test_a_refused_message_is_retried_with_a_doubling_backoff_and_parked_only_after_its_max_attempts(
    relay_settings: Settings, broker: Broker, db: asyncpg.Pool
) -> None:
    await add_events(db, 3)
    refused = relay_settings.model_copy(
        update={
            "celery_broker_url": await limited_broker_user(broker),
            "completion_task_queue": "forbidden",
            "outbox_max_attempts": 3,
        }
    )
    publisher = CeleryPublisher(refused.relay)
    relay = Relay(refused.relay, db, [completion_route(refused, publisher)], retry_backoff_s=0.5)
    retried_before = metric("progress_outbox_retried_total", outbox="completion")
    parked_before = metric("progress_outbox_failed_total", outbox="completion")

    async def rows() -> list[asyncpg.Record]:
        return await db.fetch(
            "SELECT publish_attempts, publish_failed_at, publish_error, published_at,"
            "       extract(epoch FROM claimed_until - now())::float8 AS backoff_s "
            "  FROM progress_completion_event ORDER BY id"
        )

    async def backoff_over() -> None:
        """Time moved, not waited: every backoff (a lease set into the future) ended a moment ago."""
        await db.execute(
            "UPDATE progress_completion_event SET claimed_until = now() - interval '1 ms' WHERE claimed_until > now()"
        )

    try:
        first = await relay.relay_once()
        assert (first.retried, first.parked) == ({"completion": 3}, {"completion": 0})
        after_first = await rows()
        assert [row["publish_attempts"] for row in after_first] == [1, 1, 1]
        assert all(row["publish_failed_at"] is None for row in after_first)
        assert all("permission" in row["publish_error"].lower() for row in after_first)  # NOPERM, kept
        assert all(0.3 < row["backoff_s"] <= 0.5 for row in after_first)  # the first backoff

        waiting = await relay.relay_once()  # within the backoff: nothing is claimed
        assert (waiting.retried, waiting.parked) == ({"completion": 0}, {"completion": 0})

        await backoff_over()
        second = await relay.relay_once()
        assert (second.retried, second.parked) == ({"completion": 3}, {"completion": 0})
        after_second = await rows()
        assert [row["publish_attempts"] for row in after_second] == [2, 2, 2]
        assert all(0.8 < row["backoff_s"] <= 1.0 for row in after_second)  # doubled

        await backoff_over()
        third = await relay.relay_once()
        assert (third.retried, third.parked) == ({"completion": 0}, {"completion": 3})
        parked = await rows()
        assert all(row["publish_failed_at"] is not None and row["backoff_s"] is None for row in parked)
        assert all(row["published_at"] is None and row["publish_attempts"] == 3 for row in parked)

        await backoff_over()
        after = await relay.relay_once()  # parked rows are never claimed again, however long after
        assert (after.retried, after.parked, after.published) == ({"completion": 0},) * 3
    finally:
        await asyncio.to_thread(publisher.close)

    assert metric("progress_outbox_retried_total", outbox="completion") - retried_before == 6
    assert metric("progress_outbox_failed_total", outbox="completion") - parked_before == 3
    assert metric("progress_outbox_parked_messages", outbox="completion") == 3
    assert metric("progress_outbox_owed_messages", outbox="completion") == 0
