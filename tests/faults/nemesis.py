"""A Jepsen-style nemesis: two `serve` pods under the load of many users (tests/faults/load.py) while three
lanes of faults run at random and overlap; then every request of the ledger is checked against Postgres, against the
rows seen during the run, and against its bound.

    python -m tests.faults.nemesis [--seed N] [--faults row_lock,pg_stall]  # CI size (tests/faults/test_nemesis.py)
    python -m tests.faults.nemesis --long [--seed N]                         # the larger run (the README's figures)

The seed (printed first; NEMESIS_SEED for the pytest test) decides the faults' order, lengths, gaps and targets and
the users' choices; the pods' timing is the machine's. `--faults` keeps only the named kinds ("" for none).

The faults (DESIGN §12, issue 23), each undone when it ends, the pods' settings making every brake engage:
- database lane: row_lock (SELECT ... FOR UPDATE held on up to three pending keys' rows), table_lock_progress and
  table_lock_content (LOCK TABLE ... IN ACCESS EXCLUSIVE MODE), pg_stall (every progress write sleeps, in a trigger);
- redis lane: maxmemory (noeviction, maxmemory kept just under used_memory), budget_push (the write budget's key
  set to the server's time + 1 h, as a clock stepped back leaves it: not undone, the service must live with it),
  broker_busy (the broker runs a Lua loop and answers BUSY, as tests/outbox/test_refusals.py does);
- pods lane: sigterm and sigkill of one pod, restarted at once.

The checks, all on the whole ledger: every acknowledged final position is in Postgres (the last 201, the newest
applied sync item); no row ever moved back; every completion has one event, and
every event is published; each request answered within its bound, with a status its route documents; no client
error from a pod that was not being killed; a read shows the latest position acknowledged before it; each promised
position reached Postgres within its bound (below); a pod given SIGTERM exits in time, with no wait cancelled.
"""

import argparse
import asyncio
import bisect
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import asyncpg
from redis.asyncio import Redis

from service.config import Settings
from service.progress.completion import completes
from service.progress.content import CONTENT_KINDS
from service.progress.flush.backlog import measure_backlog
from service.progress.keys import FLUSH_BUDGET_KEY, STANDALONE, parse_member
from tests.faults.load import DURATION_S, KIND, Key, Load
from tests.faults.suite import Cluster, backlog_left, start_load, wait_drained
from tests.helpers import RowsWatch, push_budget_key
from tests.monolith.fixtures import Broker, BusyBroker

# --- the pods' settings: every brake engaged, every wait short enough to be seen ---------------------------

INTERVAL_S = 1.0
BATCH = 25  # rows: small, so a backlog is many batches and a type's turn is short
LEASE_S = 3.0
STATEMENT_TIMEOUT_S = 2.0
LOCK_TIMEOUT_S = 1.0
DEGRADED_TIMEOUT_S = 2.0
SHUTDOWN_S = 4.0
DRAIN_S = 1.0  # SHUTDOWN_DRAIN_SECONDS: no load balancer here, the load is told Connection: close
PUBLISH_TIMEOUT_S = 2.0
COMPLETION_MARGIN_S = Settings.model_fields["progress_completion_margin_seconds"].default  # the pods' (default)


def service_env(budget: int) -> dict[str, str]:
    return {
        "PROGRESS_FLUSH_INTERVAL_SECONDS": str(INTERVAL_S),
        "PROGRESS_FLUSH_BATCH_SIZE": str(BATCH),
        "PROGRESS_FLUSH_CONCURRENCY": "2",
        "PROGRESS_FLUSH_LEASE_SECONDS": str(LEASE_S),
        # about twice the steady load's rows/s: a crowd's or a stall's backlog drains at the budget's pace
        "PROGRESS_FLUSH_MAX_ROWS_PER_SECOND": str(budget),
        "PROGRESS_SHUTDOWN_TIMEOUT_SECONDS": str(SHUTDOWN_S),
        "SHUTDOWN_DRAIN_SECONDS": str(DRAIN_S),
        "DATABASE_STATEMENT_TIMEOUT_SECONDS": str(STATEMENT_TIMEOUT_S),
        "DATABASE_LOCK_TIMEOUT_SECONDS": str(LOCK_TIMEOUT_S),
        "DEGRADED_WRITE_TIMEOUT_SECONDS": str(DEGRADED_TIMEOUT_S),
        "DEGRADED_REDIS_RETRY_SECONDS": "0.5",
        # a pod restarted while a content table is locked has no snapshot: it has one again within seconds
        "TRIAL_JOURNEY_INTERVAL_SECONDS": "0",
        "CELERY_PUBLISH_TIMEOUT_SECONDS": str(PUBLISH_TIMEOUT_S),
        "RELAY_LEASE_SECONDS": "5",
        "RELAY_POLL_INTERVAL_SECONDS": "1",
        "RELAY_MAX_BACKOFF_SECONDS": "1",
    }


# --- the bounds, each with its reason ------------------------------------------------------------------------

# Two shared cores run both pods, both Valkeys, Postgres, the load and this checker: a process may wait this long
# for a core (a loaded run's worst event-loop lag in the load process stays well under it).
MARGIN_S = 1.5
# one Redis round trip; at maxmemory the write goes to Postgres under its own deadline (DEGRADED_WRITE_TIMEOUT)
HEARTBEAT_S = DEGRADED_TIMEOUT_S + MARGIN_S
# DESIGN §12: a read waits at most 1 s (for its batch or a connection); its statement, behind a lock, lock_timeout
READ_S = 1.0 + LOCK_TIMEOUT_S + MARGIN_S
# a sync: a slot among the process's syncs and a connection, each waited for about as long as a read (1 s), then
# its statements (the first one behind a lock fails in lock_timeout), then one Redis round trip
SYNC_S = 2 * 1.0 + LOCK_TIMEOUT_S + MARGIN_S
BOUND_S = {"heartbeat": HEARTBEAT_S, "read": READ_S, "sync": SYNC_S}
# DESIGN §6: persisted within ~2 flush intervals; one sample period more before the checker can see it, and one
# interval more for a cycle that waits for a core on 2 shared cores (CI: runs missed by 0.1-0.6 s without it)
PERSIST_BASE_S = 3 * INTERVAL_S + MARGIN_S
# what the budget's wait may cost once, whatever its key holds: "a few batches' worth" (issue 23)
BUDGET_CAP_ROWS = 4 * BATCH
# a pod given SIGTERM: its drain, requests in hand (each within HEARTBEAT_S), the batch in hand (its statement,
# and a capped budget wait: under 1 s at either size), the final flush (PROGRESS_SHUTDOWN_TIMEOUT), the relay's
# last pass (publish timeout + 2 s)
EXIT_S = DRAIN_S + HEARTBEAT_S + STATEMENT_TIMEOUT_S + 1.0 + SHUTDOWN_S + PUBLISH_TIMEOUT_S + 2 + MARGIN_S
SLACK_S = 0.002  # Postgres keeps µs, the ledger's floats and the ISO times round below a ms


# --- sizes ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Size:
    name: str
    load: Load
    budget: int  # rows/s for the fleet
    sample_s: float  # how often the checker reads every progress row and the backlog
    gap_s: tuple[float, float]  # between two faults of a lane
    once: bool  # each fault kind once per lane (CI); else drawn again until the load ends
    warmup_s: float = 3.0
    quiet_s: float = 5.0  # the load's last seconds start no fault: the end is checked with faults off


CI = Size(
    "ci",
    Load(seconds=45, contents=10, steady_users=40, burst_users=6, sync_users=18, crowd_users=1000, crowd_at_s=(12,)),
    budget=150,
    sample_s=0.25,
    gap_s=(1.0, 2.0),
    once=True,
)
LONG = Size(
    "long",
    Load(
        seconds=300,
        contents=20,
        steady_users=300,
        burst_users=20,
        sync_users=18,
        crowd_users=4000,
        crowd_at_s=(40, 160),
    ),
    budget=600,
    sample_s=0.5,
    gap_s=(2.0, 6.0),
    once=False,
)

LANES = {
    "database": ("row_lock", "table_lock_progress", "table_lock_content", "pg_stall"),
    "redis": ("maxmemory", "budget_push", "broker_busy"),
    "pods": ("sigterm", "sigkill"),
}
FAULT_KINDS = tuple(kind for kinds in LANES.values() for kind in kinds)
# seconds a fault lasts (drawn in the range): the locks outlast the persistence bound (~4-5 s at the CI size) so a
# type that one row holds shows; the pods' faults last until the pod is ready again
FAULT_SECONDS = {
    "row_lock": (9.0, 11.0),
    "table_lock_progress": (3.5, 4.5),
    "table_lock_content": (3.5, 4.5),
    "pg_stall": (3.0, 3.5),
    "maxmemory": (7.0, 9.0),
    "budget_push": (0.0, 0.0),
    "broker_busy": (2.0, 3.0),
    "sigterm": (0.0, 0.0),
    "sigkill": (0.0, 0.0),
}
POD_FAULT_S = 8.0  # what a pod's fault may take (exit, start, ready): a lane does not start one closer to its end

# Every write to a progress table sleeps nemesis_stall.seconds (0: not at all), in a statement trigger: a stall that
# comes and goes with one UPDATE, without DDL (and its locks) at fault time. SIGSTOP of the backends was the other
# way: it reaches only the backends that exist at that moment (a pool that opens a connection meanwhile gets a
# running one), and a backend stopped inside a shared lock stalls unrelated sessions, this checker's included.
STALL_SQL = [
    "CREATE TABLE nemesis_stall (seconds float8 NOT NULL)",
    "INSERT INTO nemesis_stall VALUES (0)",
    """CREATE FUNCTION nemesis_stall() RETURNS trigger LANGUAGE plpgsql AS $$
    DECLARE s float8;
    BEGIN
        SELECT seconds INTO s FROM nemesis_stall;
        IF s > 0 THEN PERFORM pg_sleep(s); END IF;
        RETURN NULL;
    END $$""",
    *(
        f"CREATE TRIGGER nemesis_stall BEFORE INSERT ON {kind.progress_table} "
        "FOR EACH STATEMENT EXECUTE FUNCTION nemesis_stall()"
        for kind in CONTENT_KINDS
    ),
]


# --- faults --------------------------------------------------------------------------------------------------------


@dataclass
class Fault:
    kind: str
    target: str
    start: float  # wall clock
    end: float
    detail: str = ""
    pod: int | None = None
    content_type: str = ""  # the type a lock holds
    rows: list[Key] = field(default_factory=list)  # the keys a row lock holds
    stall_s: float = 0.0
    exit_s: float = 0.0

    def holds(self, key: Key, budget: int) -> tuple[float, float] | None:
        """When this fault may hold `key`'s flush: its own time, and what the flush needs after it to catch up."""
        if self.kind == "row_lock" and key in self.rows:
            # the batch that met the lock waited lock_timeout; the loop's backoff (<= interval); the next cycle
            return self.start, self.end + LOCK_TIMEOUT_S + 2 * INTERVAL_S
        if self.kind.startswith("table_lock") and key[0] == self.content_type:
            return self.start, self.end + LOCK_TIMEOUT_S + 2 * INTERVAL_S
        if self.kind == "pg_stall":  # statements in hand sleep on, at most until their statement_timeout
            return self.start, self.end + min(self.stall_s, STATEMENT_TIMEOUT_S) + 2 * INTERVAL_S
        if self.kind == "sigkill":  # the dead pod's claims come back when their lease ends; its reservations lapse
            return self.start, self.start + LEASE_S + 2 * INTERVAL_S + 2 * BATCH / budget
        if self.kind == "sigterm":  # its final flush writes, or releases, what it holds
            return self.start, self.start + self.exit_s + INTERVAL_S
        return None

    def extra_s(self, key: Key, budget: int) -> float:
        """What this fault may add, once, to the wait of `key` when it comes during it."""
        if self.kind == "row_lock" and key[0] == self.content_type and key not in self.rows:
            return 2 * LOCK_TIMEOUT_S  # a batch that meets the lock gives up on it in lock_timeout, maybe twice
        if self.kind == "budget_push":
            return BUDGET_CAP_ROWS / budget + INTERVAL_S
        return 0.0


class Nemesis:
    """Applies faults to the cluster and records each, with its times; every fault is undone when it ends."""

    def __init__(self, cluster: Cluster, watch: "Watch", log: Callable[[str], None]) -> None:
        self.cluster = cluster
        self.watch = watch
        self.log = log
        self.faults: list[Fault] = []
        self.started = time.time()

    async def lane(self, kinds: Iterable[str], rng: random.Random, size: Size, until: float) -> None:
        kinds = list(kinds)
        order = rng.sample(kinds, len(kinds))
        while kinds:
            if not order:
                if size.once:
                    return
                order = rng.sample(kinds, len(kinds))
            await asyncio.sleep(rng.uniform(*size.gap_s))
            kind = order.pop()
            seconds = rng.uniform(*FAULT_SECONDS[kind])
            if time.time() + max(seconds, POD_FAULT_S if kind.startswith("sig") else 0.0) > until:
                return
            fault = await getattr(self, kind)(rng, seconds)
            self.faults.append(fault)
            self.log(
                f"  {fault.start - self.started:6.1f}-{fault.end - self.started:6.1f} s {kind} {fault.target} "
                f"{fault.detail}"
            )

    async def _hold(self, statement: str, *args: object, seconds: float) -> tuple[float, float]:
        """`statement` in a transaction of its own, what it took held for `seconds`, then a rollback: the times it
        was sent and it returned."""
        conn = await asyncpg.connect(self.cluster.database_url)
        try:
            transaction = conn.transaction()
            await transaction.start()
            sent = time.time()
            await conn.execute(statement, *args)
            returned = time.time()
            await asyncio.sleep(seconds)
            await transaction.rollback()
        finally:
            await conn.close()
        return sent, returned

    # the database lane

    async def row_lock(self, rng: random.Random, seconds: float) -> Fault:
        kind = KIND[rng.choice(list(KIND))]
        # rows of keys pending now: the next batch of that type meets the lock, and meets it again every cycle
        seen = self.watch.rows[kind.name].seen
        redis = Redis.from_url(self.cluster.redis.url, decode_responses=True)
        try:
            for _ in range(50):  # a type's pending set is empty between two flushes only briefly
                pending = await redis.srandmember(STANDALONE.shards_of(kind.name)[0].pending_key, 50)
                if candidates := sorted(row for row in map(parse_member, pending) if row in seen):
                    break
                await asyncio.sleep(0.1)
        finally:
            await redis.aclose()
        rows = rng.sample(candidates, min(3, len(candidates)))
        _, start = await self._hold(
            f"SELECT 1 FROM {kind.progress_table} WHERE ({kind.id_column}, user_id) IN "
            "(SELECT * FROM unnest($1::bigint[], $2::bigint[])) FOR UPDATE",
            [r[0] for r in rows],
            [r[1] for r in rows],
            seconds=seconds,
        )
        keys = [(kind.name, content_id, user_id) for content_id, user_id in rows]
        return Fault(
            "row_lock", kind.progress_table, start, time.time(), f"rows {rows}", content_type=kind.name, rows=keys
        )

    async def table_lock_progress(self, rng: random.Random, seconds: float) -> Fault:
        kind = KIND[rng.choice(list(KIND))]
        return await self._table_lock("table_lock_progress", kind.progress_table, kind.name, seconds)

    async def table_lock_content(self, rng: random.Random, seconds: float) -> Fault:
        kind = KIND[rng.choice(list(KIND))]
        return await self._table_lock("table_lock_content", kind.content_table, kind.name, seconds)

    async def _table_lock(self, fault: str, table: str, content_type: str, seconds: float) -> Fault:
        # a lock that waits in the queue already holds everything that comes behind it
        start, acquired = await self._hold(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE", seconds=seconds)
        detail = f"acquired after {acquired - start:.2f} s"
        return Fault(fault, table, start, time.time(), detail, content_type=content_type)

    async def pg_stall(self, rng: random.Random, seconds: float) -> Fault:
        # a slow disk: writes that take longer than statement_timeout, or a little less (they then go, slowly)
        stall_s = rng.uniform(0.5, 1.5) * STATEMENT_TIMEOUT_S
        conn = await asyncpg.connect(self.cluster.database_url)
        try:
            await conn.execute("UPDATE nemesis_stall SET seconds = $1", stall_s)
            start = time.time()
            try:
                await asyncio.sleep(seconds)
            finally:
                await conn.execute("UPDATE nemesis_stall SET seconds = 0")
        finally:
            await conn.close()
        return Fault("pg_stall", "progress writes", start, time.time(), f"each sleeps {stall_s:.1f} s", stall_s=stall_s)

    # the redis lane

    async def maxmemory(self, rng: random.Random, seconds: float) -> Fault:
        redis = Redis.from_url(self.cluster.redis.url)
        try:
            await redis.config_set("maxmemory-policy", "noeviction")
            start, limit = time.time(), 0
            try:
                while time.time() < start + seconds:
                    used = int((await redis.info("memory"))["used_memory"])
                    if not limit or used < limit + 16_384:  # acks free memory: stay just under what is used
                        limit = used - 65_536
                        await redis.config_set("maxmemory", limit)
                    await asyncio.sleep(0.1)
            finally:
                await redis.config_set("maxmemory", 0)
        finally:
            await redis.aclose()
        return Fault("maxmemory", "valkey", start, time.time(), f"maxmemory {limit} (noeviction)")

    async def budget_push(self, rng: random.Random, seconds: float) -> Fault:
        redis = Redis.from_url(self.cluster.redis.url)
        try:
            await push_budget_key(redis, 3600)
        finally:
            await redis.aclose()
        at = time.time()
        return Fault("budget_push", FLUSH_BUDGET_KEY, at, at, "server time + 1 h")

    async def broker_busy(self, rng: random.Random, seconds: float) -> Fault:
        broker = self.cluster.broker
        assert broker is not None
        times: list[float] = []

        def busy() -> None:
            with BusyBroker(Broker(broker)):
                times.append(time.time())
                time.sleep(seconds)  # the fault's length, not a wait for anything

        await asyncio.to_thread(busy)
        return Fault("broker_busy", "broker", times[0], time.time(), "BUSY (a Lua loop)")

    # the pods lane

    async def sigterm(self, rng: random.Random, seconds: float) -> Fault:
        pod = rng.randrange(len(self.cluster.ports))
        start = time.time()
        exit_s = (await asyncio.to_thread(self.cluster.terminate_services, [pod], 60)).get(pod, 0.0)
        await self._restart(pod)
        return Fault("sigterm", f"pod {pod}", start, time.time(), f"exited in {exit_s:.1f} s", pod=pod, exit_s=exit_s)

    async def sigkill(self, rng: random.Random, seconds: float) -> Fault:
        pod = rng.randrange(len(self.cluster.ports))
        start = time.time()
        await asyncio.to_thread(self.cluster.kill_service, pod)
        await self._restart(pod)
        return Fault("sigkill", f"pod {pod}", start, time.time(), pod=pod)

    async def _restart(self, pod: int) -> None:
        self.cluster.start_service(pod)
        await asyncio.to_thread(self.cluster.wait_ready, pod, 60)


# --- what the checker sees during the run --------------------------------------------------------------------------


class Watch:
    """Every progress row (a RowsWatch per type) and the buffer's backlog per type, sampled every `sample_s`; each
    type on a connection of its own, so that a lock on one table holds only that table's samples."""

    def __init__(self, database_url: str, redis_url: str, sample_s: float) -> None:
        self.database_url = database_url
        self.redis_url = redis_url
        self.sample_s = sample_s
        self.rows: dict[str, RowsWatch] = {}
        self.backlog: list[tuple[float, dict[str, int]]] = []
        self._redis = Redis.from_url(redis_url)
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        for kind in CONTENT_KINDS:
            self.rows[kind.name] = RowsWatch(await asyncpg.connect(self.database_url), kind)
            self._tasks.append(asyncio.create_task(self._every(self.rows[kind.name].sample)))
        self._tasks.append(asyncio.create_task(self._every(self._sample_backlog)))

    async def _sample_backlog(self) -> None:
        at = time.time()
        backlog = await measure_backlog(self._redis, STANDALONE)
        self.backlog.append((at, {name: b.pending + b.in_flight for name, b in backlog.by_type.items()}))

    async def _every(self, sample: Callable[[], Awaitable[object]]) -> None:
        while not self._stop.is_set():
            await sample()
            try:
                await asyncio.wait_for(self._stop.wait(), self.sample_s)
            except TimeoutError:
                pass

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)
        for watch in self.rows.values():
            await watch.sample()  # the last look, with every fault off
            await watch.db.close()
        await self._redis.aclose()

    def backlog_at(self, content_type: str, at: float) -> int:
        """The type's backlog around `at` (the most of the samples within one period of it)."""
        low = bisect.bisect_left(self.backlog, at - self.sample_s, key=lambda sample: sample[0])
        high = bisect.bisect_right(self.backlog, at + self.sample_s, key=lambda sample: sample[0])
        return max((sizes[content_type] for _, sizes in self.backlog[low:high]), default=0)


# --- the ledger, read back -----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Op:
    """One position sent for one key: a heartbeat, or one item of a sync."""

    key: Key
    position: float
    earliest: float  # the soonest the pods can have received it (sent; an item: its listened_at)
    latest: float  # the latest (answered; never answered: inf; an item: its listened_at)
    answered: float
    promise: str  # what the answer promised: "201", "sync" (applied), or ""
    request: int  # its request's index in the ledger


def ops_by_key(requests: list[dict]) -> dict[Key, list[Op]]:
    """Every key's positions, in the order the pods received them."""
    by_key: dict[Key, list[Op]] = defaultdict(list)
    for i, r in enumerate(requests):
        if r["op"] == "heartbeat":
            key = tuple(r["key"])
            promise = "201" if r["status"] == 201 else ""
            latest = r["t1"] if r["status"] else float("inf")
            by_key[key].append(Op(key, r["position"], r["t0"], latest, r["t1"], promise, i))
        elif r["op"] == "sync":
            applied = r["applied"] or [False] * len(r["items"])
            for (content_type, content_id, position, listened_at), ok in zip(r["items"], applied, strict=True):
                key = (content_type, content_id, r["user"])
                by_key[key].append(Op(key, position, listened_at, listened_at, r["t1"], "sync" if ok else "", i))
    for ops in by_key.values():
        ops.sort(key=lambda o: o.earliest)
    return by_key


def standing(ops: list[Op], promised: Op) -> set[float]:
    """The positions that may stand after `promised`: itself, and whatever the pods may have received after it (the
    times are the load's own clock: no slack)."""
    return {o.position for o in ops if o is promised or o.latest > promised.earliest}


def last_promise(ops: Iterable[Op], kinds: tuple[str, ...] = ("201", "sync")) -> Op | None:
    promised = [o for o in ops if o.promise in kinds]
    return max(promised, key=lambda o: o.earliest) if promised else None


# --- the checks ----------------------------------------------------------------------------------------------------


@dataclass
class Final:
    """What Postgres and the pods hold once the load and the faults are over."""

    rows: dict[Key, tuple[float, float, bool]]  # position, updated_at, completed
    events: Counter[Key]
    unpublished: int
    parked: int
    backlog_left: int
    drain_s: float
    exit_s: dict[int, float]
    cancelled_waits: list[str]  # "did not stop" lines of the pods' logs


class Checks:
    """The failures of each check: how many, about how many keys (or pods, requests), and a few examples."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.about: dict[str, set[object]] = defaultdict(set)
        self.examples: dict[str, list[str]] = defaultdict(list)

    def fail(self, check: str, example: str, about: object = None) -> None:
        self.counts[check] += 1
        about = example if about is None else about
        if about not in self.about[check] and len(self.examples[check]) < 5:
            self.examples[check].append(example)
        self.about[check].add(about)

    def summary(self) -> dict[str, str]:
        return {
            check: f"{count}" + (f" ({len(self.about[check])} keys)" if count > len(self.about[check]) else "")
            for check, count in self.counts.items()
        }


def check_final(by_key: dict[Key, list[Op]], final: Final, checks: Checks, started: float) -> None:
    for key, ops in by_key.items():
        row = final.rows.get(key)
        sent = {o.position for o in ops}
        if row is not None and row[0] not in sent:
            checks.fail("row holds a position never sent", f"{key}: {row[0]}")
        promised = last_promise(ops)
        if promised is not None:
            if row is None:
                checks.fail(
                    "acknowledged final position lost", f"{key}: {promised.promise} {promised.position}, no row"
                )
            elif row[0] not in standing(ops, promised):
                checks.fail(
                    "acknowledged final position lost",
                    f"{key}: {promised.promise} {promised.position} at {promised.answered - started:.1f} s, "
                    f"row {row[0]}",
                )
        completed = row is not None and row[2]
        ends = partial(completes, duration_s=DURATION_S, margin_s=COMPLETION_MARGIN_S)
        if any(o.promise and ends(o.position) for o in ops) and not completed:
            checks.fail("acknowledged completion lost", f"{key}")
        if completed and not any(ends(o.position) for o in ops):
            checks.fail("completed without reaching the end", f"{key}")
        if final.events[key] != (1 if completed else 0):
            checks.fail(
                "not exactly one event per completion", f"{key}: completed {completed}, {final.events[key]} events"
            )
    for key in set(final.events) - set(by_key):
        checks.fail("not exactly one event per completion", f"{key}: an event for a key never sent")
    if final.unpublished or final.parked:
        checks.fail("completion events not published", f"{final.unpublished} unpublished, {final.parked} parked")
    if final.backlog_left:
        checks.fail("backlog not drained at the end", f"{final.backlog_left} members left after {final.drain_s:.0f} s")


def deadline(answered: float, allowed_s: float, held: list[tuple[float, float]]) -> float:
    """`allowed_s` of flush time from `answered`, not counting the times a fault held the key."""
    t, left = answered, allowed_s
    for start, end in sorted(held):
        if end <= t:
            continue
        if start > t + left:
            break
        if start > t:
            left -= start - t
        t = max(t, end)
    return t + left


def check_persisted(
    by_key: dict[Key, list[Op]],
    faults: list[Fault],
    crowds: list[tuple[float, float]],
    watch: Watch,
    budget: int,
    checks: Checks,
    started: float,
) -> dict[str, float]:
    """Each promised position (or a newer one) reached Postgres within its bound: DESIGN §6's ~2 intervals, plus the
    type's fair turn under the budget, plus what the faults that held it explain. Returns the worst lag per type (of
    the positions seen in Postgres at all).

    The fair turn (DESIGN §12, issue 23): types take turns, one batch each, so a key waits about one batch of every
    type for each batch of its own type ahead of it: n_types x (its type's backlog + one batch) / budget. Its type's
    backlog is what was pending when it was answered plus the keys of that type answered while it waited: a pending
    set has no order, so a key may go after those that came later.
    """
    promised = [(key, op) for key, ops in by_key.items() for op in ops if op.promise]
    held = {key: [span for f in faults if (span := f.holds(key, budget)) is not None] for key in by_key}
    arrivals = {
        kind.name: Arrivals([(op.answered, key) for key, op in promised if key[0] == kind.name])
        for kind in CONTENT_KINDS
    }
    pending = [watch.backlog_at(key[0], op.answered) for key, op in promised]
    base_s = [PERSIST_BASE_S + watch.sample_s for _ in promised]
    due = [op.answered for _, op in promised]
    for _ in range(3):  # the wait's length decides the arrivals it counts: a few rounds settle it
        came = [0] * len(promised)
        for name, type_arrivals in arrivals.items():
            mine = [i for i, (key, _) in enumerate(promised) if key[0] == name]
            for i, count in zip(
                mine, type_arrivals.distinct([(promised[i][1].answered, due[i]) for i in mine]), strict=True
            ):
                came[i] = count
        for i, (key, op) in enumerate(promised):
            fair_s = len(CONTENT_KINDS) * (pending[i] + came[i] + BATCH) / budget
            wait = deadline(op.answered, base_s[i] + fair_s, held[key])
            extra_s = sum(f.extra_s(key, budget) for f in faults if f.start < wait and f.end > op.answered - INTERVAL_S)
            due[i] = deadline(op.answered, base_s[i] + fair_s + extra_s, held[key])
    worst: dict[str, float] = defaultdict(float)
    for (key, op), op_due in zip(promised, due, strict=True):
        changes = watch.rows[key[0]].changes.get((key[1], key[2]), [])
        seen = next((at for at, updated_at, _ in changes if updated_at >= op.earliest - SLACK_S), None)
        if seen is not None:
            worst[key[0]] = max(worst[key[0]], seen - op.answered)
        if seen is None or seen > op_due:
            until = seen or op_due
            # the budget's key stays pushed: it may hold everything after it
            during = {f.kind for f in faults if f.start < until and f.end + INTERVAL_S > op.answered}
            during |= {"budget_push" for f in faults if f.kind == "budget_push" and f.start < until}
            during |= {"crowd" for start, end in crowds if start < until and end + INTERVAL_S > op.answered}
            lag = f"after {seen - op.answered:.1f} s" if seen is not None else "never"
            checks.fail(
                f"{key[0]} position persisted late",
                f"{key} {op.promise} at {op.answered - started:.1f} s: seen {lag}, bound "
                f"{op_due - op.answered:.1f} s (meanwhile: {', '.join(sorted(during)) or 'no fault'})",
                key,
            )
    return dict(worst)


class Arrivals:
    """The promised positions of one type by answer time: how many distinct keys came within each of many windows
    (offline, with a Fenwick tree: an answer counts for a window when its key's previous answer came before it)."""

    def __init__(self, answered: list[tuple[float, Key]]) -> None:
        answered.sort()
        self.times = [at for at, _ in answered]
        last: dict[Key, float] = {}
        self.previous: list[float] = []  # the same key's answer before (-inf: none)
        for at, key in answered:
            self.previous.append(last.get(key, float("-inf")))
            last[key] = at

    def distinct(self, windows: list[tuple[float, float]]) -> list[int]:
        n = len(self.times)
        tree = [0] * (n + 1)

        def add(i: int) -> None:
            i += 1
            while i <= n:
                tree[i] += 1
                i += i & -i

        def below(i: int) -> int:  # how many added among the first i answers
            total = 0
            while i > 0:
                total += tree[i]
                i -= i & -i
            return total

        by_previous = sorted(range(n), key=self.previous.__getitem__)
        counts = [0] * len(windows)
        added = 0
        for q in sorted(range(len(windows)), key=lambda q: windows[q][0]):
            start, end = windows[q]
            while added < n and self.previous[by_previous[added]] < start:
                add(by_previous[added])
                added += 1
            counts[q] = below(bisect.bisect_right(self.times, end)) - below(bisect.bisect_left(self.times, start))
        return counts


def explains_503(fault: Fault, request: dict) -> bool:
    """Whether `fault` may make `request` answer 503 (openapi.yaml documents a 503 for every route): the stores a
    route needs, and nothing more (DESIGN §12: a locked table holds only its own type's reads)."""
    route = request["op"]
    if fault.pod is not None:  # the pod going away or starting
        return fault.pod == request["pod"]
    if fault.kind == "maxmemory":
        # Redis refuses writes: a heartbeat goes to Postgres (and may fail there), a sync has no other store, and
        # the heartbeats written to Postgres take connections the reads share
        return True
    if fault.kind.startswith("table_lock"):
        # a sync reads the tables of every type it carries (a storm's syncs carry them all)
        return route == "sync" or (route == "read" and request["content_type"] == fault.content_type)
    return False  # a row lock, a slow write, the broker, the budget: no read, sync or Redis write waits on them


def check_requests(
    requests: list[dict], by_key: dict[Key, list[Op]], faults: list[Fault], checks: Checks, started: float
) -> None:
    down = [(f.pod, f.start, f.end + 1.0) for f in faults if f.pod is not None]
    for i, r in enumerate(requests):
        fail = partial(checks.fail, about=i)  # each request counts once
        route = r["op"]
        where = f"{route} at {r['t0'] - started:.1f} s to pod {r['pod']}"
        latency_s = r["t1"] - r["t0"]
        if r["status"] == 0:
            if not any(pod == r["pod"] and start <= r["t1"] and r["t0"] <= end for pod, start, end in down):
                fail("client error from a pod not being killed", f"{where}: no answer after {latency_s:.1f} s")
            continue
        if latency_s > BOUND_S[route]:
            fail(f"{route} slower than its bound ({BOUND_S[route]:.1f} s)", f"{where}: {latency_s:.1f} s")
        allowed = {"heartbeat": {201, 503}, "read": {200, 503}, "sync": {200, 503}}[route]
        if route == "read" and len(r["ids"]) == 1:
            allowed = allowed | {404}
        if r["status"] not in allowed:
            fail(f"{route} answered {r['status']}", where)
        elif r["status"] == 503:
            if route == "read" and not r["retry_after"]:
                fail("read 503 without Retry-After", where)  # openapi.yaml documents it for the reads' 503
            # a 503 answered up to a margin after its fault ended still belongs to it
            active = [f for f in faults if f.start <= r["t1"] and r["t0"] <= f.end + 1.0 + MARGIN_S]
            # a sync past SYNC_CONNECTIONS (2)'s wait is shed by design (503, Retry-After: 1), whatever slowed the
            # syncs at the database: the storms send 10 at once against 2 slots per pod
            shed = route == "sync" and r["retry_after"] and bool(active)
            if not shed and not any(explains_503(f, r) for f in active):
                kinds = ", ".join(sorted({f"{f.kind} {f.content_type}".strip() for f in active})) or "no fault"
                what = f"{route} {r['content_type']}" if route == "read" else route
                fail(f"{route} refused (503) by a fault it does not depend on", f"{where}: {what} ({kinds})")
        if route == "read" and r["status"] in (200, 404):
            check_read(r, by_key, fail, where)


def check_read(r: dict, by_key: dict[Key, list[Op]], fail: Callable[[str, str], None], where: str) -> None:
    """A read shows the position acknowledged last before it was sent, or one received after (DESIGN §10)."""
    found = dict(r["found"])
    for content_id in r["ids"]:
        key = (r["content_type"], content_id, r["user"])
        ops = by_key.get(key, [])
        shown = found.get(content_id)
        if shown is not None and shown not in {o.position for o in ops}:
            fail("read shows a position never sent", f"{where}: {key} {shown}")
        before = last_promise((o for o in ops if o.answered < r["t0"]), ("201", "sync"))
        if before is not None and (shown is None or shown not in standing(ops, before)):
            fail("read older than an acknowledged position", f"{where}: {key} {shown}, acked {before.position}")


def check_pods(faults: list[Fault], final: Final, checks: Checks) -> None:
    exits = [(f"SIGTERM fault on pod {f.pod}", f.exit_s) for f in faults if f.kind == "sigterm"]
    exits += [(f"the end: pod {pod}", exit_s) for pod, exit_s in final.exit_s.items()]
    for what, exit_s in exits:
        if exit_s > EXIT_S:
            checks.fail(f"pod exit after SIGTERM slower than its bound ({EXIT_S:.0f} s)", f"{what}: {exit_s:.1f} s")
    for i, line in enumerate(final.cancelled_waits):
        checks.fail("a wait did not end on SIGTERM (cancelled at the shutdown timeout)", line, i)


# --- the run -------------------------------------------------------------------------------------------------------


@dataclass
class Report:
    seed: int
    size: str
    faults: list[str] = field(default_factory=list)
    crowds: list[str] = field(default_factory=list)
    outcomes: dict[str, dict[str, int]] = field(default_factory=dict)  # route (role) -> status -> count
    max_latency_s: dict[str, float] = field(default_factory=dict)
    p99_latency_s: dict[str, float] = field(default_factory=dict)
    worst_lag_s: dict[str, float] = field(default_factory=dict)
    keys: int = 0
    rows: int = 0
    completed: int = 0
    events: int = 0
    load_loop_lag_s: float = 0.0
    drain_s: float = 0.0
    exit_s: dict[int, float] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)  # check -> how many (about how many keys)
    examples: dict[str, list[str]] = field(default_factory=dict)

    def ok(self) -> bool:
        return not self.failures

    def text(self) -> str:
        lines = [f"nemesis seed {self.seed} ({self.size}): {'PASS' if self.ok() else 'FAIL'}", "faults:"]
        lines += [f"  {fault}" for fault in self.faults] or ["  none"]
        lines += [f"  (load) {crowd}" for crowd in self.crowds]
        statuses = sorted({s for counts in self.outcomes.values() for s in counts}, key=int)
        lines.append(f"{'requests':<20}" + "".join(f"{s:>7}" for s in statuses) + "  max s   p99 s  bound s")
        for route, counts in self.outcomes.items():
            bound = BOUND_S[route.split()[0]]
            lines.append(
                f"{route:<20}"
                + "".join(f"{counts.get(s, 0):>7}" for s in statuses)
                + f"{self.max_latency_s[route]:>7.2f} {self.p99_latency_s[route]:>7.2f} {bound:>7.1f}"
            )
        lag = ", ".join(f"{t} {s:.1f} s" for t, s in self.worst_lag_s.items())
        lines.append(f"worst lag to Postgres of a promised position: {lag}")
        lines.append(
            f"keys {self.keys}, rows {self.rows}, completed {self.completed}, events {self.events}; "
            f"drained in {self.drain_s:.1f} s; pods exited in "
            f"{', '.join(f'{s:.1f}' for s in self.exit_s.values())} s; "
            f"the load's worst event-loop lag {self.load_loop_lag_s:.2f} s"
        )
        for check, count in self.failures.items():
            lines.append(f"FAILED {check}: {count}")
            lines += [f"    {example}" for example in self.examples[check]]
        lines.append(
            f"rerun: python -m tests.faults.nemesis{' --long' if self.size == 'long' else ''} --seed {self.seed}"
        )
        return "\n".join(lines)


def run(size: Size, seed: int, kinds: Iterable[str], base: Path, log: Callable[[str], None] = print) -> Report:
    base.mkdir(parents=True, exist_ok=True)
    log(f"nemesis seed {seed} ({size.name}; NEMESIS_SEED={seed} or --seed {seed} replays it); work in {base}")
    return asyncio.run(_run(size, seed, set(kinds), base, log))


async def _run(size: Size, seed: int, kinds: set[str], base: Path, log: Callable[[str], None]) -> Report:
    cluster = Cluster(base, processes=2, env=service_env(size.budget), broker=True)
    report = Report(seed, size.name)
    load = size.load
    users: subprocess.Popen[bytes] | None = None
    try:
        log(f"starting Valkey, Postgres, a broker and 2 pods; {load.users} users")
        await asyncio.to_thread(cluster.start, users=load.users, contents=load.contents, setup_sql=STALL_SQL)
        watch = Watch(cluster.database_url, cluster.redis.url, size.sample_s)
        await watch.start()
        ledger_path = base / "ledger.json"
        started = time.time()
        users = start_load(cluster, load, seed, ledger_path)
        nemesis = Nemesis(cluster, watch, log)
        until = started + load.seconds - size.quiet_s
        await asyncio.sleep(size.warmup_s)
        log(f"load for {load.seconds:.0f} s; faults (s from the load's start):")
        await asyncio.gather(
            *(
                nemesis.lane([k for k in lane_kinds if k in kinds], random.Random(f"{seed}:{lane}"), size, until)
                for lane, lane_kinds in LANES.items()
            )
        )
        if await asyncio.to_thread(users.wait, load.seconds + 120) != 0:
            raise RuntimeError(f"the load failed; see {base}/load.log")
        ledger = json.loads(ledger_path.read_text())
        # faults off: every pod up, the buffer drained
        for i, process in enumerate(cluster.services):
            if process is None or process.poll() is not None:
                cluster.start_service(i)
                await asyncio.to_thread(cluster.wait_ready, i, 60)
        drain_from = time.time()
        # the backlog left at the budget's pace, a dead pod's leases, two intervals and the margin
        drain_bound_s = await backlog_left(cluster.redis.url) / size.budget + LEASE_S + 2 * INTERVAL_S + 5
        left = await wait_drained(cluster.redis.url, drain_bound_s)
        drain_s = time.time() - drain_from
        unpublished, parked = await _outbox(cluster.database_url, timeout_s=10 if not left else 0)
        await watch.stop()
        rows, events = await _final_rows(cluster.database_url)
        exit_s = await asyncio.to_thread(cluster.terminate_services, range(len(cluster.ports)), 60)
        final = Final(rows, events, unpublished, parked, left, drain_s, exit_s, _cancelled_waits(base))
    finally:
        if users is not None and users.poll() is None:  # a failure of this run: the load goes with it
            users.kill()
            users.wait()
        await asyncio.to_thread(cluster.stop)

    faults = nemesis.faults
    by_key = ops_by_key(ledger["requests"])
    checks = Checks()
    check_final(by_key, final, checks, started)
    crowds = _crowds(ledger["requests"], load, size.budget)
    report.worst_lag_s = check_persisted(by_key, faults, crowds, watch, size.budget, checks, started)
    check_requests(ledger["requests"], by_key, faults, checks, started)
    check_pods(faults, final, checks)
    for kind in kinds:
        if size.once and not any(f.kind == kind for f in faults):
            checks.fail("fault never applied", kind)
    for name, rows_watch in watch.rows.items():
        for moved in rows_watch.moved_back:
            checks.fail("row moved back", f"{name} {moved}")
    _summarise(report, ledger, final, faults, crowds, started)
    report.failures, report.examples = checks.summary(), dict(checks.examples)
    return report


async def _outbox(database_url: str, timeout_s: float) -> tuple[int, int]:
    """Completion events not yet published, and parked, once the relays had `timeout_s` to publish them."""
    conn = await asyncpg.connect(database_url)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            row = await conn.fetchrow(
                "SELECT count(*) FILTER (WHERE published_at IS NULL AND publish_failed_at IS NULL) AS unpublished, "
                "count(*) FILTER (WHERE published_at IS NULL AND publish_failed_at IS NOT NULL) AS parked "
                "FROM progress_completion_event"
            )
            assert row is not None
            if not row["unpublished"] or time.monotonic() > deadline:
                return row["unpublished"], row["parked"]
            await asyncio.sleep(0.5)
    finally:
        await conn.close()


async def _final_rows(database_url: str) -> tuple[dict[Key, tuple[float, float, bool]], Counter[Key]]:
    conn = await asyncpg.connect(database_url)
    try:
        rows: dict[Key, tuple[float, float, bool]] = {}
        for kind in CONTENT_KINDS:
            query = f"SELECT {kind.id_column}, user_id, position, updated_at, completed_at FROM {kind.progress_table}"
            for r in await conn.fetch(query):
                rows[(kind.name, r[0], r["user_id"])] = (
                    r["position"],
                    r["updated_at"].timestamp(),
                    r["completed_at"] is not None,
                )
        events: Counter[Key] = Counter()
        for r in await conn.fetch("SELECT content_type, content_id, user_id FROM progress_completion_event"):
            events[(r["content_type"], r["content_id"], r["user_id"])] += 1
        return rows, events
    finally:
        await conn.close()


def _cancelled_waits(base: Path) -> list[str]:
    """The pods' log lines of a background task cancelled at shutdown: a wait that SIGTERM did not end."""
    lines = []
    for path in sorted(base.glob("service-*.log")):
        for line in path.read_text(errors="replace").splitlines():
            if "did not stop in" in line:
                lines.append(f"{path.name}: {json.loads(line).get('message', line) if line.startswith('{') else line}")
    return lines


def _crowds(requests: list[dict], load: Load, budget: int) -> list[tuple[float, float]]:
    """When each crowd sent its heartbeats, and the time its backlog takes at the budget's pace."""
    sent = sorted(r["t0"] for r in requests if r["op"] == "heartbeat" and r["role"] == "crowd")
    crowds: list[tuple[float, float]] = []
    for at in sent:
        if crowds and at - crowds[-1][1] < load.crowd_spread_s:
            crowds[-1] = (crowds[-1][0], at)
        else:
            crowds.append((at, at))
    merged: list[tuple[float, float]] = []
    for start, end in crowds:  # a crowd slowed by a fault may pause longer than its spread: one crowd still
        end += load.crowd_users / budget
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return merged


def route_of(request: dict) -> str:
    if request["op"] == "heartbeat":
        return f"heartbeat {request['role']}"
    if request["op"] == "read":
        return "read one" if len(request["ids"]) == 1 else "read ids"
    return "sync"


def _summarise(
    report: Report, ledger: dict, final: Final, faults: list[Fault], crowds: list[tuple[float, float]], started: float
) -> None:
    latencies: dict[str, list[float]] = defaultdict(list)
    outcomes: dict[str, Counter[str]] = defaultdict(Counter)
    for r in ledger["requests"]:
        route = route_of(r)
        outcomes[route][str(r["status"])] += 1
        if r["status"]:
            latencies[route].append(r["t1"] - r["t0"])
    report.outcomes = {route: dict(counts) for route, counts in sorted(outcomes.items())}
    report.max_latency_s = {route: max(values) for route, values in latencies.items()}
    report.p99_latency_s = {
        route: statistics.quantiles(values, n=100)[98] if len(values) > 1 else values[0]
        for route, values in latencies.items()
    }
    for route in report.outcomes:
        report.max_latency_s.setdefault(route, 0.0)
        report.p99_latency_s.setdefault(route, 0.0)
    report.faults = [
        f"{f.start - started:6.1f}-{f.end - started:6.1f} s {f.kind} {f.target} {f.detail}".rstrip()
        for f in sorted(faults, key=lambda f: f.start)
    ]
    crowd_users = ledger["load"]["crowd_users"]
    report.crowds = [
        f"{a - started:6.1f}-{b - started:6.1f} s crowd of {crowd_users} lesson heartbeats" for a, b in crowds
    ]
    report.keys = len({tuple(r["key"]) for r in ledger["requests"] if r["op"] == "heartbeat"})
    report.rows = len(final.rows)
    report.completed = sum(1 for row in final.rows.values() if row[2])
    report.events = sum(final.events.values())
    report.load_loop_lag_s = ledger["loop_lag_max_s"]
    report.drain_s = final.drain_s
    report.exit_s = final.exit_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--long", action="store_true", help="the larger run (about 6 minutes)")
    parser.add_argument("--seed", type=int, default=None, help="replay a run (default: a new seed, printed)")
    parser.add_argument("--faults", default=",".join(FAULT_KINDS), help=f"kinds to apply (default all: {FAULT_KINDS})")
    parser.add_argument(
        "--without-crowd", action="store_true", help="no crowd in the load (types then share no backlog)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs, ledger)")
    args = parser.parse_args()
    kinds = [k for k in args.faults.split(",") if k]
    if unknown := set(kinds) - set(FAULT_KINDS):
        parser.error(f"unknown faults {sorted(unknown)}; known: {', '.join(FAULT_KINDS)}")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds: every server started is stopped
    work = Path(tempfile.mkdtemp(prefix="nemesis-"))
    size = LONG if args.long else CI
    if args.without_crowd:
        size = replace(size, load=replace(size.load, crowd_users=0, crowd_at_s=()))
    report = run(size, seed, kinds, work)
    print(report.text())
    if not args.keep:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"work folder kept: {work}")
    return 0 if report.ok() else 1


def seed_from_environment() -> int:
    """NEMESIS_SEED, or a new seed (the test prints it)."""
    value = os.environ.get("NEMESIS_SEED", "")
    return int(value) if value else random.SystemRandom().randrange(2**31)


if __name__ == "__main__":
    raise SystemExit(main())
