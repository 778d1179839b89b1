"""`progress-service` / `python -m service`: serve, dev, and the one-off commands."""

import argparse
import asyncio
import json
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

from service.commands import flush_command, outbox_command, relay_command, trial_emails_command
from service.compose import check_startup
from service.config import ConfigError, Settings, load_settings
from service.logs import configure_logging

# after the drain, how long uvicorn waits for the requests in flight before cancelling them (each is bounded well
# below it: 10 s for a slow body, the stores' deadlines); deploy/k8s's grace period counts it
IN_FLIGHT_TIMEOUT_S = 30


def uvicorn_options(host: str, port: int, settings: Settings) -> dict[str, Any]:
    from service.api.protocol import ServiceProtocol

    return {
        "host": host,
        "port": port,
        "loop": "uvloop",
        # httptools with a limit on the request head's size and time, and the heartbeat answered below ASGI
        "http": ServiceProtocol,
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
    check_startup(settings)  # in the parent too: a bad config fails once, with its message
    from service.serving import ServeConfig, run

    # uvicorn shuts down gracefully on SIGTERM, then re-raises it so the process dies "by signal".
    # A graceful stop is a success for the orchestrator: with this handler in place, exit 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    config = ServeConfig(
        "service.app:app_from_environment",
        factory=True,
        workers=args.workers,
        drain_s=settings.shutdown_drain_seconds,
        **uvicorn_options(args.host, args.port, settings),
    )
    run(config)
    return 0


def _dev(args: argparse.Namespace) -> int:
    from service.dev.command import run

    return run(args)


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
    flush.set_defaults(run=flush_command)

    trial_emails = commands.add_parser("trial-emails", help="trial-journey emails (reserve once, enqueue)")
    actions = trial_emails.add_subparsers(dest="trial_emails_action", required=True)
    run_once = actions.add_parser(
        "run-once", help="enqueue the due emails of every trial in its journey, once; print the result as JSON"
    )
    run_once.set_defaults(run=trial_emails_command)

    relay = commands.add_parser("relay", help="publish the outboxes to the monolith's Celery broker")
    relay.add_argument("--once", action="store_true", help="publish everything owed now, print a summary, exit")
    relay.set_defaults(run=relay_command)

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
        action.set_defaults(run=outbox_command)
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
    except KeyboardInterrupt:
        return 130
