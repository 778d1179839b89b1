"""Capacity of the buffer on one Redis and on a Redis Cluster, and the request path on each.

In one run on one machine: an embedded standalone Valkey and an embedded Valkey Cluster (3 masters,
3 replicas), then
1. Redis CPU per heartbeat, from INFO commandstats (the server's own time in the write script),
   standalone and on the cluster's masters, and per flushed key (claim + ack scripts);
2. from those, heartbeats per second per Redis core and the masters needed for 1M and 10M
   concurrent listeners (one heartbeat every 5 s each);
3. the HTTP request path (one `serve` worker, wrk as bench/bench_ingest.py runs it) on the standalone
   server, on the cluster, and on the cluster with REDIS_WAIT_REPLICAS=1: requests/s and p99, and
   the cluster's share of the standalone throughput (target: at least 85 %).

    .venv/bin/python bench/bench_cluster.py [--duration 10] [--warmup 3] [--repeat 2] [--keys 100000]
"""

import argparse
import asyncio
import math
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from redis import Redis
from redis import RedisCluster as SyncRedisCluster
from redis.asyncio import Redis as AsyncRedis
from redis.asyncio import RedisCluster

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_ingest as ingest  # the sibling script: its wrk runner and process helpers

from service.app import build_key_layout
from service.clients import RedisClient
from service.config import Settings
from service.embedded import EmbeddedCluster, EmbeddedRedis
from service.progress.buffer import WRITE_SCRIPT, now_ms, write_args
from service.progress.keys import KeyLayout
from service.progress.leases import Leases

HEARTBEAT_EVERY_S = 5.0
FLUSH_INTERVAL_S = 60.0  # the default: a listener's key is flushed once per interval, whatever its heartbeats
TARGET_SHARE = 0.85
MASTER_BUSY_LIMIT = 0.5  # plan masters at half a core: room for spikes, resharding and a failover's doubling


def say(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def script_usec(nodes: list[Redis]) -> tuple[int, int]:
    """(calls, µs) of EVALSHA summed over `nodes`, since their last CONFIG RESETSTAT."""
    calls = usec = 0
    for node in nodes:
        stats = node.info("commandstats").get("cmdstat_evalsha", {})
        calls += int(stats.get("calls", 0))
        usec += int(stats.get("usec", 0))
    return calls, usec


def reset(nodes: list[Redis]) -> None:
    for node in nodes:
        node.config_resetstat()


async def write_heartbeats(redis: RedisClient, layout: KeyLayout, keys: int, rounds: int) -> None:
    """`rounds` heartbeats for each of `keys` lesson keys, pipelined as the request path sends them."""
    await redis.script_load(WRITE_SCRIPT)
    for round_ in range(rounds):
        for first in range(0, keys, 1000):
            async with redis.pipeline(transaction=False) as pipe:
                for i in range(first, min(first + 1000, keys)):
                    pipe.execute_command(*write_args("lesson", i % 1000 + 1, i // 1000 + 1, float(round_ * 10),
                                                     now_ms(), 3600, layout))  # type: ignore[arg-type]  # fmt: skip
                await pipe.execute()


async def claim_and_ack_all(redis: RedisClient, layout: KeyLayout, batch: int) -> int:
    leases = Leases(redis)
    flushed = 0
    for shard in layout.shards_of("lesson"):
        while True:
            claim = await leases.claim_batch(shard, count=batch, now_ms=now_ms(), lease_ms=60_000)
            if not claim.entries:
                break
            flushed += await leases.ack(claim)
    return flushed


async def _with_client(connect: Callable[[], RedisClient], work: Callable[[RedisClient], Any]) -> Any:
    client = connect()
    try:
        return await work(client)
    finally:
        await client.aclose()


def measure_scripts(name: str, connect: Callable[[], RedisClient], nodes: list[Redis], layout: KeyLayout,
                    args: argparse.Namespace) -> dict[str, float]:  # fmt: skip
    for node in nodes:
        node.flushall()
    reset(nodes)
    asyncio.run(_with_client(connect, lambda client: write_heartbeats(client, layout, args.keys, args.rounds)))
    calls, usec = script_usec(nodes)
    write_us = usec / calls
    reset(nodes)
    flushed = asyncio.run(_with_client(connect, lambda client: claim_and_ack_all(client, layout, 500)))
    _, usec = script_usec(nodes)
    if flushed != args.keys:
        raise RuntimeError(f"{name}: flushed {flushed} of {args.keys} keys")
    flush_us = usec / flushed
    say(f"{name}: write script {write_us:.2f} µs/heartbeat over {calls} calls; claim + ack {flush_us:.2f} µs/key")
    return {"write_us": write_us, "flush_us": flush_us}


def capacity_line(name: str, figures: dict[str, float]) -> str:
    # a listener sends FLUSH_INTERVAL_S / HEARTBEAT_EVERY_S heartbeats per flush of its key
    per_heartbeat_us = figures["write_us"] + figures["flush_us"] / (FLUSH_INTERVAL_S / HEARTBEAT_EVERY_S)
    per_core = 1e6 / per_heartbeat_us
    cells = [f"{name:<12}", f"{figures['write_us']:>9.2f}", f"{figures['flush_us']:>9.2f}", f"{per_heartbeat_us:>9.2f}",
             f"{per_core:>12,.0f}"]  # fmt: skip
    for listeners in (1_000_000, 10_000_000):
        rate = listeners / HEARTBEAT_EVERY_S
        cells.append(f"{math.ceil(rate / (per_core * MASTER_BUSY_LIMIT)):>10}")
    return " ".join(cells)


def http_run(name: str, env: dict[str, str], wrk: str, tokens: Path, args: argparse.Namespace, work_dir: Path,
             redis_pid: int | None) -> ingest.WrkResult:  # fmt: skip
    port = ingest.free_port()
    child = ingest.Child(
        name,
        [sys.executable, "-m", "service", "serve", "--workers", "1", "--host", "127.0.0.1", "--port", str(port)],
        {**os.environ, "JWT_SECRET": ingest.JWT_SECRET, "LOG_LEVEL": "WARNING", "PYTHONUNBUFFERED": "1",
         "PROGRESS_FLUSHER_ENABLED": "false", "RELAY_ENABLED": "false", "EMAIL_PUBLISHER": "redis-stream",
         "CONTENT_CATALOG_ENABLED": "false", "RATE_LIMIT_PER_USER_PER_SECOND": "0", **env},
        work_dir / f"{name}.log",
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        ingest.wait_http_ok(child, f"{url}/health/ready")
        target = ingest.Target(name, child, url, Redis(), redis_pid)
        ingest.load(target, wrk, tokens, args, args.warmup, "warm-up")
        ingest.wait_until_idle(args.wait_idle)
        result = ingest.load(target, wrk, tokens, args, args.duration, "measured")
        say(f"{name}: {result.rps:.0f} req/s, p99 {result.p99_ms:.2f} ms, all {result.requests} answers 201")
        return result
    finally:
        child.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=100_000, help="keys written for the commandstats (100000)")
    parser.add_argument("--rounds", type=int, default=3, help="heartbeats per key for the commandstats (3)")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of each measured HTTP run (10)")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds of each HTTP warm-up run (3)")
    parser.add_argument("--connections", type=int, default=64, help="wrk connections (64)")
    parser.add_argument("--threads", type=int, default=2, help="wrk threads (2)")
    parser.add_argument("--users", type=int, default=10_000, help="distinct users, one token each (10000)")
    parser.add_argument("--contents", type=int, default=2000, help="content ids 1..N per route (2000)")
    parser.add_argument("--wait-idle", type=float, default=60.0, metavar="SECONDS",
                        help="before a measured run, wait up to this long for other processes to go quiet")  # fmt: skip
    parser.add_argument("--repeat", type=int, default=2, help="runs of each measurement, the best kept (2)")
    parser.add_argument("--verbose", action="store_true", help="print wrk's own output of every run")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    wrk = ingest.ensure_wrk()
    work_dir = Path(tempfile.mkdtemp(prefix="progress-bench-cluster-"))
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, work_dir, True)
        standalone = EmbeddedRedis(work_dir / "standalone", None)
        cluster = EmbeddedCluster(work_dir / "cluster", masters=3)
        say("starting a standalone Valkey and a 3-master, 3-replica Valkey Cluster")
        standalone.start()
        stack.callback(standalone.stop)
        stack.callback(cluster.stop)
        cluster.start()
        sync_cluster = stack.enter_context(SyncRedisCluster.from_url(cluster.url))
        masters = [Redis(host=node.host, port=node.port) for node in sync_cluster.get_primaries()]
        standalone_sync = stack.enter_context(Redis.from_url(standalone.url))

        cluster_layout = build_key_layout(Settings(redis_cluster=True))
        figures: dict[str, dict[str, float]] = {}
        for _ in range(args.repeat):  # the lowest of each: the run least disturbed by other processes
            runs = {
                "standalone": measure_scripts("standalone", lambda: AsyncRedis.from_url(standalone.url),
                                              [standalone_sync], KeyLayout(), args),
                "cluster": measure_scripts("cluster", lambda: RedisCluster.from_url(cluster.url), masters,
                                           cluster_layout, args),
            }  # fmt: skip
            for name, values in runs.items():
                figures[name] = {k: min(v, figures.get(name, {}).get(k, v)) for k, v in values.items()}
        for node in [standalone_sync, *masters]:
            node.flushall()

        tokens = work_dir / "tokens.txt"
        ingest.make_tokens(args.users, tokens)
        assert standalone.process is not None
        configurations = {
            "standalone": {"REDIS_URL": standalone.url},
            "cluster": {"REDIS_URL": cluster.url, "REDIS_CLUSTER": "true"},
            "cluster+WAIT": {"REDIS_URL": cluster.url, "REDIS_CLUSTER": "true", "REDIS_WAIT_REPLICAS": "1"},
        }
        http: dict[str, ingest.WrkResult] = {}
        for round_ in range(args.repeat):  # interleaved, the best of each: other load hits them alike
            for name, env in configurations.items():
                result = http_run(f"{name}-{round_}", env, wrk, tokens, args, work_dir,
                                  standalone.process.pid if name == "standalone" else None)  # fmt: skip
                if name not in http or result.rps > http[name].rps:
                    http[name] = result

    print()
    print(f"Redis CPU from INFO commandstats ({args.keys} keys x {args.rounds} heartbeats; claim + ack in batches "
          f"of 500; lowest of {args.repeat} runs); a heartbeat every {HEARTBEAT_EVERY_S:.0f} s, a flush every "
          f"{FLUSH_INTERVAL_S:.0f} s; masters planned at {MASTER_BUSY_LIMIT:.0%} of a core")  # fmt: skip
    print(f"{'':<12} {'write µs':>9} {'flush µs':>9} {'per hb µs':>9} {'hb/s/core':>12} {'1M lstn':>10} "
          f"{'10M lstn':>10}")  # fmt: skip
    for name, values in figures.items():
        print(capacity_line(name, values))
    print()
    print(f"HTTP, one worker, wrk {args.threads} threads, {args.connections} connections, {args.duration:.0f}s "
          f"after {args.warmup:.0f}s warm-up, best of {args.repeat} interleaved runs; {os.cpu_count()} CPUs shared by "
          "wrk, the server and Valkey")  # fmt: skip
    base = http["standalone"]
    print(f"{'':<14}{'req/s':>10}{'p50 ms':>9}{'p99 ms':>9}{'share':>8}")
    for name, result in http.items():
        print(f"{name:<14}{result.rps:>10.0f}{result.p50_ms:>9.2f}{result.p99_ms:>9.2f}{result.rps / base.rps:>8.0%}")
    share = http["cluster"].rps / base.rps
    print(f"target: cluster request path >= {TARGET_SHARE:.0%} of standalone: {share:.0%} "
          f"{'PASS' if share >= TARGET_SHARE else 'MISS'}")  # fmt: skip
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
    except RuntimeError as exc:
        print(f"bench failed: {exc}", file=sys.stderr)
        sys.exit(1)
