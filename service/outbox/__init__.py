"""Delivering what this service owes the monolith's Celery workers: a transactional outbox and its relay.

messages          Message, Publisher, PublishResult: what a publisher is given and answers
outboxes          the two outbox tables (completion events, trial emails): claim, mark, park SQL; task ids
celery_publisher  Celery's own client, off the event loop, bounded and with a deadline (the default, both outboxes)
stream_publisher  EMAIL_PUBLISHER=redis-stream: the email outbox to a Redis stream instead
relay             the only publisher: claims unpublished rows, publishes, marks them; LISTEN/NOTIFY, polling, backoff
settle            what the broker answered, recorded: marks, retries after a backoff, parks; retried while leased

The writers (the flush upsert, the email reservation) write the rows in their own statements and
may call into this package; it never imports them.
"""
