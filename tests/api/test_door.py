"""The door: unknown content gets 404 and writes nothing; a flood from one user gets 429; both cheap."""

import asyncio
import contextlib
import time
from functools import partial

import asyncpg
import pytest
from redis.asyncio import Redis

from service import metrics
from service.api import catalog as catalog_module
from service.api.catalog import ContentCatalog, LookupsSaturated
from service.api.deferred import DEFER_INTERVAL_S, DeferredHeartbeats
from service.api.ratelimit import RateLimiter
from service.auth import make_token
from service.config import Settings
from service.progress.buffer import PositionWriter, decode_value
from service.progress.content import KIND_BY_PATH
from service.progress.flusher import Flusher
from service.progress.known_content import load_ids
from service.progress.sink import HeartbeatSink
from tests.helpers import MovedClock, auth, events, running_app, seed, wait_for

LESSON = KIND_BY_PATH["/engagements/progress/lesson"]


@pytest.fixture
def door(settings: Settings) -> Settings:
    return settings.model_copy(update={"content_catalog_enabled": True, "rate_limit_per_user_per_second": 2.0})


def unverified(content_type: str) -> float:
    return metrics.CATALOG_UNVERIFIED.labels(content_type)._value.get()


async def test_unknown_content_is_404_and_writes_nothing(
    door: Settings, db: asyncpg.Pool, redis: Redis, token: str
) -> None:
    await seed(db, users=7, contents=3)
    async with running_app(door) as (_, client):
        for path, field in (
            ("/engagements/progress/lesson", "lesson_id"),
            ("/audios/progress", "audio_id"),
            ("/meditations/progress", "meditation_id"),
            ("/lives/progress", "live_id"),
        ):
            response = await client.post(path, json={field: 4, "position": 1}, headers=auth(token))
            assert (response.status_code, response.json()) == (404, {"detail": f"unknown {field} 4"})
        assert await redis.keys("*") == []
        known = await client.post("/audios/progress", json={"audio_id": 3, "position": 1}, headers=auth(token))
        assert known.status_code == 201
    assert sorted(await redis.keys("*")) == ["progress:latest_position:audio:3:7", "progress:pending_flush:audio"]


async def test_content_published_a_moment_ago_is_accepted_at_once(
    door: Settings, db: asyncpg.Pool, redis: Redis, token: str
) -> None:
    await seed(db, users=7, contents=1)
    async with running_app(door) as (app, client):
        assert (
            app.api.state.services.catalog is not None and app.api.state.services.catalog.is_known(LESSON, 1) is True
        )  # in memory: no await
        await db.execute("INSERT INTO courses_lesson (id, title, duration) VALUES (50, 'new', 600)")
        response = await client.post(
            "/engagements/progress/lesson", json={"lesson_id": 50, "position": 3}, headers=auth(token)
        )
        assert response.status_code == 201
    assert await redis.smembers("progress:pending_flush:lesson") == {"50:7"}


async def test_content_created_after_a_404_is_accepted_within_a_second(
    door: Settings, db: asyncpg.Pool, redis: Redis, token: str
) -> None:
    """A cached "unknown" never outlives ~1 s, whatever CONTENT_CATALOG_CACHE_SECONDS (default: 10 s)."""
    await seed(db, users=7, contents=1)
    assert door.content_catalog_cache_seconds == Settings().content_catalog_cache_seconds > 1.2
    body = {"lesson_id": 5000, "position": 3}
    clock = MovedClock(time.monotonic)
    async with running_app(door, clock=clock) as (_, client):
        early = await client.post("/engagements/progress/lesson", json=body, headers=auth(token))
        assert early.status_code == 404
        await db.execute("INSERT INTO courses_lesson (id, title, duration) VALUES (5000, 'new', 600)")
        still = await client.post("/engagements/progress/lesson", json=body, headers=auth(token))
        assert still.status_code == 404  # the cached answer, for now
        clock.advance(1.2)
        late = await client.post("/engagements/progress/lesson", json=body, headers=auth(token))
        assert late.status_code == 201
    assert await redis.smembers("progress:pending_flush:lesson") == {"5000:7"}


@pytest.fixture
def queries(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The content ids the catalog looks up in Postgres, in order (each lookup still runs)."""
    looked_up: list[int] = []
    real_exists = catalog_module.exists

    async def counted(pool: asyncpg.Pool, kind: object, content_id: int, *, timeout_s: float) -> bool:
        looked_up.append(content_id)
        return await real_exists(pool, kind, content_id, timeout_s=timeout_s)  # type: ignore[arg-type]

    monkeypatch.setattr(catalog_module, "exists", counted)
    return looked_up


async def test_concurrent_requests_for_one_unseen_id_share_one_query(
    door: Settings, db: asyncpg.Pool, redis: Redis, token: str, queries: list[int]
) -> None:
    await seed(db, users=7, contents=1)
    async with running_app(door.model_copy(update={"rate_limit_per_user_per_second": 0})) as (_, client):
        answers = await asyncio.gather(
            *(
                client.post("/engagements/progress/lesson", json={"lesson_id": 999, "position": 1}, headers=auth(token))
                for _ in range(20)
            )
        )
        again = await client.post(
            "/engagements/progress/lesson", json={"lesson_id": 999, "position": 1}, headers=auth(token)
        )
    assert {a.status_code for a in answers} == {404} and again.status_code == 404
    assert queries == [999]  # one query for 21 requests: shared, then cached
    assert await redis.keys("*") == []


class _Proxy:
    """A TCP relay to Postgres that the test can cut: from the service's side, Postgres is down."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.server: asyncio.Server | None = None
        self.writers: list[asyncio.StreamWriter] = []

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self.writers += [writer, up_writer]

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    async def cut(self) -> None:
        assert self.server is not None
        self.server.close()
        for writer in self.writers:
            writer.transport.abort()
        await self.server.wait_closed()


async def test_postgres_down_an_unseen_id_is_accepted_and_counted(
    door: Settings, db: asyncpg.Pool, redis: Redis, token: str
) -> None:
    await seed(db, users=7, contents=2)
    dsn_port = int(door.database_url.rsplit(":", 1)[1].split("/")[0])
    proxy = _Proxy(dsn_port)
    port = await proxy.start()
    through_proxy = door.database_url.replace(f":{dsn_port}/", f":{port}/")
    async with running_app(door.model_copy(update={"database_url": through_proxy})) as (_, client):
        await proxy.cut()
        before = unverified("audio")
        unseen = await client.post("/audios/progress", json={"audio_id": 77, "position": 1}, headers=auth(token))
        known = await client.post("/audios/progress", json={"audio_id": 2, "position": 1}, headers=auth(token))
        assert (unseen.status_code, known.status_code) == (201, 201)
        assert unverified("audio") == before + 1
    assert await redis.smembers("progress:pending_flush:audio") == {"77:7", "2:7"}


async def test_the_snapshot_loads_in_pages_as_a_sorted_array(db: asyncpg.Pool) -> None:
    await db.execute(
        "INSERT INTO courses_lesson (id, title, duration) SELECT i * 3, 'c', 60 FROM generate_series(1, 50) i"
    )
    ids = await load_ids(db, LESSON, page_size=7)
    assert list(ids) == [i * 3 for i in range(1, 51)]
    assert ids.itemsize == 8  # 1M ids: 8 MB, not a set of Python ints


def test_the_apps_real_rhythm_never_reaches_the_default_limit() -> None:
    """60 s simulated: three contents at the 5 s cadence, switching, and a minute of retries at once."""
    defaults = Settings()
    now = [0.0]
    limiter = RateLimiter(
        per_second=defaults.rate_limit_per_user_per_second, burst=defaults.rate_limit_burst, clock=lambda: now[0]
    )
    refused = 0
    for tick in range(0, 60_000, 100):  # ms
        now[0] = tick / 1000
        sends = 0
        if tick % 5000 == 0:
            sends += 3  # three contents playing/paused at once (app + widget + a switch)
        if tick == 30_000:
            sends += 12 * 3  # back from a network blip: a minute of queued heartbeats for three contents
        for _ in range(sends):
            refused += limiter.allow(7) is not None
    assert refused == 0


def test_limiter_memory_is_bounded_and_idle_users_are_forgotten() -> None:
    now = [0.0]
    limiter = RateLimiter(per_second=2, burst=10, max_users=1000, clock=lambda: now[0])
    for user in range(1, 5001):
        assert limiter.allow(user) is None
        now[0] += 0.001
    assert limiter.tracked_users() <= 1000
    now[0] += 60  # everyone's bucket is full again: the same as no entry
    limiter.allow(1)
    for user in range(10_001, 11_001):
        limiter.allow(user)
    assert limiter.tracked_users() <= 1000


async def test_a_flood_from_one_user_gets_429_and_only_the_last_position_per_content_is_written_later(
    door: Settings, db: asyncpg.Pool, redis: Redis, token: str
) -> None:
    await seed(db, users=7, contents=50)
    flood = door.model_copy(update={"rate_limit_per_user_per_second": 0.01, "rate_limit_burst": 10})
    async with running_app(flood) as (_, client):
        answers = [
            await client.post("/lives/progress", json={"live_id": i, "position": position}, headers=auth(token))
            for position in (1, 2, 3)
            for i in range(1, 51)
        ]
    statuses = [a.status_code for a in answers]
    assert statuses == [201] * 10 + [429] * 140
    assert answers[-1].json() == {"detail": "too many heartbeats from this user, retry later"}
    assert 1 <= int(answers[-1].headers["retry-after"]) <= 100
    # each content's last position, written by the deferral (the last time at shutdown): one value each
    assert await redis.scard("progress:pending_flush:live") == 50
    keys = await redis.keys("progress:latest_position:*")
    values = {key: decode_value(await redis.get(key)).position for key in keys}
    assert values == {f"progress:latest_position:live:{i}:7": 3.0 for i in range(1, 51)}


def shed() -> float:
    return metrics.DEFERRED_SHED._value.get()


async def value_at(redis: Redis, key: str, position: float) -> bool:
    raw = await redis.get(key)
    return raw is not None and decode_value(raw).position == position


async def test_refused_made_up_ids_cost_one_lookup_each_at_the_drain_and_leave_no_key(
    door: Settings, db: asyncpg.Pool, redis: Redis, token: str, queries: list[int]
) -> None:
    """Nothing looked up on the request path; the drain asks once per id, the answer refuses the same ids from
    memory for the next second, and every position not kept is counted."""
    await seed(db, users=7, contents=1)
    before = shed()
    async with running_app(door.model_copy(update={"rate_limit_burst": 1, "rate_limit_per_user_per_second": 0.01})) as (
        _,
        client,
    ):

        async def refuse_all() -> list[int]:
            statuses = []
            for lesson_id in range(900, 920):
                response = await client.post(
                    "/engagements/progress/lesson", json={"lesson_id": lesson_id, "position": 1}, headers=auth(token)
                )
                statuses.append(response.status_code)
            return statuses

        first = await client.post(
            "/engagements/progress/lesson", json={"lesson_id": 1, "position": 1}, headers=auth(token)
        )
        assert first.status_code == 201
        assert await refuse_all() == [429] * 20
        assert queries == []  # none on the request path

        async def all_shed() -> bool:
            return shed() == before + 20

        await wait_for(all_shed, timeout_s=2.0)
        assert sorted(queries) == list(range(900, 920))  # at the drain, once each
        assert await refuse_all() == [429] * 20  # the same ids again, within the answers' second
        assert shed() == before + 40 and len(queries) == 20
    assert sorted(await redis.keys("*")) == ["progress:latest_position:lesson:1:7", "progress:pending_flush:lesson"]


async def test_a_flood_of_made_up_ids_costs_at_most_the_bound_of_lookups_per_drain(
    db: asyncpg.Pool, redis: Redis, queries: list[int]
) -> None:
    await seed(db, users=1, contents=1)
    catalog = ContentCatalog(db, lookup_timeout_s=1, answer_ttl_s=10, max_answers=1000, max_lookups=64)
    await catalog.refresh()
    deferred = DeferredHeartbeats(max_unverified_ids=8)
    before = shed()
    for user_id in range(1, 11):  # ten users, ten made-up ids each: 100 ids memory does not know
        for content_id in range(1000 + 10 * user_id, 1010 + 10 * user_id):
            deferred.keep(LESSON, content_id=content_id, user_id=user_id, position=5, received_ms=1, known=None)
    deferred.keep(LESSON, content_id=1, user_id=1, position=5, received_ms=1, known=True)  # real: kept
    deferred.keep(LESSON, content_id=1010, user_id=2, position=5, received_ms=1, known=None)  # an id kept already
    assert (len(deferred), shed()) == (10, before + 92)
    sink = HeartbeatSink(PositionWriter(redis), None, redis_retry_s=0.1, direct_timeout_s=0.5)
    assert await deferred.drain(sink, catalog) is True
    assert sorted(queries) == list(range(1010, 1018))  # one lookup per id kept, the shared one once
    assert shed() == before + 92 + 9
    assert await redis.keys("progress:latest_position:*") == ["progress:latest_position:lesson:1:1"]


async def test_an_id_the_catalog_cannot_check_now_waits_for_the_next_drain(db: asyncpg.Pool, redis: Redis) -> None:
    await seed(db, users=7, contents=1)
    await db.execute("INSERT INTO courses_lesson (id, title, duration) VALUES (50, 'new', 600)")
    deferred = DeferredHeartbeats()
    deferred.keep(LESSON, content_id=50, user_id=7, position=595, received_ms=time.monotonic() * 1000, known=None)
    sink = HeartbeatSink(PositionWriter(redis), None, redis_retry_s=0.1, direct_timeout_s=0.5)
    saturated = ContentCatalog(db, lookup_timeout_s=1, answer_ttl_s=10, max_answers=10, max_lookups=0)
    assert await deferred.drain(sink, saturated) is False and len(deferred) == 1  # kept, not shed
    assert await redis.keys("*") == []
    catalog = ContentCatalog(db, lookup_timeout_s=1, answer_ttl_s=10, max_answers=10, max_lookups=64)
    assert await deferred.drain(sink, catalog) is True and len(deferred) == 0
    assert decode_value(await redis.get("progress:latest_position:lesson:50:7")).position == 595.0


@pytest.mark.regression
async def test_a_refused_final_position_of_content_created_after_start_is_written_and_completes(
    door: Settings, db: asyncpg.Pool, redis: Redis, token: str, queries: list[int]
) -> None:
    """Found by an outside attack (case A): lesson 50, created after the pod started, refused at 100, 200 and
    595 with the bucket spent: no value after 1.5 s, a 404, the completion lost, and nothing counted."""
    await seed(db, users=8, contents=1, duration_s=600)
    other = make_token(door, 8)
    async with running_app(door.model_copy(update={"rate_limit_burst": 1, "rate_limit_per_user_per_second": 0.01})) as (
        _,
        client,
    ):
        await db.execute("INSERT INTO courses_lesson (id, title, duration) VALUES (50, 'new', 600)")
        for user in (token, other):
            spend = await client.post(
                "/engagements/progress/lesson", json={"lesson_id": 1, "position": 1}, headers=auth(user)
            )
            assert spend.status_code == 201
        for position in (100, 200, 595):
            for user in (token, other):
                response = await client.post(
                    "/engagements/progress/lesson", json={"lesson_id": 50, "position": position}, headers=auth(user)
                )
                assert response.status_code == 429
        await wait_for(partial(value_at, redis, "progress:latest_position:lesson:50:7", 595.0), timeout_s=1.5)
        answer = await client.get("/progress/lesson/50", headers=auth(token))
        assert (answer.status_code, answer.json()["position"]) == (200, 595.0)
        assert answer.json()["completed_at"] is not None
    assert queries == [50]  # one lookup for both users' refusals
    assert decode_value(await redis.get("progress:latest_position:lesson:50:8")).position == 595.0
    assert (await Flusher.from_settings(door, redis, db).flush_cycle()).completions == 2
    assert sorted(await events(db)) == [("lesson", 50, 7), ("lesson", 50, 8)]


@pytest.mark.regression
async def test_a_pod_started_with_postgres_unreachable_still_writes_the_refused_final_position(
    door: Settings, db: asyncpg.Pool, redis: Redis, token: str
) -> None:
    """Found by an outside attack (case B): no catalog snapshot, so memory knew no content: the stored position
    stayed at 20 after refused heartbeats at 30, 40 and 595. Postgres cannot be asked: accepted, as the door does."""
    await seed(db, users=7, contents=1, duration_s=600)
    dsn_port = int(door.database_url.rsplit(":", 1)[1].split("/")[0])
    proxy = _Proxy(dsn_port)
    port = await proxy.start()
    await proxy.cut()  # unreachable before the pod starts: no snapshot
    unreachable = door.database_url.replace(f":{dsn_port}/", f":{port}/")
    limited = {"database_url": unreachable, "rate_limit_burst": 1, "rate_limit_per_user_per_second": 0.01}
    async with running_app(door.model_copy(update=limited)) as (app, client):
        assert app.api.state.services.catalog is not None and app.api.state.services.catalog.snapshot_bytes() == 0
        statuses = []
        for position in (20, 30, 40, 595):
            response = await client.post(
                "/engagements/progress/lesson", json={"lesson_id": 1, "position": position}, headers=auth(token)
            )
            statuses.append(response.status_code)
        assert statuses == [201, 429, 429, 429]
        await wait_for(partial(value_at, redis, "progress:latest_position:lesson:1:7", 595.0), timeout_s=1.5)
    assert (await Flusher.from_settings(door, redis, db).flush_cycle()).completions == 1
    assert await db.fetchval("SELECT position FROM engagements_lessonprogress WHERE user_id = 7") == 595.0


async def test_refused_positions_neither_store_took_are_kept_for_the_next_drain(redis: Redis) -> None:
    unreachable = Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.2)
    deferred = DeferredHeartbeats()
    deferred.keep(LESSON, content_id=1, user_id=7, position=590, received_ms=time.monotonic() * 1000)
    deferred.keep(LESSON, content_id=1, user_id=7, position=5, received_ms=time.monotonic() * 1000)
    down = HeartbeatSink(PositionWriter(unreachable), None, redis_retry_s=0.1, direct_timeout_s=0.5)
    assert await deferred.drain(down) is False and len(deferred) == 1
    await unreachable.aclose()
    up = HeartbeatSink(PositionWriter(redis), None, redis_retry_s=0.1, direct_timeout_s=0.5)
    assert await deferred.drain(up) is True and len(deferred) == 0
    stored = decode_value(await redis.get("progress:latest_position:lesson:1:7"))
    assert (stored.position, stored.peak) == (5.0, 590.0)


def test_what_the_deferral_keeps_is_bounded_and_past_the_bounds_counted() -> None:
    deferred = DeferredHeartbeats(max_entries=5, max_contents_per_user=3)
    shed = metrics.DEFERRED_SHED._value.get()
    for content_id in range(1, 5):  # a fourth content of one user is one too many
        for position in range(100):  # one entry per content, however many refusals
            deferred.keep(LESSON, content_id=content_id, user_id=1, position=position, received_ms=position)
    assert (len(deferred), metrics.DEFERRED_SHED._value.get()) == (3, shed + 100)
    for user_id in range(2, 5):
        deferred.keep(LESSON, content_id=1, user_id=user_id, position=1, received_ms=1)
    assert (len(deferred), metrics.DEFERRED_SHED._value.get()) == (5, shed + 101)


async def evalsha_calls(redis: Redis) -> int:
    return int((await redis.info("commandstats")).get("cmdstat_evalsha", {}).get("calls", 0))


async def test_a_ten_minute_offline_replay_stores_its_last_position_and_completes_once(
    door: Settings, db: asyncpg.Pool, redis: Redis, token: str
) -> None:
    """120 queued heartbeats (one per 5 s offline) sent at once, default limit: many get 429, but the last
    position lands within about a second, and its completion once."""
    await seed(db, users=7, contents=1, duration_s=600)
    defaults = Settings()
    assert (door.rate_limit_per_user_per_second, door.rate_limit_burst) == (
        defaults.rate_limit_per_user_per_second,
        defaults.rate_limit_burst,
    )
    async with running_app(door) as (_, client):
        statuses = []
        for i in range(1, 121):
            response = await client.post(
                "/engagements/progress/lesson", json={"lesson_id": 1, "position": 5 * i}, headers=auth(token)
            )
            statuses.append(response.status_code)
        assert statuses.count(201) >= 60 and statuses[-1] == 429  # the limit still answers

        async def last_position_stored() -> bool:
            raw = await redis.get("progress:latest_position:lesson:1:7")
            return raw is not None and decode_value(raw).position == 600.0

        await wait_for(last_position_stored, timeout_s=1.5)
    flusher = Flusher.from_settings(door, redis, db)
    assert (await flusher.flush_cycle()).completions == 1
    assert await db.fetchval("SELECT position FROM engagements_lessonprogress WHERE user_id = 7") == 600.0
    assert await events(db) == [("lesson", 1, 7)]


async def test_a_refused_heartbeat_at_the_end_still_completes_after_a_restart(
    door: Settings, db: asyncpg.Pool, redis: Redis, token: str
) -> None:
    """Refused: the end (595 of 600), then a restart at 3: the stored position is 3 and the content completes."""
    await seed(db, users=7, contents=1, duration_s=600)
    async with running_app(door.model_copy(update={"rate_limit_burst": 1, "rate_limit_per_user_per_second": 0.01})) as (
        _,
        client,
    ):
        for position, status in ((100, 201), (595, 429), (3, 429)):
            response = await client.post(
                "/engagements/progress/lesson", json={"lesson_id": 1, "position": position}, headers=auth(token)
            )
            assert response.status_code == status
    stored = decode_value(await redis.get("progress:latest_position:lesson:1:7"))
    assert (stored.position, stored.peak) == (3.0, 595.0)
    assert (await Flusher.from_settings(door, redis, db).flush_cycle()).completions == 1
    assert await events(db) == [("lesson", 1, 7)]


async def test_a_flooding_user_costs_a_bounded_number_of_redis_writes(
    door: Settings, db: asyncpg.Pool, redis: Redis, token: str
) -> None:
    await seed(db, users=7, contents=1)
    settings = door.model_copy(update={"rate_limit_per_user_per_second": 0.01, "rate_limit_burst": 5})
    async with running_app(settings) as (_, client):
        before = await evalsha_calls(redis)
        started = time.monotonic()
        last = 0
        while time.monotonic() - started < 1.5:  # ~1.5 s of flood: hundreds of heartbeats
            last += 1
            await client.post(
                "/engagements/progress/lesson", json={"lesson_id": 1, "position": last}, headers=auth(token)
            )
        elapsed = time.monotonic() - started
    assert last > 100
    writes = await evalsha_calls(redis) - before
    # the burst of 5, then at most one write per deferral interval (no peak above the latest), and the last
    assert writes <= 5 + elapsed / DEFER_INTERVAL_S + 2
    assert decode_value(await redis.get("progress:latest_position:lesson:1:7")).position == last


async def test_a_refresh_replaces_the_snapshot(door: Settings, db: asyncpg.Pool, redis: Redis) -> None:
    await seed(db, users=1, contents=2)
    async with running_app(door) as (app, _):
        assert app.api.state.services.catalog is not None
        await db.execute("INSERT INTO courses_lesson (id, title, duration) VALUES (70, 'new', 600)")
        await db.execute("DELETE FROM courses_lesson WHERE id = 2")
        assert app.api.state.services.catalog.is_known(LESSON, 2) is True  # the snapshot of start-up
        assert await app.api.state.services.catalog.try_refresh()
        assert app.api.state.services.catalog.is_known(LESSON, 70) is True  # in memory now: no lookup
        assert app.api.state.services.catalog.snapshot_bytes() == 8 * (
            2 + 2 * 3
        )  # lessons 1 and 70, two ids of three other kinds
        missing = app.api.state.services.catalog.is_known(LESSON, 2)
        assert not isinstance(missing, bool) and await missing is False


async def test_lookup_answers_expire_and_lookups_are_bounded(db: asyncpg.Pool) -> None:
    await seed(db, users=1, contents=1)
    now = [0.0]
    catalog = ContentCatalog(
        db, lookup_timeout_s=1, answer_ttl_s=10, max_answers=2, max_lookups=64, clock=lambda: now[0]
    )
    assert await catalog.is_known(LESSON, 5) is False  # type: ignore[misc]
    assert catalog.is_known(LESSON, 5) is False  # the cached answer: a bool, no query
    await db.execute("INSERT INTO courses_lesson (id, title, duration) VALUES (5, 'late', 600)")
    now[0] = 11.0  # past the answer's life: asked again
    assert await catalog.is_known(LESSON, 5) is True  # type: ignore[misc]
    for content_id in (6, 7, 8):
        await catalog.is_known(LESSON, content_id)  # type: ignore[misc]
    assert len(catalog._answers) == 2  # bounded: the oldest answers go first
    saturated = ContentCatalog(db, lookup_timeout_s=1, answer_ttl_s=10, max_answers=2, max_lookups=0)
    with pytest.raises(LookupsSaturated):
        await saturated.is_known(LESSON, 9)  # type: ignore[misc]


async def test_the_sync_and_the_reads_pass_the_same_door(
    door: Settings, db: asyncpg.Pool, redis: Redis, token: str
) -> None:
    """A sync is one call against the user's limit and its items count against their own cap; a read is
    one call. A refused request writes nothing."""
    await seed(db, users=7, contents=500)
    settings = door.model_copy(
        update={
            "rate_limit_burst": 3,
            "rate_limit_per_user_per_second": 0.01,
            "sync_items_burst": 600,
            "sync_items_per_user_per_second": 0.01,
        }
    )
    listened_at = "2026-11-30T08:00:00+00:00"

    def items(first: int, count: int) -> dict[str, object]:
        return {
            "items": [
                {"content_type": "lesson", "content_id": c, "position": 5.0, "listened_at": listened_at}
                for c in range(first, first + count)
            ]
        }

    async with running_app(settings) as (_, client):
        first = await client.post("/progress/sync", json=items(1, 500), headers=auth(token))
        assert first.status_code == 200 and len(first.json()["items"]) == 500
        # 500 of the 600 items are spent: a second full request is refused for its items, writing nothing
        keys_before = len(await redis.keys("*"))
        refused = await client.post("/progress/sync", json=items(1, 200), headers=auth(token))
        assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
        assert len(await redis.keys("*")) == keys_before
        # each request was one call, charged before its body was read: one call is left, for a read
        assert (await client.get("/progress/lesson/1", headers=auth(token))).status_code == 200
        limited = await client.get("/progress/lesson/1", headers=auth(token))
        assert limited.status_code == 429 and "retry-after" in limited.headers
        # a sync past the calls is refused before its body is read (valid or not), writing nothing
        for body in (items(1, 1), {"items": "not even a list"}):
            assert (await client.post("/progress/sync", json=body, headers=auth(token))).status_code == 429
        assert len(await redis.keys("*")) == keys_before
        # the reads and the sync have their own bucket: the user's heartbeats still go through
        heartbeat = await client.post(
            "/engagements/progress/lesson", json={"lesson_id": 1, "position": 9}, headers=auth(token)
        )
        assert heartbeat.status_code == 201
        doubled = await client.get(
            "/progress/lesson/1", headers=[("authorization", f"Bearer {token}"), ("authorization", f"Bearer {token}")]
        )
        assert doubled.status_code == 401
