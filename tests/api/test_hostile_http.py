"""Hostile HTTP against a real uvicorn server (the protocol `serve` runs, the heartbeat answered below ASGI): slow
bodies, header bloat, duplicate JSON keys, a JSON body under another content type. Each writes nothing it should not."""

import asyncio
import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import asyncpg
import pytest
import uvicorn
from redis.asyncio import Redis

from service.api import http_limits
from service.api.protocol import ServiceProtocol
from service.config import Settings
from tests.helpers import running_app, seed

BODY_DEADLINE_S = 0.5


@pytest.fixture
async def server(settings: Settings, redis: Redis) -> AsyncIterator[int]:
    async with running_app(settings) as (app, _):
        # the handlers' deadline, shortened for the test (BODY_READ_TIMEOUT_S in service)
        app.api.state.handlers.ingest.body_read_timeout_s = BODY_DEADLINE_S
        app.api.state.handlers.sync.body_read_timeout_s = BODY_DEADLINE_S
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=0,
            http=ServiceProtocol,
            lifespan="off",
            log_config=None,
            access_log=False,
        )
        server = uvicorn.Server(config)
        serving = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        try:
            yield int(server.servers[0].sockets[0].getsockname()[1])
        finally:
            server.should_exit = True
            await serving


def request(token: str, body: bytes, *, content_type: bytes = b"application/json", extra: bytes = b"") -> bytes:
    return (
        b"POST /audios/progress HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer "
        + token.encode()
        + b"\r\nContent-Type: "
        + content_type
        + b"\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n"
        + extra
        + b"\r\n"
        + body
    )


async def exchange(port: int, data: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(65536), 5)
    writer.close()
    return answer


async def test_a_body_trickled_a_byte_at_a_time_is_cut_off(server: int, redis: Redis, token: str) -> None:
    body = b'{"audio_id": 1, "position": 5}'
    head = request(token, body)[: -len(body)]
    reader, writer = await asyncio.open_connection("127.0.0.1", server)
    writer.write(head)
    trickled = 0
    answer = b""

    async def trickle() -> None:
        nonlocal trickled
        for byte in body:
            writer.write(bytes([byte]))
            trickled += 1
            await asyncio.sleep(0.1)

    sender = asyncio.create_task(trickle())
    try:
        answer = await asyncio.wait_for(reader.read(65536), 5)
        try:  # the server hung up after answering: end of stream, or a reset if our bytes were still coming
            closed = await asyncio.wait_for(reader.read(65536), 5) == b""
        except ConnectionResetError:
            closed = True
    finally:
        sender.cancel()
        await asyncio.gather(sender, return_exceptions=True)
        writer.close()
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert b"connection: close" in answer.lower() and closed
    assert trickled < len(body)  # cut off mid-body, not served when it finally arrived
    assert await redis.keys("*") == []


async def test_header_bloat_is_refused_with_431_and_the_server_keeps_serving(
    server: int, redis: Redis, token: str
) -> None:
    bloat = b"X-Bloat: " + b"a" * (4 * http_limits.MAX_HEADER_BYTES) + b"\r\n"
    answer = await exchange(server, request(token, b'{"audio_id": 1, "position": 5}', extra=bloat))
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:100]
    many = b"".join(b"X-H%d: v\r\n" % i for i in range(5000))
    assert (await exchange(server, request(token, b"{}", extra=many))).startswith(b"HTTP/1.1 431 ")
    assert await redis.keys("*") == []
    ok = await exchange(server, request(token, b'{"audio_id": 1, "position": 5}'))
    assert ok.startswith(b"HTTP/1.1 201 ")


async def test_duplicate_json_keys_the_last_one_wins(server: int, redis: Redis, token: str) -> None:
    answer = await exchange(server, request(token, b'{"audio_id": 1, "position": 5, "audio_id": 2}'))
    assert answer.startswith(b"HTTP/1.1 201 ")
    assert await redis.smembers("progress:pending_flush:audio") == {"2:7"}


async def test_a_json_body_is_read_as_json_whatever_its_content_type(server: int, redis: Redis, token: str) -> None:
    plain = await exchange(server, request(token, b'{"audio_id": 3, "position": 5}', content_type=b"text/plain"))
    assert plain.startswith(b"HTTP/1.1 201 ")
    form = await exchange(
        server, request(token, b"audio_id=4&position=5", content_type=b"application/x-www-form-urlencoded")
    )
    assert form.startswith(b"HTTP/1.1 400 ")
    assert await redis.smembers("progress:pending_flush:audio") == {"3:7"}


async def test_a_head_trickled_a_byte_at_a_time_is_cut_off(
    server: int, redis: Redis, token: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(http_limits, "HEADER_READ_TIMEOUT_S", 0.5)
    head = request(token, b'{"audio_id": 1, "position": 5}')
    reader, writer = await asyncio.open_connection("127.0.0.1", server)

    async def trickle() -> None:
        for byte in head:
            writer.write(bytes([byte]))
            await asyncio.sleep(0.05)

    sender = asyncio.create_task(trickle())
    try:
        answer = await asyncio.wait_for(reader.read(65536), 5)
    finally:
        sender.cancel()
        await asyncio.gather(sender, return_exceptions=True)
        writer.close()
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert await redis.keys("*") == []


async def test_a_pipelined_request_after_a_large_body_is_not_taken_for_a_huge_head(
    server: int, redis: Redis, db: asyncpg.Pool, token: str
) -> None:
    await seed(db, users=7)
    # one send: an offline sync whose body (20 KB: one item and padding) is over the head limit, then
    # the start of the next request on the same connection
    listened_at = datetime.now(UTC).isoformat()
    body = json.dumps(
        {
            "items": [{"content_type": "lesson", "content_id": 1, "position": 123.0, "listened_at": listened_at}],
            "pad": "x" * 20_000,
        }
    ).encode()
    sync = (
        b"POST /progress/sync HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer "
        + token.encode()
        + b"\r\nContent-Type: application/json\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )
    answer = await exchange(server, sync + b"GET /health/live HTTP/1.1\r\nHo")
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    assert await redis.exists("progress:latest_position:lesson:1:7") == 1
