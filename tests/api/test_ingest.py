"""The four progress POSTs against a real Redis: exact keys, TTL, members, and every bad input."""

import asyncio
import time

import httpx
import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from redis.asyncio import Redis

from service.api.routes import Routes
from service.app import create_app
from service.config import ConfigError, Settings
from service.progress.ingest.buffer import decode_value
from tests.helpers import TEST_JWT_SECRET, MovedClock, auth, running_app

ROUTES = [
    ("/engagements/progress/lesson", "lesson_id", "lesson"),
    ("/audios/progress", "audio_id", "audio"),
    ("/meditations/progress", "meditation_id", "meditation"),
    ("/lives/progress", "live_id", "live"),
]


async def all_keys(redis: Redis) -> list[str]:
    return sorted(await redis.keys("*"))


@pytest.mark.parametrize(("path", "field", "content_type"), ROUTES)
async def test_each_route_writes_exactly_the_contract_keys(
    client: httpx.AsyncClient, redis: Redis, token: str, path: str, field: str, content_type: str
) -> None:
    before_ms = time.time_ns() / 1_000_000
    response = await client.post(path, json={field: 42, "position": 12.5}, headers=auth(token))
    after_ms = time.time_ns() / 1_000_000 + 1  # receive times are strictly increasing: a few µs ahead at most

    assert response.status_code == 201
    assert response.json() == {"data": True}
    value_key = f"progress:latest_position:{content_type}:42:7"
    pending_key = f"progress:pending_flush:{content_type}"
    assert await all_keys(redis) == sorted([value_key, pending_key])
    stored = decode_value(await redis.get(value_key))
    assert stored.position == 12.5
    assert before_ms <= stored.received_ms <= after_ms
    assert await redis.ttl(value_key) == -1  # pending: no TTL until it is flushed
    assert await redis.smembers(pending_key) == {"42:7"}


async def test_repeated_heartbeats_keep_only_the_latest(client: httpx.AsyncClient, redis: Redis, token: str) -> None:
    for position in (5, 10, 15.25):
        response = await client.post(
            "/audios/progress", json={"audio_id": 3, "position": position}, headers=auth(token)
        )
        assert response.status_code == 201
    assert decode_value(await redis.get("progress:latest_position:audio:3:7")).position == 15.25
    assert await redis.smembers("progress:pending_flush:audio") == {"3:7"}


async def test_a_heartbeat_is_the_newest_write_of_its_key_whatever_time_is_stored(
    client: httpx.AsyncClient, redis: Redis, token: str
) -> None:
    # a value stamped a minute ahead (an older release's pod whose clock ran fast): the heartbeat Redis receives
    # after it is later, so it stands, dated 1 µs after the stored time (the upsert moves forward to it too)
    future_ms = time.time_ns() // 1_000_000 + 60_000
    await redis.set("progress:latest_position:lesson:1:7", f"99.0:{future_ms}")
    response = await client.post(
        "/engagements/progress/lesson", json={"lesson_id": 1, "position": 1}, headers=auth(token)
    )
    assert response.status_code == 201
    assert await redis.get("progress:latest_position:lesson:1:7") == f"1.0:{future_ms}:99.0:1"
    assert await redis.smembers("progress:pending_flush:lesson") == {"1:7"}


async def test_concurrent_requests_share_pipelines_and_all_land(
    client: httpx.AsyncClient, redis: Redis, settings: Settings
) -> None:

    from service.auth import make_token

    async def one(user_id: int) -> int:
        response = await client.post(
            "/lives/progress", json={"live_id": 9, "position": user_id}, headers=auth(make_token(settings, user_id))
        )
        return response.status_code

    statuses = await asyncio.gather(*(one(user_id) for user_id in range(1, 201)))
    assert statuses == [201] * 200
    assert await redis.scard("progress:pending_flush:live") == 200
    for user_id in (1, 77, 200):
        assert decode_value(await redis.get(f"progress:latest_position:live:9:{user_id}")).position == user_id


async def test_unknown_fields_are_ignored(client: httpx.AsyncClient, redis: Redis, token: str) -> None:
    body = {"meditation_id": 2, "position": 30, "app_version": "9.9", "extra": {"nested": [1, 2]}}
    response = await client.post("/meditations/progress", json=body, headers=auth(token))
    assert response.status_code == 201
    assert await redis.smembers("progress:pending_flush:meditation") == {"2:7"}


@pytest.mark.parametrize("spelled", ["42.0", "4.2e1", "42E0"])
async def test_a_whole_number_id_spelled_as_a_float_is_that_id(
    client: httpx.AsyncClient, redis: Redis, token: str, spelled: str
) -> None:
    """openapi.yaml says `type: integer`, and JSON Schema counts 42.0 as the integer 42."""
    body = f'{{"audio_id": {spelled}, "position": 3}}'.encode()
    response = await client.post(
        "/audios/progress", content=body, headers={**auth(token), "Content-Type": "application/json"}
    )
    assert response.status_code == 201
    assert await redis.smembers("progress:pending_flush:audio") == {"42:7"}
    assert decode_value(await redis.get("progress:latest_position:audio:42:7")).position == 3


BAD_BODIES = [
    pytest.param(b'{"position": 1}', 422, "lesson_id", id="missing-id"),
    pytest.param(b'{"lesson_id": 1}', 422, "position", id="missing-position"),
    pytest.param(b'{"lesson_id": "1", "position": 1}', 422, "lesson_id", id="id-as-string"),
    pytest.param(b'{"lesson_id": 1.5, "position": 1}', 422, "lesson_id", id="id-as-float"),
    pytest.param(b'{"lesson_id": 9007199254740993.0, "position": 1}', 422, "lesson_id", id="id-float-past-2**53"),
    pytest.param(b'{"lesson_id": 1e300, "position": 1}', 422, "lesson_id", id="id-float-past-64-bit"),
    pytest.param(b'{"lesson_id": 0.0, "position": 1}', 422, "lesson_id", id="id-zero-as-float"),
    pytest.param(b'{"lesson_id": true, "position": 1}', 422, "lesson_id", id="id-as-bool"),
    pytest.param(b'{"lesson_id": 0, "position": 1}', 422, "lesson_id", id="id-zero"),
    pytest.param(b'{"lesson_id": -3, "position": 1}', 422, "lesson_id", id="id-negative"),
    pytest.param(b'{"lesson_id": 9223372036854775808, "position": 1}', 422, "lesson_id", id="id-beyond-64-bit"),
    pytest.param(b'{"lesson_id": 1, "position": "10"}', 422, "position", id="position-as-string"),
    pytest.param(b'{"lesson_id": 1, "position": null}', 422, "position", id="position-null"),
    pytest.param(b'{"lesson_id": 1, "position": -0.5}', 422, "position", id="position-negative"),
    pytest.param(b'{"lesson_id": 1, "position": 86400.01}', 422, "position", id="position-over-a-day"),
    pytest.param(b'{"lesson_id": 1, "position": NaN}', 422, "position", id="position-nan"),
    pytest.param(b'{"lesson_id": 1, "position": Infinity}', 422, "position", id="position-infinity"),
    pytest.param(b'{"lesson_id": 1, "position": 1e400}', 422, "position", id="position-overflows-to-inf"),
    pytest.param(b'{"lesson_id": 1, "position": 1', 400, "JSON", id="malformed-json"),
    pytest.param(b"", 400, "JSON", id="empty-body"),
    pytest.param(b"[1, 2]", 422, "object", id="array-body"),
    pytest.param(b'"text"', 422, "object", id="string-body"),
    pytest.param(b"null", 422, "object", id="null-body"),
]


@pytest.mark.parametrize(("body", "status", "named"), BAD_BODIES)
async def test_bad_bodies_get_a_clear_4xx_and_write_nothing(
    client: httpx.AsyncClient, redis: Redis, token: str, body: bytes, status: int, named: str
) -> None:
    response = await client.post(
        "/engagements/progress/lesson", content=body, headers={**auth(token), "Content-Type": "application/json"}
    )
    assert response.status_code == status
    assert named in response.text  # the body names the field or the problem
    assert isinstance(response.json()["detail"], list)
    assert await all_keys(redis) == []


async def test_a_body_over_the_limit_is_413_and_writes_nothing(
    client: httpx.AsyncClient, redis: Redis, token: str
) -> None:
    padding = "x" * 5000
    response = await client.post(
        "/audios/progress", json={"audio_id": 1, "position": 1, "pad": padding}, headers=auth(token)
    )
    assert response.status_code == 413
    assert "4096" in response.json()["detail"]

    async def chunked():  # no Content-Length: the limit is enforced while reading
        yield b'{"audio_id": 1, "position": 1, "pad": "'
        for _ in range(10):
            yield b"y" * 1000
        yield b'"}'

    response = await client.post("/audios/progress", content=chunked(), headers=auth(token))
    assert response.status_code == 413
    assert await all_keys(redis) == []


def _token(claims: dict[str, object], key: str = TEST_JWT_SECRET, algorithm: str = "HS256") -> str:
    return jwt.encode(claims, key, algorithm=algorithm)


_FUTURE = int(time.time()) + 3600
BAD_AUTH = [
    pytest.param(None, "missing Authorization", id="missing"),
    pytest.param("Basic dXNlcjpwYXNz", "Bearer", id="wrong-scheme"),
    pytest.param("Bearer ", "Bearer", id="empty-token"),
    pytest.param("Bearer not.a.jwt", "invalid token", id="malformed"),
    pytest.param("Bearer " + _token({"user_id": 7, "exp": int(time.time()) - 10}), "expired", id="expired"),
    pytest.param("Bearer " + _token({"user_id": 7, "exp": _FUTURE}, key="another-secret-0123456789abcdefghijk"),
                 "invalid token", id="wrong-signature"),
    pytest.param("Bearer " + _token({"user_id": 7}), "exp", id="no-exp"),
    pytest.param("Bearer " + _token({"sub": "7", "exp": _FUTURE}), "user_id", id="no-user-claim"),
    pytest.param("Bearer " + _token({"user_id": "abc", "exp": _FUTURE}), "user_id", id="non-numeric-user"),
    pytest.param("Bearer " + _token({"user_id": 0, "exp": _FUTURE}), "user_id", id="user-zero"),
    pytest.param("Bearer " + jwt.encode({"user_id": 7, "exp": _FUTURE}, None, algorithm="none"),
                 "invalid token", id="alg-none"),
]  # fmt: skip


@pytest.mark.parametrize(("authorization", "named"), BAD_AUTH)
async def test_bad_tokens_get_401_and_write_nothing(
    client: httpx.AsyncClient, redis: Redis, authorization: str | None, named: str
) -> None:
    headers = {"Authorization": authorization} if authorization is not None else {}
    response = await client.post("/lives/progress", json={"live_id": 1, "position": 1}, headers=headers)
    assert response.status_code == 401
    assert named in response.json()["detail"]
    assert await all_keys(redis) == []


async def test_a_cached_token_is_still_refused_once_expired(settings: Settings, redis: Redis) -> None:
    short = _token({"user_id": 5, "exp": int(time.time()) + 1})
    wall_clock = MovedClock(time.time)
    async with running_app(settings, wall_clock=wall_clock) as (_, client):
        first = await client.post("/lives/progress", json={"live_id": 1, "position": 1}, headers=auth(short))
        assert first.status_code == 201
        await redis.flushdb()
        wall_clock.advance(2.1)
        second = await client.post("/lives/progress", json={"live_id": 1, "position": 2}, headers=auth(short))
        assert second.status_code == 401
    assert await all_keys(redis) == []


async def test_other_methods_on_progress_routes_are_405(client: httpx.AsyncClient, redis: Redis, token: str) -> None:
    response = await client.get("/audios/progress", headers=auth(token))
    assert response.status_code == 405
    assert response.headers["allow"] == "POST"
    assert await all_keys(redis) == []


async def test_gateway_mode_trusts_the_configured_header(settings: Settings, redis: Redis) -> None:
    gateway = settings.model_copy(update={"auth_mode": "gateway", "jwt_secret": ""})
    async with running_app(gateway) as (_, client):
        ok = await client.post("/audios/progress", json={"audio_id": 4, "position": 2}, headers={"X-User-Id": "31"})
        missing = await client.post("/audios/progress", json={"audio_id": 4, "position": 2})
        bad = await client.post("/audios/progress", json={"audio_id": 4, "position": 2}, headers={"X-User-Id": "abc"})
    assert (ok.status_code, missing.status_code, bad.status_code) == (201, 401, 401)
    assert await redis.smembers("progress:pending_flush:audio") == {"4:31"}


async def test_es256_public_key_verification(settings: Settings, redis: Redis) -> None:
    private = ec.generate_private_key(ec.SECP256R1())
    public_pem = (
        private.public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        .decode()
    )
    asymmetric = settings.model_copy(
        update={"jwt_secret": "", "jwt_public_key": public_pem, "jwt_algorithms": "ES256", "jwt_audience": "progress"}
    )
    good = jwt.encode({"user_id": 12, "exp": _FUTURE, "aud": "progress"}, private, algorithm="ES256")
    wrong_aud = jwt.encode({"user_id": 12, "exp": _FUTURE, "aud": "other"}, private, algorithm="ES256")
    other_key = jwt.encode(
        {"user_id": 12, "exp": _FUTURE, "aud": "progress"}, ec.generate_private_key(ec.SECP256R1()), algorithm="ES256"
    )
    async with running_app(asymmetric) as (_, client):
        statuses = [
            (await client.post("/audios/progress", json={"audio_id": 1, "position": 1}, headers=auth(t))).status_code
            for t in (good, wrong_aud, other_key)
        ]
    assert statuses == [201, 401, 401]
    assert await redis.smembers("progress:pending_flush:audio") == {"1:12"}


@pytest.mark.parametrize(
    ("update", "names"),
    [
        ({"jwt_secret": ""}, "JWT_SECRET"),
        ({"jwt_secret": "", "jwt_algorithms": "RS256"}, "JWT_PUBLIC_KEY"),
        ({"jwt_secret": "short"}, "JWT_SECRET"),
    ],
)
def test_jwt_mode_without_a_usable_key_refuses_to_start(settings: Settings, update: dict[str, str], names: str) -> None:
    with pytest.raises(ConfigError, match=names):
        create_app(settings.model_copy(update=update))


async def test_a_client_gone_mid_body_gets_no_answer_and_writes_nothing(app: Routes, redis: Redis, token: str) -> None:
    messages = iter(
        [{"type": "http.request", "body": b'{"audio_id": 1,', "more_body": True}, {"type": "http.disconnect"}]
    )
    sent: list[dict[str, object]] = []

    async def receive() -> dict[str, object]:
        return next(messages)

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/audios/progress",
        "headers": [(b"authorization", f"Bearer {token}".encode())],
    }
    await app(scope, receive, send)  # no exception for the server to log as an application error
    assert sent == []
    assert await all_keys(redis) == []
