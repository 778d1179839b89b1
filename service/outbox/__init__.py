"""Delivering what this service owes the monolith's Celery workers: a transactional outbox and its relay, the only
publisher. The writers (the flush upsert, the email reservation) write the rows in their own statements and may call
into this package; it never imports them.
"""
