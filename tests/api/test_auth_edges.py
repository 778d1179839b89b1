"""Tokens and identity headers a hostile client (or an outside review) sends: 401, never 500, no write."""

import base64
import hashlib
import hmac
import json
import logging
import time

import httpx
import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from redis.asyncio import Redis

import service.auth
from service.api.routes import Routes
from service.app import create_app
from service.auth import Authenticator, AuthError
from service.config import ConfigError, Settings
from tests.helpers import TEST_JWT_SECRET, auth, running_app

_FUTURE = int(time.time()) + 3600
_RSA = rsa.generate_private_key(public_exponent=65537, key_size=2048)
_RSA_PUBLIC_PEM = (
    _RSA.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()
)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def hand_made(header: dict[str, object], claims: dict[str, object], key: bytes | None) -> str:
    """A token PyJWT would refuse to make: alg none, or HMAC keyed with a public key."""
    signing_input = f"{_b64(json.dumps(header).encode())}.{_b64(json.dumps(claims).encode())}"
    signature = hmac.new(key, signing_input.encode(), hashlib.sha256).digest() if key else b""
    return f"{signing_input}.{_b64(signature)}"


async def post(client: httpx.AsyncClient, headers: httpx._types.HeaderTypes) -> httpx.Response:
    return await client.post("/audios/progress", json={"audio_id": 1, "position": 2}, headers=headers)


async def test_mixed_algorithm_tokens_are_401_with_no_error_logged(
    settings: Settings, redis: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    rsa_only = settings.model_copy(
        update={"jwt_secret": "", "jwt_public_key": _RSA_PUBLIC_PEM, "jwt_algorithms": "RS256"}
    )
    # configurations start-up now refuses, as a deployment before this check could have them
    mixed = [
        (
            rsa_only.model_copy(update={"jwt_algorithms": "RS256,ES256"}),
            jwt.encode({"user_id": 5, "exp": _FUTURE}, ec.generate_private_key(ec.SECP256R1()), algorithm="ES256"),
        ),
        (
            rsa_only.model_copy(update={"jwt_algorithms": "HS256,RS256"}),
            jwt.encode({"user_id": 5, "exp": _FUTURE}, TEST_JWT_SECRET, algorithm="HS256"),
        ),
    ]
    async with running_app(rsa_only) as (app, client):
        with caplog.at_level(logging.INFO):
            for config, token in mixed:
                app.api.state.handlers.ingest.authenticator = Authenticator(config.auth)
                response = await post(client, auth(token))
                assert response.status_code == 401, response.text
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
    assert await redis.keys("*") == []


@pytest.mark.parametrize("algorithms", ["RS256,ES256", "HS256,RS256", "ES256", "PS256,RS256,HS512"])
def test_start_up_refuses_algorithms_the_rsa_key_cannot_serve(settings: Settings, algorithms: str) -> None:
    with pytest.raises(ConfigError, match="cannot be verified with the configured key"):
        create_app(
            settings.model_copy(
                update={"jwt_secret": "", "jwt_public_key": _RSA_PUBLIC_PEM, "jwt_algorithms": algorithms}
            )
        )


@pytest.mark.regression
@pytest.mark.parametrize("algorithms", ["", " , "])
@pytest.mark.parametrize("key", ["secret", "public key"])
def test_start_up_refuses_an_empty_algorithm_list_that_would_answer_every_token_401(
    settings: Settings, algorithms: str, key: str
) -> None:
    keys = {"jwt_secret": "", "jwt_public_key": _RSA_PUBLIC_PEM} if key == "public key" else {}
    with pytest.raises(ConfigError, match="JWT_ALGORITHMS is empty"):
        create_app(settings.model_copy(update={**keys, "jwt_algorithms": algorithms}))


def test_start_up_accepts_one_key_kind_and_refuses_asymmetric_algorithms_with_a_secret(settings: Settings) -> None:
    create_app(
        settings.model_copy(
            update={"jwt_secret": "", "jwt_public_key": _RSA_PUBLIC_PEM, "jwt_algorithms": "RS256,PS256"}
        )
    )
    with pytest.raises(ConfigError):
        create_app(settings.model_copy(update={"jwt_algorithms": "HS256,ES256"}))


async def test_hostile_tokens_are_401_and_write_nothing(
    settings: Settings, redis: Redis, client: httpx.AsyncClient
) -> None:
    secret = TEST_JWT_SECRET.encode()
    signed = [
        hand_made({"alg": "none", "typ": "JWT"}, {"user_id": 7, "exp": _FUTURE}, None),
        hand_made({"alg": "none"}, {"user_id": 7, "exp": _FUTURE}, None).rsplit(".", 1)[0] + ".",
        hand_made({"alg": "HS256", "typ": "JWT"}, {"user_id": 7, "exp": 10**400}, secret),  # signed, exp overflows
        hand_made({"alg": "HS256", "typ": "JWT"}, {"user_id": 7, "exp": 1e300}, secret),
        hand_made({"alg": "HS256", "typ": "JWT"}, {"user_id": 7, "exp": True}, secret),
    ]
    infinite = _b64(b'{"alg":"HS256"}') + "." + _b64(b'{"user_id":7,"exp":1e400}')  # JSON reads 1e400 as inf
    signed.append(f"{infinite}.{_b64(hmac.new(secret, infinite.encode(), hashlib.sha256).digest())}")
    for claim in (7.0, True, "seven", "1_0", " 11 ", "+9", "٣", 2**63, 0, -4, None, [7]):
        signed.append(jwt.encode({"user_id": claim, "exp": _FUTURE}, TEST_JWT_SECRET, algorithm="HS256"))
    for token in signed:
        response = await post(client, auth(token))
        assert response.status_code == 401, (token, response.text)
        assert "detail" in response.json()
    assert await redis.keys("*") == []


async def test_hs256_signed_with_the_rsa_public_key_is_401(settings: Settings, redis: Redis) -> None:
    rsa_only = settings.model_copy(
        update={"jwt_secret": "", "jwt_public_key": _RSA_PUBLIC_PEM, "jwt_algorithms": "RS256"}
    )
    forged = hand_made({"alg": "HS256", "typ": "JWT"}, {"user_id": 7, "exp": _FUTURE}, _RSA_PUBLIC_PEM.encode())
    genuine = jwt.encode({"user_id": 7, "exp": _FUTURE}, _RSA, algorithm="RS256")
    async with running_app(rsa_only) as (_, client):
        assert (await post(client, auth(forged))).status_code == 401
        assert await redis.keys("*") == []
        assert (await post(client, auth(genuine))).status_code == 201


async def test_doubled_authorization_is_401(client: httpx.AsyncClient, redis: Redis, token: str) -> None:
    other = jwt.encode({"user_id": 8, "exp": _FUTURE}, TEST_JWT_SECRET, algorithm="HS256")
    response = await post(client, [("Authorization", f"Bearer {other}"), ("Authorization", f"Bearer {token}")])
    assert response.status_code == 401
    assert await redis.keys("*") == []


async def test_gateway_header_must_be_canonical_and_single(settings: Settings, redis: Redis) -> None:
    async with running_app(settings.model_copy(update={"auth_mode": "gateway"})) as (_, client):
        for value in (b"+9", b" 8 ", b"1_0", "٣".encode(), b"007", b"9223372036854775808", b"0", b"1e3"):
            assert (await post(client, [(b"X-User-Id", value)])).status_code == 401, value
        doubled = await post(client, [("X-User-Id", "5"), ("X-User-Id", "6")])
        assert doubled.status_code == 401
        assert await redis.keys("*") == []
        assert (await post(client, [("X-User-Id", "9223372036854775807")])).status_code == 201
        # a gateway that authenticates may forward the app's Authorization too: only its header counts
        forwarded = await post(client, [("X-User-Id", "5"), ("Authorization", "Bearer whatever")])
        assert forwarded.status_code == 201
        assert await redis.exists("progress:latest_position:audio:1:5") == 1


async def test_in_jwt_mode_a_user_header_nobody_vouches_for_is_ignored(
    app: Routes, client: httpx.AsyncClient, token: str, redis: Redis
) -> None:
    response = await post(client, [("Authorization", f"Bearer {token}"), ("X-User-Id", "5"), ("X-User-Id", "6")])
    assert response.status_code == 201
    assert await redis.keys("progress:latest_position:*") == ["progress:latest_position:audio:1:7"]


@pytest.mark.slow
def test_five_cache_generations_of_distinct_tokens_stay_bounded_and_verified(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cache's generations made 5,000 tokens, not 50,000: the bound does not depend on their size, and 25,000
    tokens are five of them (100,000 tokens were two at the real size, exactly the bound: a cache that never
    dropped a generation held 100,000 and passed)."""
    monkeypatch.setattr(service.auth, "_VERIFIED_GENERATION_SIZE", 5_000)
    generation = service.auth._VERIFIED_GENERATION_SIZE
    authenticator = Authenticator(settings.auth)
    header = _b64(b'{"alg":"HS256","typ":"JWT"}')
    secret = TEST_JWT_SECRET.encode()
    for user_id in range(1, 5 * generation + 1):
        signing_input = f"{header}.{_b64(json.dumps({'user_id': user_id, 'exp': _FUTURE}).encode())}"
        token = f"{signing_input}.{_b64(hmac.new(secret, signing_input.encode(), hashlib.sha256).digest())}"
        assert authenticator.user_id(f"Bearer {token}".encode(), None) == user_id
        if user_id % (generation // 2) == 0:
            # a cached token still answers its own user; a tampered one is still refused
            assert authenticator.user_id(f"Bearer {token}".encode(), None) == user_id
            # the signature's first character changed (not its last two: a base64url tail whose last two
            # characters differ only in padding bits decodes to the same signature, about 1 token in 1,000)
            payload, signature = token.rsplit(".", 1)
            tampered = f"{payload}.{'B' if signature[0] == 'A' else 'A'}{signature[1:]}"
            with pytest.raises(AuthError):
                authenticator.user_id(f"Bearer {tampered}".encode(), None)
    assert authenticator.cached_tokens() <= 2 * generation


async def test_an_aud_claim_is_ignored_unless_an_audience_is_configured(
    settings: Settings, client: httpx.AsyncClient, redis: Redis
) -> None:
    with_aud = jwt.encode(
        {"user_id": 9, "exp": _FUTURE, "aud": "some-other-service"}, TEST_JWT_SECRET, algorithm="HS256"
    )
    assert (await post(client, [("Authorization", f"Bearer {with_aud}")])).status_code == 201
    strict = Authenticator(settings.model_copy(update={"jwt_audience": "progress"}).auth)
    with pytest.raises(AuthError):
        strict.user_id(f"Bearer {with_aud}".encode(), None)
