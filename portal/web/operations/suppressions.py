"""The suppression list: per tenant and channel, the addresses and numbers we do not send to.

Fed by permanent bounces and complaints (mailbox and provider events) and managed here: search,
add by hand, remove with a reason. Removing keeps the row, so the page also shows who took an
address off the list, when and why.
"""

from __future__ import annotations

from typing import Any

from email_validator import EmailNotValidError, validate_email
from flask import (
    Blueprint,
    Response,
    flash,
    make_response,
    redirect,
    render_template,
    request,
    url_for,
)
from flask.typing import ResponseReturnValue
from sqlalchemy import select

from portal.extensions import db
from portal.messaging.after_send import suppression
from portal.models import Channel, Suppression
from portal.web.access import Permission, requires, user
from portal.web.forms import Form, is_htmx, owned, tier_name, varies, viewed_tier

bp = Blueprint("suppressions", __name__, url_prefix="/suppressions")

LABELS = {
    "channel": "Channel",
    "address": "Address or number",
    "detail": "Note",
    "reason": "Reason",
}
CHANNELS = [(Channel.MAIL.value, "Mail"), (Channel.SMS.value, "SMS")]
PAGE = 200
REASON_LABELS = {"hard_bounce": "Hard bounce", "complaint": "Complaint", "manual": "Added by hand"}


def _rows(tier: int, channel: str | None, q: str) -> list[Suppression]:
    query = select(Suppression).where(
        Suppression.tenant_id == tier, Suppression.removed_at.is_(None)
    )
    if channel:
        query = query.where(Suppression.channel == channel)
    if q:
        escaped = q.lower().replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
        query = query.where(Suppression.address.like(f"%{escaped}%", escape="\\"))
    return list(db.session.scalars(query.order_by(Suppression.created_time.desc()).limit(PAGE)))


def _removed(tier: int) -> list[Suppression]:
    return list(
        db.session.scalars(
            select(Suppression)
            .where(Suppression.tenant_id == tier, Suppression.removed_at.is_not(None))
            .order_by(Suppression.removed_at.desc())
            .limit(20)
        )
    )


def _filters() -> tuple[str | None, str]:
    channel = request.args.get("channel", "")
    q = request.args.get("q", "").replace("\x00", "").strip()[:320]
    return (channel if channel in {c for c, _ in CHANNELS} else None), q


def _page(form: Form, status: int = 200, remove_error: dict[int, str] | None = None) -> Response:
    tier = viewed_tier()
    channel, q = _filters()
    context: dict[str, Any] = {
        "rows": _rows(tier, channel, q),
        "removed": _removed(tier),
        "channel": channel or "",
        "q": q,
        "channels": CHANNELS,
        "reasons": REASON_LABELS,
        "form": form,
        "remove_error": remove_error or {},
        "tier_name": tier_name(tier),
    }
    if is_htmx() and request.method == "GET":
        return varies(make_response(render_template("suppressions/_list.html", **context)))
    response = make_response(render_template("suppressions/index.html", **context), status)
    return varies(response)


@bp.get("/")
@requires(Permission.SUPPRESSION)
def index() -> Response:
    """The active suppressions, searchable by address or number, and the form to add one."""
    return _page(Form({"channel": Channel.MAIL.value}, LABELS))


@bp.post("/")
@requires(Permission.SUPPRESSION)
def create() -> ResponseReturnValue:
    """Add an address or number to the list by hand."""
    tier = viewed_tier()
    form = Form(request.form, LABELS)
    channel = form.choice("channel", [c for c, _ in CHANNELS], Channel.MAIL.value)
    address = form.text("address", required=True, max_len=320)
    detail = form.text("detail", max_len=500)
    normalised = None
    if address is not None:
        try:
            normalised = suppression.normalise(channel, address)
            if channel == Channel.MAIL.value:
                validate_email(normalised, check_deliverability=False)
        except (suppression.InvalidAddress, EmailNotValidError):
            what = "an email address" if channel == Channel.MAIL.value else "a phone number"
            form.fail("address", f"must be {what} (a number in international form, +44…)")
    if not form.ok or normalised is None:
        return _page(form, 422)
    if suppression.active(db.session(), tier, channel, normalised) is not None:
        flash(f"{normalised} is already on the suppression list.", "success")
        return redirect(url_for("suppressions.index"), 303)
    suppression.suppress(
        db.session(),
        tier,
        channel,
        normalised,
        suppression.SuppressionReason.MANUAL,
        detail=detail,
        by=user().email,
    )
    db.session.commit()
    flash(f"{normalised} added to the suppression list: nothing more is sent to it.", "success")
    return redirect(url_for("suppressions.index"), 303)


@bp.post("/<int:suppression_id>/delete")
@requires(Permission.SUPPRESSION)
def delete(suppression_id: int) -> ResponseReturnValue:
    """Take an address off the list; the reason is required and kept."""
    tier = viewed_tier()
    row = owned(Suppression, suppression_id, tier)
    reason = request.form.get("reason", "").replace("\x00", "").strip()[:2000]
    if not reason:
        return _page(
            Form({"channel": Channel.MAIL.value}, LABELS),
            422,
            {row.id: "Reason is required to take an address off the list"},
        )
    if row.removed_at is None:
        suppression.unsuppress(
            db.session(), tier, row.channel, row.address, by=user().email, reason=reason
        )
        db.session.commit()
        flash(f"{row.address} taken off the suppression list.", "success")
    return redirect(url_for("suppressions.index"), 303)
