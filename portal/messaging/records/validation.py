"""A caller's send request checked for shape and values, with no database access: the fields
and their limits, recipients (through ``addresses``), variables, metadata, attachments, scope,
expiry and stream, and batches. ``acceptance`` checks the result against the tenant's tier
and writes it.

A rejection raises ``AcceptanceError`` (422; 409 for a business key reused for another
request) naming the offending field. A request that could never be sent is one of them: a
subject, body or SMS content of nothing but white space where it would be sent (without a
template, or given in place of the template's) is refused here, not accepted and failed at
preparation.

``text_problem`` is the one rule for a configuration text field (one line, no control
characters), asked by the portal's forms and by ``import-config`` alike.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from portal.config import Settings
from portal.messaging.records.addresses import AddressError, email_address, parse_phone_number
from portal.models import Scope
from portal.models.record import Stream
from portal.tenancy import PLATFORM_TENANT_ID

MAX_BATCH = 500
MAX_RECIPIENTS = 50  # per field: to, cc, bcc
MAX_ATTACHMENTS = 20
MAX_SUBJECT_CHARS = 998  # RFC 5322 line length
MAX_SMS_CHARS = 1600  # ten concatenated segments
MAX_KEY_CHARS = 200
MAX_CODE_CHARS = 100
MAX_ID = 2**63 - 1

# Enum members looked up once (an enum attribute costs a descriptor call each time).
_TENANT, _PLATFORM = Scope.TENANT, Scope.PLATFORM


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


class MissingVariables(AcceptanceError):
    """A strict template needs variables the request does not give: 422
    ``missing_variables`` naming ``variables``, with the names in ``missing``."""

    def __init__(self, missing: Sequence[str], index: int | None = None, prefix: str = ""):
        self.missing = list(missing)
        names = ", ".join(self.missing)
        super().__init__(
            "missing_variables",
            "variables",
            f"{prefix}the template needs variables the request does not give: {names}",
            index,
        )

    def at(self, index: int) -> AcceptanceError:
        return MissingVariables(self.missing, index, f"item {index}: ")

    def as_dict(self) -> dict[str, Any]:
        return super().as_dict() | {"missing": self.missing}


class BusinessKeyConflict(AcceptanceError):
    """The business key was already used by this tenant for a different request."""

    status = 409


# --- configuration text ------------------------------------------------------------------

# Control characters other than tab and the line breaks; PostgreSQL refuses NUL in text outright.
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


def text_problem(value: str, *, multiline: bool = False) -> str | None:
    """Why ``value`` cannot be stored in a configuration text field, or None: a one-line field
    (a name, a URL, an account id, a sender, a secret) holds no CR or LF, which would split the
    HTTP request or mail header it goes into, and no field holds another control character
    (tab aside). The message follows the field's name ("senderId must be one line"); the
    portal's forms and ``import-config`` both ask this, so neither stores what the other
    refuses."""
    if not multiline and ("\n" in value or "\r" in value):
        return "must be one line"
    if _CONTROL.search(value):
        return "must not contain control characters"
    return None


# --- fields ------------------------------------------------------------------------------


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
    _check_text(name, value)
    return value


_STREAMS = frozenset(s.value for s in Stream)


def _stream(data: Mapping[str, Any]) -> str | None:
    """The request's ``stream``: transactional or broadcast; None when not given (then the
    template's default, else transactional: ``_resolve_streams``)."""
    value = data.get("stream")
    if value is None:
        return None
    if not isinstance(value, str) or value not in _STREAMS:
        raise _reject("stream", "stream must be transactional or broadcast")
    return value


def _hashed(req: Any) -> dict[str, Any]:
    """A request's fields for its hash; ``stream`` only when given, so a request that names
    none hashes as it did before streams (an idempotent repeat stays a duplicate)."""
    skip = (
        ("request_hash", "expires_at", "stream")
        if req.stream is None
        else ("request_hash", "expires_at")
    )
    if req.metadata is None:  # likewise metadata
        skip = (*skip, "metadata")
    return {k: v for k, v in vars(req).items() if k not in skip} | {
        "expires_at": req.expires_at.isoformat() if req.expires_at else None
    }


def _check_text(path: str, value: str) -> None:
    """What PostgreSQL text and JSON cannot hold: NUL, and lone surrogates (not UTF-8)."""
    if "\x00" in value:  # refused here, not with a 500 from the database
        raise _reject(path, f"{path} must not contain NUL characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise _reject(path, f"{path} must be valid Unicode (it has a lone surrogate)") from None


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
    try:
        return email_address(value, name)
    except AddressError as exc:
        raise AcceptanceError(exc.code, exc.field, exc.message) from None


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


METADATA_MAX_KEYS = 20
METADATA_MAX_BYTES = 2048


def _metadata(data: Mapping[str, Any]) -> dict[str, Any] | None:
    """The caller's ``metadata``: a JSON object of at most 20 keys and 2 KB, returned on GET
    and in status callbacks."""
    value = data.get("metadata")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _reject("metadata", "metadata must be an object")
    if len(value) > METADATA_MAX_KEYS:
        raise _reject("metadata", f"metadata has more than {METADATA_MAX_KEYS} keys", "too_large")
    _check_json_like(value, "metadata", depth=0)
    if len(json.dumps(value, separators=(",", ":")).encode()) > METADATA_MAX_BYTES:
        raise _reject("metadata", f"metadata exceeds {METADATA_MAX_BYTES} bytes", "too_large")
    return value


def _check_json_like(value: Any, path: str, depth: int) -> None:
    if depth > 20:
        raise _reject(path, "variables are nested too deeply (over 20 levels)")
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise _reject(path, "variable names must be strings")
            _check_text(path, key)
            _check_json_like(item, path, depth + 1)
    elif isinstance(value, list):
        for item in value:
            _check_json_like(item, path, depth + 1)
    elif isinstance(value, float) and not math.isfinite(value):  # NaN, Infinity: not JSON
        raise _reject(path, "variables must not contain NaN or Infinity")
    elif isinstance(value, str):
        _check_text(path, value)
    elif not isinstance(value, int | float | bool | type(None)):
        raise _reject(path, "variables must be JSON values")


def _scope(data: Mapping[str, Any], tenant_id: int | None) -> tuple[Scope, int]:
    raw = data.get("scope", "TENANT")
    if raw == "TENANT":
        scope = _TENANT
    elif raw == "PLATFORM":
        scope = _PLATFORM
    else:
        raise _reject("scope", "scope must be TENANT or PLATFORM")
    platform_caller = tenant_id is None or tenant_id == PLATFORM_TENANT_ID
    if scope is _PLATFORM:
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


def parse_expires_at(data: Mapping[str, Any]) -> datetime | None:
    raw = _str(data, "expiresAt", max_len=64)
    if raw is None:
        return None
    try:
        value = datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except ValueError:
        raise _reject("expiresAt", "expiresAt must be an ISO 8601 date-time") from None
    if value.tzinfo is None:
        raise _reject("expiresAt", "expiresAt must carry a time zone (e.g. Z or +01:00)")
    try:
        return value.astimezone(UTC)
    except OverflowError:  # 9999-12-31T23:59:59-14:00 is in the year 10000 in UTC
        raise _reject("expiresAt", "expiresAt is outside the years 1 to 9999 in UTC") from None


# What an attachment's name and content type may be (the template editor's uploads too).
SAFE_FILENAME = re.compile(r"^[^/\\\x00-\x1f\x7f]{1,255}$")
CONTENT_TYPE = re.compile(r"^[A-Za-z0-9][\w.+-]*/[A-Za-z0-9][\w.+-]*$")


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
        if name is None or not SAFE_FILENAME.match(name):
            raise _reject(f"{where}.name", "attachment name must be a plain file name")
        ctype = _str(item, "contentType", max_len=127) or "application/octet-stream"
        if not CONTENT_TYPE.match(ctype):
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


def _no_unknown(data: Mapping[str, Any], allowed: frozenset[str]) -> None:
    unknown = sorted(data.keys() - allowed)
    if unknown:
        raise _reject(unknown[0], f"unknown field {unknown[0]!r}")


def _request_hash(values: Mapping[str, Any]) -> str:
    canonical = json.dumps(values, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


# --- mail --------------------------------------------------------------------------------

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
    "stream",
    "metadata",
)


_MAIL_FIELD_SET = frozenset(MAIL_FIELDS)


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
    stream: str | None = None  # None: not given (resolved before the write)
    metadata: dict[str, Any] | None = None
    request_hash: str = field(default="")


def validate_mail(data: Any, settings: Settings, tenant_id: int | None) -> MailRequest:
    """Check a mail request's shape and values (no database access)."""
    if not isinstance(data, Mapping):
        raise _reject("body", "a mail request must be a JSON object")
    _no_unknown(data, _MAIL_FIELD_SET)
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
        expires_at=parse_expires_at(data),
        stream=_stream(data),
        metadata=_metadata(data),
    )
    if req.template_code == "":
        raise _reject("templateCode", "templateCode must not be empty")
    if req.business_key == "":
        raise _reject("businessKey", "businessKey must not be empty")
    has_template = req.template_id is not None or req.template_code is not None
    if req.template_id is not None and req.template_code is not None:
        raise _reject("templateCode", "give templateId or templateCode, not both")
    if not has_template:
        if _empty(req.subject):
            raise _reject("subject", "subject is required when no template is given", "required")
        if _empty(req.html) and _empty(req.text):
            raise _reject("html", "html or text is required when no template is given", "required")
    else:
        _own_parts(req)
    req.request_hash = _request_hash(_hashed(req))
    return req


def _empty(value: str | None) -> bool:
    """Nothing to show: left out, empty, or white space only (as preparation reads it)."""
    return not (value or "").strip()


def _own_parts(req: MailRequest) -> None:
    """A templated mail's own subject or body, refused when preparation would fail it for
    certain: a subject given replaces the template's, and a body given (html or text) replaces
    both of its bodies, so given empty they leave nothing to send."""
    if req.subject is not None and _empty(req.subject):
        raise _reject("subject", "subject is empty (leave it out, or null, to use the template's)")
    given = [name for name, value in (("html", req.html), ("text", req.text)) if value is not None]
    if given and _empty(req.html) and _empty(req.text):
        raise _reject(
            given[0],
            f"{' and '.join(given)} {'are' if len(given) > 1 else 'is'} empty (leave html and "
            "text out, or null, to use the template's body)",
        )


# --- SMS ---------------------------------------------------------------------------------

SMS_FIELDS = (
    "phoneNumber",
    "content",
    "templateCode",
    "variables",
    "scope",
    "businessKey",
    "expiresAt",
    "stream",
    "metadata",
)


_SMS_FIELD_SET = frozenset(SMS_FIELDS)


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
    stream: str | None = None  # None: not given (resolved before the write)
    metadata: dict[str, Any] | None = None
    request_hash: str = field(default="")


def _phone(raw: Any) -> tuple[str, str | None]:
    try:
        return parse_phone_number(raw, "phoneNumber")
    except AddressError as exc:
        raise AcceptanceError(exc.code, exc.field, exc.message) from None


def validate_sms(data: Any, settings: Settings, tenant_id: int | None) -> SmsRequest:
    """Check an SMS request's shape and values (no database access)."""
    if not isinstance(data, Mapping):
        raise _reject("body", "an SMS request must be a JSON object")
    _no_unknown(data, _SMS_FIELD_SET)
    scope, owner = _scope(data, tenant_id)
    phone, country = _phone(data.get("phoneNumber"))
    req = SmsRequest(
        tenant_id=owner,
        scope=scope,
        phone_number=phone,
        country_code=country,
        content=_str(data, "content", max_len=MAX_SMS_CHARS),
        template_code=_str(data, "templateCode", max_len=MAX_CODE_CHARS),
        variables=_variables(data, settings),
        business_key=_str(data, "businessKey", max_len=MAX_KEY_CHARS),
        expires_at=parse_expires_at(data),
        stream=_stream(data),
        metadata=_metadata(data),
    )
    if req.business_key == "":
        raise _reject("businessKey", "businessKey must not be empty")
    if not req.content and not req.template_code:
        raise _reject("content", "content or templateCode is required", "required")
    if req.content and _empty(req.content):
        # Content replaces the template's unless it is empty (then as if left out); white space
        # alone is sent as nothing, which preparation always fails.
        raise _reject("content", "content is white space only")
    req.request_hash = _request_hash(_hashed(req))
    return req


# --- batches -----------------------------------------------------------------------------


def check_batch(items: Any) -> list[Any]:
    """``items`` as a list of 1 to MAX_BATCH items (a tuple is fine from Python callers); any
    other JSON (null, a number, true, a string, an object) is refused, naming ``items``."""
    if isinstance(items, tuple):
        items = list(items)
    if not isinstance(items, list):
        raise _reject("items", f"items must be a list of 1 to {MAX_BATCH} objects")
    if not items:
        raise _reject("items", f"a batch holds 1 to {MAX_BATCH} items; this one is empty")
    if len(items) > MAX_BATCH:
        raise _reject("items", f"a batch holds 1 to {MAX_BATCH} items", "too_large")
    return items


def unique_keys(requests: Sequence[MailRequest | SmsRequest]) -> None:
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
