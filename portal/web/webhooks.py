"""Provider delivery events: ``POST /webhooks/<channel>/<provider>/<config id>``.

Each request is checked against the provider's signature on the raw body, with a constant-time
compare, before anything is parsed:

- ``sms/twilio``: ``X-Twilio-Signature``, base64 HMAC-SHA1 of the full URL followed by the
  sorted form parameters (name then value), keyed by the config's auth token (its secret).
- every other provider (``sms/http_json``, ``sms/vonage``, ``sms/test`` and ``mail/generic``):
  ``X-Postroom-Signature``, hex HMAC-SHA256 of the raw body (``sha256=`` prefix allowed), keyed
  by the config's webhook secret. Vonage's own signed-webhook schemes (JWT for the Messages
  API, an MD5/SHA ``sig`` parameter for SMS receipts) are not implemented: a Vonage account is
  set to post its JSON delivery receipts through a relay that signs them this way.
- mail servers have no webhook secret column: theirs is derived from the app's secret key and
  the config id (``mail_webhook_secret``), so rotating ``SECRET_KEY`` rotates it.

Answers: 404 for an unknown config or a provider that does not match it; 413 over 64 KiB; 401
for a missing or wrong signature; 400 for a signed body that is not an event; otherwise 200,
also for events about message ids we do not know (they are kept and applied when the id is
written), so a provider never disables the endpoint. Replays are stored once.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qsl

from flask import Blueprint, Response, current_app, jsonify, request
from sqlalchemy import select

from portal.config import Settings
from portal.extensions import csrf, db
from portal.messaging import events
from portal.messaging.events import EventType, ProviderEvent
from portal.models import Channel, MailSendServerConfig, SmsProviderConfig, SmsProviderKind
from portal.tenancy import tenant_context
from portal.web.api import error_response

bp = Blueprint("webhooks", __name__, url_prefix="/webhooks")
csrf.exempt(bp)  # signed by the provider; no cookie credential is involved
# Machine endpoints with their own authentication (the signature), like the API.

MAX_BODY = 64 * 1024
MAX_EVENTS = 100
MAX_ID = 2**63 - 1
GENERIC = "generic"
SIGNATURE_HEADER = "X-Postroom-Signature"

# Twilio ErrorCodes that say the number itself cannot receive messages (a permanent bounce);
# other failures (carrier filtering, queue overflow, unreachable for now) are not about the
# number and do not suppress it.
TWILIO_PERMANENT = {"21211", "21612", "21614", "30005", "30006"}
# Vonage delivery-receipt err-codes about the number: absent subscriber (permanent), illegal
# number, call barred by user.
VONAGE_PERMANENT = {"3", "4", "9"}


class BadEvent(ValueError):
    """A signed body that is not an event we can read."""


def mail_webhook_secret(settings: Settings, config_id: int) -> str:
    """The secret that signs a mail server config's webhooks (shown to its admin)."""
    key = settings.secret_key.encode()
    return hmac.new(key, f"postroom-mail-webhook:{config_id}".encode(), "sha256").hexdigest()


def twilio_signature(token: str, url: str, params: list[tuple[str, str]]) -> str:
    """Twilio's X-Twilio-Signature for a POST of ``params`` to ``url``."""
    data = url + "".join(k + v for k, v in sorted(params))
    digest = hmac.new(token.encode(), data.encode(), hashlib.sha1).digest()
    return base64.b64encode(digest).decode()


def body_signature(secret: str, body: bytes) -> str:
    """The generic signature: hex HMAC-SHA256 of the raw body."""
    return hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def _same(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.strip().encode(), expected.encode())


@bp.post("/sms/<provider>/<int:config_id>")
def sms(provider: str, config_id: int) -> Response:
    """Delivery events of an SMS provider config."""
    config = db.session.get(SmsProviderConfig, config_id) if config_id <= MAX_ID else None
    if config is None or config.provider != provider:
        return error_response(404, "not_found", "no such webhook", "config")
    body = _body()
    if isinstance(body, Response):
        return body
    if provider == SmsProviderKind.TWILIO.value:
        params = parse_qsl(body.decode("utf-8", "replace"), keep_blank_values=True)
        token = config.secret
        given = request.headers.get("X-Twilio-Signature", "")
        if not token or not given or not _same(given, twilio_signature(token, request.url, params)):
            return _unsigned()
        parse: Any = lambda: [_twilio(dict(params), body)]  # noqa: E731
    else:
        if not _signed(config.webhook_secret, body):
            return _unsigned()
        if provider == SmsProviderKind.VONAGE.value:
            parse = lambda: [_vonage(item, raw) for item, raw in _items(body)]  # noqa: E731
        else:
            parse = lambda: [_generic(item, raw) for item, raw in _items(body)]  # noqa: E731
    return _store(Channel.SMS, config.tenant_id, config.id, provider, parse)


@bp.post("/mail/<provider>/<int:config_id>")
def mail(provider: str, config_id: int) -> Response:
    """Delivery events about mail sent through a mail server config (generic scheme)."""
    config = (
        db.session.scalar(select(MailSendServerConfig).where(MailSendServerConfig.id == config_id))
        if config_id <= MAX_ID
        else None
    )
    if config is None or provider != GENERIC:
        return error_response(404, "not_found", "no such webhook", "config")
    body = _body()
    if isinstance(body, Response):
        return body
    settings: Settings = current_app.config["SETTINGS"]
    if not _signed(mail_webhook_secret(settings, config.id), body):
        return _unsigned()
    return _store(
        Channel.MAIL,
        config.tenant_id,
        config.id,
        provider,
        lambda: [_generic(item, raw) for item, raw in _items(body)],
    )


def _body() -> bytes | Response:
    if (request.content_length or 0) > MAX_BODY:
        return error_response(413, "too_large", f"at most {MAX_BODY} bytes", "body")
    body = request.get_data(cache=True)
    if len(body) > MAX_BODY:
        return error_response(413, "too_large", f"at most {MAX_BODY} bytes", "body")
    return body


def _signed(secret: str | None, body: bytes) -> bool:
    given = request.headers.get(SIGNATURE_HEADER, "")
    given = given.removeprefix("sha256=")
    return bool(secret and given) and _same(given, body_signature(secret or "", body))


def _unsigned() -> Response:
    return error_response(401, "bad_signature", "the signature is missing or wrong", "signature")


def _store(channel: Channel, tenant_id: int, config_id: int, provider: str, parse: Any) -> Response:
    try:
        parsed: list[ProviderEvent] = parse()
    except BadEvent as exc:
        return error_response(400, "invalid", str(exc), "body")
    stored = duplicates = matched = 0
    unmatched: list[int] = []
    with tenant_context(tenant_id):
        for event in parsed:
            result = events.store(
                db.session(),
                channel,
                tenant_id=tenant_id,
                config_id=config_id,
                provider=provider,
                event=event,
            )
            stored += result.stored
            duplicates += not result.stored
            matched += result.record_id is not None
            if result.stored and result.record_id is None and result.event_id is not None:
                unmatched.append(result.event_id)
        db.session.commit()
        for event_id in unmatched:
            matched += events.match_again(db.session(), channel, event_id) is not None
        db.session.commit()
    return jsonify({"stored": stored, "duplicates": duplicates, "matched": matched})


# --- parsing -----------------------------------------------------------------------------


def _clean(value: Any, limit: int = 200) -> str | None:
    """A short printable string, or None (NUL bytes never reach the database)."""
    if value is None or isinstance(value, (dict, list, bool)):
        return None
    text = str(value).replace("\x00", "").strip()
    return text[:limit] or None


def _when(value: Any) -> datetime | None:
    if isinstance(value, bool):
        return None
    try:
        if isinstance(value, (int, float)):
            return datetime.fromtimestamp(float(value), UTC)
        if isinstance(value, str) and value.strip():
            text = value.strip().replace("Z", "+00:00")
            if " " in text and "T" not in text:
                text = text.replace(" ", "T", 1)  # Vonage: "2020-01-01 12:00:00"
            parsed = datetime.fromisoformat(text)
            return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)
    except (ValueError, OverflowError, OSError):
        return None
    return None


def _e164(number: str | None) -> str | None:
    """Vonage writes numbers without the plus."""
    return f"+{number}" if number and number.isdigit() else number


def _hash(raw: bytes) -> str:
    return "sha256:" + hashlib.sha256(raw).hexdigest()


def _items(body: bytes) -> list[tuple[dict[str, Any], bytes]]:
    """The JSON object, or each object of a JSON array (with its canonical bytes for hashing)."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        raise BadEvent("the body is not JSON") from None
    items = data if isinstance(data, list) else [data]
    if not items or len(items) > MAX_EVENTS:
        raise BadEvent(f"send one event or a list of 1 to {MAX_EVENTS}")
    out = []
    for item in items:
        if not isinstance(item, dict):
            raise BadEvent("each event must be a JSON object")
        raw = body if not isinstance(data, list) else json.dumps(item, sort_keys=True).encode()
        out.append((item, raw))
    return out


def _generic(item: dict[str, Any], raw: bytes) -> ProviderEvent:
    """``{"eventId", "messageId", "recipient", "event", "bounceType", "code", "description",
    "timestamp"}``; event is delivered, bounced (permanent unless bounceType says
    temporary/transient/soft), complained, or anything else (kept as other)."""
    kind = (_clean(item.get("event"), 32) or "").lower()
    bounce_type = (_clean(item.get("bounceType"), 32) or "permanent").lower()
    if kind == "delivered":
        event_type = EventType.DELIVERED
    elif kind in ("bounced", "bounce") and bounce_type in ("permanent", "hard"):
        event_type = EventType.BOUNCED
    elif kind in ("complained", "complaint", "spamreport"):
        event_type = EventType.COMPLAINED
    else:
        event_type = EventType.OTHER
    event_id = _clean(item.get("eventId"), 180)
    return ProviderEvent(
        dedup_key=f"id:{event_id}" if event_id else _hash(raw),
        event_type=event_type,
        provider_message_id=_clean(item.get("messageId")),
        recipient=_clean(item.get("recipient"), 320),
        occurred_at=_when(item.get("timestamp")),
        code=_clean(item.get("code"), 100),
        description=_clean(item.get("description"), 500),
        detail={"event": kind, "bounceType": bounce_type} if kind else {},
    )


def _twilio(params: dict[str, str], raw: bytes) -> ProviderEvent:
    sid = _clean(params.get("MessageSid") or params.get("SmsSid"))
    status = (_clean(params.get("MessageStatus") or params.get("SmsStatus"), 32) or "").lower()
    if not sid or not status:
        raise BadEvent("a Twilio status callback carries MessageSid and MessageStatus")
    code = _clean(params.get("ErrorCode"), 100)
    if status == "delivered":
        event_type = EventType.DELIVERED
    elif status in ("undelivered", "failed") and code in TWILIO_PERMANENT:
        event_type = EventType.BOUNCED
    else:
        event_type = EventType.OTHER
    return ProviderEvent(
        dedup_key=f"{sid}:{status}:{code or ''}",
        event_type=event_type,
        provider_message_id=sid,
        recipient=_clean(params.get("To"), 320),
        code=code,
        description=f"Twilio status {status}" + (f", error {code}" if code else ""),
        detail={"status": status},
    )


def _vonage(item: dict[str, Any], raw: bytes) -> ProviderEvent:
    message_id = _clean(item.get("messageId") or item.get("message-id"))
    status = (_clean(item.get("status"), 32) or "").lower()
    if not message_id or not status:
        raise BadEvent("a Vonage delivery receipt carries messageId and status")
    code = _clean(item.get("err-code"), 100)
    if status == "delivered":
        event_type = EventType.DELIVERED
    elif status in ("failed", "rejected") and code in VONAGE_PERMANENT:
        event_type = EventType.BOUNCED
    else:
        event_type = EventType.OTHER
    return ProviderEvent(
        dedup_key=f"{message_id}:{status}:{code or ''}",
        event_type=event_type,
        provider_message_id=message_id,
        recipient=_e164(_clean(item.get("msisdn"), 32)),
        occurred_at=_when(item.get("message-timestamp")),
        code=code,
        description=f"Vonage status {status}" + (f", err-code {code}" if code else ""),
        detail={"status": status},
    )
