"""Sign in and sign out: flask-login sessions that end, argon2 hashes, an atomic throttle.

A session ends (at its next request, in every process) when:
- the user signs out, or their password, role, tenant or active flag changes: each bumps
  ``AppUser.session_generation`` (the attribute event below does it for any ORM change), and
  the session carries the generation it signed in with;
- nobody used it for ``session_idle_s``, or ``session_max_s`` has passed since sign-in.
``SECRET_KEY`` is never rotated for this: it also derives the key of the stored secrets.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import cache
from typing import Any

import redis
from flask import (
    Blueprint,
    Response,
    current_app,
    redirect,
    render_template,
    request,
    session,
    url_for,
)
from flask_login import current_user, login_user, logout_user
from sqlalchemy import case, delete, event, inspect, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.exc import DBAPIError
from werkzeug.wrappers import Response as WerkzeugResponse

from portal.extensions import db, login_manager
from portal.models import (
    AppUser,
    AuditAction,
    LoginThrottle,
    Tenant,
    add_audit,
    db_now,
    db_now_plus,
)
from portal.models.tenant import MAX_PASSWORD_CHARS
from portal.redis_store import connect
from portal.web.security import safe_next

bp = Blueprint("auth", __name__, url_prefix="/auth")
log = logging.getLogger(__name__)

# Password checks allowed per window: per (address typed, client), and per address typed from
# anywhere; and failed ones per client whatever the addresses (``login_client_max_failures``:
# one client spreading guesses over many addresses). Counted before the check, so parallel
# guesses cannot overrun them; a right password gives its count back.
MAX_CHECKS_PER_CLIENT = 5
MAX_CHECKS_PER_EMAIL = 30
WINDOW_S = 900
LOCKED_OUT = "Too many failed attempts. Wait 15 minutes, then try again."
NO_MATCH = "That email address and password do not match."

# What the session carries besides flask-login's keys.
GENERATION = "auth_generation"
SIGNED_IN_AT = "auth_signed_in_at"
SEEN_AT = "auth_seen_at"
# The last-seen time is written back at most this often. Every write re-sends the session
# cookie, and a response that re-sends it overwrites whatever a concurrent request set (a
# flash message after a POST was lost to the header's inbox poll in flight at the same time).
SEEN_GRANULARITY_S = 60
# Requests a page makes by itself (polls), not the person: they never keep a session alive,
# or a tab left open would never go idle, and they never write the session cookie.
PASSIVE_ENDPOINTS = frozenset({"inbox.bell"})


@cache
def _dummy() -> AppUser:
    """A user with a real hash, verified against for unknown emails so that timing does not
    reveal who exists. Made at the first such sign-in, not at import: every process that builds
    the app (workers, their rq children) would hash it, a tenth of a second of CPU each."""
    dummy = AppUser(password_hash="")
    dummy.set_password("not-a-real-password")
    return dummy


# --- sessions ------------------------------------------------------------------------------


def _ends_sessions(target: AppUser, value: Any, oldvalue: Any, _initiator: Any) -> None:
    """A stored user's password, role, tenant or active flag changed: end their sessions.

    New users have no sessions (no identity yet); assigning the same value changes nothing.
    A bulk ``update()`` bypasses this: it must bump ``session_generation`` itself.
    """
    if inspect(target).has_identity and value != oldvalue:
        target.end_sessions()


for _attribute in (AppUser.password_hash, AppUser.role, AppUser.tenant_id, AppUser.is_active):
    event.listen(_attribute, "set", _ends_sessions, active_history=True)


def keep_session(user: AppUser) -> None:
    """Keep the current request's session signed in after a change that ended ``user``'s
    sessions (one's own password change): it takes the user's new generation. Call it after
    the change, in the request that made it; every other session of the user still ends."""
    session[GENERATION] = user.session_generation


def _start_session(user: AppUser) -> None:
    # A fresh session: nothing of the one before sign-in (an operator's tenant choice, stale
    # keys) carries over, but the CSRF token of the sign-in form does, so a page opened before
    # signing in still posts. Sign-out clears everything, the CSRF token too.
    csrf_token = session.get("csrf_token")
    session.clear()
    if csrf_token is not None:
        session["csrf_token"] = csrf_token
    login_user(user)  # no remember-me: the session cookie is the only way back in
    now = time.time()
    session[GENERATION] = user.session_generation
    session[SIGNED_IN_AT] = now
    session[SEEN_AT] = now


def _forget_session() -> None:
    session.clear()  # its CSRF token too: the next person at this browser starts afresh
    # Also tells flask-login to delete a remember cookie, should one ever arrive.
    session["_remember"] = "clear"


def _session_alive(user: AppUser) -> bool:
    """Whether this session still belongs to ``user``; refreshes its last-seen time."""
    settings = current_app.config["SETTINGS"]
    signed_in_at, seen_at = session.get(SIGNED_IN_AT), session.get(SEEN_AT)
    if session.get(GENERATION) != user.session_generation:
        return False
    # A session without our times (a remember cookie, a session from before) is not one of ours.
    if not isinstance(signed_in_at, int | float) or not isinstance(seen_at, int | float):
        return False
    now = time.time()
    if now - signed_in_at >= settings.session_max_s or now - seen_at >= settings.session_idle_s:
        return False
    if now - seen_at >= SEEN_GRANULARITY_S and request.endpoint not in PASSIVE_ENDPOINTS:
        session[SEEN_AT] = now
    return True


def may_sign_in(user: AppUser) -> bool:
    """An active user of an active tenant (a deactivated tenant's keys are refused too)."""
    if not user.is_active:
        return False
    tenant = db.session.get(Tenant, user.tenant_id)
    return tenant is not None and tenant.is_active


def audit_own(user: AppUser, action: AuditAction, remark: str = "") -> None:
    """An audit row of ``user`` acting on their own account, when they are not (or not yet,
    or no longer) the signed-in user: sign-in, sign-out, a password set from an invitation."""
    add_audit(
        db.session(),
        action,
        tenant_id=user.tenant_id,
        actor_user_id=user.id,
        actor_label=user.email,
        target_type="user",
        target_id=user.id,
        remark=remark,
    )


@login_manager.user_loader  # type: ignore[untyped-decorator]
def _load_user(user_id: str) -> AppUser | None:
    # Every request of a signed-in person starts here: the user and their tenant in one
    # statement (may_sign_in then finds the tenant in the session, with no second query).
    row = (
        db.session.execute(
            select(AppUser, Tenant)
            .join(Tenant, Tenant.id == AppUser.tenant_id)
            .where(AppUser.id == int(user_id))
        ).first()
        if user_id.isdigit()
        else None
    )
    found: AppUser | None = row[0] if row is not None else None
    if found is None or not may_sign_in(found) or not _session_alive(found):
        _forget_session()
        return None
    return found


# --- the throttle --------------------------------------------------------------------------

# INCR every key, start its window at the first attempt; one script, so atomic.
_COUNT = """
local counts = {}
for i, key in ipairs(KEYS) do
  counts[i] = redis.call('INCR', key)
  if counts[i] == 1 or redis.call('TTL', key) < 0 then
    redis.call('EXPIRE', key, ARGV[1])
  end
end
return counts
"""
# A successful sign-in: forget this client's attempts at the address, and give back the
# address's one and the client's one.
_REFUND = """
redis.call('DEL', KEYS[1])
for i = 2, #KEYS do
  if redis.call('GET', KEYS[i]) and tonumber(redis.call('GET', KEYS[i])) > 0 then
    redis.call('DECR', KEYS[i])
  end
end
return 0
"""


@dataclass(frozen=True)
class Attempt:
    """One sign-in attempt as the throttle counted it."""

    client_key: str
    email_key: str
    from_key: str  # the client's attempts at any address
    allowed: bool
    just_locked: bool  # the first attempt refused in this window (audited once)
    in_database: bool  # counted in login_throttle because Redis could not be reached


def _keys(email: str, client: str) -> tuple[str, str, str]:
    # A client address has no spaces, so "client email" names one pair only.
    return f"login:client:{client} {email}", f"login:email:{email}", f"login:from:{client}"


def _count_in_redis(keys: tuple[str, ...]) -> list[int]:
    store = connect(current_app.config["SETTINGS"].redis_url)
    counts = store.register_script(_COUNT)(keys=list(keys), args=[WINDOW_S])
    return [int(c) for c in counts]


def _count_in_database(keys: tuple[str, ...]) -> list[int]:
    """The same count in login_throttle: an atomic upsert per key (PostgreSQL and SQLite)."""
    expired = LoginThrottle.window_start < db_now_plus(-WINDOW_S)
    insert = pg_insert if db.engine.dialect.name == "postgresql" else sqlite_insert
    counts = []
    with db.engine.begin() as conn:
        for key in keys:  # always in this order, so two attempts never deadlock
            upsert = insert(LoginThrottle).values(key=key, attempts=1, window_start=db_now())
            stmt = upsert.on_conflict_do_update(
                index_elements=[LoginThrottle.key],
                set_={
                    "attempts": case((expired, 1), else_=LoginThrottle.attempts + 1),
                    "window_start": case((expired, db_now()), else_=LoginThrottle.window_start),
                },
            ).returning(LoginThrottle.attempts)
            counts.append(int(conn.execute(stmt).scalar_one()))
    try:  # windows that ended are of no use: the table keeps one window's keys at most
        with db.engine.begin() as conn:
            conn.execute(delete(LoginThrottle).where(expired))
    except DBAPIError as exc:  # two purges may collide; the next attempt purges again
        log.info("login throttle: purge skipped: %s", exc)
    return counts


def _count_attempt(email: str, client: str) -> Attempt:
    """Count this attempt against both limits before any password is checked."""
    keys = _keys(email, client)
    in_database = False
    try:
        counts = _count_in_redis(keys)
    except redis.RedisError as exc:  # Redis away: the database counts instead
        log.warning("login throttle counts in the database; Redis: %s", exc)
        counts, in_database = _count_in_database(keys), True
    limits = (
        MAX_CHECKS_PER_CLIENT,
        MAX_CHECKS_PER_EMAIL,
        current_app.config["SETTINGS"].login_client_max_failures,
    )
    return Attempt(
        client_key=keys[0],
        email_key=keys[1],
        from_key=keys[2],
        allowed=all(n <= limit for n, limit in zip(counts, limits, strict=True)),
        just_locked=any(n == limit + 1 for n, limit in zip(counts, limits, strict=True)),
        in_database=in_database,
    )


def _refund(attempt: Attempt) -> None:
    """The password was right: this client starts afresh, and the attempt does not count
    against the address (the per-address limit is for guesses, not for sign-ins)."""
    if not attempt.in_database:
        try:
            store = connect(current_app.config["SETTINGS"].redis_url)
            keys = [attempt.client_key, attempt.email_key, attempt.from_key]
            store.register_script(_REFUND)(keys=keys)
            return
        except redis.RedisError as exc:
            log.warning("login throttle: could not clear the count: %s", exc)
            return
    with db.engine.begin() as conn:
        conn.execute(delete(LoginThrottle).where(LoginThrottle.key == attempt.client_key))
        conn.execute(
            update(LoginThrottle)
            .where(
                LoginThrottle.key.in_([attempt.email_key, attempt.from_key]),
                LoginThrottle.attempts > 0,
            )
            .values(attempts=LoginThrottle.attempts - 1)
        )


# --- views ---------------------------------------------------------------------------------


def _audit_failure(email: str, found: AppUser | None, remark: str) -> None:
    add_audit(
        db.session(),
        AuditAction.SIGN_IN_FAILED,
        tenant_id=found.tenant_id if found is not None else None,
        actor_label=email,
        target_type="user" if found is not None else None,
        target_id=found.id if found is not None else None,
        remark=remark,
    )


@bp.route("/login", methods=["GET", "POST"])
def login() -> str | Response | WerkzeugResponse | tuple[str, int]:
    """Sign in with email and password."""
    if request.method == "GET":
        return render_template("auth/login.html", email="", error=None)
    email = (request.form.get("email") or "").strip().lower()[:320]
    password = request.form.get("password") or ""
    if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in email):
        # No address has one; PostgreSQL refuses a NUL in a query. Nothing is checked.
        return render_template(
            "auth/login.html", email="", error="That is not an email address."
        ), 422
    if not email or not password:
        return render_template(
            "auth/login.html", email=email, error="Enter your email address and password."
        ), 422
    client = request.remote_addr or "unknown"
    attempt = _count_attempt(email, client)
    if not attempt.allowed:
        # The same answer whether the address exists or not, and no password check either way.
        if attempt.just_locked:  # one row per lock-out, not one per refused guess
            found = db.session.scalar(select(AppUser).where(AppUser.email == email))
            _audit_failure(email, found, f"from {client}; locked out for up to 15 minutes")
            db.session.commit()
        return render_template("auth/login.html", email=email, error=LOCKED_OUT), 429
    found = db.session.scalar(select(AppUser).where(AppUser.email == email))
    generation = found.session_generation if found is not None else None
    ok = (found or _dummy()).check_password(password[:MAX_PASSWORD_CHARS]) and found is not None
    if not ok or found is None or not may_sign_in(found):
        reason = (
            "unknown address"
            if found is None
            else ("wrong password" if not ok else "account or tenant deactivated")
        )
        db.session.rollback()  # a rehash of a deactivated account's hash is not kept
        _audit_failure(email, found, f"from {client}; {reason}")
        db.session.commit()
        return render_template("auth/login.html", email=email, error=NO_MATCH), 422
    if generation is not None:
        # check_password may rehash (new argon2 parameters): same password, so the user's
        # other sessions live on.
        found.session_generation = generation
    _refund(attempt)
    found.last_login_at = db_now()
    audit_own(found, AuditAction.SIGN_IN, f"from {client}")
    db.session.commit()
    _start_session(found)
    return redirect(safe_next(request.args.get("next"), url_for("dashboard.index")))


@bp.post("/logout")
def logout() -> WerkzeugResponse:
    """Sign out (POST with the CSRF token: a link cannot sign anyone out), ending every
    session of this user, in every browser."""
    if current_user.is_authenticated:
        me: AppUser = current_user._get_current_object()
        me.end_sessions()
        audit_own(me, AuditAction.SIGN_OUT, f"from {request.remote_addr or 'unknown'}")
        db.session.commit()
    logout_user()
    _forget_session()
    return redirect(url_for("auth.login"))
