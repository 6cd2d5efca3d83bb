"""``import-config``: an idempotent upsert of a whole configuration from one JSON file.

Entries are matched by natural keys (tenant slug, user email, names and codes within a
tenant), so running the same file twice changes nothing. The whole file is one transaction:
an invalid entry raises ``ConfigImportError`` naming it, and nothing is written. Text fields
follow the portal's forms' rule (``validation.text_problem``): one line, except templates'
bodies, and no control characters.

A re-import never undoes what people did in the portal: a true/false field the file omits
(``enabled``, ``active``, ``isDefault``, ``verifyTls``, ``readReceipt``) and an omitted
``uncertainPolicy`` or API key ``scopes`` keep the stored value (new rows get the default),
and a revoked API key stays revoked (reported, not an error). A change to a user's password,
role or active flag ends that user's sessions.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from email_validator import EmailNotValidError
from sqlalchemy import func, inspect, select
from sqlalchemy.orm import Session

from portal.config import Settings
from portal.messaging.records.addresses import typed_email
from portal.messaging.records.search import country_code
from portal.messaging.records.validation import text_problem
from portal.models import (
    ApiKey,
    ApiScope,
    AppUser,
    CallbackEndpoint,
    MailReceiveConfig,
    MailSendServerConfig,
    MailTemplate,
    Role,
    SmsProviderConfig,
    SmsProviderKind,
    SmsProviderRegion,
    SmsTemplate,
    SmsTemplateProviderBinding,
    SmtpSecurity,
    Tenant,
    TenantMessageQuota,
    UncertainPolicy,
)
from portal.models.record import Stream
from portal.models.tenant import (
    DEFAULT_API_SCOPES,
    MIN_PASSWORD_CHARS,
    hash_api_token,
    password_problem,
)
from portal.tenancy import PLATFORM_TENANT_ID

PLATFORM_SLUG = "platform"
SECTIONS = (
    "tenants",
    "users",
    "apiKeys",
    "mailServers",
    "smsProviders",
    "smsRoutes",
    "mailTemplates",
    "smsTemplates",
    "smsBindings",
    "quotas",
    "mailReceivers",
    "callbacks",
)

M = TypeVar("M")


class ConfigImportError(Exception):
    """An entry of the file is invalid; the message names it."""


@dataclass
class ImportReport:
    created: dict[str, int] = field(default_factory=dict)
    updated: dict[str, int] = field(default_factory=dict)
    # Entries left as they are, and why ("apiKeys[2]: revoked; left revoked"): not errors.
    notes: list[str] = field(default_factory=list)

    def count(self, section: str, created: bool) -> None:
        target = self.created if created else self.updated
        target[section] = target.get(section, 0) + 1

    def summary(self) -> str:
        parts = [f"{k}: {v} created" for k, v in self.created.items()]
        parts += [f"{k}: {v} updated" for k, v in self.updated.items()]
        return "\n".join(["; ".join(parts) or "nothing to do", *self.notes])


class _Entry:
    """One entry of a section, with typed accessors that name the entry on error."""

    def __init__(self, section: str, index: int, data: Any, allowed: set[str]):
        self.where = f"{section}[{index}]"
        if not isinstance(data, Mapping):
            raise ConfigImportError(f"{self.where}: must be an object")
        unknown = sorted(set(data) - allowed)
        if unknown:
            raise ConfigImportError(f"{self.where}: unknown field {unknown[0]!r}")
        self.data = data

    def fail(self, message: str) -> ConfigImportError:
        return ConfigImportError(f"{self.where}: {message}")

    def text(
        self, name: str, *, required: bool = False, max_len: int = 500, multiline: bool = False
    ) -> str | None:
        """A string field: one line unless ``multiline`` (a template's body), and without
        control characters either way, by the rule the portal's forms ask
        (``validation.text_problem``)."""
        value = self.data.get(name)
        if value is None:
            if required:
                raise self.fail(f"{name} is required")
            return None
        if not isinstance(value, str) or len(value) > max_len:
            raise self.fail(f"{name} must be a string of at most {max_len} characters")
        if required and not value.strip():
            raise self.fail(f"{name} must not be empty")
        problem = text_problem(value, multiline=multiline)
        if problem is not None:
            raise self.fail(f"{name} {problem}")
        return value

    def req(self, name: str, max_len: int = 500, *, multiline: bool = False) -> str:
        value = self.text(name, required=True, max_len=max_len, multiline=multiline)
        assert value is not None
        return value

    def number(self, name: str, *, lo: int = 0, hi: int = 2**31 - 1) -> int | None:
        value = self.data.get(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise self.fail(f"{name} must be a whole number from {lo} to {hi}")
        return value

    def flag(self, name: str, current: bool | None, default: bool) -> bool:
        """A true/false field. Omitted, ``current`` stays (someone may have set it in the
        portal: a disabled server, a deactivated user); a new row (``current`` None) gets
        ``default``."""
        if name not in self.data:
            return default if current is None else current
        value = self.data[name]
        if not isinstance(value, bool):
            raise self.fail(f"{name} must be true or false")
        return value

    def scopes(self, name: str) -> str | None:
        """An API key's scopes: a non-empty list of send and read (None: omitted), stored as
        the model keeps them ("send read")."""
        if name not in self.data:
            return None
        value = self.data[name]
        known = [scope.value for scope in ApiScope]
        if (
            not isinstance(value, list)
            or not value
            or any(not isinstance(v, str) or v not in known for v in value)
        ):
            raise self.fail(f"{name} must be a non-empty list of {', '.join(map(repr, known))}")
        return " ".join(scope for scope in known if scope in value)

    def choice(self, name: str, choices: list[str], default: str | None = None) -> str:
        value = self.data.get(name, default)
        if value not in choices:
            raise self.fail(f"{name} must be one of {', '.join(choices)}")
        assert isinstance(value, str)
        return value

    def email(self, name: str, *, required: bool = False) -> str | None:
        value = self.text(name, required=required, max_len=320)
        if value is None:
            return None
        try:
            return typed_email(value)
        except EmailNotValidError as exc:
            raise self.fail(f"{name} is not a valid email address: {exc}") from None


def import_config(session: Session, data: Any) -> ImportReport:
    """Upsert everything in ``data``; the caller commits (or rolls back on error)."""
    if not isinstance(data, Mapping):
        raise ConfigImportError("the file must hold a JSON object")
    unknown = sorted(set(data) - set(SECTIONS))
    if unknown:
        raise ConfigImportError(f"unknown section {unknown[0]!r}; expected {', '.join(SECTIONS)}")
    for section in SECTIONS:
        if not isinstance(data.get(section, []), list):
            raise ConfigImportError(f"{section} must be a list")
    importer = _Importer(session)
    for section in SECTIONS:
        handler: Callable[[_Entry], None] = getattr(importer, f"_{section}")
        allowed = _ALLOWED[section]
        for index, raw in enumerate(data.get(section, [])):
            handler(_Entry(section, index, raw, allowed))
            session.flush()
    return importer.report


# What a mail server and a bounce mailbox both are: a named connection to a server.
_CONNECTION = {"tenant", "name", "host", "port", "security", "verifyTls", "username", "password"}

_ALLOWED: dict[str, set[str]] = {
    "tenants": {"slug", "name", "active", "mailRetentionDays", "smsRetentionDays", "country"},
    "users": {"email", "name", "password", "role", "tenant", "active"},
    "apiKeys": {"tenant", "name", "token", "scopes"},
    "mailServers": {
        *_CONNECTION,
        "fromAddress",
        "fromName",
        "replyTo",
        "readReceipt",
        "isDefault",
        "enabled",
        "dailySendLimit",
        "rateLimitPerMinute",
        "uncertainPolicy",
    },
    "smsProviders": {
        "tenant",
        "name",
        "provider",
        "baseUrl",
        "accountId",
        "secret",
        "webhookSecret",
        "senderId",
        "isDefault",
        "enabled",
        "dailySendLimit",
        "rateLimitPerMinute",
        "retryWindowS",
        "uncertainPolicy",
    },
    "smsRoutes": {"tenant", "provider", "country", "priority"},
    "mailTemplates": {
        "tenant",
        "code",
        "name",
        "subject",
        "html",
        "text",
        "enabled",
        "priority",
        "replyTo",
        "preferredServer",
        "stream",
        "strictVariables",
    },
    "smsTemplates": {"tenant", "code", "name", "content", "enabled", "stream", "strictVariables"},
    "smsBindings": {
        "tenant",
        "template",
        "provider",
        "country",
        "externalTemplateId",
        "signature",
    },
    "quotas": {"tenant", "mailMonthlyLimit", "smsMonthlyLimit"},
    "callbacks": {"tenant", "name", "url", "events", "secret", "enabled"},
    "mailReceivers": {*_CONNECTION, "folder", "enabled"},
}


class _Importer:
    def __init__(self, session: Session):
        self.session = session
        self.report = ImportReport()

    # --- lookups ---------------------------------------------------------------------

    def tenant_id(self, entry: _Entry) -> int:
        slug = entry.req("tenant", 64)
        tenant_id = tenant_by_slug(self.session, slug)
        if tenant_id is None:
            raise entry.fail(f"tenant {slug!r} does not exist (list it under tenants first)")
        return tenant_id

    @staticmethod
    def stored(row: object, attribute: str) -> Any:
        """The stored value of a row's attribute; None for a row this import creates."""
        return getattr(row, attribute) if inspect(row).has_identity else None

    def _one(self, model: type[M], entry: _Entry, what: str, **where: Any) -> M:
        row = self.session.scalar(select(model).filter_by(**where))
        if row is None:
            raise entry.fail(f"{what} does not exist in that tenant")
        return row

    def _upsert(self, model: type[M], section: str, **key: Any) -> M:
        # filter_by(x=None) would compare with NULL and never match: use IS NULL.
        clauses = [
            getattr(model, k).is_(None) if v is None else getattr(model, k) == v
            for k, v in key.items()
        ]
        row = self.session.scalar(select(model).where(*clauses))
        created = row is None
        if row is None:
            row = model(**key)
            self.session.add(row)
        self.report.count(section, created)
        return row

    # --- sections --------------------------------------------------------------------

    def _tenants(self, e: _Entry) -> None:
        slug = e.req("slug", 64)
        if slug == PLATFORM_SLUG or not re.fullmatch(r"[a-z0-9][a-z0-9-]{0,63}", slug):
            raise e.fail("slug must be lower-case letters, digits and dashes, not 'platform'")
        row = self._upsert(Tenant, "tenants", slug=slug)
        row.name = e.req("name", 200)
        row.is_active = e.flag("active", self.stored(row, "is_active"), True)
        # Retention: omitted keeps what is stored; null keeps records forever.
        for name, attribute in (
            ("mailRetentionDays", "mail_retention_days"),
            ("smsRetentionDays", "sms_retention_days"),
        ):
            if name in e.data:
                setattr(row, attribute, e.number(name, lo=2, hi=36500))
        # How the search box reads a national phone number; omitted keeps what is stored,
        # null falls back to DEFAULT_COUNTRY.
        if "country" in e.data:
            try:
                row.country = country_code(e.data["country"])
            except ValueError as exc:
                raise e.fail(str(exc)) from None

    def _users(self, e: _Entry) -> None:
        email = e.email("email", required=True)
        role = e.choice("role", [r.value for r in Role])
        tenant_id = self.tenant_id(e)
        if (role == Role.PLATFORM_OPERATOR) != (tenant_id == PLATFORM_TENANT_ID):
            raise e.fail("platform_operator users belong to the platform tier, and only they do")
        password = e.text("password", max_len=200)
        assert email is not None
        row = self.session.scalar(select(AppUser).where(AppUser.email == email))
        if row is None:
            if not password or password_problem(password) is not None:
                floor = MIN_PASSWORD_CHARS
                raise e.fail(f"password (at least {floor} characters) is required for a new user")
            row = AppUser(email=email)
            self.session.add(row)
            self.report.count("users", True)
        else:
            if row.tenant_id != tenant_id:
                raise e.fail("this user already belongs to another tenant")
            self.report.count("users", False)
        before = (row.password_hash, row.role, row.tenant_id, row.is_active)
        row.tenant_id = tenant_id
        row.role = role
        row.name = e.text("name", max_len=200) or ""
        row.is_active = e.flag("active", self.stored(row, "is_active"), True)
        if password and (row.password_hash is None or not row.check_password(password)):
            if (problem := password_problem(password)) is not None:
                raise e.fail(f"password {problem}")
            row.set_password(password)
        if self.stored(row, "id") is not None and before != (
            row.password_hash,
            row.role,
            row.tenant_id,
            row.is_active,
        ):
            row.end_sessions()  # a changed password, role or active flag: sign them out

    def _apiKeys(self, e: _Entry) -> None:
        tenant_id = self.tenant_id(e)
        token = e.req("token", 200)
        if token != token.strip() or any(c.isspace() for c in token):
            raise e.fail("token must not contain spaces")
        if len(token) < 24:
            raise e.fail("token must be at least 24 characters (use create-api-key for a new one)")
        scopes = e.scopes("scopes")
        name = e.req("name", 200)
        digest = hash_api_token(token)
        owner = self.session.scalar(select(ApiKey).where(ApiKey.token_hash == digest))
        if owner is not None and (owner.tenant_id != tenant_id or owner.name != name):
            raise e.fail("this token is already used by another key")
        existing = self.session.scalar(
            select(ApiKey).where(ApiKey.tenant_id == tenant_id, ApiKey.name == name)
        )
        if existing is not None and existing.revoked_at is not None:
            # Revoked in the portal (or by a CLI): a file never brings a key back.
            self.report.notes.append(f"{e.where}: revoked; left revoked")
            return
        row = self._upsert(ApiKey, "apiKeys", tenant_id=tenant_id, name=name)
        row.set_token(token)
        row.scopes = scopes or self.stored(row, "scopes") or DEFAULT_API_SCOPES

    def _mailServers(self, e: _Entry) -> None:
        tenant_id = self.tenant_id(e)
        row = self._upsert(
            MailSendServerConfig, "mailServers", tenant_id=tenant_id, name=e.req("name", 200)
        )
        row.host = e.req("host", 255)
        row.port = e.number("port", lo=1, hi=65535) or 587
        row.security = e.choice("security", [s.value for s in SmtpSecurity], "starttls")
        row.verify_tls = e.flag("verifyTls", self.stored(row, "verify_tls"), True)
        row.username = e.text("username", max_len=320)
        if "password" in e.data:
            row.password = e.text("password", max_len=500)
        row.from_address = e.email("fromAddress")
        row.from_name = e.text("fromName", max_len=200)
        row.reply_to = e.email("replyTo")
        row.read_receipt = e.flag("readReceipt", self.stored(row, "read_receipt"), False)
        row.is_default = e.flag("isDefault", self.stored(row, "is_default"), False)
        row.enabled = e.flag("enabled", self.stored(row, "enabled"), True)
        row.daily_send_limit = e.number("dailySendLimit")
        row.rate_limit_per_minute = e.number("rateLimitPerMinute")
        row.uncertain_policy = self.policy(e, row)
        if not row.from_address and not row.username:
            raise e.fail("a mail server needs a fromAddress or a username")

    def _smsProviders(self, e: _Entry) -> None:
        tenant_id = self.tenant_id(e)
        row = self._upsert(
            SmsProviderConfig, "smsProviders", tenant_id=tenant_id, name=e.req("name", 200)
        )
        row.provider = e.choice("provider", [k.value for k in SmsProviderKind])
        row.base_url = e.text("baseUrl", max_len=500)
        if row.base_url and not row.base_url.startswith(("http://", "https://")):
            raise e.fail("baseUrl must start with http:// or https://")
        row.account_id = e.text("accountId", max_len=200)
        if "secret" in e.data:
            row.secret = e.text("secret", max_len=500)
        if "webhookSecret" in e.data:
            row.webhook_secret = e.text("webhookSecret", max_len=500)
        row.sender_id = e.text("senderId", max_len=64)
        row.is_default = e.flag("isDefault", self.stored(row, "is_default"), False)
        row.enabled = e.flag("enabled", self.stored(row, "enabled"), True)
        row.daily_send_limit = e.number("dailySendLimit")
        row.rate_limit_per_minute = e.number("rateLimitPerMinute")
        window = e.number("retryWindowS", lo=60)
        row.retry_window_s = float(window) if window is not None else None
        if self.stored(row, "uncertain_policy") is None:
            # A new provider's default follows whether it can dedupe a resend.
            row.uncertain_policy = default_uncertain_policy(row.provider)
        row.uncertain_policy = self.policy(e, row)

    def policy(self, e: _Entry, row: MailSendServerConfig | SmsProviderConfig) -> str:
        """uncertainPolicy: omitted, the stored one stays (a new row: its kind's default)."""
        current = (
            self.stored(row, "uncertain_policy")
            or row.uncertain_policy
            or UncertainPolicy.RETRY.value
        )
        return e.choice("uncertainPolicy", [p.value for p in UncertainPolicy], current)

    def _provider(self, e: _Entry, tenant_id: int) -> SmsProviderConfig:
        return self._one(
            SmsProviderConfig,
            e,
            f"provider {e.data.get('provider')!r}",
            tenant_id=tenant_id,
            name=e.req("provider", 200),
        )

    def _smsRoutes(self, e: _Entry) -> None:
        tenant_id = self.tenant_id(e)
        provider = self._provider(e, tenant_id)
        country = _country(e, "country", required=True)
        row = self._upsert(
            SmsProviderRegion, "smsRoutes", provider_id=provider.id, country_code=country
        )
        row.tenant_id = tenant_id
        priority = e.number("priority")
        row.priority = 100 if priority is None else priority

    def _mailTemplates(self, e: _Entry) -> None:
        from portal.messaging.templating.parsing import TemplateRenderError
        from portal.messaging.templating.rendering import compile_check

        tenant_id = self.tenant_id(e)
        row = self._upsert(
            MailTemplate, "mailTemplates", tenant_id=tenant_id, code=e.req("code", 100)
        )
        row.name = e.text("name", max_len=200) or row.code
        row.subject = e.text("subject", max_len=998) or ""
        row.html_body = e.text("html", max_len=1_000_000, multiline=True)
        row.text_body = e.text("text", max_len=1_000_000, multiline=True)
        for name, source, html in (
            ("subject", row.subject, False),
            ("html", row.html_body, True),
            ("text", row.text_body, False),
        ):
            if source:
                try:
                    compile_check(source, html=html)
                except TemplateRenderError as exc:
                    raise e.fail(f"{name} does not compile: {exc}") from None
        row.enabled = e.flag("enabled", self.stored(row, "enabled"), True)
        row.stream = self._stream(e, row)
        row.priority = e.number("priority", lo=1, hi=5)
        row.reply_to = e.email("replyTo")
        server = e.text("preferredServer", max_len=200)
        row.preferred_server_id = (
            self._one(
                MailSendServerConfig, e, f"server {server!r}", tenant_id=tenant_id, name=server
            ).id
            if server
            else None
        )
        self._template_version(e, row)

    def _template_version(self, e: _Entry, row: MailTemplate | SmsTemplate) -> None:
        """strictVariables (omitted: the stored value; a new template: on), then a new
        version only when the content changed."""
        from portal.messaging.templating import versions as template_versions

        row.strict_variables = e.flag("strictVariables", self.stored(row, "strict_variables"), True)
        if self.stored(row, "id") is None:
            row.version = 1
        elif template_versions.changed(self.session, row):
            row.version = (row.version or 0) + 1
            self._dry_run_note(e, row)
        else:
            return
        template_versions.save_version(self.session, row, None, "imported")

    def _dry_run_note(self, e: _Entry, row: MailTemplate | SmsTemplate) -> None:
        """No dry run stops an import, but its counts are printed."""
        from portal.messaging.templating import dry_run as template_dry_run

        check = template_dry_run.run(
            self.session,
            row,
            template_dry_run.sources_of(row),
            strict=row.strict_variables,
            samples=False,
        )
        if not check.found:
            return
        missing = ", ".join(f"{name} ({n})" for name, n in check.missing.most_common())
        self.report.notes.append(
            f"{e.where}: version {row.version} checked against {check.checked} of "
            f"{check.found} recent sends: {check.rendered} render, {check.refused} would be "
            f"refused for missing variables{f' ({missing})' if missing else ''}, "
            f"{check.failed} fail to render"
        )

    def _smsTemplates(self, e: _Entry) -> None:
        from portal.messaging.templating.parsing import TemplateRenderError
        from portal.messaging.templating.rendering import compile_check

        tenant_id = self.tenant_id(e)
        row = self._upsert(
            SmsTemplate, "smsTemplates", tenant_id=tenant_id, code=e.req("code", 100)
        )
        row.name = e.text("name", max_len=200) or row.code
        row.content = e.req("content", 1600, multiline=True)
        try:
            compile_check(row.content, html=False)
        except TemplateRenderError as exc:
            raise e.fail(f"content does not compile: {exc}") from None
        row.enabled = e.flag("enabled", self.stored(row, "enabled"), True)
        row.stream = self._stream(e, row)
        self._template_version(e, row)

    def _stream(self, e: _Entry, row: MailTemplate | SmsTemplate) -> str:
        """A template's default stream; omitted, the stored one stays (transactional when new)."""
        current = self.stored(row, "stream") or Stream.TRANSACTIONAL.value
        return e.choice("stream", [s.value for s in Stream], default=current)

    def _smsBindings(self, e: _Entry) -> None:
        tenant_id = self.tenant_id(e)
        template = self._one(
            SmsTemplate,
            e,
            f"SMS template {e.data.get('template')!r}",
            tenant_id=tenant_id,
            code=e.req("template", 100),
        )
        provider = self._provider(e, tenant_id)
        row = self._upsert(
            SmsTemplateProviderBinding,
            "smsBindings",
            template_id=template.id,
            provider_id=provider.id,
            country_code=_country(e, "country", required=False),
        )
        row.tenant_id = tenant_id
        row.external_template_id = e.text("externalTemplateId", max_len=200)
        row.signature = e.text("signature", max_len=200)

    def _mailReceivers(self, e: _Entry) -> None:
        """A bounce mailbox read over IMAP (read-only) for DSNs and read receipts."""
        tenant_id = self.tenant_id(e)
        row = self._upsert(
            MailReceiveConfig, "mailReceivers", tenant_id=tenant_id, name=e.req("name", 200)
        )
        row.host = e.req("host", 255)
        row.security = e.choice("security", ["ssl", "starttls", "plain"], "ssl")
        row.port = e.number("port", lo=1, hi=65535) or (993 if row.security == "ssl" else 143)
        row.verify_tls = e.flag("verifyTls", self.stored(row, "verify_tls"), True)
        row.username = e.req("username", 320)
        if "password" in e.data:
            row.secret = e.text("password", max_len=500)
        row.folder = e.text("folder", max_len=200) or "INBOX"
        row.enabled = e.flag("enabled", self.stored(row, "enabled"), True)

    def _callbacks(self, e: _Entry) -> None:
        """A status-callback endpoint; without ``secret`` a new one gets a generated secret,
        printed once in the report (an existing one keeps its own)."""
        from portal.messaging.after_send import callbacks

        tenant_id = self.tenant_id(e)
        name = e.req("name", 200)
        exists = self.session.scalar(
            select(CallbackEndpoint.id).where(
                CallbackEndpoint.tenant_id == tenant_id, CallbackEndpoint.name == name
            )
        )
        if exists is None:
            self.session.flush()  # endpoints added earlier in this file count
            limit = _settings().callback_endpoints_max
            full = callback_endpoints_full(self.session, tenant_id, limit)
            if full:
                raise e.fail(f"name: {full}")
        row = self._upsert(CallbackEndpoint, "callbacks", tenant_id=tenant_id, name=name)
        url = e.req("url", callbacks.MAX_URL_CHARS)
        problem = callbacks.check_at_save(url, _settings())
        if problem:
            raise e.fail(problem)
        row.url = url
        events = e.data.get("events")
        if (
            not isinstance(events, list)
            or not events
            or any(v not in callbacks.EVENT_TYPES for v in events)
        ):
            raise e.fail(f"events must be a non-empty list of {', '.join(callbacks.EVENT_TYPES)}")
        row.event_list = events
        row.enabled = e.flag("enabled", self.stored(row, "enabled"), True)
        secret = e.text("secret", max_len=200)
        if secret is not None:
            problem = callbacks.secret_problem(secret)
            if problem:
                raise e.fail(f"secret {problem}")
            if self.stored(row, "secret_encrypted") is None or row.secret != secret:
                row.secret = secret
        elif self.stored(row, "secret_encrypted") is None:
            generated = callbacks.new_secret()
            row.secret = generated
            self.report.notes.append(f"{e.where}: signing secret (shown once): {generated}")

    def _quotas(self, e: _Entry) -> None:
        tenant_id = self.tenant_id(e)
        row = self._upsert(TenantMessageQuota, "quotas", tenant_id=tenant_id)
        row.mail_monthly_limit = e.number("mailMonthlyLimit")
        row.sms_monthly_limit = e.number("smsMonthlyLimit")
        row.updated_by = "import-config"


def tenant_by_slug(session: Session, slug: str) -> int | None:
    """The id of the tenant ``slug`` names (``PLATFORM_SLUG``: the platform tier), or None."""
    if slug == PLATFORM_SLUG:
        return PLATFORM_TENANT_ID
    return session.scalar(select(Tenant.id).where(Tenant.slug == slug))


def callback_endpoints_full(session: Session, tenant_id: int, limit: int) -> str | None:
    """Why ``tenant_id`` may not have one more status callback endpoint (its tier holds
    ``limit``, CALLBACK_ENDPOINTS_MAX), or None: the portal's form and import-config ask it."""
    held = session.scalar(
        select(func.count())
        .select_from(CallbackEndpoint)
        .where(CallbackEndpoint.tenant_id == tenant_id)
    )
    if (held or 0) < limit:
        return None
    return f"a tier may have at most {limit} endpoints (CALLBACK_ENDPOINTS_MAX); delete one first"


# SMS provider kinds whose API honours no idempotency key: Twilio's Messages API and Vonage's
# SMS API. A resend after an ambiguous attempt may deliver twice, so a new config of these
# kinds holds uncertain outcomes for a person to decide; keyed providers (http_json) and SMTP
# (a stable Message-ID) retry. Migration 0010 applied the same rule to existing rows.
NO_IDEMPOTENCY_KEY = frozenset({SmsProviderKind.TWILIO.value, SmsProviderKind.VONAGE.value})


def dedupes(kind: str | None) -> bool:
    """Whether an SMS provider of ``kind`` recognises a resend by its idempotency key."""
    return kind not in NO_IDEMPOTENCY_KEY


def default_uncertain_policy(kind: str | None) -> str:
    """A new SMS provider config's uncertain policy: hold where a resend cannot be deduped."""
    return (UncertainPolicy.RETRY if dedupes(kind) else UncertainPolicy.HOLD).value


def _country(e: _Entry, name: str, *, required: bool) -> str | None:
    value = e.text(name, required=required, max_len=2)
    if value is None:
        return None
    if not re.fullmatch(r"[A-Z]{2}", value):
        raise e.fail(f"{name} must be an ISO 3166 two-letter code such as GB")
    return value


def _settings() -> Settings:
    """The app's settings when there is an app (the CLI), else the defaults' safety rules."""
    from flask import current_app, has_app_context

    if has_app_context():
        settings: Settings = current_app.config["SETTINGS"]
        return settings
    return Settings(database_url="", redis_url=None, secret_key="")
