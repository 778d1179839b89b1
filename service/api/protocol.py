"""`serve`'s HTTP protocol: the heartbeats and the reads answered below ASGI, everything else by uvicorn's cycle.

uvicorn answers a request through an ASGI cycle: a scope, `receive` and `send` coroutines, the body's
deadline, two messages to serialise and two socket writes. For a heartbeat that costs as much as the
route's own work. This protocol (uvicorn's httptools protocol with the head's limits of http_limits.py)
takes a request the route table answers without ASGI (`Routes.received_by`: a heartbeat's `POST`, a read's
`GET`), HTTP/1.1, no `Expect`, no other request of the connection in flight, whose body ends in the chunk
its head ended in: it hands the headers and the body to the route's own handler (the same code and the
same answers as its ASGI route) and writes the answer in one `transport.write`.

Every other request, one whose body goes on in a later chunk, and one whose body outgrows a heartbeat's
limit, is uvicorn's, unchanged: the body read so far goes into uvicorn's cycle, whose ASGI route reads the
rest under the body's deadline (408) and its limit (413).
What a request in flight shares with uvicorn's protocol is kept as uvicorn keeps it: `self.cycle`
(pipelined requests wait behind it, the shutdown and a lost connection reach it), the server's tasks
(the shutdown waits for them), the default headers (the date, the drain's `Connection: close`), the
keep-alive timer and the write flow control. tests/api/test_uvicorn_internals.py holds what is used;
tests/api/test_protocol.py sends each request both ways and compares the answers.
"""

import logging
from typing import Any

from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware
from uvicorn.protocols.http.httptools_impl import STATUS_LINE

from service.api.http import Answer, Headers, json_fields
from service.api.http_limits import LimitedHttpToolsProtocol
from service.api.ingest import ProgressIngest
from service.api.routes import Received, Routes

# uvicorn's answer when the application fails (or is cancelled at the end of a shutdown's grace), headers and all
_INTERNAL_ERROR_HEAD = [
    (b"content-type", b"text/plain; charset=utf-8"),
    (b"content-length", b"21"),
    (b"connection", b"close"),
]
_INTERNAL_ERROR_BODY = b"Internal Server Error"


class _Answering:
    """What uvicorn's protocol reads of the request in flight (`self.cycle`) for one answered here."""

    __slots__ = ("disconnected", "keep_alive", "response_complete")

    def __init__(self, keep_alive: bool) -> None:
        self.keep_alive = keep_alive  # the shutdown sets it False: the connection closes after the answer
        self.disconnected = False  # set when the connection is lost: nothing is written then
        self.response_complete = False

    @property
    def message_event(self) -> "_Answering":
        return self  # a lost connection wakes the cycle's `receive`: nothing waits in one here

    def set(self) -> None:
        pass


def _routes_of(app: Any) -> Routes | None:
    """The route table, if the app is the service's, under uvicorn's proxy headers at most: any other wrapper
    (a middleware, uvicorn's message logger) sees every request, so they all take uvicorn's cycle."""
    if isinstance(app, ProxyHeadersMiddleware):
        app = app.app
    return app if isinstance(app, Routes) else None


class ServiceProtocol(LimitedHttpToolsProtocol):
    _received: Received | None = None  # the handler of the request whose body is arriving, answered here
    _received_body = bytearray()  # its body so far (a new one per request)
    _keep_alive = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # a root path, a concurrency limit or uvicorn's access log written: uvicorn's cycle for every request
        logged = self.access_log and self.access_logger.isEnabledFor(logging.INFO)
        plain = not self.root_path and self.limit_concurrency is None and not logged
        self._routes = _routes_of(self.app) if plain else None

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._received is not None:  # the body goes on in a later chunk: uvicorn's cycle after all
            if self.transport.is_closing():
                self._received, self._received_body = None, bytearray()
            else:
                self._hand_over()

    def begin_request(self) -> None:
        routes = self._routes
        if (
            routes is not None
            and (self.cycle is None or self.cycle.response_complete)
            and not self.expect_100_continue
            and self.parser.get_http_version() == "1.1"
            and not self.parser.should_upgrade()
        ):
            received = routes.received_by(self.parser.get_method(), self.url)
            if received is not None:
                self._received, self._received_body = received, bytearray()
                self._keep_alive = self.parser.should_keep_alive()
                return
        super().begin_request()

    def on_body(self, body: bytes) -> None:
        if self._received is not None:
            if len(self._received_body) + len(body) <= ProgressIngest.max_body_bytes:
                self._received_body += body
                return
            self._hand_over()  # more than any heartbeat: uvicorn's cycle, whose route answers it (413)
        super().on_body(body)

    def on_message_complete(self) -> None:
        received = self._received
        if received is None:
            super().on_message_complete()
            return
        self._received, body, self._received_body = None, bytes(self._received_body), bytearray()
        cycle = _Answering(self._keep_alive)
        self.cycle = cycle  # type: ignore[assignment]
        task = self.loop.create_task(self._answer(cycle, received, self.headers, body))
        task.add_done_callback(self.tasks.discard)
        self.tasks.add(task)

    def _hand_over(self) -> None:
        body = bytes(self._received_body)
        self._received, self._received_body = None, bytearray()
        super().begin_request()  # the parser still holds this request's method, version and keep-alive
        if body:
            super().on_body(body)

    async def _answer(self, cycle: _Answering, received: Received, headers: Headers, body: bytes) -> None:
        answer: Answer | None
        try:
            answer = await received(headers, body)
        except BaseException as exc:  # as uvicorn's cycle: logged, and its plain 500
            self.logger.error("Exception in ASGI application\n", exc_info=exc)
            answer = None
            status, fields, content = 500, _INTERNAL_ERROR_HEAD, _INTERNAL_ERROR_BODY
        else:
            if answer is None:  # nothing to answer (a client gone mid-body: never a body that has all arrived)
                self.transport.close()
                return
            status, content, extra = answer
            fields = json_fields(content, extra)
        if self.flow.write_paused and not cycle.disconnected:
            await self.flow.drain()  # the client reads no answers: this one waits, and the next request behind it
        if cycle.disconnected:
            return
        self.transport.write(_message(cycle, status, [*self.server_state.default_headers, *fields], content))
        cycle.response_complete = True
        if not cycle.keep_alive:
            self.transport.close()
        self.on_response_complete()


def _message(cycle: _Answering, status: int, fields: Headers, content: bytes) -> bytes:
    """The answer as uvicorn's cycle writes it: its status line, the fields, `connection: close` when the
    connection is not kept (and the fields do not say so already), the content."""
    head = [STATUS_LINE[status]]
    closing = False
    for name, value in fields:
        if name == b"connection" and b"close" in [token.lower().strip() for token in value.split(b",")]:
            cycle.keep_alive = False
            closing = True
        head += (name, b": ", value, b"\r\n")
    if not cycle.keep_alive and not closing:
        head.append(b"connection: close\r\n")
    head += (b"\r\n", content)
    return b"".join(head)
