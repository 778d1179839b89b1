"""TurnBatcher on its own (service/progress/batching.py): one round trip for a turn's callers, bounded waits."""

import asyncio

import pytest

from service.progress.batching import TurnBatcher


class Overloaded(Exception):
    pass


class Store:
    """A send that records its batches and answers when the test says so."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.gate = asyncio.Event()
        self.gate.set()

    async def send(self, items: list[int]) -> list[BaseException | None]:
        self.batches.append(items)
        await self.gate.wait()
        return [ValueError(f"odd {i}") if i % 2 else None for i in items]


def _limited(store: Store, **limits: object) -> TurnBatcher[int]:
    options: dict[str, object] = {"max_in_flight": 1, "max_batch": 3, "max_waiting": 100, "max_wait_s": 5.0}
    return TurnBatcher(
        store.send, interrupted=lambda: RuntimeError("interrupted"), overloaded=Overloaded, **{**options, **limits}
    )  # type: ignore[arg-type]


async def test_the_callers_of_one_turn_go_in_one_batch_each_with_its_own_answer() -> None:
    store = Store()
    batcher: TurnBatcher[int] = TurnBatcher(store.send, interrupted=lambda: RuntimeError("interrupted"))
    results = await asyncio.gather(*(batcher.submit(i) for i in range(4)), return_exceptions=True)
    assert store.batches == [[0, 1, 2, 3]]
    assert [type(r) if r is not None else None for r in results] == [None, ValueError, None, ValueError]


async def test_with_a_batch_out_the_next_callers_wait_and_go_together_up_to_max_batch() -> None:
    store = Store()
    store.gate.clear()
    batcher = _limited(store)
    first = asyncio.ensure_future(batcher.submit(0))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    waiting = [asyncio.ensure_future(batcher.submit(i)) for i in (2, 4, 6, 8)]
    await asyncio.sleep(0)
    assert store.batches == [[0]]  # one batch out at a time
    store.gate.set()
    await asyncio.gather(first, *waiting)
    assert store.batches == [[0], [2, 4, 6], [8]]  # group commit, at most max_batch


async def test_a_caller_waits_at_most_max_wait_s_and_past_max_waiting_is_refused_at_once() -> None:
    store = Store()
    store.gate.clear()
    batcher = _limited(store, max_wait_s=0.05, max_waiting=2)
    out = asyncio.ensure_future(batcher.submit(0))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    waiting = [asyncio.ensure_future(batcher.submit(i)) for i in (2, 4)]
    await asyncio.sleep(0)
    with pytest.raises(Overloaded, match="2 wait already"):
        await batcher.submit(6)
    for caller in waiting:
        with pytest.raises(Overloaded, match=r"waited 0\.05 s"):
            await asyncio.wait_for(caller, 1)
    store.gate.set()
    await out
    assert store.batches == [[0]]  # the callers that gave up took no place in a batch


async def test_a_cancelled_caller_takes_no_place_in_a_batch() -> None:
    store = Store()
    store.gate.clear()
    batcher = _limited(store)
    out = asyncio.ensure_future(batcher.submit(0))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    gone = asyncio.ensure_future(batcher.submit(2))
    stays = asyncio.ensure_future(batcher.submit(4))
    await asyncio.sleep(0)
    gone.cancel()
    store.gate.set()
    await asyncio.gather(out, stays)
    assert store.batches == [[0], [4]]


async def test_close_lets_queued_batches_finish_and_refuses_after() -> None:
    store = Store()
    store.gate.clear()
    batcher = _limited(store)
    callers = [asyncio.ensure_future(batcher.submit(i)) for i in (0, 2, 4, 6)]
    await asyncio.sleep(0)
    closing = asyncio.ensure_future(batcher.aclose())
    await asyncio.sleep(0)
    store.gate.set()
    await closing
    await asyncio.gather(*callers)  # every caller that was queued got its answer
    with pytest.raises(RuntimeError, match="interrupted"):
        await batcher.submit(8)


async def test_a_send_that_fails_fails_each_caller_of_its_batch() -> None:
    async def broken(items: list[int]) -> list[BaseException | None]:
        raise ConnectionError("store down")

    batcher: TurnBatcher[int] = TurnBatcher(broken, interrupted=lambda: RuntimeError("interrupted"))
    results = await asyncio.gather(*(batcher.submit(i) for i in range(3)), return_exceptions=True)
    assert all(isinstance(r, ConnectionError) for r in results)


async def test_the_next_batch_goes_before_the_callers_of_the_one_that_came_back_are_answered() -> None:
    store = Store()
    store.gate.clear()
    batcher = _limited(store)
    sent_when_first_answered: list[list[int]] = []

    async def caller(i: int) -> None:
        await batcher.submit(i)
        if i == 0:
            sent_when_first_answered.extend(store.batches)

    first = asyncio.ensure_future(caller(0))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    second = asyncio.ensure_future(caller(2))
    await asyncio.sleep(0)
    assert store.batches == [[0]]  # the second waits for the lane
    store.gate.set()
    await asyncio.gather(first, second)
    # the store had the next batch before the caller of the last one ran: its round trip overlaps their answers
    assert sent_when_first_answered == [[0], [2]]


async def test_with_nobody_waiting_the_lane_and_idle_wait_until_the_callers_have_run() -> None:
    events: list[str] = []
    batcher = _limited(Store(), idle=lambda: events.append("idle"))

    async def reader() -> None:
        await batcher.submit(0)
        events.append("answered")
        await batcher.submit(2)  # asks again the moment it is answered: its type's lane (and connection) stay
        events.append("answered again")

    await reader()
    for _ in range(3):
        await asyncio.sleep(0)
    assert events == ["answered", "answered again", "idle"]
