"""A stand-in for the monolith's Celery workers: the two task names, each execution recorded in Postgres."""
