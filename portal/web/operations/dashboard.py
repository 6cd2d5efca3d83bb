"""The dashboard: what is waiting, what went out, what failed; it refreshes itself with htmx.

Every figure is bounded, so the page costs about the same on a day-old database and on one
with millions of records: status counts stop at COUNT_CAP ("10,000+"), the backlog walks the
delivery loop's own status indexes, the chart reads one day by created_time. That last read
(and the per-tenant status counts) want indexes the migrations do not have yet:
(created_time) and (tenant_id, status, id) on each record table; bench/pages.py measures the
dashboard with and without them.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from flask import Blueprint, redirect, render_template, request, url_for
from flask.typing import ResponseReturnValue
from sqlalchemy import ColumnElement, Select, bindparam, func, literal, select, text

from portal.extensions import db
from portal.messaging.sending import health
from portal.models import (
    Channel,
    DeadLetterMessage,
    SendStatus,
    TriageStatus,
)
from portal.models.by_channel import PARTS
from portal.tenancy import PLATFORM_TENANT_ID, names_config
from portal.web.access import Permission, can, is_operator, requires, viewed_tenant
from portal.web.forms import is_htmx, settings
from portal.web.operations.dead_letters import waiting_by_tenant
from portal.web.records import decisions, explain
from portal.web.records.kind import Kind
from portal.web.records.listing import tenant_names
from portal.web.records.mail_records import MAIL
from portal.web.records.sms_records import SMS

bp = Blueprint("dashboard", __name__, url_prefix="/")

COUNT_CAP = 10_000
CHART_HOURS = 24
FAILED = (SendStatus.FAILED.value, SendStatus.DEAD_LETTER.value)
REFRESH = "every 15s"
# Bar heights are classes h-0 .. h-20 (5 % steps): the CSP forbids style attributes.
HEIGHT_STEPS = 20


@dataclass
class StatusCount:
    status: str
    label: str
    count: int

    @property
    def capped(self) -> bool:
        return self.count > COUNT_CAP


@dataclass
class Hour:
    start: datetime
    total: int
    failed: int
    ok_height: int = 0
    failed_height: int = 0


@dataclass
class ChannelSummary:
    kind: Kind
    counts: list[StatusCount]
    due: int
    oldest_due: tuple[int, datetime] | None  # record id, due since
    hours: list[Hour]
    delivery: Delivery | None = None

    @property
    def day_total(self) -> int:
        return sum(h.total for h in self.hours)

    @property
    def day_failed(self) -> int:
        return sum(h.failed for h in self.hours)


def _scope(model: Any, tenant: int | None) -> list[ColumnElement[bool]]:
    return [] if tenant is None else [model.tenant_id == tenant]


def _capped_count(model: Any, *where: ColumnElement[bool]) -> Any:
    """count(*) of at most COUNT_CAP + 1 rows: an index range read that stops early."""
    inner = select(literal(1)).select_from(model).where(*where).limit(COUNT_CAP + 1).subquery()
    return select(func.count()).select_from(inner).scalar_subquery()


@functools.cache
def _figures_statement(model: Any, scoped: bool) -> Select[Any]:
    """One channel's figures in one statement: the records per status (each count capped),
    how many are due (Pending, and Retry whose time has come) and the longest-due Pending and
    Retry (id and since when). Each is its own index read (the status counts and the due
    scan's (status, updated_time) / (status, next_retry_at) walks); one round trip for all
    of them, built once per channel and scope (the tenant and the time are parameters)."""
    scope = [model.tenant_id == bindparam("tenant")] if scoped else []
    pending = [model.status == SendStatus.PENDING.value, *scope]
    retry_due = [
        model.status == SendStatus.RETRY.value,
        model.next_retry_at <= bindparam("now"),
        *scope,
    ]

    def oldest(column: Any, where: list[ColumnElement[bool]], by: Any) -> Any:
        return select(column).where(*where).order_by(by).limit(1).scalar_subquery()

    return select(
        *(_capped_count(model, model.status == status.value, *scope) for status in SendStatus),
        _capped_count(model, *pending),
        _capped_count(model, *retry_due),
        oldest(model.id, pending, model.updated_time),
        oldest(model.updated_time, pending, model.updated_time),
        oldest(model.id, retry_due, model.next_retry_at),
        oldest(model.next_retry_at, retry_due, model.next_retry_at),
    )


def figures(
    kind: Kind, tenant: int | None, now: datetime
) -> tuple[list[StatusCount], int, tuple[int, datetime] | None]:
    """Records per status, how many are due and the longest-due one (one round trip)."""
    row = db.session.execute(
        _figures_statement(kind.model, tenant is not None), {"tenant": tenant, "now": now}
    ).one()
    n = len(SendStatus)
    counts = [
        StatusCount(status.value, explain.label(status.value), int(count or 0))
        for status, count in zip(SendStatus, row[:n], strict=True)
    ]
    due = int(row[n] or 0) + int(row[n + 1] or 0)
    candidates = [
        (int(record_id), since)
        for record_id, since in ((row[n + 2], row[n + 3]), (row[n + 4], row[n + 5]))
        if record_id is not None and since is not None
    ]
    return counts, due, min(candidates, key=lambda c: c[1]) if candidates else None


def _hour_bucket(column: Any) -> Any:
    if db.engine.dialect.name == "sqlite":
        return func.strftime("%Y-%m-%d %H:00:00", column)
    # In UTC whatever the session's TimeZone, so the buckets are the chart's clock hours.
    return func.date_trunc("hour", func.timezone("UTC", column))


# The chart's hours before this one, read at most once a minute per channel, viewer's scope
# and process: each dashboard (and its refresh every 15 seconds) then reads only this hour's
# records. At 10M records (111,000 a day) a tenant's 24 hours were 66,000 rows read from the
# heap per channel, 40-70 ms of a request; this hour is a 24th of that. An hour that has ended
# gets no new records; its failures (a retry that ends Failed) show up to a minute late.
PAST_HOURS_S = 60.0
_past_hours: dict[tuple[str, str, int | None], tuple[float, datetime, dict[datetime, Any]]] = {}


def _hour_counts(model: Any, tenant: int | None, since: datetime) -> dict[datetime, Any]:
    """(records, failed) per clock hour, of the records created at or after ``since``."""
    bucket = _hour_bucket(model.created_time).label("hour")
    rows: Sequence[Any]
    if tenant is None:
        rows = _hourly_all_tenants(model, bucket, since)
    else:
        rows = db.session.execute(
            select(
                bucket,
                func.count(),
                func.count().filter(model.status.in_(FAILED)),
            )
            .where(model.created_time >= since, *_scope(model, tenant))
            .group_by(bucket)
        ).all()
    found: dict[datetime, Any] = {}
    for start, total, failed in rows:
        if isinstance(start, str):  # SQLite hands the bucket back as text
            start = datetime.fromisoformat(start)
        found[start.replace(tzinfo=UTC) if start.tzinfo is None else start.astimezone(UTC)] = (
            int(total),
            int(failed),
        )
    return found


def hourly(kind: Kind, tenant: int | None, now: datetime) -> list[Hour]:
    """Records created in each of the last 24 clock hours, and how many of them failed."""
    model = kind.model
    current = now.replace(minute=0, second=0, microsecond=0)
    first = current - timedelta(hours=CHART_HOURS - 1)
    key = (str(db.engine.url), kind.channel.value, tenant)
    cached = _past_hours.get(key)
    if cached is not None and cached[1] == current and time.monotonic() - cached[0] < PAST_HOURS_S:
        found = dict(cached[2])
        found.update(_hour_counts(model, tenant, current))
    else:
        read_at = time.monotonic()
        found = _hour_counts(model, tenant, first)
        past = {start: counts for start, counts in found.items() if start < current}
        _past_hours[key] = (read_at, current, past)
    hours = []
    for i in range(CHART_HOURS):
        start = first + timedelta(hours=i)
        total, failed = found.get(start, (0, 0))
        hours.append(Hour(start, total, failed))
    peak = max((h.total for h in hours), default=0)
    for h in hours:
        if peak:
            # Round up, so that an hour with a few sends still shows a sliver.
            h.failed_height = -(-h.failed * HEIGHT_STEPS // peak)
            h.ok_height = min(
                HEIGHT_STEPS - h.failed_height, -(-(h.total - h.failed) * HEIGHT_STEPS // peak)
            )
    return hours


# A failure is written after its record's creation: its updated_time is at or after its
# created_time, read by the same clock (this slack covers a transaction that began before the
# record was inserted and set updated_time to its own start).
FAILED_SLACK = timedelta(hours=1)


def _hourly_all_tenants(model: Any, bucket: Any, first: datetime) -> list[tuple[Any, int, int]]:
    """The chart over every tenant without reading the day's rows: the totals from
    ``idx_*_created`` alone (an index-only scan where the visibility map allows; the day's
    status and tenant were read from the heap, 11,000 rows a table at 1M records and ten
    times that at 10M), the failures down the delivery loop's (status, updated_time) index:
    only the failed records of the day (and of FAILED_SLACK before it) are read."""
    totals = db.session.execute(
        select(bucket, func.count()).where(model.created_time >= first).group_by(bucket)
    ).all()
    failed: dict[Any, int] = dict(
        db.session.execute(
            select(bucket, func.count())
            .where(
                model.status.in_(FAILED),
                model.updated_time >= first - FAILED_SLACK,
                model.created_time >= first,
            )
            .group_by(bucket)
        )
        .tuples()
        .all()
    )
    return [(start, int(total), int(failed.get(start, 0))) for start, total in totals]


def without_jit() -> None:
    """No JIT compilation for the rest of this request's transaction (PostgreSQL).

    The chart's day of rows and the decision counts' walks are estimated dear enough to pass
    jit_above_cost, and compiling their expressions cost 150-260 ms a query on a 10M-row table
    (bench/pages.py, EXPLAIN ANALYZE's JIT timing) to save a few ms of execution: more than
    the queries themselves. The results are the same either way.
    """
    if db.engine.dialect.name == "postgresql":
        db.session.execute(text("SET LOCAL jit = off"))


def summary(kind: Kind, tenant: int | None, now: datetime) -> ChannelSummary:
    counts, due, oldest = figures(kind, tenant, now)
    return ChannelSummary(
        kind,
        counts,
        due,
        oldest,
        hourly(kind, tenant, now),
        delivery(kind, tenant, now, operator=is_operator()),
    )


# --- the tenant's own delivery: latency and failure rate ----------------------------------

ENDED = (SendStatus.SENT.value, *FAILED)


@dataclass(frozen=True)
class Latency:
    """Accepted to sent, of the records accepted in a window that were sent: seconds."""

    sent: int
    p50: float | None
    p95: float | None


@dataclass(frozen=True)
class RouteFailures:
    """Of the records accepted in the last day through one server or provider and stream
    that ended (Sent, Failed or DeadLetter): how many, and how many failed."""

    config: str  # its name; "none chosen" for records that failed before one was chosen
    stream: str
    ended: int
    failed: int
    tier: int | None = None  # the config's tier, for ``names_config``; None: none chosen

    @property
    def rate(self) -> float:
        return self.failed / self.ended if self.ended else 0.0


@dataclass(frozen=True)
class Delivery:
    hour: Latency
    day: Latency
    routes: list[RouteFailures]


def percentile(values: Sequence[float], q: float) -> float | None:
    """``percentile_cont(q)`` of ``values`` (sorted), as PostgreSQL computes it."""
    if not values:
        return None
    at = q * (len(values) - 1)
    low = int(at)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (at - low)


def _latency_seconds(model: Any) -> Any:
    if db.engine.dialect.name == "sqlite":
        return (func.julianday(model.sent_at) - func.julianday(model.created_time)) * 86400.0
    return func.extract("epoch", model.sent_at - model.created_time)


# Ids follow acceptance: a record's created_time is its transaction's start by the database
# clock, so a later id has an earlier time only by as long as a transaction lasted.
ID_SLACK = timedelta(minutes=5)


def _window_rows(model: Any, tenant: int, day: datetime) -> list[ColumnElement[bool]]:
    """The tenant's records accepted since ``day``, down (tenant_id, status, id): the first id
    of the day comes from the (created_time) index, so each status's walk is an id range."""
    first_id = (
        select(model.id)
        .where(model.created_time >= day - ID_SLACK)
        # Records accepted in one batch share their time: the least id of the first time.
        .order_by(model.created_time, model.id)
        .limit(1)
        .scalar_subquery()
    )
    return [model.tenant_id == tenant, model.id >= first_id, model.created_time >= day]


def _latencies(model: Any, tenant: int, hour: datetime, day: datetime) -> tuple[Latency, Latency]:
    """p50 and p95 of the last hour and the last day, in one statement (PostgreSQL: in the
    database; SQLite, the embedded default with its small tables: from the day's latencies)."""
    seconds = _latency_seconds(model)
    where = [*_window_rows(model, tenant, day), model.status == SendStatus.SENT.value]
    where.append(model.sent_at.is_not(None))
    if db.engine.dialect.name != "postgresql":
        rows = db.session.execute(
            select(model.created_time >= hour, seconds).where(*where).order_by(seconds)
        ).all()
        day_values = [float(v) for _, v in rows]
        hour_values = [float(v) for recent, v in rows if recent]
        of_hour, of_day = hour_values, day_values
        return (
            Latency(len(of_hour), percentile(of_hour, 0.5), percentile(of_hour, 0.95)),
            Latency(len(of_day), percentile(of_day, 0.5), percentile(of_day, 0.95)),
        )
    recent = model.created_time >= hour

    def cont(q: float, *only: Any) -> Any:
        found = func.percentile_cont(q).within_group(seconds)
        return found.filter(*only) if only else found

    row = db.session.execute(
        select(
            func.count().filter(recent),
            cont(0.5, recent),
            cont(0.95, recent),
            func.count(),
            cont(0.5),
            cont(0.95),
        ).where(*where)
    ).one()
    return (
        Latency(int(row[0]), row[1], row[2]),
        Latency(int(row[3]), row[4], row[5]),
    )


NONE_CHOSEN = "none chosen"  # the line of records that failed before a server was chosen


def _routes(kind: Kind, tenant: int, day: datetime) -> list[RouteFailures]:
    """Failure rate by server or provider and stream, of the day's records that ended."""
    model: Any = kind.model
    parts = PARTS[kind.channel]
    column, config_model = parts.route, parts.config
    rows = db.session.execute(
        select(
            column,
            model.stream,
            func.count(),
            func.count().filter(model.status.in_(FAILED)),
        )
        .where(*_window_rows(model, tenant, day), model.status.in_(ENDED))
        .group_by(column, model.stream)
    ).all()
    ids = {r[0] for r in rows if r[0] is not None}
    names: dict[int, tuple[str, int]] = {}
    if ids:
        query = select(config_model.id, config_model.name, config_model.tenant_id).where(
            config_model.id.in_(ids), config_model.tenant_id.in_([tenant, PLATFORM_TENANT_ID])
        )
        names = {config_id: (name, tier) for config_id, name, tier in db.session.execute(query)}
    found = []
    for config, stream, ended, failed in rows:
        name, tier = (
            (NONE_CHOSEN, None) if config is None else names.get(config, (f"#{config}", None))
        )
        found.append(RouteFailures(name, stream, int(ended), int(failed), tier))
    return found


def _as_seen(kind: Kind, routes: list[RouteFailures], operator: bool) -> list[RouteFailures]:
    """The routes as the viewer may see them (``names_config``): a tenant sees the platform
    tier's servers as one "platform mail service" (or SMS), never their names or how many."""
    merged: dict[tuple[str, str], RouteFailures] = {}
    for route in routes:
        name = route.config
        if name != NONE_CHOSEN and not names_config(route.tier, operator):
            name = kind.platform_service
        key = (name, route.stream)
        if key in merged:
            seen = merged[key]
            merged[key] = RouteFailures(
                name, route.stream, seen.ended + route.ended, seen.failed + route.failed, seen.tier
            )
        else:
            merged[key] = RouteFailures(name, route.stream, route.ended, route.failed, route.tier)
    return sorted(merged.values(), key=lambda r: (-r.rate, -r.ended, r.config, r.stream))


# Read at most once a minute per channel, tenant and process, as the chart's past hours: the
# day's rows of a tenant with 6 in 10 of 10M records are 66,000 a channel.
DELIVERY_S = 60.0
_delivery: dict[tuple[str, str, int], tuple[float, Delivery]] = {}


def delivery(
    kind: Kind, tenant: int | None, now: datetime, *, operator: bool = False
) -> Delivery | None:
    """The viewed tenant's latency (last hour, last day) and failure rate by route; none over
    all tenants (each tenant's dashboard shows its own)."""
    if tenant is None:
        return None
    key = (str(db.engine.url), kind.channel.value, tenant)
    cached = _delivery.get(key)
    if cached is not None and time.monotonic() - cached[0] < DELIVERY_S:
        found = cached[1]
    else:
        read_at = time.monotonic()
        hour, day = now - timedelta(hours=1), now - timedelta(days=1)
        latency_hour, latency_day = _latencies(kind.model, tenant, hour, day)
        found = Delivery(latency_hour, latency_day, _routes(kind, tenant, day))
        _delivery[key] = (read_at, found)
    # Cached as read, named per viewer: an operator's read must not show a tenant names.
    return Delivery(found.hour, found.day, _as_seen(kind, found.routes, operator))


def recent_dead_letters(tenant: int | None, limit: int = 5) -> list[DeadLetterMessage]:
    """The newest dead letters still waiting for triage."""
    stmt = select(DeadLetterMessage).where(DeadLetterMessage.status == TriageStatus.PENDING.value)
    if tenant is not None:
        stmt = stmt.where(DeadLetterMessage.tenant_id == tenant)
    return list(db.session.scalars(stmt.order_by(DeadLetterMessage.id.desc()).limit(limit)))


def age_text(seconds: float) -> str:
    """ "3 minutes", "2 hours 5 minutes", "4 days": how long something has waited."""
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds} second{'s' if seconds != 1 else ''}"
    minutes = seconds // 60
    if minutes < 60:
        return f"{minutes} minute{'s' if minutes != 1 else ''}"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours} hour{'s' if hours != 1 else ''} {minutes} min"
    return f"{hours // 24} days"


def seconds_text(seconds: float | None) -> str:
    """A latency: "0.42 s", "12 s", "3 min 5 s"; "none" for none."""
    if seconds is None:
        return "none"
    if seconds < 10:
        return f"{seconds:.2f} s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{int(seconds // 60)} min {int(seconds % 60)} s"


@dataclass
class Failing:
    """A server or provider whose sends fail (``health``), as the viewer may see it: a tenant
    sees the platform tier's only as "platform mail service degraded" (no name, no error)."""

    channel: str
    name: str | None
    state: health.State | None


def failing_servers(tenant: int | None) -> list[Failing]:
    """The failing servers and providers the viewer should hear about: their tier's with their
    state, the platform tier's (which tenants send through) unnamed. Operators: the platform's
    and the viewed tenant's (every tier's when viewing all)."""
    tiers = None if is_operator() and tenant is None else [PLATFORM_TENANT_ID]
    if tiers is not None and tenant is not None:
        tiers.append(tenant)
    shown: list[Failing] = []
    platform: set[str] = set()
    for channel, config, state in health.failing(
        db.session, tiers, window_s=settings().health_window_s
    ):
        if is_operator() or config.tenant_id == tenant:
            shown.append(Failing(channel.value, config.name, state))
        else:
            platform.add(channel.value)
    return shown + [Failing(channel, None, None) for channel in sorted(platform)]


def decisions_count(tenant: int | None) -> tuple[int, bool]:
    """Records needing a decision, mail and SMS together (capped per walk, as the counts)."""
    total, capped = 0, False
    for kind in (MAIL, SMS):
        n, over = decisions.count(kind, tenant)
        total, capped = total + n, capped or over
    return total, capped


@dataclass
class TenantFigures:
    """One tenant's failures, for operators: what waits for someone, tenant by tenant."""

    tenant_id: int
    name: str
    mail_failed: int
    sms_failed: int
    dead_letters: int

    @property
    def total(self) -> int:
        return self.mail_failed + self.sms_failed + self.dead_letters


@functools.lru_cache(maxsize=16)  # the tenant set changes now and then: keep the recent ones
def _failures_statement(model: Any, tenant_ids: tuple[int, ...]) -> Select[Any]:
    """Per tenant and failed status, a capped count (built once per set of tenants)."""
    return select(
        *(
            _capped_count(model, model.tenant_id == tid, model.status == status)
            for tid in tenant_ids
            for status in FAILED
        )
    )


def failures_by_tenant(names: dict[int, str] | None = None) -> list[TenantFigures]:
    """Failed and dead-lettered records (each channel) and dead letters waiting for triage,
    per tenant, for the tenants that have any; most first. Operators only: so the dashboard
    never says "none" for the viewed tenant while others have failures waiting.

    Bounded like the status counts: per tenant and status, a capped count (COUNT_CAP + 1 rows
    at most) down the (tenant_id, status, id) index, all in one statement per channel.
    """
    names = tenant_names(None) if names is None else names
    figures: dict[int, list[int]] = {}
    for position, kind in enumerate((MAIL, SMS)):
        if not names:
            continue
        row = db.session.execute(_failures_statement(kind.model, tuple(names))).one()
        for i, tid in enumerate(names):
            count = sum(int(row[i * len(FAILED) + j] or 0) for j in range(len(FAILED)))
            if count:
                figures.setdefault(tid, [0, 0, 0])[position] = count
    for tenant_id, count in waiting_by_tenant().items():
        figures.setdefault(tenant_id, [0, 0, 0])[2] = count
    found = [
        TenantFigures(tid, names.get(tid, f"tenant {tid}"), *counts)
        for tid, counts in figures.items()
    ]
    return sorted(found, key=lambda f: (-f.total, f.name))


@bp.get("")
@requires(Permission.VIEW_RECORDS)
def index() -> ResponseReturnValue:
    """Counts by status, backlog, the last 24 hours and recent dead letters (htmx: the panel)."""
    tenant = viewed_tenant(allow_all=True)
    now = datetime.now(UTC)
    without_jit()
    names = tenant_names(tenant)
    context = {
        "channels": [summary(MAIL, tenant, now), summary(SMS, tenant, now)],
        "dead_letters": recent_dead_letters(tenant) if can(Permission.DEAD_LETTERS) else None,
        "names": names,
        "now": now,
        "age_text": age_text,
        "seconds_text": seconds_text,
        "count_cap": COUNT_CAP,
        "refresh": REFRESH,
        "channel_of": {Channel.MAIL.value: MAIL, Channel.SMS.value: SMS},
        "decisions": decisions_count(tenant),
        "failing": failing_servers(tenant),
        "by_tenant": failures_by_tenant(names or None) if is_operator() else None,
        "viewed": tenant,
    }
    template = "dashboard/_summary.html" if is_htmx() else "dashboard/index.html"
    return render_template(template, **context), 200, {"Vary": "HX-Request"}


@bp.get("search")
@requires(Permission.VIEW_RECORDS)
def search() -> ResponseReturnValue:
    """The old box's address (bookmarks): the one results page, mail and SMS together."""
    q = (request.args.get("q") or "").strip()  # the results page checks its length
    if not q:
        return redirect(url_for("dashboard.index"))
    return redirect(url_for("search.index", q=q))
