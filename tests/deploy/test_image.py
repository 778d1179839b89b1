"""The image's CMD, exactly as the Dockerfile writes it, against the session's real servers.

No Docker engine here: the test reads CMD, ENV and HEALTHCHECK from the Dockerfile's last stage and
runs them with the project's virtualenv standing in for the image's /opt/venv. So the command the
image runs, the variable names it reads and the health check it uses cannot drift from what is tested.
"""

import asyncio
import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import asyncpg
import httpx
import pytest
from redis.asyncio import Redis

from service.auth import make_token
from service.config import Settings
from service.dev.embedded import free_port
from tests.deploy.files import VENV_BIN, image
from tests.helpers import TEST_JWT_SECRET, Servers, auth, clean_environment, seed, wait_ready

pytestmark = pytest.mark.slow  # runs the image's command as a process

HEARTBEATS = 60  # one log line each would be 60; start, drain and stop take about 15
IMAGE_VENV = "/opt/venv/bin"


def image_environment(servers: Servers, port: int) -> dict[str, str]:
    """The image's ENV (its virtualenv swapped for ours), then what docs/deploy.md tells ops to set."""
    env = clean_environment()
    for name, value in image().env.items():
        env[name] = value.replace(IMAGE_VENV, str(VENV_BIN)).replace("$PATH", os.environ.get("PATH", ""))
    env.update(
        HOST="127.0.0.1",  # the image listens on 0.0.0.0; a test stays on loopback
        PORT=str(port),
        REDIS_URL=servers.redis_url,
        DATABASE_URL=servers.database_url,
        JWT_SECRET=TEST_JWT_SECRET,
        # the monolith's broker; a Valkey database of its own stands in for it
        CELERY_BROKER_URL=servers.redis_url.rsplit("/", 1)[0] + "/3",
        LOG_LEVEL="INFO",
        # no load balancer to leave: a short drain, still logged, instead of the default 5 s waited out
        SHUTDOWN_DRAIN_SECONDS="0.5",
    )
    return env


def _start(command: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    with open(log_path, "wb") as log_file:
        return subprocess.Popen(command, env=env, stdout=log_file, stderr=subprocess.STDOUT)


def _tail(log_path: Path) -> str:
    return log_path.read_text()[-3000:]


def _json_lines(log_path: Path) -> list[dict[str, object]]:
    """Every line the process wrote, each parsed whole: a line that is not one JSON object fails here."""
    return [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]


def _health_check(env: dict[str, str]) -> int:
    return subprocess.run(image().healthcheck, env=env, capture_output=True, timeout=10, check=False).returncode


async def test_image_cmd_takes_a_heartbeat_and_flushes_it_on_sigterm(
    servers: Servers, db: asyncpg.Pool, redis: Redis, tmp_path: Path
) -> None:
    await seed(db, users=3, contents=3)
    port = free_port()
    env = image_environment(servers, port)
    command = image().cmd
    executable = shutil.which(command[0], path=env["PATH"])
    assert executable == str(VENV_BIN / command[0]), f"{command[0]} resolves to {executable}"
    log_path = tmp_path / "serve.log"
    process = _start([executable, *command[1:]], env, log_path)
    try:
        base_url = f"http://127.0.0.1:{port}"
        await asyncio.to_thread(wait_ready, base_url, process, 30, log_path)
        assert _health_check(env) == 0

        token = make_token(Settings(jwt_secret=env["JWT_SECRET"]), 3)
        async with httpx.AsyncClient(base_url=base_url) as client:
            for position in range(1, HEARTBEATS + 1):
                response = await client.post(
                    "/engagements/progress/lesson", headers=auth(token), json={"lesson_id": 2, "position": position}
                )
                assert (response.status_code, response.json()) == (201, {"data": True})
        assert await redis.exists("progress:latest_position:lesson:2:3")
        assert await db.fetchval("SELECT count(*) FROM engagements_lessonprogress") == 0  # flushed every 60 s

        process.send_signal(signal.SIGTERM)  # the image's STOPSIGNAL
        assert await asyncio.to_thread(process.wait, 40) == 0  # a graceful stop is a success
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()

    # the final flush on shutdown persisted the last heartbeat
    row = await db.fetchrow("SELECT position FROM engagements_lessonprogress WHERE user_id = 3 AND lesson_id = 2")
    assert row is not None and row["position"] == HEARTBEATS
    assert _health_check(env) != 0, "the health check must fail once the process is gone"

    lines = _json_lines(log_path)
    for line in lines:
        assert {"time", "level", "message", "logger"} <= line.keys(), line
    messages = [str(line["message"]) for line in lines]
    assert "progress-service started" in messages
    assert messages[-2:] == ["Application shutdown complete.", f"Finished server process [{process.pid}]"]
    # one line per heartbeat would be HEARTBEATS lines at least; start and stop take a handful
    assert len(lines) < HEARTBEATS // 2, "\n".join(messages)
