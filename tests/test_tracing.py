"""Tracing (service/tracing.py): off unless the OTEL_* variables ask; on, its spans reach an OTLP/HTTP collector."""

import logging
import socket
import sys
import time
from collections.abc import AsyncIterator

import pytest

from service import tracing
from tests.otlp import receiving_traces


@pytest.fixture(autouse=True)
async def untraced(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[None]:
    """No OTEL_* variable from the shell; whatever a test turned on is off after it."""
    for name in [name for name in __import__("os").environ if name.startswith("OTEL_")]:
        monkeypatch.delenv(name)
    yield
    await tracing.aclose()


@pytest.mark.parametrize(
    ("env", "exporter"),
    [
        ({}, None),
        ({"OTEL_SERVICE_NAME": "progress-service"}, None),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, None),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, "otlp"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, "otlp"),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, "otlp"),
        ({"OTEL_TRACES_EXPORTER": "console"}, "console"),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}, None),
    ],
)
def test_only_the_otel_variables_turn_tracing_on(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], exporter: str | None
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert tracing.asked_for() == exporter


async def test_off_a_span_is_the_shared_no_op_and_no_traceparent_is_written() -> None:
    assert tracing.configure() is False
    with tracing.span("progress read", ids=3) as span:
        span.set_attribute("rows", 1)
        headers: dict[str, str] = {}
        tracing.inject(headers)
    assert headers == {}
    assert tracing.span("another") is tracing.span("progress sync")  # one object: nothing built per call


async def test_on_the_spans_reach_the_collector_with_the_traceparent_of_the_current_span(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with receiving_traces() as receiver:
        monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        assert tracing.configure() is True
        with tracing.span("relay batch", outbox="completion"):
            with tracing.span("publish t", task_id="abc") as span:
                span.set_attribute("rows", 2)
                headers: dict[str, str] = {}
                tracing.inject(headers)
        await tracing.aclose()  # what the lifecycle runs at shutdown: the spans left are exported

        version, trace_id, parent_id, flags = headers["traceparent"].split("-")
        assert version == "00" and int(flags, 16) & 1  # sampled: parentbased_always_on, the default
        publish, batch = receiver.named("publish t")[0], receiver.named("relay batch")[0]
        assert (publish.trace_id, publish.span_id) == (trace_id, parent_id)
        assert publish.parent_span_id == batch.span_id
        assert publish.attributes == {"task_id": "abc", "rows": 2}
        assert publish.service_name == "progress-service"
        assert receiver.posts == ["/v1/traces"]
    with tracing.span("after shutdown"):
        pass
    assert tracing.span("x") is tracing.span("y")


async def test_the_sampler_and_the_service_name_are_the_sdks_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    with receiving_traces() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        monkeypatch.setenv("OTEL_SERVICE_NAME", "progress-canary")
        monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
        assert tracing.configure() is True
        with tracing.span("not sampled"):
            headers: dict[str, str] = {}
            tracing.inject(headers)
        assert int(headers["traceparent"].rsplit("-", 1)[1], 16) & 1 == 0  # propagated, marked not sampled
        monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_on")
        await tracing.aclose()
        assert tracing.configure() is True
        with tracing.span("sampled"):
            pass
        await tracing.aclose()
    assert [(span.name, span.service_name) for span in receiver.spans] == [("sampled", "progress-canary")]


async def test_without_the_otel_extra_one_warning_and_the_pod_runs_untraced(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)  # what `import` finds without the SDK
    with caplog.at_level(logging.WARNING, logger="service.tracing"):
        assert tracing.configure() is False
    assert [record.getMessage() for record in caplog.records] == [
        "OTEL_* variables ask for traces, but the `otel` extra is not installed "
        "(import of opentelemetry.sdk.trace halted; None in sys.modules): running untraced"
    ]
    assert tracing.span("x") is tracing.span("y")


@pytest.mark.parametrize(
    "env",
    [{"OTEL_TRACES_EXPORTER": "zipkin"}, {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}],
)
async def test_an_exporter_it_does_not_build_is_a_warning_not_a_failure(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, env: dict[str, str]
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with caplog.at_level(logging.WARNING, logger="service.tracing"):
        assert tracing.configure() is False
    assert "running untraced" in caplog.text


@pytest.mark.slow  # waits out the shutdown's bound
async def test_a_collector_that_never_answers_holds_the_shutdown_its_bound_not_the_sdks_30_s(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with socket.create_server(("127.0.0.1", 0)) as silent:  # connections queue in its backlog, never answered
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{silent.getsockname()[1]}")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "60")
        assert tracing.configure() is True
        with tracing.span("left behind"):
            pass
        started = time.monotonic()
        await tracing.aclose()
        assert time.monotonic() - started < tracing.SHUTDOWN_TIMEOUT_S + 2
