"""Publishing to the monolith's Celery broker with Celery's own client, off the event loop.

The monolith's unchanged workers must run what we send, so the messages are Celery's: protocol 2,
JSON, an explicit queue and a stable task id. This module never imports the monolith: it knows
task names, not functions. Celery's client blocks on the network, so every publish runs in a small
thread pool, one batch per call, stopped between two messages at its deadline; the loop that awaits
it stays free.
"""

import asyncio
import contextvars
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

from service import tracing
from service.config import ConfigError, RelaySettings
from service.outbox.messages import Message, PublishResult
from service.stores import REDIS_UNAVAILABLE

log = logging.getLogger(__name__)


# SQS error codes that say "not now" rather than "never": the relay waits and retries them
_SQS_TRANSIENT_CODES = {"RequestThrottled", "ThrottlingException", "ServiceUnavailable", "InternalError",
                        "InternalFailure", "KmsThrottled", "RequestExpired"}  # fmt: skip
# Redis error replies that say "not now": a script running (BUSY), a dataset loading, a full broker,
# a replica after failover, a failed snapshot (MISCONF), a master or a cluster in failover
_REDIS_TRANSIENT_CODES = {"BUSY", "LOADING", "OOM", "READONLY", "MISCONF", "MASTERDOWN", "TRYAGAIN",
                          "CLUSTERDOWN"}  # fmt: skip


def _broker_reply(exc: BaseException) -> str | None:
    """What the broker answered, if it answered: "temporary" (wait, it passes), "refused" (this message), or None.

    kombu wraps a Redis error reply (NOPERM, BUSY, ...) in its OperationalError, the type it also uses for lost
    connections: the cause chain tells them apart. redis-py gives some replies a type of their own (the code taken
    off the message, kept in status_code) and leaves the others a plain ResponseError whose message starts with it.
    """
    from redis.exceptions import (
        BusyLoadingError,
        ClusterDownError,
        OutOfMemoryError,
        ReadOnlyError,
        ResponseError,
        TryAgainError,
    )

    seen: BaseException | None = exc
    for _ in range(10):  # a cause chain can loop back on itself
        if seen is None:
            break
        if isinstance(seen, (BusyLoadingError, OutOfMemoryError, ReadOnlyError, TryAgainError, ClusterDownError)):
            return "temporary"  # ClusterDownError covers MASTERDOWN
        if isinstance(seen, ResponseError):
            # in a pipeline (kombu's publish is one) redis-py puts "Command # 1 (...) of pipeline caused
            # error: " before the reply
            words = str(seen).rpartition("caused error: ")[2].split(maxsplit=1)
            code = str(getattr(seen, "status_code", None) or (words[0] if words else ""))
            return "temporary" if code.upper() in _REDIS_TRANSIENT_CODES else "refused"
        if type(seen).__name__ == "ClientError" and hasattr(seen, "response"):  # botocore, without importing it
            code = str(seen.response.get("Error", {}).get("Code", ""))
            return "temporary" if code in _SQS_TRANSIENT_CODES else "refused"
        seen = seen.__cause__ or seen.__context__
    return None


# without timeouts a blackholed Redis broker holds a publishing thread for minutes
_REDIS_TIMEOUTS = {"socket_timeout": 5.0, "socket_connect_timeout": 3.0}


class CeleryPublisher:
    """Owns the Celery app object and the threads that publish with it."""

    def __init__(self, settings: RelaySettings) -> None:
        from celery import Celery
        from kombu.exceptions import OperationalError

        broker_url, self.timeout_s = settings.broker_url, settings.publish_timeout_s
        check_transport(broker_url)
        self.app = Celery("progress-service", broker=broker_url, set_as_current=False)
        self.app.conf.update(
            broker_transport_options=(_REDIS_TIMEOUTS if urlsplit(broker_url).scheme in ("redis", "rediss") else {})
            | settings.broker_transport_options,
            task_serializer="json",
            task_protocol=2,
            # one quick retry covers a pooled connection gone stale (broker restarted); an outage is
            # the relay's to wait out, with backoff, not a thread's
            task_publish_retry_policy={"max_retries": 1, "interval_start": 0, "interval_step": 0.2},
            broker_connection_timeout=min(self.timeout_s, 4.0),
        )
        # what says "the broker is not reachable now" rather than "this message is refused"
        errors: list[type[BaseException]] = [OperationalError, *REDIS_UNAVAILABLE]
        try:
            from botocore.exceptions import ConnectionError as BotoConnectionError  # EndpointConnectionError's too

            errors.append(BotoConnectionError)
        except ImportError:  # the SQS extra is not installed
            pass
        self._connection_errors = tuple(errors)
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="celery-publish")

    async def publish(self, messages: Sequence[Message]) -> PublishResult:
        """Send `messages` in order; stop at the first connection error, or at the timeout after the message in hand.

        The timeout stops the thread at the next message boundary, and the call waits for it: what the broker
        took is always in the answer, so the relay marks it. A send in hand is never cut (whether the broker
        took it would be unknown): each of its round trips ends within the transport's socket timeout
        (_REDIS_TIMEOUTS on a Redis broker).
        """
        loop = asyncio.get_running_loop()
        stop = threading.Event()
        timer = loop.call_later(self.timeout_s, stop.set)
        # in the caller's context: the publish spans are children of the caller's span (the relay's batch)
        call = loop.run_in_executor(
            self._executor, contextvars.copy_context().run, self._publish_blocking, list(messages), stop
        )
        try:
            # shield: a cancelled caller stops the thread at the next message, not in the middle of one
            return await asyncio.shield(call)
        finally:
            timer.cancel()
            stop.set()

    def _publish_blocking(self, messages: list[Message], stop: threading.Event) -> PublishResult:
        result = PublishResult()
        try:
            with self.app.producer_or_acquire() as producer:
                for message in messages:
                    if stop.is_set():
                        result.unavailable = (
                            f"the broker took {len(result.sent)} of {len(messages)} messages in {self.timeout_s:g}s"
                        )
                        return result
                    try:
                        self._send(producer, message)
                    except Exception as exc:  # sorted below: refused (this message) or not now (all)
                        reply = _broker_reply(exc)
                        if reply == "temporary" or (reply is None and isinstance(exc, self._connection_errors)):
                            # an outage, however short: this and the rest of the batch wait for the relay
                            result.unavailable = f"{type(exc).__name__}: {exc}"[:1000]
                            return result
                        result.refused[message.row_id] = f"{type(exc).__name__}: {exc}"[:1000]
                    else:
                        result.sent.append(message.row_id)
        except self._connection_errors as exc:
            result.unavailable = f"{type(exc).__name__}: {exc}"
        return result

    def _send(self, producer: Any, message: Message) -> None:
        name, task_id, queue = message.task_name, message.task_id, message.queue
        with tracing.span(f"publish {name}", task_name=name, task_id=task_id, queue=queue):
            # the monolith's Celery instrumentation reads it from the message headers: its task joins this trace
            headers: dict[str, str] = {}
            tracing.inject(headers)
            self.app.send_task(
                name,
                kwargs=message.kwargs,
                task_id=task_id,
                queue=queue,
                producer=producer,
                retry=True,
                headers=headers,
            )

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        self.app.close()


# sqs:// needs the `sqs` extra installed; celery needs nothing more for the others
_SCHEMES = {"redis", "rediss", "amqp", "amqps", "pyamqp", "memory", "sqs"}


def check_transport(broker_url: str) -> None:
    """Fail at start-up, naming what to install, rather than at the first publish (in the relay's thread)."""
    from kombu.transport import resolve_transport  # kombu is imported only when a broker is used

    scheme = urlsplit(broker_url).scheme.split("+")[0]
    if scheme not in _SCHEMES:
        raise ConfigError(f"CELERY_BROKER_URL: unsupported transport {scheme!r} (use sqs://, redis:// or amqp://)")
    try:
        if scheme == "sqs":
            import boto3  # noqa: F401  # what kombu's SQS transport needs, imported by it only on first use
        # kombu imports a transport's module (and what it needs) only at the first connection
        resolve_transport(scheme)
    except ImportError as exc:
        hint = "pip install 'progress-service[sqs]'" if scheme == "sqs" else f"install the missing module ({exc.name})"
        raise ConfigError(f"CELERY_BROKER_URL uses {scheme}://, whose transport cannot load ({exc}): {hint}") from None
