"""What a list page's request carries, read and checked: the filters of its query string
(``ListFilters``; the records lists' ``Filters``), a record id, and the ids a bulk form posts
(at most ``BULK_CAP``). Nothing here raises on what a person typed: each problem is kept by
field, to be shown beside it."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, time, timedelta
from typing import Any

from portal.messaging.records.retry import MAX_BULK
from portal.models import SendStatus

MAX_SEARCH_CHARS = 320  # the longest email address; anything longer is not a search we can do
MAX_TEMPLATE_CHARS = 100
MAX_ID = 2**63 - 1  # bigint: a larger id would make PostgreSQL raise instead of find nothing
BULK_CAP = MAX_BULK
STATUSES = [s.value for s in SendStatus]
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
_ID = re.compile(r"[1-9]\d{0,18}")


def search_problem(text: str) -> str | None:
    """Why the search box's text cannot be searched for, or None: too long, or holding control
    characters (no address, number or subject has them, and PostgreSQL refuses a NUL in a
    query outright)."""
    if len(text) > MAX_SEARCH_CHARS:
        return f"Search for at most {MAX_SEARCH_CHARS} characters."
    if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in text):
        return "Search for letters, digits and punctuation only (no control characters)."
    return None


@dataclass
class ListFilters:
    """A list page's filters as typed (to put back in the form) and their problems by field,
    with the keyset cursor ``before``; each list adds its own parsed fields."""

    before: int | None = None
    raw: dict[str, str] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)

    def args(self, **overrides: Any) -> dict[str, Any]:
        """The filter's query arguments (for links that keep it), without the cursor."""
        values = {k: v for k, v in self.raw.items() if v and k != "before"}
        return values | {k: v for k, v in overrides.items() if v is not None}

    @property
    def active(self) -> bool:
        return any(v for k, v in self.raw.items() if k != "before")


@dataclass
class Filters(ListFilters):
    """What the list shows: the search box, status, template, dates, and the keyset cursor."""

    q: str = ""
    status: str = ""
    template: str = ""
    tests: str = ""  # "" shows test sends, "hide" hides them, "only" shows only them
    date_from: date | None = None
    date_to: date | None = None


def parse_id(raw: str | None) -> int | None:
    """A positive bigint id from text, or None when it is not one."""
    raw = (raw or "").strip()
    if not _ID.fullmatch(raw):
        return None
    value = int(raw)
    return value if value <= MAX_ID else None


def parse_date(raw: str) -> date | None:
    if not _DATE.fullmatch(raw):
        return None
    try:
        return date.fromisoformat(raw)
    except ValueError:
        return None


def parse_filters(source: Mapping[str, str]) -> Filters:
    """Read and check the list's query (or a bulk form's copy of it); never raises."""
    raw = {
        name: (source.get(name) or "").strip()
        for name in ("q", "status", "template", "tests", "from", "to", "before")
    }
    filters = Filters(raw=raw)
    errors = filters.errors
    if problem := search_problem(raw["q"]):
        errors["q"] = problem
    else:
        filters.q = raw["q"]
    if raw["status"] and raw["status"] not in STATUSES:
        errors["status"] = "Choose a status from the list."
    else:
        filters.status = raw["status"]
    if len(raw["template"]) > MAX_TEMPLATE_CHARS:
        errors["template"] = f"A template code has at most {MAX_TEMPLATE_CHARS} characters."
    elif any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in raw["template"]):
        errors["template"] = "A template code has no control characters."
    else:
        filters.template = raw["template"]
    if raw["tests"] not in ("", "hide", "only"):
        errors["tests"] = "Choose whether test sends are shown."
    else:
        filters.tests = raw["tests"]
    for name in ("from", "to"):
        if raw[name]:
            parsed = parse_date(raw[name])
            if parsed is None:
                errors[name] = "Enter a real date, like 2025-03-31."
            elif name == "from":
                filters.date_from = parsed
            else:
                filters.date_to = parsed
    if filters.date_from and filters.date_to and filters.date_from > filters.date_to:
        errors["to"] = "The end date must be on or after the start date."
    if raw["before"]:
        filters.before = parse_id(raw["before"])
        if filters.before is None:
            errors["before"] = "That page link is broken: start again from the newest."
    return filters


def day_start(day: date) -> datetime:
    """The first instant of ``day`` (UTC)."""
    return datetime.combine(day, time.min, tzinfo=UTC)


def day_end(day: date) -> datetime:
    """The first instant after ``day`` (UTC): the exclusive end of a "to" date, which for the
    last day of the calendar is its last instant (there is no day after it)."""
    if day == date.max:
        return datetime.max.replace(tzinfo=UTC)
    return day_start(day + timedelta(days=1))


def parse_ids(values: Iterable[str]) -> tuple[list[int], str | None]:
    """Ids from checkboxes (one each) or a confirmation (comma-separated); error or None."""
    ids: list[int] = []
    for value in values:
        for part in value.split(","):
            if not part.strip():
                continue
            parsed = parse_id(part)
            if parsed is None:
                return [], "Those record ids are not valid: reload the page and select again."
            ids.append(parsed)
    ids = list(dict.fromkeys(ids))
    if len(ids) > BULK_CAP:
        return [], f"Select at most {BULK_CAP:,} records at a time."
    return ids, None


def parse_confirmed(value: str) -> tuple[list[int], dict[int, int], str | None]:
    """A cancel confirmation's ``id:version,id,...``: the ids, the versions, or an error."""
    ids: list[int] = []
    versions: dict[int, int] = {}
    broken = "That confirmation is not valid: select the records again."
    for part in value.split(","):
        part = part.strip()
        if not part:
            continue
        raw_id, sep, raw_version = part.partition(":")
        record_id = parse_id(raw_id)
        if record_id is None:
            return [], {}, broken
        if sep:
            version = parse_id(raw_version) if raw_version != "0" else 0
            if version is None or version > 2**31 - 1:
                return [], {}, broken
            versions[record_id] = version
        ids.append(record_id)
    ids = list(dict.fromkeys(ids))
    if len(ids) > BULK_CAP:
        return [], {}, f"Select at most {BULK_CAP:,} records at a time."
    return ids, versions, None
