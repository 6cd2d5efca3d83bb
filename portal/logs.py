"""Structured logs: one JSON object a line, with the tenant and trace id from the context.

Delivery code passes the record id with ``extra={"record_id": ...}``; tenant and trace id
come from the context variables, so every line written inside ``tenant_context`` carries them.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any

from portal.tenancy import current_tenant_id, current_trace_id

_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """Format a record as a single JSON line."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        tenant = current_tenant_id()
        if tenant is not None:
            entry["tenant_id"] = tenant
        trace = current_trace_id()
        if trace is not None:
            entry["trace_id"] = trace
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


# Libraries that log every request at INFO: the delivery loop's own line ("sent", with the
# record, tenant, provider and id) says it already, so theirs only doubled the lines (one more
# per SMS and per status callback) and cost the worker a formatted JSON line each: 10 % of an
# SMS's client CPU (bench/sms.py). Their warnings and errors still come through.
CHATTY = ("httpx", "httpcore")


def configure_logging(level: str = "INFO", stream: Any = None) -> None:
    """Send every logger's output to ``stream`` (stderr) as JSON lines (idempotent)."""
    root = logging.getLogger()
    for handler in root.handlers:
        if isinstance(handler.formatter, JsonFormatter):
            return
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter())
    root.addHandler(handler)
    root.setLevel(level.upper())
    if root.level > logging.DEBUG:  # at DEBUG, everything
        for name in CHATTY:
            logging.getLogger(name).setLevel(logging.WARNING)
