"""Fuzzing the live service against the committed openapi.yaml.

The real service runs as a subprocess (`progress-service serve`) on the real Valkey and Postgres
of the session. Schemathesis reads openapi.yaml as committed (the document is what is under test,
not what the app would serve today) and generates valid (positive) and invalid (negative) requests
for every operation: bodies, content types, methods, a missing Authorization header. Each answer
must not be a 5xx, must have a documented status code, and must match the documented content type
and body schema; schemathesis's other default checks run too (valid data accepted, invalid data
refused, a request without credentials refused, undocumented methods answered 405 with `Allow`).

On the progress routes every case also looks at Redis around the request: a 201 added exactly its
own pending member and value key; a 200 of the offline sync added only members and value keys of
the token's user for the items it was sent (user 7 and contents 1..100 of every type exist, so
generated items can be applied); the reads and any other answer changed nothing.

Generation is derandomized with a fixed seed and bounded, so CI sends the same requests every
time in well under a minute; a failure reproduces with the curl command in its report.
"""

import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import pytest
import schemathesis
from redis import Redis

from service.auth import make_token
from service.config import Settings
from service.dev.embedded import free_port
from service.progress.content import CONTENT_KINDS, KIND_BY_PATH
from service.progress.keys import STANDALONE, pending_member
from tests.helpers import TEST_JWT_SECRET, Servers, wait_ready

pytestmark = pytest.mark.slow  # schemathesis against a live server

OPENAPI_FILE = Path(__file__).resolve().parents[2] / "service" / "api" / "openapi.yaml"
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
        # invalid data may also be refused for its size (a sync of 501 bulky items is over the 256 KiB limit)
        "checks": {"negative_data_rejection": {"expected-statuses": ["400", "401", "404", "405", "413", "422"]}},
    }
)
schema = schemathesis.openapi.from_path(OPENAPI_FILE, config=CONFIG)


@dataclass(frozen=True)
class LiveService:
    base_url: str
    headers: dict[str, str]
    redis: "Redis[str]"


@pytest.fixture(scope="module")
async def fuzz_content(migrated: str) -> AsyncIterator[None]:
    """User 7 and contents 1..100 of every type, so that generated sync items can be applied; removed after."""
    conn = await asyncpg.connect(migrated)
    tables = [kind.content_table for kind in CONTENT_KINDS]
    try:
        await conn.execute(
            "INSERT INTO users_user (id, email) VALUES ($1, 'fuzz@example.com') ON CONFLICT DO NOTHING", USER_ID
        )
        for table in tables:
            await conn.execute(
                f"INSERT INTO {table} (id, title, duration) SELECT i, 'fuzz', 600 "
                "FROM generate_series(1, 100) i ON CONFLICT DO NOTHING"
            )
        yield
    finally:
        for table in tables:
            await conn.execute(f"DELETE FROM {table} WHERE id <= 100 AND title = 'fuzz'")
        await conn.execute("DELETE FROM users_user WHERE email = 'fuzz@example.com'")
        await conn.close()


@pytest.fixture(scope="module")
def live_service(servers: Servers, migrated: str, fuzz_content: None) -> Iterator[LiveService]:
    port = free_port()
    env = {
        **os.environ,
        "REDIS_URL": servers.redis_url,
        "DATABASE_URL": migrated,
        "JWT_SECRET": TEST_JWT_SECRET,
        "PROGRESS_FLUSHER_ENABLED": "false",  # pending members stay put, so each case can see its own
        "RELAY_ENABLED": "false",
        "EMAIL_PUBLISHER": "redis-stream",
        "SHUTDOWN_DRAIN_SECONDS": "0",  # no load balancer to leave: the default 5 s would be waited out at the stop
        "LOG_LEVEL": "WARNING",
    }
    command = [
        str(Path(sys.executable).with_name("progress-service")),
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    process = subprocess.Popen(command, env=env)
    base_url = f"http://127.0.0.1:{port}"
    redis: Redis[str] = Redis.from_url(servers.redis_url, decode_responses=True)
    try:
        wait_ready(base_url, process)
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


RedisState = tuple[int, dict[str, set[str]]]


def _redis_state(redis: "Redis[str]") -> RedisState:
    return redis.dbsize(), {
        kind.name: redis.smembers(STANDALONE.shards_of(kind.name)[0].pending_key) for kind in CONTENT_KINDS
    }


def _check_sync_writes(case: schemathesis.Case, redis: "Redis[str]", before: RedisState, after: RedisState) -> None:
    assert isinstance(case.body, dict)
    sent: dict[str, set[str]] = {kind.name: set() for kind in CONTENT_KINDS}
    for item in case.body["items"]:
        sent[item["content_type"]].add(pending_member(int(item["content_id"]), USER_ID))
    for name, members in after[1].items():
        added = members - before[1][name]
        assert added <= sent[name], f"the sync added members it was not sent: {added - sent[name]}"
        for member in added:
            content_id = int(member.split(":")[0])
            assert redis.exists(STANDALONE.value_key(name, content_id, USER_ID))
    # value keys of the items, and a pending set the first time
    assert after[0] - before[0] <= sum(len(members) for members in sent.values()) + len(CONTENT_KINDS)


@schema.parametrize()
def test_every_answer_is_documented_and_only_a_201_writes(case: schemathesis.Case, live_service: LiveService) -> None:
    kind = KIND_BY_PATH.get(case.path)  # with any method: schemathesis also tries undocumented ones
    before = _redis_state(live_service.redis)

    # the valid token replaces any generated Authorization; negative cases that drop it still go without
    response = case.call_and_validate(base_url=live_service.base_url, headers=live_service.headers)

    after = _redis_state(live_service.redis)
    if case.path == "/progress/sync" and case.method.upper() == "POST" and response.status_code == 200:
        _check_sync_writes(case, live_service.redis, before, after)
        return
    if kind is None or response.status_code != 201:
        assert after == before, f"a {response.status_code} answer to {case.method} {case.path} wrote to Redis"
        return
    assert isinstance(case.body, dict)
    content_id = int(case.body[kind.id_column])  # 42.0 is the integer 42 for JSON Schema, and for the service
    assert after[1][kind.name] == before[1][kind.name] | {pending_member(content_id, USER_ID)}
    assert live_service.redis.exists(STANDALONE.value_key(kind.name, content_id, USER_ID))
    assert after[0] - before[0] in (0, 1, 2)  # its value key, and the pending set the first time


@schema.include(method="POST").parametrize()
def test_without_a_valid_token_every_progress_post_is_401_and_writes_nothing(
    case: schemathesis.Case, live_service: LiveService
) -> None:
    """The generated Authorization values as they are: empty, random, malformed, or none at all."""
    before = _redis_state(live_service.redis)

    response = case.call_and_validate(base_url=live_service.base_url)

    # the method is checked first: the undocumented ones schemathesis also tries get 405 whatever the token
    assert response.status_code == (401 if case.method.upper() == "POST" else 405), response.text
    assert _redis_state(live_service.redis) == before
