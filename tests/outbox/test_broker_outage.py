"""The broker stopped while completions and emails keep coming, until the relay has met it down and retried
after its backoff (RETRIES_SEEN passes refused): all delivered, none twice."""

from datetime import UTC, datetime, timedelta

import asyncpg
import pytest
from redis.asyncio import Redis

from service.config import Settings
from service.progress.flush.flusher import Flusher
from service.trial_emails.batch import BatchOptions, send_trial_journey_emails_batch
from tests.helpers import add_trials, metric, post_near_end, running_app, seed, wait_for
from tests.monolith.fixtures import Broker, Executions

pytestmark = pytest.mark.slow  # a broker outage of a few relay passes, a real Celery worker

# relay passes that met the broker down: the first, then two retries after the backoff (0.5 s, then 1 s at most,
# the test's relay settings). What the outage shows does not depend on its length in seconds (it was 10 s): that
# the relay met the broker down, backed off and tried again while the rows waited.
RETRIES_SEEN = 3


def _broker_unavailable() -> float:
    return sum(metric("progress_outbox_broker_unavailable_total", outbox=name) for name in ("completion", "email"))


async def test_a_broker_outage_delays_delivery_and_loses_or_repeats_nothing(
    relay_settings: Settings, broker: Broker, redis: Redis, db: asyncpg.Pool, executions: Executions
) -> None:
    await seed(db, users=10, contents=4, duration_s=600)
    now = datetime.now(UTC)
    await add_trials(db, 30, started_at=now - timedelta(hours=1), ends_at=now + timedelta(days=7), first_user=1001)
    trial_ids = [row["id"] for row in await db.fetch("SELECT id FROM trials_usertrial ORDER BY id")]
    flusher = Flusher(relay_settings.flush, redis, db)
    options = BatchOptions(relay_settings.send_email)
    async with running_app(relay_settings) as (_, client):
        await post_near_end(client, relay_settings, users=5, lessons=2)
        await flusher.flush_cycle()
        await executions.wait_for(10, settle_s=0)

        unavailable_before = _broker_unavailable()
        broker.stop()
        try:
            await post_near_end(client, relay_settings, users=10, lessons=4)  # 30 new completions
            await flusher.flush_cycle()
            during = await send_trial_journey_emails_batch(trial_ids[:20], pool=db, options=options)
            assert during["sent"] == 20  # reserved with their outbox rows: the broker is the relay's concern
            assert (await client.get("/health/ready")).status_code == 200  # heartbeats are still safe

            async def retried() -> bool:
                return _broker_unavailable() - unavailable_before >= RETRIES_SEEN

            await wait_for(retried, timeout_s=30)
            owed = await db.fetchval("SELECT count(*) FROM progress_completion_event WHERE published_at IS NULL")
            assert owed == 30  # waiting, not dropped
            assert await db.fetchval("SELECT count(*) FROM trial_email_outbox WHERE published_at IS NULL") == 20
        finally:
            broker.start()

        more = await send_trial_journey_emails_batch(trial_ids[20:], pool=db, options=options)
        assert more["sent"] == 10
        await executions.wait_for(10 + 30 + 20 + 10, timeout_s=60, settle_s=1.0)

    counts = await executions.by_task_id()
    assert len(counts) == 70 and set(counts.values()) == {1}
    assert await db.fetchval("SELECT count(*) FROM progress_completion_event WHERE published_at IS NULL") == 0
    assert await db.fetchval("SELECT count(*) FROM trial_email_outbox WHERE published_at IS NULL") == 0
