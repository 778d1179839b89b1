"""Limits uvicorn's httptools protocol does not have: the size and the arrival time of a request head.

httptools buffers a header of any size (10 MB headers are parsed and handed to the app), and a
client may send its headers a byte at a time for as long as it likes. This protocol counts the
bytes received while a request head is incomplete and answers 431 past MAX_HEADER_BYTES, and 408
when the head is not complete within HEADER_READ_TIMEOUT_S; both close the connection. Bodies
have their own deadline in the ingest path (10 s).

This overrides uvicorn's parser callbacks and reads what they collect (`url`, `headers`): uvicorn
gives httptools no such limits (uvicorn #157: "httptools does have a mechanism ... but we can't
change the value"). uvicorn is pinned below its next minor (pyproject.toml), and
tests/api/test_uvicorn_internals.py fails on a release that moves what is used here.
"""

import asyncio
import json

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

# the app's heads are well under 2 KiB (a JWT and a few headers); 16 KiB is h11's default limit
MAX_HEADER_BYTES = 16 * 1024
HEADER_READ_TIMEOUT_S = 10.0


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    _in_head = False
    _head_bytes = 0  # bytes of chunks that ended with the head still incomplete
    _oversized = False  # this message's head is over the limit: no app call, 431 once the chunk is parsed
    _head_deadline: asyncio.TimerHandle | None = None
    _head_began_in_chunk = False  # the chunk also held the end of the request before (pipelining)

    def data_received(self, data: bytes) -> None:
        self._head_began_in_chunk = False
        super().data_received(data)
        if self.transport.is_closing():
            return
        if self._in_head and not self._head_began_in_chunk:
            # a head still arriving: the whole chunk counts (a huge head never reaches the app). A
            # chunk in which the head began may be mostly the previous request's body: it is not
            # counted, so a pipelined request after a large body is not taken for a huge head (the
            # head is still measured once parsed, and every later chunk counts)
            self._head_bytes += len(data)
            self._oversized = self._head_bytes > MAX_HEADER_BYTES
        if self._oversized:
            self._refuse(b"431 Request Header Fields Too Large", f"request head larger than {MAX_HEADER_BYTES} bytes")
        elif self._in_head and self._head_deadline is None:
            # a head that goes on in a later chunk has its deadline from here (one that ends in its first chunk,
            # nearly every head, never needs a timer)
            self._head_deadline = self.loop.call_later(HEADER_READ_TIMEOUT_S, self._head_too_slow)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head, self._head_bytes, self._oversized = True, 0, False
        self._head_began_in_chunk = True

    def on_headers_complete(self) -> None:
        self._end_head()
        # a head that arrived in one chunk is measured here, once parsed (bounded by the read size)
        size = self._head_bytes + len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)
        if size > MAX_HEADER_BYTES:
            self._oversized = True
            return
        self.begin_request()

    def begin_request(self) -> None:
        """A head within the limits, whole: uvicorn's start of the request (its cycle, the ASGI app's task)."""
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self._oversized:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if not self._oversized:
            super().on_message_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._end_head()
        super().connection_lost(exc)

    def _head_too_slow(self) -> None:
        self._head_deadline = None
        if self._in_head and not self.transport.is_closing():
            self._refuse(b"408 Request Timeout", f"request head not received within {HEADER_READ_TIMEOUT_S:g} s")

    def _end_head(self) -> None:
        self._in_head = False
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _refuse(self, status: bytes, detail: str) -> None:
        self._end_head()
        body = json.dumps({"detail": detail}).encode()
        head = b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
        self.transport.write(head % (status, len(body)) + body)
        self.transport.close()
