"""Vonage (Nexmo) SMS API: ``POST /sms/json``.

A form POST carrying ``api_key``/``api_secret`` (the provider config's account id and secret).
The answer is HTTP 200 even when the message is refused: each part of the message has its own
``status`` ("0" accepted; anything else an error with ``error-text``). Other HTTP statuses
(429, 5xx) follow the common rules.

Idempotency: the SMS API has no idempotency key. The record's key goes as ``client-ref`` (echoed
in the answer and in delivery receipts), the same on every attempt, so an ambiguous attempt
can be matched to its receipt; Vonage itself does not deduplicate on it.
"""

from __future__ import annotations

import httpx

from portal.messaging.sending.classify import Reach, unavailable
from portal.messaging.sending.transports.sms import _http
from portal.messaging.sending.transports.sms.result import (
    CONFIG_ERROR,
    OutgoingSms,
    ProviderAccount,
    SmsErrorCode,
    SmsResult,
)

DEFAULT_BASE_URL = "https://rest.nexmo.com"

# The SMS API's documented per-message statuses (Vonage "SMS API error codes"). None of them
# says Vonage is unavailable (classify.UNAVAILABLE_PROVIDER_CODES): 1 and 10 are limits of the
# account, 5 a failure to process this message; an outage shows as HTTP 502/503/504.
CODES: dict[str, str] = {
    "1": SmsErrorCode.THROTTLED,  # Throttled: faster than the account limit
    "2": SmsErrorCode.INVALID_REQUEST,  # Missing parameters
    "3": SmsErrorCode.INVALID_REQUEST,  # Invalid parameters
    "4": SmsErrorCode.AUTH_FAILED,  # Invalid credentials
    "5": SmsErrorCode.PROVIDER_ERROR,  # Internal error
    "6": SmsErrorCode.INVALID_RECIPIENT,  # Invalid message: unrecognised number prefix
    "7": SmsErrorCode.RECIPIENT_REFUSED,  # Number barred
    "8": SmsErrorCode.ACCOUNT_SUSPENDED,  # Partner account barred
    "9": SmsErrorCode.CREDIT_EXHAUSTED,  # Partner quota violation: not enough credit
    "10": SmsErrorCode.THROTTLED,  # Too many existing binds
    "11": SmsErrorCode.ACCOUNT_SUSPENDED,  # Account not enabled for HTTP
    "12": SmsErrorCode.INVALID_REQUEST,  # Message too long
    "14": SmsErrorCode.AUTH_FAILED,  # Invalid signature
    "15": SmsErrorCode.SENDER_REJECTED,  # Invalid sender address
    "22": SmsErrorCode.INVALID_REQUEST,  # Invalid network code
    "29": SmsErrorCode.RECIPIENT_REFUSED,  # Non-whitelisted destination
    "32": SmsErrorCode.AUTH_FAILED,  # Signature and API secret disallowed
    "33": SmsErrorCode.RECIPIENT_REFUSED,  # Number de-activated
}

# A refused request (not 2xx) says why in "status" and "error-text" (or a problem's "title").
REFUSALS = _http.Refusals(
    "vonage",
    CODES,
    own_code_prefix="VONAGE_",
    code_key="status",
    message_keys=("error-text", "title"),
)

# GSM 03.38 basic character set and its extension table: anything else needs type=unicode.
_GSM = frozenset(
    "@£$¥èéùìòÇ\nØø\rÅåΔ_ΦΓΛΩΠΨΣΘΞÆæßÉ !\"#¤%&'()*+,-./0123456789:;<=>?¡ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    "ÄÖÑÜ§¿abcdefghijklmnopqrstuvwxyzäöñüà^{}\\[~]|€"
)


def is_gsm(text: str) -> bool:
    """Whether ``text`` fits the GSM 7-bit alphabet (else Vonage needs ``type=unicode``)."""
    return all(ch in _GSM for ch in text)


def send(client: httpx.Client, account: ProviderAccount, sms: OutgoingSms) -> SmsResult:
    """Submit one SMS."""
    label = f"Vonage ({account.name})"
    if not account.account_id or not account.secret:
        return SmsResult.failed(CONFIG_ERROR, f"{label} needs an API key and an API secret")
    if not account.sender_id:
        return SmsResult.failed(CONFIG_ERROR, f"{label} needs a sender (from)")
    base = (account.base_url or DEFAULT_BASE_URL).rstrip("/")
    form = {
        "api_key": account.account_id,
        "api_secret": account.secret,
        "from": account.sender_id,
        "to": sms.to.lstrip("+"),
        "text": sms.content,
        "client-ref": sms.idempotency_key,
    }
    if not is_gsm(sms.content):
        form["type"] = "unicode"
    answer = _http.post(
        client,
        f"{base}/sms/json",
        provider=label,
        allow_private=account.allow_private,
        data=form,
        headers={"Accept": "application/json"},
    )
    if isinstance(answer, SmsResult):
        return answer
    body = _http.json_body(answer)
    if not answer.is_success:
        return REFUSALS.result(answer, body, label)
    parts = body.get("messages") if body else None
    if not isinstance(parts, list) or not parts or not all(isinstance(p, dict) for p in parts):
        # A 200 we cannot read may still mean it was accepted: do not assume it failed.
        return SmsResult.failed(
            f"HTTP_{answer.status_code}",
            f"{label} answered HTTP {answer.status_code} without message statuses: "
            f"{_http.NOT_UNDERSTOOD}",
            ambiguous=True,
            reply=str(answer.status_code),
        )
    refused = next((p for p in parts if str(p.get("status", "")) != "0"), None)
    if refused is None:
        message_id = parts[0].get("message-id")
        return SmsResult.sent(str(message_id) if message_id else None)
    status = str(refused.get("status", ""))
    text = refused.get("error-text") or "(no error text)"
    message = f"{label} status {status}: {text}"
    if len(parts) > 1 and refused is not parts[0]:
        message += f" (part {parts.index(refused) + 1} of {len(parts)}; earlier parts accepted)"
    code = CODES.get(status) or f"VONAGE_{status}"
    return SmsResult.failed(
        code,
        message,
        connection=unavailable(
            Reach.ANSWERED,
            kind="vonage",
            status=answer.status_code,
            provider_code=status,
            code=code,
        ),
        reply=f"{answer.status_code} {status}"[:100],
    )
