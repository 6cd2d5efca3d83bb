"""What a list page's request carries, read and checked: the filters of its query string
(``ListFilters``; the records lists' ``Filters``), a record id, and the ids a bulk form posts
(at most ``BULK_CAP``). Nothing here raises on what a person typed: each problem is kept by
field, to be shown beside it."""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, time, timedelta
from typing import Any, Self

from portal.messaging.records.retry import MAX_BULK
from portal.models import SendStatus

MAX_SEARCH_CHARS = 320  # the longest email address; anything longer is not a search we can do
MAX_TEMPLATE_CHARS = 100
MAX_ID = 2**63 - 1  # bigint: a larger id would make PostgreSQL raise instead of find nothing
BULK_CAP = MAX_BULK
STATUSES = [s.value for s in SendStatus]
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
_ID = re.compile(r"[1-9]\d{0,18}")


def has_control(text: str) -> bool:
    """Whether ``text`` holds a control character: no address, code or name has one, and
    PostgreSQL refuses a NUL in a query outright."""
    return any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in text)


def search_problem(text: str) -> str | None:
    """Why the search box's text cannot be searched for, or None: too long, or holding control
    characters (no address, number or subject has them, and PostgreSQL refuses a NUL in a
    query outright)."""
    if len(text) > MAX_SEARCH_CHARS:
        return f"Search for at most {MAX_SEARCH_CHARS} characters."
    if has_control(text):
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

    @classmethod
    def read(cls, source: Mapping[str, str], names: Iterable[str]) -> Self:
        """The fields ``names`` and the cursor ``before`` as typed, stripped; each is then
        checked by the list (``choice``, ``plain``, its own rules) and the cursor last."""
        return cls(raw={name: (source.get(name) or "").strip() for name in (*names, "before")})

    def choice(self, name: str, allowed: Collection[str], problem: str) -> str:
        """The field ``name`` when it is empty or one of ``allowed``; else "", and ``problem``."""
        value = self.raw[name]
        if value and value not in allowed:
            self.errors[name] = problem
            return ""
        return value

    def plain(self, name: str, max_chars: int, too_long: str, control: str) -> str:
        """The field ``name`` when it has at most ``max_chars`` characters and no control
        character; else "", and the problem (``too_long`` or ``control``)."""
        value = self.raw[name]
        if len(value) > max_chars or has_control(value):
            self.errors[name] = too_long if len(value) > max_chars else control
            return ""
        return value

    def code_text(self, name: str, what: str) -> str:
        """The field ``name``, a code (a template's, an error's: ``what`` names it, "A template
        code"): ``plain``, with at most ``MAX_TEMPLATE_CHARS`` characters."""
        return self.plain(
            name,
            MAX_TEMPLATE_CHARS,
            f"{what} has at most {MAX_TEMPLATE_CHARS} characters.",
            f"{what} has no control characters.",
        )

    def cursor(self) -> Self:
        """The keyset cursor ``before`` read (a list's own problems are named first)."""
        if self.raw.get("before"):
            self.before = parse_id(self.raw["before"])
            if self.before is None:
                self.errors["before"] = "That page link is broken: start again from the newest."
        return self


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
    filters = Filters.read(source, ("q", "status", "template", "tests", "from", "to"))
    raw, errors = filters.raw, filters.errors
    if problem := search_problem(raw["q"]):
        errors["q"] = problem
    else:
        filters.q = raw["q"]
    filters.status = filters.choice("status", STATUSES, "Choose a status from the list.")
    filters.template = filters.code_text("template", "A template code")
    filters.tests = filters.choice(
        "tests", ("hide", "only"), "Choose whether test sends are shown."
    )
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
    return filters.cursor()


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
