"""The inbox: notices for tenant admins and platform operators.

A user's inbox is their own tier's (platform operators: the platform tier's); read marks are
per user. The header's bell shows the unread count and refreshes itself by htmx.
"""

from __future__ import annotations

from flask import Blueprint, flash, make_response, redirect, render_template, request, url_for
from flask.typing import ResponseReturnValue
from sqlalchemy import select

from portal.extensions import db
from portal.messaging.after_send.inbox import unread_count
from portal.models import Notification, NotificationRead, Role
from portal.tenancy import PLATFORM_TENANT_ID
from portal.web.access import Permission, requires, user
from portal.web.forms import is_htmx, owned, varies

bp = Blueprint("inbox", __name__, url_prefix="/inbox")

PAGE = 100


def _tier() -> int:
    me = user()
    return PLATFORM_TENANT_ID if me.role == Role.PLATFORM_OPERATOR.value else me.tenant_id


def _read_ids(ids: list[int]) -> set[int]:
    if not ids:
        return set()
    return set(
        db.session.scalars(
            select(NotificationRead.notification_id).where(
                NotificationRead.user_id == user().id,
                NotificationRead.notification_id.in_(ids),
            )
        )
    )


@bp.get("/")
@requires(Permission.API_KEYS)
def index() -> ResponseReturnValue:
    """The newest notices of the user's tier, unread first marked."""
    notices = list(
        db.session.scalars(
            select(Notification)
            .where(Notification.tenant_id == _tier())
            .order_by(Notification.id.desc())
            .limit(PAGE)
        )
    )
    read = _read_ids([n.id for n in notices])
    return render_template("inbox/index.html", notices=notices, read=read)


@bp.get("/bell")
@requires(Permission.API_KEYS)
def bell() -> ResponseReturnValue:
    """The header's inbox link with the unread count (a fragment)."""
    unread = unread_count(db.session(), _tier(), user().id)
    return varies(make_response(render_template("inbox/_bell.html", unread=unread)))


def _mark(ids: list[int]) -> None:
    known = _read_ids(ids)
    for notification_id in ids:
        if notification_id not in known:
            db.session.add(NotificationRead(notification_id=notification_id, user_id=user().id))
    db.session.commit()


@bp.post("/<int:notification_id>/read")
@requires(Permission.API_KEYS)
def read(notification_id: int) -> ResponseReturnValue:
    """Mark one notice read (htmx: the notice again, read)."""
    notice = owned(Notification, notification_id, _tier())
    _mark([notice.id])
    if is_htmx():
        return varies(
            make_response(render_template("inbox/_notice.html", n=notice, read={notice.id}))
        )
    return varies(make_response(redirect(url_for("inbox.index"), 303)))


@bp.post("/mail")
@requires(Permission.API_KEYS)
def mail() -> ResponseReturnValue:
    """Turn notices by mail on or off for the signed-in user (``on=1`` / anything else)."""
    me = user()
    me.notices_by_mail = request.form.get("on") == "1"
    db.session.commit()
    flash(
        "New notices are mailed to you too."
        if me.notices_by_mail
        else "Notices are no longer mailed to you.",
        "success",
    )
    return redirect(url_for("inbox.index"), 303)


@bp.post("/read-all")
@requires(Permission.API_KEYS)
def read_all() -> ResponseReturnValue:
    """Mark every notice of the tier read."""
    ids = list(db.session.scalars(select(Notification.id).where(Notification.tenant_id == _tier())))
    _mark(ids)
    return redirect(url_for("inbox.index"), 303)
