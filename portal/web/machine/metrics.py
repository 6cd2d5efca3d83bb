"""/metrics for Prometheus (correct under several gunicorn workers: multiprocess mode).

The text names every tenant's and the platform's servers and providers, so it is closed to
the outside: a scrape sends ``Authorization: Bearer <METRICS_TOKEN>``. With no token set,
only this machine may scrape (a peer of 127.0.0.1 or ::1 whose request no proxy forwarded:
behind a reverse proxy on the same host every peer is loopback).
"""

from __future__ import annotations

import hmac

from flask import Blueprint, Response, request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from portal.extensions import db
from portal.metrics import registry_for
from portal.web.forms import settings

bp = Blueprint("metrics", __name__, url_prefix="/metrics")

LOOPBACK = frozenset({"127.0.0.1", "::1"})
FORWARDED = ("Forwarded", "X-Forwarded-For", "X-Real-IP")


def _refusal() -> Response | None:
    """Why this request may not read the metrics, as the answer; None when it may."""
    token = settings().metrics_token
    if token is not None:
        sent = request.headers.get("Authorization", "")
        scheme, _, given = sent.partition(" ")
        # As bytes: compare_digest refuses a str with non-ASCII characters (a 500).
        if scheme.lower() == "bearer" and hmac.compare_digest(
            given.strip().encode(), token.encode()
        ):
            return None
        response = Response("metrics need Authorization: Bearer <METRICS_TOKEN>\n", 401)
        response.headers["WWW-Authenticate"] = 'Bearer realm="metrics"'
        return response
    local = request.remote_addr in LOOPBACK and not any(h in request.headers for h in FORWARDED)
    if local:
        return None
    return Response("metrics answer only to this machine while METRICS_TOKEN is unset\n", 403)


@bp.get("")
def index() -> Response:
    """Counters of every process plus the backlog read from the database."""
    refused = _refusal()
    if refused is not None:
        refused.mimetype = "text/plain"
        return refused
    return Response(generate_latest(registry_for(db.engine)), mimetype=CONTENT_TYPE_LATEST)
