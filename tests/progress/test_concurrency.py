"""The flush's adaptive limit on its own (service/progress/concurrency.py), on a clock the test moves."""

import asyncio

import asyncpg
import pytest

from service.progress.concurrency import AdaptiveLimit


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def _statement(limit: AdaptiveLimit, clock: Clock, latency_s: float) -> None:
    async with limit.slot():
        clock.now += latency_s


async def test_latency_that_doubles_its_baseline_halves_the_limit_and_normal_latency_grows_it_back() -> None:
    clock = Clock()
    limit = AdaptiveLimit(max_limit=4, clock=clock)
    for _ in range(50):
        await _statement(limit, clock, 0.01)
    assert limit.limit == 4
    await _statement(limit, clock, 0.2)  # the short average passes twice the baseline
    assert limit.limit == 2
    await _statement(limit, clock, 0.2)  # started after that decrease: its own
    assert limit.limit == 1
    for _ in range(200):
        await _statement(limit, clock, 0.01)
    assert limit.limit == 4  # one slot per `limit` statements, up to the configured concurrency


async def test_a_refusal_halves_at_once_and_slow_statements_in_flight_together_halve_once() -> None:
    clock = Clock()
    limit = AdaptiveLimit(max_limit=8, clock=clock)
    with pytest.raises(asyncpg.LockNotAvailableError):
        async with limit.slot():
            raise asyncpg.LockNotAvailableError("lock timeout")
    assert limit.limit == 4
    started = [limit.slot() for _ in range(3)]
    for slot in started:
        await slot.__aenter__()
    clock.now += 1
    for slot in started:  # three refusals of statements that started before the first decrease
        await slot.__aexit__(asyncpg.QueryCanceledError, asyncpg.QueryCanceledError("statement timeout"), None)
    assert limit.limit == 2


async def test_an_error_that_is_no_refusal_moves_nothing_and_frees_its_slot() -> None:
    limit = AdaptiveLimit(max_limit=1, clock=Clock())
    with pytest.raises(RuntimeError):
        async with limit.slot():
            raise RuntimeError("a bug")
    assert limit.limit == 1
    async with asyncio.timeout(1):
        async with limit.slot():  # the slot was given back
            pass


async def test_callers_past_the_limit_wait_for_a_slot_in_turn() -> None:
    limit = AdaptiveLimit(max_limit=2, clock=Clock())
    release = asyncio.Event()
    inside: list[int] = []

    async def statement(i: int) -> None:
        async with limit.slot():
            inside.append(i)
            await release.wait()

    tasks = [asyncio.create_task(statement(i)) for i in range(5)]
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert inside == [0, 1]  # two slots, three waiting
    release.set()
    await asyncio.gather(*tasks)
    assert sorted(inside) == [0, 1, 2, 3, 4]
