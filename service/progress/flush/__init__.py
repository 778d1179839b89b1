"""The buffer into Postgres: flusher (the loop of every pod) runs batch (one step per batch) over leases (claim, ack,
requeue), budget (the fleet's rows per second, shared with degraded mode) and store (the one upsert and its
completions); backlog (how much is pending), redis_persistence (what a Redis restart would lose)."""
