"""Log lines as ops read them: one JSON object per line with the documented fields, level from LOG_LEVEL."""

import io
import json
import logging
import subprocess
from collections.abc import Iterator, Sequence

import asyncpg
import httpx
import pytest
from fastapi import FastAPI
from redis.asyncio import Redis

from service.compose import completion_route
from service.config import Settings
from service.dev.embedded import free_port
from service.logs import JsonFormatter, RequestIdMiddleware
from service.outbox.messages import Message, PublishResult
from service.outbox.relay import Relay
from tests.deploy.files import VENV_BIN
from tests.helpers import Servers, auth, clean_environment, seed

DOCUMENTED_FIELDS = {"time", "level", "message", "logger"}


def _flush_once(servers: Servers, **overrides: str) -> tuple[int, list[dict[str, object]]]:
    """`progress-service flush --once` in its own process; its stderr parsed line by line."""
    env = clean_environment()
    env.update({"REDIS_URL": servers.redis_url, "DATABASE_URL": servers.database_url, **overrides})
    done = subprocess.run(
        [str(VENV_BIN / "progress-service"), "flush", "--once"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    lines = [json.loads(line) for line in done.stderr.splitlines() if line.strip()]  # each line, whole, is JSON
    for line in lines:
        assert DOCUMENTED_FIELDS <= line.keys(), line
    return done.returncode, lines


async def test_flusher_logs_lost_and_dropped_heartbeats_with_their_key(
    servers: Servers, client: httpx.AsyncClient, token: str, db: asyncpg.Pool, redis: Redis
) -> None:
    await seed(db, users=3)  # the token's user 7 does not exist: its heartbeat is dropped
    response = await client.post(
        "/engagements/progress/lesson", json={"lesson_id": 1, "position": 5}, headers=auth(token)
    )
    assert response.status_code == 201
    await redis.sadd("progress:pending_flush:audio", "2:3")  # a member whose value expired

    returncode, lines = _flush_once(servers, LOG_LEVEL="INFO")

    assert returncode == 0
    expired = next(line for line in lines if line["level"] == "ERROR")
    assert expired["logger"] == "service.progress.flush.batch"
    assert (expired["content_type"], expired["key"]) == ("audio", "2:3")
    dropped = next(line for line in lines if line["level"] == "WARNING")
    assert (dropped["content_type"], dropped["key"]) == ("lesson", "1:7")
    assert "unknown user or content" in str(dropped["message"])


async def test_outage_logs_carry_the_content_type_at_the_configured_level(
    servers: Servers, client: httpx.AsyncClient, token: str, db: asyncpg.Pool, redis: Redis
) -> None:
    for lesson_id in (1, 2, 3):
        response = await client.post(
            "/engagements/progress/lesson", json={"lesson_id": lesson_id, "position": 5}, headers=auth(token)
        )
        assert response.status_code == 201
    nowhere = f"postgresql://postgres@127.0.0.1:{free_port()}/progress"

    returncode, quiet = _flush_once(servers, DATABASE_URL=nowhere, LOG_LEVEL="ERROR")
    assert returncode == 1  # a failed batch
    assert [line for line in quiet if line["level"] == "WARNING"] == []

    returncode, lines = _flush_once(servers, DATABASE_URL=nowhere, LOG_LEVEL="WARNING")
    assert returncode == 1
    skipped = next(line for line in lines if "database unavailable" in str(line["message"]))
    assert (skipped["level"], skipped["content_type"]) == ("WARNING", "lesson")
    assert await redis.scard("progress:pending_flush:lesson") == 3  # never claimed, nothing lost


@pytest.fixture
def captured() -> Iterator[io.StringIO]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield stream
    finally:
        root.removeHandler(handler)


async def test_request_id_tags_the_log_lines_of_a_request(captured: io.StringIO) -> None:
    api = FastAPI()

    @api.get("/work")
    async def work() -> dict[str, bool]:
        logging.getLogger("service.test").warning("slow dependency")
        return {"ok": True}

    @api.get("/fail")
    async def fail() -> None:
        raise RuntimeError("boom")

    api.add_middleware(RequestIdMiddleware)
    transport = httpx.ASGITransport(app=api, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        given = await client.get("/work", headers={"X-Request-ID": "gw-123"})
        generated = await client.get("/work")
        failed = await client.get("/fail", headers={"X-Request-ID": "gw-456"})

    assert given.headers["x-request-id"] == "gw-123"
    assert len(generated.headers["x-request-id"]) == 32
    assert failed.status_code == 500
    lines = [json.loads(line) for line in captured.getvalue().splitlines()]
    ours = [line for line in lines if line["logger"] in ("service.test", "service.logs")]
    assert [line["request_id"] for line in ours] == ["gw-123", generated.headers["x-request-id"], "gw-456"]
    assert ours[2]["level"] == "ERROR" and "RuntimeError: boom" in str(ours[2]["exception"])
    assert all(DOCUMENTED_FIELDS <= line.keys() for line in ours)


class RefusingBroker:
    """A broker that answers every message with an error reply: refused for good, so the relay parks it."""

    async def publish(self, messages: Sequence[Message]) -> PublishResult:
        return PublishResult(refused={message.row_id: "ResponseError: NOPERM" for message in messages})


async def test_a_parked_outbox_row_is_logged_with_its_outbox_and_row_id(
    settings: Settings, db: asyncpg.Pool, captured: io.StringIO
) -> None:
    row_id = await db.fetchval(
        "INSERT INTO progress_completion_event (content_type, content_id, user_id, completed_at) "
        "VALUES ('lesson', 1, 1, now()) RETURNING id"
    )
    one_attempt = settings.model_copy(update={"outbox_max_attempts": 1})  # parked at the first refusal
    relay = Relay(one_attempt.relay, db, [completion_route(one_attempt, RefusingBroker())])

    result = await relay.relay_once()

    assert result.parked == {"completion": 1}
    lines = [json.loads(line) for line in captured.getvalue().splitlines()]
    (parked,) = [line for line in lines if line["logger"] == "service.outbox.settle" and line["level"] == "ERROR"]
    assert (parked["outbox"], parked["row_id"]) == ("completion", row_id)
    assert DOCUMENTED_FIELDS <= parked.keys()
