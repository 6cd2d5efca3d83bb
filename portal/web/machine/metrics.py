"""/metrics for Prometheus (correct under several gunicorn workers: multiprocess mode)."""

from __future__ import annotations

from flask import Blueprint, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from portal.extensions import db
from portal.metrics import registry_for

bp = Blueprint("metrics", __name__, url_prefix="/metrics")


@bp.get("")
def index() -> Response:
    """Counters of every process plus the backlog read from the database."""
    return Response(generate_latest(registry_for(db.engine)), mimetype=CONTENT_TYPE_LATEST)
