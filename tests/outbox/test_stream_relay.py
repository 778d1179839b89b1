"""EMAIL_PUBLISHER=redis-stream: what a batch could not publish reaches the stream through the relay."""

import asyncio
from collections.abc import Sequence
from datetime import UTC, datetime

import asyncpg
import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from service import metrics
from service.compose import email_route
from service.config import Settings
from service.outbox.messages import Message, PublishResult
from service.outbox.relay import Relay
from service.trial_emails.batch import reserve_and_enqueue
from service.trial_emails.queue import QueuedEmail, RedisStreamQueue, StreamPublisher
from tests.helpers import enqueued, seed, stream_entries


class DownQueue:
    async def publish(self, email: QueuedEmail) -> None:
        raise RedisConnectionError(f"stream down, {email.user_id}:{email.email_key} not published")


async def test_the_relay_puts_what_the_batch_left_on_the_stream_once(
    settings: Settings, redis: Redis, db: asyncpg.Pool
) -> None:
    await seed(db, users=3, contents=1)
    pairs = [(1, "trial_welcome"), (2, "trial_welcome"), (3, "trial_tips")]
    with pytest.raises(RedisConnectionError):
        await reserve_and_enqueue(pairs, pool=db, queue=DownQueue(), block_size=200, lease_s=0.2)
    await asyncio.sleep(0.3)  # the batch's lease on its winners runs out

    queue = RedisStreamQueue(redis, settings.email_queue_stream)
    relay = Relay.from_settings(settings, db, [email_route(settings, StreamPublisher(queue))])
    first, second = await relay.relay_once(), await relay.relay_once()

    assert (first.published["email"], second.published["email"]) == (3, 0)
    assert await enqueued(redis, queue.stream) == dict.fromkeys(pairs, 1)
    sent_at = await db.fetchval("SELECT sent_at FROM emails_emaildispatch WHERE user_id = 1")
    entry = (await stream_entries(redis, queue.stream))[0]
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
    with pytest.raises(RedisConnectionError):
        await reserve_and_enqueue(pairs, pool=db, queue=DownQueue(), block_size=200, lease_s=0.2)
    await asyncio.sleep(0.3)
    errors_before = metrics.OUTBOX_RELAY_ERRORS._value.get()
    queue = RedisStreamQueue(redis, settings.email_queue_stream)
    publisher = FailingOnce(StreamPublisher(queue))
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
    loop = asyncio.create_task(Relay.from_settings(fast, db, [email_route(fast, publisher)]).run(stop))
    deadline = asyncio.get_running_loop().time() + 10
    while asyncio.get_running_loop().time() < deadline and len(await enqueued(redis, queue.stream)) < 2:
        await asyncio.sleep(0.1)
    stop.set()
    await loop  # ended by `stop`, not by the error
    assert await enqueued(redis, queue.stream) == dict.fromkeys(pairs, 1)
    assert await db.fetchval("SELECT count(*) FROM trial_email_outbox WHERE published_at IS NULL") == 0
    assert metrics.OUTBOX_RELAY_ERRORS._value.get() == errors_before + 1


class SlowQueue:
    """The real stream queue behind a broker that takes 0.3 s a message (a throttled SQS, say)."""

    def __init__(self, inner: RedisStreamQueue) -> None:
        self.inner = inner

    async def publish(self, email: QueuedEmail) -> None:
        await asyncio.sleep(0.3)
        await self.inner.publish(email)


@pytest.mark.slow
async def test_a_slow_broker_leaves_the_rest_to_the_relay_before_the_lease_ends_and_nothing_goes_twice(
    settings: Settings, redis: Redis, db: asyncpg.Pool
) -> None:
    await seed(db, users=6, contents=1)
    pairs = [(user_id, "trial_welcome") for user_id in range(1, 7)]
    queue = RedisStreamQueue(redis, settings.email_queue_stream)
    # a 1.5 s lease, 0.3 s a message: the batch stops after about 0.75 s (half the lease), not at 1.8 s
    sent = await reserve_and_enqueue(
        pairs, pool=db, queue=SlowQueue(queue), block_size=200, lease_s=1.5, publish_timeout_s=3.0
    )
    assert 1 <= sent < len(pairs)
    await asyncio.sleep(1.6)  # the lease on what the batch left runs out
    relay = Relay.from_settings(settings, db, [email_route(settings, StreamPublisher(queue))])
    assert (await relay.relay_once()).published["email"] == len(pairs) - sent
    assert await enqueued(redis, queue.stream) == dict.fromkeys(pairs, 1)
    assert await db.fetchval("SELECT count(*) FROM trial_email_outbox WHERE published_at IS NULL") == 0
