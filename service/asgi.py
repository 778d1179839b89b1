"""The ASGI callable types, for the pieces of middleware that speak ASGI directly, and the drain flag of `serve`."""

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# Set by `serve`'s server (service/serving.py) in the ASGI lifespan state when SIGTERM begins the drain. Each
# request's scope["state"] is a copy of that state taken as the request starts: every request begun since sees it.
DRAINING = "draining"


def draining(scope: Scope) -> bool:
    return bool(scope.get("state", {}).get(DRAINING, False))
