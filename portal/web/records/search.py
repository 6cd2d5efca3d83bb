"""The one results page of the search box: mail and SMS together, newest first, saying what the
text was read as ("phone number +447911123456 (GB)", "mail subject containing “Invoice”").

Each channel is read newest first by id (its own keyset, an index walk through the side tables
``search_box`` chose), and the two are merged by creation time; the cursor carries each
channel's position, so a page never skips or repeats a record of either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flask import Blueprint, render_template, request
from flask.typing import ResponseReturnValue
from sqlalchemy import ColumnElement, select
from sqlalchemy.orm import load_only

from portal.extensions import db
from portal.models import Channel
from portal.web.access import Permission, requires, viewed_tenant
from portal.web.records.filters import parse_id, search_problem
from portal.web.records.kind import Kind
from portal.web.records.listing import COMMON_LIST_COLUMNS, PAGE_SIZE, tenant_column
from portal.web.records.mail_records import MAIL
from portal.web.records.search_box import understood, where
from portal.web.records.sms_records import SMS

bp = Blueprint("search", __name__, url_prefix="/search")

KINDS = (MAIL, SMS)
END = "end"  # a channel's cursor once it has nothing older


@dataclass
class Hit:
    """One result row: its channel's ``Kind`` and the record."""

    kind: Kind
    record: Any

    @property
    def recipient(self) -> str | None:
        r = self.record
        if self.kind.channel is Channel.SMS:
            return str(r.phone_number)
        addresses = (r.to_addrs or []) + (r.cc_addrs or []) + (r.bcc_addrs or [])
        return str(addresses[0]) if addresses else None

    @property
    def preview(self) -> str | None:
        r = self.record
        if self.kind.channel is Channel.SMS:
            return r.rendered_content or r.content  # type: ignore[no-any-return]
        return r.rendered_subject or r.subject  # type: ignore[no-any-return]


def _cursor(raw: str | None) -> int | str | None:
    """A channel's position: an id (older than it), END, or None (from the newest)."""
    if raw == END:
        return END
    return parse_id(raw)


def _newest(
    kind: Kind, condition: ColumnElement[bool], tenant: int | None, before: int | None
) -> list[Any]:
    """PAGE_SIZE + 1 of this channel's matches, newest first (its id order)."""
    model = kind.model
    columns = (*COMMON_LIST_COLUMNS, *kind.list_columns, "business_key")
    stmt = select(model).options(load_only(*(getattr(model, c) for c in columns)))
    stmt = stmt.where(condition)
    if tenant is not None:
        stmt = stmt.where(model.tenant_id == tenant)
    if before is not None:
        stmt = stmt.where(model.id < before)
    return list(db.session.scalars(stmt.order_by(model.id.desc()).limit(PAGE_SIZE + 1)))


def merge(
    found: dict[Channel, list[Any]], positions: dict[Channel, int | str | None]
) -> tuple[list[Hit], dict[Channel, str] | None]:
    """Take the newest PAGE_SIZE of both channels' lists (each newest first by id), keeping
    each channel's order; the cursor of the next page (None: nothing older anywhere)."""
    heads = {channel: 0 for channel in found}
    hits: list[Hit] = []
    kinds = {k.channel: k for k in KINDS}
    while len(hits) < PAGE_SIZE:
        live = [c for c in found if heads[c] < len(found[c])]
        if not live:
            break
        channel = max(live, key=lambda c: found[c][heads[c]].created_time)
        hits.append(Hit(kinds[channel], found[channel][heads[channel]]))
        heads[channel] += 1
    cursor: dict[Channel, str] = {}
    more = False
    for channel, rows in found.items():
        taken = heads[channel]
        if taken < len(rows):  # rows left over on this side: go on from the last one taken
            more = True
            position = positions.get(channel)
            cursor[channel] = str(rows[taken - 1].id) if taken else str(position or "")
        else:  # everything fetched was shown: older ones exist only if the read was full
            cursor[channel] = END if len(rows) <= PAGE_SIZE else str(rows[-1].id)
    return hits, (cursor if more else None)


@bp.get("/")
@requires(Permission.VIEW_RECORDS)
def index() -> ResponseReturnValue:
    """Mail and SMS matching the box, newest first, with what the text was read as."""
    tenant = viewed_tenant(allow_all=True)
    q = (request.args.get("q") or "").strip()
    error = search_problem(q)
    meaning = understood(q, tenant) if q and not error else None
    positions: dict[Channel, int | str | None] = {
        k.channel: _cursor(request.args.get(f"{k.channel.value}_before")) for k in KINDS
    }
    hits: list[Hit] = []
    older: dict[Channel, str] | None = None
    searched: list[Kind] = []
    if meaning is not None:
        found: dict[Channel, list[Any]] = {}
        for kind in KINDS:
            position = positions[kind.channel]
            before = position if isinstance(position, int) else None
            # A page needs at most PAGE_SIZE + 1 of each term's newest (each its own index).
            condition = where(meaning, kind.channel, tenant, before=before, newest=PAGE_SIZE + 1)
            if condition is None:
                continue
            searched.append(kind)
            if position == END:
                found[kind.channel] = []
                continue
            found[kind.channel] = _newest(kind, condition, tenant, before)
        hits, older = merge(found, positions)
    paged = any(p is not None for p in positions.values())
    html = render_template(
        "search/index.html",
        q=q,
        error=error,
        meaning=meaning,
        hits=hits,
        searched=searched,
        older={f"{c.value}_before": v for c, v in older.items()} if older else None,
        paged=paged,
        **tenant_column(tenant),
    )
    return html, 422 if error else 200
