"""`progress-service trial-emails run-once`: one sweep, progress on stderr, the summed result on stdout."""

import argparse
import asyncio
import json
import sys

import asyncpg
from redis.exceptions import RedisError

from service.clients import connect_redis, create_db_pool
from service.config import ConfigError, Settings, load_settings
from service.logs import configure_logging
from service.trial_emails.batch import BatchResult
from service.trial_emails.queue import RedisStreamQueue
from service.trial_emails.sweep import sweep_journeys


def add_commands(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    trial_emails = subparsers.add_parser("trial-emails", help="trial-journey emails (reserve once, enqueue)")
    actions = trial_emails.add_subparsers(dest="trial_emails_action", required=True)
    run_once = actions.add_parser(
        "run-once",
        help="enqueue the due emails of every trial in its journey, once; print the result as JSON",
    )
    run_once.set_defaults(run=run_once_command)


def run_once_command(args: argparse.Namespace) -> int:
    settings = load_settings()
    configure_logging(settings.log_level)
    if not settings.database_url:
        raise ConfigError("DATABASE_URL is required (the primary: reservations never go to a replica)")
    try:
        result = asyncio.run(run_once(settings))
    except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError, RedisError) as exc:
        print(f"trial-emails run-once failed: {exc!r}", file=sys.stderr)
        return 1
    print(json.dumps(result), flush=True)
    return 0


async def run_once(settings: Settings) -> BatchResult:
    pool = await create_db_pool(settings)
    redis = connect_redis(settings)
    try:
        return await sweep_journeys(
            pool=pool, queue=RedisStreamQueue(redis, settings.email_queue_stream), settings=settings,
            on_batch=_show_progress,
        )  # fmt: skip
    finally:
        await redis.aclose()
        await pool.close()


def _show_progress(done: int, in_journey: int, batch: BatchResult) -> None:
    print(f"[trial-emails] {done}/{in_journey} trials, batch of {batch['user_trials']}: {batch['sent']} enqueued",
          file=sys.stderr, flush=True)  # fmt: skip
