"""progress-service: progress heartbeats into Redis, flushed to the shared Postgres."""
