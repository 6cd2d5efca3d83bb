"""Tenant settings: the tenant's country, in which the search box reads a national phone
number (``07911 123456`` in GB is +447911123456). Unset, the platform's DEFAULT_COUNTRY."""

from __future__ import annotations

from flask import Blueprint, flash, redirect, render_template, request, url_for
from flask.typing import ResponseReturnValue

from portal.extensions import db
from portal.messaging.records.search import country_code
from portal.models import AuditAction, Tenant
from portal.web.access import Permission, audit_tenant, requires
from portal.web.forms import Form, settings, tier_name, viewed_tier

bp = Blueprint("tenant_settings", __name__, url_prefix="/tenant-settings")

LABELS = {"country": "Country"}


def _tenant() -> Tenant:
    tenant = db.session.get(Tenant, viewed_tier())
    assert tenant is not None
    return tenant


def _page(form: Form, status: int = 200) -> tuple[str, int]:
    tenant = _tenant()
    return render_template(
        "tenant_settings/index.html",
        form=form,
        tenant=tenant,
        tier_name=tier_name(tenant.id),
        default=settings().default_country,
    ), status


@bp.get("/")
@requires(Permission.EDIT_CONFIG)
def index() -> tuple[str, int]:
    """The tenant's settings and the form to change them."""
    return _page(Form({"country": _tenant().country or ""}, LABELS))


@bp.post("/")
@requires(Permission.EDIT_CONFIG)
def update() -> ResponseReturnValue:
    """Save the country (empty: the platform default)."""
    tenant = _tenant()
    form = Form(request.form, LABELS)
    raw = form.text("country", max_len=2)
    try:
        country = country_code(raw)
    except ValueError:
        form.fail("country", "must be a two-letter country code, like GB, DE or US")
    if not form.ok:
        return _page(form, 422)
    tenant.country = country
    remark = f"country: {country or 'the platform default'}"
    audit_tenant(AuditAction.CONFIG_UPDATE, tenant.id, remark)
    db.session.commit()
    flash("Settings saved.", "success")
    return redirect(url_for("tenant_settings.index"), 303)
