"""`progress-service trial-emails run-once`: one sweep, progress on stderr, the summed result on stdout.

SIGTERM (or Ctrl-C) stops it cleanly: the batch in hand finishes (its blocks are reserved and their
outbox rows written in one statement each, so whatever it could not publish is the relay's), no
new batch starts, the partial result is printed with "status": "stopped", and the exit code is 0.
"""

import argparse
import asyncio
import json
import sys

from service.clients import connect_redis, create_db_pool
from service.config import ConfigError, Settings, load_settings
from service.logs import configure_logging
from service.outbox.celery_publisher import CeleryPublisher, publisher_from_settings
from service.signals import stop_on_signals
from service.stores import POSTGRES_FAILED, REDIS_FAILED
from service.trial_emails.batch import BatchResult
from service.trial_emails.queue import build_email_queue
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
    if settings.email_publisher == "celery" and settings.send_email:
        settings.check_celery_broker()
    try:
        result = asyncio.run(run_once(settings))
    except (*POSTGRES_FAILED, *REDIS_FAILED) as exc:
        print(f"trial-emails run-once failed: {exc!r}", file=sys.stderr)
        return 1
    print(json.dumps(result), flush=True)
    return 0


async def run_once(settings: Settings) -> BatchResult:
    stop = stop_on_signals()
    publisher: CeleryPublisher | None = None
    if settings.email_publisher == "celery" and settings.send_email:
        publisher = publisher_from_settings(settings)
    pool = await create_db_pool(settings)
    redis = connect_redis(settings)
    try:
        result = await sweep_journeys(
            pool=pool, queue=build_email_queue(settings, redis, publisher), settings=settings,
            on_batch=_show_progress, should_stop=stop.is_set,
        )  # fmt: skip
        if stop.is_set():
            result["status"] = "stopped"
        return result
    finally:
        await redis.aclose()
        await pool.close()
        if publisher is not None:
            await asyncio.to_thread(publisher.close)


def _show_progress(done: int, in_journey: int, batch: BatchResult) -> None:
    print(f"[trial-emails] {done}/{in_journey} trials, batch of {batch['user_trials']}: {batch['sent']} enqueued",
          file=sys.stderr, flush=True)  # fmt: skip
