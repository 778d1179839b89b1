"""Reads and offline sync: server CPU per request against the heartbeat POST of the same run on the same process,
and the bare ASGI floor (bench/baseline_app.py answering the same heartbeats) in the same rounds.

`serve` on users x contents with a progress row for every pair (every read finds one), part of them buffered newer
than their row (a heartbeat fill); then alternating rounds of wrk runs at 16 connections: heartbeat POST, GET one,
GET 100 ids, sync of 500 items; the measured heartbeats and syncs go to contents of their own (known to the door),
so every round reads the same share buffered. Per kind, the medians over the rounds of server CPU per request, its
ratio to the round's heartbeat, req/s, p50 and p99.

    .venv/bin/python bench/bench_reads_cpu.py [--rounds 5] [--duration 8] [--connections 16]
    smallest: --rounds 1 --duration 1 --warmup 1 --wait-idle 0 --users 200 --contents 20
"""

import asyncio
import os
from functools import partial

import harness

# (label, requests.lua mode, answers, target x heartbeat); the floor's heartbeats go to the bare app
KINDS = (("bare ASGI floor", "heartbeat", (201,), 1.0), ("heartbeat POST", "heartbeat", (201,), 1.0),
         ("GET one", "one", (200,), 1.0), ("GET 100 ids", "many", (200,), 4.0),
         ("sync 500 items", "sync", (200,), 50.0))  # fmt: skip


@harness.main(rounds=5, duration=8.0, warmup=4.0, connections=16, users=2000, contents=100, wait_idle=5.0)
def main(args: harness.Namespace) -> None:
    with harness.servers("reads", postgres=True) as s:
        harness.say(f"seeding {args.users} users x {2 * args.contents} contents of each type, a row for every pair")
        asyncio.run(harness.seed(s.database_url, users=args.users, contents=2 * args.contents, rows=True))
        tokens = harness.tokens(s.work, args.users)
        service = s.service("service", CONTENT_CATALOG_ENABLED=None)  # the catalog on
        children = {**{label: service for label, *_ in KINDS}, KINDS[0][0]: s.floor()}  # the floor's, its own

        def load(
            label: str, mode: str, expect: tuple[int, ...], seconds: float, idle: float = 0.0, fill: bool = False
        ) -> harness.WrkResult:
            harness.wait_until_idle(idle)
            ids = (1, args.contents) if fill or mode in ("one", "many") else (args.contents + 1, 2 * args.contents)
            child, how = children[label], {"mode": mode, "expect": expect, "ids": ids, "connections": args.connections}
            return harness.wrk(child.url, tokens, duration_s=seconds, pids=(child.pid,), timeout_s=30, **how)

        load("heartbeat POST", "heartbeat", (201,), args.warmup * 2, fill=True)  # read values newer than their rows
        for label, mode, expect, _ in KINDS:
            load(label, mode, expect, args.warmup)
        variants = {
            label: partial(load, label, mode, expect, args.duration, args.wait_idle) for label, mode, expect, _ in KINDS
        }
        runs = harness.rounds(variants, args.rounds)

    us = {label: [r.us_per_request(children[label].pid) for r in results] for label, results in runs.items()}
    base = us["heartbeat POST"]
    ratio = {label: harness.median([a / b for a, b in zip(v, base, strict=True)]) for label, v in us.items()}
    print(
        f"\nserve --workers 1; wrk 2 threads, {args.connections} connections, {args.duration:.0f}s per run, "
        f"{args.rounds} alternating rounds; {args.users} users x {args.contents} contents of each type, a row for "
        f"every pair, part buffered; {os.cpu_count()} CPUs shared by wrk, the server, Valkey and Postgres"
    )
    rows = []
    for label, _, _, goal in KINDS:
        target = f"≤ {goal:g}x" if label not in ("heartbeat POST", KINDS[0][0]) else ""
        timing = harness.medians(runs[label], "rps", "p50_ms", "p99_ms")
        per_round = " ".join(f"{v:.0f}" for v in us[label])
        rows.append([label, harness.median(us[label]), ratio[label], target, *timing, per_round])
    titles = "server CPU µs/request | x heartbeat | target | req/s | p50 ms | p99 ms | per round (µs)"
    harness.table(f"request | {titles}", rows)
    medians = {label: harness.median(v) for label, v in us.items()}
    per_id = (medians["GET 100 ids"] - medians["GET one"]) / 99
    per_item = (medians["sync 500 items"] - medians["heartbeat POST"]) / 500
    print(
        f"beyond the request itself: {per_id:.1f} µs per id of GET 100 ids (target < 4), {per_item:.1f} µs per "
        "synced item beyond a heartbeat (target about 8)"
    )
    for label, _, _, goal in KINDS[2:]:
        x = ratio[label]
        harness.target(f"{label} server CPU ≤ {goal:g}x the heartbeat POST's", f"{x:.2f}x", x <= goal)
    harness.target("GET 100 ids: under 4 µs per id beyond the request itself", f"{per_id:.1f} µs", per_id < 4)
