"""Monthly quotas: ceilings per tenant (operators edit them), this month's usage, history.

Everyone with VIEW_QUOTA sees their own tenant's usage; operators (EDIT_QUOTA) see and edit
every tenant's and the platform tier's. An empty ceiling means the setting's default
(MAIL_MONTHLY_DEFAULT / SMS_MONTHLY_DEFAULT), which may itself be "no ceiling".
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from flask import Blueprint, abort, current_app, flash, redirect, render_template, request, url_for
from flask.typing import ResponseReturnValue
from flask_login import current_user
from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError

from portal.config import Settings
from portal.extensions import db
from portal.messaging.sending.quota import current_month
from portal.models import (
    AuditAction,
    MailSendRecord,
    SmsSendRecord,
    Tenant,
    TenantMessageQuota,
    TenantMessageUsage,
)
from portal.web.access import Permission, audit_tenant, can, requires, user
from portal.web.forms import MAX_ID, Form, form_data

bp = Blueprint("quotas", __name__, url_prefix="/quotas")

LABELS = {"mail_monthly_limit": "Mail per month", "sms_monthly_limit": "SMS per month"}
HISTORY_MONTHS = 36


@dataclass(frozen=True)
class Gauge:
    """One channel's use of one month against the ceiling in force."""

    used: int
    limit: int | None  # in force: the tenant's own, else the default; None: no ceiling
    own: int | None  # the tenant's own ceiling (None: the default applies)

    @property
    def percent(self) -> int | None:
        if self.limit is None:
            return None
        if self.limit == 0:
            return 100 if self.used else 0
        return round(100 * self.used / self.limit)

    @property
    def left(self) -> int | None:
        return None if self.limit is None else max(self.limit - self.used, 0)


@dataclass(frozen=True)
class TenantUsage:
    tenant_id: int
    name: str
    mail: Gauge
    sms: Gauge
    updated_by: str | None


def _settings() -> Settings:
    settings: Settings = current_app.config["SETTINGS"]
    return settings


def _usages(tenants: list[tuple[int, str]], month: str) -> list[TenantUsage]:
    """Usage of ``month`` for each tenant, in two queries whatever the number of tenants."""
    ids = [tid for tid, _ in tenants]
    quotas = {
        q.tenant_id: q
        for q in db.session.scalars(
            select(TenantMessageQuota).where(TenantMessageQuota.tenant_id.in_(ids))
        )
    }
    counts = {
        u.tenant_id: u
        for u in db.session.scalars(
            select(TenantMessageUsage).where(
                TenantMessageUsage.tenant_id.in_(ids), TenantMessageUsage.month == month
            )
        )
    }
    settings = _settings()
    result = []
    for tenant_id, name in tenants:
        quota, count = quotas.get(tenant_id), counts.get(tenant_id)
        mail_own = quota.mail_monthly_limit if quota else None
        sms_own = quota.sms_monthly_limit if quota else None
        result.append(
            TenantUsage(
                tenant_id=tenant_id,
                name="Platform tier" if tenant_id < 0 else name,
                mail=Gauge(
                    count.mail_count if count else 0,
                    mail_own if mail_own is not None else settings.mail_monthly_default,
                    mail_own,
                ),
                sms=Gauge(
                    count.sms_count if count else 0,
                    sms_own if sms_own is not None else settings.sms_monthly_default,
                    sms_own,
                ),
                updated_by=quota.updated_by if quota else None,
            )
        )
    return result


def _visible_tenant(tenant_id: int) -> tuple[int, str]:
    """The tenant, if this user may see its quota: operators any, everyone else their own."""
    if not can(Permission.EDIT_QUOTA) and tenant_id != int(current_user.tenant_id):
        abort(404)
    if not (-1 <= tenant_id <= MAX_ID):
        abort(404)
    tenant = db.session.get(Tenant, tenant_id)
    if tenant is None:
        abort(404)
    return tenant.id, tenant.name


def _show(tenant_id: int) -> str:
    tenant = _visible_tenant(tenant_id)
    month = current_month()
    (usage,) = _usages([tenant], month)
    history = db.session.scalars(
        select(TenantMessageUsage)
        .where(TenantMessageUsage.tenant_id == tenant_id)
        .order_by(TenantMessageUsage.month.desc())
        .limit(HISTORY_MONTHS)
    ).all()
    return render_template(
        "quotas/show.html",
        usage=usage,
        month=month,
        history=history,
        tests=_test_sends(tenant_id, month),
    )


def _test_sends(tenant_id: int, month: str) -> dict[str, int]:
    """Test sends from the template editor prepared this month, per channel: charged like
    any send and counted in the usage above, shown apart."""
    start = datetime.strptime(month, "%Y-%m").replace(tzinfo=UTC)
    counts = {}
    for channel, model in (("mail", MailSendRecord), ("sms", SmsSendRecord)):
        counts[channel] = (
            db.session.scalar(
                select(func.count())
                .select_from(model)
                .where(
                    model.tenant_id == tenant_id,
                    model.is_test.is_(True),
                    model.prepared_at >= start,
                )
            )
            or 0
        )
    return counts


@bp.get("/")
@requires(Permission.VIEW_QUOTA)
def index() -> str:
    """Operators: every tenant's ceilings and this month's usage. Others: their own."""
    if not can(Permission.EDIT_QUOTA):
        return _show(int(current_user.tenant_id))
    tenants = [(tid, name) for tid, name in db.session.execute(select(Tenant.id, Tenant.name))]
    tenants.sort(key=lambda t: (t[0] >= 0, t[1].lower()))  # the platform tier first
    month = current_month()
    return render_template(
        "quotas/index.html", usages=_usages(tenants, month), month=month, settings=_settings()
    )


@bp.get("/<int(signed=True):tenant_id>")
@requires(Permission.VIEW_QUOTA)
def show(tenant_id: int) -> str:
    """One tenant's usage this month and by month."""
    return _show(tenant_id)


def _edit_page(tenant: tuple[int, str], form: Form, status: int = 200) -> tuple[str, int]:
    (usage,) = _usages([tenant], current_month())
    return render_template("quotas/edit.html", usage=usage, form=form, settings=_settings()), status


@bp.get("/<int(signed=True):tenant_id>/edit")
@requires(Permission.EDIT_QUOTA)
def edit(tenant_id: int) -> tuple[str, int]:
    """The ceilings form."""
    tenant = _visible_tenant(tenant_id)
    quota = db.session.scalar(
        select(TenantMessageQuota).where(TenantMessageQuota.tenant_id == tenant_id)
    )
    form = Form(
        form_data(
            mail_monthly_limit=quota.mail_monthly_limit if quota else None,
            sms_monthly_limit=quota.sms_monthly_limit if quota else None,
        ),
        LABELS,
    )
    return _edit_page(tenant, form)


def _limit_text(limit: int | None) -> str:
    return "default" if limit is None else f"{limit:,}"


def _save(tenant_id: int, mail: int | None, sms: int | None) -> None:
    """Write the ceilings and their audit row (old -> new) in one commit."""
    quota = db.session.scalar(
        select(TenantMessageQuota).where(TenantMessageQuota.tenant_id == tenant_id)
    )
    if quota is None:
        quota = TenantMessageQuota(tenant_id=tenant_id)
        db.session.add(quota)
    changes = [
        f"{LABELS[name]}: {_limit_text(getattr(quota, name))} -> {_limit_text(new)}"
        for name, new in (("mail_monthly_limit", mail), ("sms_monthly_limit", sms))
    ]
    audit_tenant(AuditAction.QUOTA_CHANGE, tenant_id, "; ".join(changes))
    quota.mail_monthly_limit = mail
    quota.sms_monthly_limit = sms
    quota.updated_by = user().email
    db.session.commit()


@bp.post("/<int(signed=True):tenant_id>")
@requires(Permission.EDIT_QUOTA)
def update(tenant_id: int) -> ResponseReturnValue:
    """Save the ceilings; the next preparation checks against them."""
    tenant = _visible_tenant(tenant_id)
    form = Form(request.form, LABELS)
    mail = form.number("mail_monthly_limit")
    sms = form.number("sms_monthly_limit")
    if not form.ok:
        return _edit_page(tenant, form, 422)
    try:
        _save(tenant_id, mail, sms)
    except IntegrityError:  # created by someone else meanwhile: save over theirs
        db.session.rollback()
        _save(tenant_id, mail, sms)
    name = "the platform tier" if tenant_id < 0 else tenant[1]
    flash(f"Quota of {name} saved.", "success")
    return redirect(url_for("quotas.index"), 303)
