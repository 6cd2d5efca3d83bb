"""The tenant an operator is looking at (everyone else only ever sees their own)."""

from __future__ import annotations

from flask import Blueprint, abort, redirect, request, session, url_for
from sqlalchemy import select
from werkzeug.wrappers import Response

from portal.extensions import db
from portal.models import Tenant
from portal.web.access import ALL_TENANTS, Permission, requires
from portal.web.security import safe_next

bp = Blueprint("tenants", __name__, url_prefix="/tenants")


@bp.post("/view")
@requires(Permission.SWITCH_TENANT)
def update() -> Response:
    """Switch the tenant shown: a tenant id, the platform tier (-1), or all (records only)."""
    raw = request.form.get("tenant", "")
    if raw == ALL_TENANTS:
        session["view_tenant"] = ALL_TENANTS
    else:
        try:
            tenant_id = int(raw)
        except ValueError:
            abort(400)
        if db.session.scalar(select(Tenant.id).where(Tenant.id == tenant_id)) is None:
            abort(404)
        session["view_tenant"] = tenant_id
    return redirect(safe_next(request.form.get("next"), url_for("dashboard.index")))
