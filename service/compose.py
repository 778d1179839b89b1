"""What the lifespan (service/app.py) and the commands (service/cli.py) both compose from the builders beside each
class: the outbox routes, the trial-journey sweep, the Celery publisher. No HTTP here: the `relay` command loads none.
"""

import asyncio
from collections.abc import Coroutine
from typing import Any

import asyncpg

from service.auth import check_keys
from service.config import Settings
from service.lifecycle import Lifecycle
from service.outbox.celery_publisher import CeleryPublisher, check_transport
from service.outbox.messages import Publisher
from service.outbox.outboxes import COMPLETIONS, EMAILS
from service.outbox.relay import Route
from service.outbox.stream_publisher import StreamPublisher
from service.progress.flush.budget import FlushBudget
from service.redis_client import RedisClient
from service.trial_emails.batch import BatchOptions
from service.trial_emails.sweep import run_periodic_sweep


def check_startup(settings: Settings) -> None:
    """What `serve` refuses to start with: the token keys, the settings' own checks, the broker's transport."""
    check_keys(settings.auth)
    settings.check_can_serve()
    if settings.database_url and settings.celery_broker_url:  # the publisher start_services will build
        check_transport(settings.celery_broker_url)


def start_publisher(settings: Settings, lifecycle: Lifecycle) -> CeleryPublisher:
    """Celery's client for the monolith's broker; it stops off the loop (closing waits for a publish in flight)."""
    publisher = CeleryPublisher(settings.relay)
    lifecycle.started_part("celery publisher", asyncio.to_thread, publisher.close)
    return publisher


def completion_route(settings: Settings, publisher: Publisher) -> Route:
    return Route(COMPLETIONS, publisher, settings.completion_task_name, settings.completion_task_queue)


def email_route(settings: Settings, publisher: Publisher) -> Route:
    """`publisher` sends the email outbox where EMAIL_PUBLISHER says: Celery, or the trial-email stream."""
    return Route(EMAILS, publisher, settings.email_task_name, settings.email_task_queue)


def relay_routes(settings: Settings, redis: RedisClient, publisher: Publisher) -> list[Route]:
    emails: Publisher = publisher
    if settings.email_publisher == "redis-stream":
        emails = StreamPublisher(redis, settings.email_queue_stream)
    return [completion_route(settings, publisher), email_route(settings, emails)]


def periodic_sweep(
    settings: Settings, pool: asyncpg.Pool, stop: asyncio.Event, budget: FlushBudget
) -> Coroutine[Any, Any, None]:
    """`budget`: the pod's one write budget: the sweep's reservations are rows of the monolith's table too."""
    return run_periodic_sweep(
        pool=pool,
        options=BatchOptions(settings.send_email),
        interval_s=settings.trial_journey_interval_seconds,
        stop=stop,
        budget=budget,
    )
