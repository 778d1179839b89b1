"""The request path's writes: sink (Redis, or Postgres in degraded mode) over buffer (the one Lua script)."""
