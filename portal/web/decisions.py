"""Needs a decision: every record whose outcome a person has to settle (issue 13, part 4).

Seed 002: an ambiguous attempt (the request was written, no answer came) is never erased by a
later outcome. So besides every Uncertain record (held, never resent: Resolve it), this lists
every Failed, DeadLetter and Suppressed record with an ambiguous attempt that nobody has
resolved: its status says it was not sent, yet it may have been. Mail and SMS together; each
row links to its record page, where Resolve (or a Retry that warns first) applies.

The list walks the record tables' (tenant_id, status, id) index once per status, newest
first, with a keyset cursor per channel (``channel`` and ``before``); across every tenant the
same walk runs under ``tenant_scope``. The ambiguous filter is applied to the rows each walk
reads, so the cost grows with the Failed/DeadLetter/Suppressed records of the viewed tenant
that are not ambiguous (see bench figures in the README's pages table).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flask import Blueprint, render_template, request
from flask.typing import ResponseReturnValue
from sqlalchemy import ColumnElement, Select, func, literal, select, union_all
from sqlalchemy.orm import load_only

from portal.extensions import db
from portal.models import SendStatus
from portal.web import explain
from portal.web.access import Permission, requires, viewed_tenant
from portal.web.mail_records import (
    COMMON_LIST_COLUMNS,
    MAIL,
    PAGE_SIZE,
    Kind,
    parse_id,
    tenant_names,
    tenant_scope,
)
from portal.web.sms_records import SMS

bp = Blueprint("decisions", __name__, url_prefix="/decisions")

KINDS: dict[str, Kind] = {"mail": MAIL, "sms": SMS}
COUNT_CAP = 10_000
# Statuses that say "not sent" although an ambiguous attempt may have been delivered.
NOT_SENT = (SendStatus.FAILED, SendStatus.DEAD_LETTER, SendStatus.SUPPRESSED)
DECISION_COLUMNS = (
    "ambiguous_at",
    "ambiguous_reason",
    "updated_time",
    "scope",
)


def _parts(kind: Kind, tenant: int | None) -> list[list[ColumnElement[bool]]]:
    """The WHERE of each index walk: one per status, so each is a (tenant_id, status, id)
    range read. Together they are the rule: Uncertain, or not-sent with an unresolved
    ambiguous attempt (an Uncertain record resolved as failed is Failed with ``resolution``
    set: decided, so off the list)."""
    model = kind.model
    scope = tenant_scope(model.tenant_id, tenant)
    parts = [[scope, model.status == SendStatus.UNCERTAIN.value]]
    for status in NOT_SENT:
        parts.append(
            [
                scope,
                model.status == status.value,
                model.ambiguous_attempt.is_(True),
                model.resolution.is_(None),
            ]
        )
    return parts


def count(kind: Kind, tenant: int | None) -> tuple[int, bool]:
    """How many of ``kind``'s records need a decision (each walk stops at COUNT_CAP + 1), and
    whether the figure is capped; one round trip."""
    model = kind.model
    columns = []
    for where in _parts(kind, tenant):
        inner = select(literal(1)).select_from(model).where(*where).limit(COUNT_CAP + 1)
        columns.append(select(func.count()).select_from(inner.subquery()).scalar_subquery())
    counts = [int(n or 0) for n in db.session.execute(select(*columns)).one()]
    total = sum(counts)
    return min(total, COUNT_CAP), total > COUNT_CAP


@dataclass
class Section:
    kind: Kind
    rows: list[Any]
    older: int | None  # the cursor of this channel's next page


def section(kind: Kind, tenant: int | None, before: int | None) -> Section:
    """One page of ``kind``'s records needing a decision, newest first."""
    model = kind.model
    walks: list[Select[Any]] = []
    for where in _parts(kind, tenant):
        stmt = select(model.id).where(*where)
        if before is not None:
            stmt = stmt.where(model.id < before)
        walks.append(stmt.order_by(model.id.desc()).limit(PAGE_SIZE + 1))
    ids = union_all(*(w.subquery().select() for w in walks)).subquery()
    columns = COMMON_LIST_COLUMNS + kind.list_columns + DECISION_COLUMNS
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
    return Section(kind, rows[:PAGE_SIZE], older)


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
        all_tenants=tenant is None,
        names=tenant_names(tenant),
        label=explain.label,
    )
