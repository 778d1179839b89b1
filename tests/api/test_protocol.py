"""The heartbeat answered by `serve`'s protocol (service/api/protocol.py) answers as the ASGI route does.

Each request is sent twice to a real server: whole in one write (the protocol answers it) and with its
body in a later write (uvicorn's cycle and the ASGI route answer it); the two answers are the same bytes
but the date, and so are the keys and the counters they leave."""

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import asyncpg
import pytest
import uvicorn
from prometheus_client import REGISTRY
from redis.asyncio import Redis

from service.api.protocol import ServiceProtocol
from service.auth import make_token
from service.config import Settings
from tests.helpers import running_app, seed

AUDIO = b"/audios/progress"


class Server:
    def __init__(self, port: int, answered_below_asgi: list[int]) -> None:
        self.port = port
        self.answered_below_asgi = answered_below_asgi  # one entry per request the protocol answered itself


@pytest.fixture
async def server(settings: Settings, redis: Redis, db: asyncpg.Pool) -> AsyncIterator[Server]:
    await seed(db, users=7, contents=3)
    door = settings.model_copy(update={"content_catalog_enabled": True})
    async with running_app(door) as (app, _):
        counted: list[int] = []

        def counting(received: Callable[..., Awaitable[object]]) -> Callable[..., Awaitable[object]]:
            def answer(*args: object) -> Awaitable[object]:
                counted.append(1)
                return received(*args)

            return answer

        app.received = {path: counting(received) for path, received in app.received.items()}  # type: ignore[misc]
        assert app.reads_received is not None
        app.reads_received = counting(app.reads_received)
        config = uvicorn.Config(
            app, host="127.0.0.1", port=0, http=ServiceProtocol, lifespan="off", log_config=None, access_log=False
        )
        server = uvicorn.Server(config)
        serving = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        try:
            yield Server(int(server.servers[0].sockets[0].getsockname()[1]), counted)
        finally:
            server.should_exit = True
            await serving


def post(body: bytes, *, headers: bytes, path: bytes = AUDIO, length: int | None = None) -> tuple[bytes, bytes]:
    size = len(body) if length is None else length
    head = b"POST %s HTTP/1.1\r\nHost: t\r\n%sContent-Length: %d\r\n\r\n" % (path, headers, size)
    return head, body


def bearer(token: str) -> bytes:
    return b"Authorization: Bearer " + token.encode() + b"\r\n"


async def read_answer(reader: asyncio.StreamReader) -> bytes:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
    return head + await asyncio.wait_for(reader.readexactly(length), 5)


async def exchange(port: int, head: bytes, body: bytes, *, split: bool) -> bytes:
    """One request on a new connection; `split`: its body in a second write, once the head was taken."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        if split:
            writer.write(head)
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.write(body)
        else:
            writer.write(head + body)
        await writer.drain()
        return await read_answer(reader)
    finally:
        writer.close()


def undated(answer: bytes) -> bytes:
    return b"\r\n".join(line for line in answer.split(b"\r\n") if not line.lower().startswith(b"date:"))


def requests_counted(status: int) -> float:
    return (
        REGISTRY.get_sample_value("progress_http_requests_total", {"route": AUDIO.decode(), "status": str(status)})
        or 0.0
    )


@pytest.mark.parametrize(
    ("status", "body", "auth", "length"),
    [
        (201, b'{"audio_id": 1, "position": 5}', "token", None),
        (400, b'{"audio_id": 1, "position": ', "token", None),
        (422, b'{"audio_id": 1, "position": -1}', "token", None),
        (422, b'{"audio_id": 1}', "token", None),
        (401, b'{"audio_id": 1, "position": 5}', "", None),
        (401, b'{"audio_id": 1, "position": 5}', "bad", None),
        (401, b'{"audio_id": 1, "position": 5}', "twice", None),
        (404, b'{"audio_id": 999, "position": 5}', "token", None),
        (413, b'{"audio_id": 1, "position": 5}' + b" " * 5000, "token", None),
        (413, b'{"audio_id": 1, "position": 5}', "token", 5000),
    ],
)
async def test_every_answer_is_the_same_whichever_way_in(
    server: Server, redis: Redis, settings: Settings, status: int, body: bytes, auth: str, length: int | None
) -> None:
    token = make_token(settings, 7)
    headers = {"token": bearer(token), "": b"", "bad": bearer(token[:-4]), "twice": bearer(token) * 2}[auth]
    head, body = post(body, headers=headers, length=length)
    answers = []
    for split in (False, True):
        await redis.flushdb()
        before = requests_counted(status), len(server.answered_below_asgi)
        if length is None:
            answers.append(await exchange(server.port, head, body, split=split))
        else:  # a length declared over the limit, and no body: answered at its head either way
            answers.append(await exchange(server.port, head, b"", split=split))
        assert requests_counted(status) == before[0] + 1
        # whole in one write: the protocol's; in two: the ASGI route's, as a body past the limit (a declared 413 is
        # answered at its head)
        assert len(server.answered_below_asgi) == before[1] + (0 if split or length or status == 413 else 1)
        keys = sorted(await redis.keys("progress:*"))
        assert keys == (["progress:latest_position:audio:1:7", "progress:pending_flush:audio"] if status == 201 else [])
    below, asgi = answers
    assert below.startswith(b"HTTP/1.1 %d " % status), below
    assert undated(below) == undated(asgi)


@pytest.mark.parametrize(
    ("status", "target", "auth"),
    [
        (200, b"/progress/audio/1", "token"),
        (404, b"/progress/audio/2", "token"),
        (422, b"/progress/audio/x", "token"),
        (422, b"/progress/podcast/1", "token"),
        (401, b"/progress/audio/1", ""),
        (200, b"/progress/audio?ids=1,2,3", "token"),
        (422, b"/progress/audio?ids=" + b",".join(b"%d" % i for i in range(1, 102)), "token"),
        (422, b"/progress/audio", "token"),
        (405, b"/progress/sync", "token"),  # the sync's path: the sync's answer
    ],
)
async def test_every_read_is_answered_the_same_whichever_way_in(
    server: Server, redis: Redis, settings: Settings, status: int, target: bytes, auth: str
) -> None:
    token = make_token(settings, 7)
    stored = await exchange(server.port, *post(b'{"audio_id": 1, "position": 5}', headers=bearer(token)), split=False)
    assert stored.startswith(b"HTTP/1.1 201 ")
    headers = bearer(token) if auth else b""
    # a GET with a byte of body: whole in one write, the protocol's; the byte in a second write, ASGI's (it is ignored)
    head = b"GET %s HTTP/1.1\r\nHost: t\r\n%sContent-Length: 1\r\n\r\n" % (target, headers)
    answers = []
    for split in (False, True):
        before = len(server.answered_below_asgi)
        answers.append(await exchange(server.port, head, b"x", split=split))
        below_asgi = not split and status != 405
        assert len(server.answered_below_asgi) == before + below_asgi
    below, asgi = answers
    assert below.startswith(b"HTTP/1.1 %d " % status), below
    assert undated(below) == undated(asgi)


async def test_pipelined_heartbeats_are_answered_in_order_on_a_kept_connection(
    server: Server, redis: Redis, settings: Settings
) -> None:
    token = make_token(settings, 7)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        for round_ in range(2):  # one write of three requests, twice: the connection is kept
            requests = [
                post(b'{"audio_id": %d, "position": %d}' % (content, 10 * round_ + content), headers=bearer(token))
                for content in (1, 2, 999)
            ]
            writer.write(b"".join(head + body for head, body in requests))
            await writer.drain()
            answers = [await read_answer(reader) for _ in requests]
            assert [answer[:12] for answer in answers] == [b"HTTP/1.1 201", b"HTTP/1.1 201", b"HTTP/1.1 404"]
            assert await redis.get("progress:latest_position:audio:2:7") is not None
        assert server.answered_below_asgi  # the first of each write at least
    finally:
        writer.close()


async def test_connection_close_is_answered_then_closed(server: Server, redis: Redis, settings: Settings) -> None:
    head, body = post(
        b'{"audio_id": 1, "position": 5}', headers=bearer(make_token(settings, 7)) + b"Connection: close\r\n"
    )
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        writer.write(head + body)
        await writer.drain()
        answer = await read_answer(reader)
        assert answer.startswith(b"HTTP/1.1 201 ") and b"\r\nconnection: close\r\n" in answer
        assert await asyncio.wait_for(reader.read(), 5) == b""
    finally:
        writer.close()
    assert server.answered_below_asgi == [1]
    assert await redis.exists("progress:latest_position:audio:1:7") == 1


@pytest.mark.parametrize(("status", "padding"), [(201, 0), (413, 6000)])
async def test_a_chunked_body_of_one_byte_chunks_is_answered_below_asgi_until_it_outgrows_a_heartbeat(
    server: Server, redis: Redis, settings: Settings, status: int, padding: int
) -> None:
    body = b'{"audio_id": 1, "position": 5}' + b" " * padding
    chunks = b"".join(b"1\r\n%s\r\n" % body[i : i + 1] for i in range(len(body))) + b"0\r\n\r\n"
    head = b"POST %s HTTP/1.1\r\nHost: t\r\n%sTransfer-Encoding: chunked\r\n\r\n" % (
        AUDIO,
        bearer(make_token(settings, 7)),
    )
    before = len(server.answered_below_asgi)
    answer = await exchange(server.port, head, chunks, split=False)
    assert answer.startswith(b"HTTP/1.1 %d " % status), answer
    # a body past a heartbeat's limit goes on in uvicorn's cycle, whose route answers 413: the protocol keeps at
    # most the limit of any body (one bytearray, not a copy per chunk)
    assert len(server.answered_below_asgi) == before + (1 if status == 201 else 0)
    keys = sorted(await redis.keys("progress:*"))
    assert keys == (["progress:latest_position:audio:1:7", "progress:pending_flush:audio"] if status == 201 else [])
