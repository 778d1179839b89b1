"""`progress-service dev`: the service on embedded Valkey and Postgres in ./.progress-service, with a banner
that says how to try it. Imported by the command line only when `dev` runs: no production code imports it."""

import argparse
import asyncio
import os
import signal
import sys
from pathlib import Path
from urllib.parse import urlsplit

from service.cli import uvicorn_options
from service.commands import say
from service.config import Settings, load_settings
from service.dev.database import EmbeddedPostgres, prepare_database
from service.dev.embedded import EmbeddedRedis, EmbeddedServerError
from service.logs import configure_logging

DEV_JWT_SECRET = "dev-only-secret-not-for-production"


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from service.app import create_app
    from service.auth import make_token

    data_dir = Path(os.environ.get("DEV_DATA_DIR", ".progress-service")).resolve()
    os.environ.setdefault("JWT_SECRET", DEV_JWT_SECRET)
    servers: list[EmbeddedRedis | EmbeddedPostgres] = []
    try:
        if "REDIS_URL" not in os.environ:
            redis_server = EmbeddedRedis(data_dir / "valkey", args.redis_port)
            say(f"starting embedded Valkey on 127.0.0.1:{redis_server.port} (data in {redis_server.data_dir})")
            redis_server.start()
            servers.append(redis_server)
            os.environ["REDIS_URL"] = redis_server.url
        if "DATABASE_URL" not in os.environ:
            pg = EmbeddedPostgres(data_dir / "postgres", args.postgres_port)
            say(f"starting embedded Postgres on 127.0.0.1:{pg.port} (data in {pg.data_dir})")
            pg.start()
            servers.append(pg)
            pg.create_database("progress")
            os.environ["DATABASE_URL"] = pg.url("progress")
        # the monolith's broker, played by the embedded Valkey in a database of its own
        os.environ.setdefault("CELERY_BROKER_URL", urlsplit(os.environ["REDIS_URL"])._replace(path="/2").geturl())
        say("applying migrations_ref/*.sql and dev seed data")
        applied = asyncio.run(prepare_database(os.environ["DATABASE_URL"], seed=True))
        say(f"applied {', '.join(applied)}")
        settings = load_settings()
        configure_logging(settings.log_level)
        app = create_app(settings)
        http = uvicorn.Server(uvicorn.Config(app, **uvicorn_options(args.host, args.port, settings)))
        # Ctrl-C is uvicorn's graceful stop from the banner on, also before uvicorn installs its own handler
        # (the lifespan then starts and stops at once, final flush included): a Ctrl-C in that gap used to
        # be swallowed, and dev served on. With Python's own handler it would be a KeyboardInterrupt in the
        # middle of the lifespan's shutdown, when uvicorn re-raises it after the stop; this one is a no-op then.
        signal.signal(signal.SIGINT, http.handle_exit)
        print(_banner(args, settings, make_token(settings, 1)), flush=True)
        http.run()
    except EmbeddedServerError as exc:  # dev's own Valkey or Postgres could not start
        print(f"progress-service: {exc}", file=sys.stderr)
        return 1
    finally:
        for server in reversed(servers):
            say(f"stopping embedded {server.name}")
            server.stop()
    return 0


def _banner(args: argparse.Namespace, settings: Settings, token: str) -> str:
    """How to try it: the servers' URLs, a curl with a dev token, where the completion lands."""
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
