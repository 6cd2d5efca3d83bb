"""The audit log: who did what, to which row, and when, newest first.

Tenant admins see their own tenant's rows; operators see the tenant they view, or every row
(the platform tier's and those with no tenant, such as a failed sign-in of an unknown address
included) when they view all tenants. Filters are a plain GET form: actor (text in the actor's
label), action, and a range of UTC dates. Pages go back in time by keyset on
(created_time, id), which the (tenant_id, created_time) index serves.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime

from flask import Blueprint, render_template, request, url_for
from flask.typing import ResponseReturnValue
from sqlalchemy import ColumnElement, and_, case, literal, or_, select

from portal.extensions import db
from portal.messaging.records.search import escape_like
from portal.models import ApiKey, AppUser, AuditAction, AuditEvent
from portal.models.audit import AUDIT_ACTION_TEXT
from portal.tenancy import PLATFORM_TENANT_ID
from portal.web.access import Permission, is_operator, requires, viewed_tenant
from portal.web.records.filters import ListFilters, day_end, day_start, parse_date, parse_id
from portal.web.records.kind import Kind
from portal.web.records.listing import tenant_column
from portal.web.records.mail_records import MAIL
from portal.web.records.sms_records import SMS

bp = Blueprint("audit", __name__, url_prefix="/audit")

PAGE_SIZE = 50
MAX_ACTOR_CHARS = 400  # the length of actor_label
ACTIONS = [(action.value, AUDIT_ACTION_TEXT[action]) for action in AuditAction]
ACTION_VALUES = frozenset(value for value, _ in ACTIONS)
# target_type of a send record, as every writer names it: the model (the seeds' name).
RECORD_KINDS: dict[str, Kind] = {MAIL.model.__name__: MAIL, SMS.model.__name__: SMS}
# Targets whose plain name is not their type with the underscores taken out ("mail_server").
TARGET_NOUNS = {
    MAIL.model.__name__: "Mail record",
    SMS.model.__name__: "SMS record",
    "api_key": "API key",
    "sms_provider": "SMS provider",
    "sms_template": "SMS template",
}


@dataclass
class AuditFilters(ListFilters):
    """What the log shows: actor text, action, dates, and the keyset cursor (an event id)."""

    actor: str = ""
    action: str = ""
    date_from: datetime | None = None  # inclusive
    date_to: datetime | None = None  # exclusive: the day after the "to" date


def parse_filters(source: Mapping[str, str]) -> AuditFilters:
    """Read and check the log's query; never raises, names the field of every problem."""
    filters = AuditFilters.read(source, ("actor", "action", "from", "to"))
    raw, errors = filters.raw, filters.errors
    filters.actor = filters.plain(
        "actor",
        MAX_ACTOR_CHARS,
        f"Actor: type at most {MAX_ACTOR_CHARS} characters.",
        "Actor: type letters, digits and punctuation only (no control characters).",
    )
    filters.action = filters.choice("action", ACTION_VALUES, "Action: choose one from the list.")
    for name, label in (("from", "From"), ("to", "To")):
        if not raw[name]:
            continue
        day = parse_date(raw[name])
        if day is None:
            errors[name] = f"{label}: enter a real date, like 2025-03-31."
        elif name == "from":
            filters.date_from = day_start(day)
        else:
            filters.date_to = day_end(day)
    if filters.date_from and filters.date_to and filters.date_from >= filters.date_to:
        errors["to"] = "To: the end date must be on or after the start date."
    return filters.cursor()


def scope(tenant: int | None) -> list[ColumnElement[bool]]:
    """The rows the viewer may see: one tenant's, or (operators viewing all) every row."""
    return [] if tenant is None else [AuditEvent.tenant_id == tenant]


def actor_shown(operator: bool) -> ColumnElement[str]:
    """The actor as the viewer may see it: operators see every label; tenants see the platform
    tier's people and keys only as "Platform operator" / "Platform API key" (the platform
    tier's rows are invisible to tenants), and their actor filter matches those words."""
    if operator:
        return AuditEvent.actor_label.expression
    platform_user = AuditEvent.actor_user_id.in_(
        select(AppUser.id).where(AppUser.tenant_id == PLATFORM_TENANT_ID)
    )
    platform_key = AuditEvent.actor_key_id.in_(
        select(ApiKey.id).where(ApiKey.tenant_id == PLATFORM_TENANT_ID)
    )
    return case(
        (platform_user, literal("Platform operator")),
        (platform_key, literal("Platform API key")),
        else_=AuditEvent.actor_label,
    )


@dataclass
class AuditPage:
    rows: list[AuditEvent]
    older: int | None  # the cursor of the next (older) page; None on the last
    actors: dict[int, str] = field(default_factory=dict)  # event id -> the actor as shown


def list_page(filters: AuditFilters, tenant: int | None) -> AuditPage | None:
    """One page of matching events, newest first; None when the cursor is not a visible
    event (a link edited by hand, or one from another tenant's log)."""
    where = scope(tenant)
    actor = actor_shown(is_operator())
    if filters.actor:
        where.append(actor.ilike(f"%{escape_like(filters.actor)}%", escape="\\"))
    if filters.action:
        where.append(AuditEvent.action == filters.action)
    if filters.date_from:
        where.append(AuditEvent.created_time >= filters.date_from)
    if filters.date_to:
        where.append(AuditEvent.created_time < filters.date_to)
    if filters.before is not None:
        cursor_time = db.session.scalar(
            select(AuditEvent.created_time).where(AuditEvent.id == filters.before, *scope(tenant))
        )
        if cursor_time is None:
            return None
        # Same-time rows (one transaction's) go on by id.
        where.append(AuditEvent.created_time <= cursor_time)
        where.append(
            or_(
                AuditEvent.created_time < cursor_time,
                and_(AuditEvent.created_time == cursor_time, AuditEvent.id < filters.before),
            )
        )
    found = db.session.execute(
        select(AuditEvent, actor)
        .where(*where)
        .order_by(AuditEvent.created_time.desc(), AuditEvent.id.desc())
        .limit(PAGE_SIZE + 1)
    ).all()
    rows = [event for event, _ in found]
    older = rows[PAGE_SIZE - 1].id if len(rows) > PAGE_SIZE else None
    actors = {event.id: shown for event, shown in found[:PAGE_SIZE]}
    return AuditPage(rows[:PAGE_SIZE], older, actors)


def action_text(action: str) -> str:
    """The plain label of an action (the stored string, for one this code does not know)."""
    try:
        return AUDIT_ACTION_TEXT[AuditAction(action)]
    except ValueError:
        return action


def target_text(event: AuditEvent) -> str:
    """The target as a reader says it: "Mail record 42", "User 7", "Mail server 3"."""
    if not event.target_type:
        return ""
    noun = TARGET_NOUNS.get(event.target_type) or event.target_type.replace("_", " ").capitalize()
    return f"{noun} {event.target_id}" if event.target_id else noun


def target_link(event: AuditEvent, tenant: int | None) -> str | None:
    """The record page of a target that is a send record of the viewed tenant (the record
    page scopes it again); None for other targets."""
    kind = RECORD_KINDS.get(event.target_type or "")
    record_id = parse_id(event.target_id)
    if kind is None or record_id is None or event.tenant_id is None:
        return None
    if tenant is not None and event.tenant_id != tenant:
        return None
    return url_for(kind.endpoint("show"), record_id=record_id)


@bp.get("/")
@requires(Permission.VIEW_AUDIT)
def index() -> ResponseReturnValue:
    """The audit log, newest first: filter by actor, action and dates (UTC)."""
    tenant = viewed_tenant(allow_all=True)
    filters = parse_filters(request.args)
    page = None if filters.errors else list_page(filters, tenant)
    if page is None and not filters.errors:
        filters.errors["before"] = "That page link is broken: start again from the newest."
    html = render_template(
        "audit/index.html",
        filters=filters,
        page=page,
        actions=ACTIONS,
        **tenant_column(tenant),
        action_text=action_text,
        target_text=target_text,
        target_link=lambda event: target_link(event, tenant),
        page_size=PAGE_SIZE,
    )
    return html, 422 if filters.errors else 200
