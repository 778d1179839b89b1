"""Fault-and-load scenarios: three service processes, real Redis and Postgres, faults injected
while a separate process sends heartbeats (tests/faults/load.py, its rounds role); the final Postgres
state is checked against the ledger of every 201.

    python -m tests.faults.suite            # the long run (10,000 keys, 10 s outages)
    python -m tests.faults.suite --short    # what CI runs, through tests/faults/test_fault_suite.py

`rolling` is the fleet: the three behind a real HAProxy (deploy/haproxy/haproxy.cfg, active checks on
/health/ready, no redispatch, no retries), the load through it, and rolling restarts: SIGTERM a pod,
wait for it to exit, start it again, wait until HAProxy has it back in rotation, the next pod. The
load runs until the last roll is over.

    python -m tests.faults.suite --scenario rolling --short   # CI (tests/faults/test_fleet.py)
    python -m tests.faults.suite --scenario rolling --json    # the larger run (bench/bench_fleet.py)
"""

import argparse
import asyncio
import csv
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import asyncpg
import httpx
from redis.asyncio import Redis

from service.dev import database, embedded
from service.progress.flush.backlog import measure_backlog
from service.progress.keys import STANDALONE
from tests import debian
from tests.faults.load import DURATION_S, Load, Rounds, position
from tests.helpers import clean_environment, seed, wait_ready

SECRET = "fault-suite-secret-0123456789abcdef0123"
# A store down under load. The steady run and the pods SIGKILLed under load ran here too: the nemesis (nemesis.py)
# runs that load with pods SIGKILLed and SIGTERMed among its faults, and checks each acknowledged position as these do.
SCENARIOS = ("redis_outage", "postgres_outage")
FLEET = "rolling"
HAPROXY_CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "haproxy" / "haproxy.cfg"


@dataclass
class Size:
    users: int
    lessons: int
    rounds: int
    crossing: int
    outage_s: float
    min_round_s: float
    crossing_round: int = -1  # -1: half way through the rounds
    rolls: int = 0  # rolling: restarts of every pod, one pod after another
    drain_s: float = 0.0  # SHUTDOWN_DRAIN_SECONDS of the pods
    check_interval: str = "2s"  # HAProxy's `inter`

    def __post_init__(self) -> None:
        if self.crossing_round < 0:
            self.crossing_round = self.rounds // 2

    @property
    def keys(self) -> int:
        return self.users * self.lessons


SHORT = Size(users=50, lessons=10, rounds=20, crossing=250, outage_s=3, min_round_s=0.4)
LONG = Size(users=1000, lessons=10, rounds=24, crossing=500, outage_s=10, min_round_s=1.5)
# the fleet: rounds is a ceiling (the load stops once the rolls are over; round 2,000 would send position 80,000 of
# the 86,400 allowed); HAProxy checks every 0.5 s and takes a pod out after 2 failed checks, well within its 3 s drain
FLEET_SHORT = Size(
    users=300, lessons=4, rounds=2000, crossing=200, outage_s=0, min_round_s=0.3,
    crossing_round=5, rolls=1, drain_s=3, check_interval="500ms",
)  # fmt: skip
# the larger run (bench/bench_fleet.py): the pods' default drain (5 s) and deploy/haproxy/haproxy.cfg's own interval
FLEET_LONG = replace(FLEET_SHORT, users=2000, crossing=500, min_round_s=1.0, rolls=3, drain_s=5, check_interval="2s")


@dataclass
class Report:
    scenario: str
    keys: int
    sent: int = 0
    acknowledged: int = 0
    refused_503: int = 0
    no_answer: int = 0
    persisted: int = 0
    lost: int = 0
    stale: list[str] = field(default_factory=list)
    completed_keys: int = 0
    events: int = 0
    duplicate_events: int = 0
    missing_completions: int = 0
    faults: list[str] = field(default_factory=list)
    load_s: float = 0.0
    other: int = 0  # answers neither 201 nor 503
    rounds: int = 0
    latency_ms: dict[str, float] = field(default_factory=dict)
    exit_codes: list[int] = field(default_factory=list)  # of the pods stopped by SIGTERM during the run
    stop_s: list[float] = field(default_factory=list)  # per pod rolled: SIGTERM to exit
    back_s: list[float] = field(default_factory=list)  # per pod rolled: start to back in HAProxy's rotation

    def ok(self) -> bool:
        return (
            self.lost == 0
            and self.duplicate_events == 0
            and self.missing_completions == 0
            and self.events == self.completed_keys
            and self.acknowledged > 0
            # the fleet: every request answered 201 through the load balancer, every pod stopped cleanly
            and (self.scenario != FLEET or (self.acknowledged == self.sent and set(self.exit_codes) == {0}))
        )


class Cluster:
    """Valkey, Postgres and N `progress-service serve` processes on loopback; with `size.rolls`, HAProxy in front;
    with `broker`, a Valkey of its own as the monolith's Celery broker and the outbox relay on in every process.

    `env` is added to (and overrides) the settings every process starts with; `pod_env[i]`, to process i's alone.
    """

    def __init__(
        self,
        base: Path,
        processes: int = 3,
        *,
        size: Size | None = None,
        env: Mapping[str, str] | None = None,
        pod_env: Sequence[Mapping[str, str]] = (),
        broker: bool = False,
    ) -> None:
        self.base = base
        self.size = size
        self.redis = embedded.EmbeddedRedis(base / "valkey", None)
        self.postgres = database.EmbeddedPostgres(base / "postgres", None, durable=False)
        self.broker = embedded.EmbeddedRedis(base / "broker", None) if broker else None
        self.env = dict(env or {})
        self.pod_env = [dict(extra) for extra in pod_env]
        self.ports = [embedded.free_port() for _ in range(processes)]
        self.services: list[subprocess.Popen[bytes] | None] = [None] * processes
        self.balancer: subprocess.Popen[bytes] | None = None
        self.front_port = self.stats_port = 0

    @property
    def database_url(self) -> str:
        return self.postgres.url("progress")

    def start(self, *, users: int, contents: int, setup_sql: Sequence[str] = ()) -> None:
        """The servers, users 1..users and contents 1..contents of every type, `setup_sql`, then every process."""
        self.redis.start()
        self.postgres.start()
        if self.broker is not None:
            self.broker.start()
        self.postgres.create_database("progress")
        asyncio.run(self._prepare(users, contents, setup_sql))
        for i in range(len(self.ports)):
            self.start_service(i)
        for i in range(len(self.ports)):
            self.wait_ready(i)
        if self.size is not None and self.size.rolls:
            self.start_balancer()
            for i in range(len(self.ports)):
                self.wait_in_rotation(i)

    @property
    def load_ports(self) -> list[int]:
        return [self.front_port] if self.balancer is not None else self.ports

    def start_balancer(self) -> None:
        assert self.size is not None
        assert len(self.ports) == 3, "deploy/haproxy/haproxy.cfg names three pods"
        self.front_port, self.stats_port = embedded.free_port(), embedded.free_port()
        env = {
            **os.environ,
            "PROGRESS_FRONTEND": f"127.0.0.1:{self.front_port}",
            "PROGRESS_STATS": f"127.0.0.1:{self.stats_port}",
            "PROGRESS_CHECK_INTERVAL": self.size.check_interval,
            **{f"PROGRESS_POD_{i + 1}": f"127.0.0.1:{port}" for i, port in enumerate(self.ports)},
        }
        log = open(self.base / "haproxy.log", "ab")  # the child process keeps it open
        command = [str(debian.program(debian.HAPROXY, "haproxy")), "-db", "-f", str(HAPROXY_CONFIG)]
        self.balancer = subprocess.Popen(command, env=env, stdout=log, stderr=log, stdin=subprocess.DEVNULL)

    def wait_in_rotation(self, i: int, timeout_s: float = 30) -> None:
        """Until HAProxy's stats say pod i is UP (its `rise` checks passed): it is sent requests again."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.balancer is not None and self.balancer.poll() is None, f"HAProxy died; see {self.base}"
            try:
                stats = httpx.get(f"http://127.0.0.1:{self.stats_port}/stats;csv", timeout=1).text
            except httpx.HTTPError:
                stats = ""
            rows = csv.DictReader(stats.removeprefix("# ").splitlines())
            if any(
                row["pxname"] == "pods" and row["svname"] == f"pod{i + 1}" and row["status"] == "UP" for row in rows
            ):
                return
            time.sleep(0.1)
        raise RuntimeError(f"HAProxy never took pod {i + 1} back; see {self.base}/haproxy.log")

    async def _prepare(self, users: int, contents: int, setup_sql: Sequence[str]) -> None:
        await database.prepare_database(self.database_url, seed=False)
        pool = await asyncpg.create_pool(self.database_url, min_size=1, max_size=1)
        try:
            await seed(pool, users=users, contents=contents, duration_s=DURATION_S)
            for statement in setup_sql:
                await pool.execute(statement)
        finally:
            await pool.close()

    def start_service(self, i: int) -> None:
        env = clean_environment()
        env.update(
            REDIS_URL=self.redis.url,
            DATABASE_URL=self.database_url,
            JWT_SECRET=SECRET,
            LOG_LEVEL="WARNING",
            PROGRESS_FLUSH_INTERVAL_SECONDS="1",
            PROGRESS_FLUSH_LEASE_SECONDS="3",
            PROGRESS_SHUTDOWN_TIMEOUT_SECONDS="5",
            DEGRADED_REDIS_RETRY_SECONDS="0.5",
            # delivery to the monolith has its own tests (tests/outbox); here it stays off, unless there is a broker
            RELAY_ENABLED="false",
            EMAIL_PUBLISHER="redis-stream",
        )
        if self.size is not None:
            env.update(SHUTDOWN_DRAIN_SECONDS=str(self.size.drain_s))
        if self.broker is not None:
            env.update(RELAY_ENABLED="true", CELERY_BROKER_URL=self.broker.url)
        env.update(self.env)
        env.update(self.pod_env[i] if i < len(self.pod_env) else {})
        log = open(self.base / f"service-{i}.log", "ab")  # the child process keeps it open
        self.services[i] = subprocess.Popen(
            [sys.executable, "-m", "service", "serve", "--port", str(self.ports[i])], env=env, stdout=log, stderr=log
        )

    def wait_ready(self, i: int, timeout_s: float = 30) -> None:
        wait_ready(f"http://127.0.0.1:{self.ports[i]}", self.services[i], timeout_s, self.base / f"service-{i}.log")

    def kill_service(self, i: int) -> None:
        process = self.services[i]
        if process is not None:
            process.kill()
            process.wait()

    def stop_service(self, i: int, timeout_s: float = 60) -> int:
        """SIGTERM, as an orchestrator stops a pod; its exit code once it has drained and made its final flush."""
        process = self.services[i]
        assert process is not None
        process.send_signal(signal.SIGTERM)
        return process.wait(timeout=timeout_s)

    def exit_code(self, i: int) -> int:
        process = self.services[i]
        assert process is not None and process.returncode is not None
        return process.returncode

    def terminate_services(self, indices: Sequence[int], timeout_s: float = 30) -> dict[int, float]:
        """SIGTERM to each running process of `indices` at once; the seconds each took to exit (SIGKILL past
        `timeout_s`: then its time is `inf`)."""
        signalled = {}
        for i in indices:
            process = self.services[i]
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)
                signalled[i] = (process, time.monotonic())
        exit_s = {}
        for i, (process, sent) in signalled.items():
            try:
                process.wait(timeout=max(0.0, sent + timeout_s - time.monotonic()))
                exit_s[i] = time.monotonic() - sent
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                exit_s[i] = float("inf")
        return exit_s

    def stop(self) -> None:
        if self.balancer is not None:
            self.balancer.terminate()
            self.balancer.wait(timeout=10)
        self.terminate_services(range(len(self.services)))
        self.postgres.stop()
        self.redis.stop()
        if self.broker is not None:
            self.broker.stop()


def _inject(cluster: Cluster, scenario: str, size: Size, load: subprocess.Popen[bytes], report: Report) -> None:
    """Runs in the orchestrator while the load process runs."""
    faults = report.faults
    time.sleep(1.5)
    if scenario in ("redis_outage", "postgres_outage"):
        server: embedded.EmbeddedRedis | database.EmbeddedPostgres = (
            cluster.redis if scenario == "redis_outage" else cluster.postgres
        )
        server.stop()
        faults.append(f"{server.name} stopped for {size.outage_s:g}s")
        time.sleep(size.outage_s)
        server.start()
    elif scenario == FLEET:
        _roll(cluster, size, load, report)
        load.send_signal(signal.SIGTERM)  # the load ends with the round in hand


def _roll(cluster: Cluster, size: Size, load: subprocess.Popen[bytes], report: Report) -> None:
    """Rolling restarts, under load: each pod in turn stopped as an orchestrator stops it, started, back in rotation."""
    for roll in range(1, size.rolls + 1):
        for i in range(len(cluster.ports)):
            if load.poll() is not None:
                raise RuntimeError("the load ended before the rolls: raise Size.rounds")
            signalled = time.monotonic()
            report.exit_codes.append(cluster.stop_service(i))
            report.stop_s.append(round(time.monotonic() - signalled, 2))
            started = time.monotonic()
            cluster.start_service(i)
            cluster.wait_in_rotation(i)
            report.back_s.append(round(time.monotonic() - started, 2))
            report.faults.append(f"roll {roll}: pod {i + 1} exited {report.exit_codes[-1]}, back in rotation")


async def backlog_left(redis_url: str) -> int:
    """Members pending or in flight, over every content type and shard."""
    redis = Redis.from_url(redis_url)
    try:
        backlog = await measure_backlog(redis, STANDALONE)  # the service's own count (the pods' default layout)
        return sum(sizes.pending + sizes.in_flight for sizes in backlog.by_type.values())
    finally:
        await redis.aclose()


async def wait_drained(redis_url: str, timeout_s: float) -> int:
    """Waits (at most `timeout_s`) for the buffer to be empty; what it still holds then (0: drained)."""
    deadline = time.monotonic() + timeout_s
    while (backlog := await backlog_left(redis_url)) and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
    return backlog


async def _drained(cluster: Cluster, timeout_s: float = 90) -> None:
    if backlog := await wait_drained(cluster.redis.url, timeout_s):
        raise RuntimeError(f"backlog of {backlog} never drained")


async def _emptied(cluster: Cluster) -> None:
    """A running cluster as a new one has it: no progress row, no event, an empty buffer; every pod ready."""
    for i in range(len(cluster.services)):
        cluster.wait_ready(i)
    if backlog := await wait_drained(cluster.redis.url, 30):
        raise RuntimeError(f"backlog of {backlog} never drained")
    conn = await asyncpg.connect(cluster.database_url)
    try:
        await conn.execute("TRUNCATE engagements_lessonprogress, progress_completion_event RESTART IDENTITY")
    finally:
        await conn.close()
    redis = Redis.from_url(cluster.redis.url)
    try:
        await redis.flushall()
    finally:
        await redis.aclose()


async def _verify(cluster: Cluster, ledger: dict[str, object], size: Size, report: Report) -> None:
    conn = await asyncpg.connect(cluster.database_url)
    rows = {
        (r["lesson_id"], r["user_id"]): r
        for r in await conn.fetch("SELECT lesson_id, user_id, position, completed_at FROM engagements_lessonprogress")
    }
    event_counts = {
        (r["content_id"], r["user_id"]): r["n"]
        for r in await conn.fetch(
            "SELECT content_id, user_id, count(*) AS n FROM progress_completion_event GROUP BY 1, 2"
        )
    }
    await conn.close()
    crossing = {tuple(k) for k in ledger["crossing"]}  # type: ignore[attr-defined]
    crossing_round, rounds = size.crossing_round, int(ledger["rounds"])  # type: ignore[call-overload]
    last_acked: dict[tuple[int, int], int] = {}
    for r in ledger["requests"]:  # type: ignore[attr-defined]
        if r["status"] == 201:  # a key's rounds are sequential: its last 201 is its latest round acknowledged
            last_acked[(r["key"][1], r["key"][2])] = r["round"]
    for key, acked_round in last_acked.items():
        allowed = {
            position(key, r, crossing=key in crossing, crossing_round=crossing_round)
            for r in range(acked_round, rounds)
        }
        row = rows.get(key)
        if row is None or row["position"] not in allowed:
            report.lost += 1
            if len(report.stale) < 10:
                report.stale.append(f"{key}: acked round {acked_round}, row {row and row['position']}")
            continue
        report.persisted += 1
        acked_crossing = key in crossing and acked_round >= crossing_round
        if acked_crossing and row["completed_at"] is None:
            report.missing_completions += 1
    completed = {key for key, row in rows.items() if row["completed_at"] is not None}
    report.completed_keys = len(completed)
    report.events = sum(event_counts.values())
    report.duplicate_events = sum(n - 1 for n in event_counts.values() if n > 1)
    if set(event_counts) != completed:
        report.missing_completions += len(completed ^ set(event_counts))


def _rounds_load(size: Size) -> Load:
    rounds = Rounds(
        users=size.users,
        lessons=size.lessons,
        rounds=size.rounds,
        crossing=size.crossing,
        crossing_round=size.crossing_round,
        min_round_s=size.min_round_s,
    )
    return Load(
        seconds=900, contents=size.lessons, steady_users=0, burst_users=0, sync_users=0, crowd_users=0,
        crowd_at_s=(), client_timeout_s=10.0, rounds=rounds,
    )  # fmt: skip


def start_load(cluster: Cluster, load: Load, seed: int, ledger_path: Path) -> subprocess.Popen[bytes]:
    """The load process (tests/faults/load.py) against the cluster's pods, or its load balancer; its log in load.log."""
    args = ["--ports", ",".join(map(str, cluster.load_ports)), "--load", json.dumps(asdict(load)), "--seed", str(seed)]
    with open(cluster.base / "load.log", "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "tests.faults.load", *args, "--secret", SECRET, "--ledger", str(ledger_path)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def _count(ledger: dict[str, Any], report: Report) -> None:
    """The load's figures, from its ledger of every request."""
    statuses = Counter(r["status"] for r in ledger["requests"])
    report.sent = sum(statuses.values())
    report.acknowledged, report.refused_503, report.no_answer = statuses[201], statuses[503], statuses[0]
    report.other = report.sent - report.acknowledged - report.refused_503 - report.no_answer
    report.rounds = ledger["rounds"]
    answered = sorted(r["t1"] - r["t0"] for r in ledger["requests"])
    if answered:
        report.load_s = round(max(r["t1"] for r in ledger["requests"]) - min(r["t0"] for r in ledger["requests"]), 1)
        report.latency_ms = {
            "p50": round(statistics.median(answered) * 1000, 2),
            "p99": round(answered[int(len(answered) * 0.99)] * 1000, 2),
            "max": round(answered[-1] * 1000, 2),
        }


def run_scenario(
    scenario: str, size: Size, base: Path, log: Callable[[str], None] = print, cluster: Cluster | None = None
) -> Report:
    """`cluster`: a Cluster of this size already started (tests/faults/test_fault_suite.py's, shared by its
    scenarios), emptied first and left running; without it, one of its own for this run."""
    base.mkdir(parents=True, exist_ok=True)
    own = cluster is None
    report = Report(scenario, size.keys)
    if cluster is None:
        cluster = Cluster(base, size=size)
    try:
        if own:
            log(f"[{scenario}] starting Valkey, Postgres and {len(cluster.ports)} service processes")
            cluster.start(users=size.users, contents=size.lessons)
        else:
            asyncio.run(_emptied(cluster))
        ledger_path = base / "ledger.json"
        load = start_load(cluster, _rounds_load(size), seed=0, ledger_path=ledger_path)
        _inject(cluster, scenario, size, load, report)
        if load.wait(timeout=900) != 0:
            raise RuntimeError(f"the load failed; see {base}/load.log")
        for i in range(len(cluster.services)):
            cluster.wait_ready(i)
        ledger = json.loads(ledger_path.read_text())
        _count(ledger, report)
        log(f"[{scenario}] load done: {report.sent} sent, {report.acknowledged} acknowledged; draining")
        if scenario == FLEET:
            # the pods' final flushes write what the last interval left (and exit 0, as the rolled ones did); the load
            # is over, so the three drain and flush at once rather than one after another
            stopped = cluster.terminate_services(range(len(cluster.ports)), timeout_s=60)
            report.exit_codes += [cluster.exit_code(i) for i in stopped]
        asyncio.run(_drained(cluster, timeout_s=5 if scenario == FLEET else 90))
        asyncio.run(_verify(cluster, ledger, size, report))
    finally:
        if own:
            cluster.stop()
    log(f"[{scenario}] {json.dumps(report.__dict__)}")
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--short", action="store_true")
    parser.add_argument("--scenario", choices=(*SCENARIOS, FLEET), action="append", help="default: all but rolling")
    parser.add_argument("--users", type=int, help="users of the load (default: the size's)")
    parser.add_argument("--rolls", type=int, help="rolling: restarts of every pod (default: the size's)")
    parser.add_argument("--drain-seconds", type=float, help="the pods' SHUTDOWN_DRAIN_SECONDS (default: the size's)")
    parser.add_argument("--json", action="store_true", help="each report as one JSON line on stdout, the log on stderr")
    args = parser.parse_args()
    reports = []
    with tempfile.TemporaryDirectory(prefix="fault-suite-") as tmp:
        for scenario in args.scenario or SCENARIOS:
            size = (FLEET_SHORT if args.short else FLEET_LONG) if scenario == FLEET else SHORT if args.short else LONG
            size = replace(size, users=args.users or size.users, rolls=args.rolls or size.rolls)
            if args.drain_seconds is not None:
                size = replace(size, drain_s=args.drain_seconds)
            log = (lambda line: print(line, file=sys.stderr, flush=True)) if args.json else print
            reports.append(run_scenario(scenario, size, Path(tmp) / scenario, log=log))
    if args.json:
        for r in reports:
            print(json.dumps({**asdict(r), "ok": r.ok()}), flush=True)
        return 0 if all(r.ok() for r in reports) else 1
    print("\nscenario         keys   sent    acked   503   no-answer  persisted  lost  events  dup  faults")
    for r in reports:
        print(
            f"{r.scenario:<15} {r.keys:>6} {r.sent:>7} {r.acknowledged:>7} {r.refused_503:>5} {r.no_answer:>9} "
            f"{r.persisted:>10} {r.lost:>5} {r.events:>7} {r.duplicate_events:>4}  {len(r.faults)}"
        )
    return 0 if all(r.ok() for r in reports) else 1


if __name__ == "__main__":
    raise SystemExit(main())
