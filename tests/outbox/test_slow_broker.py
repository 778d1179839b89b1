"""A slow broker: the publish times out mid-batch, and what the broker took is marked, not sent again; a publish that
takes its whole deadline ends within its batch's lease, so a second relay never sends the batch too."""

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import replace
from urllib.parse import urlsplit

import asyncpg
import pytest
from redis.asyncio import Redis

from service.compose import completion_route
from service.config import Settings
from service.outbox.celery_publisher import CeleryPublisher
from service.outbox.messages import Message, PublishResult
from service.outbox.relay import Relay
from tests.helpers import add_events
from tests.monolith.fixtures import Broker, Executions

pytestmark = pytest.mark.slow  # a broker a second slow per reply, a real Celery worker

WARM_UP_QUEUE = "relay-warm-up"  # nobody consumes it


class SlowProxy:
    """A TCP proxy in front of the broker that holds each of the broker's replies for `delay_s`."""

    def __init__(self, port: int) -> None:
        self._port = port
        self.delay_s = 0.0
        self._writers: set[asyncio.StreamWriter] = set()

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        broker_reader, broker_writer = await asyncio.open_connection("127.0.0.1", self._port)
        self._writers |= {client_writer, broker_writer}

        async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, slow: bool) -> None:
            with contextlib.suppress(ConnectionError):
                while data := await reader.read(65536):
                    if slow:
                        await asyncio.sleep(self.delay_s)
                    writer.write(data)
                    await writer.drain()
            writer.close()

        await asyncio.gather(
            pipe(client_reader, broker_writer, slow=False), pipe(broker_reader, client_writer, slow=True)
        )

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[int]:
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        try:
            yield server.sockets[0].getsockname()[1]
        finally:
            server.close()
            for writer in self._writers:
                writer.close()
            await server.wait_closed()


@pytest.mark.regression
async def test_a_publish_timing_out_mid_batch_marks_what_the_broker_took_and_sends_nothing_twice(
    relay_settings: Settings, broker: Broker, db: asyncpg.Pool, executions: Executions
) -> None:
    """Found by an attack: a publish past CELERY_PUBLISH_TIMEOUT_SECONDS was left to its thread and its whole batch
    to the lease, so the messages the thread had sent went out again once the lease ran out, no crash involved."""
    await add_events(db, 6)
    # a lease far longer than the publish: it is run past below by moving it, not by sleeping
    settings = relay_settings.model_copy(update={"celery_publish_timeout_seconds": 1.0, "relay_lease_seconds": 30.0})
    proxy = SlowProxy(urlsplit(broker.url).port or 6379)
    async with proxy.running() as port:
        slow = CeleryPublisher(replace(settings.relay, broker_url=f"redis://127.0.0.1:{port}/0"))
        try:
            # connected while the broker is fast; then each reply takes 1.2 s, and one send (two replies) outlasts
            # the timeout by more than a second
            warm_up = await slow.publish([Message(0, settings.completion_task_name, WARM_UP_QUEUE, "warm-up", {})])
            assert warm_up.sent == [0]
            proxy.delay_s = 1.2
            result = await Relay(settings.relay, db, [completion_route(settings, slow)]).relay_once()
        finally:
            await asyncio.to_thread(slow.close)  # waits for the publishing thread: whatever it sent is in the broker

    assert result.broker_unavailable is not None
    taken = result.published["completion"]
    marked = await db.fetchval("SELECT count(*) FROM progress_completion_event WHERE published_at IS NOT NULL")
    assert marked == taken

    # the broker fast again, and every lease of that pass run out
    await db.execute("UPDATE progress_completion_event SET claimed_until = now() - interval '1 second'")
    fast = CeleryPublisher(settings.relay)
    try:
        again = await Relay(settings.relay, db, [completion_route(settings, fast)]).relay_once()
    finally:
        await asyncio.to_thread(fast.close)

    assert again.broker_unavailable is None
    await executions.wait_for(6, settle_s=1.0)
    counts = await executions.by_task_id()
    assert len(counts) == 6 and set(counts.values()) == {1}, counts
    # the send in hand at the timeout was waited for: the broker took it, and it was marked
    assert 1 <= taken < 6
    assert again.published["completion"] == 6 - taken and again.republished["completion"] == 0
    assert await db.fetchval("SELECT count(*) FROM progress_completion_event WHERE published_at IS NULL") == 0
    admin = Redis.from_url(broker.url)
    await admin.delete(WARM_UP_QUEUE)
    await admin.aclose()


class LeaseEatingBroker:
    """Takes every message; the i-th publish lasts `took_s[i]` by the database's clock (time moved, not waited: every
    lease on the outbox ends that much sooner). `during_last` runs before the last publish returns (another relay)."""

    def __init__(self, db: asyncpg.Pool, took_s: list[float], during_last: Callable[[], Awaitable[object]]) -> None:
        self._db, self._took_s, self._during_last = db, took_s, during_last
        self.task_ids: list[str] = []

    async def publish(self, messages: Sequence[Message]) -> PublishResult:
        if self._took_s:
            await asyncio.sleep(0.2)  # whatever the relay does while the broker takes a batch, it has done
            await self._db.execute(
                "UPDATE progress_completion_event SET claimed_until = claimed_until - make_interval(secs => $1)",
                self._took_s.pop(0),
            )
            if not self._took_s:
                await self._during_last()
        self.task_ids += [message.task_id for message in messages]
        return PublishResult(sent=[message.row_id for message in messages])


@pytest.mark.regression
async def test_a_publish_that_takes_its_deadline_ends_within_its_batch_lease_and_a_second_relay_sends_nothing_twice(
    relay_settings: Settings, db: asyncpg.Pool
) -> None:
    """Found by an attack: the relay claimed its next batch while the broker took one, and published it while at least
    half its lease was left; a slow broker (a publish within CELERY_PUBLISH_TIMEOUT_SECONDS, plus the message in hand)
    ran it past the lease, and a second relay claimed and sent the same 500 messages."""
    await add_events(db, 1000)  # two full batches
    # the defaults: a 60 s lease, a 10 s deadline
    settings = relay_settings.model_copy(update={"celery_publish_timeout_seconds": 10.0, "relay_lease_seconds": 60.0})
    other = LeaseEatingBroker(db, [], lambda: asyncio.sleep(0))
    other_relay = Relay(settings.relay, db, [completion_route(settings, other)])
    # the first batch takes 47 s, the second its 10 s and 4 s for the message in hand (a socket timeout is 5 s);
    # then the other relay makes a pass
    slow = LeaseEatingBroker(db, [47.0, 14.0], other_relay.relay_once)
    result = await Relay(settings.relay, db, [completion_route(settings, slow)]).relay_once()

    assert result.published == {"completion": 1000}
    assert other.task_ids == []  # it found every row marked or leased
    assert len(slow.task_ids) == len(set(slow.task_ids)) == 1000
    assert await db.fetchval("SELECT count(*) FROM progress_completion_event WHERE published_at IS NULL") == 0
