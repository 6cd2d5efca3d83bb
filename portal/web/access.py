"""Who may do what in the portal: roles, permissions, the tenant being looked at.

Every HTML view declares the permission it needs with ``@requires(...)``; a view that
declares none is refused (default deny, enforced in ``init_app``). Queries are scoped with
``viewed_tenant()``: a user of one tenant only ever sees that tenant's rows, and an id from
another tenant is a 404, exactly like an id that does not exist.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum
from functools import wraps
from typing import Any, ParamSpec, Protocol, TypeVar

from flask import Flask, abort, make_response, request, session, url_for
from flask_login import current_user, login_required

from portal.models import AppUser, AuditAction, Role, add_audit
from portal.tenancy import PLATFORM_TENANT_ID

P = ParamSpec("P")
R = TypeVar("R")

ALL_TENANTS = "all"


class Permission(StrEnum):
    VIEW_RECORDS = "view_records"
    RETRY = "retry"
    EDIT_TEMPLATES = "edit_templates"
    EDIT_CONFIG = "edit_config"  # servers, providers, routes, bindings
    VIEW_QUOTA = "view_quota"
    EDIT_QUOTA = "edit_quota"
    DEAD_LETTERS = "dead_letters"
    API_KEYS = "api_keys"
    SWITCH_TENANT = "switch_tenant"
    SUPPRESSION = "suppression"
    MANAGE_USERS = "manage_users"
    VIEW_AUDIT = "view_audit"
    OWN_ACCOUNT = "own_account"  # one's own password
    RESOLVE = "resolve"  # settle an Uncertain record (seed 002: trusted people only)


ROLE_PERMISSIONS: dict[Role, frozenset[Permission]] = {
    Role.PLATFORM_OPERATOR: frozenset(Permission),
    Role.TENANT_ADMIN: frozenset(
        {
            Permission.VIEW_RECORDS,
            Permission.RETRY,
            Permission.EDIT_TEMPLATES,
            Permission.EDIT_CONFIG,
            Permission.VIEW_QUOTA,
            Permission.API_KEYS,
            Permission.SUPPRESSION,
            Permission.MANAGE_USERS,
            Permission.VIEW_AUDIT,
            Permission.OWN_ACCOUNT,
            Permission.RESOLVE,
        }
    ),
    Role.SUPPORT: frozenset(
        {Permission.VIEW_RECORDS, Permission.RETRY, Permission.VIEW_QUOTA, Permission.OWN_ACCOUNT}
    ),
}

# Endpoints any visitor may reach (sign-in, static files, machine endpoints with their own auth).
PUBLIC_BLUEPRINTS = {"auth", "api", "operator_api", "health", "metrics", "webhooks"}
# users.accept: the one-time set-password link of an invitation (its token is the credential).
PUBLIC_ENDPOINTS = {"static", "users.accept"}


def user() -> AppUser:
    """The signed-in user (views behind ``requires`` only)."""
    return current_user._get_current_object()  # type: ignore[no-any-return]


def can(permission: Permission) -> bool:
    """Whether the signed-in user holds ``permission``."""
    if not current_user.is_authenticated:
        return False
    return permission in ROLE_PERMISSIONS[Role(current_user.role)]


def requires(permission: Permission) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Sign-in plus ``permission``, or 403."""

    def decorate(view: Callable[P, R]) -> Callable[P, R]:
        @wraps(view)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            if not can(permission):
                abort(403)
            return view(*args, **kwargs)

        @wraps(view)
        def signed_in(*args: P.args, **kwargs: P.kwargs) -> R:
            if not current_user.is_authenticated and request.headers.get("HX-Request"):
                # An htmx poll after the session expired: send the whole page to sign-in,
                # instead of swapping the login form into a fragment.
                response = make_response("", 401)
                response.headers["HX-Redirect"] = url_for("auth.login", next=request.path)
                abort(response)
            return login_required(wrapper)(*args, **kwargs)  # type: ignore[no-any-return]

        signed_in.required_permission = permission  # type: ignore[attr-defined]
        return signed_in

    return decorate


def is_operator() -> bool:
    return bool(current_user.is_authenticated and current_user.role == Role.PLATFORM_OPERATOR)


def viewed_tenant(*, allow_all: bool = False) -> int | None:
    """The tenant whose rows the page shows: the user's own, or the one an operator chose.

    None means "every tenant", which only operators get and only where ``allow_all`` (lists of
    records and dead letters); elsewhere an operator on "all" works in the platform tier.
    An operator who has chosen nothing views every tenant (the platform tier's own
    view said "No records yet" while tenants had failures waiting).
    """
    if not is_operator():
        return int(current_user.tenant_id)
    chosen = viewing()
    if chosen == ALL_TENANTS:
        return None if allow_all else PLATFORM_TENANT_ID
    return int(chosen)


def viewing() -> str:
    """What the header's "Viewing" shows chosen: a tenant id as text, or ALL_TENANTS (the
    operator's default)."""
    return str(session.get("view_tenant", ALL_TENANTS))


def init_app(app: Flask) -> None:
    """Default deny: an HTML view without a declared permission is never served."""
    app.add_template_global(viewing, "viewing")

    @app.before_request
    def _default_deny() -> None:
        endpoint = request.endpoint
        if endpoint is None or endpoint in PUBLIC_ENDPOINTS:
            return
        blueprint = endpoint.split(".", 1)[0] if "." in endpoint else None
        if blueprint in PUBLIC_BLUEPRINTS:
            return
        view: Any = app.view_functions.get(endpoint)
        if getattr(view, "required_permission", None) is None:
            abort(403)


def actor_label() -> str:
    """Who is acting, as the audit log and a record's events label them: the signed-in
    user's address, else "API key <name>" for the request's key, else ""."""
    from flask import g

    if current_user and current_user.is_authenticated:
        return str(current_user.email)
    key_id = g.get("api_key_id")
    return f"API key {g.get('api_key_name') or key_id}" if key_id is not None else ""


def audit(
    action: AuditAction,
    *,
    tenant_id: int | None,
    target_type: str | None = None,
    target_id: object = None,
    remark: str = "",
) -> None:
    """Add an audit row for the current actor (the signed-in user, or the request's API key)
    to ``db.session``: it is written by the commit of the action it records, or not at all.

    ``tenant_id`` is the tenant whose data the action touched (a record's, a config's).
    """
    from flask import g

    from portal.extensions import db

    key_id = g.get("api_key_id")
    if key_id is not None and not (current_user and current_user.is_authenticated):
        add_audit(
            db.session(),
            action,
            tenant_id=tenant_id,
            actor_key_id=key_id,
            actor_label=actor_label(),
            target_type=target_type,
            target_id=target_id,
            remark=remark,
        )
        return
    signed_in = current_user and current_user.is_authenticated
    add_audit(
        db.session(),
        action,
        tenant_id=tenant_id,
        actor_user_id=int(current_user.id) if signed_in else None,
        actor_label=actor_label(),
        target_type=target_type,
        target_id=target_id,
        remark=remark,
    )


class _TenantRow(Protocol):
    @property
    def id(self) -> int: ...

    @property
    def tenant_id(self) -> int: ...


def audit_row(action: AuditAction, target_type: str, row: _TenantRow, remark: str = "") -> None:
    """``audit`` of a change to one of a tenant's rows (``row``'s tenant, ``row``'s id), in the
    transaction that makes the change."""
    audit(action, tenant_id=row.tenant_id, target_type=target_type, target_id=row.id, remark=remark)


def audit_tenant(action: AuditAction, tenant_id: int, remark: str) -> None:
    """``audit`` of a change to a tenant's own settings, in the transaction that makes it."""
    audit(action, tenant_id=tenant_id, target_type="tenant", target_id=tenant_id, remark=remark)


def shown_actor(label: str | None) -> str | None:
    """Who did something (a record's ``resolved_by``: an address or ``api-key:<id>``), as the
    viewer may see it: the platform tier's people and keys are invisible to tenants, who see
    "a platform operator" / "a platform API key" instead."""
    if not label or is_operator():
        return label
    from sqlalchemy import select

    from portal.extensions import db
    from portal.models import ApiKey

    if label.startswith("api-key:"):
        key_id = label.removeprefix("api-key:")
        tenant = (
            db.session.scalar(select(ApiKey.tenant_id).where(ApiKey.id == int(key_id)))
            if key_id.isdigit() and len(key_id) < 19
            else None
        )
        return "a platform API key" if tenant == PLATFORM_TENANT_ID else "an API key"
    tenant = db.session.scalar(select(AppUser.tenant_id).where(AppUser.email == label))
    return "a platform operator" if tenant == PLATFORM_TENANT_ID else label
