"""Error categories and marker codes: what a failed send's code and message mean, and what to do.

`classify(code, message)` follows the seed's table (Delivery & Retries, "Failures and retries"):
the error code is looked at first, and the message only when the code yields no category. The
rules are ordered tables below; the first rule that matches wins, so order is meaning.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from enum import StrEnum


class ErrorCategory(StrEnum):
    """Why a send failed, as far as retrying it is concerned."""

    TRANSIENT = "TRANSIENT"
    QUOTA = "QUOTA"
    UNKNOWN = "UNKNOWN"
    PERMANENT = "PERMANENT"
    INVALID_INPUT = "INVALID_INPUT"
    AUTH = "AUTH"
    CONFIG = "CONFIG"


class MarkerCode(StrEnum):
    """Error codes that we write ourselves (as opposed to a server's or provider's code)."""

    TEMPLATE_NOT_RESOLVABLE = "TEMPLATE_NOT_RESOLVABLE"
    CONFIG_NOT_RESOLVABLE = "CONFIG_NOT_RESOLVABLE"
    MONTHLY_QUOTA_EXCEEDED = "MONTHLY_QUOTA_EXCEEDED"
    CONTENT_INVALID = "CONTENT_INVALID"
    QUOTA_EXCEEDED = "QUOTA_EXCEEDED"  # a local rate-limit window (daily / per minute) is full
    RATE_LIMIT_UNAVAILABLE = "RATE_LIMIT_UNAVAILABLE"  # Redis could not be asked: send deferred
    ZOMBIE_RECOVERED = "ZOMBIE_RECOVERED"
    ZOMBIE_EXHAUSTED = "ZOMBIE_EXHAUSTED"
    EXPIRED = "EXPIRED"
    RETRY_WINDOW_EXPIRED = "RETRY_WINDOW_EXPIRED"
    SUPPRESSED = "SUPPRESSED"  # every recipient is on the tenant's suppression list
    RESOLVED_FAILED = "RESOLVED_FAILED"  # an operator resolved an Uncertain record as failed


class DeferralCode(StrEnum):
    """Codes of a record that waits for something else, not for its own failure: written
    without using a retry, and never a reason to stop it."""

    SERVER_UNAVAILABLE = "SERVER_UNAVAILABLE"  # its server's or provider's breaker is open
    SERVER_BUSY = "SERVER_BUSY"  # the pool's other workers but one are stuck on its server


_RETRYABLE = frozenset({ErrorCategory.TRANSIENT, ErrorCategory.QUOTA, ErrorCategory.UNKNOWN})


def is_retryable(category: ErrorCategory) -> bool:
    """Whether a send that failed this way is tried again automatically."""
    return category in _RETRYABLE


# --- Operator help: (what happened, what to do). The portal shows these beside a record. ---

MARKER_HELP: dict[MarkerCode, tuple[str, str]] = {
    MarkerCode.TEMPLATE_NOT_RESOLVABLE: (
        "The template does not exist, none is enabled under the code, or it failed to render.",
        "Create, enable or fix the template, then press Retry.",
    ),
    MarkerCode.CONFIG_NOT_RESOLVABLE: (
        "No mail server or SMS provider could be used for it.",
        "Complete the configuration, then press Retry.",
    ),
    MarkerCode.MONTHLY_QUOTA_EXCEEDED: (
        "This month's quota is used up.",
        "Raise the quota (see Monthly quotas), then press Retry.",
    ),
    MarkerCode.CONTENT_INVALID: (
        "The render came out empty, the body is over the length limit, "
        "or the Reply-To is malformed.",
        "Fix the template or the content the caller gave, then press Retry.",
    ),
    MarkerCode.QUOTA_EXCEEDED: (
        "The send server's or SMS provider's rate limit (its daily or per-minute window) was full.",
        "Nothing: it is tried again automatically after at least 5 minutes. If this keeps "
        "happening, raise the limit on the server or provider, or spread the sends out.",
    ),
    MarkerCode.RATE_LIMIT_UNAVAILABLE: (
        "The rate-limit counters (Redis) could not be reached, so the send was held back "
        "rather than sent unchecked.",
        "Nothing: it is tried again automatically without using up a retry. If this keeps "
        "happening, check that Redis is running and reachable from the workers.",
    ),
    MarkerCode.ZOMBIE_RECOVERED: (
        "The send was stuck in Sending for too long (its worker stopped or crashed), "
        "so it was put back to retry.",
        "Nothing: it is tried again automatically. The recipient may get it twice if the "
        "first attempt had in fact gone out.",
    ),
    MarkerCode.ZOMBIE_EXHAUSTED: (
        "The send was stuck in Sending with its retries already used up, "
        "so it became a dead letter.",
        "Check the delivery workers and the dead-letter row, fix the cause, then press Retry.",
    ),
    MarkerCode.EXPIRED: (
        "The message was not sent before it expired.",
        "Nothing to fix in the message. Send a new one if it is still wanted.",
    ),
    MarkerCode.RETRY_WINDOW_EXPIRED: (
        "Retries stopped because the time allowed for retrying, counted from the first "
        "attempt, ran out.",
        "Check with the provider whether an earlier attempt was delivered before pressing "
        "Retry: its duplicate protection may no longer cover this message.",
    ),
    MarkerCode.SUPPRESSED: (
        "Not sent: the recipient is on the suppression list (an earlier hard bounce, a "
        "complaint, or added by hand).",
        "If the address or number works again, remove it from the suppression list and "
        "send a new message.",
    ),
    MarkerCode.RESOLVED_FAILED: (
        "The outcome of an earlier attempt was uncertain, and an operator checked with the "
        "provider and marked it failed.",
        "Read the operator's reason; send a new message if it should still go out.",
    ),
}

# Where a marker means something different per channel ("mail" | "sms"): the channel's own words.
CHANNEL_MARKER_HELP: dict[tuple[MarkerCode, str], tuple[str, str]] = {
    (MarkerCode.CONFIG_NOT_RESOLVABLE, "mail"): (
        "No mail server could be used: none is enabled as the default, the one it was "
        "prepared for was deleted or disabled, or the server has neither a from address nor "
        "a username.",
        "Enable a default mail server (or fix the one named in the error), then press Retry.",
    ),
    (MarkerCode.CONFIG_NOT_RESOLVABLE, "sms"): (
        "No SMS provider could be used: none has a route for the recipient's country and "
        "there is no default provider, or the provider it was prepared for was deleted or "
        "disabled.",
        "Add a route for the country or a default SMS provider (or re-enable the one named "
        "in the error), then press Retry.",
    ),
}


def marker_help(marker: MarkerCode, channel: str | None = None) -> tuple[str, str]:
    """(what happened, what to do) for a marker, in the channel's own words where they differ."""
    if channel is not None:
        own = CHANNEL_MARKER_HELP.get((marker, channel))
        if own is not None:
            return own
    return MARKER_HELP[marker]


DEFERRAL_HELP: dict[DeferralCode, tuple[str, str]] = {
    DeferralCode.SERVER_UNAVAILABLE: (
        "The mail server or SMS provider is down: several messages in a row could not even "
        "connect to it, so this one was held back instead of failing too. Holding it back "
        "used none of its retries. The message says since when, and the last error.",
        "Nothing: it goes out by itself once the server answers again (it is checked with "
        "one message at a time, at growing intervals up to 5 minutes). If it stays down, "
        "check the server or provider, or its address in the configuration.",
    ),
    DeferralCode.SERVER_BUSY: (
        "The mail server or SMS provider is slow: all of this worker's senders but one were "
        "waiting on it (or, since its sends time out, the few it may hold then), so this "
        "message waited a few seconds instead of taking another, which stays free for other "
        "servers' messages. It used none of its retries.",
        "Nothing: it is tried again within seconds. If it keeps waiting, the server is slow "
        "to answer: check it, or its timeouts.",
    ),
}

CATEGORY_HELP: dict[ErrorCategory, tuple[str, str]] = {
    ErrorCategory.TRANSIENT: (
        "A temporary fault: the server or provider was unreachable, timed out, or asked us "
        "to try again later.",
        "Nothing: it is tried again automatically, waiting longer each time (about 30 seconds "
        "up to 8 minutes). If it ends as a dead letter, check the server or provider, then "
        "press Retry.",
    ),
    ErrorCategory.QUOTA: (
        "A rate limit or quota refused the send: the provider's, the server's or our own "
        "rate-limit window.",
        "Nothing: it is tried again automatically after at least 5 minutes. If this keeps "
        "happening, raise the limit or spread the sends out.",
    ),
    ErrorCategory.UNKNOWN: (
        "An error we did not recognise.",
        "It is tried again automatically. Read the error message on the record; if it ends "
        "as a dead letter, fix the cause, then press Retry.",
    ),
    ErrorCategory.PERMANENT: (
        "The recipient was refused: no such user or mailbox.",
        "Check the recipient's address or number. Retrying will fail the same way.",
    ),
    ErrorCategory.INVALID_INPUT: (
        "The message or its recipient is invalid: a malformed or missing recipient, a message "
        "that is too large, or content that failed our checks.",
        "Fix the address or the content, then send it again.",
    ),
    ErrorCategory.AUTH: (
        "The server or provider refused our credentials.",
        "Fix the username, password or API key in the server or provider configuration, "
        "then press Retry.",
    ),
    ErrorCategory.CONFIG: (
        "Our own configuration is incomplete: a missing template, server or provider, or "
        "this month's quota is used up.",
        "Complete the configuration or raise the quota (the error code says which), "
        "then press Retry.",
    ),
}


# --- Code rules, in the order they are tried. Codes are compared upper-cased. ---

_MARKER_CATEGORIES: dict[str, ErrorCategory] = {
    MarkerCode.CONFIG_NOT_RESOLVABLE: ErrorCategory.CONFIG,
    MarkerCode.TEMPLATE_NOT_RESOLVABLE: ErrorCategory.CONFIG,
    MarkerCode.MONTHLY_QUOTA_EXCEEDED: ErrorCategory.CONFIG,
    MarkerCode.CONTENT_INVALID: ErrorCategory.INVALID_INPUT,
    MarkerCode.QUOTA_EXCEEDED: ErrorCategory.QUOTA,
    # Before QUOTA's keywords: "LIMIT" is in the name, but this is an outage, not a full window.
    MarkerCode.RATE_LIMIT_UNAVAILABLE: ErrorCategory.TRANSIENT,
    MarkerCode.SUPPRESSED: ErrorCategory.PERMANENT,
    DeferralCode.SERVER_UNAVAILABLE: ErrorCategory.TRANSIENT,
    MarkerCode.RESOLVED_FAILED: ErrorCategory.PERMANENT,
}

# Our SMTP transport reports the server's real reply code ("550 5.1.1 ..."); "SMTP_550" is
# accepted too so that a prefixed reply code is not mistaken for an exception name.
_SMTP_REPLY = re.compile(r"(?:SMTP_)?([2-5]\d\d)(?!\d)")
_SMTP_REPLY_CATEGORIES: dict[str, ErrorCategory] = {
    "421": ErrorCategory.TRANSIENT,
    "450": ErrorCategory.TRANSIENT,
    "451": ErrorCategory.TRANSIENT,
    "452": ErrorCategory.TRANSIENT,
    "550": ErrorCategory.PERMANENT,
    "551": ErrorCategory.PERMANENT,
    "553": ErrorCategory.PERMANENT,
    "552": ErrorCategory.INVALID_INPUT,
    "530": ErrorCategory.AUTH,
    "535": ErrorCategory.AUTH,
}

# "SMTP_" + a Java exception class name, as the seed's Spring system wrote them (imported
# records keep such codes). Any other exception name is UNKNOWN and the message is not read,
# as in the seed: SMTP_MailAuthenticationException is deliberately UNKNOWN.
_SMTP_EXCEPTION = re.compile(r"SMTP_([A-Z_$][\w.$]*)")
_SMTP_EXCEPTION_CATEGORIES: dict[str, ErrorCategory] = {
    "AUTHENTICATIONFAILEDEXCEPTION": ErrorCategory.AUTH,
    "SENDFAILEDEXCEPTION": ErrorCategory.PERMANENT,
    "MESSAGINGEXCEPTION": ErrorCategory.TRANSIENT,
    "MAILSENDEXCEPTION": ErrorCategory.TRANSIENT,
    "MAILEXCEPTION": ErrorCategory.TRANSIENT,
}

# Codes our SMS adapters produce from an HTTP status.
_HTTP_STATUS = re.compile(r"HTTP_(\d{3})")
_HTTP_CATEGORIES: dict[str, ErrorCategory] = {
    "401": ErrorCategory.AUTH,
    "403": ErrorCategory.AUTH,
    "408": ErrorCategory.TRANSIENT,
    "425": ErrorCategory.TRANSIENT,
    "429": ErrorCategory.QUOTA,
    **{str(status): ErrorCategory.TRANSIENT for status in range(500, 600)},
}

_EXACT_CODES: dict[str, ErrorCategory] = {
    "NETWORK_ERROR": ErrorCategory.TRANSIENT,
    "TIMEOUT": ErrorCategory.TRANSIENT,
    # The SMTP transport's own: the server config cannot work as written (no STARTTLS
    # offered where it is required, no usable login method). A retry would not fix it.
    "CONFIG_ERROR": ErrorCategory.CONFIG,
    # The SMTP transport's own: the mail cannot be written as given (an address with a
    # non-ASCII local part to a server without SMTPUTF8). The same on every attempt.
    "INVALID_INPUT": ErrorCategory.INVALID_INPUT,
    # Our SMS adapters' names for provider codes that decide a category (each adapter maps its
    # provider's documented codes onto these; the provider's own code is in the message).
    "SMS_INVALID_RECIPIENT": ErrorCategory.INVALID_INPUT,
    "SMS_INVALID_REQUEST": ErrorCategory.INVALID_INPUT,
    "SMS_RECIPIENT_REFUSED": ErrorCategory.PERMANENT,
    "SMS_AUTH_FAILED": ErrorCategory.AUTH,
    "SMS_ACCOUNT_SUSPENDED": ErrorCategory.AUTH,
    "SMS_SENDER_REJECTED": ErrorCategory.CONFIG,
    "SMS_THROTTLED": ErrorCategory.QUOTA,
    "SMS_CREDIT_EXHAUSTED": ErrorCategory.QUOTA,
    "SMS_PROVIDER_ERROR": ErrorCategory.TRANSIENT,
}

# A provider's own code naming a limit (e.g. "RATE_LIMITED", "DAILY_QUOTA", "THROTTLED").
_CODE_KEYWORDS: tuple[tuple[str, ErrorCategory], ...] = (
    ("LIMIT", ErrorCategory.QUOTA),
    ("QUOTA", ErrorCategory.QUOTA),
    ("THROTTL", ErrorCategory.QUOTA),
)


def _by_marker(code: str) -> ErrorCategory | None:
    return _MARKER_CATEGORIES.get(code)


def _by_smtp_reply(code: str) -> ErrorCategory | None:
    match = _SMTP_REPLY.match(code)
    return _SMTP_REPLY_CATEGORIES.get(match.group(1)) if match else None


def _by_smtp_exception(code: str) -> ErrorCategory | None:
    match = _SMTP_EXCEPTION.fullmatch(code)
    if not match:
        return None
    simple_name = match.group(1).rsplit(".", 1)[-1]  # "jakarta.mail.SendFailedException"
    return _SMTP_EXCEPTION_CATEGORIES.get(simple_name, ErrorCategory.UNKNOWN)


def _by_http_status(code: str) -> ErrorCategory | None:
    match = _HTTP_STATUS.fullmatch(code)
    return _HTTP_CATEGORIES.get(match.group(1)) if match else None


def _by_exact_code(code: str) -> ErrorCategory | None:
    return _EXACT_CODES.get(code)


def _by_code_keyword(code: str) -> ErrorCategory | None:
    return next((cat for word, cat in _CODE_KEYWORDS if word in code), None)


# Markers first: MONTHLY_QUOTA_EXCEEDED contains QUOTA but is a configuration problem.
_CODE_RULES: tuple[Callable[[str], ErrorCategory | None], ...] = (
    _by_marker,
    _by_smtp_reply,
    _by_smtp_exception,
    _by_http_status,
    _by_exact_code,
    _by_code_keyword,
)

# Message keywords, matched lower-cased in this order. Retryable categories come first, as in
# the seed's table: when a message is ambiguous, retrying costs a few attempts, while failing
# a send that would have gone through loses it.
_MESSAGE_KEYWORDS: tuple[tuple[str, ErrorCategory], ...] = (
    ("timeout", ErrorCategory.TRANSIENT),
    ("timed out", ErrorCategory.TRANSIENT),
    ("connection reset", ErrorCategory.TRANSIENT),
    ("connection refused", ErrorCategory.TRANSIENT),
    ("unavailable", ErrorCategory.TRANSIENT),
    ("try again", ErrorCategory.TRANSIENT),
    ("rate limit", ErrorCategory.QUOTA),
    ("too many requests", ErrorCategory.QUOTA),
    ("quota", ErrorCategory.QUOTA),
    ("throttle", ErrorCategory.QUOTA),
    ("no such user", ErrorCategory.PERMANENT),
    ("user unknown", ErrorCategory.PERMANENT),
    ("does not exist", ErrorCategory.PERMANENT),
    ("invalid address", ErrorCategory.INVALID_INPUT),
    ("malformed", ErrorCategory.INVALID_INPUT),
    ("bad recipient", ErrorCategory.INVALID_INPUT),
    ("no recipient", ErrorCategory.INVALID_INPUT),
    ("unauthorized", ErrorCategory.AUTH),
    ("forbidden", ErrorCategory.AUTH),
    ("invalid credentials", ErrorCategory.AUTH),
    ("authentication failed", ErrorCategory.AUTH),
)


def classify_code(code: str | None) -> ErrorCategory | None:
    """The category an error code alone gives, or None when the code is not recognised."""
    normalised = (code or "").strip().upper()
    if not normalised:
        return None
    return next((cat for rule in _CODE_RULES if (cat := rule(normalised)) is not None), None)


def classify_message(message: str | None) -> ErrorCategory | None:
    """The category keywords in an error message give, or None when none is recognised."""
    lowered = (message or "").lower()
    return next((cat for word, cat in _MESSAGE_KEYWORDS if word in lowered), None)


def classify(code: str | None, message: str | None) -> ErrorCategory:
    """Categorise a failure: by its code first, by its message only when the code says nothing."""
    return classify_code(code) or classify_message(message) or ErrorCategory.UNKNOWN


# --- Unavailable: a failure of the server or provider itself, whoever's message it was. ------
# The circuit breaker counts these, and only these (see breaker.py). Every SMS provider kind
# and the SMTP transport go through ``unavailable``: SMTP maps the stage a session failed at
# (connect, TLS, greeting, EHLO, STARTTLS: CONNECT; the login: ANSWERED) to a ``Reach``.


class Reach(StrEnum):
    """How far a failed attempt got, which is what it can tell about the other side."""

    CONNECT = "connect"  # no connection: refused, reset, TLS failed, connect timed out
    REQUEST = "request"  # connected, then reset or timed out while the request was written
    LOCAL = "local"  # stopped on our side (our connection pool, our configuration)
    SENT = "sent"  # the request was complete and no answer came: it may have been accepted
    ANSWERED = "answered"  # the provider answered (an HTTP status, maybe its own code)


# A gateway or proxy in front of the provider answered for it, or the service said it is down.
UNAVAILABLE_HTTP_STATUSES = frozenset({502, 503, 504})

# The providers' own codes documented as "the service is unavailable", by provider kind
# (SmsProviderKind's values), whatever HTTP status they come with. Deliberately not here:
# Twilio 20429 "Too many requests" and 20500 "Internal server error"; Vonage SMS API status 1
# "Throttled" and 10 "Too many existing binds" (limits of our account: QUOTA) and 5 "Internal
# error" (processing this message failed). Vonage's SMS API documents no status for an
# outage: its outages are HTTP 502/503/504 and failed connections.
UNAVAILABLE_PROVIDER_CODES: dict[str, frozenset[str]] = {
    "twilio": frozenset(
        {
            "20503",  # Service unavailable: temporarily unavailable, back off
            "21730",  # System under maintenance, try again later
        }
    ),
    "vonage": frozenset(),
    "http_json": frozenset({"SERVICE_UNAVAILABLE"}),  # our gateway protocol's own
}

# A provider code in one of these categories names a cause of its own (a rate limit, the
# credentials, the recipient), even on a 502/503/504: the provider was there to say so.
_OWN_CAUSE = frozenset(ErrorCategory) - {ErrorCategory.TRANSIENT, ErrorCategory.UNKNOWN}


def unavailable(
    reach: Reach,
    *,
    kind: str | None = None,
    status: int | None = None,
    provider_code: str | None = None,
    code: str | None = None,
) -> bool:
    """Whether a failed attempt says the server or provider itself is unavailable.

    True when no connection could be made or the request could not be written (refused,
    reset, TLS, a timeout before the request was accepted); when the provider answered with
    one of its documented "unavailable" codes (``UNAVAILABLE_PROVIDER_CODES[kind]``); or when
    it answered HTTP 502, 503 or 504 and its own code, if any, names no other cause (``code``
    is our name for that code, what ``classify`` reads: Twilio's 20429 on a 503 is still a
    rate limit). False once the request was complete without an answer (it may have been
    accepted, which says nothing about the provider), and for a failure on our side.
    """
    if reach in (Reach.CONNECT, Reach.REQUEST):
        return True
    if reach is not Reach.ANSWERED:
        return False
    if provider_code is not None and provider_code in UNAVAILABLE_PROVIDER_CODES.get(
        kind or "", frozenset()
    ):
        return True
    if status not in UNAVAILABLE_HTTP_STATUSES:
        return False
    return provider_code is None or classify_code(code or provider_code) not in _OWN_CAUSE
