"""Twilio Programmable Messaging: ``POST /2010-04-01/Accounts/{AccountSid}/Messages.json``.

A form POST with HTTP basic auth (Account SID : Auth Token). Success is 201 with the Message
resource (its ``sid``); a refusal is a JSON exception ``{"code", "message", "more_info",
"status"}``, where ``code`` is Twilio's error number.

Idempotency: Twilio's Messages API has no idempotency key, so a retry after an ambiguous
attempt (no answer in time) may deliver twice; the attempt is recorded as ambiguous on the
record. We send no key header (Twilio would ignore it; ``I-Twilio-Idempotency-Token`` is a
header Twilio sets on its own webhooks, not one it honours on requests).

Templates: with an external template id (a Content SID, ``HX...``) the message is sent as
``ContentSid`` with the frozen variables as ``ContentVariables``, and Twilio renders it;
otherwise the rendered content goes as ``Body``. A sender starting ``MG`` is a Messaging
Service SID, sent as ``MessagingServiceSid`` instead of ``From``.
"""

from __future__ import annotations

import json
from urllib.parse import quote

import httpx

from portal.messaging.sending.transports.sms import _http
from portal.messaging.sending.transports.sms.result import (
    CONFIG_ERROR,
    OutgoingSms,
    ProviderAccount,
    SmsErrorCode,
    SmsResult,
)

DEFAULT_BASE_URL = "https://api.twilio.com"

# Twilio's documented error numbers that decide a category (the rest keep their own number).
CODES: dict[str, str] = {
    "20003": SmsErrorCode.AUTH_FAILED,  # Authenticate
    "20005": SmsErrorCode.ACCOUNT_SUSPENDED,  # Account not active
    "20429": SmsErrorCode.THROTTLED,  # Too many requests
    "21211": SmsErrorCode.INVALID_RECIPIENT,  # Invalid 'To' phone number
    "21614": SmsErrorCode.INVALID_RECIPIENT,  # 'To' number is not a valid mobile number
    "21214": SmsErrorCode.RECIPIENT_REFUSED,  # 'To' phone number cannot be reached
    "21408": SmsErrorCode.RECIPIENT_REFUSED,  # Permission not enabled for the region
    "21608": SmsErrorCode.RECIPIENT_REFUSED,  # Unverified number (trial account)
    "21610": SmsErrorCode.RECIPIENT_REFUSED,  # Recipient unsubscribed (replied STOP)
    "21612": SmsErrorCode.RECIPIENT_REFUSED,  # 'To' number unroutable from this 'From'
    "21602": SmsErrorCode.INVALID_REQUEST,  # Message body is required
    "21617": SmsErrorCode.INVALID_REQUEST,  # Body exceeds the 1600 character limit
    "21606": SmsErrorCode.SENDER_REJECTED,  # 'From' is not an SMS-capable number of ours
    "21659": SmsErrorCode.SENDER_REJECTED,  # 'From' is not a Twilio number
    "21611": SmsErrorCode.THROTTLED,  # 'From' has too many messages queued
    # Twilio itself is down; classify.UNAVAILABLE_PROVIDER_CODES has them too (the breaker).
    "20503": SmsErrorCode.PROVIDER_ERROR,  # Service unavailable
    "21730": SmsErrorCode.PROVIDER_ERROR,  # System under maintenance
}

# A refusal is a JSON exception: Twilio's error number in "code", its text in "message".
REFUSALS = _http.Refusals("twilio", CODES, own_code_prefix="TWILIO_")


def send(client: httpx.Client, account: ProviderAccount, sms: OutgoingSms) -> SmsResult:
    """Create one Message."""
    label = f"Twilio ({account.name})"
    if not account.account_id or not account.secret:
        return SmsResult.failed(CONFIG_ERROR, f"{label} needs an Account SID and an Auth Token")
    if not account.sender_id:
        return SmsResult.failed(
            CONFIG_ERROR, f"{label} needs a sender: a From number or a Messaging Service SID"
        )
    base = (account.base_url or DEFAULT_BASE_URL).rstrip("/")
    url = f"{base}/2010-04-01/Accounts/{quote(account.account_id, safe='')}/Messages.json"
    form = {"To": sms.to}
    if account.sender_id.startswith("MG"):
        form["MessagingServiceSid"] = account.sender_id
    else:
        form["From"] = account.sender_id
    if sms.external_template_id:
        form["ContentSid"] = sms.external_template_id
        form["ContentVariables"] = json.dumps(sms.variables or {}, ensure_ascii=False)
    else:
        form["Body"] = sms.content
    answer = _http.post(
        client,
        url,
        provider=label,
        allow_private=account.allow_private,
        data=form,
        auth=(account.account_id, account.secret),
        headers={"Accept": "application/json"},
    )
    if isinstance(answer, SmsResult):
        return answer
    body = _http.json_body(answer)
    if answer.is_success:
        sid = body.get("sid") if body else None
        return SmsResult.sent(str(sid) if sid else None)
    return REFUSALS.result(answer, body, label)
