"""API keys: a tenant admin creates keys for its applications and revokes them.

Only the key's SHA-256 digest is stored, so the token is shown exactly once, on the page that
answers the create POST (not a redirect: it never sits in a URL, a flash message or a session);
no page ever shows it again. Revoking keeps the row, so the list says when each key was used.
"""

from __future__ import annotations

from datetime import UTC, datetime

from flask import Blueprint, flash, redirect, render_template, request, url_for
from flask.typing import ResponseReturnValue
from sqlalchemy import select

from portal.extensions import db
from portal.models import ApiKey
from portal.models.tenant import new_api_token
from portal.web.access import Permission, requires, user
from portal.web.forms import Form, owned, tier_name, viewed_tier

bp = Blueprint("api_keys", __name__, url_prefix="/api-keys")

LABELS = {"name": "Name"}


def _index(form: Form, status: int = 200) -> tuple[str, int]:
    tier = viewed_tier()
    keys = db.session.scalars(
        select(ApiKey).where(ApiKey.tenant_id == tier).order_by(ApiKey.created_time.desc())
    ).all()
    return render_template(
        "api_keys/index.html", keys=keys, form=form, tier_name=tier_name(tier)
    ), status


@bp.get("/")
@requires(Permission.API_KEYS)
def index() -> tuple[str, int]:
    """The tenant's keys (prefixes only) and the form for a new one."""
    return _index(Form({}, LABELS))


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
    if not form.ok or name is None:
        return _index(form, 422)
    token = new_api_token()
    key = ApiKey(tenant_id=tier, name=name, created_by=user().email)
    key.set_token(token)
    db.session.add(key)
    db.session.commit()
    return render_template("api_keys/created.html", key=key, token=token), 200


@bp.post("/<int:key_id>/delete")
@requires(Permission.API_KEYS)
def delete(key_id: int) -> ResponseReturnValue:
    """Revoke a key: requests with it are refused from now on."""
    key = owned(ApiKey, key_id, viewed_tier())
    if key.revoked_at is None:
        key.revoked_at = datetime.now(UTC)
        db.session.commit()
        flash(f"Key {key.name!r} revoked: requests with it are refused from now on.", "success")
    return redirect(url_for("api_keys.index"), 303)
