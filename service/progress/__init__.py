"""Playback positions: written on the request path (ingest/), flushed to Postgres (flush/), read back (read/)."""
