"""Flusher processes killed with SIGKILL (three flushers racing on the same keys: tests/progress/test_cluster.py, on
the cluster's layout)."""

import asyncio
import json
import random
import signal
import subprocess
import sys

import asyncpg
import pytest
from redis.asyncio import Redis

from service.progress.flush.leases import Leases
from service.progress.keys import STANDALONE
from tests.helpers import (
    FLUSH_LEASE_S,
    Servers,
    assert_all_persisted,
    events,
    fill,
    flush_once,
    flusher_env,
    leases_ended,
    seed,
    wait_for,
    write,
)

pytestmark = pytest.mark.slow  # flusher processes killed

# the lease of a flusher that is about to die at a checkpoint: its batches are free again as soon as it is gone
DEAD_LEASE_S = "0.3"


async def test_sigkill_after_claim_loses_nothing(servers: Servers, redis: Redis, db: asyncpg.Pool) -> None:
    await redis.script_load(__import__("service.progress.ingest.buffer", fromlist=["WRITE_SCRIPT"]).WRITE_SCRIPT)
    last = await fill(redis, db, 1000)
    killed = flush_once(servers, die_at="flush.after_claim", PROGRESS_FLUSH_LEASE_SECONDS=DEAD_LEASE_S)
    assert killed.returncode == -signal.SIGKILL
    assert await db.fetchval("SELECT count(*) FROM engagements_lessonprogress") == 0
    assert 0 < await redis.zcard("progress:in_flight:lesson") <= 200  # the claimed batches, under lease

    held = await redis.zcard("progress:in_flight:lesson")
    await wait_for(lambda: leases_ended(redis))
    survivor = flush_once(servers)
    assert survivor.returncode == 0, survivor.stderr
    summary = json.loads(survivor.stdout)
    assert (summary["written"], summary["requeued"]) == (1000, held)  # the dead flusher's batches, counted
    assert f"requeued {held} entries whose lease expired" in survivor.stderr
    await assert_all_persisted(redis, db, last)


async def test_no_setting_of_a_pod_makes_it_kill_itself(servers: Servers, redis: Redis, db: asyncpg.Pool) -> None:
    """The crash tests' checkpoints are installed by their own entry point (tests/crash.py), never by the
    environment: the variables the previous releases read are ignored."""
    await redis.script_load(__import__("service.progress.ingest.buffer", fromlist=["WRITE_SCRIPT"]).WRITE_SCRIPT)
    last = await fill(redis, db, 300)
    run = flush_once(servers, PROGRESS_FLUSH_FAILPOINT="after_claim", PROGRESS_RELAY_FAILPOINT="after_claim")
    assert run.returncode == 0, run.stderr
    await assert_all_persisted(redis, db, last)


async def test_sigkill_after_commit_before_ack_loses_nothing_and_adds_no_event(
    servers: Servers, redis: Redis, db: asyncpg.Pool
) -> None:
    await seed(db, users=300, contents=1, duration_s=100)
    await redis.script_load(__import__("service.progress.ingest.buffer", fromlist=["WRITE_SCRIPT"]).WRITE_SCRIPT)
    last = {}
    for user_id in range(1, 301):
        await write(redis, "lesson", 1, user_id, 95.0)  # all complete (margin 10)
        last[(1, user_id)] = 95.0
    killed = flush_once(servers, die_at="flush.after_commit", PROGRESS_FLUSH_LEASE_SECONDS=DEAD_LEASE_S)
    assert killed.returncode == -signal.SIGKILL
    committed = await db.fetchval("SELECT count(*) FROM engagements_lessonprogress")
    assert 0 < committed < 300
    assert await redis.zcard("progress:in_flight:lesson") > 0  # committed but never acked

    await wait_for(lambda: leases_ended(redis))
    assert flush_once(servers).returncode == 0
    await assert_all_persisted(redis, db, last)
    assert len(await events(db)) == 300  # the re-flushed batch did not add a second event


async def test_sigkill_at_random_moments_loses_nothing(servers: Servers, redis: Redis, db: asyncpg.Pool) -> None:
    from service.progress.ingest.buffer import WRITE_SCRIPT

    await redis.script_load(WRITE_SCRIPT)
    last = await fill(redis, db, 30_000)
    rng = random.Random()
    kills = 0
    # one batch of 100 at a time: the drain of 300 batches takes seconds, so every kill lands mid-drain
    slow = flusher_env(servers, PROGRESS_FLUSH_CONCURRENCY="1")
    for _ in range(4):
        process = subprocess.Popen(
            [sys.executable, "-m", "service", "flush", "--once"],
            env=slow,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

        async def draining(process: subprocess.Popen[bytes] = process) -> bool:
            return process.poll() is not None or await redis.zcard("progress:in_flight:lesson") > 0

        # from its first claim, not from its start (~0.3 s on a quiet machine, seconds on a busy one, when the
        # kill came before any claim): every kill lands mid-drain
        await wait_for(draining, timeout_s=60)
        await asyncio.sleep(rng.uniform(0.1, 0.7))
        if process.poll() is None:
            process.kill()
            kills += 1
        process.wait()
        # the dead flusher's batches are free to claim again once its lease has passed: time moved by the lease
        # (FLUSH_LEASE_S), not waited out, through the requeue every flusher runs
        for shard in STANDALONE.shards_to_flush("lesson"):
            await Leases(redis).requeue_expired(shard, ahead_ms=int(FLUSH_LEASE_S * 1000) + 100)
        assert await leases_ended(redis)
    assert kills >= 1
    assert flush_once(servers).returncode == 0
    await assert_all_persisted(redis, db, last)
