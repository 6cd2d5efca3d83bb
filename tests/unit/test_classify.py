"""The classifier follows the seed's table: code first, message only when the code says nothing."""

from __future__ import annotations

import pytest

from portal.messaging.sending.classify import (
    CATEGORY_HELP,
    CHANNEL_MARKER_HELP,
    MARKER_HELP,
    ErrorCategory,
    MarkerCode,
    classify,
    is_retryable,
    marker_help,
)

T = ErrorCategory.TRANSIENT
Q = ErrorCategory.QUOTA
U = ErrorCategory.UNKNOWN
P = ErrorCategory.PERMANENT
I = ErrorCategory.INVALID_INPUT  # noqa: E741
A = ErrorCategory.AUTH
C = ErrorCategory.CONFIG

CODE_ROWS = [
    # Marker codes.
    ("CONFIG_NOT_RESOLVABLE", C),
    ("TEMPLATE_NOT_RESOLVABLE", C),
    ("MONTHLY_QUOTA_EXCEEDED", C),  # contains QUOTA, but the marker wins
    ("CONTENT_INVALID", I),
    ("QUOTA_EXCEEDED", Q),
    # SMTP reply codes, bare or followed by the server's text.
    ("421", T),
    ("450", T),
    ("451 4.3.0 Temporary failure", T),
    ("452", T),
    ("550 5.1.1 <x@example.com>: Recipient address rejected", P),
    ("551", P),
    ("553", P),
    ("552 5.3.4 Message size exceeds fixed limit", I),
    ("530 5.7.0 Authentication required", A),
    ("535", A),
    ("SMTP_550", P),
    # SMTP_<ExceptionClassName>, as the seed's Spring system wrote them.
    ("SMTP_AuthenticationFailedException", A),
    ("SMTP_SendFailedException", P),
    ("SMTP_MessagingException", T),
    ("SMTP_MailSendException", T),
    ("SMTP_MailException", T),
    ("SMTP_jakarta.mail.SendFailedException", P),
    ("SMTP_MailAuthenticationException", U),  # the seed: not recognised, so retried
    ("SMTP_SomethingElseException", U),
    # HTTP statuses from our SMS adapters.
    ("HTTP_408", T),
    ("HTTP_425", T),
    ("HTTP_429", Q),
    ("HTTP_500", T),
    ("HTTP_502", T),
    ("HTTP_503", T),
    ("HTTP_599", T),
    ("HTTP_401", A),
    ("HTTP_403", A),
    ("NETWORK_ERROR", T),
    ("TIMEOUT", T),
    ("CONFIG_ERROR", ErrorCategory.CONFIG),
    # A provider's own code naming a limit.
    ("RATE_LIMITED", Q),
    ("daily_quota_reached", Q),
    ("Throttling", Q),
    ("THROTTLED", Q),
]


@pytest.mark.parametrize(("code", "expected"), CODE_ROWS)
def test_code_rows(code: str, expected: ErrorCategory) -> None:
    assert classify(code, None) is expected


MESSAGE_ROWS = [
    ("Read timeout after 30000 ms", T),
    ("connection timed out", T),
    ("Connection reset by peer", T),
    ("Connection refused", T),
    ("Service Unavailable", T),
    ("Please TRY AGAIN later", T),
    ("Rate limit exceeded", Q),
    ("429 Too Many Requests", Q),
    ("monthly quota used up", Q),
    ("request throttled: throttle active", Q),
    ("No such user here", P),
    ("User unknown in virtual mailbox table", P),
    ("Mailbox does not exist", P),
    ("Invalid address: not-an-email", I),
    ("Malformed phone number", I),
    ("Bad recipient address syntax", I),
    ("No recipient given", I),
    ("Unauthorized", A),
    ("403 Forbidden", A),
    ("Invalid credentials for account", A),
    ("Authentication failed", A),
    ("something odd happened", U),
]


@pytest.mark.parametrize(("message", "expected"), MESSAGE_ROWS)
def test_message_rows(message: str, expected: ErrorCategory) -> None:
    assert classify(None, message) is expected


@pytest.mark.parametrize("code", [None, "", "   ", "554", "HTTP_404", "ZOMBIE_RECOVERED", "E42"])
def test_unrecognised_code_falls_back_to_the_message(code: str | None) -> None:
    assert classify(code, "connection timed out") is T
    assert classify(code, "user unknown") is P
    assert classify(code, None) is U


def test_code_wins_over_message() -> None:
    assert classify("550", "try again later") is P
    assert classify("421", "user unknown") is T
    assert classify("CONTENT_INVALID", "timeout") is I
    # An unrecognised SMTP_ exception is a category by itself: the message is not read.
    assert classify("SMTP_MailAuthenticationException", "authentication failed") is U


def test_reply_code_must_be_the_whole_number() -> None:
    assert classify("5500", None) is U
    assert classify("4210", None) is U


def test_codes_are_case_insensitive() -> None:
    assert classify("content_invalid", None) is I
    assert classify("http_429", None) is Q
    assert classify(" TIMEOUT ", None) is T


def test_message_order_prefers_retrying_when_ambiguous() -> None:
    assert classify(None, "authentication failed, try again") is T


@pytest.mark.parametrize(
    ("category", "retryable"),
    [(T, True), (Q, True), (U, True), (P, False), (I, False), (A, False), (C, False)],
)
def test_is_retryable(category: ErrorCategory, retryable: bool) -> None:
    assert is_retryable(category) is retryable


def test_every_marker_and_category_has_help() -> None:
    assert set(MARKER_HELP) == set(MarkerCode)
    assert set(CATEGORY_HELP) == set(ErrorCategory)
    for what, todo in [*MARKER_HELP.values(), *CATEGORY_HELP.values()]:
        assert what.endswith(".")
        assert todo.endswith(".")


def test_config_not_resolvable_speaks_of_the_channels_own_configuration() -> None:
    mail_what, mail_todo = marker_help(MarkerCode.CONFIG_NOT_RESOLVABLE, "mail")
    sms_what, sms_todo = marker_help(MarkerCode.CONFIG_NOT_RESOLVABLE, "sms")
    assert "mail server" in mail_what
    assert "SMS" not in mail_what + mail_todo
    assert "SMS provider" in sms_what
    assert "route" in sms_todo
    assert "mail" not in (sms_what + sms_todo).lower()
    for what, todo in CHANNEL_MARKER_HELP.values():
        assert what.endswith(".")
        assert todo.endswith(".")
    # A marker with no channel's own words reads the same on both.
    same = MARKER_HELP[MarkerCode.EXPIRED]
    assert marker_help(MarkerCode.EXPIRED, "sms") == marker_help(MarkerCode.EXPIRED) == same


def test_enums_are_stored_as_their_names() -> None:
    assert MarkerCode.QUOTA_EXCEEDED == "QUOTA_EXCEEDED"
    assert str(ErrorCategory.TRANSIENT) == "TRANSIENT"
