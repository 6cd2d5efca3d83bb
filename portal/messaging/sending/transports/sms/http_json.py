"""A generic signed JSON webhook, for in-house SMS gateways.

The request: ``POST {base_url}`` with the JSON object ``{"to", "from", "content",
"externalTemplateId", "signature", "variables", "reference"}`` and the headers

- ``Idempotency-Key``: the record's key, the same on every attempt (also in ``reference``);
- ``X-Postroom-Signature``: the hex HMAC-SHA256 of the raw body under the provider's secret.

The answers a gateway gives:

- 2xx ``{"id": "..."}``: accepted, with the gateway's message id;
- 409: this idempotency key was already accepted (a gateway records a key only when it
  accepts the message); ``{"id": "..."}`` names the earlier message when it can;
- otherwise ``{"code": "...", "message": "..."}`` with a 4xx or 5xx status; a Retry-After
  header is honoured. ``SERVICE_UNAVAILABLE`` (any status), or a 502/503/504 whose code names no
  other cause, says the gateway itself is down: its circuit breaker counts it.
"""

from __future__ import annotations

import hashlib
import hmac
import json

import httpx

from portal.messaging.sending.transports.sms import _http
from portal.messaging.sending.transports.sms.result import (
    CONFIG_ERROR,
    OutgoingSms,
    ProviderAccount,
    SmsErrorCode,
    SmsResult,
)

SIGNATURE_HEADER = "X-Postroom-Signature"
IDEMPOTENCY_HEADER = "Idempotency-Key"

# The codes a gateway is asked to use for refusals that decide a category; anything else is
# kept as the gateway wrote it (classify() still reads LIMIT / QUOTA / THROTTL in it).
CODES: dict[str, str] = {
    "INVALID_RECIPIENT": SmsErrorCode.INVALID_RECIPIENT,
    "INVALID_REQUEST": SmsErrorCode.INVALID_REQUEST,
    "RECIPIENT_REFUSED": SmsErrorCode.RECIPIENT_REFUSED,
    "AUTH_FAILED": SmsErrorCode.AUTH_FAILED,
    "ACCOUNT_SUSPENDED": SmsErrorCode.ACCOUNT_SUSPENDED,
    "SENDER_REJECTED": SmsErrorCode.SENDER_REJECTED,
    "THROTTLED": SmsErrorCode.THROTTLED,
    "CREDIT_EXHAUSTED": SmsErrorCode.CREDIT_EXHAUSTED,
    "PROVIDER_ERROR": SmsErrorCode.PROVIDER_ERROR,
    # The gateway (or the carrier link behind it) is down: its breaker counts it.
    "SERVICE_UNAVAILABLE": SmsErrorCode.PROVIDER_ERROR,
}

# A refusal names the gateway's code in "code" and says why in "message".
REFUSALS = _http.Refusals("http_json", CODES)


def sign(body: bytes, secret: str) -> str:
    """The value of the signature header for ``body``."""
    return hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def body_of(account: ProviderAccount, sms: OutgoingSms) -> bytes:
    """The exact bytes that are signed and sent."""
    payload = {
        "to": sms.to,
        "from": account.sender_id,
        "content": sms.content,
        "externalTemplateId": sms.external_template_id,
        "signature": sms.signature,
        "variables": sms.variables or {},
        "reference": sms.idempotency_key,
    }
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()


def send(client: httpx.Client, account: ProviderAccount, sms: OutgoingSms) -> SmsResult:
    """POST one SMS to the gateway."""
    label = f"Gateway ({account.name})"
    if not account.base_url:
        return SmsResult.failed(CONFIG_ERROR, f"{label} needs a base URL (the gateway's endpoint)")
    if not account.secret:
        return SmsResult.failed(CONFIG_ERROR, f"{label} needs a secret to sign its requests")
    body = body_of(account, sms)
    answer = _http.post(
        client,
        account.base_url,
        provider=label,
        allow_private=account.allow_private,
        content=body,
        headers={
            "Content-Type": "application/json",
            "Accept": "application/json",
            IDEMPOTENCY_HEADER: sms.idempotency_key,
            SIGNATURE_HEADER: sign(body, account.secret),
        },
    )
    if isinstance(answer, SmsResult):
        return answer
    data = _http.json_body(answer)
    gateway_id = data.get("id") if data else None
    if answer.is_success:
        return SmsResult.sent(str(gateway_id) if gateway_id else None)
    if answer.status_code == 409:
        return SmsResult.already_sent(
            str(gateway_id) if gateway_id else None,
            f"{label}: idempotency key {sms.idempotency_key} was already accepted",
        )
    return REFUSALS.result(answer, data, label)
