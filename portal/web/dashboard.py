"""The dashboard: what is waiting, what went out, what failed."""

from __future__ import annotations

from flask import Blueprint, render_template

from portal.web.access import Permission, requires

bp = Blueprint("dashboard", __name__, url_prefix="/")


@bp.get("")
@requires(Permission.VIEW_RECORDS)
def index() -> str:
    """Counts by status per channel (the full dashboard is built on this page)."""
    return render_template("dashboard/index.html")
