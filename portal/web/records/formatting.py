"""How every page shows a record's values: times (UTC, to the second) and counts. ``init_app``
gives every template these, a status's label, why it cannot be retried and whether it has
expired: the dashboard and the dead-letter pages show records too."""

from __future__ import annotations

from datetime import UTC, datetime

from flask import Flask

from portal.messaging.records.diagnosis import refusal
from portal.web.records import explain
from portal.web.records.record_page import expired


def when(value: datetime | None) -> str:
    """A time as every record page shows it: UTC, to the second."""
    if value is None:
        return "—"
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")


def num(value: int) -> str:
    """A count with thousands separators."""
    return f"{value:,}"


def init_app(app: Flask) -> None:
    """The record helpers every page's templates may use."""
    app.add_template_filter(when, "when")
    app.add_template_filter(num, "num")
    app.add_template_global(explain.label, "status_label")
    app.add_template_global(refusal, "retry_refusal")
    app.add_template_global(expired, "record_expired")
