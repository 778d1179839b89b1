"""Session fixtures of the monolith stand-in: a broker Valkey of its own and one real `celery worker`.

The broker is a separate Valkey so a test can stop it (a broker outage) without touching the
service's Redis. The worker consumes both task queues with the solo pool and no gossip, mingle or
heartbeat: it is up in a second or two and its executions land in `monolith_task_execution`.
"""

import asyncio
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import redis

from service.dev import embedded
from tests.helpers import wait_for
from tests.monolith.worker import CREATE_TABLE_SQL

ROOT = Path(__file__).resolve().parents[2]
QUEUES = "onion-progress,emails"


@dataclass
class Broker:
    server: embedded.EmbeddedRedis

    @property
    def url(self) -> str:
        return self.server.url  # db 0 of its own server

    def stop(self) -> None:
        self.server.stop()

    def start(self) -> None:
        self.server.start()


class BusyBroker:
    """The broker runs a Lua loop: every other client is answered BUSY until SCRIPT KILL."""

    def __init__(self, broker: Broker) -> None:
        self._url = broker.url
        self._thread: threading.Thread | None = None
        self.script_error: BaseException | None = None

    def __enter__(self) -> "BusyBroker":
        admin = redis.Redis.from_url(self._url)
        admin.config_set("busy-reply-threshold", 100)  # ms: BUSY after a tenth of a second
        admin.close()
        self._thread = threading.Thread(target=self._run_script, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 5
        while not self.busy():
            assert time.monotonic() < deadline, "the broker never answered BUSY"
            time.sleep(0.05)
        return self

    def _run_script(self) -> None:
        client = redis.Redis.from_url(self._url, socket_timeout=30)
        try:
            client.eval("while true do end", 0)
        except redis.ResponseError as exc:  # "Script killed by user"
            self.script_error = exc
        finally:
            client.close()

    def busy(self) -> bool:
        client = redis.Redis.from_url(self._url, socket_timeout=2)
        try:
            client.ping()
        except redis.ResponseError as exc:
            return str(exc).startswith("BUSY")
        finally:
            client.close()
        return False

    def __exit__(self, *_: object) -> None:
        deadline = time.monotonic() + 10
        while True:
            client = redis.Redis.from_url(self._url, socket_timeout=2)
            try:
                client.script_kill()
                break
            except redis.ResponseError:  # the script has not started yet, or is already gone
                if not self.busy() or time.monotonic() > deadline:
                    break
            finally:
                client.close()
        assert self._thread is not None
        self._thread.join(timeout=10)
        admin = redis.Redis.from_url(self._url)
        admin.config_set("busy-reply-threshold", 5000)
        admin.close()


def start_worker(
    broker_url: str,
    database_url: str,
    log_path: Path,
    *,
    transport_options: str = "{}",
    name: str = "monolith",
    threads: int = 0,
) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "MONOLITH_BROKER_URL": broker_url,
        "MONOLITH_DATABASE_URL": database_url,
        "MONOLITH_BROKER_TRANSPORT_OPTIONS": transport_options,
    }
    pool = ["--pool=threads", f"--concurrency={threads}"] if threads else ["--pool=solo"]
    command = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "tests.monolith.worker",
        "worker",
        *pool,
        "-Q",
        QUEUES,
        "-n",
        f"{name}@%h",
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
        "-l",
        "INFO",
    ]
    with open(log_path, "ab") as log_file:
        return subprocess.Popen(command, env=env, cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT)


def wait_worker_ready(process: subprocess.Popen[bytes], log_path: Path, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, f"worker exited:\n{log_path.read_text()[-3000:]}"
        if " ready." in log_path.read_text(errors="replace"):
            return
        time.sleep(0.1)
    raise AssertionError(f"worker not ready:\n{log_path.read_text()[-3000:]}")


def stop_worker(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@pytest.fixture(scope="session")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    server = embedded.EmbeddedRedis(Path(tmp_path_factory.mktemp("broker")), None)
    server.start()
    try:
        yield Broker(server)
    finally:
        server.stop()


@pytest.fixture(scope="session")
async def monolith_table(migrated: str) -> str:
    conn = await asyncpg.connect(migrated)
    try:
        await conn.execute(CREATE_TABLE_SQL)
    finally:
        await conn.close()
    return migrated


@pytest.fixture(scope="session")
def worker(
    broker: Broker, monolith_table: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[subprocess.Popen[bytes]]:
    log_path = Path(tmp_path_factory.mktemp("worker")) / "worker.log"
    process = start_worker(broker.url, monolith_table, log_path)
    try:
        wait_worker_ready(process, log_path)
        yield process
    finally:
        stop_worker(process)


@dataclass
class Executions:
    """What the stand-in monolith ran, read back from its table."""

    pool: asyncpg.Pool

    async def rows(self, task_name: str | None = None) -> list[asyncpg.Record]:
        if task_name is None:
            return await self.pool.fetch("SELECT * FROM monolith_task_execution ORDER BY id")
        return await self.pool.fetch(
            "SELECT * FROM monolith_task_execution WHERE task_name = $1 ORDER BY id", task_name
        )

    async def count(self) -> int:
        return int(await self.pool.fetchval("SELECT count(*) FROM monolith_task_execution"))

    async def by_task_id(self, task_name: str | None = None) -> Counter[str]:
        return Counter(row["task_id"] for row in await self.rows(task_name))

    async def wait_for(self, count: int, timeout_s: float = 30, settle_s: float = 0.5) -> list[asyncpg.Record]:
        """Wait until at least `count` executions, then a little longer so a duplicate would show."""
        deadline = time.monotonic() + timeout_s
        while await self.count() < count:
            assert time.monotonic() < deadline, f"{await self.count()} executions of {count} in {timeout_s}s"
            await asyncio.sleep(0.1)
        await asyncio.sleep(settle_s)
        return await self.rows()


def kwargs_of(row: asyncpg.Record) -> dict[str, Any]:
    import json

    value = row["kwargs"]
    return json.loads(value) if isinstance(value, str) else dict(value)


def _send_markers(broker_url: str, marker: str) -> None:
    from celery import Celery

    app = Celery("drain", broker=broker_url, set_as_current=False)
    try:
        for queue in QUEUES.split(","):
            app.send_task("apps.engagements.tasks.advance_user_journey", task_id=f"{marker}-{queue}", queue=queue)
    finally:
        app.close()


async def _drain(broker: Broker, pool: asyncpg.Pool, timeout_s: float = 30) -> None:
    """Wait until the worker has run everything already in its queues: what an earlier test published and did not
    wait for (with no worker yet, it all runs at this worker's start). A marker goes last into each queue; the worker
    runs a queue in order, so once both markers ran, nothing older can land after the caller's TRUNCATE."""
    marker = f"drain-{time.monotonic_ns()}"
    await asyncio.to_thread(_send_markers, broker.url, marker)
    queues = len(QUEUES.split(","))
    ran = "SELECT count(*) FROM monolith_task_execution WHERE starts_with(task_id, $1)"

    async def drained() -> bool:
        return await pool.fetchval(ran, marker) == queues

    await wait_for(drained, timeout_s)


@pytest.fixture
async def executions(monolith_table: str, broker: Broker, worker: subprocess.Popen[bytes]) -> AsyncIterator[Executions]:
    pool = await asyncpg.create_pool(monolith_table, min_size=1, max_size=2)
    assert pool is not None
    await _drain(broker, pool)
    await pool.execute("TRUNCATE monolith_task_execution")
    try:
        yield Executions(pool)
    finally:
        await pool.close()
