"""Provider delivery events: ``POST /webhooks/<channel>/<provider>/<config id>``.

Each request is checked against the provider's signature on the raw body, with a constant-time
compare, before anything is parsed:

- ``sms/twilio``: ``X-Twilio-Signature``, base64 HMAC-SHA1 of the full URL followed by the
  sorted form parameters (name then value), keyed by the config's auth token (its secret).
- ``sms/vonage``: Vonage's own signed webhooks, keyed by the config's webhook secret (the
  account's *signature secret* in the Vonage dashboard):

  - SMS API delivery receipts (GET query, POST form or POST JSON) carry ``sig``: every other
    parameter, sorted by name, as ``&name=value`` (``&`` and ``=`` inside values replaced by
    ``_``), then either MD5 of that followed by the secret ("MD5 hash") or an HMAC keyed by the
    secret (MD5, SHA-1, SHA-256 or SHA-512, as set in the dashboard; the digest's length says
    which), in hex. The signed ``timestamp`` (Unix seconds) must be within 5 minutes of ours,
    so a captured receipt cannot be replayed later.
  - Messages API status webhooks carry ``Authorization: Bearer <JWT>``, HS256 with the secret
    (verified by PyJWT, no other algorithm accepted); its ``payload_hash`` claim is the SHA-256
    of the raw body and ``iat`` must be within 5 minutes; an ``api_key`` claim must be the
    config's account id when one is set.

  A receipt relayed through our own signer (``X-Postroom-Signature``, below) is still accepted.
- every other provider (``sms/http_json``, ``sms/test`` and ``mail/generic``):
  ``X-Postroom-Signature``, hex HMAC-SHA256 of the raw body (``sha256=`` prefix allowed), keyed
  by the config's webhook secret.
- mail servers have no webhook secret column: theirs is derived from the app's secret key and
  the config id (``mail_webhook_secret``), so rotating ``SECRET_KEY`` rotates it.

Answers: 404 for an unknown config or a provider that does not match it; 413 over 64 KiB; 401
for a missing or wrong signature (or a stale signed timestamp); 400 for a signed body that is
not an event; otherwise 200, also for events about message ids we do not know (they are kept
and applied when the id is written), so a provider never disables the endpoint. Replays are
stored once.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
import warnings
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qsl

import jwt as pyjwt
from flask import Blueprint, Response, current_app, jsonify, request
from sqlalchemy import select

from portal.config import Settings
from portal.extensions import csrf, db
from portal.messaging.after_send import events
from portal.messaging.after_send.events import EventType, ProviderEvent
from portal.models import Channel, MailSendServerConfig, SmsProviderConfig, SmsProviderKind
from portal.models.secretbox import SecretUnavailable
from portal.tenancy import tenant_context
from portal.web.machine.endpoint import error_response

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
# Vonage: a signed request whose timestamp is further than this from ours is refused.
VONAGE_MAX_SKEW_S = 300
# The hex length of a ``sig`` says its digest; 32 is MD5, as a plain hash or as an HMAC.
VONAGE_METHODS = {
    32: ("md5hash", "md5"),
    40: ("sha1",),
    64: ("sha256",),
    128: ("sha512",),
}


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


def vonage_signature(secret: str, params: Mapping[str, str], method: str = "md5hash") -> str:
    """Vonage's ``sig`` of a signed SMS API request: ``method`` is "md5hash" (MD5 of the
    parameters followed by the secret) or an HMAC digest ("md5", "sha1", "sha256", "sha512")."""
    text = "".join(
        f"&{name}={value.replace('&', '_').replace('=', '_')}"
        for name, value in sorted(params.items())
        if name != "sig"
    )
    if method == "md5hash":
        return hashlib.md5((text + secret).encode()).hexdigest()
    return hmac.new(secret.encode(), text.encode(), method).hexdigest()


def vonage_sig_problem(
    secret: str | None, params: Mapping[str, str], now: float | None = None
) -> str | None:
    """Why the ``sig`` of these parameters does not hold (None: it does)."""
    given = params.get("sig", "").strip().lower()
    methods = VONAGE_METHODS.get(len(given))
    if not secret or not given or methods is None:
        return "the signature is missing or wrong"
    if not any(_same(given, vonage_signature(secret, params, m)) for m in methods):
        return "the signature is missing or wrong"
    return _stale(params.get("timestamp", ""), now)


def _stale(stamp: Any, now: float | None) -> str | None:
    """Why a signed time (Unix seconds) is unusable: missing, or too far from ours."""
    if isinstance(stamp, str) and stamp.strip().isdigit() and len(stamp.strip()) <= 12:
        stamp = int(stamp.strip())
    if isinstance(stamp, bool) or not isinstance(stamp, (int, float)):
        return "the signed timestamp is missing"
    now = time.time() if now is None else now
    if abs(now - stamp) > VONAGE_MAX_SKEW_S:
        return f"the signed timestamp is more than {VONAGE_MAX_SKEW_S} seconds from now"
    return None


# Claims a Messages API token must carry (Vonage's signed webhooks: iat, jti, iss, payload_hash,
# api_key, application_id); ``api_key`` is checked against the config's account id when set.
VONAGE_JWT_CLAIMS = ["iat", "payload_hash"]
BAD_SIGNATURE = "the signature is missing or wrong"
# Vonage chooses the signature secret, and a short one is still the one we must check with:
# PyJWT's warning about HMAC keys under 32 bytes would only fill the log. (A process-wide filter:
# warnings.catch_warnings around the decode is not thread-safe.)
warnings.filterwarnings("ignore", category=pyjwt.InsecureKeyLengthWarning)


def vonage_jwt_problem(
    secret: str | None, token: str, body: bytes, api_key: str | None = None
) -> str | None:
    """Why a Messages API webhook's bearer JWT does not hold (None: it does): PyJWT checks the
    signature (HS256 only, keyed by the signature secret) and that ``iat`` is present and not in
    the future; on top, ``payload_hash`` must be the SHA-256 of the body, ``iat`` no older than
    VONAGE_MAX_SKEW_S, and ``api_key`` the config's account id when one is set."""
    if not secret:
        return BAD_SIGNATURE
    try:
        claims = pyjwt.decode(
            token.strip(),
            secret,
            algorithms=["HS256"],
            options={"require": VONAGE_JWT_CLAIMS},
            leeway=VONAGE_MAX_SKEW_S,
        )
    except pyjwt.MissingRequiredClaimError as exc:
        return "the signed timestamp is missing" if exc.claim == "iat" else BAD_SIGNATURE
    except (pyjwt.InvalidIssuedAtError, pyjwt.ImmatureSignatureError):
        return f"the signed timestamp is missing or more than {VONAGE_MAX_SKEW_S} seconds ahead"
    except pyjwt.ExpiredSignatureError:
        return "the signed timestamp (exp) has passed"
    except pyjwt.InvalidTokenError:
        return BAD_SIGNATURE
    payload_hash = claims["payload_hash"]
    if not isinstance(payload_hash, str) or not _same(
        payload_hash.lower(), hashlib.sha256(body).hexdigest()
    ):
        return "the body is not the one that was signed"
    if api_key and claims.get("api_key") not in (None, api_key):
        return "the token was signed for another Vonage account"
    # PyJWT checks only that iat is not ahead of us; a captured token must not replay later.
    return _stale(claims["iat"], None)


@bp.get("/sms/vonage/<int:config_id>")
def vonage_receipt(config_id: int) -> Response:
    """A Vonage delivery receipt sent as a GET (the dashboard's default HTTP method)."""
    return sms(SmsProviderKind.VONAGE.value, config_id)


@bp.post("/sms/<provider>/<int:config_id>")
def sms(provider: str, config_id: int) -> Response:
    """Delivery events of an SMS provider config."""
    config = db.session.get(SmsProviderConfig, config_id) if config_id <= MAX_ID else None
    if config is None or config.provider != provider:
        return error_response(404, "not_found", "no such webhook", "config")
    body = _body()
    if isinstance(body, Response):
        return body
    try:
        return _verified_sms(config, provider, body)
    except SecretUnavailable:
        # SECRET_KEY changed since the secret was saved: nothing can be verified until an
        # admin enters it again (the provider page says so). Refused, never a 500.
        return _unsigned(
            "the signing secret stored for this provider can no longer be read; "
            "an admin must enter it again on the SMS provider page"
        )


def _verified_sms(config: SmsProviderConfig, provider: str, body: bytes) -> Response:
    if provider == SmsProviderKind.VONAGE.value and not request.headers.get(SIGNATURE_HEADER):
        return _vonage_native(config, body)
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


def _vonage_native(config: SmsProviderConfig, body: bytes) -> Response:
    """A Vonage webhook signed Vonage's way: a Messages API JWT, or an SMS API ``sig``."""
    secret = config.webhook_secret
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        problem = vonage_jwt_problem(secret, token, body, config.account_id)
        if problem is not None:
            return _unsigned(problem)
        parse: Any = lambda: [_vonage(item, raw) for item, raw in _items(body)]  # noqa: E731
        return _store(Channel.SMS, config.tenant_id, config.id, config.provider, parse)
    params = _vonage_params(body)
    problem = "the signature is missing or wrong" if params is None else None
    if params is not None:
        problem = vonage_sig_problem(secret, params)
    if problem is not None or params is None:
        return _unsigned(problem or "the signature is missing or wrong")
    # The signing fields (sig, timestamp, nonce) differ between retries of one receipt.
    receipt = {k: v for k, v in params.items() if k not in ("sig", "timestamp", "nonce")}
    raw = json.dumps(receipt, sort_keys=True).encode()
    return _store(
        Channel.SMS,
        config.tenant_id,
        config.id,
        config.provider,
        lambda: [_vonage(receipt, raw)],
    )


def _vonage_params(body: bytes) -> dict[str, str] | None:
    """An SMS API receipt's parameters as Vonage signed them: the query string, then the form
    or JSON body (None: a body that is neither)."""
    params = {k: v for k, v in request.args.items()}
    if not body.strip():
        return params
    if request.mimetype == "application/json" or body.lstrip()[:1] == b"{":
        try:
            data = json.loads(body)
        except (ValueError, RecursionError):
            return None
        if not isinstance(data, dict):
            return None
        for name, value in data.items():
            params[str(name)] = _as_signed(value)
        return params
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        return None
    for name, value in parse_qsl(text, keep_blank_values=True):
        params.setdefault(name, value)
    return params


def _as_signed(value: Any) -> str:
    """A JSON value as text for the signature (receipts send strings; others cannot match)."""
    if isinstance(value, str):
        return value
    return json.dumps(value, separators=(",", ":"))


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


def _unsigned(problem: str = "the signature is missing or wrong") -> Response:
    field = "timestamp" if "timestamp" in problem else "signature"
    return error_response(401, "bad_signature", problem, field)


def _store(channel: Channel, tenant_id: int, config_id: int, provider: str, parse: Any) -> Response:
    try:
        parsed: list[ProviderEvent] = parse()
    except BadEvent as exc:
        return error_response(400, "invalid", str(exc), "body")
    stored = duplicates = matched = 0
    unmatched: list[int] = []
    with tenant_context(tenant_id):
        ids = [event.provider_message_id for event in parsed]
        events.lock_for_events(db.session(), channel, config_id, ids)
        for event in parsed:
            result = events.store(
                db.session(),
                channel,
                tenant_id=tenant_id,
                config_id=config_id,
                provider=provider,
                event=event,
                locked=True,
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
    return events.clean_text(str(value), limit)


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
    permanent = status in ("undelivered", "failed") and code in TWILIO_PERMANENT
    return ProviderEvent(
        dedup_key=f"{sid}:{status}:{code or ''}",
        event_type=_sms_event_type(status, permanent),
        provider_message_id=sid,
        recipient=_clean(params.get("To"), 320),
        code=code,
        description=f"Twilio status {status}" + (f", error {code}" if code else ""),
        detail={"status": status},
    )


def _sms_event_type(status: str, permanent: bool) -> EventType:
    """An SMS provider's status as an event: delivered; a failure whose code says it is for
    good (``permanent``), a bounce; anything else, other."""
    if status == "delivered":
        return EventType.DELIVERED
    return EventType.BOUNCED if permanent else EventType.OTHER


def _vonage(item: dict[str, Any], raw: bytes) -> ProviderEvent:
    """An SMS API delivery receipt (messageId, msisdn, status, err-code, message-timestamp) or a
    Messages API status (message_uuid, to, status, error.title, timestamp)."""
    messages_api = "message_uuid" in item
    message_id = _clean(item.get("messageId") or item.get("message-id") or item.get("message_uuid"))
    status = (_clean(item.get("status"), 32) or "").lower()
    if not message_id or not status:
        raise BadEvent("a Vonage delivery receipt carries messageId and status")
    error = item.get("error")
    code = _clean(item.get("err-code"), 100)
    if code is None and isinstance(error, dict):
        code = _clean(error.get("title"), 100)
    permanent = status in ("failed", "rejected") and code in VONAGE_PERMANENT and not messages_api
    return ProviderEvent(
        dedup_key=f"{message_id}:{status}:{code or ''}",
        event_type=_sms_event_type(status, permanent),
        provider_message_id=message_id,
        recipient=_e164(_clean(item.get("to") if messages_api else item.get("msisdn"), 32)),
        occurred_at=_when(item.get("timestamp") if messages_api else item.get("message-timestamp")),
        code=code,
        description=f"Vonage status {status}" + (f", err-code {code}" if code else ""),
        detail={"status": status},
    )
