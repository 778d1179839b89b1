"""Server CPU per request of the reads and the offline sync, against the heartbeat POST of the same run.

A closed loop's p99 is about connections x CPU per request, so the target that holds on any
machine is the CPU one request costs the server, as a multiple of a heartbeat POST measured on the
same process in the same run. One run: an embedded Valkey and Postgres (unless REDIS_URL /
DATABASE_URL name scratch servers on loopback), users 1..N with a progress row for every content
of every type (so every read finds progress), the service as production starts it
(`python -m service serve --workers 1`, flusher off), a heartbeat fill so that part of what the
reads meet is only buffered (newer than its row), then rounds of wrk runs (bench/reads.lua) in
alternating order: heartbeat POST, GET one, GET 100 ids, sync of 500 items. Per run: the server's
CPU seconds (/proc) over the requests answered. Per kind: the median over the rounds of its CPU
per request, of its ratio to the heartbeat of the same round, and of p50/p99.

    .venv/bin/python bench/bench_reads_cpu.py [--rounds 5] [--duration 8] [--connections 16]
    .venv/bin/python bench/bench_reads_cpu.py --profile /tmp/profiles   # then a py-spy profile per kind

--profile records each kind once more with py-spy (`pip install py-spy`; needs ptrace) after the
measured rounds, and prints the top frames (self and inclusive) of each.
"""

import argparse
import asyncio
import collections
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

import asyncpg
from bench_ingest import (
    JWT_SECRET,
    Child,
    WrkResult,
    check_loopback,
    ensure_wrk,
    free_port,
    make_tokens,
    redis_server,
    say,
    wait_http_ok,
    wait_until_idle,
)
from bench_reads import TABLES, load, seed

from service import embedded

PROGRESS_TABLES = {"courses_lesson": ("engagements_lessonprogress", "lesson_id"),
                   "audios_audio": ("audios_audioprogress", "audio_id"),
                   "audios_meditation": ("audios_meditationprogress", "meditation_id"),
                   "lives_live": ("lives_liveprogress", "live_id")}  # fmt: skip
assert set(PROGRESS_TABLES) == set(TABLES)

# (label, reads.lua mode, target x heartbeat)
KINDS = (("heartbeat POST", "heartbeat", 1.0), ("GET one", "one", 1.0), ("GET 100 ids", "many", 4.0),
         ("sync 500 items", "sync", 50.0))  # fmt: skip


async def seed_progress(database_url: str, users: int, contents: int) -> None:
    """A row for every (user, content) of every type, two hours old: every read finds progress, and a
    synced item (reads.lua: heard within the last hour) is newer than its row."""
    conn = await asyncpg.connect(database_url)
    try:
        for progress_table, id_column in PROGRESS_TABLES.values():
            await conn.execute(
                f"INSERT INTO {progress_table} (user_id, {id_column}, position, completed_at, created_at, updated_at) "
                "SELECT u, c, (u * 7 + c) % 500, CASE WHEN (u + c) % 5 = 0 THEN now() - interval '3 hours' END, "
                "now() - interval '3 hours', now() - interval '2 hours' "
                "FROM generate_series(1, $1) u, generate_series(1, $2) c",
                users, contents,
            )  # fmt: skip
        await conn.execute("ANALYZE")
    finally:
        await conn.close()


def cpu_us(result: WrkResult) -> float:
    assert result.cpu is not None
    return result.cpu.server_cpu_s / result.requests * 1e6


def top_frames(raw: Path, count: int = 12) -> str:
    """py-spy's collapsed stacks ("frame;frame;... samples") as the top frames, self and inclusive."""
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, samples = line.rpartition(" ")
        if not stack or not samples.isdigit():
            continue
        frames = stack.split(";")
        total += int(samples)
        own[frames[-1]] += int(samples)
        for frame in set(frames):
            inclusive[frame] += int(samples)
    lines = [f"  {total} samples; self:"]
    lines += [f"    {n / total:6.1%}  {frame}" for frame, n in own.most_common(count)]
    lines.append("  inclusive:")
    lines += [f"    {n / total:6.1%}  {frame}" for frame, n in inclusive.most_common(count + 8)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds of the four kinds (5)")
    parser.add_argument("--duration", type=float, default=8.0, help="seconds of each measured run (8)")
    parser.add_argument("--warmup", type=float, default=4.0, help="seconds of each warm-up run (4)")
    parser.add_argument("--connections", type=int, default=16, help="wrk connections (16)")
    parser.add_argument("--threads", type=int, default=1, help="wrk threads (1)")
    parser.add_argument("--users", type=int, default=2000, help="distinct users, one token each (2000)")
    parser.add_argument("--contents", type=int, default=100, help="content ids 1..N of every type (100)")
    parser.add_argument("--wait-idle", type=float, default=5.0, metavar="SECONDS",
                        help="before a measured run, wait up to this long for other processes to go quiet (5)")
    parser.add_argument("--profile", type=Path, metavar="DIR",
                        help="then profile each kind with py-spy, raw stacks into DIR, top frames printed")
    args = parser.parse_args(argv)  # fmt: skip
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    wrk = ensure_wrk()
    py_spy = shutil.which("py-spy", path=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    if args.profile and not py_spy:
        raise RuntimeError("--profile needs py-spy: pip install py-spy")
    work_dir = Path(tempfile.mkdtemp(prefix="progress-bench-reads-cpu-"))
    rounds: list[dict[str, WrkResult]] = []
    profiles: dict[str, str] = {}
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
        say(f"seeding {args.users} users, {args.contents} contents per type and a progress row for every pair")
        asyncio.run(seed(database_url, args.users, args.contents))
        asyncio.run(seed_progress(database_url, args.users, args.contents))
        tokens = work_dir / "tokens.txt"
        make_tokens(args.users, tokens)
        env = {**os.environ, "JWT_SECRET": JWT_SECRET, "LOG_LEVEL": "WARNING", "PYTHONUNBUFFERED": "1",
               "REDIS_URL": redis_url, "DATABASE_URL": database_url, "PROGRESS_FLUSHER_ENABLED": "false",
               "TRIAL_JOURNEY_INTERVAL_SECONDS": "0", "RELAY_ENABLED": "false",
               "EMAIL_PUBLISHER": "redis-stream",
               # every request is charged as usual, but none refused: a user's share of a run is a few dozen reads
               # and a few syncs of 500 items, past the default burst of each
               "RATE_LIMIT_PER_USER_PER_SECOND": "1000000", "SYNC_ITEMS_PER_USER_PER_SECOND": "1000000"}  # fmt: skip
        port = free_port()
        child = Child("service", [sys.executable, "-m", "service", "serve", "--workers", "1", "--host", "127.0.0.1",
                                  "--port", str(port)], env, work_dir / "service.log")  # fmt: skip
        stack.callback(child.stop)
        url = f"http://127.0.0.1:{port}"
        wait_http_ok(child, f"{url}/health/ready")

        # buffered values newer than their rows for part of the pairs; the heartbeat runs add more
        load(wrk, child, redis_pid, url, tokens, args, "heartbeat", args.warmup * 2, "fill")
        for _, mode, _ in KINDS:
            load(wrk, child, redis_pid, url, tokens, args, mode, args.warmup, "warm-up")
        for i in range(args.rounds):
            measured: dict[str, WrkResult] = {}
            # alternating: each round starts one kind later, so no kind always follows the same one
            order = KINDS[i % len(KINDS) :] + KINDS[: i % len(KINDS)]
            for label, mode, _ in order:
                wait_until_idle(args.wait_idle)
                measured[label] = load(wrk, child, redis_pid, url, tokens, args, mode, args.duration,
                                       f"round {i + 1}/{args.rounds}")  # fmt: skip
            rounds.append(measured)
        if args.profile:
            args.profile.mkdir(parents=True, exist_ok=True)
            for label, mode, _ in KINDS:
                raw = args.profile / f"{mode}.txt"
                recorder = subprocess.Popen(
                    [str(py_spy), "record", "--pid", str(child.pid), "--format", "raw", "--output", str(raw),
                     "--duration", str(round(args.duration)), "--rate", "250", "--nonblocking"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                )  # fmt: skip
                load(wrk, child, redis_pid, url, tokens, args, mode, args.duration, "profiled")
                recorder.wait(60)
                profiles[label] = top_frames(raw) if raw.exists() else "  (py-spy wrote nothing)"

    print()
    print(f"serve --workers 1; wrk {args.threads} thread(s), {args.connections} connections, {args.duration:.0f}s "
          f"per run, {args.rounds} alternating rounds; {args.users} users x {args.contents} contents, a row for "
          f"every pair, part buffered; {os.cpu_count()} CPUs shared by wrk, the server, Valkey and Postgres")
    header = (f"{'request':<16}{'server CPU us/req':>19}{'x heartbeat':>13}{'target':>8}{'req/s':>9}{'p50 ms':>9}"
              f"{'p99 ms':>9}  per round (us)")  # fmt: skip
    print(header)
    print("-" * len(header))
    medians: dict[str, float] = {}
    for label, _, target in KINDS:
        per_round = [cpu_us(r[label]) for r in rounds]
        ratio = statistics.median(cpu_us(r[label]) / cpu_us(r["heartbeat POST"]) for r in rounds)
        medians[label] = statistics.median(per_round)
        verdict = "" if label == "heartbeat POST" else (" PASS" if ratio <= target else " MISS")
        print(f"{label:<16}{medians[label]:>19.0f}{ratio:>13.2f}{f'<={target:g}':>8}"
              f"{statistics.median(r[label].rps for r in rounds):>9.0f}"
              f"{statistics.median(r[label].p50_ms for r in rounds):>9.2f}"
              f"{statistics.median(r[label].p99_ms for r in rounds):>9.2f}"
              f"  {' '.join(f'{us:.0f}' for us in per_round)}{verdict}")  # fmt: skip
    per_id = (medians["GET 100 ids"] - medians["GET one"]) / 99
    per_item = (medians["sync 500 items"] - medians["heartbeat POST"]) / 500
    print(f"GET 100 ids: {per_id:.1f} us per id beyond the first (target < 4); sync: {per_item:.1f} us per item "
          "beyond a heartbeat (target about 8)")  # fmt: skip
    busy = max((r.cpu.other for run in rounds for r in run.values() if r.cpu is not None), default=0.0)
    if busy > 0.2:
        print(f"note: other processes used up to {busy:.2f} cores during a run (the ratios are of one run each)")
    for label, text in profiles.items():
        print(f"\npy-spy, {label}:\n{text}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
    except RuntimeError as exc:
        print(f"bench failed: {exc}", file=sys.stderr)
        sys.exit(1)
