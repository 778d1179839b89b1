"""The cutover of docs/cutover.md, run: a random canary sends each heartbeat to the service or to the monolith's
legacy task (tests/monolith/legacy.py), both writing the same rows; then the rollback: the gateway back to the
monolith, the service stopped (its final flush) or drained by `flush --once`, `status` showing nothing pending.

After it every row holds the last position sent, each completed key was announced exactly once (by the service's
completion event, run by the monolith's real Celery worker, or by the legacy task's own advance_user_journey),
by the path that set its completed_at, and nothing that never reached the end was completed."""

import asyncio
import random
from collections import Counter
from contextlib import AsyncExitStack
from datetime import datetime

import asyncpg
import httpx
import pytest
from redis.asyncio import Redis

from service.auth import make_token
from service.config import Settings
from service.progress.completion import completes
from tests.helpers import (
    Servers,
    auth,
    flush_once,
    run_status,
    running_app,
    seed,
    wait_for,
    with_broker,
)
from tests.monolith.fixtures import Broker, Executions, kwargs_of
from tests.monolith.legacy import MARGIN_S, TABLES, LegacyWriter

DURATION_S = 600
USERS, CONTENTS = 20, 3  # per content type: 120 keys
CANARY_ROUNDS = 10
# rounds during which a flush (`flush --once`, in its own process) runs beside the heartbeats of both paths
FLUSHED_DURING = (4, 8)
ROUTES = {"lesson": ("/engagements/progress/lesson", "lesson_id"), "audio": ("/audios/progress", "audio_id")}
Key = tuple[str, int, int]  # (content_type, content_id, user_id)


class Heartbeats:
    """Every key's position per round, increasing (some reach the end, some never do), and what was sent."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.keys = [(t, c, u) for t in ROUTES for c in range(1, CONTENTS + 1) for u in range(1, USERS + 1)]
        self.start = {key: rng.uniform(0, 200) for key in self.keys}
        self.step = {key: rng.uniform(15, 70) for key in self.keys}
        self.last: dict[Key, float] = {}  # the last position sent per key
        self.furthest: dict[Key, float] = {}

    def round(self, round_: int) -> list[tuple[Key, float]]:
        """This round's heartbeats: most keys send one (a user may pause a round), positions capped at the end."""
        sent = []
        for key in self.keys:
            if self.rng.random() < 0.8:
                position = round(min(DURATION_S, self.start[key] + round_ * self.step[key]), 3)
                self.last[key] = position
                self.furthest[key] = max(position, self.furthest.get(key, 0.0))
                sent.append((key, position))
        return sent


async def _send_round(
    heartbeats: list[tuple[Key, float]],
    rng: random.Random,
    legacy: LegacyWriter,
    client: httpx.AsyncClient | None,
    tokens: dict[int, str],
) -> None:
    """Each heartbeat to the service (a 50 % canary, when `client` is given) or to the legacy task; one per key."""
    limit = asyncio.Semaphore(16)

    async def send(key: Key, position: float, to_service: bool) -> None:
        content_type, content_id, user_id = key
        async with limit:
            if to_service:
                assert client is not None
                route, id_field = ROUTES[content_type]
                response = await client.post(
                    route, json={id_field: content_id, "position": position}, headers=auth(tokens[user_id])
                )
                assert response.status_code == 201, response.text
            else:
                await legacy.save_progress(content_type, content_id=content_id, user_id=user_id, position=position)

    await asyncio.gather(*(send(key, p, client is not None and rng.random() < 0.5) for key, p in heartbeats))


async def _rows(db: asyncpg.Pool) -> dict[Key, asyncpg.Record]:
    rows = {}
    for content_type in ROUTES:
        table, column, _ = TABLES[content_type]
        for row in await db.fetch(f"SELECT {column} AS content_id, user_id, position, completed_at FROM {table}"):
            rows[(content_type, row["content_id"], row["user_id"])] = row
    return rows


async def _nothing_pending(servers: Servers) -> None:
    """`progress-service status --json`: no position pending or in flight, no completion owed to the monolith."""
    status = await run_status(servers)
    assert status.code == 0, status.stderr
    buffer = status.report["buffer"]
    assert {t: (buffer["pending"][t], buffer["in_flight"][t]) for t in ROUTES} == dict.fromkeys(ROUTES, (0, 0))
    assert status.report["outbox"]["completion"]["owed"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("rollback", ["stop the pods", "flush --once"])
async def test_a_canary_beside_the_legacy_task_then_a_rollback_keeps_every_position_and_announces_once(
    settings: Settings,
    servers: Servers,
    redis: Redis,
    db: asyncpg.Pool,
    broker: Broker,
    executions: Executions,
    rollback: str,
) -> None:
    await seed(db, users=USERS, contents=CONTENTS, duration_s=DURATION_S)
    rng = random.Random(f"cutover {rollback}")
    heartbeats = Heartbeats(rng)
    legacy = LegacyWriter(db)
    tokens = {user_id: make_token(settings, user_id) for user_id in range(1, USERS + 1)}
    # the flushes of the canary are FLUSHED_DURING's, so that the rollback's drain always has positions to write:
    # "stop the pods" has only its final flush left, "flush --once" has API pods without a flusher
    service = with_broker(
        settings,
        broker.url,
        progress_flusher_enabled=rollback == "stop the pods",
        progress_flush_interval_seconds=3600,
    )
    async with AsyncExitStack() as pods:
        _, client = await pods.enter_async_context(running_app(service))
        for round_ in range(CANARY_ROUNDS):
            sending = _send_round(heartbeats.round(round_), rng, legacy, client, tokens)
            if round_ in FLUSHED_DURING:
                flushed, _ = await asyncio.gather(asyncio.to_thread(flush_once, servers), sending)
                assert flushed.returncode == 0, flushed.stderr
            else:
                await sending
        # the rollback: the gateway sends everything back to the monolith, while the service still holds positions
        await _send_round(heartbeats.round(CANARY_ROUNDS), rng, legacy, None, tokens)
        if rollback == "stop the pods":
            await pods.aclose()  # SIGTERM: the final flush, then the relay's last pass
        else:
            drained = flush_once(servers)
            assert drained.returncode == 0, drained.stderr

            async def published() -> bool:
                owed = "SELECT count(*) FROM progress_completion_event WHERE published_at IS NULL"
                return await db.fetchval(owed) == 0

            await wait_for(published, timeout_s=30)  # the running pods' relays
        await _nothing_pending(servers)
    await _send_round(heartbeats.round(CANARY_ROUNDS + 1), rng, legacy, None, tokens)

    rows = await _rows(db)
    assert {key: rows[key]["position"] for key in heartbeats.last} == heartbeats.last
    events = {
        (row["content_type"], row["content_id"], row["user_id"]): row["completed_at"]
        for row in await db.fetch("SELECT * FROM progress_completion_event")
    }
    ran = [kwargs_of(row) for row in await executions.wait_for(len(events))]
    by_service = Counter((k["content_type"], k["content_id"], k["user_id"]) for k in ran)
    by_legacy = Counter((a.content_type, a.content_id, a.user_id) for a in legacy.announced)
    legacy_dates = {(a.content_type, a.content_id, a.user_id): a.completed_at for a in legacy.announced}
    assert set(by_service) == set(events), "every completion event reached the monolith's task"
    reached_end = {key for key, furthest in heartbeats.furthest.items() if completes(furthest, DURATION_S, MARGIN_S)}
    completed = {key for key, row in rows.items() if row["completed_at"] is not None}
    assert completed == reached_end, "completed: exactly the keys that reached the end"
    assert reached_end and by_service and by_legacy, "both paths completed some keys"
    for key in completed:
        assert by_service[key] + by_legacy[key] == 1, f"{key}: announced {by_service[key]} + {by_legacy[key]} times"
        # the path that announced is the one whose completed_at the row keeps
        announced_at = events.get(key) or legacy_dates[key]
        assert rows[key]["completed_at"] == announced_at, key
    for k in ran:
        key = (k["content_type"], k["content_id"], k["user_id"])
        assert datetime.fromisoformat(k["completed_at"]) == rows[key]["completed_at"], key
    assert not (set(by_service) | set(by_legacy)) - completed, "an announcement of a key that is not completed"


@pytest.mark.slow
async def test_the_legacy_task_without_its_row_lock_announces_what_the_service_announced(
    settings: Settings, servers: Servers, redis: Redis, db: asyncpg.Pool
) -> None:
    """Why docs/cutover.md asks the legacy task to lock the row: a `get()` then `save()` that the service's flush
    completes in between sets completed_at again, and announces it a second time."""
    await seed(db, users=1, contents=1, duration_s=DURATION_S)
    legacy = LegacyWriter(db)
    await legacy.save_progress("lesson", content_id=1, user_id=1, position=100)
    async with running_app(settings) as (_, client):
        near_end = {"lesson_id": 1, "position": 595}
        headers = auth(make_token(settings, 1))
        assert (await client.post("/engagements/progress/lesson", json=near_end, headers=headers)).status_code == 201

    async def flush() -> None:
        assert (await asyncio.to_thread(flush_once, servers)).returncode == 0

    await legacy.save_progress("lesson", content_id=1, user_id=1, position=598, lock_row=False, after_read=flush)
    event = await db.fetchrow("SELECT completed_at FROM progress_completion_event")
    row = await db.fetchrow("SELECT completed_at FROM engagements_lessonprogress")
    assert event is not None and len(legacy.announced) == 1, "announced by both paths"
    assert row["completed_at"] == legacy.announced[0].completed_at != event["completed_at"]
