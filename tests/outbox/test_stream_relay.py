"""EMAIL_PUBLISHER=redis-stream: the relay, the only publisher, puts what the batches reserved on the stream."""

import asyncio
import logging
from collections.abc import Sequence
from datetime import UTC, datetime

import asyncpg
import pytest
from redis.asyncio import Redis

from service import metrics
from service.compose import email_route
from service.config import Settings
from service.outbox.messages import Message, PublishResult
from service.outbox.relay import Relay
from service.outbox.stream_publisher import StreamPublisher
from service.trial_emails.batch import reserve_in_blocks
from service.trial_emails.reservations import Pair
from tests.helpers import enqueued, seed, stream_entries


async def reserve(db: asyncpg.Pool, pairs: list[Pair]) -> None:
    async with db.acquire() as conn:
        assert await reserve_in_blocks(conn, pairs, block_size=200) == len(pairs)


async def test_the_relay_puts_what_the_batch_reserved_on_the_stream_once(
    settings: Settings, redis: Redis, db: asyncpg.Pool
) -> None:
    await seed(db, users=3, contents=1)
    pairs = [(1, "trial_welcome"), (2, "trial_welcome"), (3, "trial_tips")]
    await reserve(db, pairs)

    publisher = StreamPublisher(redis, settings.email_queue_stream)
    relay = Relay(settings.relay, db, [email_route(settings, publisher)])
    first, second = await relay.relay_once(), await relay.relay_once()

    assert (first.published["email"], second.published["email"]) == (3, 0)
    assert await enqueued(redis, publisher.stream) == dict.fromkeys(pairs, 1)
    sent_at = await db.fetchval("SELECT sent_at FROM emails_emaildispatch WHERE user_id = 1")
    entry = (await stream_entries(redis, publisher.stream))[0]
    assert entry["reserved_at"] == sent_at.isoformat() and entry["source"] == "trial_journey"
    assert sent_at <= datetime.now(UTC)


class FailingOnce:
    """The real stream publisher behind a first call that fails in a way nobody foresaw."""

    def __init__(self, inner: StreamPublisher) -> None:
        self.inner = inner
        self.calls = 0

    async def publish(self, messages: Sequence[Message]) -> PublishResult:
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("a publisher bug")
        return await self.inner.publish(messages)


async def test_the_relay_loop_survives_an_unexpected_publisher_error(
    settings: Settings, redis: Redis, db: asyncpg.Pool
) -> None:
    await seed(db, users=3, contents=1)
    pairs = [(1, "trial_welcome"), (2, "trial_welcome")]
    await reserve(db, pairs)
    errors_before = metrics.OUTBOX_RELAY_ERRORS._value.get()
    stream = settings.email_queue_stream
    publisher = FailingOnce(StreamPublisher(redis, stream))
    fast = settings.model_copy(
        update={
            "relay_lease_seconds": 0.5,
            "relay_poll_interval_seconds": 0.1,
            "relay_max_backoff_seconds": 0.2,
            "celery_publish_timeout_seconds": 0.2,
            "relay_listen": False,
        }
    )
    stop = asyncio.Event()
    loop = asyncio.create_task(Relay(fast.relay, db, [email_route(fast, publisher)]).run(stop))
    deadline = asyncio.get_running_loop().time() + 10
    while asyncio.get_running_loop().time() < deadline and len(await enqueued(redis, stream)) < 2:
        await asyncio.sleep(0.1)
    stop.set()
    await loop  # ended by `stop`, not by the error
    assert await enqueued(redis, stream) == dict.fromkeys(pairs, 1)
    assert await db.fetchval("SELECT count(*) FROM trial_email_outbox WHERE published_at IS NULL") == 0
    assert metrics.OUTBOX_RELAY_ERRORS._value.get() == errors_before + 1


async def test_a_republish_after_a_lost_mark_adds_no_second_entry_to_the_stream(
    settings: Settings, redis: Redis, db: asyncpg.Pool
) -> None:
    await seed(db, users=2, contents=1)
    pairs = [(1, "trial_welcome"), (2, "trial_tips")]
    await reserve(db, pairs)
    publisher = StreamPublisher(redis, settings.email_queue_stream)
    relay = Relay(settings.relay, db, [email_route(settings, publisher)])
    assert (await relay.relay_once()).published["email"] == 2
    # as if the relay had died between the publish and the mark: its lease ran out, the rows are owed again
    await db.execute("UPDATE trial_email_outbox SET published_at = NULL, claimed_until = NULL")

    again = await relay.relay_once()

    assert again.published["email"] == 2 and again.republished["email"] == 2
    assert await enqueued(redis, publisher.stream) == dict.fromkeys(pairs, 1)  # the guard names each dispatch row


class BrokerDown:
    async def publish(self, messages: Sequence[Message]) -> PublishResult:
        return PublishResult(unavailable="connection refused")


async def test_the_final_pass_with_the_broker_down_says_the_rows_wait_for_another_pod_not_a_retry(
    settings: Settings, db: asyncpg.Pool, caplog: pytest.LogCaptureFixture
) -> None:
    await seed(db, users=1, contents=1)
    await reserve(db, [(1, "trial_welcome")])

    with caplog.at_level(logging.WARNING, logger="service.outbox.relay"):
        await Relay(settings.relay, db, [email_route(settings, BrokerDown())]).final_pass(5)

    [line] = [r.getMessage() for r in caplog.records if r.name == "service.outbox.relay"]
    assert "final pass on shutdown: the rows wait in the outbox for another pod" in line and "retrying" not in line
    assert await db.fetchval("SELECT count(*) FROM trial_email_outbox WHERE published_at IS NULL") == 1
