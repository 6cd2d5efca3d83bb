"""The tenant an operator is looking at (everyone else only ever sees their own)."""

from __future__ import annotations

from urllib.parse import urlsplit

from flask import Blueprint, abort, current_app, redirect, request, session, url_for
from sqlalchemy import select
from werkzeug.exceptions import HTTPException
from werkzeug.routing import RequestRedirect
from werkzeug.wrappers import Response

from portal.extensions import db
from portal.models import Tenant
from portal.web.access import ALL_TENANTS, Permission, requires
from portal.web.security import safe_next

bp = Blueprint("tenants", __name__, url_prefix="/tenants")


def landing(target: str) -> str:
    """Where a switch lands: back on ``target``, unless it names one row (its rule has
    arguments: /mail-servers/5/edit), which the newly viewed tenant does not hold; then that
    page group's list (the blueprint's index), or the dashboard when the group has none."""
    adapter = current_app.url_map.bind("localhost")
    try:
        endpoint, arguments = adapter.match(urlsplit(target).path, method="GET")
    except RequestRedirect:
        return target  # a missing trailing slash: the page itself redirects
    except HTTPException:
        return target  # not a GET page of ours (a 404 stays the 404 it was)
    if not arguments:
        return target
    index = f"{endpoint.rpartition('.')[0]}.index"
    return url_for(index if index in current_app.view_functions else "dashboard.index")


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
        if abs(tenant_id) > 2**63 - 1:  # no such id; PostgreSQL would raise, not find none
            abort(404)
        if db.session.scalar(select(Tenant.id).where(Tenant.id == tenant_id)) is None:
            abort(404)
        session["view_tenant"] = tenant_id
    return redirect(landing(safe_next(request.form.get("next"), url_for("dashboard.index"))))
