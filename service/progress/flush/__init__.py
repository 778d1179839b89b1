"""The buffer into Postgres: flusher (every pod's loop) runs batch over leases, budget and store (one upsert)."""
