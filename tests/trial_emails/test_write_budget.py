"""The trial-journey emails' reservations are rows of the monolith's table: they draw from the write budget.

Rows are counted from Postgres itself: a statement trigger of the test's own records, per statement on
emails_emaildispatch, the clock_timestamp() and the number of rows it inserted.
"""

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest

from service.trial_emails.batch import BatchOptions
from tests.helpers import InsertLog, Servers, add_trials, insert_log, reserved, service_env, start_service_command

pytestmark = [pytest.mark.regression, pytest.mark.slow]

BUDGET = 200  # rows per second
BLOCK = BatchOptions(send_email=True).block_size


@pytest.fixture
async def dispatch_log(trials_db: asyncpg.Pool) -> AsyncIterator[InsertLog]:
    async with insert_log(trials_db, "emails_emaildispatch") as log:
        yield log


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


# 1000 trials: 5 s at the budget; unbudgeted, their 5 blocks land within a second (1000 > BUDGET + BLOCK = 400)
@pytest.mark.parametrize(("redis_up", "trials"), [(True, 1000), (False, 1000)], ids=["fleet budget", "local share"])
async def test_run_once_reserves_within_the_write_budget(
    servers: Servers, dispatch_log: InsertLog, redis_up: bool, trials: int
) -> None:
    """Found by an attack: 3000 trials' emails reserved by `trial-emails run-once` with the budget at 100 rows/s
    went in within one second (9000 dispatch rows), outside the budget the flush and degraded mode keep to."""
    now = datetime.now(UTC)
    # a day into a 14-day trial: each owes its welcome email, one row
    await add_trials(dispatch_log.db, trials, started_at=now - timedelta(days=1), ends_at=now + timedelta(days=13))
    env = service_env(
        servers,
        PROGRESS_FLUSH_MAX_ROWS_PER_SECOND=str(BUDGET),
        PROGRESS_FLEET_MAX_PODS="1",  # with Redis down, the pod's local share is the whole budget
        EMAIL_PUBLISHER="redis-stream",
    )
    if not redis_up:
        env["REDIS_URL"] = f"redis://127.0.0.1:{_closed_port()}/0"

    process = await start_service_command("trial-emails", "run-once", env=env)
    stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=120)

    assert process.returncode == 0, stderr.decode()
    assert json.loads(stdout.decode().splitlines()[-1]) == {"status": "ok", "user_trials": trials, "sent": trials}
    peak = await dispatch_log.peak_per_second()
    assert peak <= BUDGET + BLOCK, peak  # the budget, plus one block landing in the same second
    # exactly once, and nothing reserved without its outbox row
    assert len(await reserved(dispatch_log.db)) == trials
    assert sum(rows for _, rows in await dispatch_log.entries()) == trials
    assert await dispatch_log.db.fetchval("SELECT count(*) FROM trial_email_outbox") == trials
