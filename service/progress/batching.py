"""Many concurrent callers, one round trip: items submitted in the same event-loop turn go together.

With `max_in_flight` (the reads), at most that many batches are out at once: what is submitted
meanwhile waits for one to come back, then goes in one batch of at most `max_batch` (group commit),
so under load the batches grow instead of their number. It goes as soon as the send that came back
returns, before that batch's callers are answered: its round trip overlaps their answers, where the
stores would otherwise wait for them and the event loop, after, for the stores. With nobody waiting,
the lane is freed once those callers have run. A caller gets `overloaded(why)` rather than wait
longer than `max_wait_s` for a batch to start (a store that stalls holds its batches, not the
callers behind them), or at once past `max_waiting` waiting; `idle()` is called each time the last
batch out comes back, its callers answered, with nobody waiting. Without it (the writes), every
turn's batch goes at once.
"""

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class TurnBatcher(Generic[T]):
    def __init__(
        self,
        send: Callable[[list[T]], Awaitable[list[BaseException | None]]],
        *,
        interrupted: Callable[[], BaseException],
        max_in_flight: int = 0,
        max_batch: int = 0,
        max_waiting: int = 0,
        max_wait_s: float = 0.0,
        overloaded: Callable[[str], BaseException] | None = None,
        idle: Callable[[], None] | None = None,
    ) -> None:
        if max_in_flight and not (max_batch and max_waiting and max_wait_s and overloaded):
            raise ValueError("a limit of batches in flight needs max_batch, max_waiting, max_wait_s and overloaded")
        if idle is not None and not max_in_flight:
            raise ValueError("idle is called only with a limit of batches in flight")
        self._send_batch = send  # returns, for each item in order, None (done) or the exception for that item alone
        self._interrupted = interrupted  # the error a caller gets if its batch never finished
        self._max_in_flight = max_in_flight
        self._max_batch = max_batch
        self._max_waiting = max_waiting
        self._max_wait_s = max_wait_s
        self._overloaded = overloaded or (lambda why: interrupted())
        self._idle = idle  # with max_in_flight: called when no batch is out and nobody waits
        # (item, its caller's future, when it came): oldest first
        self._queue: list[tuple[T, asyncio.Future[None], float]] = []
        self._sending: set[asyncio.Task[None]] = set()
        self._expiry: asyncio.TimerHandle | None = None  # armed while callers wait for a free lane
        self._closed = False

    async def submit(self, item: T) -> None:
        if self._closed:
            raise self._interrupted()
        if self._max_waiting and len(self._queue) >= self._max_waiting:
            raise self._overloaded(f"{self._max_waiting} wait already")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        if not self._queue:
            # runs after every callback already ready in this turn: those requests join the batch
            loop.call_soon(self._send_queued)
        self._queue.append((item, future, loop.time()))
        await future

    def _send_queued(self) -> None:
        if self._max_in_flight:
            # a caller that went away while it waited (its request cancelled) takes no place in a batch
            self._queue = [entry for entry in self._queue if not entry[1].done()]
        while self._queue and not self._closed and self._lane_free():
            cut = self._max_batch or len(self._queue)
            batch, self._queue = self._queue[:cut], self._queue[cut:]
            task = asyncio.get_running_loop().create_task(self._send(batch))
            # keep a handle: an unreferenced task can be garbage-collected mid-flight
            self._sending.add(task)
            task.add_done_callback(self._sent)
        if not self._queue and self._expiry is not None:  # nobody waits: no timer
            self._expiry.cancel()
            self._expiry = None
        elif self._queue and self._max_in_flight and self._expiry is None and not self._closed:
            self._expiry = asyncio.get_running_loop().call_at(self._queue[0][2] + self._max_wait_s, self._expire)
        if self._idle is not None and not self._queue and not self._sending:
            self._idle()

    def _lane_free(self) -> bool:
        return not self._max_in_flight or len(self._sending) < self._max_in_flight

    def _sent(self, task: asyncio.Task[None] | None) -> None:
        if task in self._sending:  # once: early, when its send returned; else when the task ended (done or failed,
            # or cancelled, even before it started)
            self._sending.discard(task)
            if self._max_in_flight:
                self._send_queued()  # what waited for this batch to come back

    def _expire(self) -> None:
        """Who waited max_wait_s (within a ms) and is still not in a batch gets overloaded(); the queue is oldest
        first, so only its front is looked at, and the timer follows the oldest left."""
        self._expiry = None
        given_up = asyncio.get_running_loop().time() - self._max_wait_s + 0.001
        expired = 0
        for _, future, came in self._queue:
            if came > given_up:
                break
            if not future.done():
                future.set_exception(self._overloaded(f"waited {self._max_wait_s:g} s"))
            expired += 1
        del self._queue[:expired]
        if self._queue and not self._closed:
            self._expiry = asyncio.get_running_loop().call_at(self._queue[0][2] + self._max_wait_s, self._expire)

    async def _send(self, batch: list[tuple[T, asyncio.Future[None], float]]) -> None:
        error: BaseException | None = None
        try:
            results = await self._send_batch([item for item, _, _ in batch])
            if self._max_in_flight and self._queue:
                # its lane to who waits, before these callers run; with none waiting the done callback frees it
                # after them, so a caller that asks again at once keeps the lane (and the reads' connection: idle)
                # (safe only with no await below: `aclose` and the set's reference to this task end here)
                self._sent(asyncio.current_task())
            for (_, future, _), result in zip(batch, results, strict=True):
                if future.done():  # its request was cancelled (client went away)
                    continue
                if result is None:
                    future.set_result(None)
                else:
                    future.set_exception(result)
        except Exception as exc:  # handed to every caller of the batch, who handles or re-raises it
            error = exc
        finally:
            # whatever happened, no caller is left waiting for an answer that will not come
            for _, future, _ in batch:
                if not future.done():
                    future.set_exception(error if error is not None else self._interrupted())

    async def aclose(self) -> None:
        """Let the batches already queued finish, so no caller that will get an answer is cut short."""
        try:
            self._send_queued()
            while self._sending:  # each batch that comes back sends the next of those waiting
                await asyncio.gather(*self._sending, return_exceptions=True)
        finally:
            # cancelled (a shutdown cut short): no batch starts after this, and no caller is left waiting
            self._closed = True
            if self._expiry is not None:
                self._expiry.cancel()
            for _, future, _ in self._queue:
                if not future.done():
                    future.set_exception(self._interrupted())
            self._queue = []


async def close_all(batchers: Iterable[TurnBatcher[Any]]) -> None:
    """aclose of each, at once: one type's stalled batches hold back no other type's shutdown."""
    await asyncio.gather(*(batcher.aclose() for batcher in batchers))
