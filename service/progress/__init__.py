"""Playback positions, by what flows through them: written on the request path, flushed to Postgres, read back.

content   the four kinds of content: their routes, bodies, tables
keys      every Redis key name, and how keys are sharded
batching  the calls of one event-loop turn in one round trip (the writes and the reads share it)
ingest/   the request path's writes: the buffer's script, or Postgres in degraded mode
flush/    the loop of every pod: the buffer into Postgres under one budget, acked only after commit
read/     the freshest position (the buffer, then the row) and the offline sync
"""
