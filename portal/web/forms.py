"""Server-side form handling for the configuration pages (templates, servers, providers,
quotas, API keys).

A ``Form`` reads every field of a posted form, collects one error per field (each message names
its field: "Port must be a whole number from 1 to 65535") instead of stopping at the first, and
keeps the raw input so an invalid form re-renders (422) exactly as the user typed it. The rules
are ``import-config``'s (portal/importer.py), so a value the portal accepts the importer accepts
too. ``owned`` is the tenant-scoped lookup every id route starts with: an id of another tenant
is a 404, like an id that does not exist.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, TypeVar

import phonenumbers
from email_validator import EmailNotValidError
from flask import Response, abort, current_app, request, url_for

from portal.config import Settings
from portal.extensions import db
from portal.messaging.records.addresses import typed_email
from portal.messaging.records.validation import text_problem
from portal.models import Tenant
from portal.web.access import viewed_tenant

MAX_INT = 2**31 - 1  # the INTEGER columns' range
MAX_ID = 2**63 - 1  # the BIGINT ids' range: a larger id in a URL is a 404, not a 500


class Form:
    """One posted form: typed readers that record an error per field, and the raw input."""

    def __init__(self, data: Mapping[str, str], labels: Mapping[str, str]):
        self.data = data
        self.labels = labels
        self.errors: dict[str, str] = {}

    @property
    def ok(self) -> bool:
        return not self.errors

    def fail(self, name: str, message: str) -> None:
        """Record ``message`` (which follows the field's label) unless the field has one."""
        self.errors.setdefault(name, f"{self.labels.get(name, name)} {message}")

    def raw(self, name: str) -> str:
        return str(self.data.get(name) or "")

    def text(
        self, name: str, *, required: bool = False, max_len: int = 500, multiline: bool = False
    ) -> str | None:
        """A text field: one line, trimmed (or a text area, kept as typed); empty is None."""
        value = self.raw(name).replace("\r\n", "\n")
        if not multiline:
            value = value.strip()
        if not value.strip():
            if required:
                self.fail(name, "is required")
            return None
        if len(value) > max_len:
            self.fail(name, f"must be at most {max_len:,} characters (it has {len(value):,})")
            return None
        problem = text_problem(value, multiline=multiline)
        if problem is not None:  # the rule import-config asks too
            self.fail(name, problem)
            return None
        return value

    def number(self, name: str, *, lo: int = 0, hi: int = MAX_INT) -> int | None:
        """A whole number within [lo, hi]; empty is None."""
        value = self.raw(name).strip().replace(",", "").replace("_", "")
        if not value:
            return None
        if not re.fullmatch(r"-?\d{1,12}", value) or not lo <= int(value) <= hi:
            self.fail(name, f"must be a whole number from {lo:,} to {hi:,}")
            return None
        return int(value)

    def flag(self, name: str) -> bool:
        """A checkbox: present (any value but "" or "0") is True."""
        return self.raw(name) not in ("", "0", "false", "off")

    def choice(self, name: str, choices: Sequence[str], default: str | None = None) -> str:
        """One of ``choices``; an empty field takes ``default`` when there is one."""
        value = self.raw(name).strip() or default
        if value not in choices:
            self.fail(name, f"must be one of {', '.join(choices)}")
            return choices[0]
        assert value is not None
        return value

    def email(self, name: str, *, required: bool = False) -> str | None:
        """An email address, normalised as the importer and acceptance do."""
        value = self.text(name, required=required, max_len=320)
        if value is None:
            return None
        try:
            return typed_email(value)
        except EmailNotValidError as exc:
            self.fail(name, f"is not a valid email address: {exc}")
            return None

    def country(self, name: str, *, required: bool = False) -> str | None:
        """An ISO 3166 two-letter country code that phone numbers are known for (GB, US...)."""
        value = self.text(name, required=required, max_len=2)
        if value is None:
            return None
        value = value.upper()
        if len(value) != 2 or not value.isascii() or not value.isalpha():
            self.fail(name, "must be an ISO 3166 two-letter code such as GB")
            return None
        if value not in phonenumbers.SUPPORTED_REGIONS:
            self.fail(name, f"{value} is not a country code we know")
            return None
        return value

    def url(self, name: str, *, max_len: int = 500) -> str | None:
        value = self.text(name, max_len=max_len)
        if value is not None and not re.match(r"https?://[^\s/]+", value):
            self.fail(name, "must start with http:// or https:// and name a host")
            return None
        return value

    def json_object(self, name: str) -> dict[str, Any] | None:
        """A JSON object (empty: {}); None with an error when it is not one."""
        value = self.raw(name).strip()
        if not value:
            return {}
        try:
            parsed = json.loads(value)
        except ValueError as exc:
            self.fail(name, f"are not valid JSON: {exc}")
            return None
        if not isinstance(parsed, dict):
            self.fail(name, 'must be a JSON object, such as {"name": "Ann"}')
            return None
        return parsed


def replace_secret(form: Form, row: object, name: str, value: str | None) -> None:
    """A write-only secret field: ticking ``remove_<name>`` clears the stored secret, a typed
    value replaces it, and a blank field keeps it."""
    if form.flag(f"remove_{name}"):
        setattr(row, name, None)
    elif value is not None:
        setattr(row, name, value)


def form_data(**fields: object) -> dict[str, str]:
    """A saved row's values as a form would post them (for the first render of an edit page)."""
    data = {}
    for name, value in fields.items():
        if isinstance(value, bool):
            data[name] = "on" if value else ""
        else:
            data[name] = "" if value is None else str(value)
    return data


class _Owned(Protocol):
    @property
    def tenant_id(self) -> int: ...


M = TypeVar("M", bound=_Owned)


def owned(model: type[M], row_id: int, tenant_id: int) -> M:
    """The row ``row_id`` of ``model`` if it belongs to ``tenant_id``; otherwise 404."""
    if not 1 <= row_id <= MAX_ID:
        abort(404)
    row = db.session.get(model, row_id)
    if row is None or row.tenant_id != tenant_id:
        abort(404)
    return row


class _Parent(Protocol):
    @property
    def id(self) -> int: ...

    @property
    def tenant_id(self) -> int: ...


def owned_under(model: type[M], row_id: int, parent: _Parent, parent_key: str) -> M:
    """The row ``row_id`` of ``model`` if it is ``parent``'s (its ``parent_key`` column names
    ``parent``, a row already found in the viewed tier), and so in ``parent``'s tenant;
    otherwise 404."""
    row = owned(model, row_id, parent.tenant_id)
    if getattr(row, parent_key) != parent.id:
        abort(404)
    return row


def viewed_tier() -> int:
    """The tier whose configuration the page edits: the user's own tenant, or for an operator
    the tenant chosen in the header (the platform tier by default, and on "all")."""
    tier = viewed_tenant()
    assert tier is not None  # only allow_all=True gives None
    return tier


def tier_name(tenant_id: int) -> str:
    """How a page names the tier it shows."""
    if tenant_id < 0:
        return "Platform tier"
    tenant = db.session.get(Tenant, tenant_id)
    return tenant.name if tenant is not None else f"Tenant {tenant_id}"


def settings() -> Settings:
    """The app's settings (timeouts and the secret key the config pages need)."""
    value: Settings = current_app.config["SETTINGS"]
    return value


def record_url(endpoint: str, record_id: int) -> str | None:
    """A link to a send record's page, when the records pages are there."""
    if endpoint not in current_app.view_functions:
        return None
    return url_for(endpoint, record_id=record_id)


def is_htmx() -> bool:
    """Whether htmx sent this request for a fragment. Not a history restore: when the Back
    button finds no page in htmx's history cache, htmx asks again with HX-Request and
    HX-History-Restore-Request, and it needs the whole page."""
    return (
        request.headers.get("HX-Request") == "true"
        and request.headers.get("HX-History-Restore-Request") != "true"
    )


def varies(response: Response) -> Response:
    """Mark a response that depends on HX-Request, so no cache serves a fragment as a page."""
    response.vary.add("HX-Request")
    response.vary.add("HX-History-Restore-Request")
    return response
