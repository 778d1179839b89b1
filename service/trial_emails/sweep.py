"""Every trial still in its journey, page by page: once from the command line, or periodically in `serve`."""

import asyncio
import contextlib
import logging
from collections.abc import Callable
from datetime import UTC, datetime

import asyncpg

from service import metrics
from service.loops import every
from service.progress.flush.budget import FlushBudget
from service.stores import POSTGRES_FAILED
from service.trial_emails.batch import BatchOptions, BatchResult, send_trial_journey_emails_batch
from service.trial_emails.journey import GRACE

log = logging.getLogger(__name__)

# pg advisory lock key of the periodic sweep; 7431001 guards the migrations (service.dev.database)
SWEEP_LOCK_KEY = 7431004

# Same window as journey.resolve_pending_emails: started, and less than GRACE past ends_at.
COUNT_IN_JOURNEY_SQL = """
SELECT count(*) FROM trials_usertrial WHERE started_at <= $1 AND ends_at > $1 - $2::interval
"""
# Keyset paging by id: a page costs the same however deep the sweep is.
PAGE_IN_JOURNEY_SQL = """
SELECT id FROM trials_usertrial
 WHERE id > $1 AND started_at <= $2 AND ends_at > $2 - $3::interval
 ORDER BY id
 LIMIT $4
"""

OnBatch = Callable[[int, int, BatchResult], None]  # (trials done so far, trials in journey, batch result)


async def sweep_journeys(
    *,
    pool: asyncpg.Pool,
    options: BatchOptions,
    now: datetime | None = None,
    on_batch: OnBatch = lambda done, in_journey, result: None,
    should_stop: Callable[[], bool] = lambda: False,
    budget: FlushBudget | None = None,
) -> BatchResult:
    """Run send_trial_journey_emails_batch over every trial in its journey; return the summed result.

    Correctness does not need a lock: two sweeps at once still enqueue each email once. `should_stop`
    is checked between batches, so a shutdown finishes the batch in hand and no more. `budget`: the
    write budget every reservation block is taken from (None: unbudgeted).
    """
    if not options.send_email:
        return {"status": "disabled", "user_trials": 0, "sent": 0}
    total: BatchResult = {"status": "ok", "user_trials": 0, "sent": 0}
    now = now or datetime.now(UTC)
    in_journey = await pool.fetchval(COUNT_IN_JOURNEY_SQL, now, GRACE)
    after_id = 0
    while not should_stop():
        rows = await pool.fetch(PAGE_IN_JOURNEY_SQL, after_id, now, GRACE, options.batch_size)
        if not rows:
            break
        ids = [row["id"] for row in rows]
        result = await send_trial_journey_emails_batch(ids, pool=pool, options=options, now=now, budget=budget)
        total["user_trials"] += result["user_trials"]
        total["sent"] += result["sent"]
        on_batch(total["user_trials"], in_journey, result)
        after_id = ids[-1]
    return total


async def run_periodic_sweep(
    *, pool: asyncpg.Pool, options: BatchOptions, interval_s: float, stop: asyncio.Event, budget: FlushBudget
) -> None:
    """Sweep at start, then every `interval_s` (TRIAL_JOURNEY_INTERVAL_SECONDS), until `stop` (0 disables it).

    A failed sweep is logged and counted, and the next one runs on schedule: the reservations make
    a retry safe, and a database outage must not end the loop.
    """
    if interval_s <= 0:
        log.info("trial-journey sweep disabled (TRIAL_JOURNEY_INTERVAL_SECONDS=0)")
        return

    async def sweep() -> bool:
        # The lock only saves duplicated work. It is a session lock, so its connection must be a real session
        # to the primary (not PgBouncer in transaction mode). If the unlock never happens (a cancellation, a
        # lost connection), the pool's reset on release or the server's end of the session releases it. The
        # lock holds one connection of `pool` for the sweep, which needs another.
        try:
            async with pool.acquire() as lock_conn:
                if not await lock_conn.fetchval("SELECT pg_try_advisory_lock($1)", SWEEP_LOCK_KEY):
                    metrics.TRIAL_JOURNEY_SWEEPS.labels("locked").inc()
                    log.info("trial-journey sweep skipped: another pod holds the lock")
                    return True
                try:
                    result = await sweep_journeys(pool=pool, options=options, should_stop=stop.is_set, budget=budget)
                finally:
                    # on a broken connection the server has dropped the lock with the session already; an
                    # error here would only hide the one that got us here
                    with contextlib.suppress(*POSTGRES_FAILED):
                        await lock_conn.execute("SELECT pg_advisory_unlock($1)", SWEEP_LOCK_KEY)
        except POSTGRES_FAILED as exc:
            metrics.TRIAL_JOURNEY_SWEEPS.labels("failed").inc()
            log.exception("trial-journey sweep failed; next in %.0f s", interval_s, extra={"error": repr(exc)})
            return False
        metrics.TRIAL_JOURNEY_SWEEPS.labels("done").inc()
        log.info(
            "trial-journey sweep done: %d trials, %d emails reserved for the relay",
            result["user_trials"],
            result["sent"],
            extra={"count": result["sent"]},
        )
        return True

    await every(
        interval_s,
        stop,
        sweep,
        name="trial-journey sweep",
        errors=metrics.TRIAL_JOURNEY_SWEEPS.labels("failed"),
        logger=log,
    )
