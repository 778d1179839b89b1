"""Start-up and shutdown as one sequence: parts start in order and stop in reverse.

Each part is named as it starts, with what stops it; `aclose` stops them last-started first and
records the names in that order (`stopped`), so a test can hold the order that keeps the guarantees.
A stop that raises does not keep the others from stopping; its error comes out of `aclose`.
"""

from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from typing import Any


class Lifecycle:
    def __init__(self) -> None:
        self.started: list[str] = []
        self.stopped: list[str] = []
        self._stops = AsyncExitStack()

    def started_part(self, name: str, stop: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """`name` is running; `stop(*args)` stops it, after every part started later has stopped."""
        self.started.append(name)
        self._stops.push_async_callback(stop, *args)
        self._stops.callback(self.stopped.append, name)  # last in, first out: named as it begins to stop

    async def aclose(self) -> None:
        await self._stops.aclose()
