"""API keys: a tenant admin creates keys for its applications and revokes them.

Only the key's SHA-256 digest is stored, so the token is shown exactly once, on the page that
answers the create POST (not a redirect: it never sits in a URL, a flash message or a session);
no page ever shows it again. A key holds scopes (``send`` accepts messages, ``read`` reads
records); both are ticked by default. Revoking asks first, on a page of its own that works
without JavaScript, and keeps the row, so the list says when each key was last used.
"""

from __future__ import annotations

from datetime import UTC, datetime

from flask import Blueprint, flash, redirect, render_template, request, url_for
from flask.typing import ResponseReturnValue
from sqlalchemy import select

from portal.extensions import db
from portal.models import ApiKey, AuditAction
from portal.models.enums import ApiScope
from portal.models.tenant import new_api_token
from portal.web.access import Permission, audit_row, requires, user
from portal.web.configuration.config_pages import confirmed
from portal.web.forms import Form, owned, tier_name, viewed_tier
from portal.web.machine.endpoint import KEY_USE_INTERVAL_S

bp = Blueprint("api_keys", __name__, url_prefix="/api-keys")

LABELS = {"name": "Name", "scope": "Scopes"}

# What each scope allows, as the page says it (in ApiScope's order).
SCOPE_TEXT = {
    ApiScope.SEND: "send: accept mail and SMS; cancel, retry and resolve records",
    ApiScope.READ: "read: read records and quota usage",
}
ALL_SCOPES = [str(scope) for scope in ApiScope]


def _index(form: Form, chosen: list[str], status: int = 200) -> tuple[str, int]:
    tier = viewed_tier()
    keys = db.session.scalars(
        select(ApiKey).where(ApiKey.tenant_id == tier).order_by(ApiKey.created_time.desc())
    ).all()
    return render_template(
        "api_keys/index.html",
        keys=keys,
        form=form,
        tier_name=tier_name(tier),
        scope_text=SCOPE_TEXT,
        chosen=chosen,
        use_interval_s=int(KEY_USE_INTERVAL_S),
    ), status


@bp.get("/")
@requires(Permission.API_KEYS)
def index() -> tuple[str, int]:
    """The tenant's keys (prefixes, scopes, last use) and the form for a new one."""
    return _index(Form({}, LABELS), ALL_SCOPES)


@bp.post("/")
@requires(Permission.API_KEYS)
def create() -> tuple[str, int]:
    """Create a key and show its token, this once."""
    tier = viewed_tier()
    form = Form(request.form, LABELS)
    name = form.text("name", required=True, max_len=200)
    if name is not None:
        clash = db.session.scalar(
            select(ApiKey.id).where(ApiKey.tenant_id == tier, ApiKey.name == name)
        )
        if clash is not None:
            form.fail("name", f"{name!r} is already the name of a key; choose another")
    chosen = request.form.getlist("scope")
    if any(scope not in ALL_SCOPES for scope in chosen):
        form.fail("scope", f"must be among {', '.join(ALL_SCOPES)}")
    elif not chosen:
        form.fail("scope", "need at least one: a key without scopes can do nothing")
    if not form.ok or name is None:
        return _index(form, [s for s in ALL_SCOPES if s in chosen], 422)
    scopes = " ".join(s for s in ALL_SCOPES if s in chosen)  # one order, whatever was posted
    token = new_api_token()
    key = ApiKey(tenant_id=tier, name=name, created_by=user().email, scopes=scopes)
    key.set_token(token)
    db.session.add(key)
    db.session.flush()
    audit_row(AuditAction.KEY_CREATE, "api_key", key, f"{name} (scopes: {scopes})")
    db.session.commit()
    return render_template("api_keys/created.html", key=key, token=token), 200


@bp.route("/<int:key_id>/delete", methods=["GET", "POST"])
@requires(Permission.API_KEYS)
def delete(key_id: int) -> ResponseReturnValue:
    """Revoke a key, after a confirm page: requests with it are refused from then on.

    GET (or a POST without ``confirm=yes``) shows the confirm page; its button posts here
    with ``confirm=yes``, which revokes.
    """
    key = owned(ApiKey, key_id, viewed_tier())
    if not confirmed():
        return render_template("api_keys/delete.html", key=key)
    if key.revoked_at is None:
        key.revoked_at = datetime.now(UTC)
        audit_row(AuditAction.KEY_REVOKE, "api_key", key, key.name)
        db.session.commit()
        flash(f"Key {key.name!r} revoked: requests with it are refused from now on.", "success")
    return redirect(url_for("api_keys.index"), 303)
