"""Rolling restarts behind a real HAProxy, under a ledgered load: what a deploy without a preStop hook costs.

Three `serve` pods behind HAProxy 2.6 running deploy/haproxy/haproxy.cfg as shipped (checks on /health/ready every
2 s, out after 2 failures, `retries 0`, no redispatch), the pods at their default drain (SHUTDOWN_DRAIN_SECONDS 5)
and keep-alive (75 s). The fault suite's load generator sends every (user, lesson) a heartbeat per round through it
and keeps the ledger; each roll SIGTERMs every pod in turn, waits for its exit, starts it and waits until HAProxy has
it back in rotation. After the last roll every pod stops (its final flush) and every acknowledged final position is
looked for in Postgres. The CI test (tests/faults/test_fleet.py) is the same scenario, small.

    .venv/bin/python bench/bench_fleet.py [--users 2000] [--rolls 3] [--drain-seconds 5]
    smallest: --users 300 --rolls 1
    the pods as they were before the drain: --drain-seconds 0 (they stop listening at SIGTERM)
"""

import json
import statistics
import subprocess
import sys
from argparse import Namespace

import harness

FLEET_RUN_TIMEOUT_S = 1800


@harness.main(users=2000, rolls=3, drain_seconds=5.0)
def main(args: Namespace) -> None:
    harness.say(
        f"{args.users} users x 4 lessons, {args.rolls} roll(s) of 3 pods behind HAProxy, drain {args.drain_seconds:g} s"
    )
    command = [sys.executable, "-m", "tests.faults.suite", "--scenario", "rolling", "--json"]
    flags = ["--users", str(args.users), "--rolls", str(args.rolls), "--drain-seconds", str(args.drain_seconds)]
    # the suite exits 1 when a request was dropped: its report is the figures either way
    done = subprocess.run(
        [*command, *flags], capture_output=True, text=True, timeout=FLEET_RUN_TIMEOUT_S, **harness.IN_REPO
    )
    if not done.stdout.strip():
        raise RuntimeError(f"the fleet run printed no report ({done.returncode}):\n{done.stderr[-3000:]}")
    report = json.loads(done.stdout.strip().splitlines()[-1])
    non_2xx = report["refused_503"] + report["other"]
    harness.table(
        "requests | 201 | non-2xx | client errors | req/s | p50 ms | p99 ms | max ms",
        [
            [
                report["sent"],
                report["acknowledged"],
                non_2xx,
                report["no_answer"],
                report["sent"] / report["load_s"],
                report["latency_ms"]["p50"],
                report["latency_ms"]["p99"],
                report["latency_ms"]["max"],
            ]
        ],
    )
    harness.table(
        "pods rolled | SIGTERM to exit, median (max) s | start to back in rotation, median (max) s | exit codes",
        [
            [
                len(report["stop_s"]),
                f"{statistics.median(report['stop_s']):.2f} ({max(report['stop_s']):.2f})",
                f"{statistics.median(report['back_s']):.2f} ({max(report['back_s']):.2f})",
                ", ".join(str(code) for code in sorted(set(report["exit_codes"]))),
            ]
        ],
    )
    harness.table(
        "keys | final positions in Postgres | missing | completion events | duplicates",
        [[report["keys"], report["persisted"], report["lost"], report["events"], report["duplicate_events"]]],
    )
    harness.target("non-2xx answers", f"{non_2xx:,}", non_2xx == 0)
    harness.target("client errors (no answer)", f"{report['no_answer']:,}", report["no_answer"] == 0)
    harness.target("final positions missing", f"{report['lost']:,}", report["lost"] == 0)
    exits = report["exit_codes"]
    harness.target("pods exiting 0", f"{exits.count(0)} of {len(exits)}", set(exits) == {0})
