"""The one loop helper: steps every interval, backoff after a failure, a bug logged and counted, never fatal."""

import asyncio
import logging
import time

import pytest
from prometheus_client import CollectorRegistry, Counter

from service.loops import Backoff, every


def test_the_backoff_doubles_up_to_its_cap() -> None:
    assert [Backoff(0.5, 3.0).delay_s(n) for n in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]


async def test_a_step_that_raises_is_logged_counted_and_retried_after_the_backoff(
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry = CollectorRegistry()
    errors = Counter("loop_test_errors", "unexpected errors", registry=registry)
    stop = asyncio.Event()
    started: list[float] = []

    async def step() -> bool:
        started.append(time.monotonic())
        if len(started) <= 2:
            raise RuntimeError("a bug")
        stop.set()
        return True

    with caplog.at_level(logging.ERROR, logger="service.loops"):
        await asyncio.wait_for(
            every(60.0, stop, step, name="test loop", backoff=Backoff(0.05, 1.0), errors=errors), timeout=5
        )

    assert len(started) == 3  # the loop went on after each failure, and retried long before the interval
    assert started[2] - started[1] >= started[1] - started[0] >= 0.04  # 0.05 s, then 0.1 s
    assert registry.get_sample_value("loop_test_errors_total") == 2
    assert [r.getMessage() for r in caplog.records] == ["test loop failed unexpectedly; retrying"] * 2
    assert all(r.exc_info is not None for r in caplog.records)


async def test_a_wake_event_cuts_the_wait_after_a_success_and_stop_ends_the_loop() -> None:
    stop, wake = asyncio.Event(), asyncio.Event()
    steps = 0

    async def step() -> bool:
        nonlocal steps
        steps += 1
        return True

    loop = asyncio.create_task(every(60.0, stop, step, name="test loop", wake=wake))
    await asyncio.sleep(0.05)
    assert steps == 1
    wake.set()
    await asyncio.sleep(0.05)
    assert steps == 2  # woken long before the interval
    stop.set()
    await asyncio.wait_for(loop, timeout=1)
    assert steps == 2


async def test_wait_first_waits_an_interval_before_the_first_step() -> None:
    stop = asyncio.Event()
    steps = 0

    async def step() -> bool:
        nonlocal steps
        steps += 1
        return True

    loop = asyncio.create_task(every(0.2, stop, step, name="test loop", wait_first=True))
    await asyncio.sleep(0.1)
    assert steps == 0
    await asyncio.sleep(0.2)
    assert steps == 1
    stop.set()
    await asyncio.wait_for(loop, timeout=1)
