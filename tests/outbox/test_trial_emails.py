"""Trial emails reach the monolith's send_email task through a real worker: once each, whatever dies when.

The batches reserve and write outbox rows; the relay, woken by each reservation, is the only publisher.
"""

import asyncio
import json
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest

from service.compose import email_route
from service.config import Settings
from service.dev.embedded import free_port
from service.outbox.celery_publisher import CeleryPublisher
from service.outbox.outboxes import email_task_id
from service.outbox.relay import Relay
from service.trial_emails.batch import BatchOptions, send_trial_journey_emails_batch
from tests.helpers import (
    Servers,
    add_trials,
    limited_broker_user,
    relay_env,
    relay_once,
    relayed,
    running_app,
    start_service_command,
    wait_for,
)
from tests.monolith.fixtures import Broker, Executions, kwargs_of

pytestmark = pytest.mark.slow  # relay processes and a real Celery worker

NOW = datetime.now(UTC)
SEND_EMAIL = "apps.emails.tasks.send_email"


async def mixed_trials(db: asyncpg.Pool, now: datetime) -> int:
    """Trials at every stage of the journey, some with keys already dispatched; returns the emails owed."""
    day = timedelta(days=1)
    await add_trials(db, 7, started_at=now - timedelta(hours=1), ends_at=now + 20 * day)  # welcome: 7
    await add_trials(db, 5, started_at=now - 10 * day, ends_at=now + 10 * day, first_user=101)  # 3 each: 15
    await add_trials(db, 4, started_at=now - 10 * day, ends_at=now - timedelta(hours=2), first_user=201)  # 6: 24
    await add_trials(db, 2, started_at=now + day, ends_at=now + 8 * day, first_user=301)  # not started: 0
    await add_trials(db, 2, started_at=now - 20 * day, ends_at=now - 3 * day, first_user=401)  # over: 0
    # user 101 already had welcome and tips from an earlier run
    await db.execute(
        "INSERT INTO emails_emaildispatch (user_id, source, email_key, sent_at, created_at) "
        "VALUES (101, 'trial_journey', 'trial_welcome', $1, $1), (101, 'trial_journey', 'trial_tips', $1, $1)",
        now - day,
    )
    return 7 + 15 - 2 + 24


async def trial_ids(db: asyncpg.Pool) -> list[int]:
    return [row["id"] for row in await db.fetch("SELECT id FROM trials_usertrial ORDER BY id")]


async def assert_each_reservation_delivered_once(db: asyncpg.Pool, executions: Executions) -> int:
    dispatched = await db.fetch(
        "SELECT id, user_id, email_key FROM emails_emaildispatch WHERE created_at > now() - interval '1 hour'"
    )
    rows = await executions.wait_for(len(dispatched), timeout_s=90)
    by_id = {email_task_id(row["id"]): row for row in dispatched}
    counts = await executions.by_task_id(SEND_EMAIL)
    assert set(counts) == set(by_id) and set(counts.values()) == {1}
    for row in rows:
        kwargs = kwargs_of(row)
        dispatch = by_id[row["task_id"]]
        assert kwargs == {
            "dispatch_id": dispatch["id"],
            "user_id": dispatch["user_id"],
            "email_key": dispatch["email_key"],
            "source": "trial_journey",
        }
        assert row["queue"] == "emails"
    owed = await db.fetchval("SELECT count(*) FROM trial_email_outbox WHERE published_at IS NULL")
    assert owed == 0, f"{owed} reserved emails never published"
    return len(dispatched)


@asynccontextmanager
async def relay_running(settings: Settings, db: asyncpg.Pool) -> AsyncIterator[None]:
    """The relay of a pod, sending the email outbox to the worker; it polls once an hour, so it sends on NOTIFY."""
    woken_only = settings.model_copy(update={"relay_poll_interval_seconds": 3600})
    publisher = CeleryPublisher(woken_only.relay)
    stop = asyncio.Event()
    relay = asyncio.create_task(Relay(woken_only.relay, db, [email_route(woken_only, publisher)]).run(stop))
    try:
        yield
    finally:
        stop.set()
        await asyncio.wait_for(relay, timeout=30)
        await asyncio.to_thread(publisher.close)


async def test_the_mixed_trials_reach_the_worker_once_a_rerun_sends_none_and_send_email_false_nothing(
    relay_settings: Settings, db: asyncpg.Pool, executions: Executions
) -> None:
    owed = await mixed_trials(db, NOW)
    async with relay_running(relay_settings, db):
        disabled = relay_settings.model_copy(update={"send_email": False})
        off = await send_trial_journey_emails_batch(
            await trial_ids(db), pool=db, options=BatchOptions(disabled.send_email)
        )
        assert off["sent"] == 0 and await db.fetchval("SELECT count(*) FROM trial_email_outbox") == 0

        first = await send_trial_journey_emails_batch(
            await trial_ids(db), pool=db, options=BatchOptions(relay_settings.send_email)
        )
        rerun = await send_trial_journey_emails_batch(
            await trial_ids(db), pool=db, options=BatchOptions(relay_settings.send_email)
        )
        await relayed(db)

    assert (first["sent"], rerun["sent"]) == (owed, 0)
    assert await assert_each_reservation_delivered_once(db, executions) == owed
    # one publish each: nothing was sent twice
    assert await db.fetchval("SELECT max(publish_attempts) FROM trial_email_outbox") == 1


async def test_three_concurrent_runners_deliver_each_email_once(
    relay_settings: Settings, db: asyncpg.Pool, migrated: str, executions: Executions
) -> None:
    await add_trials(db, 60, started_at=NOW - timedelta(days=10), ends_at=NOW - timedelta(hours=1))
    small_blocks = BatchOptions(relay_settings.send_email, block_size=16)
    pools = [await asyncpg.create_pool(migrated, min_size=1, max_size=1) for _ in range(3)]
    try:
        async with relay_running(relay_settings, db):
            ids = await trial_ids(db)
            results = await asyncio.gather(
                *(send_trial_journey_emails_batch(ids, pool=pool, options=small_blocks) for pool in pools)
            )
            await relayed(db)
    finally:
        await asyncio.gather(*(pool.close() for pool in pools))

    assert sum(result["sent"] for result in results) == 360
    assert await assert_each_reservation_delivered_once(db, executions) == 360


async def run_once(servers: Servers, broker_url: str, *, die_at: str = "", **extra: str) -> asyncio.subprocess.Process:
    env = relay_env(servers, type("B", (), {"url": broker_url})(), **extra)  # type: ignore[arg-type]
    return await start_service_command("trial-emails", "run-once", env=env, die_at=die_at)


@pytest.mark.regression
async def test_killed_after_its_first_reservation_the_relay_publishes_it_at_once(
    servers: Servers, broker: Broker, db: asyncpg.Pool, executions: Executions
) -> None:
    # issue 29: the dead batch's winners were leased to it, and waited out that lease for the relay
    await add_trials(db, 50, started_at=NOW - timedelta(days=10), ends_at=NOW - timedelta(hours=1))
    process = await run_once(servers, broker.url, die_at="trial_emails.after_reserve")
    await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode == -9
    assert await db.fetchval("SELECT count(*) FROM trial_email_outbox WHERE published_at IS NULL") == 200
    assert await executions.count() == 0

    code, summary = await relay_once(servers, broker)  # no lease to wait out: the relay's from the start

    assert code == 0 and summary is not None and summary["published"]["email"] == 200
    assert await assert_each_reservation_delivered_once(db, executions) == 200


async def test_broker_down_every_reserved_email_waits_and_is_delivered_once_it_is_back(
    servers: Servers, broker: Broker, db: asyncpg.Pool, executions: Executions
) -> None:
    # the first review defect: each run reserved a block, published none, and those emails were lost
    await add_trials(db, 1000, started_at=NOW - timedelta(hours=1), ends_at=NOW + timedelta(days=7))
    down = f"redis://127.0.0.1:{free_port()}/0"
    process = await run_once(servers, down)  # it reserves only: the broker is the relay's
    stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode == 0, stderr.decode()[-2000:]
    assert json.loads(stdout.decode().splitlines()[-1])["sent"] == 1000
    code, summary = await relay_once(servers, broker, CELERY_BROKER_URL=down)
    assert code == 1 and summary is not None and summary["broker_unavailable"]
    assert summary["published"]["email"] == 0
    assert await db.fetchval("SELECT count(*) FROM trial_email_outbox WHERE published_at IS NULL") == 1000

    code, summary = await relay_once(servers, broker)

    assert code == 0 and summary is not None and summary["published"]["email"] == 1000
    assert await assert_each_reservation_delivered_once(db, executions) == 1000


async def test_sigterm_during_run_once_stops_cleanly_and_every_reserved_email_is_delivered(
    servers: Servers, broker: Broker, db: asyncpg.Pool, executions: Executions
) -> None:
    # the second review defect: SIGTERM mid-run left reservations never published and no trace
    await add_trials(db, 5000, started_at=NOW - timedelta(hours=1), ends_at=NOW + timedelta(days=7))
    process = await run_once(servers, broker.url)

    async def reserving() -> bool:  # mid-run: its first blocks are reserved (not a guess of the start-up time)
        return bool(await db.fetchval("SELECT count(*) FROM emails_emaildispatch"))

    await wait_for(reserving, timeout_s=30)
    process.send_signal(signal.SIGTERM)
    stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=60)

    assert process.returncode == 0, stderr.decode()[-2000:]
    result = json.loads(stdout.decode().splitlines()[-1])
    reserved = await db.fetchval("SELECT count(*) FROM emails_emaildispatch")
    assert result["status"] == "stopped" and 0 < reserved < 5000
    code, _ = await relay_once(servers, broker)
    assert code == 0
    assert await assert_each_reservation_delivered_once(db, executions) == reserved


async def test_an_email_the_broker_refuses_is_not_marked_published_and_the_relay_parks_it(
    relay_settings: Settings, servers: Servers, broker: Broker, db: asyncpg.Pool, executions: Executions
) -> None:
    await add_trials(db, 2, started_at=NOW - timedelta(hours=1), ends_at=NOW + timedelta(days=7))
    refused = relay_settings.model_copy(
        update={"celery_broker_url": await limited_broker_user(broker), "email_task_queue": "forbidden"}
    )
    result = await send_trial_journey_emails_batch(
        await trial_ids(db), pool=db, options=BatchOptions(refused.send_email)
    )
    assert result["sent"] == 2
    assert await db.fetchval("SELECT count(*) FROM trial_email_outbox WHERE published_at IS NULL") == 2

    code, summary = await relay_once(
        servers,
        broker,
        CELERY_BROKER_URL=refused.celery_broker_url,
        EMAIL_TASK_QUEUE="forbidden",
        OUTBOX_MAX_ATTEMPTS="1",
    )
    assert code == 0 and summary is not None and summary["parked"]["email"] == 2
    parked = await db.fetchval("SELECT count(*) FROM trial_email_outbox WHERE publish_failed_at IS NOT NULL")
    assert parked == 2 and await executions.count() == 0


async def test_the_serve_sweep_with_the_broker_down_loses_no_block(
    relay_settings: Settings, servers: Servers, broker: Broker, db: asyncpg.Pool, executions: Executions
) -> None:
    # the serve side of the first review defect: a sweep reserved a block, could publish none, lost it
    await add_trials(db, 30, started_at=NOW - timedelta(hours=1), ends_at=NOW + timedelta(days=7))
    down = relay_settings.model_copy(
        update={"celery_broker_url": f"redis://127.0.0.1:{free_port()}/0", "trial_journey_interval_seconds": 3600}
    )
    async with running_app(down):
        deadline = asyncio.get_running_loop().time() + 10
        while await db.fetchval("SELECT count(*) FROM trial_email_outbox") < 30:
            assert asyncio.get_running_loop().time() < deadline, "the sweep did not reserve at start"
            await asyncio.sleep(0.1)
    assert await executions.count() == 0

    code, summary = await relay_once(servers, broker)
    assert code == 0 and summary is not None and summary["published"]["email"] == 30
    assert await assert_each_reservation_delivered_once(db, executions) == 30
