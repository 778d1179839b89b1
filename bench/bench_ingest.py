"""Request path over HTTP: the heartbeat of `serve` (one worker, the door on, as a production pod runs) against the
bare ASGI floor (bench/baseline_app.py: the same uvicorn, uvloop and httptools, no work), alternating rounds of the
same wrk load: req/s, latencies, server CPU per request, the share of the floor; then made-up ids (the door's 404s,
no key left) and the RSS. --million: then --requests N (a million) in all and the RSS. --tracing: a third service
with tracing configured (OTLP, the default sampler), in the same rounds.

    .venv/bin/python bench/bench_ingest.py [--rounds 3] [--duration 20] [--warmup 10] [--million [--requests N]]
        [--tracing]
    smallest: --rounds 1 --duration 1 --warmup 1 --wait-idle 0 [--million --requests 20000] [--tracing]
"""

import asyncio
import re
from functools import partial
from pathlib import Path
from typing import Any

import harness
from harness import WrkResult, median
from redis import Redis

from service.progress.content import CONTENT_KINDS

BOGUS_IDS = (1_000_000_000, 2_000_000_000)  # made-up content ids: none exists
LOAD = {"duration": 20.0, "warmup": 10.0, "connections": 64, "users": 10_000, "contents": 2000, "wait_idle": 120.0}


def rss_mib(pid: int) -> dict[str, float]:
    """VmRSS and VmHWM (the peak) of `pid`."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    fields = (line.partition(":") for line in lines)
    return {k: int(v.split()[0]) / 1024 for k, _, v in fields if k in ("VmRSS", "VmHWM")}


def check_writes(redis: Redis, name: str) -> None:
    """The run left pending members, and a pending member's latest position is stored and well formed."""
    found = 0
    for kind in (kind.name for kind in CONTENT_KINDS):
        member = redis.srandmember(f"progress:pending_flush:{kind}")
        if isinstance(member, bytes):
            found += 1
            value = redis.get(f"progress:latest_position:{kind}:{member.decode()}")
            # "{position}:{ms}", then ":{peak}" and ":{microseconds}" (service.progress.ingest.buffer)
            if not isinstance(value, bytes) or not re.fullmatch(rb"[\d.]+:\d{13}(:[\d.]+)?(:\d{1,3})?", value):
                raise RuntimeError(f"{name}: pending member {kind} {member!r} has value {value!r}")
    if not found:
        raise RuntimeError(f"{name}: the pending sets are empty after the run")


@harness.main(**LOAD, tracing=False, rounds=3, million=False, requests=1_000_000)
def main(args: harness.Namespace) -> None:
    served: dict[str, int] = {}

    with harness.servers("ingest", postgres=True) as s:
        asyncio.run(harness.seed(s.database_url, users=0, contents=args.contents))
        tokens = harness.tokens(s.work, args.users)

        def load(name: str, seconds: float, token_file: Path = tokens, **how: Any) -> WrkResult:
            """`seconds` of wrk on children[name]; `how`: wrk's ids and expect, when not the known ids' 201."""
            child = children[name]
            how = {"ids": (1, args.contents), "connections": args.connections, **how}
            result = harness.wrk(child.url, token_file, duration_s=seconds, pids=(child.pid, s.redis_pid), **how)
            served[name] = served.get(name, 0) + result.requests
            return result

        def measured(name: str) -> WrkResult:
            if name in redis:
                redis[name].flushdb()
            harness.wait_until_idle(args.wait_idle)
            result = load(name, args.duration)
            if name in redis:
                check_writes(redis[name], name)
            return result

        names = ["service", "service+tracing"] if args.tracing else ["service"]
        otel = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}  # discard port
        children = {"bare ASGI": s.floor()}
        for db, name in enumerate(names):  # the door on: the catalog in Postgres
            env = {**(otel if "tracing" in name else {}), "REDIS_URL": harness.redis_db(s.redis_url, db)}
            children[name] = s.service(name, CONTENT_CATALOG_ENABLED="true", **env)
        if args.tracing and "google/_upb" not in Path(f"/proc/{children[names[1]].pid}/maps").read_text():
            raise RuntimeError("service+tracing did not load the OTLP exporter: is the otel extra installed?")
        redis = {
            n: s.stack.enter_context(Redis.from_url(harness.redis_db(s.redis_url, db))) for db, n in enumerate(names)
        }
        service_pid = children["service"].pid
        rss_idle = rss_mib(service_pid)["VmRSS"]
        for name in children:
            load(name, args.warmup)
        runs = harness.rounds({n: partial(measured, n) for n in children}, args.rounds)
        print(
            f"\nwrk 2 threads, {args.connections} connections, {args.rounds} alternating rounds of "
            f"{args.duration:.0f}s after {args.warmup:.0f}s warm-up; {args.users} users, content ids 1..{args.contents}"
        )
        rows = []
        for n, rs in runs.items():
            rps, p50, p99, p999 = harness.medians(rs, "rps", "p50_ms", "p99_ms", "p999_ms")
            cpu = median(r.us_per_request(children[n].pid) for r in rs)
            rows.append([n, rps, ", ".join(f"{r.rps:,.0f}" for r in rs), p50, p99, p999, cpu])
        share = rows[1][1] / rows[0][1]
        harness.table(" | median req/s | runs req/s | p50 ms | p99 ms | p99.9 ms | server CPU µs/request", rows)
        harness.target("heartbeat req/s >= 45% of the bare ASGI app's", f"{share:.1%}", share >= 0.45)
        harness.target(
            f"service p99 < 15 ms at {args.connections} connections", f"{rows[1][4]:.2f} ms", rows[1][4] < 15
        )
        if args.tracing:
            more = rows[2][6] / rows[1][6] - 1
            harness.target("server CPU per heartbeat with tracing configured <= 5% more", f"{more:+.1%}", more <= 0.05)
        print(f"\ndoor: made-up content ids ({BOGUS_IDS[0]}..{BOGUS_IDS[1]}), {args.duration:.0f}s")
        one_token = s.work / "one_token.txt"
        one_token.write_text(tokens.read_text().splitlines()[0] + "\n")
        for label, token_file in (("one token", one_token), (f"{args.users} tokens", tokens)):
            redis["service"].flushdb()
            r = load("service", args.duration, token_file, ids=BOGUS_IDS, expect=(404,))
            keys = int(redis["service"].dbsize())
            harness.target(f"{label}: {r.rps:,.0f} answers/s {r.statuses}, Redis keys left", str(keys), keys == 0)
        rss = rss_mib(service_pid)["VmRSS"]
        print(f"service RSS: {rss_idle:.1f} MiB idle, {rss:.1f} MiB after {served['service']:,} requests")

        if args.million:  # every request is a 201 (wrk checks the answers), so wrk's count is the service's
            rate = rows[1][1]
            while served["service"] < args.requests:
                seconds = min(120.0, max(1.0, (args.requests - served["service"]) / rate * 1.05 + 1))
                rate = load("service", seconds).rps
            after = rss_mib(service_pid)
            print(
                f"\nservice memory after {served['service']:,} requests: VmRSS {after['VmRSS']:.1f} MiB, "
                f"peak {after['VmHWM']:.1f} MiB"
            )
            mb = after["VmRSS"] * 1.048576
            harness.target(f"RSS < 150 MB after {args.requests:,} requests", f"{mb:.1f} MB", mb < 150)
            check_writes(redis["service"], "service")
