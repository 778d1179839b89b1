"""HTTP benchmark of the progress reads and the offline sync, against the heartbeat POST of the same run.

In one run on one machine: starts an embedded Valkey and Postgres (unless REDIS_URL / DATABASE_URL
are given; both must be scratch servers on loopback), seeds users and contents, starts the service
exactly as production starts it (`python -m service serve --workers 1`, flusher off), fills the
buffer with heartbeats and flushes them once (so reads meet both rows and newer buffered values),
then loads it with wrk (bench/reads.lua), one kind of request per run:
heartbeat POST, GET of one position, heartbeat POST again, GET of one again (the comparison of the
issue, twice, interleaved), GET of 100 ids and a 500-item sync at 64 connections, then both again at
2 connections (the latency of one request without a queue in front of it). Prints req/s, latencies
and server CPU per request, and PASS/MISS per target.

    .venv/bin/python bench/bench_reads.py [--duration 15] [--connections 64]
"""

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

import asyncpg
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
               "TRIAL_JOURNEY_INTERVAL_SECONDS": "0"}  # fmt: skip
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
