"""The outbox relay against a bare send_task loop, and commit-to-execution latency, on a Valkey broker.

In one run, against the same embedded Valkey (the broker) and Postgres:

  bare loop   N `send_task` calls from one thread on one producer: the most one process can publish
              (the baseline);
  relay       the relay draining N pending completion events (claim a batch with FOR UPDATE SKIP
              LOCKED, publish it, mark it published), as `relay --once` does; target >= 80 % of
              the bare loop's rate;
  latency     a real Celery worker (the tests' stand-in monolith, solo pool) consuming while the
              flush statement commits completions at a steady --rate per second for --seconds;
              latency = the worker's execution time minus the event's commit time, both read from
              Postgres' clock; target p99 < 2 s.

    .venv/bin/python bench/bench_relay.py [--events 10000] [--repeats 3] [--rate 200] [--seconds 15]
"""

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import asyncpg

from service import embedded
from service.app import build_relay, completion_route
from service.config import Settings
from service.outbox.celery_publisher import publisher_from_settings
from service.progress.content import CONTENT_KINDS
from service.progress.store import Heartbeat, persist_batch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' stand-in monolith is the worker
from tests.monolith.fixtures import start_worker, stop_worker, wait_worker_ready
from tests.monolith.worker import CREATE_TABLE_SQL

TARGET_RATIO = 0.80
TARGET_P99_S = 2.0
LESSON = next(kind for kind in CONTENT_KINDS if kind.name == "lesson")


def say(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def bare_loop(settings: Settings, count: int) -> float:
    """Seconds for `count` send_task calls, one thread, one producer: nothing but Celery's client."""
    publisher = publisher_from_settings(settings)
    app = publisher.app
    try:
        with app.producer_or_acquire() as producer:  # connect before the clock starts
            app.send_task("bench.warmup", kwargs={}, queue="bench-bare", producer=producer)
            started = time.perf_counter()
            for i in range(count):
                app.send_task(settings.completion_task_name, queue="bench-bare", serializer="json",
                              task_id=str(uuid.uuid4()), producer=producer,
                              kwargs={"user_id": i, "content_type": "lesson", "content_id": 1,
                                      "completed_at": "2026-01-01T00:00:00+00:00"})  # fmt: skip
            return time.perf_counter() - started
    finally:
        publisher.close()


async def relay_drain(settings: Settings, pool: asyncpg.Pool, count: int) -> tuple[float, int]:
    await pool.execute("TRUNCATE progress_completion_event")
    await pool.execute(
        "INSERT INTO progress_completion_event (content_type, content_id, user_id, completed_at) "
        "SELECT 'lesson', 1, i, now() FROM generate_series(1, $1) i", count,
    )  # fmt: skip
    publisher = publisher_from_settings(settings)
    try:
        relay = build_relay(settings, pool, [completion_route(settings, publisher)])
        await publisher.publish([])  # nothing: the thread pool exists before the clock starts
        started = time.perf_counter()
        result = await relay.relay_once()
        elapsed = time.perf_counter() - started
    finally:
        publisher.close()
    owed = await pool.fetchval("SELECT count(*) FROM progress_completion_event WHERE published_at IS NULL")
    assert owed == 0 and result.published["completion"] == count, (owed, result)
    return elapsed, result.published["completion"]


async def steady_latency(
    settings: Settings, pool: asyncpg.Pool, rate: int, seconds: float
) -> tuple[list[float], list[float]]:
    """Commit `rate` completions per second (10 flush statements a second) while relay and worker run."""
    await pool.execute("TRUNCATE progress_completion_event, monolith_task_execution, engagements_lessonprogress")
    total = int(rate * seconds)
    await pool.execute("INSERT INTO users_user (id, email) SELECT i, 'u' || i FROM generate_series(1, $1) i "
                       "ON CONFLICT DO NOTHING", total)  # fmt: skip
    await pool.execute("INSERT INTO courses_lesson (id, title, duration) VALUES (1, 'l', 600) ON CONFLICT DO NOTHING")
    publisher = publisher_from_settings(settings)
    stop = asyncio.Event()
    relay = asyncio.create_task(build_relay(settings, pool, [completion_route(settings, publisher)]).run(stop))
    try:
        await asyncio.sleep(1.0)  # LISTEN in place
        per_tick, tick_s = max(1, rate // 10), 0.1
        next_tick = time.perf_counter()
        for first in range(1, total + 1, per_tick):
            now_ms = time.time_ns() // 1_000_000
            users = range(first, min(first + per_tick, total + 1))
            batch = [Heartbeat(1, user, 595.0, now_ms, 595.0) for user in users]
            await persist_batch(pool, LESSON, batch, margin_s=10.0)
            next_tick += tick_s
            await asyncio.sleep(max(0.0, next_tick - time.perf_counter()))
        deadline = time.monotonic() + 60
        while await pool.fetchval("SELECT count(*) FROM monolith_task_execution") < total:
            assert time.monotonic() < deadline, "the worker did not run every completion in 60 s"
            await asyncio.sleep(0.2)
    finally:
        stop.set()
        await relay
        publisher.close()
    rows = await pool.fetch(
        "SELECT extract(epoch FROM x.executed_at - e.created_at)::float8 AS latency_s, "
        "       extract(epoch FROM e.published_at - e.created_at)::float8 AS published_s "
        "FROM monolith_task_execution x JOIN progress_completion_event e "
        "ON e.user_id = (x.kwargs->>'user_id')::bigint AND e.content_id = (x.kwargs->>'content_id')::bigint"
    )
    return sorted(row["latency_s"] for row in rows), sorted(row["published_s"] for row in rows)


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=10_000)
    parser.add_argument("--rate", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--repeats", type=int, default=3, help="bare loop and relay drain, interleaved; medians")
    parser.add_argument("--worker-threads", type=int, default=4, help="the stand-in worker's threads pool size")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="bench-relay-"))
    broker = embedded.EmbeddedRedis(base / "valkey", None)
    pg = embedded.EmbeddedPostgres(base / "postgres", None)
    worker = None
    try:
        say("starting Valkey (broker) and Postgres")
        broker.start()
        pg.start()
        pg.create_database("bench")
        database_url = pg.url("bench")
        await embedded.prepare_database(database_url, seed=False)
        settings = Settings(database_url=database_url, celery_broker_url=broker.url, relay_batch_size=500,
                            relay_poll_interval_seconds=1.0)  # fmt: skip
        pool = await asyncpg.create_pool(database_url, min_size=2, max_size=4)
        assert pool is not None
        await pool.execute(CREATE_TABLE_SQL)

        # interleaved and repeated: the machine is shared, and its load moves both rates alike
        bare_runs, relay_runs = [], []
        for run in range(1, args.repeats + 1):
            say(f"run {run}/{args.repeats}: bare loop of {args.events} send_task calls")
            bare_runs.append(await asyncio.to_thread(bare_loop, settings, args.events))
            say(f"run {run}/{args.repeats}: relay draining {args.events} pending events")
            seconds, published = await relay_drain(settings, pool, args.events)
            relay_runs.append(seconds)
        bare_s, relay_s = statistics.median(bare_runs), statistics.median(relay_runs)
        say("bare loop seconds: " + ", ".join(f"{x:.2f}" for x in bare_runs)
            + "; relay seconds: " + ", ".join(f"{x:.2f}" for x in relay_runs))  # fmt: skip

        log_path = base / "worker.log"
        worker = start_worker(broker.url.replace("/0", "/1"), database_url, log_path, threads=args.worker_threads)
        await asyncio.to_thread(wait_worker_ready, worker, log_path)
        latency_settings = settings.model_copy(update={"celery_broker_url": broker.url.replace("/0", "/1")})
        say(f"latency: {args.rate} completions/s for {args.seconds:g} s, a real worker consuming")
        latencies, marked = await steady_latency(latency_settings, pool, args.rate, args.seconds)
        await pool.close()
    finally:
        if worker is not None:
            stop_worker(worker)
        pg.stop()
        broker.stop()

    bare_rate, relay_rate = args.events / bare_s, published / relay_s
    ratio = relay_rate / bare_rate
    median = statistics.median(latencies)
    p99 = latencies[int(0.99 * (len(latencies) - 1))]
    print(f"medians of {args.repeats} interleaved runs\n| | messages | seconds | messages/s |\n|---|---|---|---|\n"
          f"| bare `send_task` loop | {args.events:,} | {bare_s:.2f} | {bare_rate:,.0f} |\n"
          f"| relay draining the outbox | {published:,} | {relay_s:.2f} | {relay_rate:,.0f} |\n"
          f"| ratio | | | **{ratio:.0%}** |")  # fmt: skip
    print(f"\ncommit -> worker execution at {args.rate}/s over {len(latencies):,} completions: "
          f"median {median * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms, max {latencies[-1] * 1000:.0f} ms")
    print(f"commit -> marked published (the relay's share): median {statistics.median(marked) * 1000:.0f} ms, "
          f"p99 {marked[int(0.99 * (len(marked) - 1))] * 1000:.0f} ms")
    ok_ratio, ok_p99 = ratio >= TARGET_RATIO, p99 < TARGET_P99_S
    print(f"relay >= {TARGET_RATIO:.0%} of the bare loop: {'PASS' if ok_ratio else 'FAIL'}; "
          f"p99 < {TARGET_P99_S:g} s: {'PASS' if ok_p99 else 'FAIL'}")
    return 0 if ok_ratio and ok_p99 else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
