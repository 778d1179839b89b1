"""Parked messages: `outbox list --parked` shows them, `outbox redrive` sends each once more with its task id."""

import asyncio
import json
from functools import partial
from typing import Any

import asyncpg
import pytest

from service import cli
from service.outbox.admin import count_parked, redrive_parked
from service.outbox.outboxes import COMPLETIONS, completion_task_id, email_task_id
from tests.helpers import (
    Servers,
    add_events,
    limited_broker_user,
    relay_env,
    relay_once,
    start_service_command,
    wait_for,
)
from tests.monolith.fixtures import Broker, Executions

LIST_KEYS = {"outbox", "id", "error", "failed_at", "attempts"}


async def outbox_command(servers: Servers, broker: Broker, *args: str) -> tuple[str, str]:
    """`progress-service outbox ...` as its own process, off a terminal; (stdout, stderr), exit 0 asserted."""
    process = await start_service_command("outbox", *args, env=relay_env(servers, broker, LOG_LEVEL="INFO"))
    stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode == 0, stderr.decode()[-2000:]
    return stdout.decode(), stderr.decode()


async def listed(servers: Servers, broker: Broker, *args: str) -> list[dict[str, Any]]:
    stdout, _ = await outbox_command(servers, broker, "list", "--parked", "--json", *args)
    rows: list[dict[str, Any]] = json.loads(stdout)
    return rows


async def park_one_email(db: asyncpg.Pool, user_id: int) -> int:
    """A trial email the broker refused for good, as the relay leaves it; returns its dispatch id."""
    await db.execute("INSERT INTO users_user (id, email) VALUES ($1, 'parked@example.com')", user_id)
    dispatch_id: int = await db.fetchval(
        "INSERT INTO emails_emaildispatch (user_id, source, email_key, sent_at, created_at) "
        "VALUES ($1, 'trial_journey', 'trial_welcome', now(), now()) RETURNING id",
        user_id,
    )
    await db.execute(
        "INSERT INTO trial_email_outbox (dispatch_id, user_id, source, email_key, reserved_at, publish_attempts,"
        "                                publish_failed_at, publish_error) "
        "VALUES ($1, $2, 'trial_journey', 'trial_welcome', now(), 12, now(), 'ResponseError: NOPERM')",
        dispatch_id,
        user_id,
    )
    return dispatch_id


@pytest.mark.slow  # processes of the command and of the relay, a real Celery worker
async def test_parked_rows_are_listed_then_re_driven_once_each_with_their_task_ids_and_a_second_redrive_does_nothing(
    servers: Servers, broker: Broker, db: asyncpg.Pool, executions: Executions
) -> None:
    await add_events(db, 5)
    refused = {
        "CELERY_BROKER_URL": await limited_broker_user(broker),
        "COMPLETION_TASK_QUEUE": "forbidden",
        "OUTBOX_MAX_ATTEMPTS": "1",
    }
    code, summary = await relay_once(servers, broker, **refused)
    assert code == 0 and summary is not None and summary["parked"]["completion"] == 5
    dispatch_id = await park_one_email(db, 1000)

    rows = await listed(servers, broker)
    assert len(rows) == 6 and all(set(row) == LIST_KEYS for row in rows)
    completions = sorted((row for row in rows if row["outbox"] == "completion"), key=lambda row: row["id"])
    assert [row["id"] for row in completions] == [1, 2, 3, 4, 5]
    assert all(row["attempts"] == 1 and "permission" in row["error"].lower() for row in completions)
    assert all(isinstance(row["failed_at"], str) for row in rows)
    assert [(row["outbox"], row["id"]) for row in await listed(servers, broker, "--outbox", "email")] == [
        ("email", dispatch_id)
    ]
    assert len(await listed(servers, broker, "--limit", "2")) == 2
    table, _ = await outbox_command(servers, broker, "list", "--parked", "--outbox", "email")
    header, line = table.splitlines()
    assert header.split() == ["outbox", "id", "attempts", "failed_at", "error"]
    assert line.split()[:3] == ["email", str(dispatch_id), "12"] and line.endswith("ResponseError: NOPERM")

    stdout, _ = await outbox_command(servers, broker, "redrive", "--parked", "--dry-run")
    assert "would re-drive 6 parked rows" in stdout
    assert len(await listed(servers, broker)) == 6  # a dry run changes nothing

    stdout, _ = await outbox_command(servers, broker, "redrive", "--parked", "--outbox", "completion", "--ids", "1,2")
    assert "re-drove 2 parked rows" in stdout
    assert sorted(row["id"] for row in await listed(servers, broker, "--outbox", "completion")) == [3, 4, 5]
    stdout, stderr = await outbox_command(servers, broker, "redrive", "--parked")
    assert "re-drove 4 parked rows (completion 3, email 1)" in stdout
    summaries = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    assert any(line["message"].startswith("outbox redrive done: 4 of 4 rows in ") for line in summaries), stderr

    code, summary = await relay_once(servers, broker)
    assert code == 0 and summary is not None
    assert (summary["published"], summary["republished"]) == (
        {"completion": 5, "email": 1},
        {"completion": 0, "email": 0},
    )
    await executions.wait_for(6, settle_s=1.0)
    expected = {completion_task_id("lesson", 1, user_id) for user_id in range(1, 6)} | {email_task_id(dispatch_id)}
    counts = await executions.by_task_id()
    assert set(counts) == expected and set(counts.values()) == {1}

    published_at = await db.fetch("SELECT id, published_at FROM progress_completion_event ORDER BY id")
    stdout, _ = await outbox_command(servers, broker, "redrive", "--parked")
    assert "re-drove 0 parked rows" in stdout
    assert await db.fetch("SELECT id, published_at FROM progress_completion_event ORDER BY id") == published_at
    assert await listed(servers, broker) == []
    code, summary = await relay_once(servers, broker)
    assert summary is not None and summary["published"] == {"completion": 0, "email": 0}
    await asyncio.sleep(0.5)
    assert await executions.count() == 6


async def test_a_redrive_goes_in_chunks_and_touches_only_parked_unpublished_rows(db: asyncpg.Pool) -> None:
    await add_events(db, 7)
    await db.execute(
        "UPDATE progress_completion_event SET publish_failed_at = now(), publish_error = 'NOPERM', "
        "publish_attempts = 3 WHERE id <= 5"
    )
    await db.execute("UPDATE progress_completion_event SET published_at = now() WHERE id = 6")
    assert await count_parked(db, COMPLETIONS) == 5
    assert await count_parked(db, COMPLETIONS, [1, 6, 7]) == 1

    chunks: list[int] = []
    assert await redrive_parked(db, COMPLETIONS, chunk=2, on_chunk=chunks.append) == 5
    assert chunks == [2, 2, 1]
    rows = await db.fetch(
        "SELECT id, publish_failed_at, claimed_until, publish_attempts, published_at "
        "FROM progress_completion_event ORDER BY id"
    )
    assert all(row["publish_failed_at"] is None and row["claimed_until"] is None for row in rows)
    assert [row["publish_attempts"] for row in rows[:5]] == [3] * 5  # kept: a new refusal parks again at once
    assert [row["published_at"] is not None for row in rows] == [False] * 5 + [True, False]
    assert await redrive_parked(db, COMPLETIONS) == 0


async def _parked_out_of_key_order(db: asyncpg.Pool, parked: int) -> None:
    """`parked` rows written in descending key order (a scan of the table meets them last key first), behind
    many published ones."""
    await db.execute(
        "INSERT INTO progress_completion_event (id, content_type, content_id, user_id, completed_at, published_at) "
        "SELECT g, 'lesson', g, 1, now(), now() FROM generate_series($1 + 1, $1 + 20000) g",
        parked,
    )
    await db.execute(
        "INSERT INTO progress_completion_event (id, content_type, content_id, user_id, completed_at,"
        "                                       publish_attempts, publish_failed_at, publish_error) "
        "SELECT g, 'lesson', g, 1, now(), 12, now(), 'NOPERM' FROM generate_series($1, 1, -1) g",
        parked,
    )
    await db.execute("ANALYZE progress_completion_event")


async def _waiting_for_a_lock(db: asyncpg.Pool, pids: list[int]) -> bool:
    return bool(
        await db.fetchval(
            "SELECT count(DISTINCT pid) = $2 FROM pg_locks WHERE NOT granted AND pid = ANY($1)", pids, len(pids)
        )
    )


@pytest.mark.regression
async def test_two_redrives_at_once_cannot_deadlock_whatever_join_the_planner_picks(
    migrated: str, db: asyncpg.Pool
) -> None:
    """Found by an outside attack: three re-drives at once over 3,000 rows, one died of a deadlock. The chunk
    took no lock and the UPDATE locked in its join's order: here one re-drive joins by a nested loop over the
    chunk (key order), the other by a hash join probing the table (heap order, last key first), and a third
    session holds the middle row until both wait on it. Locked by the chunk in key order, both finish."""
    parked = 3000
    await _parked_out_of_key_order(db, parked)
    plans = {
        "nested loop over the chunk": ("enable_hashjoin", "enable_mergejoin"),
        "hash join probing the table": ("enable_nestloop", "enable_mergejoin", "enable_indexscan", "enable_bitmapscan"),
    }
    connections = [await asyncpg.connect(migrated) for _ in range(3)]
    blocker, *redrivers = connections
    try:
        for conn, off in zip(redrivers, plans.values(), strict=True):
            for setting in off:
                await conn.execute(f"SET {setting} = off")
            await conn.execute("SET deadlock_timeout = '100ms'")  # a deadlock, if any, is found at once
        holding = blocker.transaction()
        await holding.start()
        await blocker.execute("SELECT 1 FROM progress_completion_event WHERE id = $1 FOR UPDATE", parked // 2)
        runs = [asyncio.ensure_future(redrive_parked(conn, COMPLETIONS, chunk=parked)) for conn in redrivers]
        await wait_for(partial(_waiting_for_a_lock, db, [conn.get_server_pid() for conn in redrivers]), timeout_s=10)
        await holding.rollback()
        done = await asyncio.wait_for(asyncio.gather(*runs, return_exceptions=True), timeout=30)
    finally:
        for conn in connections:
            await conn.close()
    assert not [result for result in done if isinstance(result, BaseException)], done
    assert sum(done) == parked  # type: ignore[arg-type]  # each row once, by one of them
    assert await count_parked(db, COMPLETIONS) == 0


async def test_redrives_at_once_over_rows_parked_out_of_order_each_row_once(migrated: str, db: asyncpg.Pool) -> None:
    """Five re-drives at once, in chunks, with the planner's own plans: every row re-driven exactly once."""
    parked = 3000
    await _parked_out_of_key_order(db, parked)
    connections = [await asyncpg.connect(migrated) for _ in range(5)]
    try:
        done = await asyncio.wait_for(
            asyncio.gather(*(redrive_parked(conn, COMPLETIONS, chunk=200) for conn in connections)), timeout=30
        )
    finally:
        for conn in connections:
            await conn.close()
    assert sum(done) == parked
    assert await count_parked(db, COMPLETIONS) == 0


@pytest.mark.regression
@pytest.mark.parametrize("action", ["list", "redrive"])
def test_ids_outside_1_to_2_63_or_not_plain_digits_are_an_argument_error(
    action: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by an outside attack: --ids 99999999999999999999 ended as "a store is unavailable: DataError", and
    1_0, +3 and -4 were taken as ids. Refused by the parser, before any store is asked; plain ids still pass."""
    for ids in (
        "99999999999999999999",
        "9223372036854775808",
        "0",
        "1_0",
        "+3",
        "-4",
        "1.0",
        "\u0661",
        "1,x",
        "9" * 5000,
    ):
        with pytest.raises(SystemExit) as exit_:
            cli.main(["outbox", action, "--parked", "--outbox", "completion", "--ids", ids])
        assert exit_.value.code == 2, ids
        assert (
            "argument --ids: --ids takes comma-separated row ids from 1 to 9223372036854775807"
            in capsys.readouterr().err
        )
    args = cli._parser().parse_args(["outbox", action, "--outbox", "email", "--ids", "7, 007,9223372036854775807"])
    assert args.ids == [7, 7, 2**63 - 1]
