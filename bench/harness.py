"""The benchmarks' one harness: servers, the service as a subprocess, wrk, a CPU meter, rounds and tables.

Each bench/bench_*.py is a short scenario on top of it; everything runs on 127.0.0.1, in embedded servers. A scenario
builds the service parts it runs in-process (flusher, relay, leases) itself, on `settings` (at the end).
"""

import asyncio
import ctypes
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from argparse import ArgumentParser, Namespace, RawDescriptionHelpFormatter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import asyncpg

from service.auth import make_token
from service.config import Settings
from service.dev import database, embedded
from service.progress.content import CONTENT_KINDS
from service.progress.flush.backlog import measure_backlog
from service.progress.ingest.buffer import WRITE_SCRIPT, write_args
from service.progress.keys import STANDALONE, KeyLayout

BENCH = Path(__file__).resolve().parent
JWT_SECRET = "bench-secret-0123456789-abcdefghijklmnopqrstuvwxyz"
# what `serve` runs with in a benchmark unless a scenario says otherwise: the request path alone, door off
SERVICE_ENV = {"LOG_LEVEL": "WARNING", "PYTHONUNBUFFERED": "1", "JWT_SECRET": JWT_SECRET,
               "PROGRESS_FLUSHER_ENABLED": "false", "TRIAL_JOURNEY_INTERVAL_SECONDS": "0", "RELAY_ENABLED": "false",
               "EMAIL_PUBLISHER": "redis-stream", "CONTENT_CATALOG_ENABLED": "false"}  # fmt: skip
T = TypeVar("T")
median = statistics.median


def say(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


MISSED: list[str] = []  # the targets missed so far: main() exits 1 if any


def target(name: str, value: str, ok: bool) -> None:
    print(f"target: {name}: {value} {'PASS' if ok else 'MISS'}")
    if not ok:
        MISSED.append(name)


def cell(v: object) -> str:
    """A table's cell, as bench/RESULTS.md quotes them: floats to 2 decimals below 1,000, else whole."""
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.2f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def table(header: str, rows: list[list[Any]]) -> None:
    """A Markdown table under `header`, its titles as the table prints them: "a | b | c"."""
    print(f"\n| {header} |\n|" + "---|" * (header.count(" | ") + 1))
    for row in rows:
        print("| " + " | ".join(cell(value) for value in row) + " |")


def medians(results: list[Any], *fields: str) -> list[float]:
    """The median of each field over `results` (e.g. the rounds of one variant)."""
    return [median(getattr(r, field) for r in results) for field in fields]


def rounds(variants: dict[str, Callable[[], T]], count: int) -> dict[str, list[T]]:
    """`count` rounds of every variant, in reverse order every other round, so a drift hits all alike."""
    runs: dict[str, list[T]] = {name: [] for name in variants}
    for order in orders(list(variants), count):
        for name in order:
            runs[name].append(variants[name]())
    return runs


def orders(names: list[str], count: int) -> Iterator[list[str]]:
    """`count` rounds of `names`, reversed every other round (the order of `rounds`, for async variants)."""
    return (names if i % 2 == 0 else names[::-1] for i in range(count))


def main(**flags: float | bool | str) -> Callable[[Callable[[Namespace], None]], None]:
    """The decorator of a scenario's main(args), which it runs when the scenario runs as a script: the flags from the
    script's docstring and `flags` (`wait_idle=60.0` is `--wait-idle`, default 60.0; False is a switch); a SIGTERM
    unwinds like Ctrl-C (so every server started is stopped); exit 1 on a failure or a missed target."""

    def run(scenario: Callable[[Namespace], None]) -> None:
        if scenario.__module__ != "__main__":
            return
        parser = ArgumentParser(
            description=sys.modules["__main__"].__doc__, formatter_class=RawDescriptionHelpFormatter
        )
        for name, default in flags.items():
            flag = f"--{name.replace('_', '-')}"
            if default is False:
                parser.add_argument(flag, action="store_true")
            else:
                parser.add_argument(flag, type=type(default), default=default, help=f"default {default}")
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        try:
            scenario(parser.parse_args())
            sys.exit(1 if MISSED else 0)
        except KeyboardInterrupt:
            sys.exit(130)
        except RuntimeError as exc:
            print(f"bench failed: {exc}", file=sys.stderr)
            sys.exit(1)

    return run


# --- CPU ---


def cpu_seconds(pid: int) -> float:
    """User + system CPU of `pid` and its reaped children, plus its live children's (not for this process)."""

    def times(p: int | str, count: int) -> float:
        fields = Path(f"/proc/{p}/stat").read_text().rpartition(")")[2].split()
        return sum(int(v) for v in fields[11 : 11 + count]) / os.sysconf("SC_CLK_TCK")  # utime stime cutime cstime

    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split() if pid != os.getpid() else []
        total = times(pid, 4)
    except (OSError, ValueError):
        return 0.0
    for child in children:
        with suppress(OSError, ValueError):  # exited meanwhile: its time moves to the parent's cutime
            total += times(child, 2)
    return total


def machine_busy_s() -> float:
    """CPU seconds all CPUs spent not idle (nor waiting for I/O) since boot."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(values) - values[3] - values[4]) / os.sysconf("SC_CLK_TCK")


def cpu_meter(*pids: int | None) -> Callable[[], dict[int, float]]:
    """Meters the CPU seconds of `pids` from now: call the result to stop, for {pid: seconds}; it warns if everything
    else used more than 0.2 cores meanwhile."""
    metered = [pid for pid in dict.fromkeys(pids) if pid]
    wall0, busy0, cpu0 = time.monotonic(), machine_busy_s(), [cpu_seconds(pid) for pid in metered]

    def stop() -> dict[int, float]:
        wall1, busy1, cpu1 = time.monotonic(), machine_busy_s(), [cpu_seconds(pid) for pid in metered]
        seconds = {pid: b - a for pid, a, b in zip(metered, cpu0, cpu1, strict=True)}
        if (other := max(0.0, busy1 - busy0 - sum(seconds.values())) / (wall1 - wall0)) > 0.2:
            say(f"WARNING: other processes used {other:.2f} cores meanwhile: the figures are low")
        return seconds

    return stop


def wait_until_idle(limit_s: float) -> None:
    """Before a measured run: wait (up to limit_s) until other processes leave the CPUs alone."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        busy = machine_busy_s()
        time.sleep(1.0)
        if machine_busy_s() - busy < 0.15:
            return


# --- servers and child processes ---


def _dying_with_us() -> None:
    """In a child before exec: SIGTERM when this script dies, even SIGKILLed."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


# how every child runs: in the repository, reading nothing, dying with this script
IN_REPO = {"cwd": BENCH.parent, "stdin": subprocess.DEVNULL, "preexec_fn": _dying_with_us}


def run_to_end(args: list[str], timeout_s: float, env: dict[str, str] | None = None) -> str:
    """Runs `args` (IN_REPO) to its end: its stdout; a RuntimeError if it fails."""
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout_s, **IN_REPO)
    if done.returncode != 0:
        raise RuntimeError(f"{args[:3]} exited {done.returncode}:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    return done.stdout


class Child(subprocess.Popen[bytes]):
    """A process in its own session (IN_REPO, its output to `log_path`), stopped with its whole group."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], log_path: Path) -> None:
        self.name, self.log_path, self.url = name, log_path, ""
        with open(log_path, "ab") as out:
            super().__init__(args, env=env, stdout=out, stderr=out, start_new_session=True, **IN_REPO)

    def wait_for(self, ready: Callable[[], bool], timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            if self.poll() is not None or time.monotonic() > deadline:
                log = self.log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{self.name} not ready in {timeout_s:.0f}s ({self.poll()}):\n{log}")
            time.sleep(0.1)

    def stop(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):  # SIGKILL only if SIGTERM did not stop it in 10 s
            with suppress(ProcessLookupError, subprocess.TimeoutExpired):
                if self.poll() is None:
                    os.killpg(self.pid, sig)
                    self.wait(10)


def http_ok(url: str) -> bool:
    with suppress(OSError), urllib.request.urlopen(url, timeout=1) as answer:
        return bool(answer.status == 200)
    return False


@dataclass
class Servers:
    work: Path
    stack: ExitStack
    redis_url: str = ""
    redis_pid: int | None = None
    database_url: str = ""
    postgres_pid: int | None = None

    def child(self, name: str, args: list[str], env: dict[str, str], ready_url: str = "") -> Child:
        """A child process stopped with the servers; waits for `ready_url` (its url + /health/...) to answer 200."""
        process = Child(name, args, {**os.environ, **env}, self.work / f"{name}.log")
        self.stack.callback(process.stop)
        if ready_url:
            process.wait_for(lambda: http_ok(ready_url))
            process.url = ready_url.rsplit("/health/", 1)[0]
        return process

    def service_env(self, **env: str | None) -> dict[str, str]:
        """SERVICE_ENV on these servers, then `env` (None: unset, the setting's default)."""
        merged = {**SERVICE_ENV, "REDIS_URL": self.redis_url, "DATABASE_URL": self.database_url, **env}
        return {name: value for name, value in merged.items() if value is not None}

    def service(self, name: str, **env: str | None) -> Child:
        """`python -m service serve --workers 1`, as production starts it, with service_env(**env)."""
        port = embedded.free_port()
        args = [sys.executable, *f"-m service serve --workers 1 --host 127.0.0.1 --port {port}".split()]
        return self.child(name, args, self.service_env(**env), f"http://127.0.0.1:{port}/health/ready")

    def floor(self) -> Child:
        """bench/baseline_app.py: a bare ASGI app under the same uvicorn, uvloop and httptools, the HTTP floor."""
        port = embedded.free_port()
        args = [sys.executable, str(BENCH / "baseline_app.py"), "--port", str(port)]
        return self.child("bare ASGI", args, {}, f"http://127.0.0.1:{port}/health/live")

    def command(self, *args: str, **env: str | None) -> dict[str, Any]:
        """A one-shot `python -m service ...` (e.g. `flush --once`): its JSON summary, the last line it prints."""
        out = run_to_end([sys.executable, "-m", "service", *args], 900, {**os.environ, **self.service_env(**env)})
        return dict(json.loads(out.strip().splitlines()[-1]))


@contextmanager
def servers(name: str, *, redis: bool = True, postgres: bool = False, durable: bool = False) -> Iterator[Servers]:
    """A work folder, an embedded Valkey and/or a migrated embedded Postgres (durable: fsync on), all removed after."""
    work = Path(tempfile.mkdtemp(prefix=f"progress-bench-{name}-"))
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, work, True)
        s = Servers(work, stack)
        if redis:
            valkey = embedded.EmbeddedRedis(work / "valkey", None)
            say(f"starting embedded Valkey on 127.0.0.1:{valkey.port}")
            valkey.start()
            stack.callback(valkey.stop)
            s.redis_url, s.redis_pid = valkey.url, valkey.process.pid if valkey.process else None
        if postgres:
            pg = database.EmbeddedPostgres(work / "postgres", None, durable=durable)
            say(f"starting embedded Postgres on 127.0.0.1:{pg.port} (fsync {'on' if durable else 'off'})")
            pg.start()
            stack.callback(pg.stop)
            pg.create_database("bench")
            s.database_url, s.postgres_pid = pg.url("bench"), pg.process.pid if pg.process else None
            asyncio.run(database.prepare_database(s.database_url, seed=False))
        yield s


def redis_db(url: str, db: int) -> str:
    return url.rsplit("/", 1)[0] + f"/{db}"


async def seed(database_url: str, *, users: int, contents: int, duration_s: int = 600, rows: bool = False) -> None:
    """Users 1..users and content ids 1..contents of every type (each lasting duration_s), nothing else; rows: and a
    progress row for every (user, content) of every type, two hours old, one in five completed."""
    statements = [
        f"TRUNCATE users_user, {', '.join(k.content_table for k in CONTENT_KINDS)} RESTART IDENTITY CASCADE",
        f"INSERT INTO users_user (id, email) SELECT i, 'u' || i || '@example.com' FROM generate_series(1, {users}) i",
    ]
    for name, progress, column in ((k.content_table, k.progress_table, k.id_column) for k in CONTENT_KINDS):
        statements.append(
            f"INSERT INTO {name} (id, title, duration) SELECT i, 'c' || i, {duration_s} "
            f"FROM generate_series(1, {contents}) i"
        )
        if rows:
            statements.append(
                f"INSERT INTO {progress} (user_id, {column}, position, completed_at, created_at, updated_at) "
                "SELECT u, c, (u * 7 + c) % 500, CASE WHEN (u + c) % 5 = 0 THEN now() - interval '3 hours' END, "
                f"now() - interval '3 hours', now() - interval '2 hours' "
                f"FROM generate_series(1, {users}) u, generate_series(1, {contents}) c"
            )
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute(";\n".join(statements))  # one implicit transaction; VACUUM cannot run in one
        await conn.execute("VACUUM ANALYZE")
    finally:
        await conn.close()


async def fill(
    redis: Any, keys: int, position: Callable[[int], float], *, lessons: int = 10, layout: KeyLayout = STANDALONE
) -> None:
    """One heartbeat for each of `keys` keys, by the request path's own script, pipelined as it sends them: key i is
    lesson i % lessons + 1 of user i // lessons + 1, at position(i)."""
    await redis.script_load(WRITE_SCRIPT)
    for first in range(0, keys, 1000):
        async with redis.pipeline(transaction=False) as pipe:
            for i in range(first, min(first + 1000, keys)):
                pipe.execute_command(
                    *write_args("lesson", i % lessons + 1, i // lessons + 1, position(i), layout=layout)
                )
            await pipe.execute()


async def buffered(redis: Any, layout: KeyLayout = STANDALONE) -> int:
    """The members the buffer still holds, pending or in flight, over every type and shard (the service's own count)."""
    backlog = await measure_backlog(redis, layout)
    return sum(sizes.pending + sizes.in_flight for sizes in backlog.by_type.values())


def tokens(work: Path, users: int) -> Path:
    """A file of one HS256 token per user 1..users, a line each (what bench/requests.lua reads)."""
    signer = Settings(jwt_secret=JWT_SECRET)
    path = work / "tokens.txt"
    lines = (make_token(signer, u, ttl_s=7 * 24 * 3600) for u in range(1, users + 1))
    path.write_text("".join(f"{line}\n" for line in lines))
    return path


# --- wrk ---


@dataclass(frozen=True)
class WrkResult:
    requests: int
    seconds: float
    p50_ms: float
    p99_ms: float
    p999_ms: float
    statuses: dict[str, int]
    cpu: dict[int, float]  # CPU seconds by pid (cpu_meter)

    @property
    def rps(self) -> float:
        return self.requests / self.seconds

    def us_per_request(self, pid: int | None) -> float:
        return self.cpu.get(pid or 0, 0.0) / self.requests * 1e6


def wrk(
    url: str,
    tokens_file: Path,
    *,
    duration_s: float,
    mode: str = "heartbeat",
    ids: tuple[int, int] = (1, 2000),
    connections: int = 64,
    expect: tuple[int, ...] = (201,),
    pids: tuple[int | None, ...] = (),
    timeout_s: int = 2,
) -> WrkResult:
    """One wrk run (2 threads) of bench/requests.lua; every answer must be one of `expect`. Meters `pids` meanwhile.

    mode: heartbeat (a random route of the four), lesson (the lesson route), one (GET of one lesson), many (100 ids),
    sync (POST /progress/sync of 500 items); content ids drawn from `ids`, users from the tokens.
    """
    say(f"wrk {mode} {url}: {duration_s:.0f}s, {connections} connections")
    stop = cpu_meter(os.getpid(), *pids)  # wrk is our child: its time is ours once it is reaped
    flags = f"-t2 -c{connections} -d{max(1, round(duration_s))}s --latency --timeout {timeout_s}s"
    script = [str(BENCH / "requests.lua"), url, "--", str(tokens_file), mode, str(ids[0]), str(ids[1])]
    if not (path := shutil.which("wrk")):
        raise RuntimeError("wrk is not installed: run `apt-get install wrk` (as root)")
    out = run_to_end([path, *flags.split(), "-s", *script], duration_s + 60)
    cpu = stop()
    if (match := re.search(r"^BENCH_RESULT (\{.*\})$", out, re.MULTILINE)) is None:
        raise RuntimeError(f"wrk printed no BENCH_RESULT:\n{out}")
    data = json.loads(match.group(1))
    unexpected = {s: n for s, n in data["statuses"].items() if int(s) not in expect}
    if unexpected or data["socket_errors"]:
        raise RuntimeError(f"{url} {mode}: unexpected answers {unexpected}, {data['socket_errors']} socket errors")
    latencies = (data[f"{q}_us"] / 1000 for q in ("p50", "p99", "p999"))
    return WrkResult(data["requests"], data["duration_us"] / 1e6, *latencies, data["statuses"], cpu)


# --- the settings of a service part built in-process ---


def settings(s: Servers, **env: str | None) -> Settings:
    """The settings `s.service(**env)` would run with, for a part built in this process (names as in service_env)."""
    return Settings(**{name.lower(): value for name, value in s.service_env(**env).items() if value})
