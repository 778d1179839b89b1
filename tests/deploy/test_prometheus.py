"""A real Prometheus (Debian's binary) scrapes a real `progress-service serve` under a few seconds of
heartbeats, with the flusher and the relay on; then every dashboard expression and every alert
expression is evaluated through Prometheus' HTTP API. None may fail; the traffic and flush rows
must show data. The server also loads alerts.yml and must evaluate every rule without error."""

import asyncio
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
import yaml
from redis.asyncio import Redis

from service.auth import make_token
from service.config import Settings
from service.dev.embedded import _die_with_parent, free_port
from tests.deploy.files import ALERTS_FILE, VENV_BIN, alert_rules, dashboard_queries
from tests.helpers import TEST_JWT_SECRET, Servers, auth, clean_environment, seed

pytestmark = pytest.mark.slow

LOAD_S = 4.0
MIN_REQUESTS = 300
CONCURRENCY = 8
USERS = 40
CONTENTS = 5
DURATION_S = 600  # each seeded content; a position of 595 completes it (margin 10 s)
UNKNOWN_ID = 999_999  # not in the catalog: 404, refused at the door
# long enough to hold the whole run, so every rate() has its samples
RATE_INTERVAL = "30s"
ROWS_WITH_DATA = {"Traffic", "Flush"}


def _service_env(servers: Servers, port: int) -> dict[str, str]:
    env = clean_environment()
    env.update(
        HOST="127.0.0.1",
        PORT=str(port),
        REDIS_URL=servers.redis_url,
        DATABASE_URL=servers.database_url,
        JWT_SECRET=TEST_JWT_SECRET,
        # the monolith's broker; a Valkey database of its own stands in for it (no worker needed)
        CELERY_BROKER_URL=servers.redis_url.rsplit("/", 1)[0] + "/3",
        PROGRESS_FLUSH_INTERVAL_SECONDS="0.5",
        RELAY_POLL_INTERVAL_SECONDS="0.5",
        PROGRESS_SHUTDOWN_TIMEOUT_SECONDS="5",
        SHUTDOWN_DRAIN_SECONDS="0",  # no load balancer to leave: its default 5 s would be waited out at the stop
        LOG_LEVEL="WARNING",
    )
    return env


def _start(command: list[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            command,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=_die_with_parent(signal.SIGTERM),
        )


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _tail(log_path: Path) -> str:
    return log_path.read_text()[-3000:]


async def _wait_for(url: str, process: subprocess.Popen[bytes], log_path: Path, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=2) as client:
        while time.monotonic() < deadline:
            assert process.poll() is None, f"{process.args} exited:\n{_tail(log_path)}"
            try:
                if (await client.get(url)).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.1)
    raise AssertionError(f"{url} never answered 200:\n{_tail(log_path)}")


def _prometheus_config(path: Path, service_port: int) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
                "rule_files": [str(ALERTS_FILE)],
                "scrape_configs": [
                    {"job_name": "progress-service", "static_configs": [{"targets": [f"127.0.0.1:{service_port}"]}]}
                ],
            }
        )
    )
    return path


async def _load(base_url: str, seconds: float) -> dict[int, int]:
    """Heartbeats from many users over every content: most below the end, some at the end (completions),
    a few for content that does not exist (404 at the door); for `seconds`, and on until MIN_REQUESTS were
    answered (a busy machine answers fewer in the time: the rates need the load, not its speed)."""
    settings = Settings(jwt_secret=TEST_JWT_SECRET)
    tokens = [make_token(settings, user) for user in range(1, USERS + 1)]
    statuses: dict[int, int] = {}
    deadline = time.monotonic() + seconds

    async def worker(w: int) -> None:
        async with httpx.AsyncClient(base_url=base_url, timeout=5) as client:
            i = w
            while time.monotonic() < deadline or sum(statuses.values()) < MIN_REQUESTS:
                user, content = i % USERS, (i // USERS) % CONTENTS + 1
                position = 595 if i % 7 == 0 else float(i % 500)
                lesson = UNKNOWN_ID if i % 50 == 0 else content
                response = await client.post(
                    "/engagements/progress/lesson",
                    headers=auth(tokens[user]),
                    json={"lesson_id": lesson, "position": position},
                )
                statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
                i += CONCURRENCY

    await asyncio.gather(*(worker(w) for w in range(CONCURRENCY)))
    return statuses


class Prometheus:
    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    async def query(self, expr: str) -> list[dict[str, Any]]:
        response = await self.client.get("/api/v1/query", params={"query": expr})
        body = response.json()
        assert response.status_code == 200 and body["status"] == "success", f"{expr}\n{body}"
        assert not body.get("warnings"), f"{expr}\n{body['warnings']}"
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    async def wait_until(self, expr: str, timeout_s: float = 20) -> None:
        deadline = time.monotonic() + timeout_s
        while not await self.query(expr):
            assert time.monotonic() < deadline, f"Prometheus never had {expr}"
            await asyncio.sleep(0.25)


async def test_a_real_prometheus_evaluates_every_dashboard_and_alert_expression(
    servers: Servers, db: asyncpg.Pool, redis: Redis, prometheus_bin: Path, tmp_path: Path
) -> None:
    started = time.monotonic()
    await seed(db, users=USERS, contents=CONTENTS, duration_s=DURATION_S)
    port, prometheus_port = free_port(), free_port()
    service_log, prometheus_log = tmp_path / "serve.log", tmp_path / "prometheus.log"
    service = _start([str(VENV_BIN / "progress-service"), "serve"], service_log, _service_env(servers, port))
    prometheus = None
    try:
        await _wait_for(f"http://127.0.0.1:{port}/health/ready", service, service_log)
        config = _prometheus_config(tmp_path / "prometheus.yml", port)
        prometheus = _start(
            [
                str(prometheus_bin / "prometheus"),
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{prometheus_port}",
                "--log.level=warn",
            ],
            prometheus_log,
        )
        await _wait_for(f"http://127.0.0.1:{prometheus_port}/-/ready", prometheus, prometheus_log)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{prometheus_port}", timeout=10) as client:
            api = Prometheus(client)
            await api.wait_until('up{job="progress-service"} == 1')

            statuses = await _load(f"http://127.0.0.1:{port}", LOAD_S)
            assert statuses.get(201, 0) > 100 and statuses.get(404, 0) > 0, statuses
            # the flush and the relay have run on the load, and Prometheus has scraped it since
            await api.wait_until("sum(progress_flush_rows_total) > 0")
            await api.wait_until("sum(progress_flush_completions_total) > 0")
            await api.wait_until("sum(progress_outbox_published_total) > 0")
            # the interval the flush alerts count in is the setting the pod runs with
            await api.wait_until("max(progress_flush_interval_seconds) == 0.5")

            async def empty_panels() -> list[str]:
                empty = []
                for query in dashboard_queries(rate_interval=RATE_INTERVAL):
                    result = await api.query(query.expr)
                    if query.row in ROWS_WITH_DATA and not result:
                        empty.append(f"{query.row} / {query.panel}: {query.expr}")
                return empty

            async def rising(panel: str) -> bool:
                expr = next(q.expr for q in dashboard_queries(rate_interval=RATE_INTERVAL) if q.panel == panel)
                return any(float(sample["value"][1]) > 0 for sample in await api.query(expr))

            panels = ("Heartbeats/s by route and status", "Rows/s", "Completions/s")
            # until the rows have data and the rates rise (the scrapes after the load: they had 2 s, waited out),
            # then the same checks
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline or sum(statuses.values()) < MIN_REQUESTS:
                if not await empty_panels() and all([await rising(panel) for panel in panels]):
                    break
                await asyncio.sleep(0.25)
            empty = await empty_panels()
            assert not empty, "no data for:\n" + "\n".join(empty)
            for panel in panels:
                assert await rising(panel), panel

            for rule in alert_rules():
                await api.query(rule["expr"])

            # the server loaded alerts.yml itself and has evaluated every rule without error
            body = (await client.get("/api/v1/rules")).json()
            evaluated = {rule["name"]: rule for group in body["data"]["groups"] for rule in group["rules"]}
            assert set(evaluated) == {rule["alert"] for rule in alert_rules()}
            for name, rule in evaluated.items():
                assert rule["health"] == "ok", f"{name}: {rule['health']} {rule.get('lastError')}"
    finally:
        if prometheus is not None:
            _stop(prometheus)
        _stop(service)
    assert service.returncode == 0, _tail(service_log)
    assert time.monotonic() - started < 60
