"""The door's own cost on the request path, in process: the same heartbeats through the app with the
door off and on (content catalog + per-user rate limit), against real Valkey and Postgres.

wrk against two server processes (bench_ingest.py --door) measures the whole stack but moves with
whatever else the machine runs; this measures only the ASGI app, in alternating rounds in one
process, and prints the median CPU time per request and requests per second of each.

    .venv/bin/python bench/bench_door.py [--requests 20000] [--rounds 6]
"""

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import asyncpg

from service import embedded
from service.api.ingest import ProgressIngest
from service.app import create_app
from service.auth import make_token
from service.config import Settings

CONTENTS = 2000
USERS = 2000
CONCURRENCY = 64


async def _fill(url: str) -> None:
    await embedded.prepare_database(url, seed=False)
    conn = await asyncpg.connect(url)
    try:
        for table in ("courses_lesson", "audios_audio", "audios_meditation", "lives_live"):
            await conn.execute(f"INSERT INTO {table} (id, title, duration) "
                               "SELECT i, 'c' || i, 600 FROM generate_series(1, $1) i", CONTENTS)  # fmt: skip
    finally:
        await conn.close()


async def _post(app: ProgressIngest, token: bytes, body: bytes) -> int:
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    statuses: list[int] = []

    async def receive() -> dict[str, object]:
        return messages.pop()

    async def send(message: dict[str, object]) -> None:
        if message["type"] == "http.response.start":
            statuses.append(int(message["status"]))  # type: ignore[call-overload]

    scope = {"type": "http", "method": "POST", "path": "/engagements/progress/lesson",
             "headers": [(b"authorization", b"Bearer " + token), (b"content-type", b"application/json")]}  # fmt: skip
    await app(scope, receive, send)  # type: ignore[arg-type]
    return statuses[0]


async def _measure(settings: Settings, tokens: list[bytes], bodies: list[bytes], requests: int) -> tuple[float, float]:
    app = create_app(settings)
    async with app.app.router.lifespan_context(app.app):  # type: ignore[attr-defined]
        # every token verified once, as in a long-running pod
        await asyncio.gather(*(_post(app, token, bodies[0]) for token in tokens))
        cpu, wall = time.process_time(), time.perf_counter()
        for start in range(0, requests, CONCURRENCY):
            statuses = await asyncio.gather(*(
                _post(app, tokens[i % len(tokens)], bodies[i % len(bodies)]) for i in range(start, start + CONCURRENCY)
            ))  # fmt: skip
            if set(statuses) != {201}:
                raise RuntimeError(f"not all 201: {sorted(set(statuses))}")
        return (time.process_time() - cpu) / requests * 1e6, requests / (time.perf_counter() - wall)


async def main(args: argparse.Namespace) -> None:
    base = Path(tempfile.mkdtemp(prefix="progress-bench-door-"))
    redis = embedded.EmbeddedRedis(base / "valkey", None)
    postgres = embedded.EmbeddedPostgres(base / "postgres", None, durable=False)
    redis.start()
    postgres.start()
    try:
        postgres.create_database("bench")
        url = postgres.url("bench")
        await _fill(url)
        common = Settings(redis_url=redis.url, database_url=url, jwt_secret="bench-secret-" + "x" * 32,
                          progress_flusher_enabled=False, trial_journey_interval_seconds=0,
                          relay_enabled=False, email_publisher="redis-stream")  # fmt: skip
        door_off = {"content_catalog_enabled": False, "rate_limit_per_user_per_second": 0}
        # door on: the catalog and the rate limit at their defaults
        variants = {"door off": common.model_copy(update=door_off), "door on": common}
        tokens = [make_token(common, user_id).encode() for user_id in range(1, USERS + 1)]
        rng = random.Random(1)
        bodies = [json.dumps({"lesson_id": rng.randint(1, CONTENTS), "position": 3.0}).encode() for _ in range(4000)]
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
        for round_no in range(args.rounds):
            order = list(variants) if round_no % 2 == 0 else list(reversed(variants))
            for name in order:
                runs[name].append(await _measure(variants[name], tokens, bodies, args.requests))
        print(f"{args.requests} heartbeats per run ({CONCURRENCY} at a time, known ids), "
              f"{args.rounds} alternating rounds")
        medians: dict[str, tuple[float, float]] = {}
        for name, results in runs.items():
            cpu = sorted(c for c, _ in results)
            rps = sorted(r for _, r in results)
            medians[name] = cpu[len(cpu) // 2], rps[len(rps) // 2]
            print(f"{name:<10} median CPU {medians[name][0]:6.1f} us/request, median {medians[name][1]:7.0f} req/s "
                  f"(runs: {', '.join(f'{r:.0f}' for r in rps)})")  # fmt: skip
        # The process is CPU-bound: its throughput is 1 / CPU per request. Wall-clock req/s also
        # moves with whatever else the machine runs; both are printed, the first is the steadier.
        by_cpu = medians["door off"][0] / medians["door on"][0]
        by_wall = medians["door on"][1] / medians["door off"][1]
        print(f"target: throughput with the door >= 95% of without: {by_cpu:.1%} by CPU per request "
              f"{'PASS' if by_cpu >= 0.95 else 'MISS'}; {by_wall:.1%} by wall-clock req/s "
              f"{'PASS' if by_wall >= 0.95 else 'MISS'}")  # fmt: skip
    finally:
        postgres.stop()
        redis.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20_000, help="heartbeats per measured run (20000)")
    parser.add_argument("--rounds", type=int, default=6, help="alternating rounds (6)")
    asyncio.run(main(parser.parse_args()))
    sys.exit(0)
