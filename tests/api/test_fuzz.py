"""Fuzzing the live service against the committed openapi.yaml.

The real service runs as a subprocess (`progress-service serve`) on the real Valkey and Postgres
of the session. Schemathesis reads openapi.yaml as committed (the document is what is under test,
not what the app would serve today) and generates valid (positive) and invalid (negative) requests
for every operation: bodies, content types, methods, a missing Authorization header. Each answer
must not be a 5xx, must have a documented status code, and must match the documented content type
and body schema; schemathesis's other default checks run too (valid data accepted, invalid data
refused, a request without credentials refused, undocumented methods answered 405 with `Allow`).

On the progress routes every case also looks at Redis around the request: a 201 added exactly its
own pending member and value key, any other answer changed nothing.

Generation is derandomized with a fixed seed and bounded, so CI sends the same requests every
time in well under a minute; a failure reproduces with the curl command in its report.
"""

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import schemathesis
from redis import Redis

from service.auth import make_token
from service.config import Settings
from service.embedded import free_port
from service.progress.content import KIND_BY_PATH, ContentKind
from service.progress.keys import latest_position_key, pending_flush_key, pending_member
from tests.conftest import TEST_JWT_SECRET, Servers

OPENAPI_FILE = Path(__file__).resolve().parents[2] / "openapi.yaml"
USER_ID = 7

CONFIG = schemathesis.Config.from_dict(
    {
        "seed": 20240601,
        "generation": {
            "mode": "all",  # positive and negative
            "max-examples": 100,  # per operation and phase
            "deterministic": True,
            "database": "none",  # no example database: CI and a laptop run the same cases
        },
    }
)
schema = schemathesis.openapi.from_path(OPENAPI_FILE, config=CONFIG)


@dataclass(frozen=True)
class LiveService:
    base_url: str
    headers: dict[str, str]
    redis: "Redis[str]"


def _wait_ready(process: "subprocess.Popen[bytes]", base_url: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"the service exited with {process.returncode} before it was ready")
        try:
            if httpx.get(f"{base_url}/health/ready", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"the service was not ready within {timeout_s:.0f}s")


@pytest.fixture(scope="module")
def live_service(servers: Servers, migrated: str) -> Iterator[LiveService]:
    port = free_port()
    env = {
        **os.environ,
        "REDIS_URL": servers.redis_url,
        "DATABASE_URL": migrated,
        "JWT_SECRET": TEST_JWT_SECRET,
        "PROGRESS_FLUSHER_ENABLED": "false",  # pending members stay put, so each case can see its own
        "RELAY_ENABLED": "false",
        "EMAIL_PUBLISHER": "redis-stream",
        "LOG_LEVEL": "WARNING",
    }
    command = [str(Path(sys.executable).with_name("progress-service")), "serve", "--host", "127.0.0.1",
               "--port", str(port)]  # fmt: skip
    process = subprocess.Popen(command, env=env)
    base_url = f"http://127.0.0.1:{port}"
    redis: Redis[str] = Redis.from_url(servers.redis_url, decode_responses=True)
    try:
        _wait_ready(process, base_url)
        token = make_token(Settings(jwt_secret=TEST_JWT_SECRET), USER_ID)
        yield LiveService(base_url, {"Authorization": f"Bearer {token}"}, redis)
    finally:
        redis.close()
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _redis_state(redis: "Redis[str]", kind: ContentKind) -> tuple[int, set[str]]:
    return redis.dbsize(), redis.smembers(pending_flush_key(kind.name))


@schema.parametrize()
def test_every_answer_is_documented_and_only_a_201_writes(case: schemathesis.Case, live_service: LiveService) -> None:
    kind = KIND_BY_PATH.get(case.path)  # with any method: schemathesis also tries undocumented ones
    before = _redis_state(live_service.redis, kind) if kind else None

    # the valid token replaces any generated Authorization; negative cases that drop it still go without
    response = case.call_and_validate(base_url=live_service.base_url, headers=live_service.headers)

    if kind is None or before is None:
        return
    keys, members = _redis_state(live_service.redis, kind)
    if response.status_code != 201:
        assert (keys, members) == before, f"a {response.status_code} answer wrote to Redis"
        return
    assert isinstance(case.body, dict)
    content_id = int(case.body[kind.id_column])  # 42.0 is the integer 42 for JSON Schema, and for the service
    assert members == before[1] | {pending_member(content_id, USER_ID)}
    assert live_service.redis.exists(latest_position_key(kind.name, content_id, USER_ID))
    assert keys - before[0] in (0, 1, 2)  # its value key, and the pending set the first time


@schema.include(method="POST").parametrize()
def test_without_a_valid_token_every_progress_post_is_401_and_writes_nothing(
    case: schemathesis.Case, live_service: LiveService
) -> None:
    """The generated Authorization values as they are: empty, random, malformed, or none at all."""
    kind = KIND_BY_PATH[case.path]
    before = _redis_state(live_service.redis, kind)

    response = case.call_and_validate(base_url=live_service.base_url)

    # the method is checked first: the undocumented ones schemathesis also tries get 405 whatever the token
    assert response.status_code == (401 if case.method.upper() == "POST" else 405), response.text
    assert _redis_state(live_service.redis, kind) == before
