"""Liveness for load balancers and the run command."""

from __future__ import annotations

from flask import Blueprint
from sqlalchemy import text

from portal.extensions import db

bp = Blueprint("health", __name__, url_prefix="/health")


@bp.get("")
def index() -> tuple[dict[str, str], int]:
    """200 when the database answers."""
    db.session.execute(text("SELECT 1"))
    return {"status": "ok"}, 200
