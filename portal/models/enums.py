"""Enumerations stored as strings."""

from __future__ import annotations

from enum import StrEnum


class SendStatus(StrEnum):
    PENDING = "Pending"
    SENDING = "Sending"
    SENT = "Sent"
    RETRY = "Retry"
    FAILED = "Failed"
    DEAD_LETTER = "DeadLetter"
    CANCELLED = "Cancelled"
    SUPPRESSED = "Suppressed"
    UNCERTAIN = "Uncertain"


# The from-statuses of two transitions (portal/messaging/transitions.py): the claim's, and a
# manual retry's, which the pages and the diagnosis read too.
DUE_STATUSES = (SendStatus.PENDING, SendStatus.RETRY)
RETRYABLE_BY_HAND = (
    SendStatus.PENDING,
    SendStatus.RETRY,
    SendStatus.FAILED,
    SendStatus.DEAD_LETTER,
)


class Scope(StrEnum):
    TENANT = "TENANT"
    PLATFORM = "PLATFORM"


class Channel(StrEnum):
    MAIL = "mail"
    SMS = "sms"


class ApiScope(StrEnum):
    """What an API key may do: ``send`` accepts messages; ``read`` reads records."""

    SEND = "send"
    READ = "read"


class Role(StrEnum):
    PLATFORM_OPERATOR = "platform_operator"
    TENANT_ADMIN = "tenant_admin"
    SUPPORT = "support"


class SmtpSecurity(StrEnum):
    PLAIN = "plain"
    STARTTLS = "starttls"
    SSL = "ssl"


class SmsProviderKind(StrEnum):
    TWILIO = "twilio"
    VONAGE = "vonage"
    HTTP_JSON = "http_json"
    TEST = "test"


class UncertainPolicy(StrEnum):
    RETRY = "retry"
    HOLD = "hold"


class DeadLetterSource(StrEnum):
    SEND_EXHAUSTED = "SendExhausted"
    BROKER_POISON = "BrokerPoison"


class TriageStatus(StrEnum):
    PENDING = "Pending"
    RESOLVED = "Resolved"
    DISCARDED = "Discarded"
