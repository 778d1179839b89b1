"""POST /progress/sync: offline positions through the buffer with their own time, against real Redis and Postgres."""

import json
import time
from datetime import UTC, datetime

import asyncpg
import httpx
import pytest
from redis.asyncio import Redis

from service.api.routes import Routes
from service.config import Settings
from service.progress.flush.flusher import Flusher
from service.progress.ingest.buffer import WRITE_SCRIPT, PositionWriter, decode_value, write_args
from service.progress.read.reads import as_ms
from service.progress.read.sync import MAX_BACKDATE_S, OLDER_THAN_STORED, SUPERSEDED, UNKNOWN_CONTENT
from tests.helpers import BAD_SYNCS, ago, auth, metric, running_app, seed, sync_body
from tests.helpers import sync_item as item

VALUE = "progress:latest_position:{}:{}:7"


async def sync(client: httpx.AsyncClient, token: str, *items: dict[str, object]) -> list[tuple[bool, str | None]]:
    response = await client.post("/progress/sync", json={"items": list(items)}, headers=auth(token))
    assert response.status_code == 200, response.text
    return [(outcome["applied"], outcome["reason"]) for outcome in response.json()["items"]]


async def live_heartbeat(redis: Redis, content_id: int, position: float, received_ms: float | None = None) -> None:
    """A heartbeat through the request path's script: stamped by Redis, or stored at `received_ms` when given."""
    await redis.script_load(WRITE_SCRIPT)
    await redis.execute_command(*write_args("audio", content_id, 7, position, received_ms))


def ms(moment: datetime) -> float:
    """A receive time as the buffer keeps it: ms with the microseconds of `listened_at`."""
    return as_ms(moment)


@pytest.fixture
async def flusher(settings: Settings, redis: Redis, db: asyncpg.Pool) -> Flusher:
    return Flusher(settings.flush, redis, db)


async def test_newer_items_are_applied_and_older_ones_are_not(
    client: httpx.AsyncClient, redis: Redis, db: asyncpg.Pool, token: str
) -> None:
    await seed(db, users=7, contents=3)
    await live_heartbeat(redis, 1, 100.0, ms(ago(60)))  # a live heartbeat a minute ago
    await live_heartbeat(redis, 2, 100.0, ms(ago(60)))
    newer, older = ago(30), ago(120)
    outcomes = await sync(client, token, item(1, 130.0, newer), item(2, 50.0, older), item(3, 7.0, older))
    assert outcomes == [(True, None), (False, OLDER_THAN_STORED), (True, None)]
    assert decode_value(await redis.get(VALUE.format("audio", 1))).position == 130.0
    assert decode_value(await redis.get(VALUE.format("audio", 1))).received_ms == ms(newer)
    assert decode_value(await redis.get(VALUE.format("audio", 2))).position == 100.0  # the live one stands
    assert await redis.smembers("progress:pending_flush:audio") == {"1:7", "2:7", "3:7"}
    assert (await client.get("/progress/audio/2", headers=auth(token))).json()["position"] == 100.0
    # and the other way round: a live heartbeat after the offline item replaces it
    await live_heartbeat(redis, 3, 9.0, ms(ago(1)))
    assert (await client.get("/progress/audio/3", headers=auth(token))).json()["position"] == 9.0


async def test_an_item_older_than_the_row_is_not_applied_even_once_the_value_expired(
    client: httpx.AsyncClient, redis: Redis, db: asyncpg.Pool, token: str, flusher: Flusher
) -> None:
    await seed(db, users=7)
    await live_heartbeat(redis, 1, 100.0, ms(ago(60)))
    await flusher.flush_cycle()
    await redis.delete(VALUE.format("audio", 1))  # its TTL passed after the flush: only the row knows
    assert await sync(client, token, item(1, 50.0, ago(600))) == [(False, OLDER_THAN_STORED)]
    await flusher.flush_cycle()
    assert await db.fetchval("SELECT position FROM audios_audioprogress WHERE user_id = 7") == 100.0
    assert (await client.get("/progress/audio/1", headers=auth(token))).json()["position"] == 100.0
    # newer than the row: applied, and the flush moves the row forward
    assert await sync(client, token, item(1, 120.0, ago(30))) == [(True, None)]
    await flusher.flush_cycle()
    assert await db.fetchval("SELECT position FROM audios_audioprogress WHERE user_id = 7") == 120.0


async def test_an_offline_listen_to_the_end_completes_once(
    client: httpx.AsyncClient, redis: Redis, db: asyncpg.Pool, token: str, flusher: Flusher
) -> None:
    await seed(db, users=7, duration_s=600)
    listened_at = ago(300).replace(microsecond=250_000)
    assert await sync(client, token, item(1, 595.0, listened_at, "meditation")) == [(True, None)]
    answer = (await client.get("/progress/meditation/1", headers=auth(token))).json()
    assert answer["completed_at"] == listened_at.isoformat()  # before the flush, as the flush will write it

    assert (await flusher.flush_cycle()).completions == 1
    # the app uploads the same batch again (it never saw the answer), and a later one
    assert await sync(client, token, item(1, 595.0, listened_at, "meditation")) == [(True, None)]
    assert await sync(client, token, item(1, 600.0, ago(10), "meditation")) == [(True, None)]
    assert (await flusher.flush_cycle()).completions == 0
    events = await db.fetch("SELECT content_type, content_id, user_id, completed_at FROM progress_completion_event")
    assert [tuple(e) for e in events] == [("meditation", 1, 7, listened_at)]
    assert await db.fetchval("SELECT completed_at FROM audios_meditationprogress") == listened_at


async def test_duplicates_in_one_request_the_latest_wins_and_the_furthest_still_completes(
    client: httpx.AsyncClient, redis: Redis, db: asyncpg.Pool, token: str, flusher: Flusher
) -> None:
    await seed(db, users=7, duration_s=600)
    end, restart = ago(120), ago(60)
    # out of order on purpose: the device listened to the end, then restarted
    outcomes = await sync(client, token, item(2, 5.0, restart), item(2, 598.0, end), item(1, 3.0, restart))
    assert outcomes == [(True, None), (False, SUPERSEDED), (True, None)]
    stored = decode_value(await redis.get(VALUE.format("audio", 2)))
    assert (stored.position, stored.received_ms, stored.peak) == (5.0, ms(restart), 598.0)
    assert (await flusher.flush_cycle()).completions == 1
    row = await db.fetchrow("SELECT position, completed_at FROM audios_audioprogress WHERE audio_id = 2")
    assert row["position"] == 5.0
    assert row["completed_at"] == datetime.fromtimestamp(ms(restart) / 1000, UTC)


async def test_duplicates_of_one_time_the_last_in_the_request_stands_and_is_the_one_stored(
    client: httpx.AsyncClient, redis: Redis, db: asyncpg.Pool, token: str
) -> None:
    await seed(db, users=7, duration_s=600)
    at = ago(30)
    outcomes = await sync(client, token, item(2, 100.0, at), item(2, 200.0, at), item(2, 150.0, at))
    assert outcomes == [(False, SUPERSEDED), (False, SUPERSEDED), (True, None)]
    stored = decode_value(await redis.get(VALUE.format("audio", 2)))
    assert (stored.position, stored.received_ms, stored.peak) == (150.0, ms(at), 200.0)


async def test_items_clamped_to_now_the_latest_the_device_told_stands(
    client: httpx.AsyncClient, redis: Redis, db: asyncpg.Pool, token: str
) -> None:
    await seed(db, users=7, duration_s=600)
    # a clock a little ahead: both are stored as now, but the device heard 50 after 100
    outcomes = await sync(client, token, item(2, 50.0, ago(-200)), item(2, 100.0, ago(-100)))
    assert outcomes == [(True, None), (False, SUPERSEDED)]
    assert decode_value(await redis.get(VALUE.format("audio", 2))).position == 50.0


async def test_refused_items_are_reported_one_by_one_and_not_written(
    client: httpx.AsyncClient, redis: Redis, db: asyncpg.Pool, token: str
) -> None:
    await seed(db, users=7, contents=3)
    outcomes = await sync(
        client,
        token,
        item(1, 10.0, ago(-3600)),  # an hour in the future: a wrong clock
        item(999, 10.0, ago(5)),  # no such audio: the flush would drop it
        item(3, 10.0, ago(-60)),  # a clock a minute ahead: tolerated, stored as now
    )
    assert [applied for applied, _ in outcomes] == [False, False, True]
    assert "future" in str(outcomes[0][1])
    assert outcomes[1][1] == UNKNOWN_CONTENT
    assert await redis.smembers("progress:pending_flush:audio") == {"3:7"}
    assert sorted(await redis.keys("progress:latest_position:*")) == [VALUE.format("audio", 3)]
    assert decode_value(await redis.get(VALUE.format("audio", 3))).received_ms <= time.time_ns() // 1_000_000


async def test_one_sync_cannot_date_completions_further_back_than_the_window(
    client: httpx.AsyncClient, settings: Settings, redis: Redis, db: asyncpg.Pool, token: str, flusher: Flusher
) -> None:
    """29 items at the end, listened 1..29 days ago: applied (offline progress is not lost), each row dated when
    it was heard, but every completion and event at most 6 h before the request."""
    await seed(db, users=7, contents=29, duration_s=600)
    window_ms = MAX_BACKDATE_S * 1000
    assert window_ms == 6 * 3_600_000  # the default
    before = time.time_ns() // 1_000_000
    listened = {d: ago(d * 86_400) for d in range(1, 30)}
    outcomes = await sync(client, token, *(item(d, 600.0, at) for d, at in listened.items()))
    after = time.time_ns() // 1_000_000
    assert outcomes == [(True, None)] * 29
    assert (await flusher.flush_cycle()).completions == 29
    dates = [as_ms(row["completed_at"]) for row in await db.fetch("SELECT completed_at FROM progress_completion_event")]
    assert len(dates) == 29 and before - window_ms <= min(dates) and max(dates) <= after - window_ms
    rows = await db.fetch("SELECT audio_id, updated_at, completed_at FROM audios_audioprogress")
    assert len(rows) == 29
    assert all(before - window_ms <= as_ms(row["completed_at"]) <= after - window_ms for row in rows)
    assert {row["audio_id"]: row["updated_at"] for row in rows} == listened


@pytest.mark.regression
async def test_an_older_offline_listen_never_replaces_a_newer_row(
    client: httpx.AsyncClient, redis: Redis, db: asyncpg.Pool, token: str, flusher: Flusher
) -> None:
    """Found by an outside attack (case 1): the row at 900, written by live heartbeats 7 h ago; a sync of 100
    listened 8 h ago answered applied and replaced it, its time clamped to 6 h ago. Against the row (the value
    expired after its flush) and against a value still buffered."""
    await seed(db, users=7, contents=2)
    live_at = ago(7 * 3600)
    await live_heartbeat(redis, 1, 900.0, ms(live_at))
    await flusher.flush_cycle()
    await redis.delete(VALUE.format("audio", 1))  # its TTL passed after the flush: only the row knows
    await live_heartbeat(redis, 2, 900.0, ms(live_at))  # not flushed yet
    outcomes = await sync(client, token, item(1, 100.0, ago(8 * 3600)), item(2, 100.0, ago(8 * 3600)))
    assert outcomes == [(False, OLDER_THAN_STORED)] * 2
    assert decode_value(await redis.get(VALUE.format("audio", 2))).position == 900.0
    await flusher.flush_cycle()
    rows = await db.fetch("SELECT audio_id, position, updated_at FROM audios_audioprogress ORDER BY audio_id")
    assert [tuple(row) for row in rows] == [(1, 900.0, live_at), (2, 900.0, live_at)]
    for content_id in (1, 2):
        assert (await client.get(f"/progress/audio/{content_id}", headers=auth(token))).json()["position"] == 900.0


@pytest.mark.regression
async def test_of_two_old_offline_listens_the_later_heard_stands_whichever_is_sent_last(
    client: httpx.AsyncClient, redis: Redis, db: asyncpg.Pool, token: str, flusher: Flusher
) -> None:
    """Found by an outside attack (case 2): a sync of 500 listened 10 h ago, then one of 100 listened 30 h ago;
    both were clamped to 6 h before their receipt, so the second, received later, stood. Before the flush
    (content 1) and after it, once the value expired (content 2)."""
    await seed(db, users=7, contents=2)
    assert (
        await sync(client, token, item(1, 500.0, ago(10 * 3600)), item(2, 500.0, ago(10 * 3600))) == [(True, None)] * 2
    )
    await flusher.flush_cycle()
    await redis.delete(VALUE.format("audio", 2))
    outcomes = await sync(client, token, item(1, 100.0, ago(30 * 3600)), item(2, 100.0, ago(30 * 3600)))
    assert outcomes == [(False, OLDER_THAN_STORED)] * 2
    await flusher.flush_cycle()
    assert await db.fetchval("SELECT array_agg(position ORDER BY audio_id) FROM audios_audioprogress") == [500.0] * 2


@pytest.mark.regression
async def test_a_completion_heard_30_hours_ago_is_dated_within_the_window_and_its_row_when_heard(
    client: httpx.AsyncClient, settings: Settings, redis: Redis, db: asyncpg.Pool, token: str, flusher: Flusher
) -> None:
    """The completion's date is bounded (receipt - 6 h), the position's order is not: the
    row's updated_at is when the listen happened, and the read before the flush answers what the flush writes."""
    await seed(db, users=7, duration_s=600)
    window_ms = MAX_BACKDATE_S * 1000
    heard = ago(30 * 3600).replace(microsecond=125_000)
    before = time.time_ns() // 1_000_000
    assert await sync(client, token, item(1, 598.0, heard, "lesson")) == [(True, None)]
    after = time.time_ns() // 1_000_000
    answer = (await client.get("/progress/lesson/1", headers=auth(token))).json()
    assert answer["updated_at"] == heard.isoformat()
    assert (await flusher.flush_cycle()).completions == 1
    row = await db.fetchrow("SELECT updated_at, completed_at FROM engagements_lessonprogress WHERE user_id = 7")
    assert row["updated_at"] == heard
    assert before - window_ms <= as_ms(row["completed_at"]) <= after - window_ms
    assert answer["completed_at"] == row["completed_at"].isoformat()  # the read said what the flush wrote
    assert await db.fetchval("SELECT completed_at FROM progress_completion_event") == row["completed_at"]


async def redis_ms(redis: Redis) -> int:
    seconds, micros = await redis.time()
    return seconds * 1000 + micros // 1000


async def test_a_completion_floor_rises_with_the_peak_and_goes_with_a_later_write(redis: Redis) -> None:
    """The buffer keeps the floor of the write that brought the peak, and drops it when a later write stands
    (whose own time is later than any floor before it). The floor is Redis's now minus the window."""
    key = VALUE.format("audio", 1)
    writer = PositionWriter(redis)
    heard_ms = 1_700_000_000_000.25  # long ago
    day, hour = 86_400_000, 3_600_000
    before = await redis_ms(redis)
    assert await writer.write_all([("audio", 1, 7, 10.0, heard_ms, 10.0)], max_skew_ms=0, max_backdate_ms=day) == [1]
    first = decode_value(await redis.get(key))
    assert (await redis.get(key)).startswith("10.0:1700000000000:10.0:250:")
    assert first.completion_floor_ms is not None and before - day <= first.completion_floor_ms <= before - day + 1000
    # older, further, and received with a later floor (a narrower window): the peak rises, and so does the floor
    written = await writer.write_all([("audio", 1, 7, 590.0, heard_ms - 5, 590.0)], max_skew_ms=0, max_backdate_ms=hour)
    assert written == [0]
    raised = decode_value(await redis.get(key))
    assert (raised.position, raised.received_ms, raised.peak) == (10.0, heard_ms, 590.0)
    assert raised.completion_floor_ms is not None and raised.completion_floor_ms >= before - hour
    # not further: nothing changes, floor included
    stored = await redis.get(key)
    written = await writer.write_all([("audio", 1, 7, 5.0, heard_ms - 9, 5.0)], max_skew_ms=0, max_backdate_ms=60_000)
    assert written == [0]
    assert await redis.get(key) == stored
    await live_heartbeat(redis, 1, 20.0)  # a live heartbeat: later than any floor
    live = decode_value(await redis.get(key))
    assert (live.position, live.peak, live.completion_floor_ms) == (20.0, 590.0, None)
    assert len((await redis.get(key)).split(":")) == 4


@pytest.mark.parametrize(("body", "status", "named"), BAD_SYNCS)
async def test_bad_syncs_get_a_clear_4xx_and_write_nothing(
    client: httpx.AsyncClient, redis: Redis, db: asyncpg.Pool, token: str, body: bytes, status: int, named: str
) -> None:
    await seed(db, users=7)
    response = await client.post(
        "/progress/sync", content=body, headers={**auth(token), "Content-Type": "application/json"}
    )
    assert response.status_code == status
    assert named in response.text
    assert await redis.keys("*") == []


async def test_a_sync_needs_a_token_post_and_a_body_within_the_limit(
    client: httpx.AsyncClient, redis: Redis, db: asyncpg.Pool, token: str
) -> None:
    await seed(db, users=7)
    assert (await client.post("/progress/sync", content=sync_body(1))).status_code == 401
    assert (await client.put("/progress/sync", content=sync_body(1), headers=auth(token))).status_code == 405
    padded = json.dumps({"items": [item(1, 1.0, ago(5))], "pad": "x" * 300_000}).encode()
    response = await client.post("/progress/sync", content=padded, headers=auth(token))
    assert (response.status_code, "262144" in response.text) == (413, True)
    assert await redis.keys("*") == []
    assert (await client.post("/progress/sync", content=sync_body(500), headers=auth(token))).status_code == 200


@pytest.mark.regression
@pytest.mark.parametrize("depth", [1000, 5000, 40000])
async def test_a_body_nested_past_the_decoders_stack_is_a_400_not_a_500(
    client: httpx.AsyncClient, redis: Redis, db: asyncpg.Pool, token: str, depth: int
) -> None:
    """Found by an outside attack: msgspec's RecursionError escaped the route as the server's bare 500."""
    await seed(db, users=7)
    nested = b'{"a":' * depth + b"1" + b"}" * depth
    for body in (b'{"items":[{"x":' + nested + b"}]}", b'{"items":[' + nested + b"]}"):
        response = await client.post("/progress/sync", content=body, headers=auth(token))
        assert (response.status_code, "recursion" in response.text) == (400, True)
    assert await redis.keys("*") == []


async def test_a_bug_in_a_route_is_a_json_500_counted_and_logged(
    app: Routes, client: httpx.AsyncClient, db: asyncpg.Pool, token: str, caplog: pytest.LogCaptureFixture
) -> None:
    await seed(db, users=7)

    async def broken(*_: object, **__: object) -> None:
        raise RuntimeError("a bug")

    app.api.state.handlers.sync.offline.apply = broken
    before = metric("progress_http_requests_total", route="/progress/sync", status="500")
    response = await client.post("/progress/sync", content=sync_body(1), headers=auth(token))
    assert (response.status_code, response.json()) == (500, {"detail": "internal error, retry later"})
    assert metric("progress_http_requests_total", route="/progress/sync", status="500") == before + 1
    assert any(r.exc_info and "a bug" in str(r.exc_info[1]) for r in caplog.records)


@pytest.mark.regression
async def test_while_the_shard_count_changes_a_sync_item_older_than_the_previous_layouts_value_is_not_applied(
    settings: Settings, redis: Redis, db: asyncpg.Pool, token: str
) -> None:
    """Found by an outside attack: a pod on the old shard count buffered a later position, and a sync on a
    pod of the new count answered `applied` for an older item. The value of either layout that is newer stands."""
    await seed(db, users=7, contents=3)
    changed = settings.model_copy(update={"progress_buffer_shards": 4, "progress_buffer_previous_shards": 1})
    await live_heartbeat(redis, 1, 321.0, ms(ago(30)))  # the one-shard names: a pod on the old count
    await live_heartbeat(redis, 2, 321.0, ms(ago(300)))
    async with running_app(changed) as (_, client):
        outcomes = await sync(client, token, item(1, 10.0, ago(60)), item(2, 10.0, ago(60)), item(3, 10.0, ago(60)))
        assert outcomes == [(False, OLDER_THAN_STORED), (True, None), (True, None)]
        answers = (await client.get("/progress/audio?ids=1,2,3", headers=auth(token))).json()["data"]
    assert [(a["content_id"], a["position"]) for a in answers] == [(1, 321.0), (2, 10.0), (3, 10.0)]
    # what the flush of both layouts leaves: the newer of each (one drain, every shard in turn)
    await Flusher(changed.model_copy(update={"progress_flush_concurrency": 1}).flush, redis, db).flush_cycle()
    assert await db.fetchval("SELECT array_agg(position ORDER BY audio_id) FROM audios_audioprogress") == [
        321.0,
        10.0,
        10.0,
    ]


@pytest.mark.regression
@pytest.mark.parametrize(
    "listened_at", ["0001-01-01T00:00:00+14:00", "0001-01-01T00:00:00+00:01", "1960-01-01T00:00:00Z"]
)
async def test_a_listen_dated_before_the_app_existed_is_refused_and_reads_stay_whole(
    client: httpx.AsyncClient, redis: Redis, db: asyncpg.Pool, token: str, flusher: Flusher, listened_at: str
) -> None:
    """Found by an attack: a year-0 listened_at was stored as a BC timestamp that failed every read of its content
    (a 500, for the other users of the read batch too); a 1960 one was not ordered in Redis (a later, older one won)."""
    await seed(db, users=7, contents=3)
    body = {"content_type": "audio", "content_id": 2, "position": 595, "listened_at": listened_at}
    response = await client.post("/progress/sync", json={"items": [body]}, headers=auth(token))
    assert response.status_code == 200
    assert response.json()["items"] == [{"applied": False, "reason": "listened_at is before 2000-01-01T00:00:00Z"}]
    assert await redis.keys("progress:*") == []
    await flusher.flush_cycle()
    assert await db.fetchval("SELECT count(*) FROM audios_audioprogress") == 0
    assert (await client.get("/progress/audio/2", headers=auth(token))).status_code == 404
