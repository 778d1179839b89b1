"""The completion rule, written once: content is complete once the furthest position heard (the peak)
reaches its duration less the margin (PROGRESS_COMPLETION_MARGIN_SECONDS). The flush's upsert judges it in
SQL, the reads in Python, both from here; tests/progress/test_completion.py holds the two equal on Postgres."""


def completes(peak: float, duration_s: float, margin_s: float) -> bool:
    return peak >= duration_s - margin_s


def completes_sql(peak: str, duration: str, margin: str) -> str:
    """The same rule over three SQL expressions (float8 arithmetic, as Python's float)."""
    return f"{peak} >= {duration} - {margin}"
