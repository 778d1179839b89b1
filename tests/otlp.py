"""A collector's OTLP/HTTP traces endpoint on 127.0.0.1, for the tracing tests: it keeps every span it is sent.

with receiving_traces() as receiver:
    ... OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint ...
    receiver.spans  # [ReceivedSpan(name, trace_id, span_id, parent_span_id, attributes, service_name)]
"""

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass(frozen=True)
class ReceivedSpan:
    name: str
    trace_id: str  # 32 hex digits, as in a traceparent
    span_id: str  # 16 hex digits
    parent_span_id: str  # "" for a root span
    attributes: dict[str, Any]
    service_name: str


def _value(any_value: Any) -> Any:
    return getattr(any_value, any_value.WhichOneof("value"))


def decode(body: bytes) -> list[ReceivedSpan]:
    request = ExportTraceServiceRequest.FromString(body)
    spans = []
    for resource_spans in request.resource_spans:
        resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(
                    ReceivedSpan(
                        span.name,
                        span.trace_id.hex(),
                        span.span_id.hex(),
                        span.parent_span_id.hex(),
                        {a.key: _value(a.value) for a in span.attributes},
                        str(resource.get("service.name", "")),
                    )
                )
    return spans


class Receiver:
    def __init__(self, server: ThreadingHTTPServer) -> None:
        self.endpoint = f"http://127.0.0.1:{server.server_address[1]}"
        self.spans: list[ReceivedSpan] = []
        self.posts: list[str] = []  # the paths posted to

    def named(self, name: str) -> list[ReceivedSpan]:
        return [span for span in self.spans if span.name == name]


@contextmanager
def receiving_traces() -> Iterator[Receiver]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            receiver.posts.append(self.path)
            if self.path == "/v1/traces":
                receiver.spans.extend(decode(body))
            answer = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200 if self.path == "/v1/traces" else 404)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args: object) -> None:
            return None

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    receiver = Receiver(server)
    thread = threading.Thread(target=server.serve_forever, name="otlp-receiver", daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
