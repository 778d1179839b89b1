"""No pod's clock orders, dates or leases anything: pods and flushers run under Debian's libfaketime.

A pod's wall clock is shifted with LD_PRELOAD of libfaketime (FAKETIME=+30s, -30s, +1h; its monotonic clock
left alone, as a host whose NTP is wrong still counts seconds right). Redis stamps the heartbeats and scores
the leases, Postgres dates the degraded writes: every heartbeat is answered 201, the last one sent stands
across pods, nothing is dated in the future, and no pod takes another's valid lease.
"""

import asyncio
import signal
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from functools import partial
from itertools import pairwise
from pathlib import Path

import asyncpg
import httpx
import pytest
from redis.asyncio import Redis

from service.auth import make_token
from service.config import Settings
from service.progress.flush.flusher import Flusher
from service.progress.flush.leases import Leases
from service.progress.ingest.buffer import WRITE_SCRIPT, decode_value, write_args
from service.progress.keys import STANDALONE
from tests import debian
from tests.faults.load import DURATION_S
from tests.faults.suite import SECRET, Cluster
from tests.helpers import Servers, auth, fill, flush_once, sync_item, wait_for, write

pytestmark = pytest.mark.slow  # pods and flushers in processes of their own

END = DURATION_S - 5  # past the completion threshold (duration - 10 s)


@pytest.fixture(scope="module")
def faketime() -> Path:
    try:
        return debian.program(debian.LIBFAKETIME, "libfaketime.so.1")
    except debian.Unavailable as exc:
        pytest.fail(f"no libfaketime for the tests: {exc} (or `apt-get install -y libfaketime`)")


def skewed(faketime: Path, offset: str) -> dict[str, str]:
    """The environment of a process whose wall clock is `offset` away (libfaketime's syntax: +30s, -30s, +1h)."""
    return {"LD_PRELOAD": str(faketime), "FAKETIME": offset, "FAKETIME_DONT_FAKE_MONOTONIC": "1"}


@asynccontextmanager
async def fleet(
    base: Path, pod_env: Sequence[Mapping[str, str]], *, users: int, contents: int
) -> AsyncIterator[Cluster]:
    """`serve` pods on a Valkey and a Postgres of their own, pod i with `pod_env[i]`; flush every second. No load
    balancer: no drain either (its default 5 s would be waited out at every stop; the drain has its own tests)."""
    cluster = Cluster(base, processes=len(pod_env), env={"SHUTDOWN_DRAIN_SECONDS": "0"}, pod_env=pod_env)
    try:
        await asyncio.to_thread(partial(cluster.start, users=users, contents=contents))
        yield cluster
    finally:
        await asyncio.to_thread(cluster.stop)


def client_of(cluster: Cluster, pod: int) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=f"http://127.0.0.1:{cluster.ports[pod]}", timeout=10)


def tokens(users: int) -> dict[int, str]:
    settings = Settings(jwt_secret=SECRET)
    return {user_id: make_token(settings, user_id) for user_id in range(1, users + 1)}


async def heartbeat(client: httpx.AsyncClient, token: str, lesson: int, position: float) -> int:
    answer = await client.post(
        "/engagements/progress/lesson", json={"lesson_id": lesson, "position": position}, headers=auth(token)
    )
    return answer.status_code


async def dated_in_the_future(db: asyncpg.Pool | asyncpg.Connection) -> list[str]:
    """Every row and event dated after Postgres's clock, named."""
    rows = await db.fetch(
        """
        SELECT 'row ' || lesson_id || ':' || user_id FROM engagements_lessonprogress
        WHERE updated_at > clock_timestamp() OR completed_at > clock_timestamp() OR created_at > clock_timestamp()
        UNION ALL
        SELECT 'row audio ' || audio_id || ':' || user_id FROM audios_audioprogress
        WHERE updated_at > clock_timestamp() OR completed_at > clock_timestamp()
        UNION ALL
        SELECT 'event ' || content_type || ' ' || content_id || ':' || user_id FROM progress_completion_event
        WHERE completed_at > clock_timestamp()
        """
    )
    return [row[0] for row in rows]


async def test_pods_30_s_apart_either_way_and_one_an_hour_ahead_answer_201_and_the_last_heartbeat_sent_stands(
    tmp_path: Path, faketime: Path
) -> None:
    """Each user's heartbeats alternate between a pod 30 s ahead, one 30 s behind and one 1 h ahead, all
    flushing: every one is answered 201, the row ends at the last position sent (half of them rewound after
    reaching the end, so the last is not the furthest), and no row, completion or event is dated in the future.
    The pod an hour ahead refuses a sync item heard 30 min from now (in the future by Redis's clock)."""
    users, lessons, rounds = 30, 2, 6
    pods = [skewed(faketime, "+30s"), skewed(faketime, "-30s"), skewed(faketime, "+1h")]
    async with fleet(tmp_path, pods, users=users, contents=lessons) as cluster:
        clients = [client_of(cluster, pod) for pod in range(len(pods))]
        token = tokens(users)
        last: dict[tuple[int, int], float] = {}

        async def listen(user_id: int, lesson: int) -> list[int]:
            positions = [100.0 * (r + 1) for r in range(rounds - 2)] + [END]
            positions.append(50.0 if user_id % 2 else END + 1)  # a rewind after the end: the last is not the max
            statuses = []
            for step, position in enumerate(positions):  # one after the other, each on the next pod
                client = clients[(user_id + lesson + step) % len(clients)]
                statuses.append(await heartbeat(client, token[user_id], lesson, position))
            last[(lesson, user_id)] = positions[-1]
            return statuses

        try:
            answers = await asyncio.gather(
                *(listen(user_id, lesson) for user_id in range(1, users + 1) for lesson in range(1, lessons + 1))
            )
            assert [status for statuses in answers for status in statuses] == [201] * (users * lessons * rounds)
            ahead = datetime.now(UTC) + timedelta(minutes=30)
            synced = await clients[2].post(
                "/progress/sync",
                json={"items": [sync_item(1, 7.0, ahead), sync_item(2, 9.0, datetime.now(UTC) - timedelta(seconds=5))]},
                headers=auth(token[1]),
            )
            assert synced.status_code == 200, synced.text
            (refused, applied) = synced.json()["items"]
            assert not refused["applied"] and "future" in refused["reason"]
            assert applied == {"applied": True, "reason": None}
        finally:
            for client in clients:
                await client.aclose()
        db = await asyncpg.connect(cluster.database_url)
        try:

            async def flushed() -> bool:
                rows = await db.fetch("SELECT lesson_id, user_id, position FROM engagements_lessonprogress")
                synced_row = await db.fetchval("SELECT count(*) FROM audios_audioprogress WHERE audio_id = 2")
                return synced_row == 1 and {(row[0], row[1]): row[2] for row in rows} == last

            await wait_for(flushed, timeout_s=30)
            assert await dated_in_the_future(db) == []
            completed = await db.fetchval(
                "SELECT count(*) FROM engagements_lessonprogress WHERE completed_at IS NOT NULL"
            )
            events = await db.fetchval("SELECT count(*) FROM progress_completion_event")
            assert (completed, events) == (users * lessons, users * lessons)
            assert await db.fetchval("SELECT count(*) FROM audios_audioprogress WHERE audio_id = 1") == 0
        finally:
            await db.close()


@pytest.mark.regression
async def test_a_flusher_an_hour_ahead_takes_no_valid_lease_of_another(
    servers: Servers, redis: Redis, db: asyncpg.Pool, faketime: Path
) -> None:
    """Found by an attack: a pod 300 s ahead requeued and rewrote another pod's leased batches (500 of 500
    entries stolen): it expired leases by its own clock. A whole cycle of a flusher 1 h ahead, while a flusher
    with the right clock holds 500 entries under a 60 s lease: they stay in flight, its lease untouched."""
    await redis.script_load(WRITE_SCRIPT)
    await fill(redis, db, 500)
    (shard,) = STANDALONE.shards_of("lesson")
    leases = Leases(redis)
    claim = await leases.claim_batch(shard, count=500, lease_ms=60_000)
    assert len(claim.entries) == 500
    held = await redis.zrange(shard.in_flight_key, 0, -1, withscores=True)
    await write(redis, "audio", 1, 1, 42.0)  # the cycle's own work: shows it ran

    run = await asyncio.to_thread(flush_once, servers, **skewed(faketime, "+1h"))

    assert run.returncode == 0, run.stderr
    assert await db.fetchval("SELECT position FROM audios_audioprogress WHERE user_id = 1") == 42.0
    assert await redis.zrange(shard.in_flight_key, 0, -1, withscores=True) == held
    assert await db.fetchval("SELECT count(*) FROM engagements_lessonprogress") == 0
    assert await leases.ack(claim) == 500  # still ours: no other flusher claimed any of them


@pytest.mark.regression
async def test_a_flusher_an_hour_ahead_killed_after_its_claim_holds_the_batch_for_its_lease_only(
    servers: Servers, settings: Settings, redis: Redis, db: asyncpg.Pool, faketime: Path
) -> None:
    """Found by an attack: a pod 1 h ahead killed after its claim held the batch for an hour (500 acknowledged
    positions not in Postgres after 15 flush intervals): its lease was scored by its own clock. Killed at
    flush.after_claim with a 1 s lease, its entries are taken back by a flusher with the right clock once that
    second has passed."""
    await redis.script_load(WRITE_SCRIPT)
    last = await fill(redis, db, 500)
    (shard,) = STANDALONE.shards_of("lesson")

    killed = await asyncio.to_thread(flush_once, servers, die_at="flush.after_claim", **skewed(faketime, "+1h"))

    assert killed.returncode == -signal.SIGKILL, killed.stderr
    seconds, micros = await redis.time()
    now_ms = seconds * 1000 + micros / 1000
    leases = await redis.zrange(shard.in_flight_key, 0, -1, withscores=True)
    assert leases, "the killed flusher claimed nothing"
    assert max(score for _, score in leases) - now_ms <= 1000  # its lease ends by Redis's clock, 1 s after the claim
    flusher = Flusher(settings.flush, redis, db)

    async def all_written() -> bool:
        await flusher.flush_cycle()
        return await db.fetchval("SELECT count(*) FROM engagements_lessonprogress") == len(last)

    await wait_for(all_written, timeout_s=15)  # 1 s of lease: within a few cycles, not an hour
    rows = await db.fetch("SELECT lesson_id, user_id, position FROM engagements_lessonprogress")
    assert {(row[0], row[1]): row[2] for row in rows} == last


@pytest.mark.regression
async def test_a_pod_an_hour_ahead_started_while_redis_is_down_dates_nothing_in_the_future(
    tmp_path: Path, faketime: Path
) -> None:
    """Found by an attack: a pod 1 h ahead, started while Redis was down, wrote rows dated +1 h in degraded mode
    (its clock check could not ask Redis); every later heartbeat of those keys was then dropped by the monotonic
    upsert (100 of 100 users' later positions lost) and the completions were dated +1 h. A degraded write is
    dated by Postgres: the later heartbeats, through a pod with the right clock once Redis is back, stand."""
    users = 100
    async with fleet(tmp_path, [{}, {}], users=users, contents=1) as cluster:
        token = tokens(users)
        cluster.kill_service(1)
        cluster.redis.stop()
        cluster.pod_env[1] = skewed(faketime, "+1h")
        cluster.start_service(1)  # an hour ahead, started while Redis is down
        await asyncio.to_thread(cluster.wait_ready, 1)  # ready: degraded mode
        async with client_of(cluster, 1) as ahead:
            statuses = await asyncio.gather(*(heartbeat(ahead, token[u], 1, END) for u in range(1, users + 1)))
        assert statuses == [201] * users
        db = await asyncpg.connect(cluster.database_url)
        try:
            assert await db.fetchval("SELECT count(*) FROM engagements_lessonprogress") == users  # written directly
            cluster.redis.start()
            await asyncio.to_thread(cluster.wait_ready, 0)
            async with client_of(cluster, 0) as right:

                async def normal_mode() -> bool:
                    return (await right.get("/health/ready")).json()["mode"] == "normal"

                await wait_for(normal_mode, timeout_s=10)
                statuses = await asyncio.gather(*(heartbeat(right, token[u], 1, 500.0) for u in range(1, users + 1)))
            assert statuses == [201] * users

            async def later_positions_stand() -> bool:
                return (
                    await db.fetchval("SELECT count(*) FROM engagements_lessonprogress WHERE position = 500") == users
                )

            await wait_for(later_positions_stand, timeout_s=15)  # 15 flush intervals
            assert await dated_in_the_future(db) == []
            assert await db.fetchval("SELECT count(*) FROM progress_completion_event") == users
        finally:
            await db.close()


async def test_two_heartbeats_of_a_key_never_tie_and_the_last_redis_receives_stands(redis: Redis) -> None:
    """Redis stamps each heartbeat after the stored one, even within one microsecond: 200 writes of one key one
    after the other, each a later time than the one before; then 1,000 in one pipeline, the last one standing."""
    await redis.script_load(WRITE_SCRIPT)
    times = []
    for position in range(200):
        times.append(await write(redis, "lesson", 1, 1, float(position)))
    assert all(a < b for a, b in pairwise(times))
    async with redis.pipeline(transaction=False) as pipe:
        for position in range(1000):
            pipe.execute_command(*write_args("lesson", 1, 1, float(position)))
        await pipe.execute()
    stored = decode_value(await redis.get("progress:latest_position:lesson:1:1"))
    assert (stored.position, stored.peak) == (999.0, 999.0)
    assert stored.received_ms > times[-1]
