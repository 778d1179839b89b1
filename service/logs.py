"""One JSON object per log line, so a log pipeline can filter by level, logger or content type."""

import json
import logging
import sys
from datetime import UTC, datetime

# Context a log call may pass with `extra=`; anything else on the record is logging's own.
CONTEXT_FIELDS = ("request_id", "content_type", "batch_size", "key", "pairs", "error", "pod", "count")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "message": record.getMessage(),
            "logger": record.name,
        }
        for field in CONTEXT_FIELDS:
            value = record.__dict__.get(field)
            if value is not None:
                entry[field] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
    # one line per request at INFO would be one line per heartbeat
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)
