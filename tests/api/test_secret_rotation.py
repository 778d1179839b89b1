"""Rotating the token key: the previous secrets (or PEM keys) stay valid and are counted; any other key is 401."""

import subprocess
import time

import httpx
import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from redis.asyncio import Redis

from service.app import create_app
from service.config import ConfigError, Settings
from tests.helpers import REPO_ROOT, TEST_JWT_SECRET, Servers, auth, metric, running_app, service_command, service_env

_FUTURE = int(time.time()) + 3600
NEW_SECRET = "the-new-secret-0123456789abcdef-0123456789"
OLDER_SECRET = "an-older-secret-0123456789abcdef-012345678"
PREVIOUS = "progress_auth_previous_key_total"
_RSA_NEW, _RSA_OLD, _RSA_STRANGER = (rsa.generate_private_key(public_exponent=65537, key_size=2048) for _ in range(3))
_EC = ec.generate_private_key(ec.SECP256R1())


def _token(user_id: int, key: object, algorithm: str = "HS256") -> str:
    return jwt.encode({"user_id": user_id, "exp": _FUTURE}, key, algorithm=algorithm)  # type: ignore[arg-type]


def _pem(private: rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey) -> str:
    """The public key in PEM, as JWT_PUBLIC_KEY holds it."""
    return (
        private.public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        .decode()
    )


async def _post(client: httpx.AsyncClient, token: str) -> int:
    response = await client.post("/audios/progress", json={"audio_id": 1, "position": 2}, headers=auth(token))
    return response.status_code


async def test_a_token_of_a_previous_secret_gets_201_and_is_counted_on_every_request(
    settings: Settings, redis: Redis
) -> None:
    rotating = settings.model_copy(
        update={"jwt_secret": NEW_SECRET, "jwt_previous_secrets": f"{TEST_JWT_SECRET}, {OLDER_SECRET}"}
    )
    async with running_app(rotating) as (_, client):
        before = metric(PREVIOUS)
        assert await _post(client, _token(1, NEW_SECRET)) == 201
        assert metric(PREVIOUS) == before, "a token of the current secret is not a previous one"
        # the second request of a token is answered from the cache: still counted, the token is still in use
        assert [await _post(client, _token(2, TEST_JWT_SECRET)) for _ in range(2)] == [201, 201]
        assert await _post(client, _token(3, OLDER_SECRET)) == 201
        assert metric(PREVIOUS) == before + 3
        unknown = "a-secret-nobody-configured-0123456789abcdef"
        assert await _post(client, _token(4, unknown)) == 401
        assert metric(PREVIOUS) == before + 3
    assert await redis.smembers("progress:pending_flush:audio") == {"1:1", "1:2", "1:3"}


async def test_without_previous_secrets_the_old_secret_is_401(settings: Settings, redis: Redis) -> None:
    async with running_app(settings.model_copy(update={"jwt_secret": NEW_SECRET})) as (_, client):
        assert await _post(client, _token(2, TEST_JWT_SECRET)) == 401
    assert await redis.keys("*") == []


async def test_several_pem_keys_the_first_current_the_others_previous(settings: Settings, redis: Redis) -> None:
    rotating = settings.model_copy(
        update={"jwt_secret": "", "jwt_public_key": _pem(_RSA_NEW) + "\n" + _pem(_RSA_OLD), "jwt_algorithms": "RS256"}
    )
    async with running_app(rotating) as (_, client):
        before = metric(PREVIOUS)
        assert await _post(client, _token(1, _RSA_NEW, "RS256")) == 201
        assert metric(PREVIOUS) == before
        assert await _post(client, _token(2, _RSA_OLD, "RS256")) == 201
        assert metric(PREVIOUS) == before + 1
        assert await _post(client, _token(3, _RSA_STRANGER, "RS256")) == 401
    assert await redis.smembers("progress:pending_flush:audio") == {"1:1", "1:2"}


@pytest.mark.parametrize(
    ("update", "names"),
    [
        ({"jwt_previous_secrets": f"{TEST_JWT_SECRET},too-short"}, "JWT_PREVIOUS_SECRETS"),
        # an HS256 secret can verify nothing beside a public key
        (
            {
                "jwt_secret": "",
                "jwt_algorithms": "ES256",
                "jwt_public_key": _pem(_EC),
                "jwt_previous_secrets": "x" * 40,
            },
            "JWT_PUBLIC_KEY",
        ),
        # keys of two kinds: ES256 cannot be verified with the RSA one
        (
            {"jwt_secret": "", "jwt_algorithms": "ES256", "jwt_public_key": _pem(_EC) + _pem(_RSA_OLD)},
            "cannot be verified",
        ),
    ],
)
def test_start_up_refuses_previous_keys_that_cannot_serve(
    settings: Settings, update: dict[str, str], names: str
) -> None:
    with pytest.raises(ConfigError, match=names):
        create_app(settings.model_copy(update=update))


@pytest.mark.slow
def test_serve_refuses_to_start_with_a_short_previous_secret(servers: Servers) -> None:
    env = service_env(servers, JWT_SECRET=NEW_SECRET, JWT_PREVIOUS_SECRETS=f"{TEST_JWT_SECRET},0123456789")
    run = subprocess.run(
        service_command("serve", "--port", "0"), env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 2, run.stderr
    assert "configuration error: JWT_PREVIOUS_SECRETS holds a secret too short" in run.stderr
