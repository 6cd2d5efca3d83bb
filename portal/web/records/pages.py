"""The record pages of either channel: search, filters, keyset pages, detail, retry (one and bulk)
and bulk cancel, written once with a channel parameter (``Kind``).

``mail_records`` and ``sms_records`` each give their ``Kind`` (model, search, list columns) and
their blueprint's views, which call the bodies here. Support staff's main tool is the search
box; what it searches is the channel's own (``Kind.search``).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, date, datetime, time, timedelta
from typing import Any, TypeVar

from flask import (
    Flask,
    abort,
    current_app,
    flash,
    has_request_context,
    make_response,
    redirect,
    render_template,
    request,
    url_for,
)
from flask.typing import ResponseReturnValue
from flask_login import current_user
from sqlalchemy import ColumnElement, Select, func, select, tuple_
from sqlalchemy.orm import load_only
from werkzeug.datastructures import MultiDict

from portal.extensions import db
from portal.messaging.records import cancel, diagnosis
from portal.messaging.records.diagnosis import Diagnosis, refusal
from portal.messaging.records.diagnosis.reasons import REASON_LABEL, Reason
from portal.messaging.records.retry import (
    MAX_BULK,
    Model,
    new_expiry,
    resend_as_new,
    retry_records,
)
from portal.messaging.records.validation import AcceptanceError
from portal.models import (
    AuditAction,
    Channel,
    DeadLetterMessage,
    MailSendServerConfig,
    Role,
    SendStatus,
    SmsProviderConfig,
    Tenant,
)
from portal.models.enums import RETRYABLE_BY_HAND
from portal.tenancy import PLATFORM_TENANT_ID, names_config
from portal.web.access import actor_label, audit, is_operator, viewed_tenant
from portal.web.forms import is_htmx
from portal.web.records import explain
from portal.web.records.timeline import timeline
from portal.web.security import safe_next

PAGE_SIZE = 50
MAX_SEARCH_CHARS = 320  # the longest email address; anything longer is not a search we can do


def search_problem(text: str) -> str | None:
    """Why the search box's text cannot be searched for, or None: too long, or holding control
    characters (no address, number or subject has them, and PostgreSQL refuses a NUL in a
    query outright)."""
    if len(text) > MAX_SEARCH_CHARS:
        return f"Search for at most {MAX_SEARCH_CHARS} characters."
    if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in text):
        return "Search for letters, digits and punctuation only (no control characters)."
    return None


MAX_TEMPLATE_CHARS = 100
MAX_ID = 2**63 - 1  # bigint: a larger id would make PostgreSQL raise instead of find nothing
BULK_CAP = MAX_BULK
AUDIT_IDS_LISTED = 50  # of the records a bulk action changed, its audit remark names this many
# A subject search has no index to walk (ILIKE '%x%'), so each page reads at most this many of
# the newest records (by the tenant's id index) and offers "Older" to go on from there.
SUBJECT_WINDOW = 20_000
RETRYABLE = frozenset(s.value for s in RETRYABLE_BY_HAND)
STATUSES = [s.value for s in SendStatus]
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
_ID = re.compile(r"[1-9]\d{0,18}")


# --- filters ------------------------------------------------------------------------------


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


# --- what differs per channel ---------------------------------------------------------------


@dataclass(frozen=True)
class Search:
    """The conditions a search box adds, and (subject search) where its window stops."""

    clauses: list[ColumnElement[bool]]
    description: str
    floor: int | None = None  # the oldest id the window reached; None: it reached the end


@dataclass(frozen=True)
class Kind:
    """One channel's record pages: its blueprint, model, search and list columns, and the
    configs (servers, providers) its records are sent through."""

    blueprint: str
    model: Model
    channel: Channel
    config: type[MailSendServerConfig] | type[SmsProviderConfig]
    platform_service: str  # what a tenant sees instead of a platform-tier config's name
    title: str
    noun: str
    search_label: str
    search_hint: str
    preview_heading: str
    search: Callable[[str, int | None, int | None], Search]
    list_columns: tuple[str, ...]

    @property
    def row_prefix(self) -> str:
        return f"{self.blueprint.replace('_', '-')}-row-"

    def endpoint(self, view: str) -> str:
        return f"{self.blueprint}.{view}"


def tenant_scope(column: Any, tenant: int | None) -> ColumnElement[bool]:
    """``column`` restricted to ``tenant``; for all tenants, to every tenant id.

    "Every tenant id" is not a no-op: it lets an index that starts with tenant_id serve a
    search across tenants (one range scan per tenant) instead of a full scan.
    """
    if tenant is None:
        return column.in_(select(Tenant.id))  # type: ignore[no-any-return]
    return column == tenant  # type: ignore[no-any-return]


# What every list row needs, whatever the channel; the heavy columns (bodies) stay unloaded.
COMMON_LIST_COLUMNS = (
    "id",
    "tenant_id",
    "status",
    "retry_count",
    "error_code",
    "error_message",
    "template_code",
    "created_time",
    "ambiguous_attempt",  # its Retry asks first (a duplicate is possible)
    "expires_at",  # its Retry asks for a new expiry
    "is_test",  # the row's "Test" pill: left out, each row loaded it in a query of its own
)


# --- queries ----------------------------------------------------------------------------------


def visible(kind: Kind, ids: Iterable[int], tenant: int | None, *columns: Any) -> Select[Any]:
    """The one way ids from a request become records: ``select(*columns)`` (the records
    themselves by default) of those among ``ids`` that belong to ``tenant``, the viewed tenant
    (None: an operator looking at every tenant, as the lists do).

    Every id->row query of the record pages goes through here, so another tenant's id finds
    nothing, exactly like an id that does not exist.
    """
    model = kind.model
    stmt: Select[Any] = select(*columns) if columns else select(model)
    stmt = stmt.where(model.id.in_(list(ids)))
    if tenant is not None:
        stmt = stmt.where(model.tenant_id == tenant)
    return stmt


def conditions(
    kind: Kind, filters: Filters, tenant: int | None
) -> tuple[list[ColumnElement[bool]], Search | None]:
    """The WHERE of a filtered list (without the cursor)."""
    model = kind.model
    where: list[ColumnElement[bool]] = []
    if tenant is not None:
        where.append(model.tenant_id == tenant)
    if filters.status:
        where.append(model.status == filters.status)
    if filters.template:
        where.append(model.template_code == filters.template)
    if filters.tests:
        where.append(model.is_test.is_(filters.tests == "only"))
    if filters.date_from:
        where.append(model.created_time >= day_start(filters.date_from))
    if filters.date_to:
        where.append(model.created_time < day_end(filters.date_to))
    search = kind.search(filters.q, tenant, filters.before) if filters.q else None
    if search is not None:
        where.extend(search.clauses)
    return where, search


@dataclass
class RecordPage:
    rows: Sequence[Any]
    older: int | None  # the cursor of the next (older) page, None on the last
    search: Search | None
    tenant_names: dict[int, str]


def tenant_names(tenant: int | None) -> dict[int, str]:
    """Tenant names for the "all tenants" view (a short table: read it whole)."""
    if tenant is not None:
        return {}
    rows = db.session.execute(select(Tenant.id, Tenant.name)).all()
    return {tid: ("Platform tier" if tid < 0 else name) for tid, name in rows}


def list_page(kind: Kind, filters: Filters, tenant: int | None) -> RecordPage:
    """One page of matching records, newest first (keyset on id: no OFFSET, any depth).

    Between dates (and no search) the page is newest first by creation time, ties by id, and
    the cursor's record gives the position: the dates are then a range of ``idx_*_created``.
    By id, PostgreSQL walked the primary key back from today to the dates' newest record
    ("a week two months ago" at 1M: 614,000 rows read, 350 ms; by creation time 52, 0.5 ms).
    Ids follow creation times only nearly (a transaction's records share its start time), so
    no id range stands for the dates exactly. The cursor's record is read under the list's
    own conditions (its tenant, its dates): another tenant's id positions nothing.
    """
    model = kind.model
    where, search = conditions(kind, filters, tenant)
    stmt: Select[Any] = select(model).options(
        load_only(*(getattr(model, c) for c in COMMON_LIST_COLUMNS + kind.list_columns))
    )
    order: list[Any] = [model.id.desc()]
    if (filters.date_from or filters.date_to) and search is None:
        order = [model.created_time.desc(), model.id.desc()]
        if filters.before is not None:
            at = (
                select(model.created_time)
                .where(model.id == filters.before, *where)
                .scalar_subquery()
            )
            stmt = stmt.where(
                model.created_time <= at,
                tuple_(model.created_time, model.id) < tuple_(at, filters.before),
            )
    elif filters.before is not None:
        stmt = stmt.where(model.id < filters.before)
    rows = db.session.scalars(stmt.where(*where).order_by(*order).limit(PAGE_SIZE + 1)).all()
    if len(rows) > PAGE_SIZE:
        older: int | None = rows[PAGE_SIZE - 1].id
    else:
        older = search.floor if search is not None else None
    return RecordPage(rows[:PAGE_SIZE], older, search, tenant_names(tenant))


def find_record(kind: Kind, record_id: int, tenant: int | None) -> Any:
    """The record, if the viewer may see it; 404 otherwise (another tenant's included)."""
    if record_id > MAX_ID:
        abort(404)
    record = db.session.scalar(visible(kind, [record_id], tenant))
    if record is None:
        abort(404)
    return record


def pretty_json(value: Any) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True, default=str)


@dataclass(frozen=True)
class ConfigName:
    """How a record page names the server or provider a record names."""

    name: str
    platform: bool  # the platform tier's, named to a tenant only as "platform ... service"
    hidden: bool  # so its name, id and kind are not shown (a tenant looking)


def config_names(kind: Kind, record: Any, ids: Iterable[int | None]) -> dict[int, ConfigName]:
    """The names of the configs ``ids`` a record of ``record.tenant_id`` names: its own
    tenant's and the platform tier's (the only ones it can be sent through).

    The platform tier's rows are invisible to tenants (DESIGN, "Tenancy and roles"): a tenant
    sees "platform mail service" (or SMS) instead of the name; operators see the real one. The
    rule, by the config's tier and not the record's scope, is ``serialise.names_config``.
    """
    wanted = {i for i in ids if i is not None}
    if not wanted:
        return {}
    config = kind.config
    rows = db.session.execute(
        select(config.id, config.tenant_id, config.name).where(
            config.id.in_(wanted),
            config.tenant_id.in_([record.tenant_id, PLATFORM_TENANT_ID]),
        )
    ).all()
    operator = is_operator()
    names = {}
    for config_id, tenant_id, name in rows:
        platform = tenant_id == PLATFORM_TENANT_ID and record.tenant_id != PLATFORM_TENANT_ID
        hidden = not names_config(tenant_id, operator)
        names[config_id] = ConfigName(kind.platform_service if hidden else name, platform, hidden)
    return names


# --- bulk retry -------------------------------------------------------------------------------


@dataclass
class StatusLine:
    status: str
    count: int
    reason: str | None  # None: it will be requeued


@dataclass
class RetryPlan:
    """What "Retry" would do to a set of ids, counted by status, without changing anything."""

    ids: list[int]
    requeue: int
    skip: int
    lines: list[StatusLine]
    capped: bool = False
    ambiguous: int = 0  # of those requeued, how many had an ambiguous attempt (may go twice)
    expired: int = 0  # of the retryable ones, how many are past their expiry (skipped)
    reasons: list[ReasonGroup] = field(default_factory=list)  # those that would fail again
    groups: list[CodeGroup] = field(default_factory=list)  # the others, by error code
    blocked: int = 0  # of the retryable ones, how many would fail again (left out by default)
    tenants: list[tuple[str, int]] = field(default_factory=list)  # all-tenants view: per tenant
    needs_all_tenants: bool = False  # confirming needs the explicit "all tenants" choice
    scope: str = "selected"


@dataclass
class ReasonGroup:
    """Retryable records that would fail again for one reason (``diagnosis.Reason``)."""

    reason: Reason
    count: int
    whys: list[tuple[str, int]]  # (why, and what to change first; how many)

    @property
    def label(self) -> str:
        return REASON_LABEL[self.reason]


@dataclass
class CodeGroup:
    """Retryable records with one error code that nothing found stops."""

    code: str
    count: int


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


def matching_ids(kind: Kind, filters: Filters, tenant: int | None) -> tuple[list[int], bool]:
    """The newest BULK_CAP ids matching the filter (every page, not just this one)."""
    unpaged = replace(filters, before=None)
    where, _ = conditions(kind, unpaged, tenant)
    ids = list(
        db.session.scalars(
            select(kind.model.id).where(*where).order_by(kind.model.id.desc()).limit(BULK_CAP + 1)
        )
    )
    return ids[:BULK_CAP], len(ids) > BULK_CAP


def plan_retry(kind: Kind, ids: Sequence[int], tenant: int | None) -> RetryPlan:
    """Count the ids by status: which would be requeued, which skipped and why; those that
    would fail again (their diagnosis) are counted by reason and left out unless asked."""
    model = kind.model
    stmt = visible(kind, ids, tenant, model.status, func.count()).group_by(model.status)
    counts: dict[str, int] = {status: n for status, n in db.session.execute(stmt)}
    lines = [
        StatusLine(status, counts[status], refusal(status))
        for status in sorted(counts, key=lambda s: (refusal(s) is not None, s))
    ]
    missing = len(ids) - sum(counts.values())
    if missing:
        lines.append(StatusLine("", missing, "no such record"))
    found = retryable_diagnoses(kind, ids, tenant)
    blocked = {i: d for i, d in found.items() if d.would_fail_again}
    if blocked:
        # A status's line counts only those requeued; the rest get a line of their own.
        held = Counter(status for _, status in found_statuses(kind, blocked, tenant))
        split: list[StatusLine] = []
        for line in lines:
            n = held.get(line.status, 0) if line.reason is None else 0
            if line.count - n:
                split.append(replace(line, count=line.count - n))
            if n:
                split.append(StatusLine(line.status, n, FAIL_AGAIN))
        lines = split
    requeue = sum(line.count for line in lines if line.reason is None)
    return RetryPlan(
        list(ids),
        requeue,
        len(ids) - requeue,
        lines,
        ambiguous=sum(1 for i, d in found.items() if d.ambiguous and i not in blocked),
        expired=sum(1 for d in blocked.values() if d.reason is Reason.EXPIRED),
        reasons=reason_groups(blocked),
        groups=code_groups(kind, [i for i in found if i not in blocked], tenant),
        blocked=len(blocked),
    )


FAIL_AGAIN = "left out: it would fail again (see below)"


def diagnoses(kind: Kind, records: Sequence[Any]) -> dict[int, Diagnosis]:
    """The records' diagnoses (the viewer's records, already scoped), as this viewer may
    read them: a platform operator sees the platform's servers by name."""
    settings = current_app.config["SETTINGS"]
    operator = viewer_role() == Role.PLATFORM_OPERATOR
    return diagnosis.diagnose_many(db.session(), kind.channel, records, settings, operator=operator)


def retryable_diagnoses(kind: Kind, ids: Sequence[int], tenant: int | None) -> dict[int, Diagnosis]:
    """Of ``ids`` (the viewer's), the retryable ones' diagnoses."""
    records = list(
        db.session.scalars(visible(kind, ids, tenant).where(kind.model.status.in_(RETRYABLE)))
    )
    return diagnoses(kind, records)


def blocked_ids(kind: Kind, ids: Sequence[int], tenant: int | None) -> dict[int, Diagnosis]:
    """Of ``ids`` (the viewer's), the retryable ones a retry now would not cure: their
    diagnosis says it would fail again (the causes as they are, not the status)."""
    found = retryable_diagnoses(kind, ids, tenant)
    return {i: d for i, d in found.items() if d.would_fail_again}


def found_statuses(kind: Kind, ids: Iterable[int], tenant: int | None) -> list[tuple[int, str]]:
    model = kind.model
    return [
        (int(i), str(status))
        for i, status in db.session.execute(visible(kind, ids, tenant, model.id, model.status))
    ]


def reason_groups(blocked: Mapping[int, Diagnosis]) -> list[ReasonGroup]:
    """Those that would fail again, by reason, the commonest first; each reason with its
    particular whys (one per server, template, tier ...)."""
    by_reason: dict[Reason, Counter[str]] = {}
    for found in blocked.values():
        if found.reason is None or found.why is None:
            continue  # not one that would fail again
        by_reason.setdefault(found.reason, Counter())[found.why] += 1
    groups = [
        ReasonGroup(reason, sum(whys.values()), whys.most_common())
        for reason, whys in by_reason.items()
    ]
    groups.sort(key=lambda g: (-g.count, g.reason.value))
    return groups


def code_groups(kind: Kind, ids: Sequence[int], tenant: int | None) -> list[CodeGroup]:
    """The retryable ones nothing found stops, by error code."""
    if not ids:
        return []
    model = kind.model
    rows = db.session.execute(visible(kind, ids, tenant, model.error_code))
    counts = Counter(code or "" for (code,) in rows)
    return [CodeGroup(code, n) for code, n in sorted(counts.items(), key=lambda c: (-c[1], c[0]))]


def tenant_counts(kind: Kind, ids: Sequence[int]) -> list[tuple[str, int]]:
    """How many of ``ids`` each tenant holds, by name (the all-tenants view's bulk actions)."""
    model = kind.model
    stmt = visible(kind, ids, None, model.tenant_id, func.count()).group_by(model.tenant_id)
    names = tenant_names(None)
    counts = [(names.get(tid, f"tenant {tid}"), int(n)) for tid, n in db.session.execute(stmt)]
    return sorted(counts, key=lambda c: (-c[1], c[0]))


def skipped_summary(skipped: Mapping[int, str]) -> list[tuple[str, int]]:
    """Skipped ids grouped by reason, the commonest first."""
    return Counter(skipped.values()).most_common()


# --- bulk cancel ------------------------------------------------------------------------------


@dataclass
class CancelPlan:
    """What "Cancel" would do to a set of ids, without changing anything: the versions seen
    (the cancellable ones') go into the confirmation, so the cancel takes exactly those."""

    ids: list[int]
    versions: dict[int, int]  # cancellable ids -> the version seen now
    lines: list[StatusLine]
    capped: bool = False
    tenants: list[tuple[str, int]] = field(default_factory=list)
    needs_all_tenants: bool = False
    scope: str = "selected"

    @property
    def cancel(self) -> int:
        return len(self.versions)

    @property
    def keep(self) -> int:
        return len(self.ids) - len(self.versions)

    @property
    def confirmed(self) -> str:
        """``id:version`` for each cancellable id, the bare id for the others."""
        return ",".join(
            f"{i}:{self.versions[i]}" if i in self.versions else str(i) for i in self.ids
        )


def plan_cancel(kind: Kind, ids: Sequence[int], tenant: int | None) -> CancelPlan:
    """Which of the ids can be cancelled now (Pending or Retry, no ambiguous attempt) and why
    the others cannot, counted by status."""
    model = kind.model
    stmt = visible(
        kind, ids, tenant, model.id, model.status, model.ambiguous_attempt, model.version
    )
    versions: dict[int, int] = {}
    counts: Counter[tuple[str, str | None]] = Counter()
    for record_id, status, ambiguous, version in db.session.execute(stmt):
        reason = cancel.cancellable(status, bool(ambiguous))
        if reason is None:
            versions[record_id] = version
        counts[(status, reason)] += 1
    lines = [
        StatusLine(status, n, reason)
        for (status, reason), n in sorted(
            counts.items(), key=lambda item: (item[0][1] is not None, item[0][0])
        )
    ]
    missing = len(ids) - sum(counts.values())
    if missing:
        lines.append(StatusLine("", missing, "no such record"))
    return CancelPlan(list(ids), versions, lines)


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


@dataclass
class CancelOutcome:
    """Step two's answer: what happened to each record, in three plain groups."""

    cancelled: list[int]
    claimed: list[tuple[int, str]]  # a worker got there first: (id, what it is now)
    refused: list[tuple[str, int]]  # never cancellable: (reason, how many)

    @property
    def text(self) -> str:
        """The no-JavaScript flash."""
        parts = [f"{len(self.cancelled):,} cancelled"]
        if self.claimed:
            ids = ", ".join(str(i) for i, _ in self.claimed[:20])
            more = "…" if len(self.claimed) > 20 else ""
            parts.append(
                f"{len(self.claimed):,} not cancelled because a worker claimed it first "
                f"(record {ids}{more})"
            )
        if self.refused:
            total = sum(n for _, n in self.refused)
            reasons = " · ".join(f"{n:,}: {reason}" for reason, n in self.refused)
            parts.append(f"{total:,} not cancellable ({reasons})")
        return "; ".join(parts) + "."


def cancel_outcome(report: cancel.CancelReport) -> CancelOutcome:
    claimed = set(report.claimed)
    return CancelOutcome(
        cancelled=report.cancelled,
        claimed=[(i, report.skipped[i]) for i in report.claimed],
        refused=skipped_summary({i: r for i, r in report.skipped.items() if i not in claimed}),
    )


PlanT = TypeVar("PlanT", RetryPlan, CancelPlan)


# --- template helpers (app-wide: the dashboard and dead-letter pages show records too) -----


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


# --- the views' shared bodies ------------------------------------------------------------------


def index_view(kind: Kind) -> ResponseReturnValue:
    tenant = viewed_tenant(allow_all=True)
    filters = parse_filters(request.args)
    page = None if filters.errors else list_page(kind, filters, tenant)
    html = render_template(
        f"{kind.blueprint}/index.html",
        kind=kind,
        filters=filters,
        page=page,
        all_tenants=tenant is None,
        statuses=STATUSES,
        page_size=PAGE_SIZE,
        window=SUBJECT_WINDOW,
        bulk_cap=BULK_CAP,
    )
    return html, 422 if filters.errors else 200


def show_context(kind: Kind, record: Any) -> dict[str, Any]:
    found = diagnoses(kind, [record])[record.id]
    return {
        "kind": kind,
        "record": record,
        "diagnosis": found,
        "tone": explain.tone(record.status, found),
        "who_can": explain.who_can(found, viewer_role()),
        "refusal": refusal(record.status),
        "tenant_name": db.session.scalar(select(Tenant.name).where(Tenant.id == record.tenant_id)),
        "pretty_json": pretty_json,
        "channel": kind.channel,
        # Provider events are on the timeline (read once, there).
        "timeline": timeline(db.session(), kind.channel, record, operator=is_operator()),
        "dead_letter": dead_letter_of(kind, record),
    }


def viewer_role() -> str | None:
    """The signed-in person's role (None: nobody, or no request), for "who can act" lines."""
    if not has_request_context() or not current_user.is_authenticated:
        return None
    return str(current_user.role)


def dead_letter_of(kind: Kind, record: Any) -> DeadLetterMessage | None:
    """The dead letter that archived this record (its newest, should it have died twice):
    the record page shows its triage state and remark."""
    return db.session.scalar(
        select(DeadLetterMessage)
        .where(
            DeadLetterMessage.channel == kind.channel.value,
            DeadLetterMessage.event_id == str(record.id),
            DeadLetterMessage.tenant_id == record.tenant_id,
        )
        .order_by(DeadLetterMessage.id.desc())
        .limit(1)
    )


def expired(record: Any) -> bool:
    """Past its ``expiresAt``: a retry needs a new one."""
    return record.expires_at is not None and record.expires_at <= datetime.now(UTC)


def retry_one(kind: Kind, record_id: int) -> ResponseReturnValue:
    """Requeue one record; the list row swaps itself, a page form redirects back.

    A record whose diagnosis says it would fail again, with an ambiguous attempt, or past its
    expiry first gets a confirm page (the reason, and who can change it; the risk of a
    duplicate; a new expiry to fill in). Only ``confirm=yes`` with what it asks retries:
    for a record that would fail again, ``anyway`` naming the reason the page showed, so a
    confirmation given for another reason (or none) never requeues it into that failure.
    Anything else is retried in one step.
    """
    tenant = viewed_tenant(allow_all=True)
    record = find_record(kind, record_id, tenant)
    found = diagnoses(kind, [record])[record.id]
    again = found.would_fail_again and found.reason is not Reason.EXPIRED
    asks = record.status in RETRYABLE and (record.ambiguous_attempt or expired(record) or again)
    expires_at = None
    error = None
    confirmed = request.form.get("confirm") == "yes"
    if again and request.form.get("anyway") != found.reason:
        confirmed = False
    if asks and expired(record) and confirmed:
        try:
            expires_at = new_expiry(request.form.get("expiresAt", ""), datetime.now(UTC))
        except AcceptanceError as exc:
            error = exc.message
    if asks and (not confirmed or error):
        if is_htmx() and request.form.get("view") == "row" and not error:
            # The list row's one-click Retry: nothing requeued; the row says why and offers
            # the confirm page instead.
            return _row_response(
                kind,
                record_id,
                tenant,
                f"Not retried: it would fail again — {found.reason}: {found.why}."
                if again
                else "Not retried: it needs a confirmation first (Retry…).",
                ask_first=True,
            )
        page = render_template(
            "mail_records/retry.html",
            kind=kind,
            record=record,
            expired=expired(record),
            diagnosis=found,
            fail_again=again,
            who_can=explain.who_can(found, viewer_role()),
            error=error,
            next_url=safe_next(
                request.form.get("next"), url_for(kind.endpoint("show"), record_id=record_id)
            ),
        )
        return page, 422 if error else 200
    report = retry_records(
        db.session(),
        kind.model,
        [record_id],
        tenant,
        expires_at=expires_at,
        by=actor_label(),
        anyway={record_id: (str(found.reason), found.why or "")} if again else None,
    )
    if report.requeued:
        message, category = f"Record {record_id} requeued: it will be sent again shortly.", "info"
        remark = "requeued" + (f" with a new expiry {expires_at.isoformat()}" if expires_at else "")
        if again:
            remark += f", retried anyway: would fail again ({found.reason}): {found.why}"
    else:
        message = f"Record {record_id} not retried — {report.skipped[record_id]}."
        category = "error"
        remark = f"not retried: {report.skipped[record_id]}"
    audit(
        AuditAction.RETRY,
        tenant_id=record.tenant_id,
        target_type=kind.model.__name__,
        target_id=record_id,
        remark=remark,
    )
    db.session.commit()  # the retry and its audit row together
    if is_htmx() and request.form.get("view") == "row":
        return _row_response(kind, record_id, tenant, message)
    flash(message, category)
    fallback = url_for(kind.endpoint("show"), record_id=record_id)
    return redirect(safe_next(request.form.get("next"), fallback))


def _row_response(
    kind: Kind, record_id: int, tenant: int | None, message: str, *, ask_first: bool = False
) -> ResponseReturnValue:
    """The list row of one record, swapped in by its Retry, with what happened."""
    row = find_record(kind, record_id, tenant)
    response = make_response(
        render_template(
            f"{kind.blueprint}/_row.html",
            kind=kind,
            r=row,
            all_tenants=tenant is None,
            names=tenant_names(tenant),
            row_message=message,
            ask_first=ask_first,
        )
    )
    response.headers["Vary"] = "HX-Request"
    return response


def resend_one(kind: Kind, record_id: int) -> ResponseReturnValue:
    """Send an Uncertain record's request again as a new message (a new record with a new
    business key); without ``confirm=yes``, the page that says what that risks."""
    tenant = viewed_tenant(allow_all=True)
    record = find_record(kind, record_id, tenant)
    if record.status != SendStatus.UNCERTAIN.value:
        flash(
            f"Record {record_id} is {explain.label(record.status)}, not uncertain: "
            "retry it instead.",
            "error",
        )
        return redirect(url_for(kind.endpoint("show"), record_id=record_id), 303)
    error = None
    if request.form.get("confirm") == "yes":
        try:
            accepted = resend_as_new(
                db.session(), record, current_app.config["SETTINGS"], by=actor_label()
            )
        except AcceptanceError as exc:
            db.session.rollback()
            error = f"It cannot be sent again as it was: {exc.message}."
        else:
            audit(
                AuditAction.RETRY,
                tenant_id=record.tenant_id,
                target_type=kind.model.__name__,
                target_id=record_id,
                remark=f"sent again as a new message: record {accepted.id}",
            )
            db.session.commit()  # the new record and its audit row together
            flash(
                f"Sent again as a new message, record {accepted.id}. Record {record_id} "
                "stays uncertain until it is resolved.",
                "info",
            )
            return redirect(url_for(kind.endpoint("show"), record_id=accepted.id), 303)
    page = render_template("mail_records/resend.html", kind=kind, record=record, error=error)
    return page, 422 if error else 200


@dataclass
class BulkRequest:
    """One post of a bulk form (retry or cancel), read once: whose records, the filter it
    carries, the list to go back to, and whether htmx wants a fragment or the page."""

    kind: Kind
    verb: str  # "retry" or "cancel": the endpoint is bulk_<verb>, the page bulk_<verb>.html
    fragments: str  # the fragments' prefix: <prefix>confirm.html and <prefix>outcome.html
    tenant: int | None
    form: MultiDict[str, str]
    filters: Filters
    list_url: str
    fragment: bool

    def render(self, step: str, status: int = 200, **context: Any) -> ResponseReturnValue:
        """The step's fragment (htmx) or the page that holds the confirmation."""
        page = f"{self.fragments}{step}" if self.fragment else f"bulk_{self.verb}"
        html = render_template(
            f"{self.kind.blueprint}/{page}.html",
            kind=self.kind,
            filters=self.filters,
            list_url=self.list_url,
            verb=self.verb,
            step=step,
            **context,
        )
        return html, status, {"Vary": "HX-Request"}

    def changed_rows(self, ids: Iterable[int]) -> dict[str, Any]:
        """The rows on the page (``shown``) among ``ids``, re-read, for the outcome to swap."""
        shown, _ = parse_ids(self.form.getlist("shown"))
        wanted = set(shown) & set(ids)
        rows = []
        if wanted:
            model = self.kind.model
            rows = list(
                db.session.scalars(
                    visible(self.kind, wanted, self.tenant).order_by(model.id.desc())
                )
            )
        return {
            "rows": rows,
            "all_tenants": self.tenant is None,
            "names": tenant_names(self.tenant),
        }


def bulk_view(
    kind: Kind,
    verb: str,
    fragments: str,
    plan: Callable[[Kind, Sequence[int], int | None], PlanT],
    confirmed: Callable[[BulkRequest], ResponseReturnValue],
) -> ResponseReturnValue:
    """A bulk action's two steps on one endpoint: without ``confirm``, ``plan`` counts what
    would happen to the selection (or everything matching the filter); with ``confirm=yes``,
    ``confirmed`` does it; ``confirm=no`` clears the confirmation."""
    form: MultiDict[str, str] = request.form
    filters = parse_filters(form)
    bulk = BulkRequest(
        kind=kind,
        verb=verb,
        fragments=fragments,
        tenant=viewed_tenant(allow_all=True),
        form=form,
        filters=filters,
        list_url=url_for(kind.endpoint("index"), **filters.args()),
        fragment=is_htmx(),
    )
    decision = form.get("confirm", "")
    if decision == "no":
        return ("", 200, {"Vary": "HX-Request"}) if bulk.fragment else redirect(bulk.list_url)
    if decision == "yes":
        return _all_tenants_unchosen(bulk, plan) or confirmed(bulk)

    # Step one: which records, and what would happen to them.
    if form.get("scope") == "filter":
        if filters.errors:
            return bulk.render("confirm", 422, error=next(iter(filters.errors.values())), plan=None)
        ids, capped = matching_ids(kind, filters, bulk.tenant)
        if not ids:
            return bulk.render("confirm", 422, error="No records match this filter.", plan=None)
    else:
        ids, error = parse_ids(form.getlist("ids"))
        capped = False
        if error or not ids:
            error = error or f"Select at least one record to {verb}."
            return bulk.render("confirm", 422, error=error, plan=None)
    planned = plan(kind, ids, bulk.tenant)
    planned.capped = capped
    scope = form.get("scope", "")
    return bulk.render("confirm", plan=_for_viewer(bulk, planned, ids, scope), error=None)


ALL_TENANTS_CHOSEN = "yes"  # the value of the confirmation's "all_tenants" checkbox


def _for_viewer(bulk: BulkRequest, planned: PlanT, ids: Sequence[int], scope: str) -> PlanT:
    """The plan with what the all-tenants view adds: counts per tenant, and whether confirming
    needs the explicit "all tenants" choice (everything matching the filter: whose records
    those are is not something the operator picked row by row).

    The confirmation carries the scope it was planned for as ``planned_scope``, not ``scope``:
    a confirmation left on the page must not turn the next "Retry selected" into "all
    matching"."""
    planned.scope = "filter" if scope == "filter" else "selected"
    if bulk.tenant is None:
        planned.tenants = tenant_counts(bulk.kind, ids)
        planned.needs_all_tenants = planned.scope == "filter"
    return planned


def _all_tenants_unchosen(
    bulk: BulkRequest, plan: Callable[[Kind, Sequence[int], int | None], PlanT]
) -> ResponseReturnValue | None:
    """Step two in the all-tenants view over everything matching the filter (the
    confirmation carries ``planned_scope=filter``), without the explicit choice: the
    confirmation again (422), saying what to tick; else None."""
    if bulk.tenant is None and bulk.form.get("planned_scope") == "filter":
        ids, _versions, error = parse_confirmed(bulk.form.get("confirmed", ""))
        if error or not ids:
            return None  # the action's own step two says what is wrong
        planned = _for_viewer(bulk, plan(bulk.kind, ids, bulk.tenant), ids, "filter")
        if planned.needs_all_tenants and bulk.form.get("all_tenants") != ALL_TENANTS_CHOSEN:
            choice = (
                f"This would {bulk.verb} records of every tenant listed: tick "
                "“Yes, all these tenants” to go on, or choose one tenant under Viewing."
            )
            return bulk.render("confirm", 422, plan=planned, error=None, choice_error=choice)
    return None


def bulk_retry_view(kind: Kind) -> ResponseReturnValue:
    """Two steps on one endpoint: without ``confirm`` count what would happen; with it, do it."""
    return bulk_view(kind, "retry", "_", plan_retry, _retry_confirmed)


def _retry_confirmed(bulk: BulkRequest) -> ResponseReturnValue:
    """Step two of a bulk retry: requeue the confirmed records."""
    ids, error = parse_ids([bulk.form.get("confirmed", "")])
    if error or not ids:
        return bulk.render("confirm", 422, error=error or "Nothing to retry.", plan=None)
    # Read again now: a quota raised or a template added since step one counts.
    blocked = blocked_ids(bulk.kind, ids, bulk.tenant)
    include = bulk.form.get("include_blocked") == "yes"
    left_out = {} if include else {i: f"{d.reason}: {d.why}" for i, d in blocked.items()}
    report = retry_records(
        db.session(),
        bulk.kind.model,
        [i for i in ids if i not in left_out],
        bulk.tenant,
        by=actor_label(),
        anyway={i: (str(d.reason), d.why or "") for i, d in blocked.items()} if include else None,
    )
    skipped = dict(report.skipped) | {
        i: f"left out: would fail again, {why}" for i, why in left_out.items()
    }
    tenant_of = dict(report.tenant_of)
    if left_out:
        model = bulk.kind.model
        found = visible(bulk.kind, left_out, bulk.tenant, model.id, model.tenant_id)
        tenant_of |= {int(rid): int(tid) for rid, tid in db.session.execute(found)}
    anyway = {i: f"{d.reason}" for i, d in blocked.items() if include and i in report.tenant_of}
    audit_bulk(AuditAction.BULK_RETRY, bulk, report.requeued, skipped, tenant_of, anyway)
    db.session.commit()  # the retry and its audit rows together
    summary = skipped_summary(report.skipped)
    left = skipped_summary(left_out)
    if not bulk.fragment:
        text = _outcome_text(len(report.requeued), summary)
        if left_out:
            text += f" {len(left_out):,} left out because they would fail again."
        flash(text, "info")
        return redirect(bulk.list_url)
    return bulk.render(
        "outcome",
        requeued=len(report.requeued),
        summary=summary,
        left_out=left,
        left_out_count=len(left_out),
        **bulk.changed_rows(ids),
    )


def _outcome_text(done: int, summary: list[tuple[str, int]], verb: str = "requeued") -> str:
    """The no-JavaScript flash: "3 requeued, 2 skipped (1: already sent · 1: ...)."."""
    if not summary:
        return f"{done:,} {verb}."
    skipped = sum(n for _, n in summary)
    reasons = " · ".join(f"{n:,}: {reason}" for reason, n in summary)
    return f"{done:,} {verb}, {skipped:,} skipped ({reasons})."


def audit_bulk(
    action: AuditAction,
    bulk: BulkRequest,
    done: Sequence[int],
    skipped: Mapping[int, str],
    tenant_of: Mapping[int, int],
    anyway: Mapping[int, str] | None = None,
) -> None:
    """The audit rows of one confirmed bulk request (in its transaction): one row in the
    viewed tenant. ``anyway``: the records requeued although they would fail again (the
    person ticked to include them), with the reason, counted in the remark.

    An operator looking at every tenant writes one row per tenant whose records the request
    reached, so each tenant's admins see it in their own log, plus one without a tenant for
    ids that matched no record. Each remark counts what happened to that tenant's records
    ("3 requeued, 1 skipped (1: already sent).") and names the first ones changed.
    """
    verb = "requeued" if action is AuditAction.BULK_RETRY else "cancelled"
    groups: dict[int | None, set[int]] = {}
    for record_id in [*done, *skipped]:
        groups.setdefault(tenant_of.get(record_id, bulk.tenant), set()).add(record_id)
    for tenant_id, ids in groups.items():
        changed = [i for i in done if i in ids]
        remark = _outcome_text(
            len(changed), skipped_summary({i: r for i, r in skipped.items() if i in ids}), verb
        )
        if changed:
            listed = ", ".join(str(i) for i in changed[:AUDIT_IDS_LISTED])
            rest = len(changed) - AUDIT_IDS_LISTED
            more = f" and {rest:,} more" if rest > 0 else ""
            remark += f" {verb.capitalize()}: {listed}{more}."
        forced = skipped_summary({i: r for i, r in (anyway or {}).items() if i in changed})
        if forced:
            reasons = " · ".join(f"{n:,}: {reason}" for reason, n in forced)
            remark += (
                f" Retried anyway although they would fail again: "
                f"{sum(n for _, n in forced):,} ({reasons})."
            )
        audit(action, tenant_id=tenant_id, target_type=bulk.kind.model.__name__, remark=remark)


def bulk_cancel_view(kind: Kind) -> ResponseReturnValue:
    """Two steps, as bulk retry: count what a cancel would do; then cancel by version."""
    return bulk_view(kind, "cancel", "_cancel_", plan_cancel, _cancel_confirmed)


def _cancel_confirmed(bulk: BulkRequest) -> ResponseReturnValue:
    """Step two of a bulk cancel: cancel the confirmed records at the versions seen."""
    ids, versions, error = parse_confirmed(bulk.form.get("confirmed", ""))
    if error or not ids:
        return bulk.render("confirm", 422, error=error or "Nothing to cancel.", plan=None)
    report = cancel.cancel_records(
        db.session(), bulk.kind.model, ids, bulk.tenant, versions, by=actor_label()
    )
    audit_bulk(AuditAction.BULK_CANCEL, bulk, report.cancelled, report.skipped, report.tenant_of)
    db.session.commit()  # the cancel and its audit rows together
    outcome = cancel_outcome(report)
    if not bulk.fragment:
        flash(outcome.text, "info" if not report.skipped else "error")
        return redirect(bulk.list_url)
    return bulk.render("outcome", outcome=outcome, **bulk.changed_rows(ids))
