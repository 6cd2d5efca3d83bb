"""What an SMS adapter is given and what it answers, the same for every provider.

Pure data (no Flask, no database, no network). An adapter never raises for a failed send: it
answers ``SmsResult`` with an error code that ``classify()`` understands (see ``SmsErrorCode``),
so the pipeline handles every provider the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

# The transport's own codes, shared with the SMTP transport; classify() knows them.
NETWORK_ERROR = "NETWORK_ERROR"
TIMEOUT = "TIMEOUT"
CONFIG_ERROR = "CONFIG_ERROR"


class SmsErrorCode(StrEnum):
    """Our names for provider answers that decide a category (each adapter maps its provider's
    codes onto these; classify() reads them). The provider's own code stays in the message."""

    INVALID_RECIPIENT = "SMS_INVALID_RECIPIENT"  # INVALID_INPUT: not a valid mobile number
    INVALID_REQUEST = "SMS_INVALID_REQUEST"  # INVALID_INPUT: content or parameters refused
    RECIPIENT_REFUSED = "SMS_RECIPIENT_REFUSED"  # PERMANENT: barred, unsubscribed, unreachable
    AUTH_FAILED = "SMS_AUTH_FAILED"  # AUTH: credentials refused
    ACCOUNT_SUSPENDED = "SMS_ACCOUNT_SUSPENDED"  # AUTH: the account may not send
    SENDER_REJECTED = "SMS_SENDER_REJECTED"  # CONFIG: the configured sender is not usable
    THROTTLED = "SMS_THROTTLED"  # QUOTA: sending faster than the account allows
    CREDIT_EXHAUSTED = "SMS_CREDIT_EXHAUSTED"  # QUOTA: no credit left; retried after a top-up
    PROVIDER_ERROR = "SMS_PROVIDER_ERROR"  # TRANSIENT: the provider's own fault


def idempotency_key(record_id: int) -> str:
    """The provider idempotency key of a record: the same on every attempt."""
    return f"postroom-sms-{record_id}"


@dataclass(frozen=True)
class ProviderAccount:
    """The provider config as an adapter needs it, read at each send (secrets decrypted)."""

    kind: str
    name: str
    base_url: str | None
    account_id: str | None
    secret: str | None
    sender_id: str | None
    # Whether the base URL may reach private and reserved addresses: the caller decides by the
    # config's tier (portal.messaging.sending.outbound.allows_private); every send checks it.
    allow_private: bool = True


@dataclass(frozen=True)
class OutgoingSms:
    """One SMS as preparation froze it."""

    record_id: int
    to: str  # E.164
    content: str
    idempotency_key: str
    external_template_id: str | None = None
    signature: str | None = None
    variables: dict[str, Any] | None = None


@dataclass(frozen=True)
class SmsResult:
    """The provider's answer to one attempt.

    ``accepted``: the provider took the message (``provider_message_id`` when it said which).
    ``duplicate``: it refused the idempotency key as already used, i.e. an earlier attempt was
    accepted; the record is Sent, never retried. Otherwise ``code``/``message`` say why, with
    the provider's Retry-After in ``retry_after_s`` and ``ambiguous`` when the request had been
    written before the failure (the provider may have taken it).
    """

    accepted: bool
    provider_message_id: str | None = None
    code: str | None = None
    message: str | None = None
    retry_after_s: float | None = None
    ambiguous: bool = False
    duplicate: bool = False
    # The provider itself is unavailable, whatever the message (classify.unavailable decides,
    # the same for every provider kind): its circuit breaker counts these, and only these.
    connection: bool = False
    # The provider's reply as the attempt's row shows it: the HTTP status, then the
    # provider's own code ("400 21211"); None when no HTTP answer came.
    reply: str | None = None

    @classmethod
    def sent(cls, provider_message_id: str | None) -> SmsResult:
        """The provider accepted the message."""
        return cls(accepted=True, provider_message_id=provider_message_id)

    @classmethod
    def already_sent(cls, provider_message_id: str | None, message: str) -> SmsResult:
        """The idempotency key was used by an earlier, accepted attempt."""
        return cls(
            accepted=True, provider_message_id=provider_message_id, message=message, duplicate=True
        )

    @classmethod
    def failed(
        cls,
        code: str,
        message: str,
        *,
        retry_after_s: float | None = None,
        ambiguous: bool = False,
        connection: bool = False,
        reply: str | None = None,
    ) -> SmsResult:
        """The attempt failed; ``code`` decides the category."""
        return cls(
            accepted=False,
            code=code,
            message=message,
            retry_after_s=retry_after_s,
            ambiguous=ambiguous,
            connection=connection,
            reply=reply,
        )
