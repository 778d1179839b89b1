"""A completion's Celery message carries the W3C traceparent of its publish span, into the monolith's task.

Heartbeat at the end -> the app's flush -> outbox -> the relay publishes to the real broker -> the real
worker, which records the `traceparent` its task request carries (as Celery's OpenTelemetry
instrumentation reads it); the app's spans go to a local OTLP/HTTP collector.
"""

import os
from collections.abc import AsyncIterator

import asyncpg
import pytest

from service import tracing
from service.auth import make_token
from service.config import Settings
from tests.helpers import auth, running_app, seed
from tests.monolith.fixtures import Executions
from tests.otlp import receiving_traces

pytestmark = pytest.mark.slow  # a real Celery worker

TASK = "apps.engagements.tasks.advance_user_journey"


@pytest.fixture
async def untraced(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[None]:
    for name in [name for name in os.environ if name.startswith("OTEL_")]:
        monkeypatch.delenv(name)
    yield
    await tracing.aclose()  # a test that failed before its app stopped leaves tracing on


async def complete_one(settings: Settings, db: asyncpg.Pool, executions: Executions) -> asyncpg.Record:
    """User 1 reaches the end of lesson 1 through the app, which flushes and relays it; the worker's execution."""
    await seed(db, users=1, contents=1, duration_s=600)
    app_settings = settings.model_copy(update={"progress_flusher_enabled": True})
    async with running_app(app_settings) as (_, client):
        response = await client.post(
            "/engagements/progress/lesson",
            headers=auth(make_token(app_settings, 1)),
            json={"lesson_id": 1, "position": 595},
        )
        assert response.status_code == 201
        [row] = await executions.wait_for(1)
    return row


async def test_the_monolith_task_gets_the_traceparent_of_the_publish_span_the_collector_received(
    relay_settings: Settings, db: asyncpg.Pool, executions: Executions, untraced: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    with receiving_traces() as receiver:
        monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        row = await complete_one(relay_settings, db, executions)
        # the app has stopped: its lifecycle exported the spans left

    assert row["task_name"] == TASK
    assert row["traceparent"] is not None, "the task's request carried no traceparent header"
    _, trace_id, parent_id, _ = row["traceparent"].split("-")
    assert trace_id in {span.trace_id for span in receiver.spans}
    [publish] = [span for span in receiver.named(f"publish {TASK}") if span.span_id == parent_id]
    assert publish.trace_id == trace_id
    assert publish.attributes == {"task_name": TASK, "task_id": row["task_id"], "queue": "onion-progress"}
    assert publish.service_name == "progress-service"
    # the heartbeat made no span: only the flush's, the relay's and the publish's came
    assert {span.name for span in receiver.spans} <= {"flush batch", "relay batch", f"publish {TASK}"}
    [flush] = receiver.named("flush batch")
    assert flush.attributes == {"content_type": "lesson", "rows": 1, "completions": 1}
    [batch] = [span for span in receiver.named("relay batch") if span.span_id == publish.parent_span_id]
    assert batch.attributes == {"outbox": "completion", "rows": 1}


@pytest.mark.parametrize("asked", ["no OTEL variable", "OTEL_TRACES_EXPORTER=none beside an endpoint"])
async def test_untraced_nothing_is_exported_and_the_message_has_no_traceparent(
    relay_settings: Settings,
    db: asyncpg.Pool,
    executions: Executions,
    untraced: None,
    monkeypatch: pytest.MonkeyPatch,
    asked: str,
) -> None:
    with receiving_traces() as receiver:
        if asked != "no OTEL variable":
            monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
            monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        row = await complete_one(relay_settings, db, executions)

    assert row["task_name"] == TASK
    assert row["traceparent"] is None
    assert receiver.posts == []
