"""Where a request's server CPU goes: `py-spy record` of `serve --workers 1` (the door on) under wrk, per kind of
request: the top functions and files by self time. The service is this checkout's (the harness runs `python -m
service` from it): a copy of this script in an export of an older commit profiles the code before a change.

    .venv/bin/python bench/profile_request.py [--modes heartbeat,one,many] [--connections 64] [--duration 8]
    smallest: --modes heartbeat --duration 2 --warmup 1 --users 20 --contents 5
"""

import asyncio
import subprocess
import sys
from collections import Counter
from pathlib import Path

import harness

ANSWERS = {"heartbeat": (201,), "lesson": (201,), "one": (200,), "many": (200,), "sync": (200,)}


def self_time(raw: str) -> tuple[Counter[str], Counter[str]]:
    """py-spy's raw (collapsed) stacks -> samples per leaf function and per leaf file."""
    functions: Counter[str] = Counter()
    files: Counter[str] = Counter()
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        leaf = stack.rsplit(";", 1)[-1]  # "function (path/to/file.py:line)"
        name, _, where = leaf.partition(" (")
        path = where.rsplit(":", 1)[0]
        name = name or "(no Python frame)"
        functions[f"{name} ({Path(path).name})"] += int(count)
        files["/".join(Path(path).parts[-3:])] += int(count)
    return functions, files


@harness.main(modes="heartbeat,one,many", duration=8.0, warmup=4.0, connections=64, users=2000, contents=100, top=10.0)
def main(args: harness.Namespace) -> None:
    spy = Path(sys.executable).with_name("py-spy")
    with harness.servers("profile", postgres=True) as s:
        asyncio.run(harness.seed(s.database_url, users=args.users, contents=args.contents, rows=True))
        tokens = harness.tokens(s.work, args.users)
        service = s.service("service", CONTENT_CATALOG_ENABLED=None)  # the door on, as a production pod runs
        for mode in args.modes.split(","):
            how = {"mode": mode, "expect": ANSWERS[mode], "ids": (1, args.contents), "connections": args.connections}
            harness.wrk(service.url, tokens, duration_s=args.warmup, **how)
            raw = s.work / f"{mode}.txt"
            record = [str(spy), "record", "--rate", "500", "--duration", str(max(1, int(args.duration) - 1))]
            record += ["--format", "raw", "--nonblocking", "--pid", str(service.pid), "--output", str(raw)]
            with subprocess.Popen(record, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL):
                result = harness.wrk(service.url, tokens, duration_s=args.duration, pids=(service.pid,), **how)
            functions, files = self_time(raw.read_text())
            total = functions.total()
            cpu = result.us_per_request(service.pid)
            print(f"\n{mode}: {result.rps:,.0f} req/s, {cpu:.1f} µs server CPU per request, {total:,} samples")
            for title, counts in (("function (file)", functions), ("file", files)):
                harness.table(
                    f"share | {title}", [[f"{n / total:.1%}", k] for k, n in counts.most_common(int(args.top))]
                )
