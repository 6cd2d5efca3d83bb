"""Needs a decision: every record whose outcome a person has to settle.

Seed 002: an ambiguous attempt (the request was written, no answer came) is never erased by a
later outcome. So besides every Uncertain record (held, never resent: Resolve it), this lists
every Failed, DeadLetter and Suppressed record with an ambiguous attempt that nobody has
resolved: its status says it was not sent, yet it may have been. Mail and SMS together; each
row links to its record page, where Resolve (or a Retry that warns first) applies.

The list and the count walk one partial index per record table (``idx_*_needs_decision``,
migration 0018), which holds only these records, newest first, with a keyset cursor per
channel (``channel`` and ``before``); across every tenant the same walk runs under
``tenant_scope``. Their cost follows the records listed, not the tenant's other failures.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flask import Blueprint, render_template, request
from flask.typing import ResponseReturnValue
from sqlalchemy import ColumnElement, TextClause, func, literal, select, text
from sqlalchemy.orm import load_only

from portal.extensions import db
from portal.messaging.records import diagnosis
from portal.messaging.records.diagnosis import Diagnosis
from portal.models import Channel
from portal.models.record import NEEDS_DECISION
from portal.web.access import Permission, requires, viewed_tenant
from portal.web.records import explain
from portal.web.records.filters import parse_id
from portal.web.records.kind import Kind, tenant_scope
from portal.web.records.listing import COMMON_LIST_COLUMNS, PAGE_SIZE, tenant_column
from portal.web.records.mail_records import MAIL
from portal.web.records.record_page import diagnoses, viewer_role
from portal.web.records.sms_records import SMS

bp = Blueprint("decisions", __name__, url_prefix="/decisions")

KINDS: dict[str, Kind] = {"mail": MAIL, "sms": SMS}
COUNT_CAP = 10_000
DECISION_COLUMNS = (
    "ambiguous_at",
    "ambiguous_reason",
    "updated_time",
    "scope",
)


def _needing(kind: Kind, tenant: int | None) -> list[ColumnElement[bool] | TextClause]:
    """The WHERE of the one walk: the rule (Uncertain, or not sent with an unresolved
    ambiguous attempt; an Uncertain record resolved as failed is Failed with ``resolution``
    set: decided, so off the list) written as the partial index's own predicate, so the walk
    is that index's (tenant_id, id) range, whatever the tenant's other records."""
    return [tenant_scope(kind.model.tenant_id, tenant), text(f"({NEEDS_DECISION})")]


def count(kind: Kind, tenant: int | None) -> tuple[int, bool]:
    """How many of ``kind``'s records need a decision (the walk stops at COUNT_CAP + 1), and
    whether the figure is capped; one round trip."""
    model = kind.model
    inner = select(literal(1)).select_from(model).where(*_needing(kind, tenant))
    total = int(
        db.session.execute(
            select(func.count()).select_from(inner.limit(COUNT_CAP + 1).subquery())
        ).scalar_one()
    )
    return min(total, COUNT_CAP), total > COUNT_CAP


@dataclass
class Section:
    kind: Kind
    rows: list[Any]
    older: int | None  # the cursor of this channel's next page
    diagnoses: dict[int, Diagnosis]  # each row's: what to do, and who can


def section(kind: Kind, tenant: int | None, before: int | None) -> Section:
    """One page of ``kind``'s records needing a decision, newest first."""
    model = kind.model
    walk = select(model.id).where(*_needing(kind, tenant))
    if before is not None:
        walk = walk.where(model.id < before)
    ids = walk.order_by(model.id.desc()).limit(PAGE_SIZE + 1).subquery()
    columns = tuple(
        dict.fromkeys(COMMON_LIST_COLUMNS + kind.list_columns + DECISION_COLUMNS + _needs(kind))
    )
    rows: list[Any] = list(
        db.session.scalars(
            select(model)
            .options(load_only(*(getattr(model, c) for c in columns)))
            .where(model.id.in_(select(ids.c.id)))
            .order_by(model.id.desc())
            .limit(PAGE_SIZE + 1)
        )
    )
    older = rows[PAGE_SIZE - 1].id if len(rows) > PAGE_SIZE else None
    shown = rows[:PAGE_SIZE]
    return Section(kind, shown, older, diagnoses(kind, shown))


def _needs(kind: Kind) -> tuple[str, ...]:
    """The columns a row's diagnosis reads."""
    own = diagnosis.MAIL_COLUMNS if kind.channel is Channel.MAIL else diagnosis.SMS_COLUMNS
    return diagnosis.COLUMNS + own


@bp.get("/")
@requires(Permission.VIEW_RECORDS)
def index() -> ResponseReturnValue:
    """Records a person must decide about: Uncertain ones, and not-sent ones with an ambiguous
    attempt; mail and SMS, newest first, each linking to its record page."""
    tenant = viewed_tenant(allow_all=True)
    only = request.args.get("channel", "")
    before = parse_id(request.args.get("before"))
    if only not in ("", *KINDS) or (request.args.get("before") and before is None):
        return render_template("decisions/index.html", sections=[], bad=True), 422
    wanted = [KINDS[only]] if only else list(KINDS.values())
    sections = [section(kind, tenant, before if only else None) for kind in wanted]
    return render_template(
        "decisions/index.html",
        sections=sections,
        bad=False,
        only=only,
        **tenant_column(tenant),
        label=explain.label,
        who_can=lambda found: explain.who_can(found, viewer_role()),
    )
