"""Positions read back: reads (the freshest position: the buffered value, then the row) and sync (positions listened
offline, checked against what is stored and written through the same buffer with the time they were heard)."""
