"""GET /progress/...: the freshest position, from the buffer before the flush and from the row after it."""

import asyncio
from datetime import UTC, datetime, timedelta

import asyncpg
import httpx
import pytest
from redis.asyncio import Redis

from service.api.http import json_body
from service.api.reads import progress_json
from service.auth import make_token
from service.config import Settings
from service.progress.flush.flusher import Flusher
from service.progress.ingest.buffer import decode_value
from service.progress.keys import KeyLayout
from service.progress.read.reads import Progress, as_us, from_ms
from tests.helpers import auth, running_app, seed, wait_for, write


async def heartbeat(client: httpx.AsyncClient, token: str, lesson_id: int, position: float) -> None:
    response = await client.post(
        "/engagements/progress/lesson", json={"lesson_id": lesson_id, "position": position}, headers=auth(token)
    )
    assert response.status_code == 201


async def stored_ms(redis: Redis, lesson_id: int, user_id: int = 7) -> int:
    return decode_value(await redis.get(f"progress:latest_position:lesson:{lesson_id}:{user_id}")).received_ms


@pytest.fixture
async def flusher(settings: Settings, redis: Redis, db: asyncpg.Pool) -> Flusher:
    return Flusher(settings.flush, redis, db)


async def test_a_heartbeat_is_read_back_at_once_then_from_the_row_after_flush_and_expiry(
    client: httpx.AsyncClient, redis: Redis, db: asyncpg.Pool, token: str, flusher: Flusher
) -> None:
    await seed(db, users=7)
    await heartbeat(client, token, 2, 40.5)
    received_ms = await stored_ms(redis, 2)

    response = await client.get("/progress/lesson/2", headers=auth(token))  # before any flush: no row yet
    assert response.status_code == 200
    assert response.headers["cache-control"] == "no-store"
    expected = {
        "content_type": "lesson",
        "content_id": 2,
        "position": 40.5,
        "updated_at": from_ms(received_ms).isoformat(),
        "completed_at": None,
    }
    assert response.json() == expected
    assert await db.fetchval("SELECT count(*) FROM engagements_lessonprogress") == 0

    assert (await flusher.flush_cycle()).written == 1
    assert (await client.get("/progress/lesson/2", headers=auth(token))).json() == expected

    await redis.delete("progress:latest_position:lesson:2:7")  # the value's TTL passed
    assert (await client.get("/progress/lesson/2", headers=auth(token))).json() == expected

    # the next heartbeat is newer than the row: it is the answer until the next flush
    await heartbeat(client, token, 2, 41.0)
    answer = (await client.get("/progress/lesson/2", headers=auth(token))).json()
    assert (answer["position"], answer["updated_at"]) == (41.0, from_ms(await stored_ms(redis, 2)).isoformat())


async def test_a_row_newer_than_the_buffered_value_wins(
    client: httpx.AsyncClient, redis: Redis, db: asyncpg.Pool, token: str
) -> None:
    await seed(db, users=7)
    await heartbeat(client, token, 1, 10.0)
    # written since by degraded mode (or another device's flushed heartbeat): newer than the buffer
    await db.execute(
        "INSERT INTO engagements_lessonprogress (user_id, lesson_id, position, created_at, updated_at) "
        "VALUES (7, 1, 99.0, now() + interval '1 minute', now() + interval '1 minute')"
    )
    answer = (await client.get("/progress/lesson/1", headers=auth(token))).json()
    assert answer["position"] == 99.0


async def test_a_completion_not_flushed_yet_is_read_as_the_flush_will_write_it(
    client: httpx.AsyncClient, redis: Redis, db: asyncpg.Pool, token: str, flusher: Flusher
) -> None:
    await seed(db, users=7, duration_s=600)
    await heartbeat(client, token, 3, 595.0)  # within the 10 s margin
    await heartbeat(client, token, 3, 4.0)  # and restarted: the peak still completes it
    received_ms = await stored_ms(redis, 3)
    answer = (await client.get("/progress/lesson/3", headers=auth(token))).json()
    assert (answer["position"], answer["completed_at"]) == (4.0, from_ms(received_ms).isoformat())

    await flusher.flush_cycle()
    completed_at = await db.fetchval("SELECT completed_at FROM engagements_lessonprogress WHERE lesson_id = 3")
    assert completed_at.isoformat() == answer["completed_at"]  # the read said what the flush wrote
    assert (await client.get("/progress/lesson/3", headers=auth(token))).json() == answer


async def test_another_users_token_never_sees_it(
    client: httpx.AsyncClient, redis: Redis, db: asyncpg.Pool, settings: Settings, token: str, flusher: Flusher
) -> None:
    from service.auth import make_token

    await seed(db, users=8)
    await heartbeat(client, token, 1, 12.0)
    other = auth(make_token(settings, 8))
    response = await client.get("/progress/lesson/1", headers=other)
    assert response.status_code == 404
    assert "lesson 1" in response.json()["detail"]
    assert (await client.get("/progress/lesson?ids=1", headers=other)).json() == {"data": []}
    await flusher.flush_cycle()
    assert (await client.get("/progress/lesson/1", headers=other)).status_code == 404
    assert (await client.get("/progress/lesson/1", headers=auth(token))).status_code == 200


async def test_nothing_known_is_404_and_a_value_for_unknown_content_is_not_progress(
    client: httpx.AsyncClient, redis: Redis, db: asyncpg.Pool, token: str
) -> None:
    await seed(db, users=7, contents=2)
    nothing = await client.get("/progress/audio/1", headers=auth(token))
    assert (nothing.status_code, nothing.headers["cache-control"]) == (404, "no-store")  # no cached "none"
    await client.post("/audios/progress", json={"audio_id": 99, "position": 5}, headers=auth(token))
    assert await redis.exists("progress:latest_position:audio:99:7")  # the flush will drop it: no such audio
    assert (await client.get("/progress/audio/99", headers=auth(token))).status_code == 404


async def test_batch_read_returns_an_entry_per_id_with_progress_in_the_order_asked(
    client: httpx.AsyncClient, redis: Redis, db: asyncpg.Pool, token: str, flusher: Flusher
) -> None:
    await seed(db, users=7, contents=5)
    await heartbeat(client, token, 4, 44.0)
    await flusher.flush_cycle()
    await redis.delete("progress:latest_position:lesson:4:7")  # 4: only in the row
    await heartbeat(client, token, 2, 22.0)  # 2: only in the buffer
    response = await client.get("/progress/lesson?ids=5,4,3,2,4,1000", headers=auth(token))
    assert response.status_code == 200
    assert [(e["content_id"], e["position"]) for e in response.json()["data"]] == [(4, 44.0), (2, 22.0)]
    assert all(e["content_type"] == "lesson" for e in response.json()["data"])


BAD_READS = [
    pytest.param("/progress/podcast/1", 422, "content_type", id="unknown-type"),
    pytest.param("/progress/podcast?ids=1", 422, "content_type", id="unknown-type-batch"),
    pytest.param("/progress/lesson/abc", 422, "content_id", id="id-not-integer"),
    pytest.param("/progress/lesson/1.0", 422, "content_id", id="id-float"),
    pytest.param("/progress/lesson/0", 422, "content_id", id="id-zero"),
    pytest.param("/progress/lesson/-1", 422, "content_id", id="id-negative"),
    pytest.param("/progress/lesson/9223372036854775808", 422, "content_id", id="id-beyond-64-bit"),
    pytest.param("/progress/lesson", 422, "ids", id="ids-missing"),
    pytest.param("/progress/lesson?ids=", 422, "ids", id="ids-empty"),
    pytest.param("/progress/lesson?ids=1,x", 422, "ids", id="ids-not-integer"),
    pytest.param("/progress/lesson?ids=1,,2", 422, "ids", id="ids-empty-item"),
    pytest.param("/progress/lesson?ids=1&ids=2", 422, "ids", id="ids-repeated"),
    pytest.param("/progress/lesson?ids=" + ",".join(str(i) for i in range(1, 102)), 422, "100", id="101-ids"),
]


@pytest.mark.parametrize(("url", "status", "named"), BAD_READS)
async def test_bad_reads_get_a_clear_4xx_and_write_nothing(
    client: httpx.AsyncClient, redis: Redis, db: asyncpg.Pool, token: str, url: str, status: int, named: str
) -> None:
    await seed(db, users=7)
    await heartbeat(client, token, 1, 5.0)
    keys = sorted(await redis.keys("*"))
    response = await client.get(url, headers=auth(token))
    assert response.status_code == status
    assert named in response.text
    assert sorted(await redis.keys("*")) == keys
    assert await db.fetchval("SELECT count(*) FROM engagements_lessonprogress") == 0


async def test_a_read_behind_a_stalled_store_gets_a_503_to_retry_soon_not_a_long_wait(
    client: httpx.AsyncClient, db: asyncpg.Pool, token: str
) -> None:
    """The batch a process may have out for lessons stalls on a lock: the next read is refused within about a
    second (the held read answers when the lock goes, inside the app's 2 s lock_timeout)."""
    await seed(db, users=7)
    loop = asyncio.get_running_loop()
    waiting_on_the_lock = (
        "SELECT count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation"
        " WHERE NOT l.granted AND c.relname = 'engagements_lessonprogress'"
    )
    async with db.acquire() as conn, conn.transaction():
        await conn.execute("LOCK TABLE engagements_lessonprogress IN ACCESS EXCLUSIVE MODE")
        held = asyncio.create_task(client.get("/progress/lesson/1", headers=auth(token)))

        async def held_on_the_lock() -> bool:
            return bool(await db.fetchval(waiting_on_the_lock))

        await wait_for(held_on_the_lock)  # its batch is out, waiting on the lock
        started = loop.time()
        waited = await client.get("/progress/lesson/2", headers=auth(token))
        elapsed = loop.time() - started
    assert (waited.status_code, waited.headers["retry-after"]) == (503, "1"), waited.text
    assert "too slow" in waited.json()["detail"] and 0.9 < elapsed < 1.5
    assert (await held).status_code == 404  # answered once the lock went


async def test_100_ids_are_accepted(client: httpx.AsyncClient, db: asyncpg.Pool, token: str) -> None:
    await seed(db, users=7)
    ids = ",".join(str(i) for i in range(1, 101))
    assert (await client.get(f"/progress/audio?ids={ids}", headers=auth(token))).json() == {"data": []}


async def test_reads_need_a_token_and_get(client: httpx.AsyncClient, redis: Redis, token: str) -> None:
    response = await client.get("/progress/lesson/1")
    assert (response.status_code, "Authorization" in response.json()["detail"]) == (401, True)
    assert (await client.get("/progress/lesson?ids=1", headers=auth("x.y.z"))).status_code == 401
    response = await client.post("/progress/lesson/1", headers=auth(token))
    assert (response.status_code, response.headers["allow"]) == (405, "GET")
    response = await client.get("/progress/sync", headers=auth(token))
    assert (response.status_code, response.headers["allow"]) == (405, "POST")
    assert (await client.get("/progress/lesson/1/more", headers=auth(token))).status_code == 404  # not a route
    assert await redis.keys("*") == []


async def test_without_a_database_reads_answer_503(settings: Settings, redis: Redis, token: str) -> None:
    async with running_app(settings.model_copy(update={"database_url": ""})) as (_, client):
        response = await client.get("/progress/lesson/1", headers=auth(token))
        assert response.status_code == 503
        assert "DATABASE_URL" in response.json()["detail"]


async def test_a_store_that_fails_is_503_not_500(
    client: httpx.AsyncClient, redis: Redis, db: asyncpg.Pool, token: str
) -> None:
    await seed(db, users=7)
    await db.execute("ALTER TABLE engagements_lessonprogress RENAME TO engagements_lessonprogress_away")
    try:
        response = await client.get("/progress/lesson/1", headers=auth(token))
    finally:
        await db.execute("ALTER TABLE engagements_lessonprogress_away RENAME TO engagements_lessonprogress")
    assert (response.status_code, response.headers["retry-after"]) == (503, "1")


async def test_an_unreachable_redis_is_503_for_reads_and_sync(settings: Settings, db: asyncpg.Pool, token: str) -> None:
    from service.dev.embedded import free_port

    await seed(db, users=7)
    unreachable = settings.model_copy(update={"redis_url": f"redis://127.0.0.1:{free_port()}/0"})
    async with running_app(unreachable) as (_, client):
        assert (await client.get("/progress/lesson/1", headers=auth(token))).status_code == 503
        assert (await client.get("/progress/lesson?ids=1,2", headers=auth(token))).status_code == 503
        listened_at = (datetime.now(UTC) - timedelta(minutes=1)).isoformat()
        body = {"items": [{"content_type": "lesson", "content_id": 1, "position": 3.0, "listened_at": listened_at}]}
        response = await client.post("/progress/sync", json=body, headers=auth(token))
        assert response.status_code == 503, response.text
        assert "retry later" in response.json()["detail"]


async def test_a_value_nobody_could_read_spoils_no_other_read_of_its_turn(
    settings: Settings, client: httpx.AsyncClient, redis: Redis, db: asyncpg.Pool, token: str
) -> None:
    """A value another writer left under the monolith's key names (one field) reads as no buffered value;
    the reads that share its round trip answer as usual."""
    await seed(db, users=8, contents=3)
    await heartbeat(client, token, 2, 42.0)
    await redis.set("progress:latest_position:lesson:2:8", "42.5")
    other = make_token(settings, 8)
    answers = await asyncio.gather(*(client.get("/progress/lesson/2", headers=auth(t)) for t in (token, other) * 5))
    assert [a.status_code for a in answers] == [200, 404] * 5
    assert {a.json()["position"] for a in answers[::2]} == {42.0}


@pytest.mark.parametrize("position", [0.0, -0.0, 1.5, 1e-05, 2.5e-07, 1 / 3, 86400.0, float("nan"), float("inf")])
@pytest.mark.parametrize("completed", [False, True])
def test_an_entry_is_written_as_json_dumps_wrote_its_dict(position: float, completed: bool) -> None:
    updated_at = datetime(2026, 11, 30, 10, 0, 0, 123456, UTC) if completed else datetime(2026, 11, 30, tzinfo=UTC)
    progress: Progress = (2**63 - 1, position, as_us(updated_at), as_us(updated_at) if completed else None)
    as_dict = {
        "content_type": "meditation",
        "content_id": 2**63 - 1,
        "position": position,
        "updated_at": updated_at.isoformat(),
        "completed_at": updated_at.isoformat() if completed else None,
    }
    assert progress_json("meditation", progress).encode() == json_body(as_dict)


@pytest.mark.regression
async def test_while_the_shard_count_changes_a_read_takes_the_newer_value_of_both_layouts(
    settings: Settings, redis: Redis, db: asyncpg.Pool, token: str
) -> None:
    """Found by an outside attack: with PROGRESS_BUFFER_SHARDS=4 and PREVIOUS_SHARDS=1, a pod still on the old
    count buffered 321 while the row held 10, and the new pod's GET answered 10."""
    await seed(db, users=7, contents=3)
    changed = settings.model_copy(update={"progress_buffer_shards": 4, "progress_buffer_previous_shards": 1})
    new_layout = KeyLayout.from_settings(changed.redis)
    await write(redis, "lesson", 1, 7, 10.0, received_ms=ms_ago(60))
    await Flusher(settings.flush, redis, db).flush_cycle()  # the row holds 10
    await write(redis, "lesson", 1, 7, 321.0, received_ms=ms_ago(30))  # a pod on the old count: its names
    await write(redis, "lesson", 2, 7, 50.0, received_ms=ms_ago(30))  # old layout, older than the new one's
    await write(redis, "lesson", 2, 7, 60.0, received_ms=ms_ago(20), layout=new_layout)
    await write(redis, "lesson", 3, 7, 70.0, received_ms=ms_ago(20), layout=new_layout)  # the new layout only
    async with running_app(changed) as (_, client):
        response = await client.get("/progress/lesson?ids=1,2,3", headers=auth(token))
    assert [(p["content_id"], p["position"]) for p in response.json()["data"]] == [(1, 321.0), (2, 60.0), (3, 70.0)]


def ms_ago(seconds: float) -> float:
    return (datetime.now(UTC) - timedelta(seconds=seconds)).timestamp() * 1000
