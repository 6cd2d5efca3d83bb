"""The route walker's machinery: marked seed data, table snapshots, the HTML field harvest,
the parameter classification and the walk itself (tests/integration/test_route_walker.py).

Every text field of another tier's rows carries a marker (``zqbleak12x`` for tenant B,
``zqpleak3x`` for the platform tier, ``zqnleak1x`` for their tenant names, ``zqaleak7x`` for
tenant A's own rows); a response is searched for them, so any byte of another tier's data
that reaches a viewer is found, whatever the page or field it came through.
"""

from __future__ import annotations

import base64
import contextlib
import json
import re
import socket
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from html.parser import HTMLParser
from itertools import count
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

from flask import Flask
from flask.testing import FlaskClient
from sqlalchemy import JSON, String, Text, select
from sqlalchemy.orm import Session
from werkzeug.datastructures import MultiDict
from werkzeug.exceptions import HTTPException
from werkzeug.routing import Rule
from werkzeug.test import TestResponse

from portal.messaging.templating import versions as template_versions
from portal.models import (
    ApiKey,
    AppUser,
    AuditEvent,
    Base,
    CallbackDelivery,
    CallbackEndpoint,
    DeadLetterMessage,
    DeliveryEvent,
    MailReceiveConfig,
    MailReceiveState,
    MailSendRecipient,
    MailSendRecord,
    MailSendServerConfig,
    MailTemplate,
    Notification,
    ReceivedMail,
    SmsProviderConfig,
    SmsProviderRegion,
    SmsSendRecord,
    SmsTemplate,
    SmsTemplateProviderBinding,
    Suppression,
    TemplateVersion,
    TenantMessageQuota,
    TenantMessageUsage,
)
from portal.models.tenant import new_api_token

# --- markers ------------------------------------------------------------------------------

MARKER = re.compile(r"zq([abnp])leak\d+x", re.IGNORECASE)
_serial = count(1)


def marker(tier: str) -> str:
    """A fresh marker of ``tier`` (a: tenant A, b: tenant B, p: platform tier, n: B's and the
    platform tier's tenant names, which operators see in the tenant switcher)."""
    return f"zq{tier}leak{next(_serial)}x"


def free_port() -> int:
    """A 127.0.0.1 port nothing listens on (bound, read and closed again)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


# Columns whose values are enums, codes or hashes, set explicitly by the seed (a marker
# would break a CHECK constraint or the value's meaning), or too short for a marker.
_NOT_MARKED = {
    "status",
    "scope",
    "role",
    "channel",
    "security",
    "uncertain_policy",
    "kind",
    "event_type",
    "source",
    "delivery_outcome",
    "resolution",
    "bounce_status",
    "month",
    "action",
    "target_type",
    "target_id",
    "provider_kind",
    "scopes",
    "password_hash",
    "token_hash",
    "password_token_hash",
    "secret_encrypted",
    "webhook_secret_encrypted",
    "password_encrypted",
    "request_hash",
    "dedup_key",
}


def _email_column(name: str) -> bool:
    return (
        "addr" in name
        or "email" in name
        or name.endswith("_by")
        or name in {"reply_to", "final_reply_to", "username", "recipient", "address"}
    )


def fill(row: Base, tier: str) -> Base:
    """Give every unset text and JSON column of ``row`` a fresh marker of ``tier``."""
    for column in row.__table__.columns:
        name = column.key
        if name in _NOT_MARKED or getattr(row, name, None) is not None:
            continue
        kind = column.type
        if isinstance(kind, JSON):
            m = marker(tier)
            if name.endswith("_addrs"):
                value: Any = [f"{m}@example.com"]
            elif "attachments" in name:
                content = base64.b64encode(m.encode()).decode()
                value = [{"name": f"{m}.txt", "contentType": "text/plain", "content": content}]
            else:
                value = {"name": m, "detail": marker(tier)}
            setattr(row, name, value)
        elif isinstance(kind, String | Text):
            length = getattr(kind, "length", None)
            if length is not None and length < 16:
                continue
            m = marker(tier)
            setattr(row, name, f"{m}@example.com" if _email_column(name) else m)
    return row


@dataclass
class Tier:
    """One tier's seeded rows: ids by kind, and what the walker needs to act as it."""

    tenant_id: int
    ids: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    codes: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    emails: list[str] = field(default_factory=list)
    phones: list[str] = field(default_factory=list)
    api_token: str = ""
    users: dict[str, str] = field(default_factory=dict)  # role -> email

    def first(self, kind: str) -> int:
        return self.ids[kind][0]


PASSWORD = "walker-password-1"


def seed_tier(session: Session, tenant_id: int, tier: str, port: int, roles: Iterable[str]) -> Tier:
    """Every kind of row a tier can own, each text field marked with ``tier``'s markers.

    Configs point at ``port`` on 127.0.0.1, where nothing listens: a Test connection or a
    Send test the walk triggers fails fast instead of reaching anything.
    """
    out = Tier(tenant_id)
    now = datetime.now(UTC)

    def add(row: Base, kind: str | None = None) -> Any:
        fill(row, tier)
        session.add(row)
        session.flush()
        if kind is not None:
            out.ids[kind].append(row.id)  # type: ignore[attr-defined]
        return row

    for role in roles:
        user = AppUser(
            tenant_id=tenant_id,
            email=f"{marker(tier)}@example.com",
            role=role,
            password_token_expires_at=now + timedelta(hours=1),
        )
        user.set_password(PASSWORD)
        add(user, "user")
        out.users[role] = user.email
    token = new_api_token()
    key = ApiKey(tenant_id=tenant_id, scopes="send read")
    key.set_token(token)
    key.prefix = marker(tier)[:16]
    add(key, "api_key")
    out.api_token = token

    server = MailSendServerConfig(
        tenant_id=tenant_id,
        host="127.0.0.1",
        port=port,
        security="plain",
        verify_tls=False,
        is_default=True,
        uncertain_policy="hold",
    )
    server.password = marker(tier)
    add(server, "mail_server")
    provider = SmsProviderConfig(
        tenant_id=tenant_id,
        provider="http_json",
        base_url=f"http://127.0.0.1:{port}/{marker(tier)}",
        is_default=True,
        retry_window_s=3600.0,
        uncertain_policy="hold",
    )
    provider.secret = marker(tier)
    provider.webhook_secret = marker(tier)
    add(provider, "sms_provider")
    add(SmsProviderRegion(tenant_id=tenant_id, provider_id=provider.id, country_code="GB"), "route")

    mail_template = MailTemplate(
        tenant_id=tenant_id,
        preferred_server_id=server.id,
        html_body=f"<p>{marker(tier)} {{{{ name }}}}</p>",
        text_body=f"{marker(tier)} {{{{ name }}}}",
        subject=f"{marker(tier)} {{{{ name }}}}",
    )
    add(mail_template, "mail_template")
    out.codes["mail_template"].append(mail_template.code)
    sms_template = SmsTemplate(tenant_id=tenant_id, content=f"{marker(tier)} {{{{ name }}}}")
    add(sms_template, "sms_template")
    out.codes["sms_template"].append(sms_template.code)
    # Each template's saved version, its content marked like the template's.
    for channel, saved in (("mail", mail_template), ("sms", sms_template)):
        session.add(
            TemplateVersion(
                tenant_id=tenant_id,
                channel=channel,
                template_id=saved.id,
                number=saved.version or 1,
                author=marker(tier),
                remark=marker(tier),
                content=template_versions.content_of(session, saved),
            )
        )
    session.flush()
    add(
        SmsTemplateProviderBinding(
            tenant_id=tenant_id, template_id=sms_template.id, provider_id=provider.id
        ),
        "binding",
    )

    # A status-callback endpoint before the records: their inserts write its deliveries.
    endpoint = CallbackEndpoint(
        tenant_id=tenant_id, url=f"http://127.0.0.1:{port}/{marker(tier)}", events=",mail.sent,"
    )
    endpoint.secret = "whsec_" + base64.b64encode(marker(tier).encode().ljust(24, b"x")).decode()
    add(endpoint, "callback_endpoint")
    add(
        CallbackDelivery(
            tenant_id=tenant_id,
            endpoint_id=endpoint.id,
            event_type="test",
            status="dead",
            payload={"id": None, "metadata": {"tier": marker(tier)}},
        ),
        "callback_delivery",
    )
    add(Notification(tenant_id=tenant_id, kind="quota", dedup_key=marker(tier)), "notification")

    scope = "PLATFORM" if tenant_id < 0 else "TENANT"
    for status in ("Failed", "Pending", "Uncertain", "Sent", "DeadLetter", "Retry"):
        email = f"{marker(tier)}@example.com"
        mail = MailSendRecord(
            tenant_id=tenant_id,
            scope=scope,
            status=status,
            to_addrs=[email],
            server_id=server.id,
            server_config_id=server.id,
            template_id=mail_template.id,
            ambiguous_attempt=status == "Uncertain",
            next_retry_at=now + timedelta(days=30),
            updated_time=now,
        )
        add(mail, "mail_record")
        out.emails.append(email)
        for address in mail.to_addrs + (mail.cc_addrs or []) + (mail.bcc_addrs or []):
            session.add(
                MailSendRecipient(
                    record_id=mail.id, tenant_id=tenant_id, address=address.lower(), kind="to"
                )
            )
        add(
            DeliveryEvent(
                tenant_id=tenant_id,
                channel="mail",
                config_id=server.id,
                provider="generic",
                event_type="delivered",
                occurred_at=now,
                record_id=mail.id,
                dedup_key=marker(tier),
            ),
            "event",
        )
        phone = f"+4479{next(_serial) % 10_000_000:07d}"
        sms = SmsSendRecord(
            tenant_id=tenant_id,
            scope=scope,
            status=status,
            phone_number=phone,
            country_code="GB",
            provider_config_id=provider.id,
            provider_kind="http_json",
            template_id=sms_template.id,
            ambiguous_attempt=status == "Uncertain",
            next_retry_at=now + timedelta(days=30),
            updated_time=now,
        )
        add(sms, "sms_record")
        out.phones.append(phone)
        add(
            DeliveryEvent(
                tenant_id=tenant_id,
                channel="sms",
                config_id=provider.id,
                provider="http_json",
                event_type="delivered",
                occurred_at=now,
                record_id=sms.id,
                dedup_key=marker(tier),
            ),
            "event",
        )
        add(
            DeadLetterMessage(
                tenant_id=tenant_id,
                source="SendExhausted",
                channel="mail",
                event_id=str(mail.id),
                attempts=5,
                status="Pending",
            ),
            "dead_letter",
        )
    add(TenantMessageQuota(tenant_id=tenant_id, mail_monthly_limit=1000, sms_monthly_limit=100))
    add(TenantMessageUsage(tenant_id=tenant_id, month=now.strftime("%Y-%m"), mail_count=7))
    suppressed = f"{marker(tier)}@example.com"
    add(
        Suppression(tenant_id=tenant_id, channel="mail", address=suppressed, reason="manual"),
        "suppression",
    )
    out.emails.append(suppressed)
    box = MailReceiveConfig(
        tenant_id=tenant_id, host="127.0.0.1", port=port, security="plain", verify_tls=False
    )
    box.secret = marker(tier)
    add(box, "receiver")
    add(MailReceiveState(config_id=box.id, uidvalidity=1, last_uid=3, last_run_at=now))
    add(
        ReceivedMail(
            tenant_id=tenant_id,
            config_id=box.id,
            uid=3,
            size=10,
            kind="bounce",
            bounce_status="permanent",
            record_id=out.first("mail_record"),
            dedup_key=marker(tier),
        ),
        "received_mail",
    )
    add(
        AuditEvent(tenant_id=tenant_id, action="config_create", target_type="mail_server"),
        "audit_event",
    )
    session.commit()
    return out


# --- snapshots --------------------------------------------------------------------------------

# Tables whose rows belong to a tier through a parent row rather than their own tenant_id.
_OWNER_THROUGH = {
    "mail_receive_state": ("config_id", "mail_receive_config"),
    "notification_read": ("notification_id", "notification"),
}
# Tables that belong to no tenant: sign-in throttling counts per address and client.
UNOWNED = {
    "login_throttle": "sign-in attempt counts, keyed by address and client: no tier's data",
    "chore_run": "when each periodic chore (the stuck-send sweep) last ran: no tier's data",
    "template_blob": "template attachment bytes by content hash; pages reach them only "
    "through a version of a template of the viewer's tier",
    "breaker_state": "a server's or provider's circuit breaker (up/down, last connection "
    "error), keyed by channel and config id; pages read it only for configs the tier lists",
    "config_epoch": "one row: the epoch that tells workers their cached configs changed",
}


def snapshot(
    session: Session, tenants: set[int]
) -> dict[tuple[str, tuple[Any, ...]], dict[str, Any]]:
    """Every row of every table that belongs to one of ``tenants``, keyed by (table, key)."""
    rows: dict[tuple[str, tuple[Any, ...]], dict[str, Any]] = {}
    for table in Base.metadata.sorted_tables:
        if table.name in UNOWNED:
            continue
        pk = [c.name for c in table.primary_key.columns]
        if "tenant_id" in table.c:
            stmt = select(table).where(table.c.tenant_id.in_(tenants))
        elif table.name == "tenant":
            stmt = select(table).where(table.c.id.in_(tenants))
        elif table.name in _OWNER_THROUGH:
            column, parent_name = _OWNER_THROUGH[table.name]
            parent = Base.metadata.tables[parent_name]
            owned = select(parent.c.id).where(parent.c.tenant_id.in_(tenants))
            stmt = select(table).where(table.c[column].in_(owned))
        else:
            raise AssertionError(
                f"table {table.name} has no tenant_id: say how its rows belong to a tier "
                "(route_walker._OWNER_THROUGH) or why they belong to none (UNOWNED)"
            )
        for row in session.execute(stmt).mappings():
            rows[(table.name, tuple(row[c] for c in pk))] = dict(row)
    return rows


def snapshot_changes(
    before: Mapping[tuple[str, tuple[Any, ...]], dict[str, Any]],
    after: Mapping[tuple[str, tuple[Any, ...]], dict[str, Any]],
) -> list[str]:
    """Rows changed, deleted or added between two snapshots, one line each."""
    problems = []
    for key, row in before.items():
        if key not in after:
            problems.append(f"{key[0]} {key[1]}: deleted")
            continue
        changed = {c: (row[c], after[key][c]) for c in row if row[c] != after[key][c]}
        if changed:
            problems.append(f"{key[0]} {key[1]}: changed {changed}")
    problems += [f"{key[0]} {key[1]}: added {after[key]}" for key in after if key not in before]
    return problems


# --- the HTML harvest --------------------------------------------------------------------------


@dataclass
class Harvest:
    """Field names seen in rendered pages: per rule (from forms, hx-* elements and links), and
    every name anywhere, with where it was seen."""

    fields: dict[str, dict[str, list[str]]] = field(default_factory=lambda: defaultdict(dict))
    names: dict[str, str] = field(default_factory=dict)  # name -> where first seen
    csrf: str | None = None

    def add(self, rule: str | None, name: str, value: str | None, where: str) -> None:
        self.names.setdefault(name, where)
        if rule is not None:
            values = self.fields[rule].setdefault(name, [])
            if value is not None and value not in values:
                values.append(value)


class _PageParser(HTMLParser):
    """Forms (with their inputs, wherever a ``form=`` attribute puts them), buttons' names and
    formactions, hx-* requests with hx-vals and hx-include, links with query strings, the
    CSRF token in ``hx-headers`` and every ``name`` attribute."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.forms: dict[str, dict[str, Any]] = {}
        self.stack: list[str] = []  # open forms' keys
        self.requests: list[tuple[str, str, dict[str, str], list[str]]] = []
        self.links: list[str] = []
        self.names: list[tuple[str, str | None]] = []
        self.csrf: str | None = None
        self._select: tuple[str, str] | None = None
        self._n = 0

    def _form(self, attrs: dict[str, str | None]) -> dict[str, Any] | None:
        owner = attrs.get("form")
        if owner and owner in self.forms:
            return self.forms[owner]
        return self.forms[self.stack[-1]] if self.stack else None

    def handle_starttag(self, tag: str, attr_list: list[tuple[str, str | None]]) -> None:
        attrs = dict(attr_list)
        if tag == "body" and attrs.get("hx-headers"):
            with contextlib.suppress(ValueError):
                self.csrf = json.loads(attrs["hx-headers"] or "{}").get("X-CSRFToken")
        if tag == "meta" and attrs.get("name") == "csrf-token":
            self.csrf = attrs.get("content")
        if tag == "form":
            self._n += 1
            key = attrs.get("id") or f"form-{self._n}"
            self.forms[key] = {
                "actions": {(attrs.get("method") or "get").upper(): {attrs.get("action") or ""}},
                "fields": [],
            }
            for verb in ("get", "post", "put", "patch", "delete"):
                if attrs.get(f"hx-{verb}"):
                    self.forms[key]["actions"].setdefault(verb.upper(), set()).add(
                        attrs[f"hx-{verb}"]
                    )
            self.stack.append(key)
        form = self._form(attrs)
        name = attrs.get("name")
        if tag in ("input", "select", "textarea", "button") and name:
            value = attrs.get("value")
            if tag == "input" and attrs.get("type") == "file":
                value = None
            self.names.append((name, value))
            if form is not None:
                form["fields"].append((name, value))
            if tag == "select":
                self._select = (name, next(iter(form["fields"][-1:]), ("", ""))[0] if form else "")
        elif name and tag not in ("meta", "a"):
            self.names.append((name, attrs.get("value")))
        if tag == "option" and self._select is not None:
            value = attrs.get("value")
            self.names.append((self._select[0], value))
            if form is not None:
                form["fields"].append((self._select[0], value))
        if tag == "button" and form is not None and attrs.get("formaction"):
            method = (attrs.get("formmethod") or "post").upper()
            form["actions"].setdefault(method, set()).add(attrs["formaction"])
        if tag != "form":
            for verb in ("get", "post", "put", "patch", "delete"):
                url = attrs.get(f"hx-{verb}")
                if not url:
                    continue
                vals: dict[str, str] = {}
                if attrs.get("hx-vals"):
                    try:
                        vals = {k: str(v) for k, v in json.loads(attrs["hx-vals"] or "{}").items()}
                    except ValueError:
                        vals = {}
                include = re.findall(r"name=['\"]?([\w\[\]-]+)", attrs.get("hx-include") or "")
                extra = [n for n, _ in form["fields"]] if form is not None else []
                self.requests.append((verb.upper(), url, vals, include + extra))
        elif attrs.get("hx-vals"):
            try:
                for k, v in json.loads(attrs["hx-vals"] or "{}").items():
                    self.forms[self.stack[-1]]["fields"].append((k, str(v)))
            except ValueError:
                pass
        if tag == "a" and attrs.get("href"):
            self.links.append(attrs["href"] or "")

    def handle_endtag(self, tag: str) -> None:
        if tag == "form" and self.stack:
            self.stack.pop()
        if tag == "select":
            self._select = None


def match_rule(app: Flask, url: str, method: str) -> tuple[Rule, dict[str, Any]] | None:
    """The rule ``url`` reaches with ``method``, or None (external, or no such route)."""
    parts = urlsplit(url)
    if parts.scheme or parts.netloc or not parts.path.startswith("/"):
        return None
    adapter = app.url_map.bind("localhost")
    try:
        rule, args = adapter.match(parts.path, method, return_rule=True)
    except HTTPException:
        return None
    except Exception:  # a RequestRedirect (trailing slash) and the like
        return None
    return rule, args


def harvest_page(
    app: Flask, harvest: Harvest, page_url: str, html: str, posted_to: str | None = None
) -> None:
    """Add one rendered page's field names to ``harvest``; a fragment answering a post to
    ``posted_to`` ("METHOD rule") is swapped into that form, so its loose fields belong to it."""
    parser = _PageParser()
    parser.feed(html)
    if parser.csrf and harvest.csrf is None:
        harvest.csrf = parser.csrf
    where = page_url
    for name, value in parser.names:
        harvest.add(None, name, value, where)
    if posted_to is not None:
        in_forms = {n for form in parser.forms.values() for n, _ in form["fields"]}
        for name, value in parser.names:
            if name not in in_forms:
                harvest.add(posted_to, name, value, where)
    for form in parser.forms.values():
        for method, actions in form["actions"].items():
            for action in actions:
                target = match_rule(app, action or page_url, method)
                if target is None:
                    continue
                rule = f"{method} {target[0].rule}"
                harvest.fields.setdefault(rule, {})
                for name, value in form["fields"]:
                    harvest.add(rule, name, value, where)
                for name, value in parse_qsl(urlsplit(action).query, keep_blank_values=True):
                    harvest.add(rule, name, value, where)
    for method, url, vals, include in parser.requests:
        target = match_rule(app, url, method)
        if target is None:
            continue
        rule = f"{method} {target[0].rule}"
        harvest.fields.setdefault(rule, {})
        for name, value in vals.items():
            harvest.add(rule, name, value, where)
        for name in include:
            harvest.add(rule, name, None, where)
        for name, value in parse_qsl(urlsplit(url).query, keep_blank_values=True):
            harvest.add(rule, name, value, where)
    for href in parser.links:
        query = urlsplit(href).query
        target = match_rule(app, href, "GET")
        if target is None or not query:
            continue
        rule = f"GET {target[0].rule}"
        for name, value in parse_qsl(query, keep_blank_values=True):
            harvest.add(rule, name, value, where)


def openapi_fields(document: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Per ``METHOD /path`` of the OpenAPI document: its parameters and its body's fields
    (nested objects and arrays flattened), with the body schema."""
    schemas = document.get("components", {}).get("schemas", {})

    def resolve(schema: Mapping[str, Any]) -> Mapping[str, Any]:
        ref = schema.get("$ref")
        if ref:
            return resolve(schemas[ref.rsplit("/", 1)[-1]])
        return schema

    def names(schema: Mapping[str, Any], seen: set[str]) -> Iterator[str]:
        schema = resolve(schema)
        for sub in schema.get("oneOf", []) + schema.get("anyOf", []) + schema.get("allOf", []):
            yield from names(sub, seen)
        if "items" in schema:
            yield from names(schema["items"], seen)
        for name, sub in schema.get("properties", {}).items():
            yield name
            ref = sub.get("$ref") or sub.get("items", {}).get("$ref")
            if ref is None or ref not in seen:
                yield from names(sub, seen | ({ref} if ref else set()))

    out: dict[str, dict[str, Any]] = {}
    for path, operations in document.get("paths", {}).items():
        for method, operation in operations.items():
            if not isinstance(operation, dict) or method == "parameters":
                continue
            body = (
                operation.get("requestBody", {})
                .get("content", {})
                .get("application/json", {})
                .get("schema")
            )
            out[f"{method.upper()} {path}"] = {
                "params": [
                    (p["name"], p.get("in", "query")) for p in operation.get("parameters", [])
                ],
                "body": sorted(set(names(body, set()))) if body else [],
                "schema": resolve(body) if body else None,
                "resolve": resolve,
            }
    return out


# --- the classification ------------------------------------------------------------------------


@dataclass(frozen=True)
class Param:
    """How the walker fills one parameter.

    ``kind`` is one of: ``id`` (``of``: which rows' ids; another tier's go in), ``code``
    (a row addressed by its code or address: another tier's goes in), ``tenant`` (a tenant
    selector), ``enum`` (``values``: each one is tried), ``text`` (harmless free text),
    ``csrf``, ``next`` (a same-site path), ``file`` (an upload), ``index`` (a position in the
    viewer's own list, not an id across tiers).
    """

    kind: str
    of: tuple[str, ...] = ()
    values: tuple[str, ...] = ()
    sample: str = "walker"
    multi: bool = False  # one value per id (checkboxes) instead of one comma-joined value
    joined: bool = False  # "1,2,3"


def ids_of(*kinds: str, multi: bool = False, joined: bool = False) -> Param:
    return Param("id", of=kinds, multi=multi, joined=joined)


RECORDS = ("mail_record", "sms_record")
TEXT = Param("text")
SEND_STATUSES = (
    "Pending",
    "Sending",
    "Sent",
    "Retry",
    "Failed",
    "DeadLetter",
    "Cancelled",
    "Suppressed",
    "Uncertain",
)


def enum(*values: str) -> Param:
    return Param("enum", values=values)


def text(sample: str) -> Param:
    return Param("text", sample=sample)


# --- the walk ----------------------------------------------------------------------------------

JSON_PREFIXES = (
    "/api/",
    "/MailSendRecord/",
    "/SmsSendRecord/",
    "/TenantMessageQuota/",
    "/webhooks/",
)
REFUSALS = {400, 401, 403, 404, 405, 422}
ANSWERS = {200, 201, 202, 204, 302, 303, 400, 401, 403, 404, 405, 409, 413, 415, 422, 429}
_RECORD_STATUS = {"resolve": 2, "cancel": 1}  # which seeded record a path id names


@dataclass
class Identity:
    """Who the walker is: a signed-in client or an API key, and which tiers' markers it must
    never see (a platform identity sees its own tier and every tenant's name)."""

    name: str
    client: FlaskClient
    platform: bool
    csrf: str | None = None
    token: str | None = None
    forbidden: frozenset[str] = frozenset("bpn")
    after: Callable[[str], None] | None = None  # called with the endpoint after each request

    @property
    def session(self) -> bool:
        return self.token is None


@dataclass
class Call:
    method: str
    rule: Rule
    path: str
    query: list[tuple[str, str]]
    form: list[tuple[str, str]] | None
    json_body: Any
    hx: bool
    foreign: bool  # the path names another tier's row: only a refusal may answer
    tier: str

    def describe(self) -> str:
        parts = [f"{self.method} {self.path}"]
        if self.query:
            parts.append("?" + urlencode(self.query))
        if self.form is not None:
            parts.append(f" form={urlencode(self.form)}")
        if self.json_body is not None:
            parts.append(f" json={json.dumps(self.json_body)}")
        if self.hx:
            parts.append(" [HX-Request]")
        return "".join(parts)

    def text(self) -> str:
        return self.describe()

    def sent_text(self) -> str:
        """Every value the call sends, unencoded: what the markers it sent are read from (a
        marker is letters and digits, the same in a URL's encoding)."""
        parts = [self.path]
        parts += [v for _, v in self.query]
        if self.form is not None:
            parts += [str(v) for _, v in self.form]
        if self.json_body is not None:
            parts.append(json.dumps(self.json_body))
        return " ".join(parts)


@dataclass
class Outcome:
    requests: int = 0
    reached: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    requests_by: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    problems: list[str] = field(default_factory=list)
    rules: set[str] = field(default_factory=set)


class FreshClient(FlaskClient):
    """A test client whose every request runs in its own app context: the tests' fixture keeps
    one pushed, and requests would otherwise share its ``g`` (one client's CSRF token) and its
    database session (rows read by an earlier request)."""

    def open(self, *args: Any, **kwargs: Any) -> TestResponse:
        with self.application.app_context():
            return super().open(*args, **kwargs)


def client_for(app: Flask) -> FlaskClient:
    return FreshClient(app, app.response_class, use_cookies=True)


def markers_in(response: TestResponse) -> set[str]:
    data = response.get_data(as_text=True)
    headers = "\n".join(f"{k}: {v}" for k, v in response.headers.items())
    return {m.group(0).lower() for m in MARKER.finditer(data + "\n" + headers)}


def is_csrf_refusal(response: TestResponse) -> bool:
    data = response.get_data(as_text=True)
    return response.status_code == 400 and ("CSRF" in data or "form expired" in data)


def is_login_redirect(response: TestResponse) -> bool:
    return response.status_code in (302, 303) and "/auth/login" in response.headers.get(
        "Location", ""
    )


def _sms_context(rule: Rule, args: Mapping[str, Any]) -> bool:
    return (
        "sms" in rule.rule.lower()
        or "sms" in {str(v).lower() for v in args.values()}
        or (args.get("kind") == "SmsSendRecord")
    )


def _any_values(rule: Rule, name: str) -> list[str]:
    converter = rule._converters[name]
    items = getattr(converter, "items", None)
    if items:
        return list(items)
    return re.findall(r"[\w-]+", converter.regex.replace("(?:", "").replace("\\", ""))


@dataclass
class Walker:
    """Builds and sends every request of the walk for one identity, and checks each answer."""

    app: Flask
    params: Mapping[str, Param]  # the classification: parameter name -> how to fill it
    path_params: Mapping[str, Param]
    harvest: Harvest
    openapi: Mapping[str, dict[str, Any]]  # "METHOD rule" -> the OpenAPI operation's fields
    own: Tier
    tiers: Mapping[str, Tier]  # "b", "p"
    outcome: Outcome
    waived: Mapping[tuple[str, str], str] = field(default_factory=dict)

    # -- values -------------------------------------------------------------------------------

    def _kind(self, param: Param, sms: bool) -> str:
        kinds = list(param.of)
        if len(kinds) > 1:
            chosen = [k for k in kinds if k.startswith("sms") == sms]
            kinds = chosen or kinds
        return kinds[0]

    def _id(self, tier: Tier, kind: str, rule: Rule) -> int:
        ids = tier.ids[kind]
        if kind.endswith("_record"):
            for word, index in _RECORD_STATUS.items():
                if word in rule.rule:
                    return ids[index]
        return ids[0]

    def values(
        self,
        name: str,
        param: Param,
        tier: Tier,
        identity: Identity,
        rule: Rule,
        sms: bool,
        default: str | None,
    ) -> list[str]:
        """The value(s) ``name`` gets in a request that puts ``tier``'s ids in."""
        if param.kind == "id":
            kind = self._kind(param, sms)
            if param.multi:
                return [str(i) for i in tier.ids[kind]]
            if param.joined:
                return [",".join(str(i) for i in tier.ids[kind])]
            return [str(self._id(tier, kind, rule))]
        if param.kind == "code":
            kind = self._kind(param, sms)
            if kind == "user_email":
                return [next(iter(tier.users.values()))]
            if kind == "search":
                return [tier.phones[0] if sms else tier.emails[0]]
            return [tier.codes[kind][0]]
        if param.kind == "tenant":
            return [str(self.own.tenant_id if identity.platform else tier.tenant_id)]
        if param.kind == "csrf":
            return [identity.csrf or ""]
        if param.kind == "enum":
            if default is not None and default in param.values:
                return [default]
            return [param.values[0]] if param.values else [""]
        if param.kind == "next":
            return ["/"]
        if param.kind == "index":
            return ["0"]
        if param.kind == "file":
            return []
        return [default if default else param.sample]

    def _json_value(
        self,
        name: str,
        schema: Mapping[str, Any],
        tier: Tier,
        identity: Identity,
        rule: Rule,
        sms: bool,
        resolve: Callable[[Mapping[str, Any]], Mapping[str, Any]],
    ) -> Any:
        schema = resolve(schema)
        if schema.get("oneOf"):
            schema = resolve(schema["oneOf"][0])
        param = self.params[name]
        kind = schema.get("type")
        if kind == "array":
            items = resolve(schema.get("items", {}))
            if param.kind == "id":
                return [
                    int(v)
                    for v in self.values(
                        name, replace_multi(param), tier, identity, rule, sms, None
                    )
                ]
            if items.get("type") == "object" or items.get("properties"):
                return [self._json_object(items, tier, identity, rule, sms, resolve)]
            return [self.values(name, param, tier, identity, rule, sms, None)[0]]
        if kind == "object" and schema.get("properties"):
            return self._json_object(schema, tier, identity, rule, sms, resolve)
        if kind == "object":
            return {"name": "walker"}
        values = self.values(name, param, tier, identity, rule, sms, None)
        value = values[0] if values else ""
        if kind == "integer" or param.kind in ("id", "tenant", "index"):
            return int(value) if value.lstrip("-").isdigit() else 1
        if kind == "boolean":
            return True
        return value

    def _json_object(
        self,
        schema: Mapping[str, Any],
        tier: Tier,
        identity: Identity,
        rule: Rule,
        sms: bool,
        resolve: Callable[[Mapping[str, Any]], Mapping[str, Any]],
    ) -> dict[str, Any]:
        return {
            name: self._json_value(name, sub, tier, identity, rule, sms, resolve)
            for name, sub in schema.get("properties", {}).items()
        }

    # -- requests -----------------------------------------------------------------------------

    def route_fields(self, method: str, rule: Rule) -> dict[str, list[str]]:
        """The rule's own fields (harvested from pages and the OpenAPI document) plus every
        id-like field the walker knows, so each id field is tried on every route."""
        fields: dict[str, list[str]] = {
            name: list(values)
            for name, values in self.harvest.fields.get(f"{method} {rule.rule}", {}).items()
        }
        for name, _where in self.openapi.get(f"{method} {rule.rule}", {}).get("params", []):
            fields.setdefault(name, [])
        for name, param in self.params.items():
            if param.kind in ("id", "code", "tenant"):
                fields.setdefault(name, [])
        return fields

    def calls(self, rule: Rule, method: str, identity: Identity) -> Iterator[Call]:
        json_route = rule.rule.startswith(JSON_PREFIXES)
        api_doc = self.openapi.get(f"{method} {rule.rule}")
        fields = self.route_fields(method, rule)
        own_fields = set(self.harvest.fields.get(f"{method} {rule.rule}", {}))
        path_names = list(rule.arguments)
        id_paths = [n for n in path_names if self.path_params[n].kind in ("id",)]
        choices: list[list[tuple[str, str]]] = [[]]
        for name in path_names:
            param = self.path_params[name]
            if type(rule._converters[name]).__name__ == "AnyConverter":
                options = _any_values(rule, name)
            elif param.kind == "enum":
                options = list(param.values)
            else:
                continue
            choices = [[*c, (name, o)] for c in choices for o in options]
        for tier_name, tier in self.tiers.items():
            foreign_tier = tier_name in identity.forbidden
            if not foreign_tier:
                continue  # a platform identity's own tier: nothing to prove there
            # A's own row in the path with B's ids in the body: where a form could link them.
            own_mode = tier_name == "b" and method != "GET"
            modes = ["foreign", "own"] if id_paths and own_mode else ["foreign"]
            if not id_paths:
                modes = ["none"]
            if len(id_paths) > 1 and tier_name == "b":
                modes += [f"only:{n}" for n in id_paths]
            for fixed in choices:
                args = dict(fixed)
                sms = _sms_context(rule, args)
                for mode in modes:
                    path_args: dict[str, Any] = dict(args)
                    foreign_path = False
                    for name in path_names:
                        if name in path_args:
                            continue
                        param = self.path_params[name]
                        use_foreign = mode == "foreign" or mode == f"only:{name}"
                        if param.kind == "id":
                            source = tier if use_foreign else self.own
                            path_args[name] = self._id(source, self._kind(param, sms), rule)
                            foreign_path = foreign_path or (use_foreign and foreign_tier)
                        elif param.kind == "tenant":
                            source = tier if use_foreign and not identity.platform else self.own
                            path_args[name] = source.tenant_id
                            foreign_path = foreign_path or (
                                use_foreign and foreign_tier and not identity.platform
                            )
                        else:
                            path_args[name] = self.values(
                                name, param, tier, identity, rule, sms, None
                            )[0]
                    if (
                        mode == "foreign"
                        and id_paths == []
                        and any(self.path_params[n].kind == "tenant" for n in path_names)
                    ):
                        pass
                    _, path = rule.build(path_args, append_unknown=False)  # type: ignore[misc]
                    base: list[tuple[str, str]] = []
                    enum_fields: list[tuple[str, Param, list[str]]] = []
                    for name, seen in fields.items():
                        param = self.params[name]
                        default = seen[0] if seen else None
                        for value in self.values(name, param, tier, identity, rule, sms, default):
                            base.append((name, value))
                        if param.kind == "enum" and name in own_fields:
                            others = [
                                v for v in dict.fromkeys(seen + list(param.values)) if v != default
                            ]
                            enum_fields.append((name, param, others))
                    stray = str(self.own.tenant_id if identity.platform else tier.tenant_id)
                    stray_args = [("tenantId", stray), ("tenant_id", stray)]
                    variants: list[tuple[list[tuple[str, str]], bool]] = [
                        (base, False),
                        (base, True),
                    ]
                    if identity.token:
                        variants = [(values, hx) for values, hx in variants if not hx]
                    if identity.token and not json_route:
                        variants = [(base, False)]  # a key on a portal page: sign-in, always
                        enum_fields = []
                    if tier_name != "b":
                        enum_fields = []
                    for name, _param, others in enum_fields:
                        for value in others:
                            varied = [(n, v) for n, v in base if n != name] + [(name, value)]
                            variants.append((varied, True))
                    for values, hx in variants:
                        if method in ("GET", "HEAD", "DELETE"):
                            yield Call(
                                method,
                                rule,
                                path,
                                values + stray_args,
                                None,
                                None,
                                hx,
                                foreign_path,
                                tier_name,
                            )
                            continue
                        if json_route:
                            if api_doc and api_doc.get("schema"):
                                body = self._json_object(
                                    api_doc["schema"], tier, identity, rule, sms, api_doc["resolve"]
                                )
                            else:
                                body = {}
                            for name, value in values:
                                param = self.params[name]
                                if name in body or param.kind not in ("id", "code", "tenant"):
                                    continue
                                if param.kind == "id":
                                    body[name] = [
                                        int(v)
                                        for v in self.values(
                                            name,
                                            replace_multi(param),
                                            tier,
                                            identity,
                                            rule,
                                            sms,
                                            None,
                                        )
                                    ]
                                else:
                                    body[name] = value
                            yield Call(
                                method,
                                rule,
                                path,
                                stray_args,
                                None,
                                body,
                                hx,
                                foreign_path,
                                tier_name,
                            )
                            if identity.session and not rule.rule.startswith("/webhooks/"):
                                yield Call(
                                    method,
                                    rule,
                                    path,
                                    stray_args,
                                    values,
                                    None,
                                    hx,
                                    foreign_path,
                                    tier_name,
                                )
                        else:
                            yield Call(
                                method,
                                rule,
                                path,
                                stray_args,
                                values,
                                None,
                                hx,
                                foreign_path,
                                tier_name,
                            )

    # -- sending and checking ---------------------------------------------------------------

    def send(self, identity: Identity, call: Call) -> TestResponse:
        headers = {}
        if identity.token:
            headers["Authorization"] = f"Bearer {identity.token}"
        if identity.csrf and call.method not in ("GET", "HEAD"):
            headers["X-CSRFToken"] = identity.csrf
        if call.hx:
            headers["HX-Request"] = "true"
        kwargs: dict[str, Any] = {"query_string": call.query, "headers": headers}
        if call.json_body is not None:
            kwargs["json"] = call.json_body
        elif call.form is not None:
            data: MultiDict[str, Any] = MultiDict(call.form)
            for name, param in self.params.items():
                if param.kind == "file" and name in self.route_fields(call.method, call.rule):
                    from io import BytesIO

                    data.add(name, (BytesIO(b"walker"), "walker.txt", "text/plain"))
            kwargs["data"] = data
        return identity.client.open(call.path, method=call.method, **kwargs)

    def check(self, identity: Identity, call: Call, response: TestResponse) -> None:
        out = self.outcome
        out.requests += 1
        out.requests_by[identity.name] += 1
        status = response.status_code
        if not (
            status in (401, 403)
            or is_csrf_refusal(response)
            or (is_login_redirect(response) and call.rule.endpoint != "auth.login")
        ):
            out.reached[identity.name] += 1

        # Described only for a problem: describing every call URL-encoded its values again.
        def where() -> str:
            return f"{identity.name}: {call.describe()}"

        if status >= 500:
            out.problems.append(f"500 {where()}")
        elif status not in ANSWERS:
            out.problems.append(f"unexpected status {status} {where()}")
        elif call.foreign and not (
            status in REFUSALS
            or is_login_redirect(response)
            # the record page's htmx buttons get an error line, not an error status
            or (call.hx and 'class="field-error"' in response.get_data(as_text=True))
        ):
            out.problems.append(
                f"not refused ({status}) with another tier's id in the path {where()}"
            )
        sent = {m.group(0).lower() for m in MARKER.finditer(call.sent_text())}
        seen = markers_in(response) - sent
        waived = self.waived.get((call.method, call.rule.rule))
        leaked = sorted(m for m in seen if m[2] in identity.forbidden)
        if leaked and not (waived and identity.platform):
            body = response.get_data(as_text=True)
            at = body.lower().find(leaked[0])
            snippet = body[max(0, at - 120) : at + 60].replace("\n", " ") if at >= 0 else "(header)"
            out.problems.append(f"LEAK {leaked} {where()} -> {status}: …{snippet}…")

    def walk(self, identity: Identity, rules: list[tuple[str, Rule]]) -> None:
        for method, rule in rules:
            self.outcome.rules.add(f"{method} {rule.rule}")
            for call in self.calls(rule, method, identity):
                response = self.send(identity, call)
                self.check(identity, call, response)
                if identity.after is not None:
                    identity.after(rule.endpoint)


def replace_multi(param: Param) -> Param:
    return Param(param.kind, of=param.of, values=param.values, sample=param.sample, multi=True)
