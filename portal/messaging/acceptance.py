"""Acceptance: validate a caller's request and write a Pending record in the caller's transaction.

Nothing here commits. A rejection raises ``AcceptanceError`` before anything is written, so the
caller's transaction stays usable; a business key already used by the same tenant returns the
existing record instead of writing a second one (idempotent acceptance).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

import phonenumbers
from email_validator import EmailNotValidError, validate_email
from sqlalchemy import select, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from portal.config import Settings
from portal.models import (
    MailSendRecipient,
    MailSendRecord,
    MailSendServerConfig,
    MailTemplate,
    Scope,
    SendStatus,
    SmsSendRecord,
)
from portal.tenancy import PLATFORM_TENANT_ID, current_tenant_id, current_trace_id, new_trace_id

MAX_BATCH = 500
MAX_RECIPIENTS = 50  # per field: to, cc, bcc
MAX_ATTACHMENTS = 20
MAX_SUBJECT_CHARS = 998  # RFC 5322 line length
MAX_SMS_CHARS = 1600  # ten concatenated segments
MAX_KEY_CHARS = 200
MAX_CODE_CHARS = 100
MAX_ID = 2**63 - 1

# Wake-up channels for the delivery loop (PostgreSQL LISTEN/NOTIFY).
NOTIFY_CHANNEL = {"mail": "postroom_mail_due", "sms": "postroom_sms_due"}


class AcceptanceError(Exception):
    """A request that cannot be accepted; ``field`` names the offending input."""

    status = 422

    def __init__(self, code: str, field: str | None, message: str, index: int | None = None):
        super().__init__(message)
        self.code = code
        self.field = field
        self.message = message
        self.index = index

    def at(self, index: int) -> AcceptanceError:
        """The same error, placed at a batch item."""
        error = type(self)(self.code, self.field, f"item {index}: {self.message}", index)
        return error

    def as_dict(self) -> dict[str, Any]:
        body: dict[str, Any] = {"code": self.code, "field": self.field, "message": self.message}
        if self.index is not None:
            body["index"] = self.index
        return body


class BusinessKeyConflict(AcceptanceError):
    """The business key was already used by this tenant for a different request."""

    status = 409


@dataclass(frozen=True)
class Accepted:
    id: int
    duplicate: bool


# --- field validation -------------------------------------------------------------------

T = TypeVar("T")


def _reject(field_name: str, message: str, code: str = "invalid") -> AcceptanceError:
    return AcceptanceError(code, field_name, message)


def _str(data: Mapping[str, Any], name: str, *, max_len: int, required: bool = False) -> str | None:
    value = data.get(name)
    if value is None:
        if required:
            raise _reject(name, f"{name} is required", "required")
        return None
    if not isinstance(value, str):
        raise _reject(name, f"{name} must be a string")
    if len(value) > max_len:
        raise _reject(name, f"{name} is longer than {max_len} characters", "too_large")
    return value


def _int(data: Mapping[str, Any], name: str, *, lo: int = 1, hi: int = MAX_ID) -> int | None:
    value = data.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _reject(name, f"{name} must be an integer")
    if not lo <= value <= hi:
        raise _reject(name, f"{name} must be between {lo} and {hi}")
    return value


def _email(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise _reject(name, f"{name} must be an email address string")
    if len(value) > 320 or "\r" in value or "\n" in value:
        raise _reject(name, f"{name} is not a valid email address")
    try:
        return validate_email(value, check_deliverability=False).normalized
    except EmailNotValidError as exc:
        raise _reject(name, f"{name} is not a valid email address: {exc}") from None


def _addresses(data: Mapping[str, Any], name: str, *, required: bool) -> list[str]:
    value = data.get(name)
    if value is None or value == []:
        if required:
            raise _reject(name, f"at least one {name} address is required", "required")
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        raise _reject(name, f"{name} must be a list of email addresses")
    if len(value) > MAX_RECIPIENTS:
        raise _reject(name, f"{name} has more than {MAX_RECIPIENTS} addresses", "too_large")
    return [_email(item, f"{name}[{i}]") for i, item in enumerate(value)]


def _json_size(value: Any) -> int:
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False))


def _variables(data: Mapping[str, Any], settings: Settings) -> dict[str, Any] | None:
    value = data.get("variables")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _reject("variables", "variables must be an object")
    _check_json_like(value, "variables", depth=0)
    if _json_size(value) > settings.variables_max_bytes:
        raise _reject(
            "variables", f"variables exceed {settings.variables_max_bytes} bytes", "too_large"
        )
    return value


def _check_json_like(value: Any, path: str, depth: int) -> None:
    if depth > 20:
        raise _reject(path, "variables are nested too deeply (over 20 levels)")
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise _reject(path, "variable names must be strings")
            _check_json_like(item, path, depth + 1)
    elif isinstance(value, list):
        for item in value:
            _check_json_like(item, path, depth + 1)
    elif isinstance(value, float) and value != value:  # NaN is not JSON
        raise _reject(path, "variables must not contain NaN")
    elif not isinstance(value, str | int | float | bool | type(None)):
        raise _reject(path, "variables must be JSON values")


def _scope(data: Mapping[str, Any], tenant_id: int | None) -> tuple[Scope, int]:
    raw = data.get("scope", Scope.TENANT.value)
    if raw not in (Scope.TENANT.value, Scope.PLATFORM.value):
        raise _reject("scope", "scope must be TENANT or PLATFORM")
    scope = Scope(raw)
    platform_caller = tenant_id is None or tenant_id == PLATFORM_TENANT_ID
    if scope is Scope.PLATFORM:
        if not platform_caller:
            raise AcceptanceError(
                "forbidden", "scope", "only the platform tier may send with scope PLATFORM"
            )
        return scope, PLATFORM_TENANT_ID
    if tenant_id is None:
        raise AcceptanceError(
            "forbidden",
            "scope",
            "a TENANT send needs a tenant context (or send with scope PLATFORM)",
        )
    return scope, tenant_id


def _expires_at(data: Mapping[str, Any]) -> datetime | None:
    raw = _str(data, "expiresAt", max_len=64)
    if raw is None:
        return None
    try:
        value = datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except ValueError:
        raise _reject("expiresAt", "expiresAt must be an ISO 8601 date-time") from None
    if value.tzinfo is None:
        raise _reject("expiresAt", "expiresAt must carry a time zone (e.g. Z or +01:00)")
    return value.astimezone(UTC)


_SAFE_FILENAME = re.compile(r"^[^/\\\x00-\x1f\x7f]{1,255}$")
_CONTENT_TYPE = re.compile(r"^[A-Za-z0-9][\w.+-]*/[A-Za-z0-9][\w.+-]*$")


def _attachments(data: Mapping[str, Any], settings: Settings) -> list[dict[str, Any]] | None:
    value = data.get("attachments")
    if value is None:
        return None
    if not isinstance(value, list):
        raise _reject("attachments", "attachments must be a list")
    if len(value) > MAX_ATTACHMENTS:
        raise _reject("attachments", f"at most {MAX_ATTACHMENTS} attachments", "too_large")
    total = 0
    result = []
    for i, item in enumerate(value):
        where = f"attachments[{i}]"
        if not isinstance(item, dict):
            raise _reject(where, f"{where} must be an object with name, contentType, content")
        unknown = set(item) - {"name", "contentType", "content"}
        if unknown:
            raise _reject(f"{where}.{sorted(unknown)[0]}", "unknown attachment field")
        name = _str(item, "name", max_len=255, required=True)
        if name is None or not _SAFE_FILENAME.match(name):
            raise _reject(f"{where}.name", "attachment name must be a plain file name")
        ctype = _str(item, "contentType", max_len=127) or "application/octet-stream"
        if not _CONTENT_TYPE.match(ctype):
            raise _reject(f"{where}.contentType", "contentType must look like type/subtype")
        content = item.get("content")
        if not isinstance(content, str):
            raise _reject(f"{where}.content", "content must be a base64 string", "required")
        if len(content) > settings.attachment_max_bytes * 4 // 3 + 4:
            raise _reject(f"{where}.content", "attachment is too large", "too_large")
        try:
            decoded = base64.b64decode(content, validate=True)
        except (binascii.Error, ValueError):
            raise _reject(f"{where}.content", "content is not valid base64") from None
        total += len(decoded)
        if total > settings.attachment_max_bytes:
            raise _reject(
                f"{where}.content",
                f"attachments exceed {settings.attachment_max_bytes} bytes in all",
                "too_large",
            )
        result.append({"name": name, "contentType": ctype, "content": content})
    return result


def _no_unknown(data: Mapping[str, Any], allowed: Iterable[str]) -> None:
    unknown = sorted(set(data) - set(allowed))
    if unknown:
        raise _reject(unknown[0], f"unknown field {unknown[0]!r}")


def _request_hash(values: Mapping[str, Any]) -> str:
    canonical = json.dumps(values, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


# --- mail -------------------------------------------------------------------------------

MAIL_FIELDS = (
    "to",
    "cc",
    "bcc",
    "replyTo",
    "subject",
    "html",
    "text",
    "templateId",
    "templateCode",
    "variables",
    "serverId",
    "priority",
    "scope",
    "businessKey",
    "attachments",
    "expiresAt",
)


@dataclass
class MailRequest:
    """A validated mail request, before it is looked up against the tenant's tier."""

    tenant_id: int
    scope: Scope
    to: list[str]
    cc: list[str]
    bcc: list[str]
    reply_to: str | None
    subject: str | None
    html: str | None
    text: str | None
    template_id: int | None
    template_code: str | None
    variables: dict[str, Any] | None
    server_id: int | None
    priority: int | None
    business_key: str | None
    attachments: list[dict[str, Any]] | None
    expires_at: datetime | None
    request_hash: str = field(default="")


def validate_mail(data: Any, settings: Settings, tenant_id: int | None) -> MailRequest:
    """Check a mail request's shape and values (no database access)."""
    if not isinstance(data, Mapping):
        raise _reject("body", "a mail request must be a JSON object")
    _no_unknown(data, MAIL_FIELDS)
    scope, owner = _scope(data, tenant_id)
    body_max = settings.mail_body_max_chars
    subject = _str(data, "subject", max_len=MAX_SUBJECT_CHARS)
    if subject is not None and ("\r" in subject or "\n" in subject):
        raise _reject("subject", "subject must be one line")
    req = MailRequest(
        tenant_id=owner,
        scope=scope,
        to=_addresses(data, "to", required=True),
        cc=_addresses(data, "cc", required=False),
        bcc=_addresses(data, "bcc", required=False),
        reply_to=_email(data["replyTo"], "replyTo") if data.get("replyTo") is not None else None,
        subject=subject,
        html=_str(data, "html", max_len=body_max),
        text=_str(data, "text", max_len=body_max),
        template_id=_int(data, "templateId"),
        template_code=_str(data, "templateCode", max_len=MAX_CODE_CHARS),
        variables=_variables(data, settings),
        server_id=_int(data, "serverId"),
        priority=_int(data, "priority", lo=1, hi=5),
        business_key=_str(data, "businessKey", max_len=MAX_KEY_CHARS),
        attachments=_attachments(data, settings),
        expires_at=_expires_at(data),
    )
    if req.template_code == "":
        raise _reject("templateCode", "templateCode must not be empty")
    if req.business_key == "":
        raise _reject("businessKey", "businessKey must not be empty")
    has_template = req.template_id is not None or req.template_code is not None
    if req.template_id is not None and req.template_code is not None:
        raise _reject("templateCode", "give templateId or templateCode, not both")
    if not has_template:
        if not req.subject:
            raise _reject("subject", "subject is required when no template is given", "required")
        if not req.html and not req.text:
            raise _reject("html", "html or text is required when no template is given", "required")
    req.request_hash = _request_hash(
        {k: v for k, v in vars(req).items() if k not in ("request_hash", "expires_at")}
        | {"expires_at": req.expires_at.isoformat() if req.expires_at else None}
    )
    return req


def _check_mail_references(session: Session, req: MailRequest, prefix: str = "") -> None:
    """A templateId or serverId must exist in the send scope's tier (else: as if it did not)."""
    if req.template_id is not None:
        found = session.scalar(
            select(MailTemplate.id).where(
                MailTemplate.id == req.template_id, MailTemplate.tenant_id == req.tenant_id
            )
        )
        if found is None:
            raise AcceptanceError("not_found", "templateId", "no such template")
    if req.server_id is not None:
        found = session.scalar(
            select(MailSendServerConfig.id).where(
                MailSendServerConfig.id == req.server_id,
                MailSendServerConfig.tenant_id == req.tenant_id,
            )
        )
        if found is None:
            raise AcceptanceError("not_found", "serverId", "no such mail server")


def _mail_record(req: MailRequest, trace_id: str) -> MailSendRecord:
    record = MailSendRecord(
        tenant_id=req.tenant_id,
        scope=req.scope.value,
        status=SendStatus.PENDING.value,
        version=0,
        retry_count=0,
        trace_id=trace_id,
        business_key=req.business_key,
        request_hash=req.request_hash,
        to_addrs=req.to,
        cc_addrs=req.cc or None,
        bcc_addrs=req.bcc or None,
        reply_to=req.reply_to,
        subject=req.subject,
        html_body=req.html,
        text_body=req.text,
        template_id=req.template_id,
        template_code=req.template_code,
        variables=req.variables,
        server_id=req.server_id,
        priority=req.priority,
        attachments=req.attachments,
        expires_at=req.expires_at,
    )
    return record


def _mail_recipients(record: MailSendRecord, req: MailRequest) -> list[MailSendRecipient]:
    rows = []
    for kind, addresses in (("to", req.to), ("cc", req.cc), ("bcc", req.bcc)):
        for address in dict.fromkeys(a.lower() for a in addresses):
            rows.append(
                MailSendRecipient(
                    record_id=record.id, tenant_id=req.tenant_id, address=address, kind=kind
                )
            )
    return rows


# --- SMS --------------------------------------------------------------------------------

SMS_FIELDS = (
    "phoneNumber",
    "content",
    "templateCode",
    "variables",
    "scope",
    "businessKey",
    "expiresAt",
)


@dataclass
class SmsRequest:
    tenant_id: int
    scope: Scope
    phone_number: str
    country_code: str | None
    content: str | None
    template_code: str | None
    variables: dict[str, Any] | None
    business_key: str | None
    expires_at: datetime | None
    request_hash: str = field(default="")


def parse_phone_number(raw: Any, field_name: str = "phoneNumber") -> tuple[str, str | None]:
    """E.164 and the ISO country of a number written in international form."""
    if not isinstance(raw, str) or not raw.strip():
        raise _reject(field_name, f"{field_name} is required", "required")
    if len(raw) > 32:
        raise _reject(field_name, f"{field_name} is not a valid phone number")
    try:
        number = phonenumbers.parse(raw, None)
    except phonenumbers.NumberParseException:
        raise _reject(
            field_name, f"{field_name} must be in international form, e.g. +447911123456"
        ) from None
    if not phonenumbers.is_valid_number(number):
        raise _reject(field_name, f"{field_name} is not a valid phone number")
    e164 = phonenumbers.format_number(number, phonenumbers.PhoneNumberFormat.E164)
    region = phonenumbers.region_code_for_number(number)
    # Non-geographic numbers (+800, +882, ...) have the pseudo-region "001": no country to
    # route by, so they take the tier's default providers.
    return e164, region if region and len(region) == 2 and region.isalpha() else None


def validate_sms(data: Any, settings: Settings, tenant_id: int | None) -> SmsRequest:
    """Check an SMS request's shape and values (no database access)."""
    if not isinstance(data, Mapping):
        raise _reject("body", "an SMS request must be a JSON object")
    _no_unknown(data, SMS_FIELDS)
    scope, owner = _scope(data, tenant_id)
    phone, country = parse_phone_number(data.get("phoneNumber"))
    req = SmsRequest(
        tenant_id=owner,
        scope=scope,
        phone_number=phone,
        country_code=country,
        content=_str(data, "content", max_len=MAX_SMS_CHARS),
        template_code=_str(data, "templateCode", max_len=MAX_CODE_CHARS),
        variables=_variables(data, settings),
        business_key=_str(data, "businessKey", max_len=MAX_KEY_CHARS),
        expires_at=_expires_at(data),
    )
    if req.business_key == "":
        raise _reject("businessKey", "businessKey must not be empty")
    if not req.content and not req.template_code:
        raise _reject("content", "content or templateCode is required", "required")
    req.request_hash = _request_hash(
        {k: v for k, v in vars(req).items() if k not in ("request_hash", "expires_at")}
        | {"expires_at": req.expires_at.isoformat() if req.expires_at else None}
    )
    return req


def _sms_record(req: SmsRequest, trace_id: str) -> SmsSendRecord:
    return SmsSendRecord(
        tenant_id=req.tenant_id,
        scope=req.scope.value,
        status=SendStatus.PENDING.value,
        version=0,
        retry_count=0,
        trace_id=trace_id,
        business_key=req.business_key,
        request_hash=req.request_hash,
        phone_number=req.phone_number,
        country_code=req.country_code,
        content=req.content,
        template_code=req.template_code,
        variables=req.variables,
        expires_at=req.expires_at,
    )


# --- writing ----------------------------------------------------------------------------

Req = TypeVar("Req", MailRequest, SmsRequest)
Rec = TypeVar("Rec", MailSendRecord, SmsSendRecord)


def _existing(
    session: Session, model: type[Rec], tenant_id: int, keys: Sequence[str]
) -> dict[str, tuple[int, str | None]]:
    if not keys:
        return {}
    rows = session.execute(
        select(model.business_key, model.id, model.request_hash).where(
            model.tenant_id == tenant_id, model.business_key.in_(keys)
        )
    )
    return {key: (rid, digest) for key, rid, digest in rows if key is not None}


def _write(
    session: Session,
    model: type[Rec],
    requests: Sequence[Req],
    build: Callable[[Req, str], Rec],
    extra_rows: Callable[[Rec, Req], list[Any]] | None,
    channel: str,
) -> list[Accepted]:
    """Insert the records not already there by business key; ids come back in input order.

    The insert runs in a savepoint: when a concurrent caller commits the same business key
    first, the unique index refuses ours, only the savepoint rolls back, and we return the
    winner's record. The caller's transaction is never aborted.
    """
    trace_id = current_trace_id() or new_trace_id()
    for _attempt in range(3):
        results: list[Accepted | None] = [None] * len(requests)
        by_tenant: dict[int, list[str]] = {}
        for req in requests:
            if req.business_key is not None:
                by_tenant.setdefault(req.tenant_id, []).append(req.business_key)
        found: dict[tuple[int, str], tuple[int, str | None]] = {}
        for tenant_id, keys in by_tenant.items():
            for key, value in _existing(session, model, tenant_id, keys).items():
                found[(tenant_id, key)] = value
        new: list[tuple[int, Req, Rec]] = []
        for i, req in enumerate(requests):
            hit = found.get((req.tenant_id, req.business_key)) if req.business_key else None
            if hit is not None:
                record_id, digest = hit
                if digest != req.request_hash:
                    error = BusinessKeyConflict(
                        "conflict",
                        "businessKey",
                        "this businessKey was already used for a different request",
                    )
                    raise error.at(i) if len(requests) > 1 else error
                results[i] = Accepted(record_id, duplicate=True)
            else:
                new.append((i, req, build(req, trace_id)))
        if not new:
            return [r for r in results if r is not None]
        keyed = any(req.business_key is not None for _, req, _ in new)
        try:
            # Only a business key can collide with a concurrent caller; without one there
            # is nothing to roll back to, and the savepoint would cost two round trips.
            with session.begin_nested() if keyed else contextlib.nullcontext():
                session.add_all([record for _, _, record in new])
                session.flush()
                if extra_rows is not None:
                    rows = [row for _, req, rec in new for row in extra_rows(rec, req)]
                    session.add_all(rows)
                    session.flush()
        except IntegrityError:
            if not keyed:
                raise
            # Someone committed one of our business keys meanwhile: look again.
            for _, _, record in new:
                if record in session:
                    session.expunge(record)
            continue
        for i, _req, record in new:
            results[i] = Accepted(record.id, duplicate=False)
        _notify(session, channel)
        return [r for r in results if r is not None]
    raise AcceptanceError(
        "conflict", "businessKey", "business keys kept colliding with concurrent requests"
    )


def _notify(session: Session, channel: str) -> None:
    """Wake idle workers when the caller commits (PostgreSQL folds repeats in a transaction)."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text(f"NOTIFY {NOTIFY_CHANNEL[channel]}"))


def _check_batch(items: Any) -> list[Any]:
    if not isinstance(items, list):
        raise _reject("items", "items must be a list")
    if not 1 <= len(items) <= MAX_BATCH:
        raise _reject("items", f"a batch holds 1 to {MAX_BATCH} items", "too_large")
    return items


def _unique_keys(requests: Sequence[MailRequest | SmsRequest]) -> None:
    seen: dict[tuple[int, str], int] = {}
    for i, req in enumerate(requests):
        if req.business_key is None:
            continue
        key = (req.tenant_id, req.business_key)
        if key in seen:
            raise AcceptanceError(
                "duplicate_in_batch",
                "businessKey",
                f"item {i}: businessKey repeats item {seen[key]}",
                i,
            )
        seen[key] = i


def _settings_of(session: Session, settings: Settings | None) -> Settings:
    if settings is not None:
        return settings
    return _default_settings()


_DEFAULT: list[Settings] = []


def _default_settings() -> Settings:
    if not _DEFAULT:
        _DEFAULT.append(Settings.from_env())
    return _DEFAULT[0]


def send_mail(
    session: Session, request: Mapping[str, Any], *, settings: Settings | None = None
) -> Accepted:
    """Accept one mail for the current tenant; writes a Pending record, never commits."""
    return send_mail_batch(session, [request], settings=settings, _single=True)[0]


def send_mail_batch(
    session: Session,
    items: Sequence[Mapping[str, Any]],
    *,
    settings: Settings | None = None,
    _single: bool = False,
) -> list[Accepted]:
    """Accept 1..500 mails atomically: one invalid item rejects the batch, naming its index."""
    cfg = _settings_of(session, settings)
    tenant_id = current_tenant_id()
    items = _check_batch(list(items)) if not _single else list(items)
    requests = []
    for i, item in enumerate(items):
        try:
            req = validate_mail(item, cfg, tenant_id)
            _check_mail_references(session, req)
        except AcceptanceError as error:
            raise (error if _single else error.at(i)) from None
        requests.append(req)
    _unique_keys(requests)
    return _write(session, MailSendRecord, requests, _mail_record, _mail_recipients, "mail")


def send_sms(
    session: Session, request: Mapping[str, Any], *, settings: Settings | None = None
) -> Accepted:
    """Accept one SMS for the current tenant; writes a Pending record, never commits."""
    return send_sms_batch(session, [request], settings=settings, _single=True)[0]


def send_sms_batch(
    session: Session,
    items: Sequence[Mapping[str, Any]],
    *,
    settings: Settings | None = None,
    _single: bool = False,
) -> list[Accepted]:
    """Accept 1..500 SMS atomically: one invalid item rejects the batch, naming its index."""
    cfg = _settings_of(session, settings)
    tenant_id = current_tenant_id()
    items = _check_batch(list(items)) if not _single else list(items)
    requests = []
    for i, item in enumerate(items):
        try:
            requests.append(validate_sms(item, cfg, tenant_id))
        except AcceptanceError as error:
            raise (error if _single else error.at(i)) from None
    _unique_keys(requests)
    return _write(session, SmsSendRecord, requests, _sms_record, None, "sms")
