"""Sign in and sign out (flask-login, argon2 hashes, throttled against guessing)."""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from urllib.parse import urlsplit

from flask import Blueprint, Response, current_app, redirect, render_template, request, url_for
from flask_login import login_user, logout_user
from sqlalchemy import select
from werkzeug.wrappers import Response as WerkzeugResponse

from portal.extensions import db, login_manager
from portal.models import AppUser
from portal.redis_store import connect

bp = Blueprint("auth", __name__, url_prefix="/auth")
log = logging.getLogger(__name__)

MAX_FAILURES_PER_EMAIL = 5
MAX_FAILURES_PER_ADDRESS = 30
FAILURE_WINDOW_S = 900
# Verify against a real hash even for unknown emails, so timing does not reveal who exists.
_DUMMY = AppUser(password_hash="")
_DUMMY.set_password("not-a-real-password")


@login_manager.user_loader  # type: ignore[untyped-decorator]
def _load_user(user_id: str) -> AppUser | None:
    if not user_id.isdigit():
        return None
    found = db.session.get(AppUser, int(user_id))
    return found if found is not None and found.is_active else None


def _throttle_keys(email: str) -> list[tuple[str, int]]:
    address = request.remote_addr or "unknown"
    return [
        (f"login-fail:email:{email}", MAX_FAILURES_PER_EMAIL),
        (f"login-fail:addr:{address}", MAX_FAILURES_PER_ADDRESS),
    ]


def _throttled(email: str) -> bool:
    try:
        redis = connect(current_app.config["SETTINGS"].redis_url)
        counts = redis.mget([key for key, _ in _throttle_keys(email)])
    except Exception as exc:  # Redis away: keep signing people in, and say so
        log.warning("login throttle unavailable: %s", exc)
        return False
    return any(
        int(c or 0) >= limit for c, (_, limit) in zip(counts, _throttle_keys(email), strict=True)
    )


def _record_failure(email: str) -> None:
    try:
        redis = connect(current_app.config["SETTINGS"].redis_url)
        pipe = redis.pipeline()
        for key, _ in _throttle_keys(email):
            pipe.incr(key)
            pipe.expire(key, FAILURE_WINDOW_S)
        pipe.execute()
    except Exception as exc:
        log.warning("login throttle unavailable: %s", exc)


def _safe_next(target: str | None) -> str:
    """Only same-site relative paths: no open redirect through ?next=."""
    if target and target.startswith("/") and not target.startswith("//"):
        parts = urlsplit(target)
        if not parts.scheme and not parts.netloc:
            return target
    return url_for("dashboard.index")


@bp.route("/login", methods=["GET", "POST"])
def login() -> str | Response | WerkzeugResponse | tuple[str, int]:
    """Sign in with email and password."""
    if request.method == "GET":
        return render_template("auth/login.html", email="", error=None)
    email = (request.form.get("email") or "").strip().lower()[:320]
    password = request.form.get("password") or ""
    if not email or not password:
        return render_template(
            "auth/login.html", email=email, error="Enter your email address and password."
        ), 422
    if _throttled(email):
        return render_template(
            "auth/login.html",
            email=email,
            error="Too many failed attempts. Wait 15 minutes, then try again.",
        ), 429
    found = db.session.scalar(select(AppUser).where(AppUser.email == email))
    ok = (found or _DUMMY).check_password(password[:1024]) and found is not None
    if not ok or found is None or not found.is_active:
        _record_failure(email)
        return render_template(
            "auth/login.html", email=email, error="That email address and password do not match."
        ), 422
    found.last_login_at = datetime.now(UTC)
    db.session.commit()
    login_user(found)
    return redirect(_safe_next(request.args.get("next")))


@bp.post("/logout")
def logout() -> WerkzeugResponse:
    """Sign out (POST with the CSRF token: a link cannot sign anyone out)."""
    logout_user()
    return redirect(url_for("auth.login"))
