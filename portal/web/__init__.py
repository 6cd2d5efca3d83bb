"""Blueprints: one module per page group, grouped by what a reader looks for (records,
configuration, operations), plus the machine endpoints (JSON API, operator endpoints, webhooks)."""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import Any

from flask import (
    Flask,
    Response,
    current_app,
    flash,
    jsonify,
    redirect,
    render_template,
    request,
    url_for,
)
from flask_login.utils import login_url
from markupsafe import escape
from sqlalchemy import select
from werkzeug.exceptions import HTTPException

from portal.extensions import connection_lost, db, login_manager

log = logging.getLogger(__name__)

# Page groups, in navigation order: (package.module, label, permission, nav group); the
# module's name is its blueprint's name and URL prefix. The nav shows them under their group's
# heading (what a reader looks for: the records, the configuration, the operations), in the
# order of the groups' first pages.
RECORDS, CONFIGURATION, OPERATIONS = "Records", "Configuration", "Operations"
PAGES: list[tuple[str, str, str, str]] = [
    ("operations.dashboard", "Dashboard", "view_records", RECORDS),
    ("records.mail_records", "Mail", "view_records", RECORDS),
    ("records.sms_records", "SMS", "view_records", RECORDS),
    ("records.decisions", "Needs a decision", "view_records", RECORDS),
    ("configuration.mail_templates", "Mail templates", "edit_templates", CONFIGURATION),
    ("configuration.sms_templates", "SMS templates", "edit_templates", CONFIGURATION),
    ("configuration.mail_servers", "Mail servers", "edit_config", CONFIGURATION),
    ("configuration.sms_providers", "SMS providers", "edit_config", CONFIGURATION),
    ("configuration.mail_receivers", "Bounce mailboxes", "edit_config", CONFIGURATION),
    ("operations.quotas", "Quotas", "view_quota", OPERATIONS),
    ("operations.dead_letters", "Dead letters", "dead_letters", OPERATIONS),
    ("operations.suppressions", "Suppression list", "suppression", OPERATIONS),
    ("operations.api_keys", "API keys", "api_keys", OPERATIONS),
    ("configuration.callbacks", "Status callbacks", "api_keys", CONFIGURATION),
    ("configuration.retention", "Retention", "edit_config", CONFIGURATION),
    ("configuration.tenant_settings", "Tenant settings", "edit_config", CONFIGURATION),
    ("operations.users", "Users", "manage_users", OPERATIONS),
    ("operations.audit", "Audit log", "view_audit", OPERATIONS),
]
# Blueprints with no navigation entry: the machine endpoints, sign-in, the tenant switcher, inbox.
UNLISTED = [
    "machine.api",
    "machine.operator_api",
    "machine.health",
    "machine.metrics",
    "auth",
    "tenants",
    "machine.webhooks",
    "operations.inbox",
    "records.attempt_files",
    "records.search",
    "records.recipients",
]


def _sign_in_first() -> Any:
    """Someone not signed in asked for a page: the sign-in page, back to that page after. The
    portal's front door (``/``) opens on the sign-in page as it is, without "Sign in to see
    that page" (nobody asked for a page yet)."""
    if request.path != "/":
        flash(login_manager.login_message or "", "info")
        return redirect(login_url("auth.login", request.full_path.rstrip("?")))
    return redirect(url_for("auth.login"))


@dataclass(frozen=True)
class NavItem:
    label: str
    url: str
    active: bool


@dataclass(frozen=True)
class NavGroup:
    label: str
    items: list[NavItem]

    @property
    def key(self) -> str:
        return self.label.lower()


def register_blueprints(app: Flask) -> None:
    """Register every blueprint module: the unlisted ones, then the page groups."""
    from portal.web import access, security
    from portal.web.records import formatting, recipients

    login_manager.init_app(app)
    login_manager.login_view = "auth.login"
    login_manager.login_message = "Sign in to see that page."
    login_manager.session_protection = "strong"
    login_manager.unauthorized_handler(_sign_in_first)
    for path in UNLISTED + [page[0] for page in PAGES]:
        module = importlib.import_module(f"portal.web.{path}")
        app.register_blueprint(module.bp)
    access.init_app(app)
    security.init_app(app)
    formatting.init_app(app)
    recipients.init_app(app)
    _context(app)
    _errors(app)


def _context(app: Flask) -> None:
    from portal.messaging.records.uncertain import resolvable
    from portal.web.access import Permission, can, shown_actor

    @app.context_processor
    def _helpers() -> dict[str, Any]:
        def nav_groups() -> list[NavGroup]:
            """The viewer's pages under their group's heading; a group with none is left out."""
            groups: dict[str, list[NavItem]] = {}
            for path, label, permission, group in PAGES:
                name = path.rpartition(".")[2]
                endpoint = f"{name}.index"
                if endpoint in current_app.view_functions and can(Permission(permission)):
                    active = (request.blueprint or "") == name
                    groups.setdefault(group, []).append(NavItem(label, url_for(endpoint), active))
            return [NavGroup(label, items) for label, items in groups.items()]

        def tenant_choices() -> list[tuple[str, str]]:
            from portal.models import Tenant
            from portal.web.access import ALL_TENANTS

            rows = db.session.execute(select(Tenant.id, Tenant.name).order_by(Tenant.id)).all()
            choices = [(ALL_TENANTS, "All tenants (records)")]
            choices += [(str(tid), "Platform tier" if tid < 0 else name) for tid, name in rows]
            return choices

        return {
            "can": lambda permission: can(Permission(permission)),
            "shown_actor": shown_actor,
            "resolvable": resolvable,
            "nav_groups": nav_groups,
            "tenant_choices": tenant_choices,
        }


def _wants_json() -> bool:
    return request.path.startswith(
        ("/api/", "/MailSendRecord/", "/SmsSendRecord/", "/TenantMessageQuota/", "/webhooks/")
    )


ERROR_TEXT = {
    400: ("Bad request", "The request could not be understood."),
    403: ("You cannot see this page", "Your role does not allow this. Ask an administrator."),
    404: ("Page not found", "There is nothing here, or it belongs to another tenant."),
    405: ("Not allowed", "That action is not available here."),
    413: ("Too large", "What you sent is larger than we accept."),
    429: ("Too many requests", "Wait a little, then try again."),
    500: ("Something went wrong", "The error has been logged. Try again in a moment."),
    503: (
        "The database is out of reach",
        "The portal lost its connection to the database. Try again in a few seconds; if you "
        "were saving something, look first whether it was saved.",
    ),
}


def _errors(app: Flask) -> None:
    @app.errorhandler(HTTPException)
    def _http_error(exc: HTTPException) -> Response:
        status = exc.code or 500
        if _wants_json():
            from portal.web.machine.endpoint import error_response

            code = (exc.name or "error").lower().replace(" ", "_")
            response = error_response(status, code, exc.description or exc.name or "error")
        else:
            if status == 400 and "CSRF" in (exc.description or ""):
                title, message = "Your form expired", "Go back, reload the page and try again."
            else:
                title, message = ERROR_TEXT.get(status, (exc.name, exc.description or ""))
            html = render_template("errors/error.html", title=title, message=message)
            response = Response(html, status, mimetype="text/html")
        # What the exception says besides its body: Allow on a 405 (RFC 9110 requires it),
        # WWW-Authenticate, Retry-After. Our body's Content-Type stays.
        for name, value in exc.get_headers():
            if name.lower() != "content-type":
                response.headers[name] = value
        return response

    @app.errorhandler(Exception)
    def _unexpected(exc: Exception) -> Response | tuple[str, int]:
        if isinstance(exc, HTTPException):
            return _http_error(exc)
        if connection_lost(exc):
            return _database_unavailable(exc)
        log.exception("unexpected error on %s %s", request.method, request.path)
        db.session.rollback()
        if _wants_json():
            response = jsonify(
                {"error": {"code": "internal", "field": None, "message": "internal error"}}
            )
            response.status_code = 500
            return response
        title, message = ERROR_TEXT[500]
        return render_template("errors/error.html", title=title, message=message), 500


def _database_unavailable(exc: Exception) -> Response:
    """A lost database connection: 503 with Retry-After, not a 500. The API's JSON shape, or a
    page that needs no database (``base.html`` asks it who is signed in)."""
    from portal.web.machine.endpoint import (
        RETRY_AFTER_S,
        database_unavailable,
        roll_back_quietly,
    )

    log.warning("database connection lost on %s %s: %s", request.method, request.path, exc)
    roll_back_quietly()
    if _wants_json():
        return database_unavailable()
    title, message = ERROR_TEXT[503]
    page = (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f"<title>{escape(title)} · Postroom</title></head>"
        f"<body><main><h1>{escape(title)}</h1><p>{escape(message)}</p></main></body></html>"
    )
    response = Response(page, 503, mimetype="text/html")
    response.headers["Retry-After"] = str(RETRY_AFTER_S)
    return response
