"""One page per recipient: everything sent to one address or number, how it went, whether it is
suppressed, and what to do about the latest failure ("it never arrived").

The URL carries an opaque token, an HMAC of tenant, channel and address keyed by SECRET_KEY,
never the address, so addresses stay out of URLs, access logs and Referer headers. Pages that
link to a recipient call ``recipient_url`` (a template global); the token rows it collects are
written after the request (insert-only, idempotent), and this page finds the address from its
token within the viewed tenant only: another tenant's token is a 404.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from flask import Blueprint, Flask, Response, abort, current_app, g, render_template, request
from flask import url_for as flask_url_for
from flask.typing import ResponseReturnValue
from sqlalchemy import null, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import load_only

from portal.extensions import db
from portal.messaging.after_send import suppression
from portal.messaging.records.addresses import AddressError, email_address
from portal.models import (
    Channel,
    DeliveryEvent,
    MailSendRecipient,
    MailSendRecord,
    RecipientToken,
    SendStatus,
    SmsSendRecord,
    Tenant,
)
from portal.web.access import Permission, can, requires, viewed_tenant
from portal.web.records import explain
from portal.web.records.filters import parse_id
from portal.web.records.kind import Kind, visible
from portal.web.records.listing import COMMON_LIST_COLUMNS, PAGE_SIZE, tenant_column
from portal.web.records.mail_records import MAIL
from portal.web.records.record_page import diagnoses, viewer_role
from portal.web.records.sms_records import SMS

bp = Blueprint("recipients", __name__, url_prefix="/recipients")

KINDS = {Channel.MAIL.value: MAIL, Channel.SMS.value: SMS}
# The figures (delivery rate, last delivered, bounces, read receipts, latest failure) read this
# many of the recipient's newest records: the page costs the same for a recipient with years
# of mail.
RECENT = 500
FAILED = (
    SendStatus.FAILED.value,
    SendStatus.DEAD_LETTER.value,
    SendStatus.SUPPRESSED.value,
)
SETTLED = (SendStatus.SENT.value, *FAILED)
BAD_EVENTS = ("bounced", "complained")


def token_for(tenant_id: int, channel: str, address: str) -> str:
    """The recipient's opaque token: HMAC-SHA256 of tenant, channel and normalised address."""
    key = str(current_app.config["SECRET_KEY"]).encode()
    message = f"recipient\x00{tenant_id}\x00{channel}\x00{address}".encode()
    digest = hmac.new(key, message, hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")


def normalised(channel: str, address: str) -> str:
    """The form the recipient tables hold: mail lower-cased as acceptance keeps it (the
    recipient rows are), SMS in E.164 as stored."""
    if channel == Channel.MAIL.value:
        try:
            return email_address(address, "address").lower()
        except AddressError:
            return address.lower()
    return address


def recipient_url(tenant_id: int, channel: str, address: str | None) -> str | None:
    """The recipient page's URL (a template global); its token row is written after the
    request. None when there is no address to link."""
    if not address:
        return None
    address = normalised(channel, address)
    token = token_for(tenant_id, channel, address)
    pending: dict[str, tuple[int, str, str]] = g.setdefault("recipient_tokens", {})
    pending[token] = (tenant_id, channel, address)
    return flask_url_for("recipients.show", token=token)


def _save_tokens(response: Response) -> Response:
    """Write the tokens this request linked to (one statement; rows already there stay)."""
    pending: dict[str, tuple[int, str, str]] | None = g.pop("recipient_tokens", None)
    if not pending:
        return response
    rows = [
        {"token": t, "tenant_id": tid, "channel": ch, "address": a}
        for t, (tid, ch, a) in pending.items()
    ]
    dialect = db.engine.dialect.name
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    stmt = insert(RecipientToken).on_conflict_do_nothing(index_elements=["token"])
    with db.engine.begin() as connection:  # its own short transaction, whatever the view did
        connection.execute(stmt, rows)
    return response


def init_app(app: Flask) -> None:
    app.add_template_global(recipient_url, "recipient_url")
    app.after_request(_save_tokens)


@dataclass
class Figures:
    """How this recipient's newest RECENT records went."""

    looked_at: int
    delivered: int
    failed: int
    last_delivered: datetime | None

    @property
    def rate(self) -> str:
        settled = self.delivered + self.failed
        if not settled:
            return "—"
        return f"{100 * self.delivered / settled:.0f} %"


def _find(token: str, tenant: int | None) -> RecipientToken:
    """The recipient behind ``token`` if the viewer may see it; 404 otherwise."""
    if len(token) > 64 or "\x00" in token:  # PostgreSQL refuses a NUL in a query outright
        abort(404)
    stmt = select(RecipientToken).where(RecipientToken.token == token)
    if tenant is not None:
        stmt = stmt.where(RecipientToken.tenant_id == tenant)
    row = db.session.scalar(stmt)
    if row is None or row.channel not in KINDS:
        abort(404)
    if not hmac.compare_digest(token, token_for(row.tenant_id, row.channel, row.address)):
        abort(404)  # a row written under another SECRET_KEY: not ours to trust
    return row


def _records_of(kind: Kind, who: RecipientToken) -> Any:
    """The WHERE of this recipient's records (an index walk either way)."""
    if kind.channel is Channel.MAIL:
        ids = select(MailSendRecipient.record_id).where(
            MailSendRecipient.tenant_id == who.tenant_id,
            MailSendRecipient.address == who.address,
        )
        return (MailSendRecord.tenant_id == who.tenant_id) & MailSendRecord.id.in_(ids)
    return (SmsSendRecord.tenant_id == who.tenant_id) & (SmsSendRecord.phone_number == who.address)


@bp.get("/<token>")
@requires(Permission.VIEW_RECORDS)
def show(token: str) -> ResponseReturnValue:
    """Everything sent to one recipient, newest first, with how it went and what to do."""
    tenant = viewed_tenant(allow_all=True)
    who = _find(token, tenant)
    kind = KINDS[who.channel]
    model = kind.model
    mine = _records_of(kind, who)
    before = parse_id(request.args.get("before"))
    columns = COMMON_LIST_COLUMNS + kind.list_columns
    extra = ("sent_at", "read_at") if kind.channel is Channel.MAIL else ("sent_at",)
    stmt = select(model).options(load_only(*(getattr(model, c) for c in columns + extra)))
    if before is not None:
        stmt = stmt.where(model.id < before)
    rows: list[Any] = list(
        db.session.scalars(stmt.where(mine).order_by(model.id.desc()).limit(PAGE_SIZE + 1))
    )
    older = rows[PAGE_SIZE - 1].id if len(rows) > PAGE_SIZE else None

    recent = (
        select(model.id, model.status, model.sent_at, model.error_code, model.error_message)
        .add_columns(model.ambiguous_attempt, model.updated_time)
        .add_columns(MailSendRecord.read_at if kind.channel is Channel.MAIL else null())
        .where(mine)
        .order_by(model.id.desc())
        .limit(RECENT)
    )
    window = db.session.execute(recent).all()
    figures = Figures(
        looked_at=len(window),
        delivered=sum(1 for r in window if r.status == SendStatus.SENT.value),
        failed=sum(1 for r in window if r.status in FAILED),
        last_delivered=max(
            (r.sent_at for r in window if r.status == SendStatus.SENT.value and r.sent_at),
            default=None,
        ),
    )
    latest_failure = next((r for r in window if r.status in FAILED), None)
    found = None
    if latest_failure is not None:
        # The record page's own diagnosis of it: the same cause, verdict and next step.
        failed = db.session.scalar(visible(kind, [latest_failure.id], who.tenant_id))
        found = diagnoses(kind, [failed])[failed.id] if failed is not None else None
    window_ids = [r.id for r in window]
    events = (
        list(
            db.session.scalars(
                select(DeliveryEvent)
                .where(
                    DeliveryEvent.channel == kind.channel.value,
                    DeliveryEvent.record_id.in_(window_ids),
                    DeliveryEvent.event_type.in_(BAD_EVENTS),
                )
                .order_by(DeliveryEvent.id.desc())
                .limit(20)
            )
        )
        if window_ids
        else []
    )
    reads = [(r.id, r[-1]) for r in window if r[-1] is not None][:20]
    suppressed = suppression.active(db.session(), who.tenant_id, who.channel, who.address)
    html = render_template(
        "recipients/show.html",
        who=who,
        kind=kind,
        rows=rows[:PAGE_SIZE],
        older=older,
        before=before,
        figures=figures,
        recent=RECENT,
        latest_failure=latest_failure,
        diagnosis=found,
        tone=explain.tone(latest_failure.status, found) if found and latest_failure else None,
        who_can=explain.who_can(found, viewer_role()) if found else None,
        events=events,
        reads=reads,
        suppressed=suppressed,
        can_unsuppress=can(Permission.SUPPRESSION) and can(Permission.EDIT_CONFIG),
        tenant_name=db.session.scalar(select(Tenant.name).where(Tenant.id == who.tenant_id)),
        **tenant_column(tenant),
        token=token,
    )
    # The page names the address: never let a link out of it carry the URL elsewhere.
    return html, 200, {"Referrer-Policy": "same-origin"}
