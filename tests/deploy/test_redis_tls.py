"""REDIS_URL=rediss://... as managed Redis services and TLS sidecars offer it, verified against a private CA.

The embedded Valkey has no TLS, so a TLS terminator (as stunnel or a cloud proxy would) sits in
front of it: the service's own client speaks TLS to it, and the data lands in the real Valkey.
"""

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from service.auth import make_token
from service.config import Settings
from service.redis_client import connect_redis
from tests.helpers import Servers, Tls, auth, running_app


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, ssl.SSLError):
        pass
    finally:
        writer.close()


@contextlib.asynccontextmanager
async def tls_terminator(tls: Tls, upstream_url: str) -> AsyncIterator[int]:
    upstream = urlsplit(upstream_url)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(tls.cert, tls.key)

    async def forward(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        reader, writer = await asyncio.open_connection(upstream.hostname, upstream.port)
        await asyncio.gather(_pipe(client_reader, writer), _pipe(reader, client_writer))

    server = await asyncio.start_server(forward, "127.0.0.1", 0, ssl=context)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()


async def test_service_stores_heartbeats_through_rediss_url(
    servers: Servers, settings: Settings, redis: Redis, tls: Tls
) -> None:
    database = urlsplit(servers.redis_url).path
    async with tls_terminator(tls, servers.redis_url) as port:
        over_tls = settings.model_copy(
            update={"redis_url": f"rediss://127.0.0.1:{port}{database}?ssl_ca_certs={tls.ca}"}
        )
        async with running_app(over_tls) as (_, client):
            assert (await client.get("/health/ready")).status_code == 200
            response = await client.post(
                "/audios/progress", json={"audio_id": 4, "position": 12.5}, headers=auth(make_token(over_tls, 5))
            )
            assert response.status_code == 201
    assert await redis.exists("progress:latest_position:audio:4:5")


async def test_rediss_url_verifies_the_server_certificate(servers: Servers, settings: Settings, tls: Tls) -> None:
    async with tls_terminator(tls, servers.redis_url) as port:
        # no ssl_ca_certs: the system trust store does not know the private CA, so the handshake fails
        untrusted = connect_redis(settings.model_copy(update={"redis_url": f"rediss://127.0.0.1:{port}/0"}).redis)
        try:
            with pytest.raises(RedisConnectionError, match="certificate verify failed"):
                await untrusted.ping()
        finally:
            await untrusted.aclose()
