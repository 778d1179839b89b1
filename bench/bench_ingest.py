"""HTTP benchmark of the heartbeat path: the service (one worker) against the straightforward baseline.

In one run on one machine: starts an embedded Valkey (unless REDIS_URL is given), the service exactly
as production starts it (`python -m service serve --workers 1`) and the baseline FastAPI app
(bench/baseline_app.py) against the same Redis (the baseline on the next database number), then
loads each in turn with wrk (64 connections, 2 threads, random users, routes, contents and
positions: bench/progress.lua), checks the answers and the Redis writes, and prints requests/s,
p50, p99 and the ratio. With --million it then drives the service to a million requests in total
and prints its resident memory before and after. With --door it also starts an embedded Postgres
holding content ids 1..N and a second service with the door on (content catalog and per-user rate
limit), compares the two on the same load in alternating rounds (known ids: every answer must be
201), then pushes made-up content ids at the door and counts the Redis keys they leave.

    .venv/bin/python bench/bench_ingest.py [--duration 20] [--connections 64] [--million] [--door]

Everything listens on and talks to 127.0.0.1 only. REDIS_URL, if given, must be a scratch Redis
on loopback: the two databases used are flushed before each run.
"""

import argparse
import ctypes
import json
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import jwt
from redis import Redis

BENCH_DIR = Path(__file__).resolve().parent
REPO_DIR = BENCH_DIR.parent
LUA_SCRIPT = BENCH_DIR / "progress.lua"
JWT_SECRET = "bench-secret-0123456789-abcdefghijklmnopqrstuvwxyz"
CONTENT_TYPES = ("lesson", "audio", "meditation", "live")
MILLION = 1_000_000
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
_PR_SET_PDEATHSIG = 1

# targets of the issue, for one worker process
TARGET_RATIO = 4.0
TARGET_P99_MS = 15.0
TARGET_RSS_MB = 150.0
TARGET_DOOR_SHARE = 0.95  # throughput kept with the door on (known ids)
BOGUS_IDS = (1_000_000_000, 2_000_000_000)  # made-up content ids: none exists


def say(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# ---------------------------------------------------------------------------------------------
# child processes


def _dying_with_us() -> None:
    """In a child before exec: SIGTERM when this script dies, even SIGKILLed."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _own_session_dying_with_us() -> None:
    os.setsid()  # its own process group, stopped as a whole
    _dying_with_us()


class Child:
    """A process in its own session, stopped (SIGTERM, then SIGKILL) with its whole group."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], log_path: Path) -> None:
        self.name = name
        self.log_path = log_path
        with open(log_path, "ab") as out:
            self.process = subprocess.Popen(
                args, cwd=REPO_DIR, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                preexec_fn=_own_session_dying_with_us,
            )  # fmt: skip

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def stop(self) -> None:
        if not self.alive():
            return
        for sig, wait_s in ((signal.SIGTERM, STOP_TIMEOUT_S), (signal.SIGKILL, STOP_TIMEOUT_S)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.process.wait(wait_s)
                return
            except subprocess.TimeoutExpired:
                say(f"{self.name} (pid {self.pid}) did not stop on {sig.name}")


def wait_http_ok(child: Child, url: str, timeout_s: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not child.alive():
            raise RuntimeError(f"{child.name} exited at start:\n{child.log_tail()}")
        try:
            with urllib.request.urlopen(url, timeout=1) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{child.name} not ready at {url} in {timeout_s:.0f}s:\n{child.log_tail()}")


def rss_kib(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak) of `pid`, or of its only child when it is a supervisor of one worker."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    target = int(children[0]) if len(children) == 1 else pid
    fields: dict[str, int] = {}
    for line in Path(f"/proc/{target}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0])
    return fields


def mib(kib: int) -> float:
    return kib / 1024


_TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of `pid` and its reaped children."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except FileNotFoundError:
        return 0.0
    # after the command name: utime, stime, cutime, cstime are fields 12..15 (0-based from state)
    return sum(int(value) for value in fields[11:15]) * _TICK_S


def machine_busy_s() -> float:
    """CPU seconds all CPUs spent not idle since boot (/proc/stat)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return (sum(values[:8]) - idle) * _TICK_S


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@dataclass(frozen=True)
class CpuShare:
    """Cores used during a run: by the loaded server, by Redis, by wrk, and by everything else."""

    server: float
    redis: float
    wrk: float
    other: float
    server_cpu_s: float


class CpuMeter:
    def __init__(self, server_pid: int, redis_pid: int | None) -> None:
        self.server_pid, self.redis_pid = server_pid, redis_pid
        self._start = self._sample()

    def _sample(self) -> tuple[float, float, float, float, float]:
        redis_s = process_cpu_s(self.redis_pid) if self.redis_pid else 0.0
        return time.monotonic(), process_cpu_s(self.server_pid), redis_s, children_cpu_s(), machine_busy_s()

    def stop(self) -> CpuShare:
        end = self._sample()
        wall, server, redis, wrk, busy = (b - a for a, b in zip(self._start, end, strict=True))
        # the server and Redis are our children too, but still running: their time is not in RUSAGE_CHILDREN
        return CpuShare(server / wall, redis / wall, wrk / wall, max(0.0, busy - server - redis - wrk) / wall, server)


# ---------------------------------------------------------------------------------------------
# wrk


def ensure_wrk() -> str:
    found = shutil.which("wrk")
    if found:
        return found
    say("wrk not found: installing it from the distribution's packages (apt-get install wrk)")
    if os.geteuid() != 0:
        raise RuntimeError("wrk is missing and we are not root: run `sudo apt-get install -y wrk`")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env, timeout=300)
    subprocess.run(["apt-get", "install", "-y", "-qq", "wrk"], check=True, env=env, timeout=300)
    found = shutil.which("wrk")
    if not found:
        raise RuntimeError("apt-get install wrk did not provide a wrk executable")
    return found


@dataclass(frozen=True)
class WrkResult:
    requests: int
    duration_s: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    p999_ms: float
    max_ms: float
    socket_errors: dict[str, int]
    non201: int
    statuses: dict[str, int]
    output: str
    cpu: CpuShare | None = None

    @property
    def rps(self) -> float:
        return self.requests / self.duration_s

    @property
    def errors(self) -> int:
        return sum(self.socket_errors.values())


def run_wrk(wrk: str, url: str, tokens_file: Path, args: argparse.Namespace, duration_s: float,
            meter: CpuMeter, ids: tuple[int, int] | None = None, *, script: Path = LUA_SCRIPT,
            script_args: tuple[str, ...] = (), connections: int | None = None,
            timeout_s: int = 2) -> WrkResult:  # fmt: skip
    first_id, last_id = ids or (1, args.contents)
    # progress.lua reads (tokens, last id, first id); reads.lua (tokens, last id, mode...)
    script_ids = (str(last_id), str(first_id)) if script == LUA_SCRIPT else (str(last_id),)
    command = [
        wrk, f"-t{args.threads}", f"-c{connections or args.connections}", f"-d{max(1, round(duration_s))}s",
        "--latency", "--timeout", f"{timeout_s}s", "-s", str(script), url, "--", str(tokens_file), *script_ids,
        *script_args,
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=duration_s + 60, check=False,
                          preexec_fn=_dying_with_us)  # fmt: skip
    cpu = meter.stop()
    if done.returncode != 0:
        raise RuntimeError(f"wrk failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    match = re.search(r"^BENCH_RESULT (\{.*\})$", done.stdout, re.MULTILINE)
    if match is None:
        raise RuntimeError(f"no BENCH_RESULT line in wrk's output:\n{done.stdout}\n{done.stderr}")
    data = json.loads(match.group(1))
    stated = re.search(r"Requests/sec:\s+([\d.]+)", done.stdout)
    result = WrkResult(
        requests=data["requests"], duration_s=data["duration_us"] / 1e6,
        p50_ms=data["p50_us"] / 1000, p90_ms=data["p90_us"] / 1000, p99_ms=data["p99_us"] / 1000,
        p999_ms=data["p999_us"] / 1000, max_ms=data["max_us"] / 1000,
        socket_errors=data["errors"], non201=data["non201"], statuses=data["statuses"], output=done.stdout,
        cpu=cpu,
    )  # fmt: skip
    if stated and abs(float(stated.group(1)) - result.rps) > 0.01 * result.rps + 1:
        raise RuntimeError(f"wrk's Requests/sec {stated.group(1)} disagrees with {result.rps:.0f}")
    return result


# ---------------------------------------------------------------------------------------------
# Redis


def url_with_db(url: str, db: int) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, f"/{db}", parts.query, parts.fragment))


def db_of(url: str) -> int:
    path = urlsplit(url).path.strip("/")
    return int(path) if path else 0


def check_loopback(url: str) -> None:
    host = urlsplit(url).hostname
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit(f"REDIS_URL must be on loopback (this benchmark talks to 127.0.0.1 only): {url}")


def pending_counts(redis: Redis) -> dict[str, int]:
    return {kind: int(redis.scard(f"progress:pending_flush:{kind}")) for kind in CONTENT_TYPES}


def check_writes(redis: Redis, name: str) -> dict[str, int]:
    """The run left pending members, and a pending member's latest position is stored and well formed."""
    counts = pending_counts(redis)
    if sum(counts.values()) == 0:
        raise RuntimeError(f"{name}: the pending sets are empty after the run")
    for kind, count in counts.items():
        if not count:
            continue
        member = redis.srandmember(f"progress:pending_flush:{kind}")
        assert isinstance(member, bytes)
        content_id, user_id = member.decode().split(":")
        value = redis.get(f"progress:latest_position:{kind}:{content_id}:{user_id}")
        # "{position}:{ms}", then ":{peak}" and ":{microseconds}" (service.progress.buffer)
        if not isinstance(value, bytes) or not re.fullmatch(rb"[\d.]+:\d{13}(:[\d.]+)?(:\d{1,3})?", value):
            raise RuntimeError(f"{name}: pending member {kind} {member!r} has value {value!r}")
    return counts


# ---------------------------------------------------------------------------------------------
# the run


@dataclass
class Target:
    name: str
    child: Child
    url: str
    redis: Redis
    redis_pid: int | None
    served: int = 0  # requests answered in all runs so far (warm-up included)


def make_tokens(users: int, path: Path) -> None:
    expires = int(time.time()) + 7 * 24 * 3600
    with open(path, "w") as out:
        for user_id in range(1, users + 1):
            out.write(jwt.encode({"user_id": user_id, "exp": expires}, JWT_SECRET, algorithm="HS256") + "\n")


def wait_until_idle(limit_s: float) -> None:
    """Before a measured run: wait (up to limit_s) until other processes leave the CPUs alone."""
    started = time.monotonic()
    while True:
        start = machine_busy_s()
        time.sleep(1.0)
        busy = machine_busy_s() - start
        waited = time.monotonic() - started
        if busy < 0.15:
            if waited > 1.5:
                say(f"the machine is idle after {waited:.0f}s")
            return
        if waited >= limit_s:
            say(f"the machine is still busy ({busy:.2f} cores used by others): measuring anyway")
            return
        if waited < 1.5:
            say(f"waiting up to {limit_s:.0f}s for other processes to leave the CPUs ({busy:.2f} cores busy)")


def load(target: Target, wrk: str, tokens: Path, args: argparse.Namespace, duration_s: float,
         label: str) -> WrkResult:  # fmt: skip
    say(f"{target.name}: {label} run, {duration_s:.0f}s, {args.connections} connections, {args.threads} threads")
    result = run_wrk(wrk, target.url, tokens, args, duration_s, CpuMeter(target.child.pid, target.redis_pid))
    target.served += result.requests
    if args.verbose:
        print(result.output, file=sys.stderr)
    problems = []
    if result.non201:
        problems.append(f"{result.non201} answers were not 201 (statuses {result.statuses})")
    if result.errors:
        problems.append(f"socket errors {result.socket_errors}")
    if not target.child.alive():
        problems.append(f"the process exited:\n{target.child.log_tail()}")
    if problems:
        raise RuntimeError(f"{target.name} {label} run: " + "; ".join(problems))
    return result


def served_201_by_metrics(url: str) -> int:
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    return sum(
        int(float(m.group(1)))
        for m in re.finditer(r'^progress_http_requests_total\{[^}]*status="201"[^}]*\} ([\d.e+]+)$', text, re.M)
    )


def print_table(results: dict[str, WrkResult], args: argparse.Namespace) -> None:
    service, baseline = results["service"], results["baseline"]
    print()
    print(f"wrk {args.threads} threads, {args.connections} connections, {args.duration:.0f}s measured after "
          f"{args.warmup:.0f}s warm-up; {args.users} users, content ids 1..{args.contents}, 4 routes; "
          f"{os.cpu_count()} CPUs shared by wrk, the server and Valkey")  # fmt: skip
    header = f"{'':<10}{'req/s':>10}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}{'p99.9 ms':>10}{'max ms':>9}" \
             f"{'requests':>11}{'non-201':>9}{'sock err':>9}"  # fmt: skip
    print(header)
    print("-" * len(header))
    for name, r in results.items():
        print(f"{name:<10}{r.rps:>10.0f}{r.p50_ms:>9.2f}{r.p90_ms:>9.2f}{r.p99_ms:>9.2f}{r.p999_ms:>10.2f}"
              f"{r.max_ms:>9.1f}{r.requests:>11}{r.non201:>9}{r.errors:>9}")  # fmt: skip
    ratio = service.rps / baseline.rps
    print(f"{'ratio':<10}{ratio:>9.2f}x{service.p50_ms / baseline.p50_ms:>9.2f}"
          f"{service.p90_ms / baseline.p90_ms:>9.2f}{service.p99_ms / baseline.p99_ms:>9.2f}"
          f"{service.p999_ms / baseline.p999_ms:>10.2f}   (service / baseline)")  # fmt: skip
    print()
    print(f"CPU during the measured runs, in cores of {os.cpu_count()}:")
    print(f"{'':<10}{'server':>9}{'valkey':>9}{'wrk':>9}{'others':>9}{'server CPU us/request':>24}")
    for name, r in results.items():
        if r.cpu is not None:
            print(f"{name:<10}{r.cpu.server:>9.2f}{r.cpu.redis:>9.2f}{r.cpu.wrk:>9.2f}{r.cpu.other:>9.2f}"
                  f"{r.cpu.server_cpu_s / r.requests * 1e6:>24.1f}")  # fmt: skip
    busy = max((r.cpu.other for r in results.values() if r.cpu is not None), default=0.0)
    if busy > 0.2:
        print(f"WARNING: other processes used up to {busy:.2f} cores during a run: the figures are low")
    print()
    print(f"target: service req/s >= {TARGET_RATIO:.0f}x baseline: {ratio:.2f}x "
          f"{'PASS' if ratio >= TARGET_RATIO else 'MISS'}")  # fmt: skip
    print(f"target: service p99 < {TARGET_P99_MS:.0f} ms at {args.connections} connections: "
          f"{service.p99_ms:.2f} ms {'PASS' if service.p99_ms < TARGET_P99_MS else 'MISS'}")  # fmt: skip


def drive_to_million(target: Target, wrk: str, tokens: Path, args: argparse.Namespace, rate: float) -> None:
    before = rss_kib(target.child.pid)
    say(f"service: {target.served} requests so far, RSS {mib(before['VmRSS']):.1f} MiB; driving to {MILLION}")
    while target.served < MILLION:
        remaining = MILLION - target.served
        duration_s = min(120.0, max(5.0, remaining / rate * 1.05 + 1))
        result = load(target, wrk, tokens, args, duration_s, "million")
        rate = result.rps
        say(f"service: {target.served} requests served, {result.rps:.0f} req/s, p99 {result.p99_ms:.2f} ms, "
            f"RSS {mib(rss_kib(target.child.pid)['VmRSS']):.1f} MiB")  # fmt: skip
    after = rss_kib(target.child.pid)
    counted = served_201_by_metrics(target.url)
    print()
    print(f"service memory: {target.served} requests served ({counted} counted as 201 by its /metrics)")
    print(f"  VmRSS before the {MILLION}-request drive: {mib(before['VmRSS']):.1f} MiB")
    print(f"  VmRSS after  {target.served} requests: {mib(after['VmRSS']):.1f} MiB "
          f"(peak VmHWM {mib(after['VmHWM']):.1f} MiB)")  # fmt: skip
    ok = after["VmRSS"] / 1024 < TARGET_RSS_MB
    print(f"target: RSS < {TARGET_RSS_MB:.0f} MB after a million requests: "
          f"{after['VmRSS'] * 1024 / 1e6:.1f} MB {'PASS' if ok else 'MISS'}")  # fmt: skip
    if counted < MILLION:
        raise RuntimeError(f"the service's /metrics counted only {counted} answers 201")


@contextmanager
def postgres_with_content(work_dir: Path, contents: int) -> Iterator[str]:
    """An embedded Postgres with the shared tables and content ids 1..contents of every type."""
    import asyncio

    import asyncpg

    from service.embedded import EmbeddedPostgres, prepare_database

    server = EmbeddedPostgres(work_dir / "postgres", None, durable=False)
    say(f"starting embedded Postgres on 127.0.0.1:{server.port}")
    server.start()
    try:
        server.create_database("bench")
        url = server.url("bench")

        async def fill() -> None:
            await prepare_database(url, seed=False)
            conn = await asyncpg.connect(url)
            try:
                for table in ("courses_lesson", "audios_audio", "audios_meditation", "lives_live"):
                    await conn.execute(f"INSERT INTO {table} (id, title, duration) "
                                       "SELECT i, 'c' || i, 600 FROM generate_series(1, $1) i", contents)  # fmt: skip
            finally:
                await conn.close()

        asyncio.run(fill())
        yield url
    finally:
        server.stop()


def median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def door_comparison(plain: Target, door: Target, wrk: str, tokens: Path, args: argparse.Namespace) -> None:
    """The same load on the service without and with the door, alternating rounds; medians compared."""
    load(door, wrk, tokens, args, args.warmup, "warm-up")
    runs: dict[str, list[WrkResult]] = {plain.name: [], door.name: []}
    for round_no in range(args.rounds):
        for target in (plain, door) if round_no % 2 == 0 else (door, plain):
            target.redis.flushdb()
            wait_until_idle(args.wait_idle)
            runs[target.name].append(load(target, wrk, tokens, args, args.duration, f"door round {round_no + 1}"))
            check_writes(target.redis, target.name)
    print()
    print(f"door: the same load ({args.users} users, known ids 1..{args.contents}), {args.rounds} alternating "
          f"rounds of {args.duration:.0f}s each; every answer 201")  # fmt: skip
    print(f"{'':<16}{'median req/s':>14}{'runs req/s':>30}{'median p99 ms':>15}{'server CPU us/request':>24}")
    for name, results in runs.items():
        rates = [r.rps for r in results]
        cpu_us = [r.cpu.server_cpu_s / r.requests * 1e6 for r in results if r.cpu is not None]
        print(f"{name:<16}{median(rates):>14.0f}{', '.join(f'{r:.0f}' for r in rates):>30}"
              f"{median([r.p99_ms for r in results]):>15.2f}{median(cpu_us) if cpu_us else 0:>24.1f}")  # fmt: skip
    share = median([r.rps for r in runs[door.name]]) / median([r.rps for r in runs[plain.name]])
    print(f"target: throughput with the door >= {TARGET_DOOR_SHARE:.0%} of without: {share:.1%} "
          f"{'PASS' if share >= TARGET_DOOR_SHARE else 'MISS'}")  # fmt: skip


def bogus_ids(door: Target, wrk: str, tokens: Path, one_token: Path, args: argparse.Namespace) -> None:
    """Made-up content ids pushed at the door: how fast it refuses them and what they leave in Redis."""
    print()
    print(f"door: made-up content ids ({BOGUS_IDS[0]}..{BOGUS_IDS[1]}), {args.connections} connections, "
          f"{args.duration:.0f}s")  # fmt: skip
    for label, token_file in (("one token", one_token), (f"{args.users} tokens", tokens)):
        door.redis.flushdb()
        result = run_wrk(wrk, door.url, token_file, args, args.duration, CpuMeter(door.child.pid, door.redis_pid),
                         ids=BOGUS_IDS)  # fmt: skip
        keys = int(door.redis.dbsize())
        # wrk counts every non-2xx answer as a "status" error: only the others are socket errors
        socket_errors = result.errors - result.socket_errors.get("status", 0)
        print(f"  {label:<14} {result.rps:>8.0f} answers/s  statuses {result.statuses}  "
              f"socket errors {socket_errors}  Redis keys left: {keys} {'PASS' if keys == 0 else 'MISS'}")  # fmt: skip
        if "201" in result.statuses:
            raise RuntimeError(f"the door accepted made-up ids: {result.statuses}")


@contextmanager
def redis_server(work_dir: Path) -> Iterator[tuple[str, int | None]]:
    """The Redis URL, and the server's pid when it is ours (for its CPU share)."""
    from_env = os.environ.get("REDIS_URL")
    if from_env:
        check_loopback(from_env)
        yield from_env, None
        return
    from service.embedded import EmbeddedRedis

    server = EmbeddedRedis(work_dir / "valkey", None)
    say(f"starting embedded Valkey on 127.0.0.1:{server.port}")
    server.start()
    assert server.process is not None
    try:
        yield server.url, server.process.pid
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of each measured run (20)")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds of each warm-up run (10)")
    parser.add_argument("--connections", type=int, default=64, help="wrk connections (64)")
    parser.add_argument("--threads", type=int, default=2, help="wrk threads (2)")
    parser.add_argument("--users", type=int, default=10_000, help="distinct users, one token each (10000)")
    parser.add_argument("--contents", type=int, default=2000, help="content ids 1..N per route (2000)")
    parser.add_argument("--million", action="store_true",
                        help="then drive the service to 1,000,000 requests and print its RSS")  # fmt: skip
    parser.add_argument("--wait-idle", type=float, default=120.0, metavar="SECONDS",
                        help="before a measured run, wait up to this long for other processes to go quiet")  # fmt: skip
    parser.add_argument("--door", action="store_true",
                        help="also compare with the door on (catalog + rate limit) and push made-up ids")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of the door comparison (3)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs, tokens)")
    parser.add_argument("--verbose", action="store_true", help="print wrk's own output of every run")
    args = parser.parse_args(argv)
    if args.connections < args.threads:
        parser.error("--connections must be at least --threads")

    # a SIGTERM unwinds like Ctrl-C, so the finally blocks stop everything started here
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    wrk = ensure_wrk()
    work_dir = Path(tempfile.mkdtemp(prefix="progress-bench-"))
    with ExitStack() as stack:
        if not args.keep:
            stack.callback(shutil.rmtree, work_dir, True)
        else:
            say(f"work directory: {work_dir}")
        redis_url, redis_pid = stack.enter_context(redis_server(work_dir))
        service_url_redis = redis_url
        baseline_url_redis = url_with_db(redis_url, db_of(redis_url) + 1)

        tokens = work_dir / "tokens.txt"
        make_tokens(args.users, tokens)

        common_env = {**os.environ, "JWT_SECRET": JWT_SECRET, "LOG_LEVEL": "WARNING", "PYTHONUNBUFFERED": "1"}
        service_port, baseline_port = free_port(), free_port()
        service_child = Child(
            "service",
            [sys.executable, "-m", "service", "serve", "--workers", "1", "--host", "127.0.0.1",
             "--port", str(service_port)],
            {**common_env, "REDIS_URL": service_url_redis, "PROGRESS_FLUSHER_ENABLED": "false",
             "CONTENT_CATALOG_ENABLED": "false", "RATE_LIMIT_PER_USER_PER_SECOND": "0"},
            work_dir / "service.log",
        )  # fmt: skip
        stack.callback(service_child.stop)
        door_target = None
        if args.door:
            database_url = stack.enter_context(postgres_with_content(work_dir, args.contents))
            door_url_redis = url_with_db(redis_url, db_of(redis_url) + 2)
            door_port = free_port()
            door_child = Child(
                "door",
                [sys.executable, "-m", "service", "serve", "--workers", "1", "--host", "127.0.0.1",
                 "--port", str(door_port)],
                {**common_env, "REDIS_URL": door_url_redis, "DATABASE_URL": database_url,
                 "PROGRESS_FLUSHER_ENABLED": "false", "TRIAL_JOURNEY_INTERVAL_SECONDS": "0",
                 "RELAY_ENABLED": "false", "EMAIL_PUBLISHER": "redis-stream",
                 "CONTENT_CATALOG_ENABLED": "true"},  # the rate limit at its defaults
                work_dir / "door.log",
            )  # fmt: skip
            stack.callback(door_child.stop)
            wait_http_ok(door_child, f"http://127.0.0.1:{door_port}/health/ready")
            door_target = Target("service+door", door_child, f"http://127.0.0.1:{door_port}",
                                 stack.enter_context(Redis.from_url(door_url_redis)), redis_pid)  # fmt: skip
        baseline_child = Child(
            "baseline",
            [sys.executable, str(BENCH_DIR / "baseline_app.py"), "--host", "127.0.0.1", "--port", str(baseline_port)],
            {**common_env, "REDIS_URL": baseline_url_redis},
            work_dir / "baseline.log",
        )
        stack.callback(baseline_child.stop)
        service_url, baseline_url = f"http://127.0.0.1:{service_port}", f"http://127.0.0.1:{baseline_port}"
        wait_http_ok(service_child, f"{service_url}/health/ready")
        wait_http_ok(baseline_child, f"{baseline_url}/health/live")
        say(f"service pid {service_child.pid} on {service_url} (Redis {service_url_redis}); "
            f"baseline pid {baseline_child.pid} on {baseline_url} (Redis {baseline_url_redis})")  # fmt: skip

        targets = [
            Target("service", service_child, service_url,
                   stack.enter_context(Redis.from_url(service_url_redis)), redis_pid),
            Target("baseline", baseline_child, baseline_url,
                   stack.enter_context(Redis.from_url(baseline_url_redis)), redis_pid),
        ]  # fmt: skip
        rss_idle = rss_kib(service_child.pid)
        results: dict[str, WrkResult] = {}
        for target in targets:
            target.redis.flushdb()
            load(target, wrk, tokens, args, args.warmup, "warm-up")
            target.redis.flushdb()
            wait_until_idle(args.wait_idle)
            results[target.name] = load(target, wrk, tokens, args, args.duration, "measured")
            counts = check_writes(target.redis, target.name)
            say(f"{target.name}: {results[target.name].rps:.0f} req/s; all {results[target.name].requests} "
                f"answers 201; pending members {counts}")  # fmt: skip

        print_table(results, args)
        rss_now = rss_kib(service_child.pid)
        print(f"service RSS: {mib(rss_idle['VmRSS']):.1f} MiB idle after start, {mib(rss_now['VmRSS']):.1f} MiB "
              f"after {targets[0].served} requests")  # fmt: skip
        if door_target is not None:
            door_comparison(targets[0], door_target, wrk, tokens, args)
            one_token = work_dir / "one_token.txt"
            one_token.write_text(tokens.read_text().splitlines()[0] + "\n")
            bogus_ids(door_target, wrk, tokens, one_token, args)
        if args.million:
            drive_to_million(targets[0], wrk, tokens, args, results["service"].rps)
            check_writes(targets[0].redis, "service")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
    except RuntimeError as exc:
        print(f"bench failed: {exc}", file=sys.stderr)
        sys.exit(1)
