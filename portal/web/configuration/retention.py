"""Retention and erasure: how long a tier's records are kept, the oldest one
still kept, and "Forget this recipient" for erasure requests.

Turning retention on (or shortening it) asks first and says how many records the next run of
the chore will delete. Forgetting a recipient asks first too; the audit row keeps counts and a
hash of the address, never the address.
"""

from __future__ import annotations

from flask import Blueprint, flash, redirect, render_template, request, url_for
from flask.typing import ResponseReturnValue

from portal.extensions import db
from portal.messaging.after_send import suppression
from portal.messaging.records import retention
from portal.models import AuditAction, Channel, Tenant
from portal.web.access import Permission, audit, audit_tenant, requires
from portal.web.forms import Form, settings, tier_name, viewed_tier

bp = Blueprint("retention", __name__, url_prefix="/retention")

LABELS = {
    "mail_days": "Mail retention",
    "sms_days": "SMS retention",
    "address": "Address or number",
    "channel": "Channel",
}
CHANNELS = {Channel.MAIL: "mail_days", Channel.SMS: "sms_days"}
ATTRIBUTE = {Channel.MAIL: "mail_retention_days", Channel.SMS: "sms_retention_days"}


def _tenant() -> Tenant:
    tenant = db.session.get(Tenant, viewed_tier())
    assert tenant is not None
    return tenant


def _page(form: Form, forget: Form, status: int = 200, **extra: object) -> tuple[str, int]:
    tenant = _tenant()
    rows = []
    for channel in CHANNELS:
        own = getattr(tenant, ATTRIBUTE[channel])
        rows.append(
            {
                "channel": channel,
                "own": own,
                "days": retention.retention_days(tenant, channel, settings()),
                "oldest": retention.oldest_kept(db.session(), tenant.id, channel),
            }
        )
    return render_template(
        "retention/index.html",
        rows=rows,
        form=form,
        forget=forget,
        tier_name=tier_name(tenant.id),
        default=settings().retention_days_default,
        **extra,
    ), status


def _initial() -> Form:
    tenant = _tenant()
    return Form(
        {
            "mail_days": str(tenant.mail_retention_days or ""),
            "sms_days": str(tenant.sms_retention_days or ""),
        },
        LABELS,
    )


@bp.get("/")
@requires(Permission.EDIT_CONFIG)
def index() -> tuple[str, int]:
    """The retention in force per channel, the oldest record kept, and the two forms."""
    return _page(_initial(), Form({}, LABELS))


@bp.post("/")
@requires(Permission.EDIT_CONFIG)
def update() -> ResponseReturnValue:
    """Set the retention; turning it on or shortening it first shows what the next run
    deletes (the confirm button posts again with confirm=yes)."""
    tenant = _tenant()
    form = Form(request.form, LABELS)
    wanted: dict[Channel, int | None] = {}
    for channel, name in CHANNELS.items():
        days = form.number(name, lo=0, hi=36500) if form.raw(name).strip() else None
        problem = retention.days_problem(days)
        if problem:
            form.fail(name, problem)
        wanted[channel] = days
    if not form.ok:
        return _page(form, Form({}, LABELS), 422)
    doomed = {
        channel: retention.count_purgeable(db.session(), tenant.id, channel, days, settings())
        for channel, days in wanted.items()
        if days is not None
        and (
            getattr(tenant, ATTRIBUTE[channel]) is None
            or days < getattr(tenant, ATTRIBUTE[channel])
        )
    }
    if doomed and request.form.get("confirm") != "yes":
        return render_template(
            "retention/confirm.html", wanted=wanted, doomed=doomed, tier_name=tier_name(tenant.id)
        )
    for channel, days in wanted.items():
        setattr(tenant, ATTRIBUTE[channel], days)
    remark = ", ".join(f"{c.value}: {d if d is not None else 'forever'}" for c, d in wanted.items())
    audit_tenant(AuditAction.RETENTION_CHANGE, tenant.id, remark)
    db.session.commit()
    flash("Retention saved; the chore applies it at its next run.", "success")
    return redirect(url_for("retention.index"), 303)


@bp.post("/forget")
@requires(Permission.EDIT_CONFIG)
def forget() -> ResponseReturnValue:
    """Erase one recipient from this tier, after a confirm page that says how many records go."""
    tenant = _tenant()
    form = Form(request.form, LABELS)
    channel = Channel(form.choice("channel", [c.value for c in Channel], Channel.MAIL.value))
    raw = form.text("address", required=True, max_len=320)
    address = None
    if raw is not None:
        try:
            address = suppression.normalise(channel, raw)
        except suppression.InvalidAddress as exc:
            form.fail("address", f"is not valid: {exc}")
    if not form.ok or address is None:
        return _page(_initial(), form, 422)
    if request.form.get("confirm") != "yes":
        count = len(retention.forget_ids(db.session(), tenant.id, channel, address))
        return render_template(
            "retention/forget.html",
            channel=channel,
            address=address,
            count=count,
            tier_name=tier_name(tenant.id),
        )
    done = retention.forget(db.session(), tenant.id, channel, address)
    audit(
        AuditAction.RECIPIENT_FORGET,
        tenant_id=tenant.id,
        target_type=f"{channel.value}_recipient",
        target_id=suppression.hashed(address)[:40],
        remark=", ".join(f"{k}: {v}" for k, v in sorted(done.items())) or "nothing found",
    )
    db.session.commit()
    flash(
        f"Forgotten: {done.get(channel.value + '_records', 0):,} records and their events."
        + (" The suppression stays, by hash only." if done.get("suppressions_hashed") else ""),
        "success",
    )
    return redirect(url_for("retention.index"), 303)
