"""`progress-service` / `python -m service`: serve, dev, and the one-off commands."""

import argparse
import asyncio
import json
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import asyncpg

from service import tracing
from service.compose import relay_routes, start_publisher
from service.config import ConfigError, Settings, load_settings
from service.console import Progress
from service.embedded import EmbeddedServerError
from service.lifecycle import Lifecycle
from service.logs import configure_logging
from service.loops import run_until_stopped
from service.outbox.celery_publisher import CeleryPublisher
from service.outbox.outboxes import Outbox
from service.outbox.relay import counts_text
from service.postgres import create_db_pool
from service.progress.backlog import measure_backlog
from service.redis_client import RedisClient, connect_redis
from service.stores import POSTGRES_FAILED, REDIS_FAILED
from service.trial_emails.batch import BatchResult
from service.trial_emails.sweep import sweep_journeys

DEV_JWT_SECRET = "dev-only-secret-not-for-production"


# after the drain, how long uvicorn waits for the requests in flight before cancelling them (each is bounded well
# below it: 10 s for a slow body, the stores' deadlines); deploy/k8s's grace period counts it
IN_FLIGHT_TIMEOUT_S = 30


def _uvicorn_options(host: str, port: int, settings: Settings) -> dict[str, Any]:
    from service.api.http_limits import LimitedHttpToolsProtocol

    return {
        "host": host,
        "port": port,
        "loop": "uvloop",
        "http": LimitedHttpToolsProtocol,  # httptools with a limit on the request head's size and time
        "lifespan": "on",
        "log_config": None,
        "access_log": False,
        "proxy_headers": True,
        "server_header": False,
        "timeout_keep_alive": settings.http_keep_alive_timeout_seconds,
        "timeout_graceful_shutdown": IN_FLIGHT_TIMEOUT_S,
    }


def _serve(args: argparse.Namespace) -> int:
    settings = load_settings()
    configure_logging(settings.log_level)
    settings.check_can_serve()  # in the parent too: a bad config fails once, with its message
    from service.serving import ServeConfig, run

    # uvicorn shuts down gracefully on SIGTERM, then re-raises it so the process dies "by signal".
    # A graceful stop is a success for the orchestrator: with this handler in place, exit 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    config = ServeConfig(
        "service.app:app_from_environment",
        factory=True,
        workers=args.workers,
        drain_s=settings.shutdown_drain_seconds,
        **_uvicorn_options(args.host, args.port, settings),
    )
    run(config)
    return 0


def _dev_banner(args: argparse.Namespace, settings: Settings, token: str) -> str:
    return (
        f"\nprogress-service dev is ready on http://{args.host}:{args.port}\n"
        f"REDIS_URL={settings.redis_url}\nDATABASE_URL={settings.database_url}\n"
        f"CELERY_BROKER_URL={settings.celery_broker_url}\n\n"
        "Try it (user 1, lesson 1):\n"
        f"  curl -i -X POST http://{args.host}:{args.port}/engagements/progress/lesson \\\n"
        f"    -H 'Authorization: Bearer {token}' \\\n"
        "    -H 'Content-Type: application/json' -d '{\"lesson_id\": 1, \"position\": 42.5}'\n\n"
        'Lesson 1 lasts 600 s: send "position": 595 and it completes. After the next flush '
        f"(every {settings.progress_flush_interval_seconds:g} s) its {settings.completion_task_name} task "
        "waits in the broker:\n"
        f"  python -c \"import redis; print(redis.Redis.from_url('{settings.celery_broker_url}')"
        f".lrange('{settings.completion_task_queue}', 0, -1))\"\n\n"
        "Ctrl-C stops the service and the embedded servers.\n"
    )


def _dev(args: argparse.Namespace) -> int:
    import uvicorn

    from service import embedded
    from service.app import create_app
    from service.auth import make_token

    data_dir = Path(os.environ.get("DEV_DATA_DIR", ".progress-service")).resolve()
    os.environ.setdefault("JWT_SECRET", DEV_JWT_SECRET)
    servers: list[embedded.EmbeddedRedis | embedded.EmbeddedPostgres] = []
    try:
        if "REDIS_URL" not in os.environ:
            redis_server = embedded.EmbeddedRedis(data_dir / "valkey", args.redis_port)
            _progress(f"starting embedded Valkey on 127.0.0.1:{redis_server.port} (data in {redis_server.data_dir})")
            redis_server.start()
            servers.append(redis_server)
            os.environ["REDIS_URL"] = redis_server.url
        if "DATABASE_URL" not in os.environ:
            pg = embedded.EmbeddedPostgres(data_dir / "postgres", args.postgres_port)
            _progress(f"starting embedded Postgres on 127.0.0.1:{pg.port} (data in {pg.data_dir})")
            pg.start()
            servers.append(pg)
            pg.create_database("progress")
            os.environ["DATABASE_URL"] = pg.url("progress")
        if "CELERY_BROKER_URL" not in os.environ:
            # the monolith's broker, played by the embedded Valkey in a database of its own
            os.environ["CELERY_BROKER_URL"] = urlsplit(os.environ["REDIS_URL"])._replace(path="/2").geturl()
        _progress("applying migrations_ref/*.sql and dev seed data")
        applied = asyncio.run(embedded.prepare_database(os.environ["DATABASE_URL"], seed=True))
        _progress(f"applied {', '.join(applied)}")
        settings = load_settings()
        configure_logging(settings.log_level)
        app = create_app(settings)
        token = make_token(settings, 1)
        http = uvicorn.Server(uvicorn.Config(app, **_uvicorn_options(args.host, args.port, settings)))
        # Ctrl-C is uvicorn's graceful stop from the banner on, also before uvicorn installs its own handler
        # (the lifespan then starts and stops at once, final flush included): a Ctrl-C in that gap used to
        # be swallowed, and dev served on. With Python's own handler it would be a KeyboardInterrupt in the
        # middle of the lifespan's shutdown, when uvicorn re-raises it after the stop; this one is a no-op then.
        signal.signal(signal.SIGINT, http.handle_exit)
        print(_dev_banner(args, settings, token), flush=True)
        http.run()
    finally:
        for server in reversed(servers):
            _progress(f"stopping embedded {server.name}")
            server.stop()
    return 0


@dataclass(frozen=True, slots=True)
class _Parts:
    """What a long-running command is given: its settings, its stores, and the event SIGTERM sets."""

    settings: Settings
    redis: RedisClient
    pool: asyncpg.Pool
    publisher: CeleryPublisher | None
    stop: asyncio.Event


def _run_command(name: str, check: Callable[[Settings], bool], body: Callable[[_Parts], Awaitable[int]]) -> int:
    """The skeleton of flush, relay, trial-emails run-once and outbox: settings, JSON logs, the stores, the exit code.

    `check` raises ConfigError for what the command cannot run without, and says whether it publishes
    with Celery. The stores are opened in order (publisher, Postgres, Redis) and closed in reverse;
    SIGTERM or Ctrl-C sets `stop`, the body finishes what it has in hand and its code is the exit code.
    A store that cannot be reached is one line on stderr and exit 1 (whatever it could not do waits in
    the store for the next run: nothing is lost), not a traceback.
    """
    settings = load_settings()
    configure_logging(settings.log_level)
    with_publisher = check(settings)

    async def main(stop: asyncio.Event) -> int:
        lifecycle = Lifecycle()
        try:
            if tracing.configure():  # stopped last: the spans of the last batch are exported too
                lifecycle.started_part("tracing", tracing.aclose)
            publisher = start_publisher(settings, lifecycle) if with_publisher else None
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


def _flush(args: argparse.Namespace) -> int:
    def check(settings: Settings) -> bool:
        if not settings.database_url:
            raise ConfigError("flush needs DATABASE_URL (postgresql://...)")
        return False

    return _run_command("flush --once" if args.once else "flush", check, partial(_run_flusher, once=args.once))


async def _run_flusher(parts: _Parts, *, once: bool) -> int:
    from service.progress.flusher import Flusher
    from service.progress.keys import KeyLayout

    flusher = Flusher.from_settings(parts.settings.flush, parts.redis, parts.pool)
    if once:
        # what is pending now: heartbeats that arrive during the drain are flushed too, past the total
        backlog = await measure_backlog(parts.redis, KeyLayout.from_settings(parts.settings.redis))
        with Progress("flush --once", total=backlog.pending, unit="entries") as progress:
            result = await flusher.flush_cycle(stop=parts.stop, on_batch=progress.advance)
        print(json.dumps(asdict(result)), flush=True)
        return 1 if result.failed_batches else 0
    _progress(f"flushing every {parts.settings.progress_flush_interval_seconds:g}s; SIGTERM or Ctrl-C stops")
    await flusher.run(parts.stop)
    return 0


def _relay(args: argparse.Namespace) -> int:
    def check(settings: Settings) -> bool:
        if not settings.database_url:
            raise ConfigError("relay needs DATABASE_URL (postgresql://...)")
        if not settings.celery_broker_url:
            raise ConfigError("relay needs CELERY_BROKER_URL (the monolith's broker: sqs://, redis:// or amqp://)")
        return True

    return _run_command("relay --once" if args.once else "relay", check, partial(_run_relay, once=args.once))


async def _run_relay(parts: _Parts, *, once: bool) -> int:
    from service.outbox.relay import Relay

    assert parts.publisher is not None
    relay = Relay.from_settings(
        parts.settings.relay, parts.pool, relay_routes(parts.settings, parts.redis, parts.publisher)
    )
    if once:
        result = await relay.relay_once(stop=parts.stop)
        print(json.dumps(asdict(result)), flush=True)
        return 1 if result.broker_unavailable else 0
    _progress("relaying the outboxes; SIGTERM or Ctrl-C stops")
    await relay.run(parts.stop)
    return 0


def _trial_emails_run_once(args: argparse.Namespace) -> int:
    """One sweep, progress on stderr, the summed result on stdout.

    It publishes nothing: each block's statement reserves the emails, writes their outbox rows and wakes
    the relays of the `serve` pods (or `relay`). SIGTERM (or Ctrl-C) stops it cleanly: the batch in hand
    finishes, no new batch starts, the partial result is printed with "status": "stopped", and the exit
    code is 0.
    """

    def check(settings: Settings) -> bool:
        if not settings.database_url:
            raise ConfigError("DATABASE_URL is required (the primary: reservations never go to a replica)")
        return False

    return _run_command("trial-emails run-once", check, _sweep_once)


async def _sweep_once(parts: _Parts) -> int:
    from service.trial_emails.batch import BatchOptions

    with Progress("trial-emails run-once", unit="trials") as progress:

        def show(done: int, in_journey: int, batch: BatchResult) -> None:
            progress.set_total(in_journey)  # counted by the sweep before its first batch
            progress.advance(batch["user_trials"])

        result = await sweep_journeys(
            pool=parts.pool,
            options=BatchOptions(parts.settings.send_email),
            on_batch=show,
            should_stop=parts.stop.is_set,
        )
    if parts.stop.is_set():
        result["status"] = "stopped"
    print(json.dumps(result), flush=True)
    return 0


def _status(args: argparse.Namespace) -> int:
    """The state of the buffer, the outboxes and both stores; exit 1 (and a line on stderr) when a store fails."""
    from service.status import gather_status, render

    settings = load_settings()
    configure_logging(settings.log_level)
    if not settings.database_url:
        raise ConfigError("status needs DATABASE_URL (postgresql://...)")
    status = asyncio.run(gather_status(settings))
    print(json.dumps(status.report) if args.json else render(status.report), flush=True)
    for failure in status.failures:
        print(f"progress-service status: {failure}", file=sys.stderr, flush=True)
    return 1 if status.failures else 0


def _outbox_command(args: argparse.Namespace) -> int:
    """`outbox list` and `outbox redrive`: parked rows seen and made owed again, in short statements."""

    def check(settings: Settings) -> bool:
        if not settings.database_url:
            raise ConfigError(f"outbox {args.outbox_action} needs DATABASE_URL (postgresql://...)")
        return False

    body = _list_parked if args.outbox_action == "list" else _redrive_parked
    return _run_command(f"outbox {args.outbox_action}", check, partial(body, args=args))


def _chosen_outboxes(args: argparse.Namespace) -> list[Outbox]:
    from service.outbox.outboxes import OUTBOXES

    return [OUTBOXES[args.outbox]] if args.outbox else list(OUTBOXES.values())


async def _list_parked(parts: _Parts, *, args: argparse.Namespace) -> int:
    from service.outbox.admin import list_parked

    rows = await list_parked(parts.pool, _chosen_outboxes(args), limit=args.limit, ids=args.ids)
    if args.json:
        print(json.dumps([row.as_json() for row in rows]), flush=True)
        return 0
    if not rows:
        _progress("no parked outbox rows")
        return 0
    print(f"{'outbox':<10}  {'id':>12}  {'attempts':>8}  {'failed_at':<32}  error")
    for row in rows:
        # the broker's words as they came, its control bytes shown escaped rather than sent to the terminal
        error = "".join(c if c.isprintable() else repr(c)[1:-1] for c in row.error or "")
        print(f"{row.outbox:<10}  {row.id:>12}  {row.attempts:>8}  {row.failed_at.isoformat():<32}  {error}")
    return 0


async def _redrive_parked(parts: _Parts, *, args: argparse.Namespace) -> int:
    from service.outbox.admin import count_parked, redrive_parked

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


def _ids(value: str) -> list[int]:
    """Row ids as the outboxes' bigint keys hold them: plain decimal digits (not "1_0", "+3", "-4"), 1 to 2^63-1."""
    parts = [part.strip() for part in value.split(",") if part.strip()]
    if not parts:
        raise argparse.ArgumentTypeError("--ids needs at least one row id")
    for part in parts:
        # the length before int(): it refuses thousands of digits, and past 19 no number is below 2^63
        plain = part.isascii() and part.isdigit() and len(part.lstrip("0")) <= 19
        if not (plain and 1 <= int(part) <= _MAX_ROW_ID):
            raise argparse.ArgumentTypeError(
                f"--ids takes comma-separated row ids from 1 to {_MAX_ROW_ID}, not {part[:40]!r}"
            )
    return [int(part) for part in parts]


_MAX_ROW_ID = 2**63 - 1  # the outboxes' keys are bigint


def _positive(value: str) -> int:
    if not value.isdigit() or not 1 <= int(value) <= _MAX_COUNT:
        raise argparse.ArgumentTypeError(f"a whole number from 1 to {_MAX_COUNT:,}, not {value!r}")
    return int(value)


_MAX_COUNT = 1_000_000  # rows a listing may ask for


def _openapi(args: argparse.Namespace) -> int:
    """Print the OpenAPI document the app serves: service/api/openapi.yaml, as written."""
    from service.api.openapi import openapi_text

    print(openapi_text(), end="")
    return 0


def _progress(message: str) -> None:
    print(f"[progress-service] {message}", file=sys.stderr, flush=True)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="progress-service", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the HTTP service (config from the environment)")
    serve.add_argument("--host", default=os.environ.get("HOST", "0.0.0.0"))
    serve.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8000")))
    serve.add_argument("--workers", type=int, default=int(os.environ.get("WORKERS", "1")))
    serve.set_defaults(run=_serve)

    dev = commands.add_parser("dev", help="run with embedded Valkey and Postgres in ./.progress-service")
    dev.add_argument("--host", default="127.0.0.1")
    dev.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8000")))
    dev.add_argument("--redis-port", type=int, default=56379)
    dev.add_argument("--postgres-port", type=int, default=55432)
    dev.set_defaults(run=_dev)

    flush = commands.add_parser("flush", help="run the flusher alone (no HTTP), e.g. in a flusher-only pod")
    flush.add_argument("--once", action="store_true", help="drain everything pending, print a summary, exit")
    flush.set_defaults(run=_flush)

    trial_emails = commands.add_parser("trial-emails", help="trial-journey emails (reserve once, enqueue)")
    actions = trial_emails.add_subparsers(dest="trial_emails_action", required=True)
    run_once = actions.add_parser(
        "run-once", help="enqueue the due emails of every trial in its journey, once; print the result as JSON"
    )
    run_once.set_defaults(run=_trial_emails_run_once)

    relay = commands.add_parser("relay", help="publish the outboxes to the monolith's Celery broker")
    relay.add_argument("--once", action="store_true", help="publish everything owed now, print a summary, exit")
    relay.set_defaults(run=_relay)

    status = commands.add_parser("status", help="buffer, outboxes, Redis memory, Postgres, catalog: one screen")
    status.add_argument("--json", action="store_true", help="print the same facts as one JSON object")
    status.set_defaults(run=_status)
    outbox = commands.add_parser("outbox", help="parked outbox messages: list them, re-drive them")
    outbox_actions = outbox.add_subparsers(dest="outbox_action", required=True)
    listing = outbox_actions.add_parser("list", help="list the parked rows, newest first")
    redrive = outbox_actions.add_parser(
        "redrive", help="make parked rows owed again: the relay publishes them with their same task ids"
    )
    for action in (listing, redrive):
        action.add_argument("--parked", action="store_true", help="the parked rows (the only ones these commands see)")
        action.add_argument("--outbox", choices=["completion", "email"], help="one outbox only (default: both)")
        action.add_argument("--ids", type=_ids, help="only these row ids, comma-separated (needs --outbox)")
        action.set_defaults(run=_outbox_command)
    listing.add_argument("--limit", type=_positive, default=50, help="at most this many rows (default 50)")
    listing.add_argument("--json", action="store_true", help="a JSON array of {outbox, id, error, failed_at, attempts}")
    redrive.add_argument("--dry-run", action="store_true", help="print how many rows it would re-drive, change nothing")

    openapi = commands.add_parser("openapi", help="print the OpenAPI document (YAML) the app serves")
    openapi.set_defaults(run=_openapi)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "outbox":
        if args.ids is not None and args.outbox is None:
            parser.error("--ids names rows of one outbox: add --outbox completion|email")
        if args.outbox_action == "redrive" and not (args.parked or args.ids):
            parser.error("outbox redrive needs --parked (every parked row) or --ids")
    run: Callable[[argparse.Namespace], int] = args.run
    try:
        return run(args)
    except ConfigError as exc:
        print(f"progress-service: configuration error: {exc}", file=sys.stderr)
        return 2
    except EmbeddedServerError as exc:  # dev's own Valkey or Postgres could not start
        print(f"progress-service: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
