"""Request path over HTTP: `serve` (one worker) against bench/baseline_app.py, both under the same wrk load.

req/s, latencies, server CPU per request, the ratio, RSS; --million: then --requests N (a million) in all and the
RSS. --door: a second service with the door on, alternating rounds against the first (known ids), then made-up ids.
--tracing: a second service with tracing configured (OTLP, the default sampler), alternating rounds against the first.

    .venv/bin/python bench/bench_ingest.py [--duration 20] [--warmup 10] [--million [--requests N]] [--door --rounds 3]
        [--tracing]
    smallest: --duration 1 --warmup 1 --wait-idle 0 [--million --requests 20000] [--door --rounds 1] [--tracing]
    (--door needs many --users)
"""

import asyncio
import re
import sys
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


@harness.main(**LOAD, door=False, tracing=False, rounds=3, million=False, requests=1_000_000)
def main(args: harness.Namespace) -> None:
    served: dict[str, int] = {}

    with harness.servers("ingest", postgres=args.door) as s:
        tokens = harness.tokens(s.work, args.users)

        def load(name: str, seconds: float, token_file: Path = tokens, **how: Any) -> WrkResult:
            """`seconds` of wrk on children[name]; `how`: wrk's ids and expect, when not the known ids' 201."""
            child = children[name]
            how = {"ids": (1, args.contents), "connections": args.connections, **how}
            result = harness.wrk(child.url, token_file, duration_s=seconds, pids=(child.pid, s.redis_pid), **how)
            served[name] = served.get(name, 0) + result.requests
            return result

        def measured(name: str) -> WrkResult:
            redis[name].flushdb()
            harness.wait_until_idle(args.wait_idle)
            result = load(name, args.duration)
            check_writes(redis[name], name)
            return result

        port = harness.embedded.free_port()
        app = [sys.executable, str(harness.BENCH / "baseline_app.py"), "--port", str(port)]
        env = {"JWT_SECRET": harness.JWT_SECRET, "REDIS_URL": harness.redis_db(s.redis_url, 1)}
        children = {
            "service": s.service("service", REDIS_URL=harness.redis_db(s.redis_url, 0), DATABASE_URL=""),
            "baseline": s.child("baseline", app, env, f"http://127.0.0.1:{port}/health/live"),
        }
        redis = {
            name: s.stack.enter_context(Redis.from_url(harness.redis_db(s.redis_url, db)))
            for db, name in enumerate(("service", "baseline", "service+door", "service+tracing"))
        }
        service_pid = children["service"].pid
        rss_idle = rss_mib(service_pid)["VmRSS"]
        results = {}
        for name in children:
            load(name, args.warmup)
            results[name] = measured(name)
        service, baseline = results["service"], results["baseline"]
        ratio = service.rps / baseline.rps
        print(
            f"\nwrk 2 threads, {args.connections} connections, {args.duration:.0f}s after {args.warmup:.0f}s "
            f"warm-up; {args.users} users, content ids 1..{args.contents}, 4 routes"
        )
        latencies = ("p50_ms", "p99_ms", "p999_ms")
        rows = [
            [n, r.rps, *(getattr(r, q) for q in latencies), 0, r.us_per_request(children[n].pid)]
            for n, r in results.items()
        ]
        ratios = [getattr(service, q) / getattr(baseline, q) for q in latencies]
        harness.table(
            " | req/s | p50 ms | p99 ms | p99.9 ms | non-201 | server CPU µs/request",
            [*rows, ["ratio", f"**{ratio:.2f}x**", *ratios, "", ""]],
        )
        rss = rss_mib(service_pid)["VmRSS"]
        print(f"service RSS: {rss_idle:.1f} MiB idle, {rss:.1f} MiB after {served['service']:,} requests")
        harness.target("service req/s >= 4x baseline", f"{ratio:.2f}x", ratio >= 4)
        p99_target = f"service p99 < 15 ms at {args.connections} connections"
        harness.target(p99_target, f"{service.p99_ms:.2f} ms", service.p99_ms < 15)

        def side_by_side(other: str) -> list[list[Any]]:
            """Alternating rounds of the service and `other` under the same load: a row of medians each."""
            load(other, args.warmup)
            runs = harness.rounds({n: partial(measured, n) for n in ("service", other)}, args.rounds)
            print(f"\n{other}: the same load, known ids, {args.rounds} alternating rounds of {args.duration:.0f}s")
            rows = []
            for n, rs in runs.items():
                rps, p99 = harness.medians(rs, "rps", "p99_ms")
                cpu = median(r.us_per_request(children[n].pid) for r in rs)
                rows.append([n, rps, ", ".join(f"{r.rps:,.0f}" for r in rs), p99, cpu])
            harness.table(" | median req/s | runs req/s | median p99 ms | server CPU µs/request", rows)
            return rows

        if args.door:
            asyncio.run(harness.seed(s.database_url, users=0, contents=args.contents))
            door_env = {"REDIS_URL": harness.redis_db(s.redis_url, 2), "CONTENT_CATALOG_ENABLED": "true"}
            children["service+door"] = s.service("service+door", **door_env)  # the catalog on
            rows = side_by_side("service+door")
            share = rows[1][1] / rows[0][1]
            harness.target("throughput with the door >= 95% of without", f"{share:.1%}", share >= 0.95)
            print(f"\ndoor: made-up content ids ({BOGUS_IDS[0]}..{BOGUS_IDS[1]}), {args.duration:.0f}s")
            one_token = s.work / "one_token.txt"
            one_token.write_text(tokens.read_text().splitlines()[0] + "\n")
            for label, token_file in (("one token", one_token), (f"{args.users} tokens", tokens)):
                redis["service+door"].flushdb()
                r = load("service+door", args.duration, token_file, ids=BOGUS_IDS, expect=(404,))
                keys = int(redis["service+door"].dbsize())
                harness.target(f"{label}: {r.rps:,.0f} answers/s {r.statuses}, Redis keys left", str(keys), keys == 0)

        if args.tracing:  # a collector address with none behind it: a heartbeat makes no span to send there
            otel = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}  # discard port
            child = s.service("service+tracing", **otel, REDIS_URL=harness.redis_db(s.redis_url, 3), DATABASE_URL="")
            children["service+tracing"] = child
            if "google/_upb" not in Path(f"/proc/{child.pid}/maps").read_text():  # the OTLP exporter's protobuf
                raise RuntimeError("service+tracing did not load the OTLP exporter: is the otel extra installed?")
            rows = side_by_side("service+tracing")
            more = rows[1][4] / rows[0][4] - 1
            harness.target("server CPU per heartbeat with tracing configured <= 5% more", f"{more:+.1%}", more <= 0.05)

        if args.million:  # every request is a 201 (wrk checks the answers), so wrk's count is the service's
            rate = service.rps
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
