"""`serve`'s HTTP server: uvicorn, with a drain between SIGTERM and the stop.

uvicorn stops listening and closes idle keep-alive connections as soon as SIGTERM arrives, while the load
balancer still sends requests until its health check sees the pod down: those requests fail (502/503, or
an EOF in the client). A pod stopped this way drains first:

1. SIGTERM: `/health/ready` answers 503 at once (service/api/health.py reads `DRAINING`), and every answer carries
   `Connection: close`, so each client leaves its connection after its next answer.
2. For `drain_s` the pod goes on serving whatever still comes, new connections included.
3. Then uvicorn's own shutdown: stop listening, close the idle connections, finish the requests in flight, run the
   lifespan's shutdown (the final flush).

SIGINT (Ctrl-C) skips the drain, and cuts one short. With `--workers N` every worker drains, all at once.
uvicorn has no such delay (its open pull request #2414 would give one: drop this then). What this takes from
uvicorn's internals is held in place by tests/api/test_uvicorn_internals.py; uvicorn is pinned below its next minor.
"""

import logging
import os
import signal
import sys
import time
from types import FrameType
from typing import Any

import uvicorn
from uvicorn.config import STARTUP_FAILURE
from uvicorn.supervisors import multiprocess

from service.asgi import DRAINING

log = logging.getLogger(__name__)

_CONNECTION_CLOSE = (b"connection", b"close")


class ServeConfig(uvicorn.Config):
    """uvicorn's config and the drain's length; pickled whole into each worker of `--workers N`."""

    def __init__(self, app: str, *, drain_s: float, **options: Any) -> None:
        super().__init__(app, **options)
        self.drain_s = drain_s


class DrainingServer(uvicorn.Server):
    def __init__(self, config: ServeConfig) -> None:
        super().__init__(config)
        self.drain_s = config.drain_s
        self._drain_ends_at: float | None = None  # time.monotonic() once SIGTERM has begun the drain
        self._drain_logged = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler: it only swaps flags and lists, no logging (a lock the interrupted code may hold);
        # main_loop's tick, every 0.1 s, does the rest. Before the server listens there is nothing to drain.
        if sig != signal.SIGTERM or self.drain_s <= 0 or not self.started or self.should_exit:
            super().handle_exit(sig, frame)
            return
        if self._drain_ends_at is not None:
            return  # a second SIGTERM (a supervisor's after a process group's) changes nothing
        self._drain_ends_at = time.monotonic() + self.drain_s
        self.lifespan.state[DRAINING] = True
        # the headers of every answer begun from now: the running ones now, the refreshed ones every second
        self.config.encoded_headers = [*self.config.encoded_headers, _CONNECTION_CLOSE]
        self.server_state.default_headers = [*self.server_state.default_headers, _CONNECTION_CLOSE]

    async def on_tick(self, counter: int) -> bool:
        should_exit = await super().on_tick(counter)
        if should_exit or self._drain_ends_at is None:
            return should_exit
        if not self._drain_logged:
            self._drain_logged = True
            log.info(
                "SIGTERM: draining for %g s (readiness 503, Connection: close on every answer), then stopping [%d]",
                self.drain_s,
                os.getpid(),
            )
        if time.monotonic() < self._drain_ends_at:
            return False
        log.info("drain over after %g s: no new connections now; the requests in flight finish", self.drain_s)
        super().handle_exit(signal.SIGTERM, None)  # what uvicorn does at the signal (it raises it again at the end)
        return True


class _DrainingWorker(multiprocess.Process):
    """A worker process of `--workers N`: uvicorn's own, serving with a DrainingServer."""

    @property
    def server(self) -> uvicorn.Server:
        if self._server is None:
            assert isinstance(self.config, ServeConfig)
            self._server = DrainingServer(self.config)
        return self._server


def run(config: ServeConfig) -> None:
    """Serve until SIGTERM (drained) or SIGINT; exit STARTUP_FAILURE if the server never started, as uvicorn.run."""
    if config.workers <= 1:
        server = DrainingServer(config)
        server.run()
        if not server.started:
            sys.exit(STARTUP_FAILURE)
        return
    # uvicorn's supervisor makes its workers from its module's `Process`, with no way to pass another. This
    # process is only that supervisor from here on: every worker it starts, restarts included, drains.
    multiprocess.Process = _DrainingWorker  # type: ignore[misc]
    multiprocess.Multiprocess(config, sockets=[config.bind_socket()]).run()
