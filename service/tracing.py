"""OpenTelemetry traces, asked for by the standard OTEL_* variables and by nothing else.

Tracing is on when OTEL_TRACES_EXPORTER names an exporter (`otlp` or `console`), or when it is unset
and an OTLP endpoint is (OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT);
OTEL_SDK_DISABLED=true keeps it off. The SDK reads the other variables itself (the service name and
resource, the sampler, the batching, the exporter's headers and timeout). While it is off, `span`
hands back one shared object that does nothing and `inject` writes nothing: a call costs a call.

A pod never fails over tracing: without the `otel` extra, or asked for an exporter this module does
not build, it logs one warning and runs untraced. The spans go to this module's own provider, not
the global one, so FastAPI's own telemetry (the probes, /metrics) stays off.
"""

import asyncio
import logging
import os
import threading
from contextlib import AbstractContextManager, nullcontext
from typing import Any

log = logging.getLogger(__name__)

# a collector that does not answer holds the end of a shutdown this long, not the SDK's 30 s: tracing
# stops last, after every guarantee is kept, and only spans are left behind
SHUTDOWN_TIMEOUT_S = 5.0


class Span:
    """What a span is used for here; this one, the span while tracing is off, keeps nothing."""

    def set_attribute(self, key: str, value: Any) -> None:
        return None


# what `span` gives while tracing is off: one context, entered and left for nothing
_NO_SPAN: AbstractContextManager[Span] = nullcontext(Span())
_provider: Any = None  # the SDK's TracerProvider while tracing is on
_tracer: Any = None
_propagator: Any = None


def span(name: str, **attributes: Any) -> AbstractContextManager[Span]:
    """A span `name`, child of the current one, while tracing is on; an exception leaving it is recorded."""
    if _tracer is None:
        return _NO_SPAN
    return _tracer.start_as_current_span(name, attributes=attributes)  # type: ignore[no-any-return]


def inject(headers: dict[str, str]) -> None:
    """Write the current span's W3C `traceparent` (and `tracestate`) into `headers`, while tracing is on."""
    if _propagator is not None:
        _propagator.inject(headers)


def asked_for() -> str | None:
    """The exporter the environment asks for, or None: tracing stays off."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    exporter = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if not exporter and (
        os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    ):
        exporter = "otlp"
    return exporter if exporter not in ("", "none") else None


def configure() -> bool:
    """Start tracing if the OTEL_* variables ask for it; True when it is on (the caller then owns `aclose`)."""
    global _provider, _tracer, _propagator
    exporter = asked_for()
    if exporter is None:
        return False
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    except ImportError as exc:
        log.warning(
            "OTEL_* variables ask for traces, but the `otel` extra is not installed (%s): running untraced", exc
        )
        return False
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    if exporter not in ("otlp", "console") or (exporter == "otlp" and protocol not in (None, "http/protobuf")):
        log.warning(
            "OTEL_TRACES_EXPORTER=%s (protocol %s) is not one this service sends: otlp over http/protobuf, or "
            "console; running untraced",
            exporter,
            protocol,
        )
        return False
    resource = Resource.create()  # OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": "progress-service"}))
    provider = TracerProvider(resource=resource)  # the sampler: OTEL_TRACES_SAMPLER, OTEL_TRACES_SAMPLER_ARG
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter() if exporter == "otlp" else ConsoleSpanExporter()))
    _provider, _tracer = provider, provider.get_tracer("progress-service")
    _propagator = TraceContextTextMapPropagator()
    log.info("tracing on: %s spans of %s", exporter, resource.attributes["service.name"])
    return True


async def aclose() -> None:
    """Export the spans left (SHUTDOWN_TIMEOUT_S at most), then trace nothing more."""
    global _provider, _tracer, _propagator
    provider, _provider, _tracer, _propagator = _provider, None, None, None
    if provider is None:
        return
    # a daemon thread, so that an exit does not wait for it either once the timeout has passed
    exporting = threading.Thread(target=provider.shutdown, name="tracing-shutdown", daemon=True)
    exporting.start()
    await asyncio.to_thread(exporting.join, SHUTDOWN_TIMEOUT_S)
