"""Positions read back: reads (the buffered value, then the row) and sync (positions listened offline)."""
