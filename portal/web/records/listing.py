"""A list of records: the filtered conditions, one keyset page newest first, the columns a
row loads, the tenants' names for the all-tenants view, and the list page's view."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from flask import render_template, request
from flask.typing import ResponseReturnValue
from sqlalchemy import ColumnElement, Select, select, tuple_
from sqlalchemy.orm import load_only

from portal.extensions import db
from portal.models import Tenant
from portal.web.access import viewed_tenant
from portal.web.records.filters import (
    BULK_CAP,
    STATUSES,
    Filters,
    day_end,
    day_start,
    parse_filters,
)
from portal.web.records.kind import Kind, Search

PAGE_SIZE = 50


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


def tenant_column(tenant: int | None) -> dict[str, Any]:
    """What a page's Tenant column needs, for the viewed ``tenant`` (None: all of them):
    ``all_tenants``, whether to show it, and ``names``, what it shows."""
    return {"all_tenants": tenant is None, "names": tenant_names(tenant)}


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
    older = rows[PAGE_SIZE - 1].id if len(rows) > PAGE_SIZE else None
    return RecordPage(rows[:PAGE_SIZE], older, search, tenant_names(tenant))


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
        bulk_cap=BULK_CAP,
    )
    return html, 422 if filters.errors else 200
