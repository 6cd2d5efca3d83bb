"""Blueprints: one module per page group, plus the JSON API and machine endpoints."""

from __future__ import annotations

import importlib
import importlib.util
import logging
from dataclasses import dataclass
from typing import Any

from flask import Flask, Response, current_app, jsonify, render_template, request, url_for
from sqlalchemy import select
from werkzeug.exceptions import HTTPException

from portal.extensions import db, login_manager

log = logging.getLogger(__name__)

# Page groups, in navigation order: (module = blueprint name = URL prefix, label, permission).
PAGES: list[tuple[str, str, str]] = [
    ("dashboard", "Dashboard", "view_records"),
    ("mail_records", "Mail", "view_records"),
    ("sms_records", "SMS", "view_records"),
    ("decisions", "Needs a decision", "view_records"),
    ("mail_templates", "Mail templates", "edit_templates"),
    ("sms_templates", "SMS templates", "edit_templates"),
    ("mail_servers", "Mail servers", "edit_config"),
    ("sms_providers", "SMS providers", "edit_config"),
    ("mail_receivers", "Bounce mailboxes", "edit_config"),
    ("quotas", "Quotas", "view_quota"),
    ("dead_letters", "Dead letters", "dead_letters"),
    ("suppressions", "Suppression list", "suppression"),
    ("api_keys", "API keys", "api_keys"),
    ("callbacks", "Status callbacks", "api_keys"),
    ("retention", "Retention", "edit_config"),
    ("users", "Users", "manage_users"),
    ("audit", "Audit log", "view_audit"),
]
MACHINE = ["api", "operator_api", "health", "metrics", "auth", "tenants", "webhooks", "inbox"]


@dataclass(frozen=True)
class NavItem:
    label: str
    url: str
    active: bool


def register_blueprints(app: Flask) -> None:
    """Register every blueprint module that exists (page groups arrive one by one)."""
    from portal.web import access, security

    login_manager.init_app(app)
    login_manager.login_view = "auth.login"
    login_manager.login_message = "Sign in to see that page."
    login_manager.session_protection = "strong"
    for name in MACHINE + [name for name, _, _ in PAGES]:
        if importlib.util.find_spec(f"portal.web.{name}") is None:
            continue
        module = importlib.import_module(f"portal.web.{name}")
        app.register_blueprint(module.bp)
    access.init_app(app)
    security.init_app(app)
    _context(app)
    _errors(app)


def _context(app: Flask) -> None:
    from portal.messaging.uncertain import resolvable
    from portal.web.access import Permission, can, shown_actor

    @app.context_processor
    def _helpers() -> dict[str, Any]:
        def nav_items() -> list[NavItem]:
            items = []
            for name, label, permission in PAGES:
                endpoint = f"{name}.index"
                if endpoint in current_app.view_functions and can(Permission(permission)):
                    active = (request.blueprint or "") == name
                    items.append(NavItem(label, url_for(endpoint), active))
            return items

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
            "nav_items": nav_items,
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
}


def _errors(app: Flask) -> None:
    @app.errorhandler(HTTPException)
    def _http_error(exc: HTTPException) -> Response:
        status = exc.code or 500
        if _wants_json():
            from portal.web.api import error_response

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
