"""Wiring the outbox relay to its publishers, and `progress-service relay` / `relay --once`.

It sits above service.outbox and service.trial_emails so that the outbox package never imports the
writers: the email outbox goes where EMAIL_PUBLISHER says (Celery, or the trial-email Redis stream).
"""

import argparse
import asyncio
import json
import sys
from dataclasses import asdict

from service.clients import RedisClient, connect_redis, create_db_pool
from service.config import ConfigError, Settings, load_settings
from service.logs import configure_logging
from service.outbox.celery_publisher import publisher_from_settings
from service.outbox.messages import Publisher
from service.outbox.outboxes import COMPLETIONS, EMAILS
from service.outbox.relay import Relay, Route
from service.signals import stop_on_signals
from service.trial_emails.queue import email_relay_publisher


def relay_routes(settings: Settings, redis: RedisClient, publisher: Publisher) -> list[Route]:
    return [Route(COMPLETIONS, publisher), Route(EMAILS, email_relay_publisher(settings, redis, publisher))]


def add_commands(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    relay = subparsers.add_parser("relay", help="publish the outboxes to the monolith's Celery broker")
    relay.add_argument("--once", action="store_true", help="publish everything owed now, print a summary, exit")
    relay.set_defaults(run=relay_command)


def relay_command(args: argparse.Namespace) -> int:
    settings = load_settings()
    configure_logging(settings.log_level)
    if not settings.database_url:
        raise ConfigError("relay needs DATABASE_URL (postgresql://...)")
    if not settings.celery_broker_url:
        raise ConfigError("relay needs CELERY_BROKER_URL (the monolith's broker: sqs://, redis:// or amqp://)")
    return asyncio.run(run_relay(settings, once=args.once))


async def run_relay(settings: Settings, *, once: bool) -> int:
    publisher = publisher_from_settings(settings)
    pool = await create_db_pool(settings)
    redis = connect_redis(settings)
    try:
        relay = Relay(pool=pool, routes=relay_routes(settings, redis, publisher), settings=settings)
        if once:
            result = await relay.relay_once()
            print(json.dumps(asdict(result)), flush=True)
            return 1 if result.broker_unavailable else 0
        stop = stop_on_signals()
        print("[progress-service] relaying the outboxes; SIGTERM or Ctrl-C stops", file=sys.stderr, flush=True)
        await relay.run(stop)
        return 0
    finally:
        await redis.aclose()
        await pool.close()
        await asyncio.to_thread(publisher.close)
