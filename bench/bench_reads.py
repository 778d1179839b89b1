"""HTTP benchmark of the progress reads and the offline sync, against the heartbeat POST of the same run.

In one run on one machine: starts an embedded Valkey and Postgres (unless REDIS_URL / DATABASE_URL
are given; both must be scratch servers on loopback), seeds users and contents, starts the service
exactly as production starts it (`python -m service serve --workers 1`, flusher off), fills the
buffer with heartbeats and flushes them once (so reads meet both rows and newer buffered values),
then loads it with wrk (bench/reads.lua), one kind of request per run:
heartbeat POST, GET of one position, heartbeat POST again, GET of one again (the comparison of the
issue, twice, interleaved), GET of 100 ids and a 500-item sync at 64 connections, then both again at
2 connections (the latency of one request without a queue in front of it). Last, the heartbeat POST
and the GET of one again, through the ASGI app in this process (no HTTP, no wrk), to compare what
the service itself spends on each. Prints req/s, latencies and CPU per request, and PASS/MISS per
target.

    .venv/bin/python bench/bench_reads.py [--duration 15] [--connections 64]
"""

import argparse
import asyncio
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import asyncpg
import uvloop
from bench_ingest import (
    BENCH_DIR,
    JWT_SECRET,
    Child,
    CpuMeter,
    WrkResult,
    check_loopback,
    ensure_wrk,
    free_port,
    make_tokens,
    redis_server,
    run_wrk,
    say,
    wait_http_ok,
    wait_until_idle,
)

from service import embedded

READS_SCRIPT = BENCH_DIR / "reads.lua"
TARGET_P99_MS = 20.0
TABLES = ("courses_lesson", "audios_audio", "audios_meditation", "lives_live")


async def seed(database_url: str, users: int, contents: int) -> None:
    await embedded.prepare_database(database_url, seed=False)
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute("TRUNCATE users_user, " + ", ".join(TABLES) + " RESTART IDENTITY CASCADE")
        await conn.execute("INSERT INTO users_user (id, email) SELECT i, 'u' || i || '@example.com' "
                           "FROM generate_series(1, $1) i", users)  # fmt: skip
        for table in TABLES:
            await conn.execute(f"INSERT INTO {table} (id, title, duration) SELECT i, 'c' || i, 600 "
                               "FROM generate_series(1, $1) i", contents)  # fmt: skip
    finally:
        await conn.close()


def load(wrk: str, child: Child, redis_pid: int | None, url: str, tokens: Path, args: argparse.Namespace,
         mode: str, duration_s: float, label: str, connections: int | None = None) -> WrkResult:  # fmt: skip
    connections = connections or args.connections
    say(f"{mode}: {label} run, {duration_s:.0f}s, {connections} connections")
    # a 500-item sync queued behind 63 others waits seconds: measured, not dropped as a timeout
    result = run_wrk(wrk, url, tokens, args, duration_s, CpuMeter(child.pid, redis_pid), script=READS_SCRIPT,
                     script_args=(mode,), connections=connections, timeout_s=30)  # fmt: skip
    # wrk counts a 404 among its "status" errors: the unexpected statuses are counted by the script
    socket_errors = sum(n for kind, n in result.socket_errors.items() if kind != "status")
    if result.non201 or socket_errors or not child.alive():
        raise RuntimeError(f"{mode} {label} run: {result.non201} unexpected answers {result.statuses}, "
                           f"socket errors {result.socket_errors}\n{child.log_tail()}")  # fmt: skip
    return result


async def in_process(redis_url: str, database_url: str, users: int, contents: int,
                     rounds: int = 3) -> list[tuple[str, float, float]]:  # fmt: skip
    """The same two requests through the ASGI app in this process, 64 at a time: no HTTP parsing, no wrk.

    What the service itself spends per heartbeat and per read, apart from what the machine's
    other load does to an HTTP run. Returns (name, wall µs, CPU µs of this process) per request.
    """
    from service.app import create_app
    from service.auth import make_token
    from service.config import Settings

    settings = Settings(redis_url=redis_url, database_url=database_url, jwt_secret=JWT_SECRET,
                        progress_flusher_enabled=False, trial_journey_interval_seconds=0,
                        relay_enabled=False, email_publisher="redis-stream")  # fmt: skip
    app = create_app(settings)
    authorizations = [f"Bearer {make_token(settings, user_id)}".encode() for user_id in range(1, users + 1)]

    async def call(method: str, path: str, body: bytes = b"") -> None:
        scope = {"type": "http", "method": method, "path": path, "query_string": b"",
                 "headers": [(b"authorization", random.choice(authorizations)),
                             (b"content-length", str(len(body)).encode())]}  # fmt: skip
        statuses: list[int] = []

        async def receive() -> dict[str, object]:
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message: Any) -> None:
            if message["type"] == "http.response.start":
                statuses.append(message["status"])

        await app(scope, receive, send)
        if statuses[0] not in (200, 201, 404):
            raise RuntimeError(f"{method} {path}: {statuses[0]}")

    async def heartbeat() -> None:
        body = b'{"lesson_id":%d,"position":%.1f}' % (random.randint(1, contents), random.random() * 600)
        await call("POST", "/engagements/progress/lesson", body)

    async def read() -> None:
        await call("GET", f"/progress/lesson/{random.randint(1, contents)}")

    async def loop(request: Callable[[], Awaitable[None]], times: int) -> None:
        for _ in range(times):
            await request()

    measured: list[tuple[str, float, float]] = []
    async with app.app.router.lifespan_context(app.app):
        for request in (heartbeat, read):
            await asyncio.gather(*(loop(request, 20) for _ in range(64)))
        for _ in range(rounds):
            for name, request in (("heartbeat POST", heartbeat), ("GET one", read)):
                wall, cpu = time.perf_counter(), time.process_time()
                await asyncio.gather(*(loop(request, 100) for _ in range(64)))
                measured.append((name, (time.perf_counter() - wall) / 6400 * 1e6,
                                 (time.process_time() - cpu) / 6400 * 1e6))  # fmt: skip
    return measured


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=15.0, help="seconds of each measured run (15)")
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds of each warm-up run (5)")
    parser.add_argument("--connections", type=int, default=64, help="wrk connections (64)")
    parser.add_argument("--few", type=int, default=2, help="connections of the second batch and sync runs (2)")
    parser.add_argument("--threads", type=int, default=2, help="wrk threads (2)")
    parser.add_argument("--users", type=int, default=500, help="distinct users, one token each (500)")
    parser.add_argument("--contents", type=int, default=100, help="content ids 1..N of every type (100)")
    parser.add_argument("--wait-idle", type=float, default=60.0, metavar="SECONDS",
                        help="before a measured run, wait up to this long for other processes to go quiet")  # fmt: skip
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    wrk = ensure_wrk()
    work_dir = Path(tempfile.mkdtemp(prefix="progress-bench-reads-"))
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, work_dir, True)
        redis_url, redis_pid = stack.enter_context(redis_server(work_dir))
        database_url = os.environ.get("DATABASE_URL")
        if database_url:
            check_loopback(database_url)
        else:
            pg = embedded.EmbeddedPostgres(work_dir / "postgres", None, durable=False)
            say(f"starting embedded Postgres on 127.0.0.1:{pg.port}")
            pg.start()
            stack.callback(pg.stop)
            pg.create_database("progress_bench")
            database_url = pg.url("progress_bench")
        asyncio.run(seed(database_url, args.users, args.contents))
        tokens = work_dir / "tokens.txt"
        make_tokens(args.users, tokens)
        env = {**os.environ, "JWT_SECRET": JWT_SECRET, "LOG_LEVEL": "WARNING", "PYTHONUNBUFFERED": "1",
               "REDIS_URL": redis_url, "DATABASE_URL": database_url, "PROGRESS_FLUSHER_ENABLED": "false",
               "TRIAL_JOURNEY_INTERVAL_SECONDS": "0", "RELAY_ENABLED": "false",
               "EMAIL_PUBLISHER": "redis-stream"}  # fmt: skip
        port = free_port()
        child = Child("service", [sys.executable, "-m", "service", "serve", "--workers", "1", "--host", "127.0.0.1",
                                  "--port", str(port)], env, work_dir / "service.log")  # fmt: skip
        stack.callback(child.stop)
        url = f"http://127.0.0.1:{port}"
        wait_http_ok(child, f"{url}/health/ready")

        load(wrk, child, redis_pid, url, tokens, args, "heartbeat", args.warmup * 2, "fill")
        say("flushing the buffer once: the reads meet rows, and buffered values newer than them")
        subprocess.run([sys.executable, "-m", "service", "flush", "--once"], env=env, check=True,
                       stdout=subprocess.DEVNULL, timeout=300)  # fmt: skip
        load(wrk, child, redis_pid, url, tokens, args, "heartbeat", args.warmup, "fill after flush")
        for mode in ("one", "many", "sync"):
            load(wrk, child, redis_pid, url, tokens, args, mode, args.warmup, "warm-up")

        results: list[tuple[str, int, WrkResult]] = []
        runs = [("heartbeat POST", "heartbeat", args.connections), ("GET one", "one", args.connections),
                ("heartbeat POST", "heartbeat", args.connections), ("GET one", "one", args.connections),
                ("GET 100 ids", "many", args.connections), ("sync 500 items", "sync", args.connections),
                ("GET 100 ids", "many", args.few), ("sync 500 items", "sync", args.few)]  # fmt: skip
        for name, mode, connections in runs:
            wait_until_idle(args.wait_idle)
            result = load(wrk, child, redis_pid, url, tokens, args, mode, args.duration, "measured", connections)
            results.append((name, connections, result))
        say("in-process: the heartbeat POST and the GET of one through the ASGI app, 64 at a time")
        wait_until_idle(args.wait_idle)
        direct = uvloop.run(in_process(redis_url, database_url, args.users, args.contents))

    print()
    print(f"wrk {args.threads} threads, {args.connections} connections, {args.duration:.0f}s per run; {args.users} "
          f"users, content ids 1..{args.contents}; {os.cpu_count()} CPUs shared by wrk, the server, Valkey and "
          "Postgres")  # fmt: skip
    header = (f"{'':<16}{'conns':>6}{'req/s':>9}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}{'p99.9 ms':>10}"
              f"{'server us/req':>15}  statuses")  # fmt: skip
    print(header)
    print("-" * len(header))
    for name, connections, r in results:
        cpu_us = r.cpu.server_cpu_s / r.requests * 1e6 if r.cpu is not None else 0.0
        print(f"{name:<16}{connections:>6}{r.rps:>9.0f}{r.p50_ms:>9.2f}{r.p90_ms:>9.2f}{r.p99_ms:>9.2f}"
              f"{r.p999_ms:>10.2f}{cpu_us:>15.0f}  {r.statuses}")  # fmt: skip
    busy = max((r.cpu.other for _, _, r in results if r.cpu is not None), default=0.0)
    if busy > 0.2:
        print(f"WARNING: other processes used up to {busy:.2f} cores during a run: the figures are low")
    print()
    print("in-process, through the ASGI app, 64 concurrent (6,400 requests each; CPU of this process):")
    for name, wall_us, cpu_us in direct:
        print(f"  {name:<16}{wall_us:>8.1f} us wall {cpu_us:>8.1f} us CPU per request")
    post_us = statistics.median(cpu for name, _, cpu in direct if name == "heartbeat POST")
    get_us = statistics.median(cpu for name, _, cpu in direct if name == "GET one")
    verdict = "PASS" if get_us <= post_us else "MISS"
    print(f"target: GET one costs the service no more than the heartbeat POST (in-process CPU, median of "
          f"{len(direct) // 2}): {get_us:.1f} vs {post_us:.1f} us {verdict}")  # fmt: skip
    heartbeats = [r for name, _, r in results if name == "heartbeat POST"]
    reads = [r for name, _, r in results if name == "GET one"]
    for i, (post, get) in enumerate(zip(heartbeats, reads, strict=True), 1):
        fast = get.rps >= post.rps
        print(f"target: GET one at least as fast as the heartbeat POST (round {i}): {get.rps:.0f} vs {post.rps:.0f} "
              f"req/s, p99 {get.p99_ms:.2f} vs {post.p99_ms:.2f} ms {'PASS' if fast else 'MISS'}")  # fmt: skip
    for name, connections, r in results[4:]:
        print(f"target: {name} p99 < {TARGET_P99_MS:.0f} ms at {connections} connections: {r.p99_ms:.2f} ms "
              f"{'PASS' if r.p99_ms < TARGET_P99_MS else 'MISS'}")  # fmt: skip
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
    except RuntimeError as exc:
        print(f"bench failed: {exc}", file=sys.stderr)
        sys.exit(1)
