"""Flusher processes killed with SIGKILL, and several flushers racing on the same keys."""

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time

import asyncpg
from redis.asyncio import Redis

from service.clients import RedisClient
from service.progress.buffer import write_args
from service.progress.keys import STANDALONE, KeyLayout
from tests.conftest import Servers, seed
from tests.progress.test_flusher import events, lesson_rows, write

LEASE_S = 1.0


def flusher_env(servers: Servers, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PROGRESS_", "REDIS_", "DATABASE_"))}
    env.update(REDIS_URL=servers.redis_url, DATABASE_URL=servers.database_url, LOG_LEVEL="WARNING",
               PROGRESS_FLUSH_LEASE_SECONDS=str(LEASE_S), PROGRESS_FLUSH_BATCH_SIZE="100",
               PROGRESS_FLUSH_CONCURRENCY="2")  # fmt: skip
    env.update(extra)
    return env


def flush_once(servers: Servers, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "service", "flush", "--once"], env=flusher_env(servers, **extra),
                          capture_output=True, text=True, timeout=120)  # fmt: skip


async def fill(redis: RedisClient, db: asyncpg.Pool, keys: int,
               layout: KeyLayout = STANDALONE) -> dict[tuple[int, int], float]:  # fmt: skip
    """`keys` lessons-by-user, each with a few heartbeats; returns the last position of each."""
    await seed(db, users=keys // 10, contents=10)
    last = {}
    for round_ in range(3):
        async with redis.pipeline(transaction=False) as pipe:
            for i in range(keys):
                content_id, user_id = i % 10 + 1, i // 10 + 1
                position = float(round_ * 100 + i % 97)
                pipe.execute_command(*_args(content_id, user_id, position, layout))
                last[(content_id, user_id)] = position
            await pipe.execute()
    return last


def _args(content_id: int, user_id: int, position: float, layout: KeyLayout = STANDALONE) -> tuple[object, ...]:
    return write_args("lesson", content_id, user_id, position, time.time_ns() // 1_000_000, 3600, layout)


async def backlog(redis: RedisClient, layout: KeyLayout = STANDALONE) -> tuple[int, int]:
    """Lesson members pending and in flight, over every shard."""
    pending = in_flight = 0
    for shard in layout.shards_to_flush("lesson"):
        pending += await redis.scard(shard.pending_key)
        in_flight += await redis.zcard(shard.in_flight_key)
    return pending, in_flight


async def assert_all_persisted(redis: RedisClient, db: asyncpg.Pool, last: dict[tuple[int, int], float],
                               layout: KeyLayout = STANDALONE) -> None:  # fmt: skip
    rows = await lesson_rows(db)
    missing = [key for key in last if key not in rows]
    wrong = [key for key, position in last.items() if key in rows and rows[key]["position"] != position]
    assert (missing, wrong) == ([], []), f"{len(missing)} missing, {len(wrong)} with an old position"
    assert await backlog(redis, layout) == (0, 0)


async def test_sigkill_after_claim_loses_nothing(servers: Servers, redis: Redis, db: asyncpg.Pool) -> None:
    await redis.script_load(__import__("service.progress.buffer", fromlist=["WRITE_SCRIPT"]).WRITE_SCRIPT)
    last = await fill(redis, db, 1000)
    killed = flush_once(servers, PROGRESS_FLUSH_FAILPOINT="after_claim")
    assert killed.returncode == -signal.SIGKILL
    assert await db.fetchval("SELECT count(*) FROM engagements_lessonprogress") == 0
    assert 0 < await redis.zcard("progress:in_flight:lesson") <= 200  # the claimed batches, under lease

    await asyncio.sleep(LEASE_S + 0.1)
    survivor = flush_once(servers)
    assert survivor.returncode == 0, survivor.stderr
    assert json.loads(survivor.stdout)["written"] == 1000
    await assert_all_persisted(redis, db, last)


async def test_sigkill_after_commit_before_ack_loses_nothing_and_adds_no_event(
    servers: Servers, redis: Redis, db: asyncpg.Pool
) -> None:
    await seed(db, users=300, contents=1, duration_s=100)
    await redis.script_load(__import__("service.progress.buffer", fromlist=["WRITE_SCRIPT"]).WRITE_SCRIPT)
    last = {}
    for user_id in range(1, 301):
        await write(redis, "lesson", 1, user_id, 95.0)  # all complete (margin 10)
        last[(1, user_id)] = 95.0
    killed = flush_once(servers, PROGRESS_FLUSH_FAILPOINT="after_commit")
    assert killed.returncode == -signal.SIGKILL
    committed = await db.fetchval("SELECT count(*) FROM engagements_lessonprogress")
    assert 0 < committed < 300
    assert await redis.zcard("progress:in_flight:lesson") > 0  # committed but never acked

    await asyncio.sleep(LEASE_S + 0.1)
    assert flush_once(servers).returncode == 0
    await assert_all_persisted(redis, db, last)
    assert len(await events(db)) == 300  # the re-flushed batch did not add a second event


async def test_sigkill_at_random_moments_loses_nothing(servers: Servers, redis: Redis, db: asyncpg.Pool) -> None:
    from service.progress.buffer import WRITE_SCRIPT

    await redis.script_load(WRITE_SCRIPT)
    last = await fill(redis, db, 50_000)
    rng = random.Random()
    kills = 0
    # one batch of 100 at a time: the drain takes a few seconds, so every kill lands mid-drain
    slow = flusher_env(servers, PROGRESS_FLUSH_CONCURRENCY="1")
    for _ in range(4):
        process = subprocess.Popen([sys.executable, "-m", "service", "flush", "--once"], env=slow,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        time.sleep(rng.uniform(0.4, 1.0))  # start-up is ~0.3 s
        if process.poll() is None:
            process.kill()
            kills += 1
        process.wait()
        await asyncio.sleep(LEASE_S + 0.1)
    assert kills >= 1
    assert flush_once(servers).returncode == 0
    await assert_all_persisted(redis, db, last)


async def test_three_flushers_racing_keep_one_event_per_key_and_never_move_back(
    servers: Servers, redis: Redis, db: asyncpg.Pool
) -> None:
    await race_three_flushers(redis, db, flusher_env(servers))


async def race_three_flushers(redis: RedisClient, db: asyncpg.Pool, env: dict[str, str],
                              layout: KeyLayout = STANDALONE) -> None:  # fmt: skip
    from service.progress.buffer import WRITE_SCRIPT

    await redis.script_load(WRITE_SCRIPT)
    await seed(db, users=200, contents=10, duration_s=1000)  # 2000 keys
    keys = [(c, u) for c in range(1, 11) for u in range(1, 201)]
    crossing = set(keys[:500])
    env = env | {"PROGRESS_FLUSH_INTERVAL_SECONDS": "0.1", "PROGRESS_FLUSH_LEASE_SECONDS": "10"}
    flushers = [subprocess.Popen([sys.executable, "-m", "service", "flush"], env=env, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, text=True) for _ in range(3)]  # fmt: skip
    seen: dict[tuple[int, int], tuple[float, float]] = {}  # key -> (updated_at, position) last sampled
    moved_back = []

    async def sample() -> None:
        for row in await db.fetch("SELECT lesson_id, user_id, position, updated_at FROM engagements_lessonprogress"):
            key, now = (row["lesson_id"], row["user_id"]), (row["updated_at"].timestamp(), row["position"])
            if key in seen and now < seen[key]:
                moved_back.append((key, seen[key], now))
            seen[key] = now

    last: dict[tuple[int, int], float] = {}
    try:
        for round_ in range(12):
            async with redis.pipeline(transaction=False) as pipe:
                for key in keys:
                    if round_ == 6 and key in crossing:
                        position = 995.0  # 500 keys cross the margin in the same instant
                    elif round_ > 6 and key in crossing:
                        position = rng_position(round_, key, near_end=True)
                    else:
                        position = float(round_ * 10)
                    pipe.execute_command(*_args(*key, position, layout))
                    last[key] = position
                await pipe.execute()
            await sample()
            await asyncio.sleep(0.15)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if sum(await backlog(redis, layout)) == 0:
                break
            await sample()
            await asyncio.sleep(0.1)
    finally:
        for process in flushers:
            process.send_signal(signal.SIGTERM)
        codes = [process.wait(timeout=30) for process in flushers]
    assert codes == [0, 0, 0], [p.stderr.read() if p.stderr else "" for p in flushers]
    await sample()
    assert moved_back == []
    await assert_all_persisted(redis, db, last, layout)
    assert sorted(await events(db)) == sorted(("lesson", c, u) for c, u in crossing)


def rng_position(round_: int, key: tuple[int, int], *, near_end: bool) -> float:
    """After crossing: rewinds and near-end heartbeats again, which must not add events."""
    return 999.0 if (round_ + key[1]) % 2 else float(round_)
