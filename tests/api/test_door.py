"""The door: unknown content gets 404 and writes nothing, cheaply; a flood from one user is answered like any
heartbeats and grows nothing (no per-user limit in the service: request rates are the gateway's)."""

import asyncio
import contextlib
import time
from collections import defaultdict
from pathlib import Path

import asyncpg
import httpx
import pytest
from redis.asyncio import Redis

from service import metrics
from service.api import catalog as catalog_module
from service.api.catalog import ANSWER_TTL_S, ContentCatalog, LookupsSaturated, load_ids
from service.auth import make_token
from service.config import Settings
from service.dev import embedded
from service.progress.content import KIND_BY_PATH
from service.progress.flush.flusher import Flusher
from service.progress.ingest.buffer import decode_value
from tests.helpers import MovedClock, auth, degraded_settings, events, running_app, seed

LESSON = KIND_BY_PATH["/engagements/progress/lesson"]


@pytest.fixture
def door(settings: Settings) -> Settings:
    return settings.model_copy(update={"content_catalog_enabled": True})


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
    """A cached "unknown" never outlives ~1 s, whatever ANSWER_TTL_S (10 s)."""
    await seed(db, users=7, contents=1)
    assert ANSWER_TTL_S > 1.2
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
    real_existing = catalog_module.existing

    async def counted(pool: asyncpg.Pool, kind: object, content_ids: list[int], *, timeout_s: float) -> set[int]:
        looked_up.extend(content_ids)
        return await real_existing(pool, kind, content_ids, timeout_s=timeout_s)  # type: ignore[arg-type]

    monkeypatch.setattr(catalog_module, "existing", counted)
    return looked_up


async def test_concurrent_requests_for_one_unseen_id_share_one_query(
    door: Settings, db: asyncpg.Pool, redis: Redis, token: str, queries: list[int]
) -> None:
    await seed(db, users=7, contents=1)
    async with running_app(door) as (_, client):
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


async def test_a_flood_from_one_user_is_201_and_each_content_keeps_its_last_position(
    door: Settings, db: asyncpg.Pool, redis: Redis, token: str
) -> None:
    await seed(db, users=7, contents=50)
    async with running_app(door) as (_, client):
        answers = [
            await client.post("/lives/progress", json={"live_id": i, "position": position}, headers=auth(token))
            for position in (1, 2, 3)
            for i in range(1, 51)
        ]
    assert [a.status_code for a in answers] == [201] * 150
    # each content's last position: one value each, however many heartbeats
    assert await redis.scard("progress:pending_flush:live") == 50
    keys = await redis.keys("progress:latest_position:*")
    values = {key: decode_value(await redis.get(key)).position for key in keys}
    assert values == {f"progress:latest_position:live:{i}:7": 3.0 for i in range(1, 51)}


async def test_made_up_ids_cost_one_lookup_each_and_leave_no_key(
    door: Settings, db: asyncpg.Pool, redis: Redis, token: str, queries: list[int]
) -> None:
    """One query per made-up id; its answer refuses the same id from memory for the next second."""
    await seed(db, users=7, contents=1)
    before = metrics.REFUSED.labels("unknown_content")._value.get()
    async with running_app(door) as (_, client):

        async def post_all() -> list[int]:
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
        assert await post_all() == [404] * 20
        assert sorted(queries) == list(range(900, 920))  # once each
        assert await post_all() == [404] * 20  # the same ids again, within the answers' second
        assert len(queries) == 20
    assert metrics.REFUSED.labels("unknown_content")._value.get() == before + 40
    assert sorted(await redis.keys("*")) == ["progress:latest_position:lesson:1:7", "progress:pending_flush:lesson"]


@pytest.mark.regression
async def test_a_burst_at_content_created_after_start_stores_its_final_position_and_completes(
    door: Settings, db: asyncpg.Pool, redis: Redis, token: str, queries: list[int]
) -> None:
    """Found by an outside attack (case A): lesson 50, created after the pod started, sent at 100, 200 and
    595 in a burst: no value after 1.5 s, a 404, the completion lost, and nothing counted."""
    await seed(db, users=8, contents=1, duration_s=600)
    other = make_token(door, 8)
    async with running_app(door) as (_, client):
        await db.execute("INSERT INTO courses_lesson (id, title, duration) VALUES (50, 'new', 600)")
        for user in (token, other):
            first = await client.post(
                "/engagements/progress/lesson", json={"lesson_id": 1, "position": 1}, headers=auth(user)
            )
            assert first.status_code == 201
        for position in (100, 200, 595):
            for user in (token, other):
                response = await client.post(
                    "/engagements/progress/lesson", json={"lesson_id": 50, "position": position}, headers=auth(user)
                )
                assert response.status_code == 201
        assert decode_value(await redis.get("progress:latest_position:lesson:50:7")).position == 595.0
        answer = await client.get("/progress/lesson/50", headers=auth(token))
        assert (answer.status_code, answer.json()["position"]) == (200, 595.0)
        assert answer.json()["completed_at"] is not None
    assert queries == [50]  # one lookup for both users' heartbeats
    assert decode_value(await redis.get("progress:latest_position:lesson:50:8")).position == 595.0
    assert (await Flusher(door.flush, redis, db).flush_cycle()).completions == 2
    assert sorted(await events(db)) == [("lesson", 50, 7), ("lesson", 50, 8)]


@pytest.mark.regression
async def test_a_pod_started_with_postgres_unreachable_still_stores_the_final_position(
    door: Settings, db: asyncpg.Pool, redis: Redis, token: str
) -> None:
    """Found by an outside attack (case B): no catalog snapshot, so memory knew no content: the stored position
    stayed at 20 after heartbeats at 30, 40 and 595. Postgres cannot be asked: accepted, as the door does."""
    await seed(db, users=7, contents=1, duration_s=600)
    dsn_port = int(door.database_url.rsplit(":", 1)[1].split("/")[0])
    proxy = _Proxy(dsn_port)
    port = await proxy.start()
    await proxy.cut()  # unreachable before the pod starts: no snapshot
    unreachable = door.database_url.replace(f":{dsn_port}/", f":{port}/")
    async with running_app(door.model_copy(update={"database_url": unreachable})) as (app, client):
        assert app.api.state.services.catalog is not None and app.api.state.services.catalog.snapshot_bytes() == 0
        statuses = []
        for position in (20, 30, 40, 595):
            response = await client.post(
                "/engagements/progress/lesson", json={"lesson_id": 1, "position": position}, headers=auth(token)
            )
            statuses.append(response.status_code)
        assert statuses == [201, 201, 201, 201]
        assert decode_value(await redis.get("progress:latest_position:lesson:1:7")).position == 595.0
    assert (await Flusher(door.flush, redis, db).flush_cycle()).completions == 1
    assert await db.fetchval("SELECT position FROM engagements_lessonprogress WHERE user_id = 7") == 595.0


async def test_a_ten_minute_offline_replay_stores_its_last_position_and_completes_once(
    door: Settings, db: asyncpg.Pool, redis: Redis, token: str
) -> None:
    """120 queued heartbeats (one per 5 s offline) sent at once: every one is answered 201, the last position is
    the stored one, and its completion comes once."""
    await seed(db, users=7, contents=1, duration_s=600)
    async with running_app(door) as (_, client):
        statuses = []
        for i in range(1, 121):
            response = await client.post(
                "/engagements/progress/lesson", json={"lesson_id": 1, "position": 5 * i}, headers=auth(token)
            )
            statuses.append(response.status_code)
        assert statuses == [201] * 120
        assert decode_value(await redis.get("progress:latest_position:lesson:1:7")).position == 600.0
    flusher = Flusher(door.flush, redis, db)
    assert (await flusher.flush_cycle()).completions == 1
    assert await db.fetchval("SELECT position FROM engagements_lessonprogress WHERE user_id = 7") == 600.0
    assert await events(db) == [("lesson", 1, 7)]


async def test_a_burst_through_the_end_then_a_restart_still_completes(
    door: Settings, db: asyncpg.Pool, redis: Redis, token: str
) -> None:
    """In one burst: 100, the end (595 of 600), then a restart at 3: the stored position is 3 and the content
    completes."""
    await seed(db, users=7, contents=1, duration_s=600)
    async with running_app(door) as (_, client):
        for position in (100, 595, 3):
            response = await client.post(
                "/engagements/progress/lesson", json={"lesson_id": 1, "position": position}, headers=auth(token)
            )
            assert response.status_code == 201
    stored = decode_value(await redis.get("progress:latest_position:lesson:1:7"))
    assert (stored.position, stored.peak) == (3.0, 595.0)
    assert (await Flusher(door.flush, redis, db).flush_cycle()).completions == 1
    assert await events(db) == [("lesson", 1, 7)]


async def test_a_flooding_user_grows_nothing_in_redis(
    door: Settings, db: asyncpg.Pool, redis: Redis, token: str
) -> None:
    await seed(db, users=7, contents=1)
    async with running_app(door) as (_, client):
        for position in range(1, 501):
            await client.post(
                "/engagements/progress/lesson", json={"lesson_id": 1, "position": position}, headers=auth(token)
            )
            if position in (1, 500):
                # one value and its pending member, after the first heartbeat as after the 500th
                assert sorted(await redis.keys("*")) == [
                    "progress:latest_position:lesson:1:7",
                    "progress:pending_flush:lesson",
                ]
                assert await redis.scard("progress:pending_flush:lesson") == 1
    assert decode_value(await redis.get("progress:latest_position:lesson:1:7")).position == 500.0


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
    catalog = ContentCatalog(db, max_answers=2, max_lookups=64, clock=lambda: now[0])
    assert await catalog.is_known(LESSON, 5) is False  # type: ignore[misc]
    assert catalog.is_known(LESSON, 5) is False  # the cached answer: a bool, no query
    await db.execute("INSERT INTO courses_lesson (id, title, duration) VALUES (5, 'late', 600)")
    now[0] = 11.0  # past the answer's life: asked again
    assert await catalog.is_known(LESSON, 5) is True  # type: ignore[misc]
    for content_id in (6, 7, 8):
        await catalog.is_known(LESSON, content_id)  # type: ignore[misc]
    assert len(catalog._answers) == 2  # bounded: the oldest answers go first
    await catalog.aclose()
    saturated = ContentCatalog(db, max_answers=2, max_lookups=1)
    with pytest.raises(LookupsSaturated):  # two distinct ids of a type waiting at once, one allowed
        await asyncio.gather(saturated.is_known(LESSON, 9), saturated.is_known(LESSON, 10))  # type: ignore[arg-type]
    await saturated.aclose()


async def test_a_read_with_two_authorization_headers_is_401(door: Settings, db: asyncpg.Pool, token: str) -> None:
    await seed(db, users=7, contents=1)
    async with running_app(door) as (_, client):
        doubled = await client.get(
            "/progress/lesson/1", headers=[("authorization", f"Bearer {token}"), ("authorization", f"Bearer {token}")]
        )
        assert doubled.status_code == 401


@pytest.mark.regression
async def test_a_lookup_timing_out_on_a_locked_table_accepts_only_its_own_id(
    door: Settings, db: asyncpg.Pool, redis: Redis, queries: list[int]
) -> None:
    """Found by an outside attack: one catalog lookup timing out (`audios_audio` locked) accepted made-up ids of
    every type for a second: 101 of 101 made-up lesson ids answered 201. Each from a user of its own: no limit
    of any kind stands between them and the catalog."""
    await seed(db, users=7, contents=1)
    before = unverified("audio")
    async with running_app(door) as (_, client):
        async with db.acquire() as locker, locker.transaction():
            await locker.execute("LOCK TABLE audios_audio IN ACCESS EXCLUSIVE MODE")
            locked = await client.post(
                "/audios/progress", json={"audio_id": 77, "position": 1}, headers=auth(make_token(door, 7))
            )
            assert locked.status_code == 201  # its lookup timed out: accepted, never lost to an outage
            again = await client.post(
                "/audios/progress", json={"audio_id": 77, "position": 2}, headers=auth(make_token(door, 7))
            )
            assert again.status_code == 201  # for a second from memory: no lookup, still counted
            statuses = [
                (
                    await client.post(
                        "/engagements/progress/lesson",
                        json={"lesson_id": 1000 + i, "position": 1},
                        headers=auth(make_token(door, 100 + i)),
                    )
                ).status_code
                for i in range(101)
            ]
    assert statuses == [404] * 101
    assert sorted(queries) == [77, *range(1000, 1101)]  # each id its own lookup
    assert unverified("audio") == before + 2
    assert sorted(await redis.keys("*")) == ["progress:latest_position:audio:77:7", "progress:pending_flush:audio"]


@pytest.mark.regression
@pytest.mark.slow
async def test_with_redis_down_a_burst_costs_live_users_nothing_and_only_201s_are_written(
    door: Settings, db: asyncpg.Pool, tmp_path: Path
) -> None:
    """Found by an outside attack: during a Redis outage the drain of a burst's refused (429) heartbeats filled
    degraded mode's queue and live users got 503s, and those refused positions were written later. Now a burst
    is answered like any heartbeats, and each key's row ends at the last position answered 201 for it."""
    await seed(db, users=21, contents=21, duration_s=6000)
    own_redis = embedded.EmbeddedRedis(tmp_path / "valkey", None)
    own_redis.start()
    answered: dict[tuple[int, int], list[tuple[float, int]]] = defaultdict(list)
    try:
        async with running_app(degraded_settings(door, own_redis)) as (_, client):
            own_redis.stop()

            async def send(user_id: int, lesson_id: int, position: float) -> None:
                response = await client.post(
                    "/engagements/progress/lesson",
                    json={"lesson_id": lesson_id, "position": position},
                    headers=auth(make_token(door, user_id)),
                )
                answered[(user_id, lesson_id)].append((position, response.status_code))

            async def burst() -> None:  # user 21: 600 heartbeats on end, ten times the old limit's burst
                for position in range(1, 601):
                    await send(21, 21, position)

            async def listen(user_id: int) -> None:  # a live user: a heartbeat every 0.1 s for a second
                for position in range(1, 11):
                    await send(user_id, user_id, position)
                    await asyncio.sleep(0.1)

            await asyncio.gather(burst(), *(listen(user_id) for user_id in range(1, 21)))
    finally:
        own_redis.stop()
    for user_id in range(1, 21):
        assert [status for _, status in answered[(user_id, user_id)]] == [201] * 10, user_id
    rows = dict(
        ((row["user_id"], row["lesson_id"]), row["position"])
        for row in await db.fetch("SELECT user_id, lesson_id, position FROM engagements_lessonprogress")
    )
    # no heartbeat answered anything but 201 is written: each row is the last position its key was answered 201
    last_201 = {
        key: max((position for position, status in sent if status == 201), default=None)
        for key, sent in answered.items()
    }
    assert rows == {key: position for key, position in last_201.items() if position is not None}
    assert rows[(21, 21)] == 600.0 and len(rows) == 21


@pytest.mark.regression
@pytest.mark.slow
async def test_a_locked_lesson_table_flooded_with_made_up_ids_costs_audio_nothing(
    door: Settings, db: asyncpg.Pool, redis: Redis
) -> None:
    """Found by an outside attack (the catalog x the pool): `courses_lesson` locked and made-up lesson ids at 150 a
    second, and audio got 503s: each lookup held one of the pool's connections for its timeout, 64 at once against
    16, so the other types' lookups, reads (and degraded writes) found none. Now a type's lookups go in one query
    at a time on one connection: audio published since the snapshot is still looked up (201), made-up audio ids
    are still refused (404), and audio reads answer."""
    await seed(db, users=4, contents=4)
    lessons: list[asyncio.Task[httpx.Response]] = []
    audio: list[tuple[str, int]] = []
    async with running_app(door) as (_, client):
        # published after the pod's snapshot: each id is looked up
        await db.execute(
            "INSERT INTO audios_audio (id, title, duration) SELECT i, 'new', 600 FROM generate_series(100, 199) i"
        )
        before = unverified("audio")
        async with db.acquire() as locker, locker.transaction():
            await locker.execute("LOCK TABLE courses_lesson IN ACCESS EXCLUSIVE MODE")

            async def flood() -> None:  # 150 made-up lesson ids a second, each from a user of its own
                for i in range(375):
                    heartbeat = {"lesson_id": 6_000_001 + i, "position": 1}
                    token = make_token(door, 1000 + i)
                    lessons.append(
                        asyncio.create_task(
                            client.post("/engagements/progress/lesson", json=heartbeat, headers=auth(token))
                        )
                    )
                    await asyncio.sleep(1 / 150)

            async def listen(user_id: int) -> None:  # every 0.2 s: a new audio, a made-up one, a read
                headers = auth(make_token(door, user_id))
                for i in range(12):
                    audio_id = 100 + 25 * (user_id - 1) + i
                    new = await client.post(
                        "/audios/progress", json={"audio_id": audio_id, "position": 1}, headers=headers
                    )
                    made_up = await client.post(
                        "/audios/progress", json={"audio_id": 7_000_000 + audio_id, "position": 1}, headers=headers
                    )
                    read = await client.get(f"/progress/audio/{audio_id}", headers=headers)
                    audio.extend(
                        [("new", new.status_code), ("made up", made_up.status_code), ("read", read.status_code)]
                    )
                    await asyncio.sleep(0.2)

            await asyncio.gather(flood(), *(listen(user_id) for user_id in range(1, 5)))
        await asyncio.gather(*lessons, return_exceptions=True)
    assert {answer: audio.count(answer) for answer in set(audio)} == {
        ("new", 201): 48,
        ("made up", 404): 48,
        ("read", 200): 48,
    }
    assert unverified("audio") == before  # each audio id answered by its own lookup, none accepted unverified
