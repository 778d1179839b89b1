"""The outbox relay against a bare send_task loop, then commit-to-execution latency, on a Valkey broker.

N `send_task` calls from one thread against the relay draining N completion events (interleaved, medians); then a
real Celery worker (bench/monolith_worker.py) while the flush commits --rate completions/s: execution - commit.

    .venv/bin/python bench/bench_relay.py [--events 10000] [--repeats 3] [--rate 200] [--seconds 15]
    smallest: --events 500 --repeats 1 --rate 50 --seconds 2
"""

import asyncio
import sys
import time
import uuid
from contextlib import closing
from functools import partial

import asyncpg
import harness
from monolith_worker import CREATE_TABLE_SQL

from service.compose import completion_route
from service.config import Settings
from service.outbox.celery_publisher import CeleryPublisher
from service.outbox.relay import Relay
from service.progress.content import CONTENT_KINDS
from service.progress.flush.store import Heartbeat, persist_batch

LESSON = next(kind for kind in CONTENT_KINDS if kind.name == "lesson")
# `$1` completion events in the outbox, as the flush leaves them
EVENTS_SQL = """INSERT INTO progress_completion_event (content_type, content_id, user_id, completed_at)
    SELECT 'lesson', 1, i, now() FROM generate_series(1, $1) i"""
COMPLETION = {"content_type": "lesson", "content_id": 1, "completed_at": "2026-01-01T00:00:00+00:00"}


def monolith_worker(s: harness.Servers, broker_url: str, threads: int) -> harness.Child:
    """A real Celery worker of the monolith's completion task (bench/monolith_worker.py)."""
    env = {"PYTHONPATH": str(harness.BENCH), "MONOLITH_BROKER_URL": broker_url, "MONOLITH_DATABASE_URL": s.database_url}
    args = f"-m celery -A monolith_worker worker --pool=threads --concurrency={threads} -Q onion-progress"
    quiet = "--without-gossip --without-mingle --without-heartbeat -l INFO"
    worker = s.child("worker", [sys.executable, *args.split(), *quiet.split()], env)
    worker.wait_for(lambda: " ready." in worker.log_path.read_text(errors="replace"))
    return worker


def bare_loop(settings: Settings, count: int) -> float:
    """Seconds for `count` send_task calls, one thread, one producer: nothing but Celery's client."""
    with closing(CeleryPublisher(settings.relay)) as publisher, publisher.app.producer_or_acquire() as producer:
        publisher.app.send_task("bench.warmup", kwargs={}, queue="bench-bare", producer=producer)
        started = time.perf_counter()  # the producer connected before the clock starts
        send = partial(publisher.app.send_task, queue="bench-bare", serializer="json", producer=producer)
        for i in range(count):
            send(settings.completion_task_name, task_id=str(uuid.uuid4()), kwargs={**COMPLETION, "user_id": i})
        return time.perf_counter() - started


async def relay_drain(settings: Settings, pool: asyncpg.Pool, count: int) -> float:
    await pool.execute("TRUNCATE progress_completion_event")
    await pool.execute(EVENTS_SQL, count)
    with closing(CeleryPublisher(settings.relay)) as publisher:
        relay = Relay(settings.relay, pool, [completion_route(settings, publisher)])
        await publisher.publish([])  # nothing: the thread pool exists before the clock starts
        started = time.perf_counter()
        result = await relay.relay_once()
        elapsed = time.perf_counter() - started
    if result.published["completion"] != count:
        raise RuntimeError(f"the relay published {result}, not {count}")
    return elapsed


async def steady_latency(settings: Settings, pool: asyncpg.Pool, rate: int, seconds: float) -> tuple[list[float], ...]:
    """Commit `rate` completions per second (10 flush statements a second) while relay and worker run."""
    await pool.execute("TRUNCATE progress_completion_event, monolith_task_execution, engagements_lessonprogress")
    total = int(rate * seconds)
    publisher, stop = CeleryPublisher(settings.relay), asyncio.Event()
    relay = asyncio.create_task(Relay(settings.relay, pool, [completion_route(settings, publisher)]).run(stop))
    try:
        await asyncio.sleep(1.0)  # LISTEN in place
        per_tick, next_tick = max(1, rate // 10), time.perf_counter()
        for first in range(1, total + 1, per_tick):
            users = range(first, min(first + per_tick, total + 1))
            batch = [Heartbeat(1, user, 595.0, time.time_ns() // 1_000_000, 595.0) for user in users]
            await persist_batch(pool, LESSON, batch, margin_s=10.0)
            next_tick += 0.1
            await asyncio.sleep(max(0.0, next_tick - time.perf_counter()))
        deadline = time.monotonic() + 60
        while await pool.fetchval("SELECT count(*) FROM monolith_task_execution") < total:
            if time.monotonic() > deadline:
                raise RuntimeError("the worker did not run every completion in 60 s")
            await asyncio.sleep(0.2)
    finally:
        stop.set()
        await relay
        publisher.close()
    rows = await pool.fetch(
        "SELECT extract(epoch FROM x.executed_at - e.created_at)::float8 AS run_s, "
        "       extract(epoch FROM e.published_at - e.created_at)::float8 AS marked_s "
        "FROM monolith_task_execution x JOIN progress_completion_event e "
        "ON e.user_id = (x.kwargs->>'user_id')::bigint AND e.content_id = (x.kwargs->>'content_id')::bigint"
    )
    return sorted(row["run_s"] for row in rows), sorted(row["marked_s"] for row in rows)


@harness.main(events=10_000, rate=200, seconds=15.0, repeats=3, worker_threads=4)
def main(args: harness.Namespace) -> None:
    with harness.servers("relay", postgres=True, durable=True) as s:
        settings = harness.settings(s, CELERY_BROKER_URL=s.redis_url, RELAY_POLL_INTERVAL_SECONDS="1")

        async def measure() -> tuple[dict[str, list[float]], tuple[list[float], ...]]:
            await harness.seed(s.database_url, users=int(args.rate * args.seconds), contents=1)
            async with asyncpg.create_pool(s.database_url, min_size=2, max_size=4) as pool:
                await pool.execute(CREATE_TABLE_SQL)
                runs: dict[str, list[float]] = {"bare `send_task` loop": [], "relay draining the outbox": []}
                for _ in range(args.repeats):  # interleaved: the machine's load moves both alike
                    runs["bare `send_task` loop"].append(await asyncio.to_thread(bare_loop, settings, args.events))
                    runs["relay draining the outbox"].append(await relay_drain(settings, pool, args.events))
                broker = harness.redis_db(s.redis_url, 1)
                await asyncio.to_thread(monolith_worker, s, broker, args.worker_threads)
                harness.say(f"latency: {args.rate} completions/s for {args.seconds:g} s, a real worker consuming")
                latency = settings.model_copy(update={"celery_broker_url": broker})
                return runs, await steady_latency(latency, pool, args.rate, args.seconds)

        runs, (ran, marked) = asyncio.run(measure())
    bare, relay = (harness.median(seconds) for seconds in runs.values())
    rows = [[name, args.events, harness.median(x), args.events / harness.median(x)] for name, x in runs.items()]
    harness.table(" | messages | seconds | messages/s", [*rows, ["ratio", "", "", f"**{bare / relay:.0%}**"]])
    p99, p99_marked = (values[int(0.99 * (len(values) - 1))] * 1000 for values in (ran, marked))
    print(
        f"\ncommit -> the worker's execution at {args.rate}/s over {len(ran):,} completions: median "
        f"{harness.median(ran) * 1000:.0f} ms, p99 {p99:.0f} ms, max {ran[-1] * 1000:.0f} ms; commit -> marked "
        f"published: median {harness.median(marked) * 1000:.0f} ms, p99 {p99_marked:.0f} ms"
    )
    harness.target("relay >= 80% of the bare loop", f"{bare / relay:.0%}", bare / relay >= 0.8)
    harness.target("p99 < 2 s", f"{p99:.0f} ms", p99 < 2000)
