"""The door's own cost, in process: the same heartbeats through the ASGI app, door off and on, alternating rounds.

    .venv/bin/python bench/bench_door.py [--requests 20000] [--rounds 6]
    smallest: --requests 2000 --rounds 2
"""

import asyncio
import json
import random
import time
from functools import partial

import harness

from service.auth import make_token
from service.config import Settings

CONTENTS = USERS = 2000
CONCURRENCY = 64


async def measure(settings: Settings, tokens: list[bytes], bodies: list[bytes], requests: int) -> tuple[float, float]:
    """(CPU µs per request, req/s) of `requests` heartbeats, 64 at a time, every token verified once before."""
    async with harness.app_in_process(settings) as app:
        path = "/engagements/progress/lesson"
        await asyncio.gather(*(harness.asgi(app, "POST", path, token, bodies[0]) for token in tokens))
        cpu, wall = time.process_time(), time.perf_counter()
        for start in range(0, requests, CONCURRENCY):
            statuses = await asyncio.gather(*(harness.asgi(app, "POST", path, tokens[i % len(tokens)],
                                                           bodies[i % len(bodies)])
                                              for i in range(start, start + CONCURRENCY)))  # fmt: skip
            if set(statuses) != {201}:
                raise RuntimeError(f"not all 201: {sorted(set(statuses))}")
        return (time.process_time() - cpu) / requests * 1e6, requests / (time.perf_counter() - wall)


def main() -> None:
    args = harness.arguments(__doc__, requests=20_000, rounds=6).parse_args()
    with harness.servers("door", postgres=True) as s:
        asyncio.run(harness.seed(s.database_url, users=0, contents=CONTENTS))
        default_rate = Settings.model_fields["rate_limit_per_user_per_second"].default
        door_on = harness.settings(s, content_catalog_enabled=True, rate_limit_per_user_per_second=default_rate)
        variants = {"door off": harness.settings(s), "door on": door_on}
        tokens = [f"Bearer {make_token(door_on, user_id)}".encode() for user_id in range(1, USERS + 1)]
        rng = random.Random(1)
        bodies = [json.dumps({"lesson_id": rng.randint(1, CONTENTS), "position": 3.0}).encode() for _ in range(4000)]

        def run(config: Settings) -> tuple[float, float]:
            return asyncio.run(measure(config, tokens, bodies, args.requests))

        runs = harness.rounds({name: partial(run, config) for name, config in variants.items()}, args.rounds)
    print(f"\n{args.requests} heartbeats per run ({CONCURRENCY} at a time, known ids), {args.rounds} rounds")
    harness.table(["", "median CPU µs/request", "median req/s", "runs req/s"], [
        [name, harness.median([c for c, _ in rs]), harness.median([r for _, r in rs]),
         ", ".join(f"{r:,.0f}" for _, r in rs)] for name, rs in runs.items()])  # fmt: skip
    # CPU-bound: throughput is 1 / CPU per request; wall-clock req/s also moves with the machine's other load
    off, on = ([harness.median([v[i] for v in runs[name]]) for i in (0, 1)] for name in variants)
    harness.target("throughput with the door >= 95% of without, by CPU per request", f"{off[0] / on[0]:.1%}",
                   off[0] / on[0] >= 0.95)  # fmt: skip
    harness.target("the same by wall-clock req/s", f"{on[1] / off[1]:.1%}", on[1] / off[1] >= 0.95)


if __name__ == "__main__":
    harness.main(main)
