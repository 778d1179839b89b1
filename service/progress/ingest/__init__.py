"""The request path's writes: sink (Redis, or Postgres in degraded mode) over buffer (the one Lua script, stamped by
Redis TIME); known_content (the door's snapshot of which content exists); redis_memory (how full the buffer is)."""
