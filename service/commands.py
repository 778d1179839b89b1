"""The commands that run without HTTP: `flush`, `relay`, `trial-emails run-once` and `outbox list|redrive`:
one skeleton for all of them (`_run_command`), then each command's body."""

import argparse
import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from functools import partial

import asyncpg

from service import tracing
from service.compose import relay_routes, start_publisher
from service.config import ConfigError, Settings, load_settings
from service.console import Progress
from service.lifecycle import Lifecycle
from service.logs import configure_logging
from service.loops import run_until_stopped
from service.outbox.admin import count_parked, list_parked, redrive_parked
from service.outbox.celery_publisher import CeleryPublisher
from service.outbox.outboxes import OUTBOXES, Outbox
from service.outbox.relay import Relay, counts_text
from service.postgres import create_db_pool
from service.progress.flush.backlog import measure_backlog
from service.progress.flush.budget import FlushBudget
from service.progress.flush.flusher import Flusher
from service.progress.keys import KeyLayout
from service.redis_client import RedisClient, connect_redis
from service.stores import POSTGRES_FAILED, REDIS_FAILED
from service.trial_emails.batch import BatchOptions, BatchResult
from service.trial_emails.sweep import sweep_journeys


@dataclass(frozen=True, slots=True)
class _Parts:
    """What a long-running command is given: its settings, its stores, and the event SIGTERM sets."""

    settings: Settings
    redis: RedisClient
    pool: asyncpg.Pool
    publisher: CeleryPublisher | None
    stop: asyncio.Event


def _run_command(name: str, body: Callable[[_Parts], Awaitable[int]], *, publishes: bool = False) -> int:
    """Settings, JSON logs, the stores (DATABASE_URL is the primary: a sweep's reservations never go to a replica),
    the body's code as the exit code; SIGTERM or Ctrl-C sets `stop` and the body finishes what it has in hand. A store
    that cannot be reached is one line on stderr and exit 1, not a traceback: what it could not do waits in the store.
    """
    settings = load_settings()
    configure_logging(settings.log_level)
    if not settings.database_url:
        raise ConfigError(f"{name} needs DATABASE_URL (postgresql://...)")
    if publishes and not settings.celery_broker_url:
        raise ConfigError(f"{name} needs CELERY_BROKER_URL (the monolith's broker: sqs://, redis:// or amqp://)")

    async def main(stop: asyncio.Event) -> int:
        lifecycle = Lifecycle()
        try:
            if tracing.configure():  # stopped last: the spans of the last batch are exported too
                lifecycle.started_part("tracing", tracing.aclose)
            publisher = start_publisher(settings, lifecycle) if publishes else None
            pool = await create_db_pool(settings.database)
            lifecycle.started_part("postgres", pool.close)
            redis = connect_redis(settings.redis)
            lifecycle.started_part("redis", redis.aclose)
            return await body(_Parts(settings, redis, pool, publisher, stop))
        finally:
            await lifecycle.aclose()

    try:
        return run_until_stopped(main)
    except (*POSTGRES_FAILED, *REDIS_FAILED) as exc:
        print(f"progress-service {name} failed: a store is unavailable: {exc!r}", file=sys.stderr)
        return 1


def flush_command(args: argparse.Namespace) -> int:
    return _run_command("flush --once" if args.once else "flush", partial(_run_flusher, once=args.once))


async def _run_flusher(parts: _Parts, *, once: bool) -> int:
    flusher = Flusher(parts.settings.flush, parts.redis, parts.pool)
    if once:
        # what is pending now: heartbeats that arrive during the drain are flushed too, past the total
        backlog = await measure_backlog(parts.redis, KeyLayout.from_settings(parts.settings.redis))
        with Progress("flush --once", total=backlog.pending, unit="entries") as progress:
            result = await flusher.flush_cycle(stop=parts.stop, on_batch=progress.advance)
        print(json.dumps(asdict(result)), flush=True)
        return 1 if result.failed_batches else 0
    say(f"flushing every {parts.settings.progress_flush_interval_seconds:g}s; SIGTERM or Ctrl-C stops")
    await flusher.run(parts.stop)
    return 0


def relay_command(args: argparse.Namespace) -> int:
    return _run_command("relay --once" if args.once else "relay", partial(_run_relay, once=args.once), publishes=True)


async def _run_relay(parts: _Parts, *, once: bool) -> int:
    assert parts.publisher is not None
    relay = Relay(parts.settings.relay, parts.pool, relay_routes(parts.settings, parts.redis, parts.publisher))
    if once:
        result = await relay.relay_once(stop=parts.stop)
        print(json.dumps(asdict(result)), flush=True)
        return 1 if result.broker_unavailable else 0
    say("relaying the outboxes; SIGTERM or Ctrl-C stops")
    await relay.run(parts.stop)
    return 0


def trial_emails_command(args: argparse.Namespace) -> int:
    """One sweep; it publishes nothing: each block's statement writes its outbox rows and wakes the relays. SIGTERM
    or Ctrl-C finishes the batch in hand, prints the partial result with "status": "stopped" and exits 0."""
    return _run_command("trial-emails run-once", _sweep_once)


async def _sweep_once(parts: _Parts) -> int:
    with Progress("trial-emails run-once", unit="trials") as progress:

        def show(done: int, in_journey: int, batch: BatchResult) -> None:
            progress.set_total(in_journey)  # counted by the sweep before its first batch
            progress.advance(batch["user_trials"])

        result = await sweep_journeys(
            pool=parts.pool,
            options=BatchOptions(parts.settings.send_email),
            on_batch=show,
            should_stop=parts.stop.is_set,
            # its reservations are rows of the monolith's table: the fleet's budget, as `flush --once` takes it
            budget=FlushBudget.from_settings(parts.settings.flush, parts.redis),
        )
    if parts.stop.is_set():
        result["status"] = "stopped"
    print(json.dumps(result), flush=True)
    return 0


def outbox_command(args: argparse.Namespace) -> int:
    """`outbox list` and `outbox redrive`: parked rows seen and made owed again, in short statements."""
    body = _list_parked if args.outbox_action == "list" else _redrive_parked
    return _run_command(f"outbox {args.outbox_action}", partial(body, args=args))


def _chosen_outboxes(args: argparse.Namespace) -> list[Outbox]:
    return [OUTBOXES[args.outbox]] if args.outbox else list(OUTBOXES.values())


async def _list_parked(parts: _Parts, *, args: argparse.Namespace) -> int:
    rows = await list_parked(parts.pool, _chosen_outboxes(args), limit=args.limit, ids=args.ids)
    if args.json:
        print(json.dumps([row.as_json() for row in rows]), flush=True)
        return 0
    if not rows:
        say("no parked outbox rows")
        return 0
    print(f"{'outbox':<10}  {'id':>12}  {'attempts':>8}  {'failed_at':<32}  error")
    for row in rows:
        # the broker's words as they came, its control bytes shown escaped rather than sent to the terminal
        error = "".join(c if c.isprintable() else repr(c)[1:-1] for c in row.error or "")
        print(f"{row.outbox:<10}  {row.id:>12}  {row.attempts:>8}  {row.failed_at.isoformat():<32}  {error}")
    return 0


async def _redrive_parked(parts: _Parts, *, args: argparse.Namespace) -> int:
    outboxes = _chosen_outboxes(args)
    owed = {outbox.name: await count_parked(parts.pool, outbox, args.ids) for outbox in outboxes}
    if args.dry_run:
        print(f"would re-drive {sum(owed.values())} parked rows ({counts_text(owed)})", flush=True)
        return 0
    done: dict[str, int] = {}
    with Progress("outbox redrive", total=sum(owed.values()), unit="rows") as progress:
        for outbox in outboxes:
            done[outbox.name] = await redrive_parked(
                parts.pool, outbox, ids=args.ids, on_chunk=progress.advance, should_stop=parts.stop.is_set
            )
    stopped = " (stopped: run it again for the rest)" if parts.stop.is_set() else ""
    print(f"re-drove {sum(done.values())} parked rows ({counts_text(done)}){stopped}", flush=True)
    return 0


def say(message: str) -> None:
    """A line for whoever runs the command, on stderr: stdout keeps its result."""
    print(f"[progress-service] {message}", file=sys.stderr, flush=True)
