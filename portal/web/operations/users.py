"""Users: who gets in. Tenant admins invite, re-role, deactivate and reactivate their tenant's
users; platform operators do so for every tenant and for operators; everyone changes their own
password; an invitation's one-time link sets the first password.

An invitation's token, like an API key, is kept only as its SHA-256 digest: the link is shown
once, on the page that answers the invite POST (never in a redirect, flash or session), and
mailed to the address through our own delivery path on the platform tier. Every change here
ends the affected user's sessions (``AppUser.end_sessions``) and writes its audit row in the
same transaction.
"""

from __future__ import annotations

import hashlib
import secrets
from datetime import UTC, datetime

from flask import Blueprint, abort, flash, redirect, render_template, request, url_for
from flask.typing import ResponseReturnValue
from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError

from portal.extensions import db
from portal.messaging.records import acceptance, validation
from portal.models import AppUser, AuditAction, AuditEvent, Role, Scope, db_now
from portal.models.base import db_now_plus
from portal.models.tenant import MAX_PASSWORD_CHARS, password_problem
from portal.tenancy import PLATFORM_TENANT_ID, new_trace_id, tenant_context
from portal.web import auth
from portal.web.access import (
    Permission,
    audit_row,
    is_operator,
    requires,
    user,
    viewed_tenant,
)
from portal.web.forms import MAX_ID, Form, settings, tier_name, viewed_tier

bp = Blueprint("users", __name__, url_prefix="/users")

INVITATION_VALID_S = 48 * 3600
MAX_TOKEN_CHARS = 100

ROLE_TEXT = {
    Role.PLATFORM_OPERATOR: "Platform operator",
    Role.TENANT_ADMIN: "Tenant admin",
    Role.SUPPORT: "Support",
}
# Least privilege first: the invitation form offers support unless told otherwise.
TENANT_ROLES = (Role.SUPPORT.value, Role.TENANT_ADMIN.value)

INVITE_LABELS = {"email": "Email address", "name": "Name", "role": "Role"}
ROLE_LABELS = {"role": "Role"}
PASSWORD_LABELS = {
    "current_password": "Current password",
    "password": "New password",
    "confirm": "New password again",
}
# Said of every address that cannot be invited, whoever holds it: the page never tells a
# tenant admin that an address has an account in another tenant.
CANNOT_INVITE = "cannot be invited. If this person already has an account, they can sign in with it"


def hash_token(token: str) -> str:
    """SHA-256 of an invitation token: it is long and random, so a slow hash buys nothing."""
    return hashlib.sha256(token.encode()).hexdigest()


# --- scoping: one rule for every view that takes a user id -----------------------------------


def _managed_tenant() -> int | None:
    """The tenant whose users the page manages: a tenant admin's own; for an operator the one
    viewed in the header (None on "All tenants": every user)."""
    return viewed_tenant(allow_all=True)


def _managed(user_id: int) -> AppUser:
    """The user ``user_id`` if the signed-in user manages them; otherwise 404, like an id that
    does not exist (another tenant's users and operators are invisible to tenant admins)."""
    if not 1 <= user_id <= MAX_ID:
        abort(404)
    found = db.session.get(AppUser, user_id)
    scope = _managed_tenant()
    if found is None or (scope is not None and found.tenant_id != scope):
        abort(404)
    if not is_operator() and found.role == Role.PLATFORM_OPERATOR:
        abort(404)
    return found


def _role_choices(tenant_id: int) -> tuple[str, ...]:
    """Roles a user of ``tenant_id`` may hold: the platform tier's users are its operators."""
    if tenant_id == PLATFORM_TENANT_ID:
        return (Role.PLATFORM_OPERATOR.value,)
    return TENANT_ROLES


def _status(row: AppUser, now: datetime) -> tuple[str, str]:
    """(label, pill class) of a user's state, as the list shows it."""
    if not row.is_active:
        return "Deactivated", "Failed"
    if row.password_token_hash is not None:
        expires = row.password_token_expires_at
        if expires is not None and expires > now:
            return f"Invited, link valid until {expires:%Y-%m-%d %H:%M} UTC", "Pending"
        return "Invitation expired", "Retry"
    return "Active", "Sent"


# --- the list, and inviting -------------------------------------------------------------------


def _index(
    invite: Form, status: int = 200, *, row_id: int | None = None, row_form: Form | None = None
) -> tuple[str, int]:
    scope = _managed_tenant()
    query = select(AppUser).order_by(AppUser.tenant_id, AppUser.email)
    if scope is not None:
        query = query.where(AppUser.tenant_id == scope)
    if not is_operator():
        query = query.where(AppUser.role != Role.PLATFORM_OPERATOR)
    rows = db.session.scalars(query).all()
    tenants: dict[int, str] = {}
    if scope is None:
        tenants = {tid: tier_name(tid) for tid in {row.tenant_id for row in rows}}
    tier = viewed_tier()
    now = datetime.now(UTC)
    return render_template(
        "users/index.html",
        rows=rows,
        statuses={row.id: _status(row, now) for row in rows},
        tenants=tenants,
        scope_name="All tenants" if scope is None else tier_name(scope),
        invite=invite,
        invite_tier=tier_name(tier),
        invite_roles=[(r, ROLE_TEXT[Role(r)]) for r in _role_choices(tier)],
        role_text=ROLE_TEXT,
        tenant_roles=[(r, ROLE_TEXT[Role(r)]) for r in TENANT_ROLES],
        me=user().id,
        row_id=row_id,
        row_form=row_form,
    ), status


@bp.get("/")
@requires(Permission.MANAGE_USERS)
def index() -> tuple[str, int]:
    """The users this user manages, and the invitation form."""
    return _index(Form({}, INVITE_LABELS))


@bp.post("/")
@requires(Permission.MANAGE_USERS)
def create() -> tuple[str, int]:
    """Invite someone: a user without a usable password, and a one-time link to set one."""
    tier = viewed_tier()
    form = Form(request.form, INVITE_LABELS)
    email = form.email("email", required=True)
    name = form.text("name", max_len=200) or ""
    role = form.choice("role", _role_choices(tier))
    if email is not None and db.session.scalar(select(AppUser.id).where(AppUser.email == email)):
        form.fail("email", CANNOT_INVITE)
    if not form.ok or email is None:
        return _index(form, 422)
    base = settings().public_base_url
    if not base:
        # The request's Host is the client's to choose: a link built from it could point
        # anywhere, so without the configured address no invitation is sent.
        form.fail(
            "email",
            "cannot be invited: the portal's address (PUBLIC_BASE_URL) is not configured, "
            "so the invitation link cannot be made. Ask the platform's administrator",
        )
        return _index(form, 503)
    if _invitations_this_hour(tier) >= settings().invitations_per_hour:
        form.fail(
            "email",
            f"cannot be invited now: {tier_name(tier)} has sent "
            f"{settings().invitations_per_hour} invitations in the last hour "
            "(INVITATIONS_PER_HOUR). Try again later",
        )
        return _index(form, 429)
    token = secrets.token_urlsafe(32)
    invited = AppUser(email=email, name=name, role=role, tenant_id=tier, is_active=True)
    # A random password nobody knows (a real hash, so sign-in takes as long as for anyone).
    invited.set_password(secrets.token_urlsafe(32))
    invited.password_token_hash = hash_token(token)
    invited.password_token_expires_at = db_now_plus(INVITATION_VALID_S)
    link = base + url_for("users.accept", token=token)
    try:
        db.session.add(invited)
        db.session.flush()
        audit_row(AuditAction.USER_INVITE, "user", invited, f"{email} as {role}")
        record_id = _mail_invitation(invited, link)
        db.session.commit()
    except IntegrityError:
        # Invited by someone else a moment ago: the same answer as any taken address.
        db.session.rollback()
        form.fail("email", CANNOT_INVITE)
        return _index(form, 422)
    except validation.AcceptanceError as exc:
        db.session.rollback()
        form.fail("email", f"cannot be mailed: {exc.message}")
        return _index(form, 422)
    return render_template(
        "users/created.html",
        invited=invited,
        role_text=ROLE_TEXT[Role(invited.role)],
        link=link,
        record_id=record_id,
        valid_hours=INVITATION_VALID_S // 3600,
    ), 200


def _invitations_this_hour(tier: int) -> int:
    """Invitations into ``tier`` in the last hour, by their audit rows (each mails a link, so
    they are capped per tier: ``INVITATIONS_PER_HOUR``)."""
    return (
        db.session.scalar(
            select(func.count()).where(
                AuditEvent.tenant_id == tier,
                AuditEvent.action == AuditAction.USER_INVITE,
                AuditEvent.created_time > db_now_plus(-3600),
            )
        )
        or 0
    )


def _mail_invitation(invited: AppUser, link: str) -> int:
    """Accept the invitation mail on the platform tier, in the caller's transaction (the
    user, its audit row and the mail commit together). Without a platform mail server the
    record waits and fails like any other; the link on the page still works."""
    inviter = user()
    where = (
        "" if invited.tenant_id == PLATFORM_TENANT_ID else f" for {tier_name(invited.tenant_id)}"
    )
    # A tenant's people never learn the platform tier's (operators') addresses.
    platform_inviter = (
        inviter.tenant_id == PLATFORM_TENANT_ID and invited.tenant_id != PLATFORM_TENANT_ID
    )
    by = "A platform operator" if platform_inviter else inviter.email
    text = (
        f"Hello{' ' + invited.name if invited.name else ''},\n\n"
        f"{by} has invited you to Postroom{where}.\n"
        f"Set your password with this link (it works once, for "
        f"{INVITATION_VALID_S // 3600} hours):\n\n{link}\n\n"
        "If you did not expect this invitation, ignore this mail.\n"
    )
    with tenant_context(PLATFORM_TENANT_ID, new_trace_id()):
        accepted = acceptance.send_mail(
            db.session(),
            {
                "scope": Scope.PLATFORM.value,
                "to": [invited.email],
                "subject": "You are invited to Postroom",
                "text": text,
            },
            settings=settings(),
        )
    return accepted.id


# --- changes to a user ------------------------------------------------------------------------


@bp.post("/<int:user_id>/role")
@requires(Permission.MANAGE_USERS)
def update(user_id: int) -> ResponseReturnValue:
    """Change a tenant user's role between tenant admin and support."""
    row = _managed(user_id)
    form = Form(request.form, ROLE_LABELS)
    role = form.choice("role", _role_choices(row.tenant_id))
    if row.id == user().id:
        form.fail("role", "of your own account cannot be changed by you; ask another admin")
    if not form.ok:
        return _index(Form({}, INVITE_LABELS), 422, row_id=row.id, row_form=form)
    old = row.role
    if role == old:
        flash(f"{row.email} is already {ROLE_TEXT[Role(role)].lower()}.", "success")
        return redirect(url_for("users.index"), 303)
    row.role = role
    row.end_sessions()
    audit_row(AuditAction.USER_ROLE_CHANGE, "user", row, f"{old} -> {role}")
    db.session.commit()
    flash(
        f"{row.email} is now {ROLE_TEXT[Role(role)].lower()}; their sessions have ended.",
        "success",
    )
    return redirect(url_for("users.index"), 303)


@bp.post("/<int:user_id>/deactivate")
@requires(Permission.MANAGE_USERS)
def deactivate(user_id: int) -> ResponseReturnValue:
    """Deactivate a user: they are signed out everywhere and cannot sign in."""
    row = _managed(user_id)
    if row.id == user().id:
        form = Form({}, ROLE_LABELS)
        form.errors["active"] = "You cannot deactivate your own account; ask another admin"
        return _index(Form({}, INVITE_LABELS), 422, row_id=row.id, row_form=form)
    _set_active(row, False)
    flash(f"{row.email} is deactivated and signed out everywhere.", "success")
    return redirect(url_for("users.index"), 303)


@bp.post("/<int:user_id>/activate")
@requires(Permission.MANAGE_USERS)
def activate(user_id: int) -> ResponseReturnValue:
    """Reactivate a user: they can sign in again with their password."""
    row = _managed(user_id)
    _set_active(row, True)
    flash(f"{row.email} is active again and can sign in.", "success")
    return redirect(url_for("users.index"), 303)


def _set_active(row: AppUser, active: bool) -> None:
    """Deactivate or reactivate ``row``, ending its sessions, with its audit row; nothing when
    it already is so."""
    if row.is_active == active:
        return
    row.is_active = active
    row.end_sessions()
    action = AuditAction.USER_ACTIVATE if active else AuditAction.USER_DEACTIVATE
    audit_row(action, "user", row, row.email)
    db.session.commit()


# --- passwords ----------------------------------------------------------------------------


def _new_password(form: Form) -> str | None:
    """The new password, typed twice; kept exactly as typed (no trimming)."""
    password = form.raw("password")
    if not password:
        form.fail("password", "is required")
    elif (problem := password_problem(password)) is not None:
        form.fail("password", problem)
    elif form.raw("confirm") != password:
        form.fail("confirm", "does not match the new password")
    return password if form.ok else None


@bp.route("/password", methods=["GET", "POST"])
@requires(Permission.OWN_ACCOUNT)
def password() -> ResponseReturnValue:
    """Change one's own password; every other session of the account ends, this one stays."""
    me = user()
    form = Form(request.form if request.method == "POST" else {}, PASSWORD_LABELS)
    if request.method == "GET":
        return render_template("users/password.html", form=form, me=me)
    current = form.raw("current_password")
    if not current:
        form.fail("current_password", "is required")
    elif not me.check_password(current[:MAX_PASSWORD_CHARS]):
        form.fail("current_password", "is not right")
    new = _new_password(form)
    if new is None:
        db.session.rollback()  # check_password may have rehashed: nothing half-written
        return render_template("users/password.html", form=form, me=me), 422
    me.set_password(new)
    me.end_sessions()
    audit_row(AuditAction.PASSWORD_CHANGE, "user", me)
    db.session.commit()
    auth.keep_session(me)  # this session stays; every other one of the account ends
    flash("Your password is changed. Your other sessions have ended.", "success")
    return redirect(url_for("users.password"), 303)


def _invited(token: str, *, lock: bool = False) -> AppUser | None:
    """The active user whose unexpired invitation ``token`` is, or None."""
    if not token or len(token) > MAX_TOKEN_CHARS:
        return None
    query = select(AppUser).where(
        AppUser.password_token_hash == hash_token(token),
        AppUser.password_token_expires_at > db_now(),
        AppUser.is_active.is_(True),
    )
    if lock:  # two tabs posting the same link: the second waits, then finds it used
        query = query.with_for_update()
    return db.session.scalar(query)


@bp.route("/accept/<token>", methods=["GET", "POST"])
def accept(token: str) -> ResponseReturnValue:
    """An invitation's link: set a first password (no sign-in; the token is the credential)."""
    invited = _invited(token, lock=request.method == "POST")
    if invited is None:
        # Used, expired, revoked or never issued: one page for all, naming no address.
        db.session.rollback()
        return render_template("users/accept_invalid.html"), 404
    form = Form(request.form if request.method == "POST" else {}, PASSWORD_LABELS)
    if request.method == "GET":
        return render_template("users/accept.html", form=form, invited=invited, token=token)
    new = _new_password(form)
    if new is None:
        db.session.rollback()
        return render_template("users/accept.html", form=form, invited=invited, token=token), 422
    invited.set_password(new)
    invited.password_token_hash = None
    invited.password_token_expires_at = None
    invited.end_sessions()
    # No one is signed in: the actor is the invited user, who holds the link.
    auth.audit_own(invited, AuditAction.PASSWORD_SET)
    db.session.commit()
    flash("Your password is set. Sign in with your email address and the new password.", "success")
    return redirect(url_for("auth.login"), 303)
