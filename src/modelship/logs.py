"""Log lines as JSON objects (`log_format: json`), one per line, for log pipelines.

Each object has the time, level, logger and message, the request's fields a caller passed
as `extra` (request_id, tenant, release, variant, status, ...), and the trace and span
ids of the span current where the line was logged (or passed as `trace_id`/`span_id`).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from opentelemetry import trace

# LogRecord's own attributes: everything else on a record came in `extra`.
_RECORD_FIELDS = frozenset(vars(logging.makeLogRecord({}))) | {
    "message",
    "asctime",
    "color_message",  # uvicorn's ANSI-colored copy of the message
}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        ctx = trace.get_current_span().get_span_context()
        if ctx.is_valid:
            entry["trace_id"] = f"{ctx.trace_id:032x}"
            entry["span_id"] = f"{ctx.span_id:016x}"
        for key, value in vars(record).items():
            if key not in _RECORD_FIELDS:
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def uvicorn_log_config() -> dict[str, Any] | None:
    """uvicorn's logging setup: its own (text) unless the root logger writes JSON, when its
    lines go to the root's handlers too (None: uvicorn configures nothing)."""
    import uvicorn.config

    if any(isinstance(h.formatter, JsonFormatter) for h in logging.getLogger().handlers):
        return None
    return uvicorn.config.LOGGING_CONFIG
